"""The measured causal ground truth (issue 31 item 3): its scoring functions on synthetic effects
with known answers, its units, and the counterfactual stage on the smoke run with regenerated
rollouts writing ``causal_*`` rows for both interventions, resumable from its files."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from behaviortrace_jax.attribution import causal as C, noise_floor as NF, replay_plans as P
from behaviortrace_jax.io.replay_request import Track


def test_unit_scores_sum_each_units_rollouts_and_ignore_non_finite():
    s = np.array([1.0, 2.0, -np.inf, 4.0, np.nan, 0.5])
    np.testing.assert_array_equal(C.unit_scores(s, [np.array([0, 1]), np.array([2, 3]), np.array([4, 5])]),
                                  [3.0, 4.0, 0.5])


def test_mean_ci_is_a_t_interval_and_none_for_one_value():
    m, lo, hi = C.mean_ci(np.array([1.0, 3.0]))
    assert m == 2.0 and lo == pytest.approx(2.0 - 12.7062 * 1.0, rel=1e-4) and hi == pytest.approx(2.0 + 12.7062, rel=1e-4)
    assert C.mean_ci(np.array([5.0])) == (5.0, None, None)
    with pytest.raises(ValueError, match="non-empty"):
        C.mean_ci(np.array([]))


def test_a_method_that_ranks_the_units_as_measured_scores_one_and_its_reverse_minus_one():
    effects = np.array([0.1, 3.0, -0.5, 2.0, 0.0, 1.0])
    per_unit = {"perfect": effects * 10, "reverse": -effects, "flat": np.zeros(6)}
    rows = {(r.table, r.method): r for r in C.method_rows("0", "remove_fixed", effects, per_unit, k=2, nboot=50,
                                                         rng_seed=0)}
    sp, pk = "causal_spearman_remove_fixed", "causal_p@k_remove_fixed"
    assert rows[(sp, "perfect")].value == pytest.approx(1.0) and rows[(sp, "reverse")].value == pytest.approx(-1.0)
    assert rows[(sp, "flat")].value == 0.0  # constant scores: 0 (SPEC §6.12's tie rule)
    assert rows[(pk, "perfect")].value == 1.0 and rows[(pk, "reverse")].value == 0.0
    assert rows[(pk, "flat")].value == pytest.approx(2 / 6) and rows[(pk, "flat")].chance == pytest.approx(2 / 6)
    assert rows[(sp, "perfect")].lo <= rows[(sp, "perfect")].value <= rows[(sp, "perfect")].hi
    with pytest.raises(ValueError, match="k"):
        C.method_rows("0", "x", effects, per_unit, k=7, nboot=1, rng_seed=0)


def test_tables_score_the_label_and_rank_the_ground_truth_units():
    """Four units of two rollouts; GT sits in units 0 and 3. Unit 3 has the largest effect, unit 0
    the smallest: the label's Spearman is between, and the GT units' mean percentile is 5/8."""
    units = [np.array([0, 1]), np.array([2, 3]), np.array([4, 5]), np.array([6, 7])]
    is_gt = np.zeros(8, bool)
    is_gt[[0, 6, 7]] = True
    effects = {("withhold-bonus", "regenerated"): np.array([[0.0, 1.0, 2.0, 3.0], [0.2, 1.2, 1.8, 3.2]]),
               ("withhold-bonus", "fixed"): np.array([[0.0, 1.0, 2.0, 3.0]])}
    deltas = {("regenerated", "withhold-all-gt"): np.array([1.0, 2.0]), ("fixed", "withhold-all-gt"): np.array([4.0])}
    scores = {"C1-dot": np.arange(8, dtype=float)}
    rows = C.tables("0", unit_names=["s0", "s1", "s2", "s3"], unit_rollouts=units, effects=effects,
                    label_deltas=deltas, scores=scores, is_gt=is_gt, k_fraction=0.25, nboot=20)
    by = {(r.table, r.method): r for r in rows}
    assert all(C.is_table(r.table) for r in rows)
    assert by[("causal_spearman_withhold-bonus_regenerated", "C1-dot")].value == pytest.approx(1.0)
    label = by[("causal_spearman_withhold-bonus_regenerated", C.LABEL)]
    assert -1 < label.value < 1 and by[("causal_p@k_withhold-bonus_regenerated", C.LABEL)].n == 1
    eff = by[("causal_effect_withhold-bonus_regenerated", "s3")]
    assert eff.value == pytest.approx(3.1) and eff.n == 2 and eff.lo < 3.1 < eff.hi
    assert by[("causal_effect_withhold-bonus_fixed", "s3")].lo is None
    rank = by[("causal_label_regenerated", "gt-unit-rank:withhold-bonus")]
    assert rank.value == pytest.approx((1 / 4 + 1) / 2) and rank.chance == pytest.approx(5 / 8) and rank.n == 2
    gt_all = by[("causal_label_regenerated", "withhold-all-gt")]
    assert gt_all.value == 1.5 and gt_all.n == 2 and by[("causal_label_fixed", "withhold-all-gt")].value == 4.0


def test_effects_below_the_noise_floor_are_not_detected_and_the_tables_are_unchanged():
    """Eight regenerated streams whose baselines spread with sd 1 (a noise floor); unit s1's effect
    is 10 sd in every stream, the others' are noise around 0 (each well inside the floor's MDE):
    only s1 is "detected"; the floor's rows state the sd and the MDE for 8 streams; and every
    existing table is the same with or without the baselines."""
    rng = np.random.default_rng(0)
    units = [np.array([0, 1]), np.array([2, 3]), np.array([4, 5])]
    e = rng.normal(0.0, 0.3, (8, 3))
    e[:, 1] += 10.0
    base = rng.normal(0.0, 1.0, 8)
    kw = dict(unit_names=["s0", "s1", "s2"], unit_rollouts=units,
              effects={("withhold-bonus", "regenerated"): e, ("withhold-bonus", "fixed"): e[:1]},
              label_deltas={}, scores={"C1-dot": np.arange(6, dtype=float)}, is_gt=np.zeros(6, bool),
              k_fraction=0.5, nboot=20)
    with_floor = C.tables("0", baselines={"regenerated": base, "fixed": base[:1]}, **kw)
    plain = C.tables("0", **kw)
    assert [r for r in with_floor if r.table in {p.table for p in plain}] == plain  # old tables unchanged
    by = {(r.table, r.method): r for r in with_floor}
    floor = by[("causal_noise_floor_regenerated", "baseline-sd")]
    assert floor.value == pytest.approx(np.std(base, ddof=1)) and floor.n == 8
    mde = by[("causal_noise_floor_regenerated", "mde")]
    assert mde.value == pytest.approx(NF.mde(np.std(base, ddof=1), 8, design="two-arm")) and mde.value > floor.value
    det = "causal_detected_withhold-bonus_regenerated"
    assert by[(det, "s1")].value == 1.0 and by[(det, "s1")].lo > 0
    for u in ("s0", "s2"):  # below the floor: the CI holds 0, reported "not detected", never "no effect"
        r = by[(det, u)]
        assert r.value == 0.0 and r.lo < 0 < r.hi and abs(r.chance) < 1
    assert not any(t.startswith(("causal_noise_floor_fixed", "causal_detected_withhold-bonus_fixed")) for t, _ in by)


def test_seed_summary_puts_each_seeds_spearman_beside_the_mean_and_the_label_checks():
    """Two seeds of the same toy tables (C1-dot ranks the units as measured in one, backwards in the
    other): its cells are 1.00 and -1.00, the mean 0.00; the label checks get one column a seed."""
    units = [np.array([0, 1]), np.array([2, 3]), np.array([4, 5]), np.array([6, 7])]
    is_gt = np.zeros(8, bool)
    is_gt[[0, 6]] = True
    effects = {("withhold-bonus", "regenerated"): np.array([[0.0, 1.0, 2.0, 3.0], [0.2, 1.2, 1.8, 3.2]])}
    deltas = {("regenerated", "withhold-all-gt"): np.array([1.0, 2.0])}
    rows = []
    for seed, sign in (("0", 1.0), ("1", -1.0)):
        rows += C.tables(seed, unit_names=["s0", "s1", "s2", "s3"], unit_rollouts=units, effects=effects,
                         label_deltas=deltas, scores={"C1-dot": sign * np.arange(8, dtype=float)}, is_gt=is_gt,
                         k_fraction=0.25, nboot=20)
    lines = C.seed_summary_lines(rows, methods=["C1-dot"])
    row = next(line for line in lines if line.startswith("| C1-dot |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1].startswith("1.00 [") and cells[2].startswith("-1.00 [") and cells[3] == "0.00"
    assert cells[4] == "0.50 (0.25)"  # P@k 1 and 0, chance k / U = 1/4
    assert not any(line.startswith(f"| {C.LABEL} |") for line in lines)  # filtered by ``methods``
    gt = next(line for line in lines if "withhold-all-gt" in line)
    assert gt.count("1.500 [") == 2
    assert C.seed_summary_lines([r for r in rows if not r.table.startswith("causal_spearman")]) == []


def _context(**cf_changes):
    """A plan context of the smoke config's shape: a window of 2 steps of 2 rollouts (GT: slot 0)."""
    import dataclasses

    from behaviortrace_jax.stages.spec import RunSpec

    cf = dataclasses.replace(RunSpec.from_config(causal_config()).counterfactual, **cf_changes)
    steps = np.repeat(np.arange(3), 2)
    return P.PlanContext(seed=0, steps=steps, n_per_step=2, group_size=2, cutoff=2, at=2, target_step=2,
                         gt=np.array([0]), scores={"C1-dot": np.arange(6.0)}, replayed={}, measures=("logp_margin",),
                         table_measures=("logp_margin",), cf=cf, nboot=5)


def test_label_only_regenerated_tracks_give_label_deltas_but_no_unit_effects():
    """``counterfactual.causal_regenerated = "label"``: the regenerated tracks hold only their baseline
    and the withhold-all replays, so the unit tables have the fixed track alone and the label rows
    every track; an unknown value is refused naming the key."""
    ctx = _context(causal_regenerated="label", causal_streams=2)
    plan = P.get_plan("single-unit")
    reps = plan.replays(ctx)
    by_track = {t: [r.role for r in reps if r.request.track == t] for t in (Track(), Track("regenerated", 1))}
    assert by_track[Track()].count("unit") == 2 * 2 and "unit" not in by_track[Track("regenerated", 1)]
    assert all(r.request.start_step == r.request.target[0] // 2 for r in reps if r.role == "unit")  # branched
    # the plan states its cost: per track its requests' steps plus the baseline advanced to its last branch
    assert P.plan_cost(reps) == sum(2 - r.request.start_step for r in reps) + 1

    def value(item, out):  # a unit's replay lowers the measure by 1 + its unit index; withhold-all by 0.5
        if item.role == "baseline":
            return 3.0
        return None if item.method == "withhold-bonus" and item.unit == 0 else 3.0 - (0.5 if item.role == "label"
                                                                                         else 1 + item.unit)
    rows = {(r.table, r.method): r for r in plan.rows(ctx, reps, value)}
    assert rows[("causal_effect_remove_fixed", "s1")].value == 2.0
    assert rows[("causal_effect_withhold-bonus_fixed", "s0")].value == 0.0  # skipped: Δ = 0
    assert not any(t.endswith("_regenerated") and t.startswith("causal_effect") for t, _ in rows)
    assert rows[("causal_label_regenerated", P.ALL_GT)].n == 2 and rows[("causal_label_regenerated", P.ALL_GT)].value == 0.5
    with pytest.raises(ValueError, match="causal_regenerated"):
        plan.replays(_context(causal_regenerated="some"))


def test_units_and_tracks():
    from configs import tiny

    from behaviortrace_jax.stages.spec import RunSpec

    spec = RunSpec.from_config(tiny.get_config("smoke"))  # window of 4 steps, 16 rollouts per step, groups of 4
    cut, g = spec.schedule.window_steps(), spec.rollouts.group_size
    steps = P.causal_units(cut, g, 16, "steps")
    assert steps.names == ["s0", "s1", "s2", "s3"] and steps.rollouts[1].tolist() == list(range(16, 32))
    groups = P.causal_units(cut, g, 16, "groups")
    assert len(groups.names) == 16 and groups.names[5] == "s1g1" and groups.rollouts[5].tolist() == [20, 21, 22, 23]
    with pytest.raises(ValueError, match="causal_units"):
        P.causal_units(cut, g, 16, "rollouts")
    # blocks of consecutive steps, the last one shorter (units sized by power)
    blocks = P.causal_units(10, g, 16, "blocks", block_steps=4)
    assert blocks.names == ["s0-3", "s4-7", "s8-9"] and blocks.steps == [0, 4, 8]
    assert blocks.rollouts[1].tolist() == list(range(64, 128)) and blocks.rollouts[2].tolist() == list(range(128, 160))
    with pytest.raises(ValueError, match="causal_block_steps=0"):
        P.causal_units(10, g, 16, "blocks", block_steps=0)
    # a numbered measure step (after the window's momentum), checked against the run's length
    assert spec.schedule.measure_step("5") == 5
    with pytest.raises(ValueError, match="counterfactual.measure: '99'"):
        spec.schedule.measure_step("99")
    assert P.tracks("fixed", 3) == [Track()]
    assert P.tracks("regenerated", 2) == [Track(), Track("regenerated", 0), Track("regenerated", 1)]


# ------------------------------------------------------------------------------------------------
# The stage on the smoke run (acceptance: rollouts=regenerated writes causal_* rows, both interventions)
# ------------------------------------------------------------------------------------------------
def causal_config():
    """The smoke config with a small counterfactual stage: regenerated rollouts, one replayed method."""
    from configs import tiny

    config = tiny.get_config("smoke")
    cf = config.counterfactual
    cf.k_fractions, cf.random_seeds, cf.lds_subsets, cf.lds_fractions = "1.0", 1, 2, "0.5"
    cf.rates, cf.sampled, cf.methods, cf.rollouts, cf.causal_streams = False, 0, "abs-advantage", "regenerated", 2
    cf.topk_recomputed = False
    config.stages = "counterfactual"
    return config


def test_the_stage_with_regenerated_rollouts_writes_causal_rows_for_both_interventions(smoke_finished, tmp_path):
    from behaviortrace_jax import pipeline
    from behaviortrace_jax.attribution import formats

    w = tmp_path / "run"
    shutil.copytree(smoke_finished, w, ignore=shutil.ignore_patterns("counterfactual", ".jax_cache"))
    config = causal_config()
    pipeline.run(config, str(w))
    rows = formats.read_results_csv(w / "results_table.csv")
    tables = {r.table for r in rows}
    for iv in ("remove", "withhold-bonus"):
        for ro in ("fixed", "regenerated"):
            assert {f"causal_spearman_{iv}_{ro}", f"causal_p@k_{iv}_{ro}", f"causal_effect_{iv}_{ro}"} <= tables
    sp = [r for r in rows if r.table == "causal_spearman_withhold-bonus_regenerated"]
    assert {C.LABEL, "abs-advantage", "C1-dot", "norm-only"} <= {r.method for r in sp}  # every scored method
    assert all(r.n == 4 for r in sp)  # the smoke window's 4 step units
    eff = [r for r in rows if r.table == "causal_effect_withhold-bonus_regenerated"]
    assert len(eff) == 4 and all(r.n == 2 and r.lo is not None for r in eff)  # 2 sampler streams: a CI
    label = {r.method: r for r in rows if r.table == "causal_label_regenerated"}
    assert {"withhold-all-gt", "withhold-all-bonuses", "gt-unit-rank:remove", "gt-unit-rank:withhold-bonus"} <= set(label)
    # the top-k replays ran with regenerated rollouts (their files sit under the track's folder)
    assert list((w / "counterfactual" / "replays" / "regenerated0").rglob("*.json"))
    # stream 0's regenerated baseline is the run: the same margin as the fixed baseline
    causal = w / "counterfactual" / "causal"
    f0 = json.loads(next((causal / "fixed" / "base").glob("*.json")).read_text())
    r0 = json.loads(next((causal / "regenerated0" / "base").glob("*.json")).read_text())
    assert f0["measures"] == r0["measures"]
    # rerun with one file made stale (another stream in its key): that replay alone runs again, every
    # other file is read back, and the table is the same bytes (kill -9 safe: one atomic file per replay)
    table = (w / "results_table.csv").read_bytes()
    files = sorted(causal.rglob("*.json"))
    mtimes = [p.stat().st_mtime_ns for p in files]
    stale = next(p for p in sorted((causal / "regenerated1" / "remove").glob("*.json"))
                 if json.loads(p.read_text())["request"]["target"][0] == 2 * 16)  # unit s2
    rec = json.loads(stale.read_text())
    rec["cache"]["request"]["stream"], rec["measures"] = 7, {"2": {"logp_margin": 0.0}}
    stale.write_text(json.dumps(rec))
    mtimes[files.index(stale)] = stale.stat().st_mtime_ns
    pipeline.run(config, str(w))
    assert (w / "results_table.csv").read_bytes() == table
    assert [p.name for p, t in zip(files, mtimes) if p.stat().st_mtime_ns != t] == [stale.name]


def test_metagradient_rows_put_its_prediction_beside_the_measured_replays_of_its_top_and_random_units():
    units = [np.array([i]) for i in range(6)]
    names = [f"s{i}" for i in range(6)]
    pred = np.array([0.1, 2.0, 0.0, 1.0, -1.0, 0.5])
    effects = {("remove", "fixed"): np.array([[0.0, 1.5, 0.1, 0.4, -0.2, 0.3]]),
               ("withhold-bonus", "fixed"): np.zeros((1, 6))}
    rows = C.tables("0", unit_names=names, unit_rollouts=units, effects=effects, label_deltas={},
                    scores={"metagradient": pred}, is_gt=np.zeros(6, bool), k_fraction=2 / 6, nboot=5)
    mg = [r for r in rows if r.table.startswith("causal_metagradient")]
    assert {r.table for r in mg} == {"causal_metagradient_remove_fixed"}  # removal only
    top = [r for r in mg if r.method.startswith("top")]
    assert [(r.method, r.value, r.chance) for r in top] == [("top1:s1", 1.5, 2.0), ("top2:s3", 0.4, 1.0)]
    rnd = [r for r in mg if r.method.startswith("random")]
    assert len(rnd) == 2 and not {r.method.split(":")[1] for r in rnd} & {"s1", "s3"}
    assert all(r.value == effects[("remove", "fixed")][0, int(r.method.split(":s")[1])] for r in rnd)
