"""The ``cause`` stage (the causal gate) on the shared smoke run: two regenerated sampler streams,
baseline against withholding every bonus; its gate.json, ``causal_gate[...]`` rows, report section
and console lines agree with the causal gate recomputed from the replay files it recorded; a rerun
replays nothing and writes the same gate; bad ``cause`` keys are refused by name."""
from __future__ import annotations

import json
import shutil

import pytest

from behaviortrace_jax.attribution import causal_gate as G, formats


def _config(streams: int = 2, samples: int = 2):
    from configs import tiny

    c = tiny.get_config("smoke")
    c.stages = "cause"
    c.cause.streams, c.cause.samples = streams, samples
    return c


def _recorded(w, streams: int, step: int) -> dict[str, list[dict]]:
    """Each stream's baseline and withheld floats read from the replay files (a skipped withheld
    replay changed nothing: its values are the baseline's)."""
    out: dict[str, list[dict]] = {"baseline": [], "withheld": []}
    for j in range(streams):
        track = w / "cause" / "replays" / f"regenerated{j}"
        (b,), (c,) = list((track / "base").glob("*.json")), list((track / "withhold-bonus").glob("*.json"))
        b, c = json.loads(b.read_text()), json.loads(c.read_text())
        out["baseline"].append(b["measures"][str(step)])
        out["withheld"].append(out["baseline"][-1] if c["skipped"] else c["measures"][str(step)])
    return out


@pytest.mark.slow
def test_the_cause_stage_gate_agrees_with_its_recorded_replays_and_resumes(smoke_finished, tmp_path, capsys):
    from behaviortrace_jax import pipeline
    from behaviortrace_jax.stages import cause

    w = tmp_path / "run"
    shutil.copytree(smoke_finished, w, ignore=shutil.ignore_patterns("counterfactual", "cause", ".jax_cache"))
    config = _config()
    pipeline.run(config, str(w))
    printed = capsys.readouterr().out
    gate = json.loads((w / "cause" / "gate.json").read_text())
    assert gate["primary"] == "probe_rate" and gate["streams"] == 2 and gate["design"] == "paired"
    assert gate["measure_step"] == 6 and gate["measures"] == ["probe-rate", "probe-pair", "leakage", "logp_margin"]
    outputs = [v["measure"] for v in gate["verdicts"]]
    assert outputs == ["probe_rate", "probe_pair_logratio", "leakage_rate", "leakage_pair_logratio", "logp_margin"]
    # the gate recomputed from the replay files the stage recorded
    rec = _recorded(w, 2, gate["measure_step"])
    col = lambda arm, o: [r[o] for r in rec[arm]]  # noqa: E731
    se = {o: col("baseline", o + "_se") for o in ("probe_rate", "leakage_rate")}
    want = G.gate_measures({o: col("baseline", o) for o in outputs}, {o: col("withheld", o) for o in outputs},
                           primary="probe_rate", sampling_se=se, paired=True,
                           expected_signs={o: 0 if o in cause.EITHER_SIGN else 1 for o in outputs})
    assert gate["acted"] == want.acted and gate["lines"] == want.lines()
    for got, v in zip(gate["verdicts"], want.verdicts):
        assert got["status"] == v.status and got["effect_delta"] == pytest.approx(v.effect.delta, abs=1e-12)
        assert got["floor_sd"] == pytest.approx(v.floor.sd, abs=1e-12) and got["mde"] == pytest.approx(v.mde)
    assert gate["values"]["baseline"]["probe_rate"] == col("baseline", "probe_rate")
    # withholding every bonus changed each stream's run; the sampled rates used cause.samples per prompt
    assert all(any(rec["baseline"][j][o] != rec["withheld"][j][o] for o in outputs) for j in range(2))
    assert col("baseline", "probe_rate_samples_per_prompt") == [2.0, 2.0]
    # console: the primary measure's line first, the label warning iff the cause did not act
    lines = [ln for ln in printed.splitlines() if ln.startswith(("the planted cause", "also ", G.LABEL_NOT_CAUSE))]
    assert lines == want.lines()
    assert lines[0].startswith("the planted cause acted: Δ = " if want.acted else
                               ("the planted cause did not act (not detected): Δ = ",
                                "the planted cause did not act as planted (reversed"))
    assert (G.LABEL_NOT_CAUSE in lines) == (not want.acted) and "2 streams" in lines[0]
    # rows: causal_gate[<output>] in the stage's own rows and in results_table.csv
    rows = {(r.table, r.method): r for r in formats.read_results_csv(w / "results_table.csv")}
    for v in want.verdicts:
        t = f"causal_gate[{v.measure}]"
        assert rows[(t, "delta")].value == pytest.approx(v.effect.delta, abs=1e-4) and rows[(t, "delta")].n == 2
        assert rows[(t, "baseline-sd")].value == pytest.approx(v.floor.sd, abs=1e-4)
        assert rows[(t, "acted")].value == {G.ACTED: 1.0, G.NOT_DETECTED: 0.0, G.REVERSED: -1.0}[v.status]
    assert formats.read_results_csv(w / "cause" / "results_rows.csv")
    section = (w / "cause" / "report_section.md").read_text()
    assert want.lines()[0] in section and "| probe_rate (primary) |" in section
    assert "The causal gate" in (w / "report.md").read_text()
    # rerun: every replay is read back (no file rewritten) and the gate is the same
    files = sorted((w / "cause" / "replays").rglob("*.json"))
    mtimes = [p.stat().st_mtime_ns for p in files]
    pipeline.run(config, str(w))
    assert [p.stat().st_mtime_ns for p in files] == mtimes
    assert json.loads((w / "cause" / "gate.json").read_text()) == gate


def test_bad_cause_keys_are_refused_by_name():
    from behaviortrace_jax.stages import cause
    from behaviortrace_jax.stages.spec import RunSpec

    for key, value, match in (("streams", 1, "cause.streams=1"), ("measures", "probe-rat", "cause.measures"),
                              ("measure_step", "40x", "cause.measure_step"), ("samples", 0, "cause.samples=0")):
        c = _config()
        c.cause[key] = value
        with pytest.raises(ValueError, match=match):
            cause.check_options(RunSpec.from_config(c))
    assert cause.measure_step(RunSpec.from_config(_config())) == 6
    c = _config()
    c.cause.measure_step = "3"
    assert cause.measure_step(RunSpec.from_config(c)) == 3
    assert cause.gated_outputs(["probe-rate", "leakage"], {"probe_rate": 0.1, "probe_rate_se": 0.0,
                                                           "leakage_rate": 0.0, "leakage_pair_logratio": 1.0}) == \
        ["probe_rate", "leakage_rate", "leakage_pair_logratio"]
