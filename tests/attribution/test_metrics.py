"""Metrics (SPEC §6, §9 test_metrics): hand-computed values and error messages."""
from __future__ import annotations

import numpy as np
import pytest

from behaviortrace_jax.attribution import metrics


# ---- tie-aware precision and ceiling (SPEC §6.3, §6.4) -------------------------------------
def test_fractional_precision_is_tie_order_independent():
    # A = {a1*, a2} at 2.0, B = {b1*, b2*, b3, b4} at 1.0, k = 3: 1 + 2·(1/4) = 1.5 -> 0.5.
    scores = np.array([2.0, 2.0, 1.0, 1.0, 1.0, 1.0])
    gt = np.array([1, 0, 1, 1, 0, 0], bool)
    assert metrics.precision_at_k_fractional(scores, gt, 3) == pytest.approx(0.5)
    perm = np.array([1, 0, 5, 4, 3, 2])
    assert metrics.precision_at_k_fractional(scores[perm], gt[perm], 3) == pytest.approx(0.5)


def test_fractional_equals_plain_without_ties():
    scores = np.array([4.0, 3.0, 2.0, 1.0])
    gt = np.array([True, False, True, False])
    assert metrics.precision_at_k_fractional(scores, gt, 2) == pytest.approx(0.5)
    assert metrics.precision_at_k(["a", "b", "c", "d"], {"a", "c"}, 2) == pytest.approx(0.5)


def test_minus_inf_forms_one_block():
    # 2 finite items (one GT), then 4 at -inf with 2 GT; k = 4: 1 + 2·(2/4) = 2 -> 0.5.
    scores = np.array([1.0, 0.5, -np.inf, -np.inf, -np.inf, -np.inf])
    gt = np.array([1, 0, 1, 1, 0, 0], bool)
    assert metrics.precision_at_k_fractional(scores, gt, 4) == pytest.approx(0.5)


def test_ceiling_orders_blocks_by_density():
    # A = {a1*, a2*} (score 0), B = {b1*, b2} (score 1), k = 3 -> (2 + 1·1/2)/3.
    keys = np.array([0, 0, 1, 1])
    gt = np.array([True, True, True, False])
    assert metrics.precision_ceiling_fractional(keys, gt, 3) == pytest.approx(2.5 / 3)
    # the ranking by score (B first) is below the ceiling
    assert metrics.precision_at_k_fractional(keys.astype(float), gt, 3) < 2.5 / 3


def test_precision_errors():
    with pytest.raises(ValueError, match="k must be a positive"):
        metrics.precision_at_k_fractional([1.0], [True], 0)
    with pytest.raises(ValueError, match="NaN"):
        metrics.precision_at_k_fractional([1.0, np.nan], [True, False], 1)
    with pytest.raises(ValueError, match="shape"):
        metrics.precision_at_k_fractional([1.0, 2.0], [True], 1)
    with pytest.raises(ValueError, match="k must be a positive"):
        metrics.precision_ceiling_fractional([0], [True], -1)


# ---- chance, lift, headroom (SPEC §6.5) -------------------------------------------------------
def test_base_rate_and_lift():
    assert metrics.base_rate(6849, 16000) == pytest.approx(0.428, abs=1e-3)
    assert metrics.base_rate(1272, 16000) == pytest.approx(0.0795, abs=1e-4)
    with pytest.raises(ValueError, match="population_size must be positive"):
        metrics.base_rate(1, 0)
    with pytest.raises(ValueError, match="ground_truth_size must be in"):
        metrics.base_rate(17, 16)
    with pytest.raises(ValueError, match="ground_truth_size must be in"):
        metrics.base_rate(-1, 16)
    assert metrics.lift(0.469, 0.428) == pytest.approx(1.096, abs=1e-3)
    assert metrics.lift(0.420, 0.0795) == pytest.approx(5.28, abs=1e-2)
    with pytest.raises(ValueError, match="floor must be > 0"):
        metrics.lift(0.5, 0.0)
    assert metrics.headroom(0.5815, 0.4716) == pytest.approx(0.1099)
    assert metrics.fraction_of_ceiling(0.4, 0.8) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="ceiling must be > 0"):
        metrics.fraction_of_ceiling(0.4, 0.0)


# ---- other metric functions (SPEC §6.12) ------------------------------------------------------
def test_other_metrics():
    ranking = ["a", "b", "c", "d"]
    assert metrics.precision_at_k(ranking, {"a", "d"}, 3) == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        metrics.precision_at_k(ranking, {"a"}, 0)
    assert metrics.recall_at_k(ranking, {"a", "d"}, 2) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="non-empty"):
        metrics.recall_at_k(ranking, set(), 2)
    assert metrics.retrain_gap_closure(1.0, 0.0, 0.0) == pytest.approx(1.0)
    assert metrics.retrain_gap_closure(1.0, 0.5, 0.0) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="gap is zero"):
        metrics.retrain_gap_closure(1.0, 0.5, 1.0)
    assert metrics.behavior_reduction(0.8, 0.2) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="before must be > 0"):
        metrics.behavior_reduction(0.0, 0.1)
    assert metrics.lds_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert metrics.lds_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert metrics.lds_correlation([1, 1, 1], [1, 2, 3]) == 0.0
    with pytest.raises(ValueError, match="same shape"):
        metrics.lds_correlation([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="at least 2"):
        metrics.lds_correlation([1], [1])


# ---- within-group AUC, residualisation, bootstrap (SPEC §6.7-§6.10) --------------------------
GROUPS = np.array([0, 0, 0, 1, 1, 1])
POS = np.array([True, True, False, True, False, False])
SCORES = np.array([3.0, 1.0, 2.0, 5.0, 5.0, 4.0])


def test_within_group_auc_pools_pairs_and_halves_ties():
    # group 0: (3 > 2) win, (1 < 2) loss; group 1: (5 = 5) tie, (5 > 4) win -> (1 + 1.5)/4.
    auc, n = metrics.within_group_auc(GROUPS, POS, SCORES)
    assert (auc, n) == (pytest.approx(0.625), 4)
    # a group without negatives adds no pairs; no pairs at all -> NaN
    assert metrics.within_group_auc([0, 0], [True, True], [1.0, 2.0])[1] == 0
    assert np.isnan(metrics.within_group_auc([0, 0], [True, True], [1.0, 2.0])[0])


def test_matched_auc_skips_pairs_beyond_delta():
    fl = np.array([0.0, 1.0, 0.05, 0.0, 0.3, 0.02])
    # kept pairs: g0 (3 vs 2, |Δ|=.05) win; g1 (5 vs 4, |Δ|=.02) win; (1 vs 2) and (5 vs 5) skipped.
    assert metrics.within_group_auc(GROUPS, POS, SCORES, fluency=fl, matched=True, delta=0.10) == (pytest.approx(1.0), 2)
    with pytest.raises(ValueError, match="needs fluency"):
        metrics.within_group_auc(GROUPS, POS, SCORES, matched=True)


def test_residualize_removes_one_pooled_slope():
    x = np.array([0.0, 1.0, 2.0, 5.0, 6.0, 7.0])
    y = 2.0 * x + np.array([10, 10, 10, -3, -3, -3])
    np.testing.assert_allclose(metrics.residualize_by_fluency(GROUPS, x, y), 0.0, atol=1e-9)
    # hand example: x_c = [-1, 0, 1, -1, 0, 1], y_c = [0, 0, 0, -2, 0, 2] -> b = (4/6)/(4/6) = 1
    y2 = np.array([5.0, 5.0, 5.0, 1.0, 3.0, 5.0])
    np.testing.assert_allclose(metrics.residualize_by_fluency(GROUPS, x, y2), [1, 0, -1, -1, 0, 1], atol=1e-9)


def _naive_bootstrap(groups, pos, scores, seed, nboot):
    """Re-implements SPEC §6.10 literally: resample group lists, recompute the AUC from pairs."""
    rng = np.random.default_rng(seed)
    labels = list(dict.fromkeys(groups.tolist()))
    members = [np.flatnonzero(groups == g) for g in labels]
    boots = []
    for _ in range(nboot):
        wins = ties = tot = 0
        for j in rng.integers(0, len(labels), len(labels)):
            idx = members[j]
            for a in idx[pos[idx]]:
                for b in idx[~pos[idx]]:
                    tot += 1
                    wins += scores[a] > scores[b]
                    ties += scores[a] == scores[b]
        if tot:
            boots.append((wins + 0.5 * ties) / tot)
    return tuple(np.percentile(boots, [2.5, 97.5]))


def test_cluster_bootstrap_matches_literal_procedure_and_is_deterministic():
    rng = np.random.default_rng(5)
    groups = np.repeat(np.arange(12), 6)
    pos = rng.random(groups.size) < 0.6
    scores = np.round(rng.normal(size=groups.size), 1)  # rounding makes ties
    gp = metrics.group_pairs(groups, pos, scores)
    ci = metrics.cluster_bootstrap(gp, np.random.default_rng(3), 200)
    assert ci == pytest.approx(_naive_bootstrap(groups, pos, scores, 3, 200), abs=1e-12)
    assert metrics.cluster_bootstrap(gp, np.random.default_rng(3), 200) == ci
    shared = np.random.default_rng(3)
    first = metrics.cluster_bootstrap(gp, shared, 200)
    second = metrics.cluster_bootstrap(gp, shared, 200)  # continues the stream
    assert first == ci and second != ci
    with pytest.raises(ValueError, match="nboot must be positive"):
        metrics.cluster_bootstrap(gp, shared, 0)


def test_rollout_metric_bad_inputs():
    with pytest.raises(ValueError, match="NaN"):
        metrics.within_group_auc(GROUPS, POS, np.array([np.nan, 1, 2, 3, 4, 5.0]))
    with pytest.raises(ValueError, match="empty"):
        metrics.within_group_auc([], [], [])
    with pytest.raises(ValueError, match="shape"):
        metrics.residualize_by_fluency(GROUPS, [1.0], SCORES)
