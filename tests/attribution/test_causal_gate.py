"""The causal gate (``attribution/causal_gate.py``, issue 47) on synthetic stream values: acted,
not detected (below the noise floor), reversed, and the designs' MDEs."""
from __future__ import annotations

import math

import numpy as np
import pytest

from behaviortrace_jax.attribution import causal_gate as cg, noise_floor as nf


def test_the_issue_numbers_act_against_a_fixed_withhold_all_arm():
    """Issue 47, step 200: baselines 0.26 / 0.30 / 0.36 over three streams, withhold-all 0.06 (the
    same in every stream)."""
    v = cg.causal_gate("probe_rate", [0.26, 0.30, 0.36], [0.06], sampling_se=[0.05, 0.05, 0.05])
    e = v.effect
    assert v.acted and v.status == cg.ACTED and e.design == "fixed-arm" and e.n == 3 and e.df == 2
    assert e.delta == pytest.approx(0.92 / 3 - 0.06) and v.floor.sd == pytest.approx(np.std([0.26, 0.30, 0.36], ddof=1))
    assert v.delta_over_sd == pytest.approx(e.delta / v.floor.sd) and 4.8 < v.delta_over_sd < 5
    assert v.mde == pytest.approx(nf.mde(v.floor.sd, 3, design="fixed-arm"))
    # the binomial error alone (0.05) is nearly the whole observed spread (0.0503)
    assert v.floor.sd_sampling == pytest.approx(0.05)
    assert v.floor.sd_between == pytest.approx(math.sqrt(v.floor.sd ** 2 - 0.05 ** 2)) and v.floor.sd_between < 0.01
    assert cg.causal_gate("probe_rate", [0.26, 0.30, 0.36], [0.06], sampling_se=[0.06] * 3).floor.sd_between == 0.0
    assert v.line.startswith("the planted cause acted: Δ = 0.2467, CI [")
    assert "3 streams, noise floor sd 0.05033, MDE " in v.line and "probe_rate; fixed-arm design" in v.line
    # the withhold-all rate is one measurement too: its binomial error (0.06 of 20 x 4 samples) widens the CI
    vw = cg.causal_gate("probe_rate", [0.26, 0.30, 0.36], [0.06], withheld_se=math.sqrt(0.06 * 0.94 / 80))
    assert vw.acted and vw.effect.se == pytest.approx(math.sqrt(e.se ** 2 + 0.06 * 0.94 / 80)) and vw.mde > v.mde
    report = cg.GateReport((v,), "probe_rate")
    assert report.acted and report.lines() == [v.line]
    d = v.as_dict()
    assert d["acted"] and d["effect_verdict"] == "detected" and d["floor_n_streams"] == 3


def test_an_effect_below_the_noise_floor_did_not_act_and_says_so():
    z = np.linspace(-1, 1, 8)
    unit = (z - z.mean()) / z.std(ddof=1)
    sd = 0.05
    base = 0.3 + sd * unit  # noise floor sd exactly 0.05
    w = base - 0.5 * sd + sd * unit[[3, 0, 6, 1, 7, 2, 5, 4]]  # paired differences: mean 0.5 sd, sd >= 1 sd
    v = cg.causal_gate("probe_pair_logratio", base, w, paired=True)
    assert not v.acted and v.status == cg.NOT_DETECTED and v.effect.design == "paired"
    assert v.effect.ci_low <= 0 <= v.effect.ci_high and v.effect.delta == pytest.approx(0.5 * sd)
    indep = cg.causal_gate("probe_pair_logratio", base, base[::-1] - 0.9 * sd)  # two arms, 0.9 floor sd apart
    assert indep.status == cg.NOT_DETECTED and indep.effect.design == "two-arm" and indep.delta_over_sd < 1
    assert v.line.startswith("the planted cause did not act (not detected): Δ = ")
    assert v.mde == pytest.approx(nf.mde(np.std(base - w, ddof=1), 8, design="paired"))
    margin = cg.causal_gate("logp_margin", base, base + 1.0, paired=False)  # independent arms, detected
    assert margin.status == cg.REVERSED and not margin.acted and margin.effect.design == "two-arm"
    assert margin.line.startswith("the planted cause did not act as planted (reversed")
    assert cg.causal_gate("leakage_rate", base, base + 1.0, expected_sign=0).acted
    report = cg.GateReport((margin, v), primary="probe_pair_logratio")
    lines = report.lines()
    assert not report.acted and lines[0] == v.line and lines[1] == margin.secondary_line and lines[-1] == cg.LABEL_NOT_CAUSE
    assert "label" in cg.LABEL_NOT_CAUSE and "not against a cause" in cg.LABEL_NOT_CAUSE


def test_two_arm_mde_uses_the_pooled_sd_and_bad_input_is_named():
    b, w = np.array([0.3, 0.4, 0.35, 0.45]), np.array([0.1, 0.15, 0.05, 0.2])
    v = cg.causal_gate("probe_rate", b, w)
    pooled = math.sqrt((np.var(b, ddof=1) + np.var(w, ddof=1)) / 2)
    assert v.effect.design == "two-arm" and v.mde == pytest.approx(nf.mde(pooled, 4, design="two-arm"))
    assert v.acted
    with pytest.raises(ValueError, match="expected_sign"):
        cg.causal_gate("probe_rate", b, w, expected_sign=2)
    with pytest.raises(ValueError, match="primary"):
        cg.GateReport((v,), "logp_margin")
    with pytest.raises(ValueError, match="streams"):
        cg.causal_gate("probe_rate", [0.3], [0.1])
    zero = cg.causal_gate("probe_rate", [0.3, 0.3], [0.3])
    assert zero.status == cg.NOT_DETECTED and zero.delta_over_sd == 0.0


def test_gate_measures_gates_each_measure_beside_the_others():
    """Probe, leakage and margin measures gated in one call: the probe measure decides, the leakage
    line stands beside it (expected sign 0: any detected change is reported as acting)."""
    base = {"probe_rate": [0.26, 0.30, 0.36], "leakage_rate": [0.02, 0.01, 0.025], "logp_margin": [-0.05, -0.08, 0.22]}
    held = {"probe_rate": [0.06], "leakage_rate": [0.01], "logp_margin": [0.0]}
    rep = cg.gate_measures(base, held, primary="probe_rate", sampling_se={"probe_rate": [0.05] * 3},
                           expected_signs={"leakage_rate": 0})
    assert rep.acted and [v.measure for v in rep.verdicts] == list(base)
    lines = rep.lines()
    assert len(lines) == 3 and lines[0].startswith("the planted cause acted") and "probe_rate;" in lines[0]
    # the others say what each measure saw, not whether the cause acted (the primary alone decides that)
    assert lines[1].startswith("also leakage_rate: ") and "leakage_rate;" in lines[1]
    assert lines[2].startswith("also logp_margin: not detected (the CI holds 0): Δ = ") and "logp_margin;" in lines[2]
    assert rep.verdicts[0].floor.sd_sampling == pytest.approx(0.05) and np.isnan(rep.verdicts[1].floor.sd_sampling)
    assert not cg.gate_measures(base, held, primary="logp_margin").acted
    with pytest.raises(ValueError, match="no withheld"):
        cg.gate_measures(base, {"probe_rate": [0.06]}, primary="probe_rate")


def test_the_reports_gate_line_says_acted_not_detected_or_not_measured():
    """The report's one-line summary (``causal_gate.summary_line``): the primary's console line; a
    gate that did not act adds that the tables score a label; no gate.json says "not measured"."""
    r = cg.gate_measures({"probe_rate": [0.5, 0.52, 0.48]}, {"probe_rate": [0.1, 0.12, 0.09]}, primary="probe_rate",
                        paired=True)
    acted = {"primary": "probe_rate", "measure_step": 80, "acted": r.acted, "lines": r.lines()}
    assert r.acted and cg.summary_line(acted).startswith("Causal gate (probe_rate, step 80): the planted cause acted")
    assert cg.LABEL_NOT_CAUSE not in cg.summary_line(acted)
    r = cg.gate_measures({"probe_rate": [0.5, 0.1, 0.3]}, {"probe_rate": [0.45, 0.2, 0.25]}, primary="probe_rate",
                        paired=True)
    quiet = {"primary": "probe_rate", "measure_step": 80, "acted": r.acted, "lines": r.lines()}
    assert not r.acted and cg.summary_line(quiet).endswith(cg.LABEL_NOT_CAUSE) and "not detected" in cg.summary_line(quiet)
    assert cg.summary_line(None) == cg.NOT_MEASURED
