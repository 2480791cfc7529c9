"""The replay engine's extension points (issue 46 items 1-3), each used from this file alone: an
intervention ("negate the bonus"), a measure and a replay plan registered here run end to end
through the counterfactual stage on the smoke run; and the stage order of issue 49 item 5
(counterfactual before evaluate and report) keeps the causal tables in results_table.csv and
report.md. Plus the numpy estimators of the registered plans on designs with known answers."""
from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from behaviortrace_jax.attribution import formats, replay_estimators as E, replay_plans as P
from behaviortrace_jax.train.measures import Measure, register_measure
from behaviortrace_jax.train.interventions import StepEffect, get_intervention, register_intervention
from behaviortrace_jax.io.replay_request import Track


@register_intervention("negate-bonus", recomputes_advantages=True)
def negate_bonus(rewards, base, target):
    """The targeted rollouts' bonus is paid with the opposite sign: reward = base - bonus."""
    return StepEffect(rewards=np.where(target, 2 * base - rewards, rewards).astype(np.float32))


@register_measure("probe-gap", version=1)
class ProbeGap(Measure):
    """The probes' pattern log-prob minus half the controls' (shares the forward of the margin)."""

    def __call__(self, params, memo):
        lp, n = self.env.pattern_logprobs(params, memo), self.env.pattern_batch()[3]
        return {"probe_gap": float(lp[:n].mean()) - 0.5 * float(lp[n:].mean())}


@P.register_plan("first-two-steps")
class FirstTwoSteps(P.ReplayPlan):
    """The window's first two steps negated at once, on fixed rollouts, against the baseline."""

    def replays(self, ctx):
        both = np.arange(2 * ctx.n_per_step)
        return [P.PlannedReplay(ctx.request(Track()), "baseline"),
                P.PlannedReplay(ctx.request(Track(), "negate-bonus", both), "subset")]

    def rows(self, ctx, replays, value):
        base, cut = replays
        return [formats.Row(ctx.label, P.measure_table("first_two_steps", out), "negate-bonus",
                            value(base, out) - (value(base, out) if value(cut, out) is None else value(cut, out)), n=2)
                for out in ctx.table_measures]


def test_the_registered_intervention_declares_its_effect():
    iv = get_intervention("negate-bonus")
    eff = iv.step(np.array([1.0, 3.0], np.float32), np.array([1.0, 1.0], np.float32), np.array([True, True]))
    assert eff.rewards.tolist() == [1.0, -1.0] and eff.weights is None and iv.recomputes_advantages
    with pytest.raises(ValueError, match="already registered"):
        register_intervention("negate-bonus", recomputes_advantages=True)(negate_bonus)
    with pytest.raises(ValueError, match="not registered; known"):
        get_intervention("negate")


def test_estimators_recover_additive_unit_effects():
    beta = np.array([0.5, -1.0, 2.0, 0.0, 0.25])
    x = E.fractional_factorial(5)
    assert x.shape == (8, 5) and np.all(x.sum(axis=0) == 0) and np.all(x.T.astype(int) @ x == 8 * np.eye(5))
    base = 3.0
    np.testing.assert_allclose(E.factorial_contrast(base, x, base - (x > 0) @ beta), beta, atol=1e-12)
    rng = np.random.default_rng(0)
    d = (rng.random((40, 5)) < 0.5).astype(np.int8)
    np.testing.assert_allclose(E.least_squares(base, d, base - d @ beta), beta, atol=1e-9)
    np.testing.assert_array_equal(E.difference(base, base - beta), beta)


def test_registered_intervention_measure_and_plan_run_through_the_stage_and_evaluate_keeps_them(
        smoke_finished, tmp_path):
    """Issue 46's registration tests and issue 49 item 5's stage order, on one copy of the smoke run:
    ``base,sft,grpo,sketch,draws,counterfactual,evaluate,report`` (the finished stages skip)."""
    from behaviortrace_jax import pipeline
    from configs import tiny

    w = tmp_path / "run"
    shutil.copytree(smoke_finished, w, ignore=shutil.ignore_patterns("counterfactual", ".jax_cache"))
    config = tiny.get_config("smoke")
    cf = config.counterfactual
    cf.causal, cf.causal_interventions, cf.rates, cf.sampled = "only", "negate-bonus", False, 0
    cf.measures, cf.table_measures, cf.plans = "probe-gap", "logp_margin,probe_gap", "first-two-steps"
    config.stages = "base,sft,grpo,sketch,draws,counterfactual,evaluate,report"
    pipeline.run(config, str(w))
    rows = formats.read_results_csv(w / "results_table.csv")
    tables = {r.table for r in rows}
    # the intervention's single-unit branches, for both table measures, and the label checks
    assert {"causal_effect_negate-bonus_fixed", "causal_spearman_negate-bonus_fixed",
            "causal_effect_negate-bonus_fixed[probe_gap]", "causal_label_fixed"} <= tables
    # the plan's rows, per table measure; its replay really moved the behaviour
    plan = {r.table: r for r in rows if r.table.startswith("first_two_steps")}
    assert set(plan) == {"first_two_steps", "first_two_steps[probe_gap]"} and plan["first_two_steps"].value != 0.0
    # evaluate ran after the counterfactual stage and kept its rows; the report carries its section
    assert {"overall", "which_rollout"} <= tables  # evaluate's own tables
    own = formats.read_results_csv(w / "counterfactual" / "results_rows.csv")
    assert len(own) > 0 and all(r in rows or np.isnan(r.value) for r in own)
    assert len(rows) > len(own)  # evaluate's own rows are there too
    report = (w / "report.md").read_text()
    assert "## Counterfactual replay" in report and "causal" in report.lower()
    # a later evaluate (e.g. rerun alone) still keeps them
    config.stages = "evaluate,report"
    pipeline.run(config, str(w))
    again = formats.read_results_csv(w / "results_table.csv")
    assert {r.table for r in again} == tables and "## Counterfactual replay" in (w / "report.md").read_text()


@pytest.mark.parametrize("name", ["datamodels", "factorial"])
def test_subset_plans_recover_additive_unit_effects_from_their_replays(name):
    """The ``datamodels`` and ``factorial`` plans on a toy context of 4 step units: replays whose
    measure drops by the sum of their units' effects give back those effects (least squares;
    main-effect contrasts), and each plan states its cost (every replay from step 0 to the measure step)."""
    import dataclasses

    from behaviortrace_jax.stages.spec import RunSpec
    from configs import tiny

    cf = dataclasses.replace(RunSpec.from_config(tiny.get_config("smoke")).counterfactual, plan_subsets=24)
    ctx = P.PlanContext(seed=0, steps=np.repeat(np.arange(6), 2), n_per_step=2, group_size=2, cutoff=4, at=4,
                        target_step=4, gt=np.array([0]), scores={"exact": np.repeat([0.5, -1.0, 2.0, 0.25, 0, 0], 2)},
                        replayed={}, measures=("logp_margin",), table_measures=("logp_margin",), cf=cf, nboot=5)
    plan = P.get_plan(name)
    reps = plan.replays(ctx)
    assert P.plan_cost(reps) == 4 * len({r.request for r in reps})
    effect = np.array([0.5, -1.0, 2.0, 0.25])

    def value(item, out):  # M drops by the effects of the intervened units (unit = step // 1, 2 slots a step)
        units = sorted({i // 2 for i in item.request.target})
        return 3.0 - float(effect[units].sum())

    rows = {(r.table, r.method): r for r in plan.rows(ctx, reps, value)}
    got = [rows[(f"{name}_effect_remove_fixed", f"s{u}")].value for u in range(4)]
    np.testing.assert_allclose(got, effect, atol=1e-9)
    assert rows[(f"causal_spearman_{name}_remove_fixed", "exact")].value == pytest.approx(1.0)
    # the fit's checks: exact additive effects that differ (equal-effects p 0) and no interaction (p 1)
    fit = {m: rows[(f"{name}_fit_remove_fixed", m)].value for m in ("loo-r2", "equal-effects-p", "interaction-p")}
    assert fit["equal-effects-p"] == 0.0 and fit["loo-r2"] == pytest.approx(1.0)
    assert fit["interaction-p"] == 1.0 or math.isnan(fit["interaction-p"])  # nan: too few replays for the pairs
    assert {r.request.track for r in reps} == {Track()}
    # regenerated: replay r on its own sampler stream r + 1, the baseline on stream 0; blocks of 2 steps
    ctx = dataclasses.replace(ctx, cf=dataclasses.replace(cf, plan_rollouts="regenerated", causal_units="blocks",
                                                          causal_block_steps=2))
    reps = plan.replays(ctx)
    base = [r for r in reps if r.role == "baseline"]
    assert [r.request.track for r in base] == [Track("regenerated", 0)]
    assert [r.request.track for r in reps if r.role == "subset"] == [Track("regenerated", r.draw + 1) for r in reps
                                                                       if r.role == "subset"]
    block = np.array([effect[0] + effect[1], effect[2] + effect[3]])

    def block_value(item, out):  # blocks s0-1 and s2-3: 4 slots each
        units = sorted({i // 4 for i in item.request.target})
        return 3.0 - float(block[units].sum())

    rows = {(r.table, r.method): r for r in plan.rows(ctx, reps, block_value)}
    got = [rows[(f"{name}_effect_remove_regenerated", u)].value for u in ("s0-1", "s2-3")]
    np.testing.assert_allclose(got, block, atol=1e-9)
    ctx = dataclasses.replace(ctx, cf=dataclasses.replace(cf, plan_rollouts="logged"))
    with pytest.raises(ValueError, match="counterfactual.plan_rollouts='logged'"):
        plan.replays(ctx)


def test_the_stage_runs_the_plans_the_config_names():
    """``counterfactual.causal`` / ``topk`` / ``plans`` choose the stage's plans; no plan at all is refused."""
    import dataclasses

    from behaviortrace_jax.stages import counterfactual as CF
    from behaviortrace_jax.stages.spec import RunSpec
    from configs import tiny

    cf = RunSpec.from_config(tiny.get_config("smoke")).counterfactual
    assert CF.stage_plans(cf) == ["leave-top-k-out", "single-unit"]
    assert CF.stage_plans(dataclasses.replace(cf, causal="only", plans="datamodels")) == ["single-unit", "datamodels"]
    assert CF.stage_plans(dataclasses.replace(cf, causal="off", topk=False, plans="datamodels")) == ["datamodels"]
    with pytest.raises(ValueError, match="no replay plan"):
        CF.stage_plans(dataclasses.replace(cf, causal="off", topk=False, plans=""))
