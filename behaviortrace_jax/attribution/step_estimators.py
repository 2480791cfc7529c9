"""The step-level estimators on sketched gradients (SPEC §4), registered by name: C1-dot, C1-cosine
(GAS), TRAK, the norm-only control, local-buffer, TracInCP, the random control and the metagradient
baseline. Each takes step (or per-rollout) sketches float32 [S, D] and returns one float64 score per
row (``per="key"``) or per rollout (``per="rollout"``); the plug-in API is ``estimators.py``'s.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from behaviortrace_jax.attribution.estimator_registry import (STEP_NORM_CONTROL, check_sketches, check_steps,
                                                             cosine, register_estimator)

# --------------------------------------------------------------------------------------------
# step-level estimators (SPEC §4 table)
# --------------------------------------------------------------------------------------------
@register_estimator("C1-dot", level="step")
def c1_dot(sketches, target) -> np.ndarray:
    """C1-dot (GAS, dot): score_s = v_s·t (SPEC §4). float64 [S]."""
    v, t = check_sketches(sketches, target)
    return (v @ t).astype(np.float64)


@register_estimator("C1-cosine", level="step")
def c1_cosine(sketches, target) -> np.ndarray:
    """C1-cosine (GAS): v_s·t / max(|v_s||t|, 1e-9); raises if |t| < 1e-9 (SPEC §4)."""
    return cosine(sketches, target)


@register_estimator("TRAK", level="step")
def trak(sketches, target, damping: float = 0.1, weights=None) -> np.ndarray:
    """TRAK-style whitened score, float64 (SPEC §4).

    Φ = sketches [R, d] (float64), λ = damping·||Φ||²_F/d. If λ ≤ 0 (Φ = 0) the score is Φt.
    Primal when d ≤ R: Φ(ΦᵀΦ + λI_d)⁻¹t; dual when d > R: (ΦΦᵀ + λI_R)⁻¹Φt (Woodbury-equal).
    Optional per-row ``weights`` [R] multiply the score.

    Raises:
        ValueError: damping ≤ 0, non-1-D target, shape mismatch, weights of the wrong shape.
    """
    if not damping > 0:
        raise ValueError(f"damping must be > 0, got {damping}")
    v, t = check_sketches(sketches, target)
    phi, t = v.astype(np.float64), t.astype(np.float64)
    R, d = phi.shape
    if R == 0:
        return np.zeros(0)
    lam = damping * float(np.sum(phi * phi)) / d
    if lam <= 0:
        score = phi @ t
    elif d <= R:
        score = phi @ np.linalg.solve(phi.T @ phi + lam * np.eye(d), t)
    else:
        score = np.linalg.solve(phi @ phi.T + lam * np.eye(R), phi @ t)
    if weights is not None:
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (R,):
            raise ValueError(f"weights must have shape ({R},), got {w.shape}")
        score = score * w
    return score


@register_estimator(STEP_NORM_CONTROL, level="step", role="control")
def norm_only(sketches) -> np.ndarray:
    """|v_s|₂, the target-free gradient-magnitude control (SPEC §4). float64 [S]."""
    v, _ = check_sketches(sketches)
    return np.linalg.norm(v.astype(np.float64), axis=1)


def local_buffer_steps(steps, current_step: int, window: int) -> np.ndarray:
    """The ``window`` most recent distinct steps strictly before ``current_step``, descending.

    SPEC §4 ``select_local_buffer`` (steps 0..19, current 15, window 5 -> [14, 13, 12, 11, 10]).
    Raises "window must be positive" on window ≤ 0.
    """
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    s = np.unique(np.asarray(steps, dtype=np.int64))
    return s[s < current_step][::-1][:window]


@register_estimator("local-buffer", level="step", role="baseline")
def local_buffer(sketches, steps, target, current_step: int | None = None, window: int | None = None,
                 metric: str = "cosine") -> np.ndarray:
    """Local-buffer baseline: cos(v_s, t) on the ``window`` most recent steps strictly before
    ``current_step``; ``-inf`` elsewhere (SPEC §4). Each row is scored independently.

    Defaults follow the notebook: current_step = max(steps) + 1, window = max(1, current_step // 10).
    ``metric="dot"`` uses v·t and allows a zero target.
    """
    v, t = check_sketches(sketches, target)
    s = check_steps(steps, v.shape[0])
    if current_step is None:
        current_step = int(s.max()) + 1 if s.size else 0
    if window is None:
        window = max(1, current_step // 10)
    keep = np.isin(s, local_buffer_steps(s, current_step, window))
    out = np.full(v.shape[0], -np.inf)
    if metric == "cosine":
        out[keep] = cosine(v[keep], t)
    elif metric == "dot":
        out[keep] = (v[keep] @ t).astype(np.float64)
    else:
        raise ValueError(f"unknown metric {metric!r} (cosine or dot)")
    return out


def governing_checkpoint(step: int, checkpoints: Sequence[int]) -> int:
    """Greatest checkpoint step ≤ ``step``, else the earliest checkpoint (SPEC §4 TracInCP)."""
    if len(checkpoints) == 0:
        raise ValueError("targets_by_checkpoint must have at least one entry")
    ck = sorted(int(c) for c in checkpoints)
    before = [c for c in ck if c <= step]
    return before[-1] if before else ck[0]


@register_estimator("TracInCP", level="step", role="baseline")
def tracin_cp(sketches, steps, targets_by_checkpoint: Mapping[int, np.ndarray],
              lr: float | Mapping[int, float] = 5e-6) -> np.ndarray:
    """TracInCP: η_c(s) · v_s·t_c(s), c(s) = governing checkpoint of step s (SPEC §4).

    Args:
        sketches: [S, D]; steps: int [S].
        targets_by_checkpoint: {checkpoint step: target [D]}, each computed at that checkpoint.
        lr: scalar η, or {checkpoint step: η} (missing keys default to 1.0).
    Raises:
        ValueError: empty target map ("at least one entry"), non-1-D target, shape mismatch.
    """
    if not targets_by_checkpoint:
        raise ValueError("targets_by_checkpoint must have at least one entry")
    v, _ = check_sketches(sketches)
    s = check_steps(steps, v.shape[0])
    for c, t in targets_by_checkpoint.items():
        check_sketches(v[:0], t)
    out = np.zeros(v.shape[0])
    gov = np.array([governing_checkpoint(int(x), list(targets_by_checkpoint)) for x in s], dtype=np.int64)
    for c in np.unique(gov):
        rows = gov == c
        eta = float(lr.get(int(c), 1.0)) if isinstance(lr, Mapping) else float(lr)
        out[rows] = eta * (v[rows] @ np.asarray(targets_by_checkpoint[int(c)])).astype(np.float64)
    return out


@register_estimator("random", level="step", role="control", per="rollout")
def random_scores(rollout_ids: Sequence[str], seed: int) -> np.ndarray:
    """Random ranking (SPEC §4): shuffle the ids in log order with ``np.random.default_rng(seed)``;
    the i-th shuffled id scores −i. Returns float64 [N] in log order."""
    ids = list(rollout_ids)
    shuffled = list(ids)
    np.random.default_rng(seed).shuffle(shuffled)
    pos = {rid: i for i, rid in enumerate(shuffled)}
    if len(pos) != len(ids):
        raise ValueError("rollout_ids contains duplicates")
    return -np.array([pos[r] for r in ids], dtype=np.float64)


@register_estimator("metagradient", level="step", role="baseline")
def metagradient_scores(metagradient, steps, rollout_steps) -> np.ndarray:
    """Metagradient (MAGIC-style, Ilyas & Engstrom 2025): ``dM/dw_i`` through the replayed run.

    Not a sketch method: the ``metagradient`` stage differentiates the behaviour measure M
    through every replayed GRPO update (``train/metagradient.py``) and writes ``dM/dw_i`` for every
    rollout (``metagradient/scores.json``, passed here as ``metagradient`` by
    ``scores.py``; the estimator is skipped where the stage has not run). The score is the
    predicted drop of M when the rollout is removed (``M(w = 1 - e_i) ~ M - dM/dw_i``), so a large
    score names a rollout whose removal lowers the behaviour, as for the other estimators.

    Args:
        metagradient: float [N] ``dM/dw_i`` in log order; rollout_steps: int [N].
        steps: the runner's keys: step numbers (step level: a step's score is the sum of its
            rollouts', the first-order effect of removing the whole step), or each rollout's own
            step (``steps`` equal to ``rollout_steps``: one row per rollout, "which rollout").
    Returns:
        float64 [len(steps)].
    Raises:
        ValueError: ``metagradient`` and ``rollout_steps`` of different shapes.
    """
    g = np.asarray(metagradient, dtype=np.float64)
    rs = np.asarray(rollout_steps, dtype=np.int64)
    keys = np.asarray(steps, dtype=np.int64)
    if g.shape != rs.shape:
        raise ValueError(f"metagradient: {g.shape} scores for {rs.shape} rollouts")
    if keys.shape == rs.shape and np.array_equal(keys, rs):
        return g
    row = {k: j for j, k in enumerate(keys.tolist())}
    out = np.zeros(keys.size)
    for step, x in zip(rs.tolist(), g.tolist()):
        if step in row:
            out[row[step]] += x
    return out
