"""Metrics of the evaluation layer (SPEC §6): numpy only, so bootstrap streams match the paper's.

Step level (SPEC §6.3-§6.6): tie-aware fractional precision@k, the step-granularity ceiling,
chance (base rate), lift, headroom. Rollout level (SPEC §6.7-§6.10): within-group AUC with pooled
pairs (ties ½, optional fluency matching), fluency residualisation (one pooled slope, fitted once)
and the cluster bootstrap over groups. SPEC §6.12: plain precision/recall@k, LDS (Spearman),
retrain gap closure, behaviour reduction.

Inputs are arrays: ``scores`` float [N] (``-inf`` allowed, NaN refused), ``is_gt`` bool [N],
``groups`` int [R]. Every bad input raises ``ValueError`` with the offending value.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import scipy.stats


# --------------------------------------------------------------------------------------------
# input checks
# --------------------------------------------------------------------------------------------
def _scores_1d(scores, name: str = "scores") -> np.ndarray:
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {s.shape}")
    if np.isnan(s).any():
        raise ValueError(f"{name} contains NaN at index {int(np.flatnonzero(np.isnan(s))[0])}")
    return s


def _mask_like(mask, n: int, name: str = "is_gt") -> np.ndarray:
    m = np.asarray(mask)
    if m.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},), got {m.shape}")
    return m.astype(bool)


def _check_k(k: int) -> int:
    if int(k) != k or k <= 0:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    return int(k)


def _fractional_credit(block_n: np.ndarray, block_g: np.ndarray, k: int) -> float:
    """Credit of blocks taken in order: each takes ``min(n, k - filled)`` slots worth g·slots/n."""
    filled_before = np.concatenate([[0], np.cumsum(block_n)[:-1]])
    slots = np.clip(k - filled_before, 0, block_n)
    return float(np.sum(block_g * slots / block_n))


# --------------------------------------------------------------------------------------------
# step level (SPEC §6.3-§6.5)
# --------------------------------------------------------------------------------------------
def precision_at_k_fractional(scores, is_gt, k: int) -> float:
    """Tie-aware fractional precision@k ("P@|GT|", SPEC §6.3).

    Sorts by score descending and walks maximal runs of exactly equal scores (``-inf`` ties with
    ``-inf``); a run of ``n`` items with ``g`` ground-truth members that gets ``slots`` of the
    remaining ``k`` positions earns ``g·slots/n``. Returns credit/k, independent of the order
    inside a tie. With no ties it equals plain precision@k.

    Args:
        scores: float [N]; NaN raises.
        is_gt: bool [N], ground-truth membership.
        k: positive int (the paper uses k = |GT| of the population).
    Raises:
        ValueError: k ≤ 0, NaN scores, shape mismatch.
    """
    k = _check_k(k)
    s = _scores_1d(scores)
    g = _mask_like(is_gt, s.size)
    order = np.argsort(-s, kind="stable")
    s, g = s[order], g[order]
    if s.size == 0:
        return 0.0
    starts = np.flatnonzero(np.concatenate([[True], s[1:] != s[:-1]]))
    block_n = np.diff(np.concatenate([starts, [s.size]]))
    block_g = np.add.reduceat(g.astype(np.int64), starts)
    return _fractional_credit(block_n, block_g, k) / k


def precision_ceiling_fractional(block_keys, is_gt, k: int) -> float:
    """Best P@k of any ranker that cannot split a block (SPEC §6.4).

    Groups items by exact ``block_keys`` value (at step level: the step number), orders the groups
    by ground-truth density g/n descending (stable: equal densities keep first-appearance order),
    and accumulates with the fractional rule of :func:`precision_at_k_fractional`.

    Args:
        block_keys: [N] hashable values (ints for steps).
        is_gt: bool [N].
        k: positive int.
    Raises:
        ValueError: k ≤ 0 or shape mismatch.
    """
    k = _check_k(k)
    keys = np.asarray(block_keys)
    if keys.ndim != 1:
        raise ValueError(f"block_keys must be 1-D, got shape {keys.shape}")
    g = _mask_like(is_gt, keys.size)
    if keys.size == 0:
        return 0.0
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    n = np.bincount(inverse).astype(np.float64)
    gt = np.bincount(inverse, weights=g.astype(np.float64))
    appearance = np.argsort(first, kind="stable")  # groups in first-appearance order
    n, gt = n[appearance], gt[appearance]
    order = np.argsort(-(gt / n), kind="stable")
    return _fractional_credit(n[order], gt[order], k) / k


def base_rate(ground_truth_size: int, population_size: int) -> float:
    """Chance level |GT|/N of P@|GT| (SPEC §6.5).

    Raises:
        ValueError: "population_size must be positive" (N ≤ 0) or
            "ground_truth_size must be in [0, N]".
    """
    if population_size <= 0:
        raise ValueError(f"population_size must be positive, got {population_size}")
    if not 0 <= ground_truth_size <= population_size:
        raise ValueError(f"ground_truth_size must be in [0, {population_size}], got {ground_truth_size}")
    return ground_truth_size / population_size


def lift(value: float, floor: float) -> float:
    """value / floor (e.g. precision over chance, SPEC §6.5). Raises "floor must be > 0"."""
    if not floor > 0:
        raise ValueError(f"floor must be > 0, got {floor}")
    return value / floor


def headroom(ceiling: float, chance: float) -> float:
    """ceiling − chance: the most any step-level ranker can gain over chance (SPEC §6.5)."""
    return ceiling - chance


def fraction_of_ceiling(value: float, ceiling: float) -> float:
    """%ceil = value / ceiling (SPEC §6.5). Raises if ceiling ≤ 0."""
    if not ceiling > 0:
        raise ValueError(f"ceiling must be > 0, got {ceiling}")
    return value / ceiling


# --------------------------------------------------------------------------------------------
# other metric functions (SPEC §6.12)
# --------------------------------------------------------------------------------------------
def precision_at_k(ranking: Sequence, gt: Iterable, k: int) -> float:
    """|top_k(ranking) ∩ gt| / k for a ranked id list (SPEC §6.12). Raises if k ≤ 0."""
    k = _check_k(k)
    gt = set(gt)
    return sum(1 for r in list(ranking)[:k] if r in gt) / k


def recall_at_k(ranking: Sequence, gt: Iterable, k: int) -> float:
    """|top_k(ranking) ∩ gt| / |gt| (SPEC §6.12). Raises on k ≤ 0 or an empty gt."""
    k = _check_k(k)
    gt = set(gt)
    if not gt:
        raise ValueError("gt must be non-empty for recall")
    return sum(1 for r in list(ranking)[:k] if r in gt) / len(gt)


def lds_correlation(predicted, actual) -> float:
    """Linear datamodeling score: Spearman ρ of predicted vs actual effects (SPEC §6.12).

    Both 1-D of equal length ≥ 2; a NaN ρ (constant input) returns 0.0.
    """
    p, a = np.asarray(predicted, dtype=np.float64), np.asarray(actual, dtype=np.float64)
    if p.ndim != 1 or p.shape != a.shape:
        raise ValueError(f"predicted and actual must be 1-D of the same shape, got {p.shape} and {a.shape}")
    if p.size < 2:
        raise ValueError(f"lds_correlation needs at least 2 items, got {p.size}")
    if np.ptp(p) == 0 or np.ptp(a) == 0:
        return 0.0
    rho = scipy.stats.spearmanr(p, a).statistic
    return 0.0 if np.isnan(rho) else float(rho)


def lds_evaluable(scores, candidates) -> bool:
    """Whether an estimator can be judged by an LDS over subsets of ``candidates`` (int indices into
    ``scores``, float [N]): True when it gives at least one candidate a finite score. An estimator
    that scores none of them (e.g. ``local-buffer``, -inf outside its last steps, on the
    contamination window) predicts the same effect, 0, for every subset: its Spearman ρ would be
    :func:`lds_correlation`'s 0.0 for ties, which reads as "no better than chance" where it was not
    measured at all. Such a row is written as not evaluable (value NaN, no CI), as SPEC §6.7 writes
    an AUC without pairs."""
    s = np.asarray(scores, np.float64)[np.asarray(candidates, np.int64)]
    return bool(np.isfinite(s).any())


def retrain_gap_closure(base: float, intervened: float, full: float) -> float:
    """(base − intervened)/(base − full) (SPEC §6.12). Raises if base == full."""
    if base - full == 0:
        raise ValueError(f"retrain_gap_closure: base == full ({base}), the gap is zero")
    return (base - intervened) / (base - full)


def behavior_reduction(before: float, after: float) -> float:
    """(before − after)/before (SPEC §6.12). Raises if before ≤ 0."""
    if not before > 0:
        raise ValueError(f"behavior_reduction: before must be > 0, got {before}")
    return (before - after) / before


# --------------------------------------------------------------------------------------------
# rollout level (SPEC §6.7-§6.10)
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupPairs:
    """Per-group pair counts behind a pooled within-group AUC.

    ``wins[g]`` = #(pos, neg) pairs of group g with s_pos > s_neg plus ½ per tie; ``pairs[g]`` =
    #pairs counted. The pooled AUC of any multiset of groups is Σwins/Σpairs, which makes the
    cluster bootstrap exact and fast.
    """

    groups: np.ndarray  # [G] group labels in first-appearance order
    wins: np.ndarray  # [G] float64
    pairs: np.ndarray  # [G] int64

    @property
    def auc(self) -> float:
        tot = int(self.pairs.sum())
        return float(self.wins.sum() / tot) if tot else float("nan")

    @property
    def n_pairs(self) -> int:
        return int(self.pairs.sum())


def _group_index(groups) -> tuple[np.ndarray, list[np.ndarray]]:
    g = np.asarray(groups)
    if g.ndim != 1:
        raise ValueError(f"groups must be 1-D, got shape {g.shape}")
    if g.size == 0:
        raise ValueError("groups is empty: no rows to evaluate")
    labels, first, inverse = np.unique(g, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    members = [np.flatnonzero(inverse == j) for j in order]
    return labels[order], members


def group_pairs(groups, positive, scores, *, fluency=None, matched: bool = False,
                delta: float = 0.10) -> GroupPairs:
    """Within-group positive/negative pair counts (SPEC §6.7, §6.9).

    For each group and each (positive a, negative b) of it: skip if ``matched`` and
    |fluency_a − fluency_b| > delta; else count a pair, a win if s_a > s_b, ½ if s_a == s_b.

    Args:
        groups: [R] group labels; positive: bool [R]; scores: float [R] (NaN raises);
        fluency: float [R], needed when ``matched``; delta: matching tolerance (nats/token).
    """
    s = _scores_1d(scores)
    pos = _mask_like(positive, s.size, "positive")
    if np.asarray(groups).shape != s.shape:
        raise ValueError(f"groups shape {np.asarray(groups).shape} != scores shape {s.shape}")
    if matched:
        if fluency is None:
            raise ValueError("matched AUC needs fluency")
        fl = _scores_1d(fluency, "fluency")
        if fl.shape != s.shape:
            raise ValueError(f"fluency shape {fl.shape} != scores shape {s.shape}")
    labels, members = _group_index(groups)
    wins = np.zeros(len(members))
    pairs = np.zeros(len(members), dtype=np.int64)
    for j, idx in enumerate(members):
        p, n = idx[pos[idx]], idx[~pos[idx]]
        if p.size == 0 or n.size == 0:
            continue
        sp, sn = s[p][:, None], s[n][None, :]
        keep = np.ones((p.size, n.size), bool)
        if matched:
            keep = np.abs(fl[p][:, None] - fl[n][None, :]) <= delta
        pairs[j] = int(keep.sum())
        wins[j] = np.sum((sp > sn) & keep) + 0.5 * np.sum((sp == sn) & keep)
    return GroupPairs(labels, wins, pairs)


def within_group_auc(groups, positive, scores, *, fluency=None, matched: bool = False,
                     delta: float = 0.10) -> tuple[float, int]:
    """Pooled within-group AUC = (wins + ½·ties)/pairs (SPEC §6.7); NaN if there are no pairs.

    Returns:
        (auc, n_pairs).
    """
    gp = group_pairs(groups, positive, scores, fluency=fluency, matched=matched, delta=delta)
    return gp.auc, gp.n_pairs


def residualize_by_fluency(groups, fluency, scores) -> np.ndarray:
    """Fluency-residualised scores (SPEC §6.8), fitted once on all rows.

    Centres fluency x and score y within each group, fits one pooled slope
    b = cov_pop(x_c, y_c)/(var_pop(x_c) + 1e-12) and returns r = y_c − b·x_c (float64 [R]).
    """
    y = _scores_1d(scores)
    x = _scores_1d(fluency, "fluency")
    if x.shape != y.shape or np.asarray(groups).shape != y.shape:
        raise ValueError(f"groups/fluency/scores shapes differ: {np.asarray(groups).shape}, {x.shape}, {y.shape}")
    _, members = _group_index(groups)
    xc, yc = np.empty_like(x), np.empty_like(y)
    for idx in members:
        xc[idx] = x[idx] - x[idx].mean()
        yc[idx] = y[idx] - y[idx].mean()
    b = np.cov(xc, yc, bias=True)[0, 1] / (np.var(xc) + 1e-12)
    return yc - b * xc


def cluster_bootstrap(gp: GroupPairs, rng: np.random.Generator, nboot: int) -> tuple[float, float]:
    """95 % cluster-bootstrap CI of a pooled within-group AUC (SPEC §6.10).

    Draws ``nboot`` times ``rng.integers(0, G, G)`` (one call per resample, so the stream is the
    paper's), keeps duplicated groups as separate groups, skips resamples with no pairs, and
    returns ``np.percentile(boots, [2.5, 97.5])`` (linear). The ``rng`` is advanced in place so
    callers can share it sequentially across calls.

    Raises:
        ValueError: nboot ≤ 0, no groups, or every resample has zero pairs.
    """
    if nboot <= 0:
        raise ValueError(f"nboot must be positive, got {nboot}")
    G = gp.groups.size
    if G == 0:
        raise ValueError("cluster_bootstrap: no groups")
    boots = []
    for _ in range(nboot):
        counts = np.bincount(rng.integers(0, G, G), minlength=G)
        tot = counts @ gp.pairs
        if tot:
            boots.append((counts @ gp.wins) / tot)
    if not boots:
        raise ValueError("cluster_bootstrap: every resample had zero pairs")
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return float(lo), float(hi)
