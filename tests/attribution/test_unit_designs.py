"""Unit designs sized by power (attribution/unit_designs.py): each design's per-unit standard error
against a direct simulation with numpy (known effects, normal noise of sd sigma), the factorial's
exactly from its design matrix, and the finest units a budget resolves."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from behaviortrace_jax.attribution import replay_estimators as E, unit_designs as U


def _simulated_se(design: str, sigma: float, units: int, replays: int, sims: int = 3000) -> float:
    """sd over ``sims`` simulated experiments of unit 0's estimated effect."""
    rng = np.random.default_rng(0)
    beta = rng.uniform(0.0, 1.0, units)  # true effects: withholding unit u lowers the measure by beta_u
    est = []
    for _ in range(sims):
        if design == "single-unit":
            r = replays // (units + 1)
            base = 1.0 + sigma * rng.standard_normal(r)
            cut = 1.0 - beta[0] + sigma * rng.standard_normal(r)
            est.append(np.mean(base - cut))
        else:
            x = (rng.random((replays, units)) < 0.5).astype(np.int8) if design == "random-subset" else \
                np.tile((E.fractional_factorial(units) > 0).astype(np.int8), (replays // U.factorial_runs(units), 1))
            y = 1.0 - x @ beta + sigma * rng.standard_normal(x.shape[0])
            est.append(E.least_squares(1.0, x, y)[0])
    return float(np.std(est, ddof=1))


@pytest.mark.parametrize("design,units,replays,tol", [("single-unit", 7, 64, 0.06), ("random-subset", 8, 64, 0.15),
                                                     ("factorial", 7, 64, 0.06)])
def test_per_unit_standard_error_matches_a_simulation(design, units, replays, tol):
    got = U.design_power(design, 0.3, units, replays)
    assert got.feasible
    assert abs(_simulated_se(design, 0.3, units, replays) / got.se - 1) < tol


def test_the_factorial_standard_error_is_exact_from_its_design_matrix():
    for units in (2, 6, 10):  # R - U - 1 >= 1 residual df (a saturated design has no interval)
        x = (E.fractional_factorial(units) > 0).astype(np.float64)
        a = np.concatenate([np.ones((x.shape[0], 1)), x], axis=1)
        var = np.linalg.inv(a.T @ a)[1:, 1:].diagonal()  # sigma = 1, one replicate
        np.testing.assert_allclose(np.sqrt(var), U.design_power("factorial", 1.0, units, x.shape[0]).se, rtol=1e-12)


def test_subset_designs_beat_single_unit_replays_by_about_half_the_unit_count_at_equal_budget():
    for units in (4, 10, 40):
        budget = 4 * (units + 1)
        single, subset, _ = U.compare_designs(0.05, units, budget, seconds_per_replay=30.0)
        ratio = (single.se / subset.se) ** 2
        assert ratio == pytest.approx((units + 1) / 2, rel=1e-9)
        assert single.cpu_hours == pytest.approx(budget * 30.0 / 3600)
        assert subset.half_width < single.half_width and subset.mde < single.mde


def test_a_budget_too_small_for_a_design_is_infeasible_not_a_number_that_looks_fine():
    p = U.design_power("single-unit", 0.05, 40, 60)  # one stream per unit: no interval
    assert not p.feasible and math.isnan(p.se) and math.isnan(p.mde)
    assert not U.design_power("random-subset", 0.05, 40, 30).feasible
    with pytest.raises(ValueError, match="design='leave-one'"):
        U.design_power("leave-one", 0.05, 4, 16)
    with pytest.raises(ValueError, match="sigma=-1"):
        U.design_power("factorial", -1, 4, 16)


def test_finest_units_is_the_largest_count_whose_even_share_is_detectable():
    sigma, delta, budget = 0.05, 0.5, 64
    for design in U.DESIGNS:
        u = U.finest_units(design, sigma, delta, budget)
        if u:
            assert delta / u >= U.design_power(design, sigma, u, budget).mde
        nxt = U.design_power(design, sigma, u + 1, budget)
        assert not nxt.feasible or delta / (u + 1) < nxt.mde
    assert U.finest_units("random-subset", sigma, delta, budget) > U.finest_units("single-unit", sigma, delta, budget)
    assert U.finest_units("random-subset", 10.0, 0.01, 16) == 0


def test_the_least_squares_fit_intervals_cover_and_its_held_out_r2_tests_additivity():
    """replay_estimators.least_squares_fit: the t intervals of an additive design cover the true
    effects at about their level (simulated, numpy), they match the textbook OLS covariance, and the
    leave-one-out R² is high for an additive response and low for an interaction-only one."""
    rng = np.random.default_rng(1)
    units, replays, sigma = 8, 48, 0.1
    beta = rng.uniform(0.0, 0.3, units)
    cover = []
    for _ in range(400):
        x = (rng.random((replays, units)) < 0.5).astype(np.int8)
        y = 1.0 - x @ beta + sigma * rng.standard_normal(replays)
        fit = E.least_squares_fit(1.0, x, y)
        cover.append((fit.ci_low <= beta) & (beta <= fit.ci_high))
    assert abs(np.mean(cover) - 0.95) < 0.02 and fit.df == replays - units - 1
    a = np.concatenate([np.ones((replays, 1)), x], axis=1)
    resid = (1.0 - y) - a @ np.linalg.lstsq(a, 1.0 - y, rcond=None)[0]
    se = np.sqrt(np.diag(np.linalg.inv(a.T @ a))[1:] * (resid @ resid) / fit.df)
    np.testing.assert_allclose(fit.se, se, rtol=1e-10)
    assert fit.loo_r2 > 0.7
    inter = 1.0 - 0.5 * (x[:, 0] ^ x[:, 1]) + 0.01 * rng.standard_normal(replays)  # XOR: no main effects
    assert E.least_squares_fit(1.0, x, inter).loo_r2 < 0.2
    small = E.least_squares_fit(1.0, x[:units + 1], y[:units + 1])  # saturated: no residual df
    assert small.df == 0 and np.isnan(small.se).all() and np.isnan(small.loo_r2)


def test_the_fits_f_tests_detect_distinct_effects_and_interactions_and_match_numpy():
    """replay_estimators.equal_effects_test / interaction_test: equal planted effects are not told
    apart (p roughly uniform: rejected at about the 5 % level), distinct ones are (p < 1e-6); an
    additive response passes the interaction test at about its level, an XOR-like one fails it;
    the F statistic matches a direct numpy computation of the two nested fits."""
    rng = np.random.default_rng(2)
    units, replays, sigma = 4, 48, 0.1
    x = (rng.random((replays, units)) < 0.5).astype(np.int8)
    noise = lambda: sigma * rng.standard_normal(replays)  # noqa: E731
    equal = [E.equal_effects_test(x, x @ np.full(units, 0.15) + noise()) for _ in range(400)]
    additive = [E.interaction_test(x, x @ np.array([0.3, 0.2, 0.1, 0.0]) + noise()) for _ in range(400)]
    assert abs(np.mean(np.array(equal) < 0.05) - 0.05) < 0.03
    assert abs(np.mean(np.array(additive) < 0.05) - 0.05) < 0.03
    assert E.equal_effects_test(x, x @ np.array([0.4, 0.2, 0.0, 0.0]) + noise()) < 1e-6
    assert E.interaction_test(x, 0.5 * (x[:, 0] ^ x[:, 1]) + noise()) < 1e-6
    # the F statistic by hand: RSS of the restricted (intercept + count) and full (intercept + units) fits
    y = x @ np.array([0.3, 0.1, 0.2, 0.0]) + noise()
    one = np.ones((replays, 1))

    def rss(a):
        r = y - a @ np.linalg.lstsq(a, y, rcond=None)[0]
        return float(r @ r)

    r0, r1 = rss(np.hstack([one, x.sum(1, keepdims=True)])), rss(np.hstack([one, x]))
    f = ((r0 - r1) / (units - 1)) / (r1 / (replays - units - 1))
    assert math.isclose(E.equal_effects_test(x, y), float(stats.f.sf(f, units - 1, replays - units - 1)), rel_tol=1e-9)
    fit = E.least_squares_fit(1.0, x, 1.0 - y)
    assert math.isclose(fit.equal_effects_p, E.equal_effects_test(x, y), rel_tol=1e-12)
    assert math.isclose(fit.interaction_p, E.interaction_test(x, y), rel_tol=1e-12)
    assert math.isnan(E.interaction_test(x[:, :1], y))  # one unit: no pairs
    assert math.isnan(E.equal_effects_test(x[:4], y[:4]))  # 4 replays, up to 5 parameters: no residual df
