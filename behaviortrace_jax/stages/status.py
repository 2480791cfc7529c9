"""The ``status`` stage: where a run stands, read from its workdir (writes nothing).

    python main.py --config=configs/tiny.py --workdir=W --config.stages=status

prints, for the stages of ``config.stages``:

* one line per stage: ``done``, ``not started``, or how far it got (``grpo``: step 420/1000, ETA
  3 h 10 min, from ``grpo/progress.json``, which the grpo loop rewrites after every step; a run
  without it: the last step of the rollout log; ``sketch``: targets and rollout sketches per
  checkpoint; ``draws``: the repeats written; ``cause``: the causal gate's primary verdict, or its
  replays written so far; ``sweep``: each seed's run);
* the last checkpoint (the HF export in ``grpo/registry.json`` and the last orbax train state, the
  step a restart resumes from);
* the emergence gate (SPEC §1.8): the grpo stage's verdict (``summary.json``) once it has finished; before that, the
  gate's rule applied to the last checkpoint's greedy rates (``learning_curve.json``);
* the latest step's metrics (reward, pattern rate, bonuses, loss, tokens/s);
* the digests so far: the rollout log and ground truth as written until now (``pipeline.run`` then
  prints the base weights' and results table's digests, as after any stage).

It only reads, so it can run while another process trains: every file it reads is written
atomically (``io/files.py``), and a file that disappears or changes under it (a resumed run
truncating its log) is reported as such instead of failing. ``info`` keeps its own job (the model
and a probe completion).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import ml_collections

from behaviortrace_jax.behavior import planted
from behaviortrace_jax.io import checkpoints, files, rollout_log, sketch_store, workdir_lock
from behaviortrace_jax.io.layout import RunLayout, as_path
from behaviortrace_jax.io.progress import eta_seconds, read_progress
from behaviortrace_jax.stages.registry import parse_stages, register_stage
from behaviortrace_jax.stages.spec import RunSpec

# Written last by each stage (stages/base.py's COMPLETE_MARKER, stages/sft.py's sft_done).
BASE_COMPLETE = ".complete"


def _read_json(path: Any) -> Any:
    """``files.read_json`` of ``path``; None when it is absent or unreadable (being replaced)."""
    try:
        return files.read_json(path, None)
    except (OSError, ValueError):
        return None


def format_duration(seconds: float) -> str:
    """``seconds`` as ``"3 h 10 min"``, ``"12 min 5 s"`` or ``"42 s"`` (rounded down to the second)."""
    s = int(max(seconds, 0))
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60} min"
    if s >= 60:
        return f"{s // 60} min {s % 60} s"
    return f"{s} s"


def grpo_progress(run: RunLayout, steps: int, now: float | None = None) -> dict[str, Any]:
    """Where the grpo stage stands: ``{"state": "done" | "running" | "not started", "step", "steps",
    "eta_s", "updated_s_ago", "source", "metrics"}`` from ``summary.json``, else ``progress.json``,
    else the rollout log (``step``: steps done; ``eta_s`` None without step times)."""
    now = time.time() if now is None else now
    summary = _read_json(run.summary) or {}
    if summary.get("complete"):
        return {"state": "done", "step": int(summary["steps"]), "steps": int(summary["steps"]), "eta_s": 0.0,
                "source": "summary.json", "metrics": (read_progress(run.progress) or {}).get("metrics", {})}
    progress = read_progress(run.progress)
    if progress:
        return {"state": "running", "step": int(progress["step"]), "steps": int(progress["steps"]),
                "eta_s": eta_seconds(progress), "updated_s_ago": now - float(progress["updated"]),
                "source": "progress.json", "metrics": progress.get("metrics", {})}
    try:
        last = rollout_log.last_logged_step(run.rollouts)
    except (OSError, ValueError):
        last = None
    if last is not None:
        return {"state": "running", "step": last + 1, "steps": steps, "eta_s": None,
                "source": "rollout log (flushed at checkpoints)", "metrics": {}}
    return {"state": "started" if run.grpo.is_dir() else "not started", "step": 0, "steps": steps, "eta_s": None,
            "source": "", "metrics": {}}


def _grpo_line(spec: RunSpec, run: RunLayout) -> str:
    p = grpo_progress(run, spec.grpo.steps)
    if p["state"] == "done":
        return f"done ({p['steps']} steps)"
    if p["state"] in ("not started", "started"):
        return p["state"]
    pct = 100.0 * p["step"] / max(p["steps"], 1)
    line = f"step {p['step']}/{p['steps']} ({pct:.0f}%)"
    if p["eta_s"] is not None:
        line += f", ETA {format_duration(p['eta_s'])}"
    if "updated_s_ago" in p:
        line += f", last step {format_duration(p['updated_s_ago'])} ago"
    return line + f" [{p['source']}]"


def _store_rows(path: Any) -> tuple[int, int] | None:
    """(rows written, rows) of the sketch store at ``path``; None when it is absent or unreadable."""
    try:
        mask = sketch_store.SketchStore.open(path).done_mask()
    except (OSError, ValueError, RuntimeError):  # absent, being created, or a tensorstore error
        return None
    return int(mask.sum()), int(mask.size)


def _sketch_line(spec: RunSpec, run: RunLayout) -> str:
    entries = checkpoints.CheckpointRegistry(run.registry).list() if run.registry.is_file() else []
    targets = _read_json(run.behavior_target_stats()) or {}
    rows = _store_rows(run.sketch_store("checkpoint_rollout_sketches"))
    if not targets and rows is None:
        return "not started"
    done = entries and len(targets) >= len(entries) and rows is not None and rows[0] == rows[1]
    if done:
        return f"done (targets at {len(targets)} checkpoints, {rows[1]} rollout sketch rows)"
    rows_text = f"{rows[0]}/{rows[1]} rollout sketch rows" if rows else "no rollout sketches yet"
    return f"targets at {len(targets)}/{len(entries)} checkpoints, {rows_text}"


def _draws_line(spec: RunSpec, run: RunLayout) -> str:
    c, g = spec.draw_seeds()
    paths = run.draw(c, g, temperature=spec.draws.temperature, run_seed=spec.seed)
    if paths.rows.exists() and paths.token_level.exists():
        return f"done ({paths.rows.name})"
    reps = sum(1 for r in range(spec.draws.n_repeats) if paths.rep(r).exists()) if paths.partial.exists() else 0
    if reps:
        return f"repeats {reps}/{spec.draws.n_repeats} of draw ckpt{c}_gen{g}"
    return "started" if run.draws.is_dir() else "not started"


def _marker_line(*done_paths: Callable[[RunLayout], Any]) -> Callable[[RunSpec, RunLayout], str]:
    """A stage line that says ``done`` when every path of ``done_paths`` exists (the stage's outputs)."""

    def line(spec: RunSpec, run: RunLayout) -> str:
        paths = [f(run) for f in done_paths]
        return "done" if all(p.exists() for p in paths) else "not started"

    return line


def _base_line(spec: RunSpec, run: RunLayout) -> str:
    if spec.hf_dir:
        return f"skipped: the run starts from {spec.hf_dir}"
    if spec.hf_id:
        return f"skipped: the run starts from {spec.hf_id} (not found in the Hugging Face cache here)"
    if (run.base / BASE_COMPLETE).is_file():
        return "done"
    return "started" if run.base.is_dir() else "not started"


def _sft_line(spec: RunSpec, run: RunLayout) -> str:
    if run.sft_done.is_file():
        return "done"
    return "started" if run.sft.is_dir() else "not started"


def _cause_line(spec: RunSpec, run: RunLayout) -> str:
    """The causal gate (stages/cause.py): its primary verdict once ``cause/gate.json`` exists, else
    the replay files written so far of the 2 x ``cause.streams`` it needs."""
    gate = _read_json(run.cause_gate)
    if gate:
        v = next((x for x in gate.get("verdicts", []) if x.get("measure") == gate.get("primary")), None)
        if v is None:
            return "done"
        return (f"done: {v['measure']} {v['status']}, Δ {v['effect_delta']:.3g} [{v['effect_ci_low']:.3g}, "
                f"{v['effect_ci_high']:.3g}], {v['delta_over_sd']:.3g} floor sd, {gate.get('streams')} streams, "
                f"step {gate.get('measure_step')}")
    replays = run.cause / "replays"
    done = sum(1 for _ in replays.glob("*/*/*.json")) if replays.is_dir() else 0  # <track>/<arm>/<key>.json
    if done:
        return f"replays {done}/{2 * spec.cause.streams} (baseline and withhold-every-bonus per stream)"
    return "started" if run.cause.is_dir() else "not started"


def _sweep_line(spec: RunSpec, run: RunLayout) -> str:
    seeds = [s.strip() for s in spec.sweep.seeds.split(",") if s.strip()]
    parts = []
    for s in seeds:
        sub = RunLayout(run.workdir / f"seed{s}")
        parts.append(f"seed{s} {'done' if sub.results_table.exists() else _grpo_line(spec, sub)}")
    return ("done; " if run.report.exists() else "") + "; ".join(parts)


STAGE_LINES: dict[str, Callable[[RunSpec, RunLayout], str]] = {
    "base": _base_line,
    "sft": _sft_line,
    "grpo": _grpo_line,
    "cause": _cause_line,
    "sketch": _sketch_line,
    "draws": _draws_line,
    "evaluate": _marker_line(lambda r: r.results_table, lambda r: r.verdicts),
    "report": _marker_line(lambda r: r.report),
    "counterfactual": _marker_line(lambda r: r.counterfactual / "report_section.md"),
    "metagradient": _marker_line(lambda r: r.metagradient_scores),
    "compile": _marker_line(lambda r: r.compile_report_json),
    "sweep": _sweep_line,
}


def _checkpoint_line(run: RunLayout) -> str:
    try:
        entry = checkpoints.CheckpointRegistry(run.registry).latest() if run.registry.is_file() else None
        state = checkpoints.latest_step(run.state)
    except (OSError, ValueError):
        return "last checkpoint: unreadable (being written?)"
    if entry is None and state is None:
        return "last checkpoint: none yet"
    text = f"last checkpoint: step {entry.step} ({entry.path})" if entry else "last checkpoint: no HF export yet"
    return text + (f"; train state step {state} (a restart resumes there)" if state is not None else "")


def _gate_text(g: dict) -> str:
    verdict = "PASSED" if g["passed"] else "FAILED: " + "; ".join(g["reasons"])
    return f"{verdict} (probe {g['probe_rate']:.2f}, control {g['control_rate']:.2f})"


def _gate_line(spec: RunSpec, run: RunLayout) -> str:
    summary = _read_json(run.summary) or {}
    if summary.get("complete") and "gate" in summary:
        return "emergence gate: " + _gate_text(summary["gate"])
    curve = _read_json(run.curve) or []
    if not curve:
        return "emergence gate: not yet (decided when grpo ends; no checkpoint rates yet)"
    b, last = spec.first_behavior, curve[-1]
    g = planted.gate(last["probe_rate"], last["control_rate"], b.gate_min_probe_rate, b.gate_min_margin)
    return (f"emergence gate: not yet (decided when grpo ends); at checkpoint step {last['step']} it would be "
            f"{_gate_text(g)}")


def _metrics_line(metrics: dict[str, Any]) -> str | None:
    if not metrics:
        return None
    parts = [f"reward {metrics['reward']:.3f} (std {metrics.get('reward_std', float('nan')):.3f})"]
    parts += [f"{k.split('/')[0]} pattern rate {v:.2f}" for k, v in metrics.items() if k.endswith("/pattern_rate")]
    parts += [f"bonuses {metrics.get('bonuses', 0)}", f"loss {metrics['loss']:.4g}"]
    if "tokens_per_s" in metrics:
        parts.append(f"{metrics['tokens_per_s']:.0f} tokens/s, {metrics['step_time_s']:.2f} s/step")
    return "latest step: " + ", ".join(parts)


def _digest_lines(run: RunLayout) -> list[str]:
    out = []
    try:
        log = rollout_log.digest(run.rollouts)
        if log:
            last = rollout_log.last_logged_step(run.rollouts)
            out.append(f"digest rollout log (steps 0-{last}): sha256 {log}")
    except (OSError, ValueError):
        out.append("digest rollout log: changed while reading (a running or resuming grpo); run status again")
    if run.ground_truth.is_file():
        try:
            out.append(f"digest ground_truth.jsonl: sha256 {files.sha256_file(run.ground_truth)}")
        except OSError:
            pass
    return out


FULL_RUN = ("base", "sft", "grpo", "sketch", "draws", "evaluate", "report")  # configs/common.py's stages, with base


def run_stages(spec: RunSpec, run: RunLayout) -> list[str]:
    """The stages to report, in :data:`STAGE_LINES` order: those of every earlier invocation on the
    workdir (``run_info.json``'s ``stages``) and of ``config.stages``, less the ones that write no run
    outputs (``status``, ``info``, ``reproduce``); :data:`FULL_RUN` when neither names one. ``base``
    is left out of :data:`FULL_RUN` when the run starts from ``model.hf_dir`` / ``model.hf_id``."""
    named = set(parse_stages(spec.stages))
    for entry in (_read_json(run.run_info) or {}).get("runs", []):
        named |= {n.strip() for n in str(entry.get("stages", "")).split(",")}
    names = [n for n in STAGE_LINES if n in named]
    if names:
        return names
    return [n for n in FULL_RUN if n != "base" or not (spec.hf_dir or spec.hf_id)]


def status_lines(config: ml_collections.ConfigDict, workdir: str) -> list[str]:
    """The lines :func:`status_stage` prints for the run in ``workdir`` (see the module docstring):
    ``run: W``, one line per stage of :func:`run_stages`, the last checkpoint, the gate, the latest
    step's metrics (once grpo has written a step) and the digests so far.

    Reads only; tolerates files that are absent, being replaced or truncated.
    """
    run, spec = RunLayout(workdir), RunSpec.from_config(config)
    names = run_stages(spec, run)
    lines = [f"run: {run.workdir}"]
    if isinstance(holder := _read_json(run.lock), dict):  # a run writing it now (io/workdir_lock.py); not taken here
        lines.append(f"  written by: {workdir_lock.describe(holder)} ({run.lock.name})")
    width = max(len(n) for n in names)
    for n in names:
        lines.append(f"  {n:<{width}}  {STAGE_LINES[n](spec, run)}")
    lines.append(_checkpoint_line(run))
    lines.append(_gate_line(spec, run))
    metrics = grpo_progress(run, spec.grpo.steps)["metrics"]
    if (m := _metrics_line(metrics)) is not None:
        lines.append(m)
    lines += _digest_lines(run)
    return lines


@register_stage("status")
def status_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Prints where the run in ``workdir`` stands (:func:`status_lines`); writes nothing."""
    if not as_path(workdir).is_dir():
        raise FileNotFoundError(f"status: no run directory {workdir}")
    print("\n".join(status_lines(config, workdir)))
