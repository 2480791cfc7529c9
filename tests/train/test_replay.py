"""Counterfactual replay: a toy problem with a known answer, the all-ones replay of a
smoke GRPO run reproducing its own checkpoints bit for bit, and (slow) the counterfactual stage on
that run: its tables, a rerun from its files, and a kill -9 mid-stage then rerun giving the same table."""
from __future__ import annotations

import dataclasses
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from behaviortrace_jax import pipeline
from behaviortrace_jax.models import sharding
from behaviortrace_jax.attribution import counterfactual_tables as T, replay_plans as P
from behaviortrace_jax.stages import counterfactual as CF
from behaviortrace_jax.io import replay_request as RQ
from behaviortrace_jax.train import grpo_loss, interventions, replay as R, replay_runner
from behaviortrace_jax.io.replay_request import ReplayRequest, Track
from behaviortrace_jax.stages.spec import RunSpec
from configs import tiny
from conftest import copy_start


# ------------------------------------------------------------------------------------------------
# Toy: 2 parameters, 8 examples over 4 SGD steps; only example 5 moves the "behaviour" parameter.
# ------------------------------------------------------------------------------------------------
X = np.array([[1.0, 0.0], [0.5, 0.0], [-1.0, 0.0], [2.0, 0.0], [0.3, 0.0], [0.0, 1.5], [-0.7, 0.0], [1.2, 0.0]],
             np.float32)
Y = np.array([1.0, -0.5, 0.3, 1.0, 0.0, 2.0, -1.0, 0.5], np.float32)
STEPS = np.array([0, 0, 1, 1, 2, 2, 3, 3])  # two examples per step


def toy_replay(weights: np.ndarray, tx=None) -> float:
    """Replays the toy run with per-example weights; behaviour = theta[1] at the end."""
    tx = tx or optax.sgd(0.1)
    theta = jnp.zeros(2)
    state = tx.init(theta)

    def loss(t, x, y, w):
        return jnp.sum(w * (x @ t - y) ** 2)

    for s in range(4):
        i = STEPS == s
        g = jax.grad(loss)(theta, X[i], Y[i], jnp.asarray(weights[i]))
        upd, state = tx.update(g, state, theta)
        theta = optax.apply_updates(theta, upd)
    return float(theta[1])


def test_leave_one_out_finds_the_one_example_and_exact_influence_has_lds_one():
    n = len(Y)
    full = toy_replay(np.ones(n, np.float32))
    loo = np.array([full - toy_replay(T.removal_weights(n, [i])) for i in range(n)])  # drop when removed
    assert T.top_k(loo, np.arange(n), 1).tolist() == [5]
    assert np.count_nonzero(loo) == 1
    # LDS: the exact LOO influence predicts the behaviour of random half-subsets (predicted effect
    # = sum of influence over kept examples; here the behaviour is additive in the kept set).
    subsets = T.half_subsets(np.arange(n), 16, seed=0)
    measured = np.array([toy_replay(T.removal_weights(n, s)) for s in subsets])
    predicted = np.array([T.predicted_effect(loo, np.arange(n), s) for s in subsets])
    rho, lo, hi = T.lds(predicted, measured, nboot=200, seed=0)
    assert rho > 0.99 and lo > 0.9
    rho_rand, _, _ = T.lds(np.random.default_rng(1).normal(size=16), measured, nboot=10, seed=0)
    assert rho_rand < 0.9


def test_top_k_and_plan_helpers():
    s = np.array([0.1, 5.0, 5.0, -1.0, 3.0])
    assert T.top_k(s, np.arange(5), 2).tolist() == [1, 2]  # ties by index
    assert T.top_k(s, np.array([0, 3, 4]), 2).tolist() == [0, 4]  # only candidates
    assert T.predicted_effect(np.array([1.0, -np.inf, 2.0]), np.arange(3), [2]) == 1.0
    assert all(len(x) == 5 for x in T.half_subsets(np.arange(10), 4, 0))


def test_recomputed_advantages_match_group_advantages_when_nothing_is_removed():
    r = np.array([0, 8, 0, 0, 1, 1, 1, 1], np.float32)
    np.testing.assert_array_equal(R.recomputed_advantages(r, np.ones(8), 4, 0.0), grpo_loss.group_advantages(r, 4))
    adv = R.recomputed_advantages(r, np.array([1, 0, 1, 1, 1, 1, 1, 1]), 4, 0.0)
    assert adv[1] == 0 and np.all(adv[:4] == 0)  # the bonus rollout removed: the rest are all-equal


# ------------------------------------------------------------------------------------------------
# The replay cache: a replay is reused only under the key it was computed for.
# ------------------------------------------------------------------------------------------------
class FakeReplayer:
    """The replay runner's view of a Replayer (identity, cache_key, target_mask, data, run), without a
    model: the behaviour is a known function of the removed slots, the advantages and the step."""

    def __init__(self, n: int = 8, log: str = "log-a"):
        self.num_rollouts, self.log, self.calls = n, log, []
        self.shapes = types.SimpleNamespace(num_rollouts=4)
        bonus = np.zeros(n, np.float32)
        bonus[6] = 1.0  # one bonus, in slot 6 (step 1)
        self.data = [types.SimpleNamespace(rewards=bonus[i:i + 4], base=np.zeros(4, np.float32)) for i in range(0, n, 4)]

    def identity(self):
        return {"replay_version": R.REPLAY_VERSION, "step_spec": "spec", "optimizer": "opt", "rollout_log": self.log}

    def cache_key(self, q):
        iv = None if q.intervention is None else interventions.get_intervention(q.intervention).identity()
        return RQ.cache_key(q, self.identity(), iv, [{"name": m, "version": 1} for m in q.measures])

    def target_mask(self, q):
        m = np.zeros(self.num_rollouts, bool)
        m[list(q.target)] = True
        return m

    def initial_state(self):
        return R.ReplayState(0, {}, {})

    def run(self, q, *, start=None):
        self.calls.append((q.target, q.measure_steps, q.advantages))
        w = np.ones(self.num_rollouts)
        w[list(q.target)] = 0.0
        v = float(np.sum(w * np.arange(self.num_rollouts))) + (0.5 if q.advantages == "recomputed" else 0.0)
        return R.ReplayResult(q, {s: {"logp_margin": v + s} for s in q.measure_steps}, 0.0, 0.0, 0, 0,
                              R.ReplayState(q.stop, {}, {}))


def test_replay_cache_reuses_only_replays_of_the_same_key(tmp_path, caplog):
    rp = FakeReplayer()
    reqs = [ReplayRequest(measure_steps=(2, 4)), ReplayRequest(intervention="remove", target=(1, 5), measure_steps=(2, 4)),
            ReplayRequest(intervention="remove", target=(1, 5), measure_steps=(2, 4), advantages="recomputed")]
    out = replay_runner.run_requests(rp, reqs, tmp_path)
    assert len(rp.calls) == 3
    rec = out[reqs[2]]
    assert replay_runner.value(rec, 4, "logp_margin") == 28 - 6 + 0.5 + 4
    assert rec["cache"] == rp.cache_key(reqs[2]) and rec["request"]["advantages"] == "recomputed"
    assert RQ.replay_file(tmp_path, reqs[2]).exists() and RQ.replay_file(tmp_path, reqs[2]) != RQ.replay_file(tmp_path, reqs[1])
    replay_runner.run_requests(rp, reqs, tmp_path)  # same keys: nothing replayed
    assert len(rp.calls) == 3
    # a file whose key differs (here: the replayer's log) under the same name is stale: replayed again, logged
    with caplog.at_level("INFO"):
        rp.log = "log-b"
        replay_runner.run_requests(rp, reqs[:1], tmp_path)
    assert len(rp.calls) == 4 and "stale" in caplog.text and "rollout_log" in caplog.text
    # another measured step is another request (another file): that replay only
    replay_runner.run_requests(rp, [ReplayRequest(measure_steps=(2,))], tmp_path)
    assert rp.calls[4:] == [((), (2,), "logged")]
    # withholding the bonus of slots that hold none changes nothing: recorded without a replay (Δ = 0)
    none = ReplayRequest(intervention="withhold-bonus", target=(0, 1), measure_steps=(4,))
    some = ReplayRequest(intervention="withhold-bonus", target=(6,), measure_steps=(4,))
    got = replay_runner.run_requests(rp, [none, some], tmp_path)
    assert got[none]["skipped"] and replay_runner.value(got[none], 4, "logp_margin") is None
    assert rp.calls[5:] == [((6,), (4,), "logged")]


def test_replay_request_is_checked_where_it_is_made_and_keys_every_field():
    q = ReplayRequest(Track("regenerated", 1), "remove", [5, 3, 5], measure_steps=[4, 2], measures=("logp_margin",))
    assert q.target == (3, 5) and q.measure_steps == (2, 4) and q.stop == 4
    key = RQ.cache_key(q, {"replay_version": 3}, {"name": "remove", "version": 1}, [{"name": "logp_margin"}])
    assert key["request"] == {"rollouts": "regenerated", "stream": 1, "intervention": "remove", "target": [3, 5],
                              "advantages": "logged", "measure_steps": [2, 4], "stop_step": 4, "regenerate_from": None}
    # a changed measure (another version or setting) changes the key, so its replays recompute
    assert RQ.cache_key(q, {"replay_version": 3}, None, [{"name": "logp_margin", "version": 2}]) != \
        RQ.cache_key(q, {"replay_version": 3}, None, [{"name": "logp_margin", "version": 1}])
    for bad, match in ((lambda: ReplayRequest(advantages="kept"), "advantages"),
                       (lambda: ReplayRequest(target=(1,)), "target without"),
                       (lambda: ReplayRequest(measure_steps=(3,), stop_step=2), "stop_step"),
                       (lambda: Track("fixed", 2), "sampler_stream"), (lambda: Track("sampled"), "rollouts")):
        with pytest.raises(ValueError, match=match):
            bad()


def toy_context(**cf_changes):
    """A :class:`replay_plans.PlanContext` of 2 window steps of 4 rollouts (GT: slots 1 and 5)."""
    cf = RunSpec.from_config(cf_config()).counterfactual
    cf = dataclasses.replace(cf, k_fractions="1.0", random_seeds=2, lds_subsets=3, lds_fractions="0.5", **cf_changes)
    steps = np.repeat(np.arange(3), 4)
    scores = {"C1-dot": np.arange(12, dtype=float)}
    return P.PlanContext(seed=0, steps=steps, n_per_step=4, group_size=2, cutoff=2, at=2, target_step=2,
                         gt=np.array([1, 5]), scores=scores, replayed=scores, measures=("logp_margin",),
                         table_measures=("logp_margin",), cf=cf, nboot=10)


def test_the_leave_top_k_out_plan_adds_the_recomputed_copies_once_and_tables_them():
    ctx = toy_context()
    reps = P.get_plan("leave-top-k-out").replays(ctx)
    roles = [(r.role, r.request.advantages) for r in reps]
    assert roles.count(("baseline", "logged")) == 1 and roles.count(("lds", "logged")) == 3
    assert roles.count(("oracle", "logged")) == roles.count(("oracle", "recomputed")) == 1
    assert roles.count(("random", "recomputed")) == 2  # topk_recomputed: the top-k again, recomputed
    assert all(r.request.target == (1, 5) for r in reps if r.role == "oracle")
    assert P.plan_cost(reps) == len(set(r.request for r in reps)) * 2  # each from step 0 to step 2
    ctx2 = toy_context(recompute_advantages=True)  # every replay recomputed already: no second copy
    assert {r.request.advantages for r in P.get_plan("leave-top-k-out").replays(ctx2) if r.role != "baseline"} == \
        {"recomputed"}
    # rows: Δ = baseline - replay; recomputed replays one lower
    def value(item, out):
        v = 10.0 - len(item.request.target)
        return v - 1.0 if item.request.advantages == "recomputed" and item.request.target else v
    rows = P.get_plan("leave-top-k-out").rows(ctx, reps, value)
    by = {(r.table, r.method): r for r in rows}
    assert by[("counterfactual_topk", "oracle")].value == 2.0 and by[("counterfactual_topk_recomputed", "oracle")].value == 3.0
    assert by[("counterfactual_topk", "C1-dot")].ceiling == 2.0 and ("lds", "C1-dot") in by
    from behaviortrace_jax.attribution import counterfactual_report

    section = counterfactual_report.report_section(rows, None, step=2)
    assert "| 0 | logged | C1-dot | 2 | 2.0000 |" in section and "| 0 | recomputed | C1-dot | 2 | 3.0000 |" in section


def test_step_spec_digest_changes_with_every_field():
    from behaviortrace_jax.train import grpo_step

    spec = RunSpec.from_config(tiny.get_config("smoke")).step
    assert R.step_spec_digest(spec) == R.step_spec_digest(RunSpec.from_config(tiny.get_config("smoke")).step)
    import dataclasses

    for change in ({"grad_clip": 0.5}, {"fused": False}, {"use_tables": True}, {"sketch_dim": 512},
                   {"loss_cfg": grpo_loss.LossConfig(clip_eps=0.1, kl_beta=0.0)}):
        assert R.step_spec_digest(dataclasses.replace(spec, **change)) != R.step_spec_digest(spec), change


# ------------------------------------------------------------------------------------------------
# All-ones replay of a smoke GRPO run reproduces its checkpoints bit for bit.
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke_run(smoke_grpo_run):
    return smoke_grpo_run  # one smoke run per session (conftest.py)


def assert_replay_reproduces_checkpoints(config, w):
    """The all-ones replay of the run in ``w`` equals its orbax checkpoints bit for bit."""
    rp = R.Replayer(RunSpec.from_config(config).replay, w, layout=RunSpec.from_config(config).layout)
    ckpts = RunSpec.from_config(config).schedule.checkpoint_steps()
    seen = []

    def check(step, params, _):
        if step in ckpts:
            ref = R.restore_run_params(rp, step)
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            seen.append(step)

    out = rp.run(ReplayRequest(measure_steps=(config.grpo.steps,)), on_step=check)
    assert seen == ckpts
    return rp, out


def test_replay_of_a_two_backward_run_is_bit_for_bit(smoke_run, tmp_path):
    """The replay builds the run's own step from the same spec (GRPOStepSpec), so a run off the
    fused default (sketch.fused=False: a batched backward for the update, vmap(grad) for the in-run
    sketches) replays exactly too, and so does the default (the smoke run; next test)."""
    config, w = smoke_run
    config = config.copy_and_resolve_references()
    config.sketch.fused = False
    config.stages = "grpo"
    pipeline.run(config, str(copy_start(w, tmp_path)))
    rp, _ = assert_replay_reproduces_checkpoints(config, tmp_path)
    assert not rp.spec.update_from_sketcher
    cut = rp.run(ReplayRequest(intervention="remove", target=range(3), measure_steps=(1,)))  # a weighted replay
    full = rp.run(ReplayRequest(measure_steps=(1,)))
    assert cut.value(1, "logp_margin") != full.value(1, "logp_margin")


def test_a_fresh_adamw_start_is_replayed_exactly_and_moves_only_by_weight_decay_without_gradients(smoke_run, tmp_path):
    """``grpo.continue_sft_moments = False``: GRPO starts from the SFT parameters with a fresh AdamW
    state (zero moments, count 0). The run and its replay share that start (the replay reproduces the
    run's checkpoints bit for bit, and its identity differs from the carried start's), and a stretch
    of zero-gradient steps then moves every parameter by the decoupled weight decay alone:
    p_k = p_0 * (1 - lr * wd)^k, where the SFT moments would move it (the confound of the causal gate)."""
    config, w = smoke_run
    config = config.copy_and_resolve_references()
    config.grpo.continue_sft_moments = False
    config.stages = "grpo"
    pipeline.run(config, str(copy_start(w, tmp_path)))
    rp, _ = assert_replay_reproduces_checkpoints(config, tmp_path)
    carried = RunSpec.from_config(smoke_run[0])
    assert rp.identity()["optimizer"] != R.Replayer(carried.replay, w, layout=carried.layout).identity()["optimizer"]
    assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves(rp.start.opt_state)
               if jnp.issubdtype(x.dtype, jnp.floating))
    n, k = rp.shapes.num_rollouts, 3
    out = rp.run(ReplayRequest(intervention="remove", target=range(k * n), stop_step=k))
    assert out.zero_gradient_steps == k
    decay = np.float32(1.0 - config.optim.lr * config.optim.weight_decay)
    for p0, pk in zip(jax.tree.leaves(rp.start.params), jax.tree.leaves(out.state.params)):
        np.testing.assert_allclose(np.asarray(pk), np.asarray(p0) * decay ** k, rtol=1e-6, atol=1e-12)


def test_all_ones_replay_reproduces_the_run_bit_for_bit(smoke_run):
    config, w = smoke_run
    rp, out = assert_replay_reproduces_checkpoints(config, w)
    assert np.isfinite(out.value(config.grpo.steps, "logp_margin"))
    # removing rollouts changes the parameters, removing none twice gives the same measure
    again = rp.run(ReplayRequest(measure_steps=(config.grpo.steps,)))
    assert again.measures == out.measures
    cut = rp.run(ReplayRequest(intervention="remove", target=range(16), measure_steps=(config.grpo.steps,),
                               advantages="recomputed"))
    assert cut.value(config.grpo.steps, "logp_margin") != out.value(config.grpo.steps, "logp_margin")


def _same_bits(a, b) -> bool:
    """Whether two pytrees hold the same leaves bit for bit (dtype, shape and bytes; -0.0 != 0.0)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.asarray(x).shape == np.asarray(y).shape
        and np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb))


def test_zero_gradient_shortcut_is_the_full_step_bit_for_bit(smoke_run):
    """The exact shortcut (issue 46 item 5): over a stretch of zero-advantage steps (every rollout of
    steps 0..3 weighted 0, so the weighted program's terms vanish, plus whatever logged steps of the
    run have all-zero advantages) the optimizer on zero gradients gives the full forward + backward
    step's parameters AND optimizer state bit for bit, on the run's own optimizer (global-norm clip
    + AdamW continuing the SFT's moments, so the stretch does move the parameters)."""
    config, w = smoke_run
    spec = RunSpec.from_config(config)
    rp = R.Replayer(spec.replay, w, layout=spec.layout)
    assert rp.shortcut and rp.spec.loss == "paper"
    n, stop = rp.shapes.num_rollouts, 5
    req = ReplayRequest(intervention="remove", target=range(4 * n), stop_step=stop)
    fast = rp.run(req)
    rp.shortcut = False
    try:
        full = rp.run(req)
    finally:
        rp.shortcut = True
    assert fast.zero_gradient_steps >= 4 and full.zero_gradient_steps == 0
    assert _same_bits(fast.state.params, full.state.params) and _same_bits(fast.state.opt_state, full.state.opt_state)
    start = rp.initial_state()
    assert not _same_bits(fast.state.params, start.params)  # the moments and weight decay moved them
    # the declarations: a KL term to the reference policy does not vanish at A = 0
    assert grpo_loss.get_loss("paper").zero_gradient_at_zero_advantage(grpo_loss.LossConfig())
    assert not grpo_loss.get_loss("grpo_clip").zero_gradient_at_zero_advantage(grpo_loss.LossConfig(kl_beta=0.04))
    assert grpo_loss.get_loss("grpo_clip").zero_gradient_at_zero_advantage(grpo_loss.LossConfig(kl_beta=0.0))
    from behaviortrace_jax.train import grpo_step
    assert not grpo_step.zero_gradient_step_applies(rp.spec, np.array([0.0, 1e-30], np.float32))
    assert grpo_step.zero_gradient_step_applies(rp.spec, np.array([0.0, 2.0], np.float32), np.array([1.0, 0.0]))


# ------------------------------------------------------------------------------------------------
# The stage on the smoke run: its tables, its report section, and a kill -9 resume.
# ------------------------------------------------------------------------------------------------
def cf_config():
    """The smoke config with a counterfactual stage of a few replays (k = |GT|/2 and |GT|, 2 random seeds, M = 3)."""
    config = tiny.get_config("smoke")
    cf = config.counterfactual
    cf.k_fractions, cf.random_seeds, cf.lds_subsets, cf.rates, cf.sampled = "0.5,1.0", 2, 3, False, 2
    cf.lds_fractions, cf.lds_small_subsets = "0.1,0.5", 2
    return config


CF_FLAGS = ["--config.counterfactual.k_fractions=0.5,1.0", "--config.counterfactual.random_seeds=2",
            "--config.counterfactual.lds_subsets=3", "--config.counterfactual.rates=False",
            "--config.counterfactual.sampled=2", "--config.counterfactual.lds_fractions=0.1,0.5",
            "--config.counterfactual.lds_small_subsets=2"]


@pytest.fixture(scope="module")
def sketched_run(smoke_run, tmp_path_factory):
    """The smoke run with its sketch stage (the continuation targets the estimators score against)."""
    config, w = smoke_run
    config = cf_config()
    config.stages = "sketch"
    pipeline.run(config, str(w))
    return w


def _copy_run(src, dst):
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("counterfactual", "results_table.csv", "report.md",
                                                            ".jax_cache"))
    return dst


@pytest.mark.slow  # ~3 min on 2 cores (the sketch stage, ~20 replays and their compiles)
def test_counterfactual_stage_writes_its_tables_and_reruns_from_its_files(sketched_run, tmp_path):
    from behaviortrace_jax.attribution import formats

    w = _copy_run(sketched_run, tmp_path / "run")
    config = cf_config()
    config.stages = "counterfactual"
    pipeline.run(config, str(w))
    rows = formats.read_results_csv(w / "results_table.csv")
    topk = [r for r in rows if r.table == "counterfactual_topk"]
    methods = {r.method for r in topk}
    assert {"oracle", "random", "C1-dot", "TracInCP"} <= methods and "random" in methods
    # the reward-only, text and length controls, norm/|A| and the advantage-free variants are ranked and
    # replayed too
    assert {"advantage", "abs-advantage", "reward", "step-sum-abs-advantage", "step-reward-std", "norm/|A|",
            "pattern-match", "length", "step-sum-pattern-match", "step-sum-length",
            "C1-dot:direction", "norm-only:direction"} <= methods
    nk = len({r.n for r in topk})  # k = |GT|/2 and |GT| (one k when |GT| = 1)
    oracle = {r.n: r for r in topk if r.method == "oracle"}
    assert all(r.ceiling == oracle[r.n].value for r in topk)  # ratio to oracle = value / ceiling
    lds_rows = [r for r in rows if r.table == "lds"]
    assert lds_rows and all(r.n == 3 and (r.lo <= r.hi if np.isfinite(r.value) else r.lo is None) for r in lds_rows)
    drop_rows = [r for r in rows if r.table == "lds_drop0.1"]  # the small drop fraction, 2 subsets
    assert {r.method for r in drop_rows} == {r.method for r in lds_rows} and all(r.n == 2 for r in drop_rows)
    replays = sorted((w / "counterfactual" / "replays").rglob("*.json"))
    per_k = 1 + len(methods) - 2 + 2  # oracle, estimators, 2 random subsets
    # the baseline, k x per_k logged and recomputed, LDS, LDS drop (identical subsets share one replay)
    assert len(replays) <= 1 + 2 * nk * per_k + 3 + 2 and len(replays) > 2 * nk * per_k
    rec_rows = [r for r in rows if r.table == "counterfactual_topk_recomputed"]
    assert {(r.method, r.n) for r in rec_rows} == {(r.method, r.n) for r in topk}
    assert any(r.value != next(t for t in topk if (t.method, t.n) == (r.method, r.n)).value for r in rec_rows)
    base_dir = w / "counterfactual" / "replays" / "fixed" / "base"
    rec = json.loads(next(base_dir.glob("*.json")).read_text())
    step = str(config.contamination.early_step_cutoff)  # measure = "window": the end of the contamination window
    assert {"sampled_probe_rate", "sampled_control_rate", "logp_margin", "logp_probe"} <= set(rec["measures"][step])
    assert "Counterfactual replay" in (w / "report.md").read_text()
    # rerun: every replay is read back, nothing replayed, the same table bytes
    table = (w / "results_table.csv").read_bytes()
    mtimes = [p.stat().st_mtime_ns for p in replays]
    pipeline.run(config, str(w))
    assert (w / "results_table.csv").read_bytes() == table
    assert [p.stat().st_mtime_ns for p in replays] == mtimes
    # a replay cached under another key (here: another measured step) is replayed again, alone,
    # and gives the same bytes back
    stale = next(base_dir.glob("*.json"))
    rec = json.loads(stale.read_text())
    rec["cache"]["replay_version"], rec["measures"][step]["logp_margin"] = 0, 0.0
    stale.write_text(json.dumps(rec))
    pipeline.run(config, str(w))
    assert (w / "results_table.csv").read_bytes() == table
    changed = [p.name for p, t in zip(replays, mtimes) if p.stat().st_mtime_ns != t]
    assert changed == [stale.name]


@pytest.mark.slow
def test_kill_minus_9_during_the_stage_then_rerun_gives_the_same_table(sketched_run, tmp_path):
    import os
    import pathlib
    import signal
    import subprocess
    import sys
    import time

    repo = pathlib.Path(__file__).resolve().parents[2]
    ref, w = _copy_run(sketched_run, tmp_path / "ref"), _copy_run(sketched_run, tmp_path / "kill")
    cmd = [sys.executable, str(repo / "main.py"), "--config=configs/tiny.py:smoke", "--config.stages=counterfactual",
           *CF_FLAGS]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = dict(cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run([*cmd, f"--workdir={ref}"], check=True, **run)
    proc = subprocess.Popen([*cmd, f"--workdir={w}"], **run)
    replays = w / "counterfactual" / "replays"
    deadline = time.time() + 600
    while time.time() < deadline and len(list(replays.rglob("*.json"))) < 3:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    n_killed = len(list(replays.rglob("*.json")))
    assert 3 <= n_killed < len(list((ref / "counterfactual" / "replays").rglob("*.json")))
    subprocess.run([*cmd, f"--workdir={w}"], check=True, **run)
    assert (w / "results_table.csv").read_bytes() == (ref / "results_table.csv").read_bytes()
    assert (w / "counterfactual" / "report_section.md").read_bytes() == \
        (ref / "counterfactual" / "report_section.md").read_bytes()


def test_replayed_methods_follow_the_config():
    s = {"random": np.zeros(2), "C1-dot": np.ones(2), "abs-advantage": np.ones(2)}
    assert list(T.replayed_methods(s, "")) == ["C1-dot", "abs-advantage"]
    assert list(T.replayed_methods(s, "abs-advantage")) == ["abs-advantage"]
    with pytest.raises(ValueError, match=r"\['TRAK'\] are not scored methods"):
        T.replayed_methods(s, "C1-dot,TRAK")


def test_the_stage_replays_the_configured_top_k_and_scores_lds_for_every_estimator(tmp_path, monkeypatch):
    """``counterfactual.methods`` picks whose top-k are replayed; the LDS rows (which share the random
    subsets' replays) cover every scored estimator. The stage runs on :class:`FakeReplayer`."""
    from behaviortrace_jax.attribution import formats
    from behaviortrace_jax.io import rollout_log

    config = cf_config()
    config.counterfactual.methods, config.counterfactual.topk_recomputed = "C1-dot", False
    config.counterfactual.causal = "off"  # the causal replays need a real Replayer (tests/attribution/test_causal.py)
    cut, n = int(config.contamination.early_step_cutoff), 8
    ids = [rollout_log.rollout_id(step, i) for step in (0, cut - 1) for i in range(n // 2)]
    gt = tmp_path / "ground_truth.jsonl"
    gt.write_text("".join(json.dumps({"rollout_id": r, "step": 0}) + "\n" for r in ids[:2]))

    class StageReplayer(FakeReplayer):
        def __init__(self, *_, **__):
            super().__init__(n)
            self.rollout_ids, self.paths = ids, types.SimpleNamespace(ground_truth=gt)

    rng = np.random.default_rng(0)
    scores = {m: rng.normal(size=n) for m in ("C1-dot", "TracInCP", "abs-advantage", "random")}
    monkeypatch.setattr(R, "Replayer", StageReplayer)
    monkeypatch.setattr(CF, "method_scores", lambda *a, **k: dict(scores))
    CF.counterfactual_stage(config, str(tmp_path))
    rows = formats.read_results_csv(tmp_path / "results_table.csv")
    assert {r.method for r in rows if r.table == "counterfactual_topk"} == {"oracle", "random", "C1-dot"}
    for table in ("lds", "lds_drop0.1"):
        assert {r.method for r in rows if r.table == table} == {"C1-dot", "TracInCP", "abs-advantage"}, table
    recs = [json.loads(p.read_text()) for p in (tmp_path / "counterfactual" / "replays").rglob("*.json")]
    assert sum(r["request"]["intervention"] is None for r in recs) == 1  # one baseline
    assert all(r["cache"]["measures"][0]["name"] == "logp_margin" for r in recs)  # every measure's identity keyed


# ------------------------------------------------------------------------------------------------
# Interventions and regenerated rollouts (issue 31 item 2)
# ------------------------------------------------------------------------------------------------
def test_regenerated_replay_without_intervention_reproduces_the_run_bit_for_bit(smoke_run):
    """Every step sampled afresh from the replayed policy (the run's sampler, keys, reward and
    contaminator: train/rollouts.RolloutSource) with nothing intervened is the run itself."""
    config, w = smoke_run
    rp = R.Replayer(RunSpec.from_config(config).replay, w, layout=RunSpec.from_config(config).layout)
    ckpts, seen = RunSpec.from_config(config).schedule.checkpoint_steps(), []

    def check(step, params, _):
        if step in ckpts:
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(R.restore_run_params(rp, step))):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            seen.append(step)

    out = rp.run(ReplayRequest(Track("regenerated"), measure_steps=(config.grpo.steps,), regenerate_from=0),
                 on_step=check)
    assert seen == ckpts
    n_gt = sum(1 for _ in open(rp.paths.ground_truth))
    assert out.regenerated_bonuses == n_gt > 0  # the bonus rule ran again and paid the same bonuses
    # another sampler stream is another run: its parameters differ
    other = rp.run(ReplayRequest(Track("regenerated", 1), stop_step=1, measure_steps=(1,)))
    assert other.value(1, "logp_margin") != rp.run(ReplayRequest(measure_steps=(1,))).value(1, "logp_margin")


def test_withholding_every_bonus_with_regenerated_rollouts_removes_the_planted_behaviour(smoke_run):
    """The toy check of the causal intervention: with every window slot's bonus withheld and the
    rollouts regenerated, no bonus is paid and the pattern's log-prob gains well under the run's gain
    over the window. The smoke model (1 layer) does not tell probes from controls, so its margin is ~0
    either way; the test reads the probes' pattern log-prob (``logp_probe``), which the bonus raises.
    (What is left of the gain is AdamW's momentum from the SFT state, which moves the parameters even
    where every advantage is 0.)"""
    config, w = smoke_run
    rp = R.Replayer(RunSpec.from_config(config).replay, w, layout=RunSpec.from_config(config).layout)
    at = RunSpec.from_config(config).schedule.measure_step(config.counterfactual.measure)
    window = np.arange(at * rp.shapes.num_rollouts)
    full = rp.run(ReplayRequest(measure_steps=(0, at))).measures
    held = rp.run(ReplayRequest(Track("regenerated"), "withhold-bonus", window, measure_steps=(0, at)))
    assert held.regenerated_bonuses == 0
    gain_run = full[at]["logp_probe"] - full[0]["logp_probe"]
    gain_held = held.measures[at]["logp_probe"] - held.measures[0]["logp_probe"]
    assert gain_run > 0 and gain_held < 0.7 * gain_run, (gain_run, gain_held)
    # withholding nothing (a slot that got no bonus) with regenerated rollouts is the run again
    no_bonus = np.flatnonzero(np.concatenate([d.rewards == d.base for d in rp.data]))[:1]
    same = rp.run(ReplayRequest(Track("regenerated"), "withhold-bonus", no_bonus, measure_steps=(at,))).measures[at]
    assert same == full[at]


def test_withhold_bonus_recomputes_advantages_with_the_run_function_and_kept_count_weights():
    assert R.kept_count_weights(np.array([1, 0, 1, 1], np.float32)).tolist() == pytest.approx([4 / 3, 0, 4 / 3, 4 / 3])
    assert R.kept_count_weights(np.zeros(4, np.float32)).tolist() == [0, 0, 0, 0]
    np.testing.assert_array_equal(R.kept_count_weights(np.ones(4, np.float32)), np.ones(4, np.float32))
