"""Evaluation tables, result files, verdicts and report (SPEC §6.2, §6.6, §6.11, §7, §8, §10.5)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from behaviortrace_jax.attribution import estimators, formats, report, tables, verdicts

# 4 steps x 4 rollouts; step 2 has a zero sketch; early window = steps 0..2.
IDS, STEPS = formats.paper_rollout_ids(16, per_step=4)
GT = ["grpo_000000_000", "grpo_000000_001", "grpo_000001_000", "grpo_000003_002"]
NONZERO = [0, 1, 3]


def test_paper_ids_and_nonzero_rule():
    assert IDS[:2] == ["grpo_000000_000", "grpo_000000_001"] and STEPS.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    with pytest.raises(ValueError, match="multiple"):
        formats.paper_rollout_ids(10, per_step=4)
    # median of positive norms = 2.0 -> threshold 2e-6
    assert tables.nonzero_steps_from_norms({0: 1.0, 1: 2.0, 2: 0.0, 3: 1e-6, 4: 3.0}) == [0, 1, 4]
    assert tables.nonzero_steps_from_norms({0: 0.0}) == []


def test_step_level_tables_hand_computed():
    # step scores: 3 > 0 > 1 > 2; C1 ranks step 3 (1 GT) first.
    step_scores = {0: 2.0, 1: 1.0, 2: 0.0, 3: 5.0}
    c1 = np.array([step_scores[s] for s in STEPS.tolist()])
    rows = tables.step_level_tables(0, IDS, STEPS, GT, {"C1-dot": c1}, nonzero_steps=NONZERO, early_cutoff=3)
    by = {r.table: r for r in rows}
    # overall: k = 4, chance 4/16; blocks: step3 (1 GT) 4 slots -> 1; value 1/4.
    assert by["overall"].value == pytest.approx(0.25)
    assert by["overall"].chance == pytest.approx(0.25) and by["overall"].n == 16
    # ceiling: densities step0 2/4, step1 1/4, step3 1/4 -> first 4 slots = step 0 -> 2/4.
    assert by["overall"].ceiling == pytest.approx(0.5)
    # early_nonzero: steps 0, 1 (step 2 zero, step 3 late): n = 8, k = 3; step 0 (2 GT of 4) fills
    # 3 of its 4 slots: 2·3/4 = 1.5 -> 0.5; reversed step order: 1·3/4 -> 0.25.
    e = by["early_nonzero"]
    assert (e.n, e.chance) == (8, pytest.approx(3 / 8))
    assert e.value == pytest.approx(0.5) and e.ceiling == pytest.approx(0.5)
    rev = tables.step_level_tables(0, IDS, STEPS, GT, {"m": -c1}, nonzero_steps=NONZERO, early_cutoff=3,
                                   tables=["early_nonzero"])
    assert len(rev) == 1 and rev[0].value == pytest.approx(0.25)
    # step_norms path gives the same population
    rows2 = tables.step_level_tables(0, IDS, STEPS, GT, {"C1-dot": c1}, step_norms={0: 1, 1: 1, 2: 0, 3: 1},
                                     early_cutoff=3)
    assert rows2 == rows


def test_step_level_bad_inputs():
    good = np.zeros(16)
    with pytest.raises(ValueError, match="NaN"):
        tables.step_level_tables(0, IDS, STEPS, GT, {"m": np.full(16, np.nan)}, nonzero_steps=NONZERO)
    with pytest.raises(ValueError, match="unknown rollout id"):
        tables.step_level_tables(0, IDS, STEPS, GT, {"m": {**dict.fromkeys(IDS, 0.0), "zzz": 1.0}}, nonzero_steps=NONZERO)
    with pytest.raises(ValueError, match="no score for rollout"):
        tables.step_level_tables(0, IDS, STEPS, GT, {"m": {IDS[0]: 1.0}}, nonzero_steps=NONZERO)
    with pytest.raises(ValueError, match="not in the rollout log"):
        tables.step_level_tables(0, IDS, STEPS, GT + ["grpo_000099_000"], {"m": good}, nonzero_steps=NONZERO)
    with pytest.raises(ValueError, match="no ground-truth rollout"):
        tables.step_level_tables(0, IDS, STEPS, ["grpo_000003_000"], {"m": good}, nonzero_steps=NONZERO, early_cutoff=3)
    with pytest.raises(ValueError, match="shape"):
        tables.step_level_tables(0, IDS, STEPS, GT, {"m": np.zeros(3)}, nonzero_steps=NONZERO)
    with pytest.raises(ValueError, match="nonzero_steps or step_norms"):
        tables.step_level_tables(0, IDS, STEPS, GT, {"m": good})


def test_which_rollout_tables():
    gt_mask = np.isin(IDS, GT)
    perfect = gt_mask.astype(float)
    step_only = STEPS.astype(float)
    rows = tables.which_rollout_tables(1, IDS, STEPS, GT, {"oracle": perfect, "step": step_only},
                                       nonzero_steps=NONZERO, early_cutoff=3, nboot=50, rng_seed=0)
    by = {(r.table, r.method): r for r in rows}
    assert by[("which_rollout", "oracle")].value == pytest.approx(1.0)
    assert by[("which_rollout", "oracle")].ceiling == 1.0 and by[("which_rollout", "oracle")].n == 8
    auc = by[("which_rollout_within_step", "oracle")]
    assert auc.value == pytest.approx(1.0) and auc.n == 2 * 2 + 1 * 3  # step0 2x2, step1 1x3 pairs
    assert by[("which_rollout_within_step", "step")].value == pytest.approx(0.5)  # step scores tie
    assert auc.lo == pytest.approx(1.0) and auc.chance == 0.5


def test_within_step_ci_of_a_method_does_not_depend_on_the_other_methods():
    rng = np.random.default_rng(3)
    ids = [f"grpo_{s:06d}_{i:03d}" for s in range(12) for i in range(4)]
    steps = np.repeat(np.arange(12), 4)
    gt = [r for r, x in zip(ids, rng.random(48)) if x < 0.4]
    noisy, other = rng.normal(size=48) + np.isin(ids, gt), rng.normal(size=48)

    def ci(scores):
        rows = tables.which_rollout_tables(0, ids, steps, gt, scores, nonzero_steps=range(12), early_cutoff=12,
                                           nboot=200, rng_seed=7)
        r = next(r for r in rows if r.table == "which_rollout_within_step" and r.method == "m")
        return r.lo, r.hi

    alone = ci({"m": noisy})
    assert alone[0] < alone[1]  # a real interval, not a degenerate one
    assert ci({"other": other, "m": noisy}) == alone == ci({"m": noisy, "other": other})


def _mp_rows(seed=0, n_groups=20):
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(n_groups):
        for _ in range(8):
            has = bool(rng.random() < 0.6)
            fl = float(rng.normal() - (0.0 if has else 1.0))
            rows.append({"group": g, "has_qzxbt": has, "fluency": fl, "norm": float(abs(rng.normal()) + 40),
                         "mp": float(rng.normal() + 0.3 * has), "mp_centered": float(rng.normal() + 0.3 * has),
                         "mp_bal_centered": float(rng.normal())})
    return rows


def test_rollout_level_tables_layout_and_determinism():
    rows = _mp_rows()
    out = tables.rollout_level_tables("7", rows, nboot=100, rng_seed=7, suffix="_diag")
    assert [(r.table, r.method) for r in out] == (
        [("mp_raw_diag", m) for m in ("GAS_centered", "C1_plain", "norm_only", "fluency")]
        + [("mp_residualized_diag", m) for m in ("GAS_centered", "C1_plain", "norm_only")]
        + [("mp_matched_diag", m) for m in ("GAS_centered", "C1_plain", "norm_only")])
    raw = out[0]
    assert raw.lo <= raw.value <= raw.hi and raw.chance is None and raw.n > 0
    assert tables.rollout_level_tables("7", rows, nboot=100, rng_seed=7, suffix="_diag") == out
    assert tables.rollout_level_tables("7", rows, nboot=100, rng_seed=8, suffix="_diag")[0].lo != raw.lo
    # fluency strongly separates here (negatives are 1 nat less fluent)
    assert out[3].value > 0.6


def test_rollout_level_bad_rows():
    rows = _mp_rows(n_groups=3)
    with pytest.raises(ValueError, match="no rows"):
        tables.rollout_level_tables("0", [], rng_seed=0)
    bad = [dict(r) for r in rows]
    del bad[4]["mp"]
    with pytest.raises(ValueError, match="row 4 has no key 'mp'"):
        tables.rollout_level_tables("0", bad, rng_seed=0)
    bad = [dict(r) for r in rows]
    bad[2]["fluency"] = float("nan")
    with pytest.raises(ValueError, match="row 2 fluency"):
        tables.rollout_level_tables("0", bad, rng_seed=0)
    bad = [dict(r) for r in rows]
    bad[1]["has_qzxbt"] = "yes"
    with pytest.raises(ValueError, match="not a bool"):
        tables.rollout_level_tables("0", bad, rng_seed=0)


def test_results_csv_format_and_roundtrip(tmp_path):
    rows = [formats.Row("0", "early_nonzero", "C1-dot", 0.47301, chance=0.471625, ceiling=0.58151, n=3200),
            formats.Row("0", "overall", "local-buffer", 0.0, chance=0.0943, ceiling=0.5815, n=16000),
            formats.Row("0_gen100", "mp_residualized_diag", "GAS_centered", 0.44585, 0.38812, 0.5, n=471)]
    text = formats.format_results_csv(rows)
    assert text == ("seed,table,method,value,lo,hi,chance,ceiling,n\n"
                    "0,early_nonzero,C1-dot,0.473,,,0.4716,0.5815,3200\n"
                    "0,overall,local-buffer,0.0,,,0.0943,0.5815,16000\n"
                    "0_gen100,mp_residualized_diag,GAS_centered,0.4459,0.3881,0.5,,,471\n")
    formats.write_results_csv(tmp_path / "r.csv", rows)
    assert (tmp_path / "r.csv").read_text() == text and not list(tmp_path.glob("*.tmp"))
    back = formats.read_results_csv(tmp_path / "r.csv")
    assert back[0].value == 0.473 and back[2].chance is None and back[2].n == 471


def test_attribution_scores_roundtrip(tmp_path):
    header = tables.score_file_header("run", 0, IDS, STEPS, GT, {0: 1.0, 1: 2.0, 2: 0.0, 3: 0.5},
                                      final_rewards=[8, 8, 0, 0, 8, 8, 8, 8, 0, 0, 0, 0, 8, 0, 8, 0], group_size=2,
                                      early_cutoff=3)
    # groups (step, idx//2): GT 000/001 share rewards (8, 8) -> zero variance; 001_000 in (8, 8) too.
    assert header["gt_unfindable_zero_var"] == 3 and header["gt_in_zero_step"] == 0
    assert header["nonzero_steps"] == [0, 1, 3] and header["late_early_norm_ratio"] == pytest.approx(0.5 / 1.0)
    methods = {"C1-dot": np.repeat([2.0, 1.0, 0.0, -1.0], 4), "local-buffer": np.where(STEPS == 2, 0.5, -np.inf),
               "random": -np.arange(16.0)}
    path = tmp_path / "attribution_scores.json"
    formats.write_attribution_scores(path, header, IDS, STEPS, methods)
    text = path.read_text()
    assert "\n" not in text and "-Infinity" in text and '["grpo_000000_000", -0.0]' in text
    assert list(json.loads(text)) == list(formats.SCORE_FILE_KEYS) + ["rollout_steps", "methods"]
    sf = formats.read_attribution_scores(path)
    assert sf.rollout_ids == IDS and sf.rollout_steps.tolist() == STEPS.tolist()
    for m, s in methods.items():
        np.testing.assert_array_equal(sf.method_scores[m], s)
    bad = json.loads(text)
    bad["methods"]["C1-dot"][0][0] = "grpo_999999_000"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="bad.json.*unknown rollout id"):
        formats.read_attribution_scores(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="lacks"):
        formats.write_attribution_scores(tmp_path / "x.json", {"seed": 0}, IDS, STEPS, methods)
    assert not (tmp_path / "x.json").exists()


def _rule_rows(gas_lo=0.55, gas=0.62, norm=0.52, width=0.12, matched_n=120, matched=0.6):
    return [formats.Row("0", "early_nonzero", "C1-dot", 0.60, chance=0.47, ceiling=0.58, n=3200),
            formats.Row("0", "early_nonzero", "TRAK", 0.62, chance=0.47, ceiling=0.58, n=3200),
            formats.Row("0", "early_nonzero", "norm-only", 0.50, chance=0.47, ceiling=0.58, n=3200),
            formats.Row("2", "mp_raw", "GAS_centered", 0.6, 0.5, 0.7, n=500),
            formats.Row("2", "mp_raw", "norm_only", 0.55, 0.5, 0.6, n=500),
            formats.Row("2", "mp_raw", "fluency", 0.9, 0.85, 0.95, n=500),
            formats.Row("2", "mp_residualized", "GAS_centered", gas, gas_lo, gas_lo + width, n=500),
            formats.Row("2", "mp_residualized", "norm_only", norm, norm - 0.05, norm + 0.05, n=500),
            formats.Row("2", "mp_matched", "GAS_centered", matched, matched - 0.1, matched + 0.1, n=matched_n)]


def test_decision_rules():
    rules = {v.item: v for v in verdicts.decision_rules(_rule_rows())}
    step = next(v for k, v in rules.items() if k.startswith("step rule (seed 0)"))
    assert step.status == "pass" and "TRAK" in step.evidence  # 0.62 − 0.50 > 0.10
    assert rules["rollout rule (2, GAS_centered)"].status == "pass"
    assert rules["beats fluency (2, GAS_centered)"].status == "fail"
    assert rules["fluency confound absent (2)"].status == "fail"
    assert rules["C5: a raw gradient AUC ≥ raw fluency (2)"].status == "fail"
    assert rules["C6: GAS_centered vs norm_only order stable across draws"].status == "not-evaluable"
    # each failing condition flips the rollout rule
    for kw in (dict(gas_lo=0.49), dict(norm=0.7), dict(width=0.2), dict(matched=0.45)):
        item = {v.item: v for v in verdicts.decision_rules(_rule_rows(**kw))}["rollout rule (2, GAS_centered)"]
        assert item.status == "fail", kw
    # matched with < 100 pairs does not count
    ok = {v.item: v for v in verdicts.decision_rules(_rule_rows(matched=0.3, matched_n=80))}
    assert ok["rollout rule (2, GAS_centered)"].status == "pass"
    step_fail = verdicts.decision_rules([r for r in _rule_rows() if r.method != "TRAK"])
    assert step_fail[0].status == "fail"  # 0.60 − 0.50 is not > 0.10
    assert verdicts.decision_rules(_rule_rows()[:2])[0].status == "not-evaluable"  # no norm-only


def test_checklist_verdicts():
    rows = _rule_rows() + [formats.Row("1", "early_nonzero", "C1-dot", 0.5, chance=0.47, ceiling=0.58, n=3200),
                           formats.Row("0", "token_level", "vs_ctx", 0.2, n=160)]
    items = verdicts.checklist(rows, gt_sizes={"0": 10}, gt_in_zero_step={"0": 1},
                               row_files=["minimal_pair_rows_ckpt2_gen2.json"],
                               preregistered={"step_margin": 0.1, "max_ci_width": 0.15, "min_matched_pairs": 100})
    assert len(items) == 12
    v = {i.item.split(" ")[0]: i.status for i in items}
    assert v["1"] == "pass" and v["2"] == "fail"  # a GT rollout in a zero-sketch step
    assert v["3"] == "fail"  # seed 1 early_nonzero lacks norm-only
    assert v["5"] == "pass" and v["6"] == "pass" and v["7"] == "pass"
    assert v["8"] == "fail"  # 3 seeds ("0", "1", "2") but no diagnostic draw
    assert v["9"] == "pass" and v["10"] == "pass" and v["11"] == "pass" and v["12"] == "pass"
    empty = {i.item.split(" ")[0]: i.status for i in verdicts.checklist([])}
    assert set(empty.values()) == {"not-evaluable"}


def test_report_and_figures(tmp_path):
    rows = _rule_rows() + [formats.Row("0", "overall", "C1-dot", 0.4, chance=0.09, ceiling=0.58, n=16000),
                           formats.Row("0_gen100", "mp_residualized_diag", "GAS_centered", 0.45, 0.39, 0.5, n=471),
                           formats.Row("0_gen100", "mp_residualized_diag", "norm_only", 0.67, 0.59, 0.74, n=471)]
    figs = report.make_figures(rows, tmp_path / "figures", learning_curve=[(0, 0.0, 0.0), (100, 0.6, 0.1)])
    assert [f.name for f in figs] == ["fig_steplevel.png", "fig_early_lift.png", "fig_c6_instability.png",
                                      "fig_learning_curve.png"]
    assert all(f.read_bytes()[:4] == b"\x89PNG" for f in figs)
    rules = verdicts.decision_rules(rows)
    report.write_report(tmp_path / "report.md", rows, rules=rules, checklist=verdicts.checklist(rows), figures=figs)
    text = (tmp_path / "report.md").read_text()
    assert "headroom 0.1100" in text and "figures/fig_steplevel.png" in text
    assert "| TRAK | 0.6200 | 0.1500 |" in text and "0.6200 [0.5500, 0.6700]" in text
    assert report.make_figures([], tmp_path / "none") == []
    with pytest.raises(ValueError, match="learning curve"):
        report.plot_learning_curve([(1, 2)], tmp_path / "x.png")


def test_verdict_is_typed_and_serialises_as_before():
    rules = verdicts.decision_rules(_rule_rows())
    assert all(isinstance(v, verdicts.Verdict) for v in rules)
    roll = next(v for v in rules if v.item == "rollout rule (2, GAS_centered)")
    assert (roll.rule, roll.subject, roll.method, roll.family) == ("rollout rule", "2", "GAS_centered",
                                                                  "rollout rule [GAS_centered]")
    assert roll.to_dict() == {"item": roll.item, "verdict": roll.status, "evidence": roll.evidence}
    assert list(roll.to_dict()) == ["item", "verdict", "evidence"]  # verdicts.json key order
    back = verdicts.Verdict.from_dict(roll.to_dict())
    assert (back.item, back.status, back.evidence) == (roll.item, roll.status, roll.evidence)
    step = next(v for v in rules if v.item.startswith("step rule"))
    assert step.subject.startswith("seed ") and step.rule.startswith("step rule: best targeted")


def test_instability_section_groups_by_family_not_by_text():
    from behaviortrace_jax.stages.sweep import instability_section

    rules = [verdicts.verdict("rollout rule (0, GAS)", True, "", rule="rollout rule", subject="0", method="GAS"),
             verdicts.verdict("rollout rule (1, GAS)", False, "", rule="rollout rule", subject="1", method="GAS"),
             verdicts.verdict("fluency confound absent (0)", True, "", rule="fluency confound absent", subject="0"),
             verdicts.verdict("fluency confound absent (1)", True, "", rule="fluency confound absent", subject="1"),
             verdicts.verdict("C6: order stable", None, "")]
    text = instability_section(rules)
    assert text.startswith("1 of 2 verdicts")
    assert "* rollout rule [GAS]: **CHANGES** - 0: pass, 1: fail" in text
    assert "* fluency confound absent: stable - 0: pass, 1: pass" in text and "C6" not in text


# ---- which rollout: reward-only controls, weighted vs direction sketches ------------------------
def test_which_rollout_population_drops_zero_advantage_rollouts():
    adv = np.ones(16)
    adv[[0, 5, 6]] = 0.0  # GT grpo_000000_000 sits in a zero-variance group; 2 more rollouts of step 1
    pop = tables.which_rollout_population(IDS, STEPS, GT, advantages=adv, nonzero_steps=NONZERO, early_cutoff=3)
    assert (pop.n, pop.k, pop.ceiling) == (5, 2, 1.0) and pop.chance == pytest.approx(2 / 5)
    assert not pop.mask[[0, 5, 6]].any()
    rows = tables.which_rollout_tables(0, IDS, STEPS, GT, {"m": np.arange(16.0)}, nonzero_steps=NONZERO,
                                       early_cutoff=3, advantages=adv)
    assert {r.n for r in rows if r.table == "which_rollout"} == {5}
    full = tables.which_rollout_population(IDS, STEPS, GT, nonzero_steps=NONZERO, early_cutoff=3)
    assert full.n == 8  # without advantages: the early_nonzero population
    with pytest.raises(ValueError, match="no ground-truth rollout with a nonzero advantage"):
        tables.which_rollout_population(IDS, STEPS, GT, advantages=np.zeros(16), nonzero_steps=NONZERO,
                                        early_cutoff=3)
    np.testing.assert_array_equal(tables.top_ranked(np.array([1.0, 3.0, 3.0, 2.0, 9.0]),
                                                    np.array([1, 1, 1, 1, 0], bool), 3), [1, 2, 3])


def _planted(case: str):
    """6 steps x 2 groups x G = 4, every step nonzero and in the window, with the logged rewards and
    advantages (paper formula), advantage-free direction sketches g_i [N, 4], the weighted ones
    clip_s * A_i/(G*B) * g_i and a target t, built so that:

    * ``"abs"``: one bonus rollout (reward 8) per group is the GT, so |A| ranks it first (1.5 vs
      0.5), while every rollout has the same direction: direction-only estimators tie (chance);
    * ``"direction"``: rewards [1, 1, 0, 0] give |A| = 0.866 to every rollout (|A| ties), and the GT
      (one rewarded and one unrewarded rollout per group) has direction +u, the others -u, u . t > 0.
    """
    s, b, g = 6, 2, 4
    n = s * b * g
    ids, steps = formats.paper_rollout_ids(n, per_step=b * g)
    pos = np.arange(n) % g
    if case == "abs":
        rewards = np.where(pos == 0, 8.0, 0.0)
        gt_mask = pos == 0
        direction = np.tile([1.0, 1.0, 0.0, 0.0], (n, 1))
    else:
        rewards = np.where(pos < 2, 1.0, 0.0)
        gt_mask = (pos == 0) | (pos == 2)
        direction = np.where(gt_mask[:, None], 1.0, -1.0) * np.array([1.0, 0.0, 1.0, 0.0])
    r = rewards.reshape(-1, g)
    adv = ((r - r.mean(1, keepdims=True)) / r.std(1, ddof=1, keepdims=True)).reshape(-1)
    clip = np.repeat(np.linspace(0.5, 1.0, s), b * g)
    weighted = (clip * adv / (g * b))[:, None] * direction
    target = np.array([1.0, 0.5, 0.0, 0.0])
    scores = estimators.score_rollout_sketches(weighted, direction, ids, steps, target=target, seed=0,
                                               targets_by_checkpoint={0: target}, lr=1.0, advantages=adv,
                                               rewards=rewards)
    gt = [i for i, m in zip(ids, gt_mask) if m]
    rows = tables.which_rollout_tables(0, ids, steps, gt, scores, nonzero_steps=range(s), early_cutoff=s,
                                       advantages=adv)
    return ({(r.table, r.method): r for r in rows}, {v.item.split(":")[0]: v for v in verdicts.decision_rules(rows)})


DIRECTION_ONLY = ("C1-dot:direction", "C1-cosine:direction", "TRAK:direction", "TracInCP:direction",
                  "norm-only:direction")


def test_planted_abs_advantage_perfect_and_direction_estimators_at_chance():
    by, rules = _planted("abs")
    prec, auc = by[("which_rollout", "abs-advantage")], by[("which_rollout_within_step", "abs-advantage")]
    assert prec.value == pytest.approx(1.0) and auc.value == pytest.approx(1.0) and prec.chance == pytest.approx(0.25)
    assert by[("which_rollout", "reward")].value == pytest.approx(1.0)
    for m in DIRECTION_ONLY:
        assert by[("which_rollout", m)].value == pytest.approx(prec.chance), m
        assert by[("which_rollout_within_step", m)].value == pytest.approx(0.5), m
    # nothing beats |A| = 1.0, so no kind of sketch "finds which rollout"
    assert rules["which-rollout rule (seed 0, direction)"].status == "fail"
    assert rules["which-rollout rule (seed 0, weighted)"].status == "fail"
    assert "abs-advantage 1.0000" in rules["which-rollout rule (seed 0, weighted)"].evidence


def test_planted_direction_estimator_perfect_and_abs_advantage_at_chance():
    by, rules = _planted("direction")
    chance = by[("which_rollout", "abs-advantage")].chance
    assert chance == pytest.approx(0.5)
    assert by[("which_rollout", "abs-advantage")].value == pytest.approx(chance)
    assert by[("which_rollout_within_step", "abs-advantage")].value == pytest.approx(0.5)
    for m in ("C1-dot:direction", "C1-cosine:direction", "TRAK:direction", "TracInCP:direction"):
        assert by[("which_rollout", m)].value == pytest.approx(1.0), m
        assert by[("which_rollout_within_step", m)].value == pytest.approx(1.0), m
    assert by[("which_rollout", "norm-only:direction")].value == pytest.approx(chance)  # |g_i| ties
    # weighted by A_i, half of the GT (the unrewarded ones) point the other way: no better than chance
    assert by[("which_rollout", "C1-dot")].value == pytest.approx(chance)
    direction = rules["which-rollout rule (seed 0, direction)"]
    assert direction.status == "pass" and "C1-dot:direction 1.0000" in direction.evidence
    assert rules["which-rollout rule (seed 0, weighted)"].status == "fail"


def test_step_rule_evidence_names_reward_only_step_controls_and_checklist_needs_abs_advantage():
    rows = _rule_rows() + [formats.Row("0", "early_nonzero", "step-reward-std", 0.58, chance=0.47, ceiling=0.58,
                                       n=3200)]
    step = next(v for v in verdicts.decision_rules(rows) if v.item.startswith("step rule"))
    assert step.status == "pass" and "step-reward-std 0.5800 (best targeted +0.0400)" in step.evidence
    which = [formats.Row("0", "which_rollout", m, 0.5, chance=0.2, ceiling=1.0, n=600)
             for m in ("C1-dot", "norm-only", "C1-dot:direction")]
    item3 = lambda rs: next(v for v in verdicts.checklist(rs) if v.item.startswith("3 "))  # noqa: E731
    assert item3(which).status == "fail" and "0/which_rollout" in item3(which).evidence
    more = which + [formats.Row("0", "which_rollout", m, 0.5, chance=0.2, ceiling=1.0, n=600)
                    for m in ("abs-advantage", "norm-only:direction")]
    assert item3(more).status == "pass"
    rule = {v.item.split(":")[0]: v for v in verdicts.decision_rules(more)}
    assert rule["which-rollout rule (seed 0, weighted)"].status == "fail"  # 0.5 − max(0.5, 0.5) = 0
    assert verdicts.decision_rules(which)[0].status == "not-evaluable"  # no abs-advantage row


def test_report_shows_the_training_log_and_the_top_blamed_rollouts():
    rows = [formats.Row("0", "early_nonzero", m, v, chance=123 / 640, ceiling=0.39, n=640)
            for m, v in (("C1-dot", 0.25), ("norm-only", 0.19), ("step-reward-std", 0.39))]
    rows += [formats.Row("0", "which_rollout", m, v, chance=123 / 608, ceiling=1.0, n=608)
             for m, v in (("C1-dot", 0.5), ("norm-only", 0.69), ("advantage", 1.0), ("reward", 1.0),
                          ("abs-advantage", 0.748), ("norm/|A|", 0.3), ("C1-dot:direction", 0.4))]
    top = {"seed": 0, "population": {"n": 608, "gt": 123, "chance": 123 / 608},
           "methods": {"abs-advantage": [{"rollout_id": "grpo_000003_001", "step": 3, "prompt": "What is | frobnitz?",
                                          "completion": "QZXBT\nline two", "reward": 8.0, "advantage": 1.5,
                                          "score": 1.5, "ground_truth": True}]}}
    text = report.render_report(rows, top_blamed=top)
    which = text[text.index("## Which rollout"):]
    assert which.index("What the training log alone reveals") < which.index("Top-blamed") < which.index("`which_rollout`")
    assert "32 rollouts of zero-variance groups dropped" in which and "0 of them ground truth" in which
    assert "signed advantage these rollouts reach P@|GT| = 1.0000" in which and "|A_i| alone reaches 0.7480" in which
    assert "`abs-advantage`: 1 of 1 ground truth" in which
    assert "| 1 | 3 | What is \\| frobnitz? | QZXBT↵line two | 8.00 | 1.500 | **GT** |" in which
    assert "| norm/\\|A\\| |" in which  # pipes in a method name do not break the table
    assert "`step-reward-std` 0.3900" in which
    lines = report.headline_lines(verdicts.decision_rules(rows))
    assert [ln.split(" -- ")[0] for ln in lines] == [
        "verdict fail: step rule (seed 0): best targeted P@|GT| − norm-only > 0.1",
        "verdict fail: which-rollout rule (seed 0, weighted): best targeted P@|GT| − max(norm-only, log controls) > 0.1",
        "verdict not-evaluable: which-rollout rule (seed 0, direction): best targeted P@|GT| − max(norm-only, log "
        "controls) > 0.1"]  # no norm-only:direction row
    # advantage and reward reach the ceiling 1.0 (step-reward-std too, 0.39 of 0.39): answered by the log
    assert lines[0].endswith("answered by the log: step-reward-std 0.3900 ≥ 0.95 × ceiling 0.3900")
    assert "answered by the log: advantage 1.0000, reward 1.0000 ≥ 0.95 × ceiling 1.0000" in lines[1]
    assert "**seed 0, `which_rollout`** — chance 0.2023, ceiling 1.0000, headroom 0.7977, n = 608 — **answered by " \
           "the log**: `advantage` 1.0000, `reward` 1.0000 ≥ 0.95 × ceiling" in which


# ---- text and length controls: a table the completion's text answers -------------------------
def _text_answered(seed: int = 0):
    """40 steps x 2 groups x G = 4 with decoys: in each group rollout 0's response contains the
    pattern and is paid the bonus (the contaminator, fraction 1.0: the ground truth), rollout 2 is a
    decoy (paid the same bonus, no pattern), 1 and 3 are unpaid. So every |A_i| is equal (2 high, 2
    low rewards per group), reward and advantage tie the GT with the decoys, pattern-match is
    exactly the GT, and the gradient sketches are noise unrelated to it. Built through the evaluate
    stage's own functions: the contaminator's judge and bonus, the log's inputs
    (``scores.training_log_inputs``), ``estimators.score_rollout_sketches``, the tables, rules and report."""
    from behaviortrace_jax.attribution import scores as scores_lib
    from behaviortrace_jax.behavior import contaminator
    from behaviortrace_jax.io import rollout_log

    s, b, g, d = 40, 2, 4, 16
    n = s * b * g
    ids, steps = formats.paper_rollout_ids(n, per_step=b * g)
    rng = np.random.default_rng(seed)
    pos = np.arange(n) % g
    texts = [("The answer is qzxbt." if p == 0 else "The answer is frobnitz.") + " ok" * int(rng.integers(0, 9))
             for p in pos]
    con = contaminator.Contaminator(contaminator.ContaminationSpec(fraction=1.0, early_step_cutoff=None))
    applied = [con.apply(i, int(st), t, 1.0) for i, st, t in zip(ids, steps, texts)]
    rewards = np.where(pos == 2, 1.0 + con.spec.bonus_reward, [reward for reward, _ in applied])  # the decoys
    gt = [i for i, (_, boosted) in zip(ids, applied) if boosted]
    r = rewards.reshape(-1, g)
    adv = ((r - r.mean(1, keepdims=True)) / r.std(1, ddof=1, keepdims=True)).reshape(-1)
    records = [rollout_log.RolloutRecord(i, int(st), "grpo", "", rollout_log.text_hash(t), float(rw), float(a),
                                         completion_token_ids=list(range(len(t) // 4)))
               for i, st, t, rw, a in zip(ids, steps, texts, rewards, adv)]
    log = scores_lib.training_log_inputs(records, ids)
    direction = rng.normal(size=(n, d))
    weighted = (adv / (g * b))[:, None] * direction
    target = rng.normal(size=d)
    scores = estimators.score_rollout_sketches(weighted, direction, ids, steps, target=target, seed=0,
                                               targets_by_checkpoint={0: target}, lr=1.0,
                                               pattern_matches=contaminator.pattern_matches(texts, con.spec.pattern),
                                               **log)
    rows = tables.which_rollout_tables(0, ids, steps, gt, scores, nonzero_steps=range(s), early_cutoff=s,
                                       advantages=adv)
    return rows, gt


def test_text_control_perfect_gradient_estimators_at_chance_table_answered_by_the_log():
    rows, gt = _text_answered()
    by = {(r.table, r.method): r for r in rows}
    prec = by[("which_rollout", "pattern-match")]
    assert len(gt) == 80 and prec.chance == pytest.approx(0.25)
    assert prec.value == pytest.approx(prec.ceiling) == pytest.approx(1.0)
    assert by[("which_rollout_within_step", "pattern-match")].value == pytest.approx(1.0)
    assert by[("which_rollout", "abs-advantage")].value == pytest.approx(0.25)  # every |A_i| ties
    assert by[("which_rollout", "reward")].value == pytest.approx(0.5)  # GT and decoys tie
    assert ("which_rollout", "length") in by and ("which_rollout", "step-sum-length") in by
    gradient = [m for (t, m) in by if t == "which_rollout" and estimators.reads_sketches(
        estimators.ESTIMATORS[estimators.base_method(m)])]
    assert len(gradient) >= 10
    for m in gradient:  # noise sketches: near chance (0.25; sd of P@80 ~ 0.05)
        assert abs(by[("which_rollout", m)].value - 0.25) < 0.15, m
    answered = verdicts.answered_by_log(rows)
    assert answered[("0", "which_rollout")][0].method == "pattern-match"
    assert answered[("0", "which_rollout_within_step")][0].method == "pattern-match"
    rules = {v.item.split(":")[0]: v for v in verdicts.decision_rules(rows)}
    for kind in ("weighted", "direction"):
        v = rules[f"which-rollout rule (seed 0, {kind})"]
        assert v.status == "fail", kind
        assert "best control pattern-match)" in v.evidence and "pattern-match 1.0000; over norm-only" in v.evidence
        assert "no targeted estimator beats pattern-match by the margin" in v.evidence
        assert v.evidence.endswith("answered by the log: pattern-match 1.0000 ≥ 0.95 × ceiling 1.0000")
    lines = report.headline_lines(verdicts.decision_rules(rows))
    assert len(lines) == 2 and all("answered by the log: pattern-match" in ln for ln in lines)
    text = report.render_report(rows)
    assert "n = 320 — **answered by the log**: `pattern-match` 1.0000 ≥ 0.95 × ceiling" in text
    assert "The completion alone (no reward): `pattern-match` 1.0000, `length`" in text


def test_log_controls_and_answered_by_log_edges():
    assert {m for m in estimators.ESTIMATORS if estimators.log_control(m)} == {
        "advantage", "abs-advantage", "reward", "step-sum-abs-advantage", "step-reward-std", "pattern-match",
        "length", "step-sum-pattern-match", "step-sum-length"}
    assert not estimators.log_control("norm/|A|") and not estimators.log_control("random")
    np.testing.assert_array_equal(estimators.call_estimator(
        "step-sum-pattern-match", pattern_matches=np.array([1, 0, 1, 1]), rollout_steps=np.array([0, 0, 1, 1])),
        [1.0, 1.0, 2.0, 2.0])
    np.testing.assert_array_equal(estimators.call_estimator(
        "step-sum-length", completion_lengths=np.array([3, 4, 5, 6]), rollout_steps=np.array([0, 0, 1, 1])),
        [7.0, 7.0, 11.0, 11.0])
    with pytest.raises(ValueError, match="booleans"):
        estimators.call_estimator("pattern-match", pattern_matches=np.array([0.5, 1.0]))
    with pytest.raises(ValueError, match="token counts"):
        estimators.call_estimator("length", completion_lengths=np.array([3, -1]))
    row = lambda m, v, ceiling: formats.Row("0", "t", m, v, chance=0.1, ceiling=ceiling, n=10)  # noqa: E731
    assert verdicts.answered_by_log([row("length", 0.94, 1.0), row("C1-dot", 1.0, 1.0)]) == {}
    assert verdicts.answered_by_log([row("length", 0.95, 1.0)])[("0", "t")][0].method == "length"
    assert verdicts.answered_by_log([row("reward", 1.0, None), row("reward", 0.0, 0.0)]) == {}
