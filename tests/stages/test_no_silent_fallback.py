"""No silent fallback (issue 32, item 8): the compile stage's ``metagradient_step`` row is the
program the metagradient stage steps with; ``loop_counted_cost`` raises where it cannot count
(instead of one trip, or a loop start of 0); an LDS the estimator cannot be judged by is written as
not evaluable (NaN), not as a tie's 0; hash tables that the fused sketcher would ignore are refused
by both keys' names."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from behaviortrace_jax.stages import compile as compile_stage
from behaviortrace_jax.stages.spec import RunSpec
from configs import tiny


# ------------------------------------------------------------------------------------------------
# The compile row is the program that runs
# ------------------------------------------------------------------------------------------------
def _meta_lowered(a, meta, batch):
    weights, opt = batch["advantages"], a.state.opt_state
    return meta.forward.lower(a.params, opt, batch, weights, None).as_text()


@pytest.mark.parametrize("mode", ["logged", "recomputed"])
def test_compile_metagradient_step_is_the_run_forward(mode):
    """The metagradient stage steps a fused run with the run's own step (``make_run_forward``): the
    compile stage's ``metagradient_step`` must lower to that program, not to the batched
    ``make_weighted_step`` it differentiates (the row it compiled before)."""
    from behaviortrace_jax.models import sharding
    from behaviortrace_jax.sketch import sketcher
    from behaviortrace_jax.train import grpo_step, metagradient as MG, train_state

    c = tiny.get_config("smoke")
    c.metagradient.advantages = mode
    spec = RunSpec.from_config(c).step
    assert spec.update_from_sketcher  # the default: the fused sketcher gives the run's update
    mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    a = compile_stage.AbstractRun.build(RunSpec.from_config(c).compile, compile_stage.model_config(RunSpec.from_config(c)),
                                        mesh)
    row = {p.name: p for p in compile_stage.metagradient_programs(a)}["metagradient_step"]
    gbatch = a.grpo_batch()
    batch = dict(gbatch, rewards=gbatch["advantages"]) if mode == "recomputed" else gbatch
    tx = train_state.make_optimizer(RunSpec.from_config(c).optim, differentiable=True)
    floor = float(c.grpo.adv_std_floor)
    shardings = (a.param_shardings, a.state_shardings.opt_state, {k: a.data for k in batch}, a.data, None, a.rep)
    run_tx = train_state.make_optimizer(RunSpec.from_config(c).optim)  # the forward: the run's own (eps_root 0)
    run_forward = MG.make_run_forward(a.graphdef, a.abstract_params, run_tx, spec, sketcher.hf_param_order(a.cfg), mesh,
                                      advantages=mode, std_floor=floor)
    batched = MG.make_weighted_step(a.graphdef, tx, spec, advantages=mode, std_floor=floor)
    want = _meta_lowered(a, MG.MetaStep(batched, shardings, opt_state=a.state.opt_state, forward=run_forward), batch)
    other = _meta_lowered(a, MG.MetaStep(batched, shardings, opt_state=a.state.opt_state), batch)
    assert want != other  # the two programs are told apart
    assert row.lower().as_text() == want


# ------------------------------------------------------------------------------------------------
# loop_counted_cost raises where it cannot count
# ------------------------------------------------------------------------------------------------
X = jnp.ones((8, 8))


def test_loop_counted_cost_refuses_a_loop_without_a_trip_count():
    """A ``while_loop`` that stops on a value has no trip count: counted as one trip before; now an
    error naming the loop, unless the caller gives its bound."""
    for body in (lambda y: jnp.sin(y) * 0.5, lambda y: y @ y * 0.1):
        looped = jax.jit(lambda x, body=body: jax.lax.while_loop(lambda y: y.sum() > 1.0, body, x)).lower(X).compile()
        with pytest.raises(compile_stage.UncountedLoop, match=r"while loop \(body %.*no known trip count"):
            compile_stage.loop_counted_cost(looped)
        counted = compile_stage.loop_counted_cost(looped, 5)
        assert counted["loops"] == [-5] and counted["flops"] > counted["flops_one_trip"]


@pytest.mark.parametrize("start", [3, 7])
def test_loop_counted_cost_refuses_a_loop_whose_start_is_not_a_constant(start):
    """``fori_loop(s, 10)`` with a traced start: XLA annotates no trip count and the start is an
    argument; 10 trips (a start of 0) were counted before, whatever ``s``."""
    looped = jax.jit(lambda x, s: jax.lax.fori_loop(s, 10, lambda i, y: jnp.sin(y @ y), x)).lower(
        X, jnp.int32(start)).compile()
    with pytest.raises(compile_stage.UncountedLoop, match="bound 10, but the counter's initial value"):
        compile_stage.loop_counted_cost(looped)


def test_compile_row_says_when_it_could_not_count():
    """A program that cannot be counted gets a row with no FLOPs or roofline and the reason, not
    XLA's one-trip figures passed off as the count."""
    f = jax.jit(lambda x: jax.lax.while_loop(lambda y: y.sum() > 1.0, lambda y: jnp.sin(y) * 0.5, x))
    pr = compile_stage.Program("until", lambda: f.lower(jax.ShapeDtypeStruct((8, 8), jnp.float32)), "x")
    row = compile_stage.compile_program(pr, compile_stage.CHIPS["v5e"], None)
    assert row["flops"] is None and row["roofline_s"] is None and "no known trip count" in row["cost_error"]
    assert row["flops_one_trip"] > 0
    md = compile_stage.report_markdown({"target": "cpu:1", "n_devices": 1, "chip": None, "mesh": {}, "model": "m",
                                        "host_peak_rss_bytes": 1, "stage_s": 1.0, "programs": [row]})
    assert "| until |" in md and "not counted" in md


# ------------------------------------------------------------------------------------------------
# Not-evaluable LDS rows
# ------------------------------------------------------------------------------------------------
def _lds_inputs(rng, n=12, subsets=6):
    """``{0.5: [(removed half, measured behaviour)]}``: ``subsets`` random half-subsets."""
    return {0.5: [(np.sort(rng.choice(n, n // 2, replace=False)), float(rng.normal())) for _ in range(subsets)]}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lds_of_an_estimator_without_scores_on_the_window_is_not_evaluable(seed):
    """local-buffer scores -inf outside its last steps: on the window its prediction is the same for
    every subset. That row is NaN ("not evaluable"), not the 0 of a tie; an estimator with real
    (finite, equal) scores keeps SPEC §6.12's 0, and a scoring one its Spearman."""
    from behaviortrace_jax.attribution import counterfactual_report, counterfactual_tables as CF, formats

    rng = np.random.default_rng(seed)
    subsets = _lds_inputs(rng)
    window = np.arange(12)
    scores = {"local-buffer": np.full(12, -np.inf), "ties": np.ones(12), "C1-dot": rng.normal(size=12),
              "partly": np.where(np.arange(12) < 6, rng.normal(size=12), -np.inf)}
    rows = {r.method: r for r in CF.lds_rows(str(seed), subsets, scores, window, nboot=5)}
    assert np.isnan(rows["local-buffer"].value) and rows["local-buffer"].lo is None and rows["local-buffer"].n == 6
    assert rows["ties"].value == 0.0 and rows["ties"].lo == 0.0
    assert np.isfinite(rows["C1-dot"].value) and np.isfinite(rows["partly"].value)
    csv = formats.format_results_csv(list(rows.values()))
    assert f"{seed},lds,local-buffer,nan,,,0.0,1.0,6" in csv
    section = counterfactual_report.report_section(list(rows.values()), None)
    assert "| local-buffer | 0.5 | not evaluable (no score in the window) | | 6 |" in section


# ------------------------------------------------------------------------------------------------
# Hash tables the fused sketcher would ignore
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["sketch.in_run_tables", "targets.use_tables"])
def test_hash_tables_under_the_fused_sketcher_are_refused_by_both_keys(key):
    from behaviortrace_jax.sketch import hash_tables, targets
    from behaviortrace_jax.train import grpo_step

    c = tiny.get_config("smoke")
    section, name = key.split(".")
    setattr(getattr(c, section), name, True)
    build = ((lambda: RunSpec.from_config(c).step) if key == "sketch.in_run_tables" else
             (lambda: targets.ForcedSketcher.from_options(RunSpec.from_config(c).forced, None, None, None, pad_id=0)))
    with pytest.raises(ValueError, match=rf"config\.{key}=True is ignored .*config\.sketch\.fused=True"):
        build()
    c.sketch.fused = False  # the vmap(grad) sketcher reads the tables: honoured
    assert hash_tables.table_switch(key, True, c.sketch.fused) is True
    if key == "sketch.in_run_tables":
        assert RunSpec.from_config(c).step.use_tables


def test_tiny_config_sets_no_ignored_key():
    """configs/tiny.py claimed ~2.7x from targets.use_tables, which the fused default ignores."""
    from behaviortrace_jax.sketch import hash_tables

    for variant in ("", "smoke"):
        c = tiny.get_config(variant)
        for key in hash_tables.TABLE_KEYS:
            section, name = key.split(".")
            hash_tables.table_switch(key, c[section][name], c.sketch.fused)  # raises for an ignored key
