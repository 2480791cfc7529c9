"""Noise floor, minimum detectable effect, streams needed and detection verdicts
(``attribution/noise_floor.py``, issue 47), against Monte-Carlo t-tests, the textbook sample sizes
and synthetic hierarchical (stream x prompt x sample) data."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from behaviortrace_jax.attribution import noise_floor as nf

R = 20_000  # Monte-Carlo replicates: a rejection rate's SE is <= 0.0035


@pytest.mark.parametrize("design,n", [("two-arm", 8), ("two-arm", 3), ("fixed-arm", 8), ("paired", 5)])
def test_mde_has_its_power_by_monte_carlo(design, n):
    """Simulated t-tests at the MDE reject with the stated power; at effect 0 with rate alpha."""
    rng = np.random.default_rng(0)
    sd = 0.05
    d = nf.mde(sd, n, design=design)
    for effect, want in ((d, nf.POWER), (0.0, nf.ALPHA)):
        b = rng.normal(effect, sd, (R, n))
        if design == "two-arm":
            p = stats.ttest_ind(b, rng.normal(0.0, sd, (R, n)), axis=1).pvalue
        else:  # fixed-arm: the baseline against a constant; paired: sd is that of the differences
            p = stats.ttest_1samp(b, 0.0, axis=1).pvalue
        assert abs(np.mean(p < nf.ALPHA) - want) < 0.012, (design, n, effect, np.mean(p < nf.ALPHA))


def test_mde_matches_textbook_sample_sizes_and_normal_formula():
    """Cohen (1988): d = 0.5 at power 0.8 needs 64 per group (two samples) and 34 (one sample);
    the normal approximation is (z_.975 + z_.8) * k * sd / sqrt(n) and the t MDE exceeds it,
    converging for large n."""
    assert nf.streams_for_mde(1.0, 0.5, design="two-arm") == 64
    assert nf.streams_for_mde(1.0, 0.5, design="fixed-arm") == 34
    assert nf.streams_for_mde(1.0, 0.5, design="paired") == 34
    z = stats.norm.ppf(0.975) + stats.norm.ppf(0.8)
    assert nf.mde(2.0, 8, method="normal") == pytest.approx(z * 2.0 * math.sqrt(2 / 8), rel=1e-12)
    assert nf.mde(2.0, 8, design="fixed-arm", method="normal") == pytest.approx(z * 2.0 / math.sqrt(8), rel=1e-12)
    for n in (3, 8, 30):
        assert nf.mde(1.0, n) > nf.mde(1.0, n, method="normal")
    assert nf.mde(1.0, 4000) == pytest.approx(nf.mde(1.0, 4000, method="normal"), rel=2e-3)
    assert nf.mde(0.0, 5) == 0.0
    # power 0.9 needs a larger effect; the MDE scales with sd
    assert nf.mde(1.0, 8, power=0.9) > nf.mde(1.0, 8)
    assert nf.mde(3.0, 8) == pytest.approx(3 * nf.mde(1.0, 8), rel=1e-9)


@pytest.mark.parametrize("design", nf.DESIGNS)
def test_streams_needed_is_the_smallest_n_reaching_the_half_width(design):
    sd, h = 0.05, 0.03
    n = nf.streams_needed(sd, h, design=design)
    k = math.sqrt(2) if design == "two-arm" else 1.0

    def half(m):
        return stats.t.ppf(0.975, nf.design_factor(design, m)[1]) * k * sd / math.sqrt(m)

    assert half(n) <= h < half(n - 1)
    n_norm = nf.streams_needed(sd, h, design=design, method="normal")
    assert n_norm == max(2, math.ceil((stats.norm.ppf(0.975) * k * sd / h) ** 2)) and n >= n_norm
    # the CI built with that many streams covers the true effect 95 % of the time (Monte-Carlo)
    rng = np.random.default_rng(1)
    b = rng.normal(0.3, sd, (4000, n))
    se = b.std(1, ddof=1) / math.sqrt(n)
    q = stats.t.ppf(0.975, n - 1)
    assert nf.confidence_interval(b[0].mean(), se[0], n - 1) == pytest.approx((b[0].mean() - q * se[0],
                                                                               b[0].mean() + q * se[0]))
    assert abs(np.mean(np.abs(b.mean(1) - 0.3) <= q * se) - 0.95) < 0.012


def test_effects_below_the_noise_floor_are_not_detected():
    """Arms whose means differ by less than one noise-floor sd, with n <= 8 streams per arm, give a
    CI holding 0 ("not detected", never "no effect"); a large effect is detected; over many
    synthetic draws the detection rate of a sub-floor effect stays at the t-test's power for it."""
    for n in (3, 5, 8):
        z = np.linspace(-1, 1, n)
        unit = (z - z.mean()) / z.std(ddof=1)  # sd exactly 1
        sd = 0.05
        base = 0.30 + sd * unit
        for delta in (0.0, 0.5 * sd, 0.9 * sd, -0.9 * sd):
            e = nf.estimate_effect(base, base - delta)
            assert e.verdict == nf.NOT_DETECTED and e.ci_low <= 0 <= e.ci_high
            assert e.delta == pytest.approx(delta)
            fl = nf.noise_floor(base)
            assert fl.sd == pytest.approx(sd) and abs(delta) < fl.sd < fl.mde
        big = nf.estimate_effect(base, base - 10 * sd)
        assert big.verdict == nf.DETECTED and big.ci_low > 0 and big.design == "two-arm"
        fixed = nf.estimate_effect(base, [base.mean() - 10 * sd])  # the withhold-all arm: one value
        assert fixed.verdict == nf.DETECTED and fixed.design == "fixed-arm" and fixed.df == n - 1
    assert {nf.DETECTED, nf.NOT_DETECTED} == {"detected", "not detected"}
    rng = np.random.default_rng(2)
    sd, n = 0.05, 5
    delta = 0.5 * sd
    hits = np.mean([nf.estimate_effect(rng.normal(delta, sd, n), rng.normal(0, sd, n)).verdict == nf.DETECTED
                    for _ in range(2000)])
    power = nf.t_power(delta, sd * math.sqrt(2 / n), 2 * n - 2)
    assert power < 0.15 and hits < power + 0.03  # Welch's t is at most as liberal as the pooled t here


def test_paired_effect_uses_the_per_stream_differences():
    b = np.array([0.26, 0.30, 0.36])
    w = np.array([0.05, 0.06, 0.08])
    e = nf.estimate_effect(b, w, paired=True)
    d = b - w
    assert e.design == "paired" and e.df == 2 and e.delta == pytest.approx(d.mean())
    assert e.se == pytest.approx(d.std(ddof=1) / math.sqrt(3))
    t = stats.ttest_rel(b, w)
    lo, hi = t.confidence_interval(0.95)
    assert (e.ci_low, e.ci_high) == pytest.approx((lo, hi))
    welch = stats.ttest_ind(b, w, equal_var=False)
    ew = nf.estimate_effect(b, w)
    assert (ew.ci_low, ew.ci_high) == pytest.approx(tuple(welch.confidence_interval(0.95)))
    assert ew.df == pytest.approx(welch.df)


def test_variance_split_recovers_the_hierarchy():
    """Streams j with training noise u_j ~ N(0, tau), prompts i with rates p_i + u_j, k samples of
    0/1 hits each: the split's between-stream sd estimates tau and its sampling part the binomial
    variance sum_i pi_ij (1 - pi_ij) / k / m^2."""
    rng = np.random.default_rng(3)
    s, m, k, tau = 3000, 20, 4, 0.05
    p = np.linspace(0.1, 0.5, m)
    pi = np.clip(p[None, :] + rng.normal(0, tau, (s, 1)), 0, 1)
    hits = rng.random((s, m, k)) < pi[..., None]
    y = hits.mean(axis=(1, 2))
    se = np.array([nf.sampling_se(h) for h in hits])
    fl = nf.noise_floor(y, se)
    true_samp = np.mean(np.sum(pi * (1 - pi), axis=1) / k / m ** 2)
    assert fl.sd_sampling ** 2 == pytest.approx(true_samp, rel=0.03)
    assert fl.sd_between == pytest.approx(tau, rel=0.08)
    assert fl.sd ** 2 == pytest.approx(fl.sd_between ** 2 + fl.sd_sampling ** 2)
    # binary hits: the stratified SE is sum_i p_i (1 - p_i) / (k - 1) / m^2
    ph = hits[0].mean(1)
    assert se[0] ** 2 == pytest.approx(np.sum(ph * (1 - ph)) / (k - 1) / m ** 2)
    # a deterministic measure (se 0) puts the whole floor between streams
    det = nf.noise_floor(y[:8], np.zeros(8))
    assert det.sd_sampling == 0 and det.sd_between == pytest.approx(det.sd)
    assert math.isnan(nf.noise_floor(y[:8]).sd_between)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="streams"):
        nf.noise_floor([0.3])
    with pytest.raises(ValueError, match="non-finite"):
        nf.noise_floor([0.3, float("nan")])
    with pytest.raises(ValueError, match="sampling_se"):
        nf.noise_floor([0.3, 0.4], [0.1])
    with pytest.raises(ValueError, match="design"):
        nf.mde(1.0, 5, design="three-arm")
    with pytest.raises(ValueError, match="power"):
        nf.mde(1.0, 5, power=1.2)
    with pytest.raises(ValueError, match="n=1"):
        nf.mde(1.0, 1)
    with pytest.raises(ValueError, match="half_width"):
        nf.streams_needed(1.0, 0.0)
    with pytest.raises(ValueError, match="samples"):
        nf.sampling_se(np.zeros((4, 1)))
    with pytest.raises(ValueError, match="paired"):
        nf.estimate_effect([0.1, 0.2, 0.3], [0.1, 0.2], paired=True)


def test_a_fixed_arm_measured_once_adds_its_own_sampling_error():
    """The withhold-all run is one measurement with its own error (e.g. binomial): with
    ``intervened_se`` the CI covers the true effect at its level (Satterthwaite df); without it,
    coverage falls short."""
    rng = np.random.default_rng(4)
    n, sd, se_w, reps = 5, 0.05, 0.04, 4000
    b = rng.normal(0.30, sd, (reps, n))
    w = rng.normal(0.06, se_w, reps)
    cover = {0.0: 0, se_w: 0}
    for i in range(reps):
        for s in cover:
            e = nf.estimate_effect(b[i], [w[i]], intervened_se=s)
            cover[s] += e.ci_low <= 0.24 <= e.ci_high
    assert abs(cover[se_w] / reps - 0.95) < 0.015 and cover[0.0] / reps < 0.90
    e = nf.estimate_effect(b[0], [w[0]], intervened_se=se_w)
    vb = np.var(b[0], ddof=1) / n
    assert e.design == "fixed-arm" and e.se == pytest.approx(math.sqrt(vb + se_w ** 2))
    assert e.df == pytest.approx((vb + se_w ** 2) ** 2 / (vb ** 2 / (n - 1)))
    with pytest.raises(ValueError, match="intervened_se"):
        nf.estimate_effect(b[0], b[1], intervened_se=0.01)
    with pytest.raises(ValueError, match="intervened_se"):
        nf.estimate_effect(b[0], b[1], paired=True, intervened_se=0.01)
