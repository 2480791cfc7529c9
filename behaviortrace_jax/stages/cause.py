"""The ``cause`` stage: the causal gate of a finished GRPO run (did the planted cause act?).

The paper's gate (SPEC §1.8) checks that the behaviour exists; this one checks that the bonus
caused it. With the replay engine (``train/replay.py``, ``train/replay_runner.py``), per sampler
stream j = 0 .. ``cause.streams`` - 1 (track ``regenerated<j>``: rollouts sampled from the
replayed policy, the run's reward and contaminator, stream j's sampler keys):

* the no-intervention baseline, and
* ``withhold-bonus`` on every rollout slot of the contamination window (every bonus the
  regenerated rollouts earn there is withheld; its base reward kept),

both measured at ``cause.measure_step`` ("end", "window" or a step number) with the registered
measures ``cause.measures`` (``probe-rate`` and ``leakage`` with ``cause.samples`` completions per
prompt). The two arms of a stream share the stream's sampling keys (the measures' ``stream``
setting), the streams have independent keys, so the comparison is paired
(``attribution/causal_gate.py``: Δ = baseline - withheld per stream, its t interval over streams,
the baseline's noise floor and the minimum detectable effect). ``cause.primary`` (an output, e.g.
``probe_rate``) decides "acted" / "not detected"; a run whose cause did not act says that its
attribution tables score methods against a label, not a cause (``causal_gate.LABEL_NOT_CAUSE``).

Outputs: ``cause/gate.json`` (every verdict, the per-stream values, the console lines),
``cause/results_rows.csv`` (tables ``causal_gate[<output>]``, merged into ``results_table.csv``,
``attribution/stage_outputs.py``), ``cause/report_section.md`` (rendered by the ``report``
stage, re-run here when ``report.md`` exists). The console gets the gate's lines. Resumable: each
replay is one atomic, keyed file under ``cause/replays/`` (a rerun reads them back and replays
only missing or stale ones); the gate is recomputed from them on every run.

In the tiny default's stages right after ``grpo`` (``configs/tiny.py``; its sweeps run it per
seed); other configs add it to ``config.stages`` (at paper scale it costs about
``2 * cause.streams * cause.measure_step`` GRPO steps with sampling). Without it, the report says
the gate was not measured (``causal_gate.NOT_MEASURED``).
"""
from __future__ import annotations

import math

import ml_collections
import numpy as np
from absl import logging

from behaviortrace_jax.attribution import causal_gate, stage_outputs
from behaviortrace_jax.io.files import write_json
from behaviortrace_jax.io.layout import RunLayout
from behaviortrace_jax.io.replay_request import ReplayRequest, Track
from behaviortrace_jax.stages.registry import load_stages, register_stage
from behaviortrace_jax.stages.spec import RunSpec

# The outputs of a registered measure that the gate tests (their standard errors and counts are
# read beside them). A measure not named here is recorded (gate.json's values) but not gated, unless
# no configured measure is named here: then every float is gated.
GATED_OUTPUTS = {"probe-rate": ("probe_rate",), "probe-pair": ("probe_pair_logratio",),
                 "leakage": ("leakage_rate", "leakage_pair_logratio"), "logp_margin": ("logp_margin",),
                 "logp_probe": ("logp_probe",), "logp_control": ("logp_control",),
                 "greedy_rate": ("probe_rate", "control_rate"),
                 "sampled_rate": ("sampled_probe_rate", "sampled_control_rate")}
# Outputs whose expected sign under the bonus is not "up": leakage is reported, either sign counts.
EITHER_SIGN = ("leakage_rate", "leakage_pair_logratio", "control_rate", "sampled_control_rate", "logp_control")
SAMPLED = ("probe-rate", "leakage")  # measures that take the samples / stream settings


def split(value: str) -> list[str]:
    """A comma list of names, stripped, empty ones dropped."""
    return [s.strip() for s in str(value).split(",") if s.strip()]


def measure_step(spec: RunSpec) -> int:
    """``cause.measure_step``: "end" = the run's end, "window" = the window's end, or a step in
    1..steps. Raises ValueError naming the key for another value."""
    v, steps = spec.cause.measure_step.strip(), spec.schedule.steps
    if v in ("end", "window"):
        return spec.schedule.measure_step(v)
    if not v.isdigit() or not 1 <= int(v) <= steps:
        raise ValueError(f"config.cause.measure_step={v!r}; expected 'end', 'window' or a step in 1..{steps}")
    return int(v)


def settings(names: list[str], samples: int, stream: int) -> dict:
    """The measures' settings of sampler stream ``stream`` (the sampled ones' key is the stream's)."""
    return {n: {"samples": samples, "stream": stream} for n in names if n in SAMPLED}


def check_options(spec: RunSpec) -> list[str]:
    """The configured measure names, checked with every ``cause`` key before any replay. Raises
    ValueError naming the key."""
    from behaviortrace_jax.train import measures

    ck = spec.cause
    if ck.streams < 2:
        raise ValueError(f"config.cause.streams={ck.streams}: the gate's CI needs >= 2 sampler streams")
    if ck.samples < 1:
        raise ValueError(f"config.cause.samples={ck.samples}: must be >= 1")
    names = split(ck.measures)
    bad = [n for n in names if n not in measures.MEASURES]
    if not names or bad:
        raise ValueError(f"config.cause.measures={ck.measures!r}: {bad or 'empty'}; registered: {sorted(measures.MEASURES)}")
    measure_step(spec)
    return names


def gated_outputs(names: list[str], floats: dict) -> list[str]:
    """The outputs the gate tests, in measure order (:data:`GATED_OUTPUTS`)."""
    return list(dict.fromkeys(o for n in names for o in GATED_OUTPUTS.get(n, ()) if o in floats)) or sorted(floats)


@register_stage("cause")
def cause_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
    """The causal gate of the run in ``workdir`` (see the module docstring)."""
    from behaviortrace_jax.train import measures as measures_lib, replay as R, replay_runner

    w = RunLayout(workdir)
    spec = RunSpec.from_config(config)
    ck = spec.cause
    names = check_options(spec)
    at = measure_step(spec)
    out_dir = w.cause
    rp = R.Replayer(spec.replay, workdir, layout=spec.layout, measures=names,
                    measure_settings=settings(names, ck.samples, 0))
    n = rp.shapes.num_rollouts
    window = np.arange(min(spec.schedule.window_steps(), at) * n, dtype=np.int64)
    logging.info("cause: baseline and withhold-every-bonus (%d window slots), regenerated, %d streams, measured at "
                 "step %d: %d replayed steps", window.size, ck.streams, at, 2 * ck.streams * at)
    values: dict[str, dict[int, dict]] = {"baseline": {}, "withheld": {}}
    for j in range(ck.streams):
        track = Track("regenerated", j)
        # the stream's own sampling keys for both arms (the measures' settings, so in each replay's cache key)
        rp.measures = measures_lib.MeasureSet(rp.measures.env, names, settings(names, ck.samples, j))
        base = ReplayRequest(track, measure_steps=(at,), measures=tuple(names))
        cut = ReplayRequest(track, "withhold-bonus", window, measure_steps=(at,), measures=tuple(names))
        got = replay_runner.run_requests(rp, [base, cut], out_dir / "replays", name=f"cause stream {j}")
        b = got[base]["measures"][str(at)]
        # a withheld arm that changes nothing in the track's rollouts is the baseline (replay_runner: skipped)
        values["baseline"][j] = b
        values["withheld"][j] = b if got[cut].get("skipped") else got[cut]["measures"][str(at)]
    streams = range(ck.streams)
    outputs = gated_outputs(names, values["baseline"][0])
    if ck.primary not in outputs:
        raise ValueError(f"config.cause.primary={ck.primary!r} is not a gated output of cause.measures "
                         f"{names}: {outputs}")
    col = lambda arm, o: [float(values[arm][j][o]) for j in streams]  # noqa: E731
    se = {o: col("baseline", o + "_se") for o in outputs
          if o + "_se" in values["baseline"][0] and all(math.isfinite(x) for x in col("baseline", o + "_se"))}
    report = causal_gate.gate_measures({o: col("baseline", o) for o in outputs}, {o: col("withheld", o) for o in outputs},
                                       primary=ck.primary, sampling_se=se, paired=True,
                                       expected_signs={o: 0 if o in EITHER_SIGN else 1 for o in outputs})
    lines = report.lines()
    write_json(w.cause_gate, {
        "acted": report.acted, "primary": report.primary, "measure_step": at, "streams": ck.streams,
        "design": "paired", "measures": names, "samples_per_prompt": ck.samples, "window_slots": int(window.size),
        "lines": lines, "verdicts": [v.as_dict() for v in report.verdicts],
        "values": {arm: {o: col(arm, o) for o in sorted(values[arm][0])} for arm in values}})
    stage_outputs.publish_rows(w, "cause", causal_gate.gate_rows(str(spec.seed), report))
    stage_outputs.write_section(w, "cause", causal_gate.report_section(report, step=at, streams=ck.streams))
    for ln in lines:
        logging.info("cause: %s", ln)
        print(ln, flush=True)
    if w.report.exists() and w.verdicts.exists():  # the report stage renders the section
        load_stages()["report"](config, str(w.workdir))
