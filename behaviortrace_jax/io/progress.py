"""``grpo/progress.json``: where a running GRPO loop stands, rewritten after every step.

The grpo stage writes it (:func:`progress_record`, ``files.write_json``: atomic, so a reader sees
the previous or the next version, never half of one); the ``status`` stage reads it
(:func:`read_progress`, :func:`eta_seconds`) while the run goes on. It holds times, so it is not a
result: no digest covers it and no number of the run depends on it.
"""
from __future__ import annotations

import os
import statistics
from typing import Any

from behaviortrace_jax.io.files import read_json

PROGRESS_WINDOW = 50  # step times kept (the ETA uses their median)


def progress_record(previous: dict | None, *, step: int, steps: int, start_step: int, started: float,
                    step_s: float, metrics: dict[str, Any], checkpoint: dict | None,
                    checkpoint_every: int, now: float) -> dict[str, Any]:
    """The record after GRPO step ``step - 1`` (``step`` steps done of ``steps``).

    Fields: ``step``, ``steps``, ``start_step`` (where this invocation began), ``started`` /
    ``updated`` (unix seconds), ``step_s`` (this invocation's last :data:`PROGRESS_WINDOW` step
    times, seconds, checkpoints excluded), ``checkpoint_s`` (the last checkpoint's seconds, None
    before one), ``checkpoint_every``, ``last_checkpoint`` (its step; a resumed run's start step
    before its first), ``metrics`` (the step's scalars). ``previous``: this invocation's last record
    (None at its first step), whose step times and checkpoint carry over; ``checkpoint``:
    ``{"step", "seconds"}`` when this step ended with one.
    """
    prev = previous or {}
    out = {"stage": "grpo", "step": int(step), "steps": int(steps), "start_step": int(start_step),
           "started": float(started), "updated": float(now),
           "step_s": [*prev.get("step_s", []), float(step_s)][-PROGRESS_WINDOW:],
           "checkpoint_s": prev.get("checkpoint_s"), "checkpoint_every": int(checkpoint_every),
           "last_checkpoint": prev.get("last_checkpoint", int(start_step) or None), "metrics": dict(metrics)}
    if checkpoint is not None:
        out["checkpoint_s"], out["last_checkpoint"] = float(checkpoint["seconds"]), int(checkpoint["step"])
    return out


def eta_seconds(progress: dict) -> float | None:
    """Seconds left of the run of ``progress`` (a :func:`progress_record`): the steps left times the
    median step time, plus the checkpoints left (every ``checkpoint_every`` steps and at the last)
    times the last checkpoint's time. None when no step time is recorded."""
    times = progress.get("step_s") or []
    if not times:
        return None
    step, steps = int(progress["step"]), int(progress["steps"])
    every = max(int(progress.get("checkpoint_every") or 1), 1)
    ckpts_left = steps // every - step // every + int(steps % every != 0 and step < steps)
    return max(steps - step, 0) * statistics.median(times) + ckpts_left * float(progress.get("checkpoint_s") or 0.0)


def read_progress(path: str | os.PathLike) -> dict | None:
    """The record at ``path``; None when it is absent, unreadable or not a record (never raises
    for a file another process is replacing)."""
    try:
        rec = read_json(path, None)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and {"step", "steps", "updated"} <= set(rec) else None
