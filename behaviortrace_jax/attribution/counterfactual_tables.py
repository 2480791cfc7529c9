"""The counterfactual stage's leave-top-k-out and LDS tables (numpy only; tested on toy problems).

Subset draws (:func:`top_k`, :func:`half_subsets`, :func:`drop_subsets`), the LDS (:func:`lds`,
:func:`predicted_effect`) and the rows of ``counterfactual_topk``, ``counterfactual_topk_recomputed``,
``lds`` and ``lds_drop<f>`` from typed replay results (:func:`topk_rows`, :func:`lds_rows`). The
replays themselves are planned in ``attribution/replay_plans.py`` and run by
``train/replay_runner.py``; Δ = behaviour(no intervention) - behaviour(intervened).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from behaviortrace_jax.attribution import formats, metrics as M

TABLES = ("counterfactual_topk", "counterfactual_topk_recomputed", "lds")
LDS_DROP = "lds_drop"  # table prefix of the LDS at a drop fraction other than 0.5


def is_table(table: str) -> bool:
    """Whether ``table`` is a leave-top-k-out or LDS table (``counterfactual_topk*``, ``lds``,
    ``lds_drop<f>``)."""
    return table in TABLES or table.startswith(LDS_DROP)


def lds_table_name(fraction: float) -> str:
    """``lds`` for the half-subsets (fraction 0.5), else ``lds_drop<f>`` (e.g. ``lds_drop0.05``)."""
    return "lds" if fraction == 0.5 else f"{LDS_DROP}{fraction:g}"


def top_k(scores: np.ndarray, candidates: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` highest ``scores`` among ``candidates`` (ties: lower index first)."""
    cand = np.asarray(candidates, np.int64)
    s = np.asarray(scores, np.float64)[cand]
    order = np.lexsort((cand, -s))
    return np.sort(cand[order[:k]])


def replayed_methods(scores: dict[str, np.ndarray], methods: str) -> dict[str, np.ndarray]:
    """The estimators whose rankings are replayed: ``counterfactual.methods`` ("" = every one scored,
    else a comma list of method names, e.g. ``"C1-dot,C1-dot:direction,abs-advantage"``), always
    without ``random`` (the random subsets replace it). Raises ValueError naming unknown methods."""
    names = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = sorted(set(names) - set(scores))
    if unknown:
        raise ValueError(f"counterfactual.methods: {unknown} are not scored methods; scored: {sorted(scores)}")
    keep = names or [m for m in scores if m != "random"]
    return {m: scores[m] for m in keep if m != "random"}


def removal_weights(n: int, removed: np.ndarray) -> np.ndarray:
    """float32 [n] ones with 0 at ``removed``."""
    w = np.ones(n, np.float32)
    w[np.asarray(removed, np.int64)] = 0.0
    return w


def half_subsets(candidates: np.ndarray, m: int, seed: int) -> list[np.ndarray]:
    """``m`` random subsets of ``candidates`` of size ``len // 2`` each (the REMOVED halves), sorted."""
    rng = np.random.default_rng(seed)
    cand = np.asarray(candidates, np.int64)
    return [np.sort(rng.choice(cand, cand.size // 2, replace=False)) for _ in range(m)]


def lds_fractions(spec: str) -> list[float]:
    """``counterfactual.lds_fractions`` ("0.01,0.05,0.1,0.5") -> sorted distinct fractions in (0, 1).

    Raises:
        ValueError: naming the key for a value that is not a number in (0, 1).
    """
    try:
        out = sorted({float(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"config.counterfactual.lds_fractions={spec!r}: expected comma-separated numbers") from None
    if any(not 0.0 < f < 1.0 for f in out):
        raise ValueError(f"config.counterfactual.lds_fractions={spec!r}: fractions must lie in (0, 1)")
    return out


def drop_subsets(candidates: np.ndarray, fraction: float, m: int, seed: int) -> list[np.ndarray]:
    """``m`` random subsets of ``max(1, round(fraction * len))`` ``candidates`` each (the REMOVED
    rollouts), sorted; one stream per (seed, subset size)."""
    cand = np.asarray(candidates, np.int64)
    k = max(1, int(round(fraction * cand.size)))
    rng = np.random.default_rng([int(seed), k])
    return [np.sort(rng.choice(cand, k, replace=False)) for _ in range(m)]


def predicted_effect(scores: np.ndarray, candidates: np.ndarray, removed: np.ndarray) -> float:
    """Sum of ``scores`` over the kept candidates (candidates not in ``removed``); -inf/nan count 0."""
    s = np.asarray(scores, np.float64)
    kept = np.setdiff1d(np.asarray(candidates, np.int64), np.asarray(removed, np.int64))
    v = s[kept]
    return float(np.sum(np.where(np.isfinite(v), v, 0.0)))


def lds(predicted: np.ndarray, measured: np.ndarray, *, nboot: int, seed: int) -> tuple[float, float, float]:
    """Spearman LDS of predicted vs measured behaviour and a percentile bootstrap 95% CI over subsets."""
    p, a = np.asarray(predicted, np.float64), np.asarray(measured, np.float64)
    rho = M.lds_correlation(p, a)
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(nboot):
        i = rng.integers(0, p.size, p.size)
        boots.append(M.lds_correlation(p[i], a[i]))
    lo, hi = np.percentile(boots, [2.5, 97.5]) if boots else (np.nan, np.nan)
    return rho, float(lo), float(hi)


def topk_rows(seed: str, table: str, drops: Mapping[tuple[str, int, int], float], methods: Sequence[str]
              ) -> list[formats.Row]:
    """The rows of a leave-top-k-out table (``counterfactual_topk`` or its recomputed twin).

    Args:
        drops: ``{(method, k, draw): Δ}``; method ``oracle``, an estimator, or ``random`` (draw =
            its seed; 0 otherwise).
        methods: the estimators, in row order (after ``oracle``).
    Rows per k: ``oracle`` and each estimator (``value`` = Δ, ``chance`` = the random subsets' mean
    Δ, ``ceiling`` = the oracle's Δ, ``n`` = k), then ``random`` (mean, ``lo``/``hi`` = mean ∓ sd).
    """
    rows: list[formats.Row] = []
    for k in sorted({k for _, k, _ in drops}):
        rnd = np.array([v for (m, kk, _), v in drops.items() if m == "random" and kk == k])
        oracle = drops.get(("oracle", k, 0))
        chance = float(rnd.mean()) if rnd.size else None
        for name in ["oracle", *methods]:
            if (name, k, 0) in drops:
                rows.append(formats.Row(seed, table, name, drops[(name, k, 0)], chance=chance, ceiling=oracle, n=k))
        if rnd.size:
            sd = float(rnd.std(ddof=1)) if rnd.size > 1 else 0.0
            rows.append(formats.Row(seed, table, "random", chance, chance - sd, chance + sd, chance, oracle, k))
    return rows


def lds_rows(seed: str, subsets: Mapping[float, Sequence[tuple[np.ndarray, float]]], scores: Mapping[str, np.ndarray],
             window: np.ndarray, *, nboot: int) -> list[formats.Row]:
    """The ``lds`` / ``lds_drop<f>`` rows: ``subsets`` ``{fraction: [(removed indices, measured
    behaviour)]}`` (draw order); per scored method, ``value`` = Spearman(predicted, measured),
    predicted = the sum of its scores over the kept window rollouts; ``lo``/``hi`` = bootstrap CI
    over subsets; ``n`` = M. A fraction with fewer than 2 subsets gives no rows; a method with no
    score in the window gets NaN (``metrics.lds_evaluable``)."""
    rows: list[formats.Row] = []
    rng_seed = int(seed.split("_")[0]) if seed[:1].isdigit() else 0
    for f in sorted(subsets, key=lambda f: (lds_table_name(f) != "lds", lds_table_name(f))):
        table, subs = lds_table_name(f), subsets[f]
        if len(subs) < 2:
            continue
        measured = np.array([v for _, v in subs])
        for name, s in scores.items():
            if not M.lds_evaluable(s, window):  # no score in the window: NaN, not a tie's 0
                rows.append(formats.Row(seed, table, name, float("nan"), None, None, 0.0, 1.0, len(subs)))
                continue
            pred = np.array([predicted_effect(s, window, rem) for rem, _ in subs])
            rho, lo, hi = lds(pred, measured, nboot=nboot, seed=rng_seed)
            rows.append(formats.Row(seed, table, name, rho, lo, hi, 0.0, 1.0, len(subs)))
    return rows
