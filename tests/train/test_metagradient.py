"""Metagradient attribution (train/metagradient.py, stages/metagradient.py): toy runs with known
answers (float64), the differentiable pieces (clip, weighted advantages), and on a smoke GRPO run:
the metagradient's forward is the run bit for bit, and central finite differences of replays agree
with dM/dw; (slow) the same for the recomputed-advantage variant and the stage end to end."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from behaviortrace_jax.attribution import estimators as E
from behaviortrace_jax.models import sharding
from behaviortrace_jax.attribution import counterfactual_tables as CF
from behaviortrace_jax.train import grpo_loss, metagradient as MG, replay as R, train_state
from behaviortrace_jax.stages.spec import RunSpec
from test_replay import STEPS, X, Y, toy_replay


# ------------------------------------------------------------------------------------------------
# Toy runs: per-example weighted least squares, one step per pair of examples.
# ------------------------------------------------------------------------------------------------
def toy_step(tx):
    """The pure step of test_replay's toy run (weighted squared loss, then ``tx``)."""
    def step(theta, opt_state, batch, w, aux):
        g = jax.grad(lambda t: jnp.sum(w * (batch["x"] @ t - batch["y"]) ** 2))(theta)
        updates, opt_state = tx.update(g, opt_state, theta)
        return optax.apply_updates(theta, updates), opt_state, {}
    return step


def toy_metagradient(tx, x, y, measure, *, dtype=jnp.float32, checkpoint_every=0, weights=None):
    n_steps = int(STEPS.max()) + 1
    w = np.ones(len(y)) if weights is None else weights
    batches = [{"x": jnp.asarray(x[STEPS == s], dtype), "y": jnp.asarray(y[STEPS == s], dtype)} for s in range(n_steps)]
    ws = [jnp.asarray(w[STEPS == s], dtype) for s in range(n_steps)]
    theta = jnp.zeros(2, dtype)
    out, stats = MG.reverse_metagradients(MG.MetaStep(toy_step(tx)), theta, tx.init(theta), batches, ws,
                                          jax.jit(jax.value_and_grad(measure)), [n_steps],
                                          checkpoint_every=checkpoint_every)
    return out[n_steps], stats


def test_toy_metagradient_finds_the_one_example_that_matters():
    """SGD toy of test_replay: only example 5 moves theta[1]; its metagradient is the only nonzero one and
    equals its leave-one-out drop (M is linear in w_5 there)."""
    res, _ = toy_metagradient(optax.sgd(0.1), X, Y, lambda t: t[1])
    g = res.dw.reshape(-1)  # steps hold examples in log order (two per step)
    assert CF.top_k(g, np.arange(8), 1).tolist() == [5]
    assert np.count_nonzero(g) == 1
    full = toy_replay(np.ones(8, np.float32))
    loo5 = full - toy_replay(CF.removal_weights(8, [5]))
    np.testing.assert_allclose(g[5], loo5, rtol=1e-5)
    assert res.value == pytest.approx(full, rel=1e-6)


def _optim(**kw):
    return train_state.OptimOptions(**dict(dict(lr=0.05, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, grad_clip=1.0),
                                           **kw))


def test_toy_metagradient_through_clip_and_adamw_matches_central_differences():
    """float64: dM/dw through the run's optimizer (global-norm clip active on some steps, AdamW with both
    moments, bias correction and weight decay) equals central differences of replays to 1e-6 relative
    (truncation error eps^2 ~ 1e-12); the checkpoint spacing changes nothing; the differentiable clip
    has the same vjp as optax's own where the gradient is not zero."""
    x = X + np.array([0.0, 1.0], np.float32) * (0.3 + 0.1 * np.arange(8))[:, None]  # every example moves both
    measure = lambda t: t[0] * t[1] + jnp.sin(t[1])  # noqa: E731 - a non-linear behaviour
    with jax.enable_x64(True):
        tx = train_state.make_optimizer(_optim(), differentiable=True)
        res, stats = toy_metagradient(tx, x, Y, measure, dtype=jnp.float64)
        g = res.dw.reshape(-1)
        for k in (1, 3):
            again, st = toy_metagradient(tx, x, Y, measure, dtype=jnp.float64, checkpoint_every=k)
            np.testing.assert_array_equal(again.dw.reshape(-1), g)
            assert st.checkpoint_every == k
        plain, _ = toy_metagradient(train_state.make_optimizer(_optim()), x, Y, measure, dtype=jnp.float64)
        np.testing.assert_allclose(plain.dw.reshape(-1), g, rtol=1e-12)
        eps = 1e-6
        for i in range(8):
            wp, wm = np.ones(8), np.ones(8)
            wp[i] += eps
            wm[i] -= eps
            mp = toy_metagradient(tx, x, Y, measure, dtype=jnp.float64, weights=wp)[0].value
            mm = toy_metagradient(tx, x, Y, measure, dtype=jnp.float64, weights=wm)[0].value
            np.testing.assert_allclose((mp - mm) / (2 * eps), g[i], rtol=1e-6, atol=1e-9)
    assert np.all(g != 0) and stats.backward_steps == 4


def test_differentiable_clip_matches_optax_and_is_finite_at_zero():
    clip, ref = train_state.differentiable_clip_by_global_norm(1.0), optax.clip_by_global_norm(1.0)
    rng = np.random.default_rng(0)
    ct = {"a": jnp.asarray(rng.normal(size=3), jnp.float32), "b": jnp.asarray(rng.normal(size=(2, 2)), jnp.float32)}
    for scale in (0.1, 10.0):  # below and above the clip norm
        g = jax.tree.map(lambda c: c * scale, ct)
        mine = jax.jit(lambda u: clip.update(u, optax.EmptyState())[0])(g)  # inside jit, as in the step
        theirs = jax.jit(lambda u: ref.update(u, optax.EmptyState())[0])(g)
        for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the same forward, bit for bit
        _, vjp_mine = jax.vjp(lambda u: clip.update(u, optax.EmptyState())[0], g)
        _, vjp_ref = jax.vjp(lambda u: ref.update(u, optax.EmptyState())[0], g)
        for a, b in zip(jax.tree.leaves(vjp_mine(ct)), jax.tree.leaves(vjp_ref(ct))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    zero = jax.tree.map(jnp.zeros_like, ct)
    _, vjp_ref = jax.vjp(lambda u: ref.update(u, optax.EmptyState())[0], zero)
    assert not np.all(np.isfinite(np.asarray(vjp_ref(ct)[0]["a"])))  # optax's own vjp: NaN at g = 0
    _, vjp_mine = jax.vjp(lambda u: clip.update(u, optax.EmptyState())[0], zero)
    for a, b in zip(jax.tree.leaves(vjp_mine(ct)), jax.tree.leaves(ct)):  # identity below the clip norm
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_weighted_group_advantages_equal_the_logged_and_recomputed_ones():
    r = np.array([0, 8, 0, 0, 1, 1, 1, 1, -2, 6, 0, 8], np.float32)
    ones = np.ones(12, np.float32)
    got = np.asarray(MG.weighted_group_advantages(jnp.asarray(r), jnp.asarray(ones), 4))
    np.testing.assert_allclose(got, grpo_loss.group_advantages(r, 4), atol=1e-6)
    assert np.all(got[4:8] == 0)  # an all-equal group stays exactly 0
    keep = np.array([1, 1, 0, 1, 1, 0, 1, 1, 1, 0, 1, 1], np.float32)
    got = np.asarray(MG.weighted_group_advantages(jnp.asarray(r), jnp.asarray(keep), 4))
    want = R.recomputed_advantages(r, keep, 4, 0.0)
    np.testing.assert_allclose(got[keep > 0], want[keep > 0], atol=1e-6)
    with jax.enable_x64(True):  # its derivative in w is finite and matches central differences
        f = jax.jit(lambda w: jnp.sum(MG.weighted_group_advantages(jnp.asarray(r, jnp.float64), w, 4) * jnp.arange(12.0)))
        w0 = jnp.ones(12, jnp.float64)
        g = np.asarray(jax.grad(f)(w0))
        e = np.eye(12) * 1e-6
        fd = np.array([(f(w0 + e[i]) - f(w0 - e[i])) / 2e-6 for i in range(12)])
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8)
        assert np.all(g[4:8] == 0)


def test_metagradient_estimator_rows_and_step_sums():
    g = np.array([0.5, -1.0, 2.0, 0.25, 0.0, 1.0])
    steps = np.array([0, 0, 1, 1, 2, 2])
    per_rollout = E.call_estimator("metagradient", metagradient=g, steps=steps, rollout_steps=steps)
    np.testing.assert_array_equal(per_rollout, g)
    per_step = E.call_estimator("metagradient", metagradient=g, steps=np.arange(3), rollout_steps=steps)
    np.testing.assert_array_equal(per_step, [-0.5, 2.25, 1.0])
    ids = [f"grpo_{s:06d}_{i:03d}" for s, i in zip(steps, [0, 1] * 3)]
    out = E.score_step_methods(np.zeros((3, 4)), np.arange(3), ids, steps, target=np.ones(4), metagradient=g,
                               names=["metagradient"])
    np.testing.assert_array_equal(out["metagradient"], [-0.5, -0.5, 2.25, 2.25, 1.0, 1.0])
    assert "metagradient" not in E.score_step_methods(np.zeros((3, 4)), np.arange(3), ids, steps, target=np.ones(4))


# ------------------------------------------------------------------------------------------------
# The vjp's rematerialisation (config.metagradient.remat): the same values, in less memory.
# ------------------------------------------------------------------------------------------------
def _meta_step(remat, scan):
    from flax import nnx

    from behaviortrace_jax.models import decoder
    from behaviortrace_jax.stages.spec import RunSpec
    from behaviortrace_jax.train import grpo_step as grpo
    from configs import tiny
    from test_grpo import SHAPES, _model_cfg

    config = tiny.get_config()
    config.metagradient.remat = remat
    run = RunSpec.from_config(config)  # metagradient.remat is a string; the policy is checked by build_meta_step
    cfg = _model_cfg().replace(scan_layers=scan)
    graphdef, params = nnx.split(decoder.init_model(cfg, seed=3), nnx.Param)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    spec = grpo.GRPOStepSpec(SHAPES, "paper", grpo_loss.LossConfig(), grad_clip=1.0, in_run_rollouts=False,
                             fused=False)
    opt = train_state.make_optimizer(run.optim).init(params)
    meta = MG.build_meta_step(run.optim, run.rollouts.adv_std_floor, graphdef, abstract, cfg, spec, None, None, opt,
                              advantages="logged", remat=run.metagradient.remat)
    return meta, params, opt


def _primitives(jaxpr, acc=None) -> set[str]:
    """The names of every primitive in ``jaxpr`` and the jaxprs nested in its equations."""
    acc = set() if acc is None else acc
    for e in jaxpr.eqns:
        acc.add(e.primitive.name)
        for v in e.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _primitives(inner, acc)
    return acc


# configs/paper.py's policy runs in CI; the other policies (and the unrolled layers) take the same
# code path with another jax.checkpoint policy: `-m slow`.
REMAT_NAMES = ("nothing_saveable", "dots_with_no_batch_dims_saveable", "dots_saveable")
REMAT_CASES = [pytest.param(p, s, marks=pytest.mark.slow) if (p, s) != ("nothing_saveable", True) else (p, s)
               for p in REMAT_NAMES for s in (True, False)]


def test_remat_cases_cover_every_policy():
    from behaviortrace_jax.models import decoder

    assert sorted(REMAT_NAMES) == sorted(decoder.REMAT_POLICIES)


# ||remat - plain|| / ||plain|| per cotangent leaf: the bound test_remat_metagradient_vjp_equals_the_plain_one holds
# (its docstring says why it holds on any x86-64 CPU, and what a real difference gives).
REMAT_NORM_RTOL = 2e-5


def _mid_run_opt_state(opt, rng):
    """``opt`` (a fresh optax state: Adam moments 0, count 0) with the moments of a run under way: count
    10, first moments N(0, 1e-3), second moments U(0.5, 1.5) x 1e-4 (so ``1 / sqrt(v_hat)`` <= ~15)."""
    def moment(path, x):
        names = {getattr(k, "name", None) for k in path}
        if "nu" in names:
            return jnp.asarray(rng.uniform(0.5, 1.5, x.shape) * 1e-4, x.dtype)
        if "mu" in names:
            return jnp.asarray(rng.standard_normal(x.shape) * 1e-3, x.dtype)
        if "count" in names:
            return jnp.full(x.shape, 10, x.dtype)
        return x
    return jax.tree_util.tree_map_with_path(moment, opt)


def _norm_rel_errors(got, want) -> list[float]:
    """``||a - b||_2 / ||b||_2`` per leaf, in float64 (0 where both are 0)."""
    out = []
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = np.linalg.norm(b)
        out.append(float(np.linalg.norm(a - b) / scale) if scale > 0 else float(np.linalg.norm(a)) * np.inf)
    return [0.0 if np.isnan(e) else e for e in out]


@pytest.mark.parametrize("policy,scan", REMAT_CASES)
def test_remat_metagradient_vjp_equals_the_plain_one(policy, scan):
    """float32: the vjp of one weighted GRPO step (clip + AdamW, 2-layer Qwen2) with each decoder layer
    rematerialised (a policy of decoder.REMAT_POLICIES; every one is a case) gives the plain vjp's
    cotangents of the weights, parameters and Adam moments: per leaf,
    ``||remat - plain||_2 <= REMAT_NORM_RTOL ||plain||_2`` (2e-5); the rematerialised program does hold a
    checkpoint (its jaxpr), and the forward is not rematerialised.

    The quantity is well conditioned: the Adam state is a run's mid-run state (second moments >= 5e-5),
    not a fresh one. From a fresh state (v = 0) the update's derivatives go through 1 / sqrt(v) with v
    near 0 and the cotangents are of order 1e12: one element of 2,048 was off by 2.5e-4 relative on an
    AVX2 CPU (issue 49), the norm-relative error is 1e-7..2.2e-4 here, and 3.3e-3 between ISAs.

    Why the bound holds on any x86-64 CPU: both programs evaluate one float32 expression graph (IEEE 754
    binary32, round to nearest; XLA:CPU enables no fast-math, and emits its own exp / log / rsqrt
    polynomials, the same at every vector width). What the CPU's vector ISA (SSE4.2 / AVX2 / AVX-512:
    4 / 8 / 16 lanes) and the remat (the layer's forward recomputed inside the backward, fused
    differently) can change is the order float32 sums are accumulated in and which multiply-adds are
    fused. A sum of n terms in any order is within gamma_(n-1) * sum|x_i| of the exact sum
    (gamma_n = n u / (1 - n u), u = 2^-24 ~ 6e-8; Higham, Accuracy and Stability of Numerical
    Algorithms, eq. 4.4) and a fused multiply-add changes one rounding (<= u); so each program is within
    c * u * kappa of the exact vjp (kappa: the vjp's condition number in its intermediates; c: the
    rounding errors one result accumulates) and the two within twice that. That is an order-of-magnitude
    argument, not a proof for every n: it says the error scales with kappa, which the mid-run state keeps
    small, and not with the ISA. Measured (2-core AMD EPYC family 26 model 2, AVX-512, jax 0.10.2): worst
    leaf 5.6e-8..3.3e-7 over the six cases (2 c * kappa ~ 1..6 in units of u); with XLA's ISA capped
    (XLA_FLAGS=--xla_cpu_max_isa=SSE4_2 / AVX2 / AVX512, i.e. another CPU's reduction order) and plain
    and remat paired across ISAs, at most 2.4e-7 (nothing_saveable, scan). REMAT_NORM_RTOL = 2e-5
    (~340 u) is 60x the worst measured. A remat that changed the result moves the cotangents far more:
    one rollout's weight off by 1% gives 9.0e-4 (45x the bound), and the test checks that it would fail
    on that.
    """
    from test_grpo import _batch

    rng = np.random.default_rng(0)
    plain, params, opt = _meta_step("", scan)
    batch = {k: v for k, v in _batch(seed=1).items() if k in ("input_ids", "attention_mask", "loss_mask", "advantages")}
    w = jnp.asarray(rng.uniform(0.5, 1.5, batch["advantages"].shape[0]), jnp.float32)
    ct_p = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params)
    ct_o = [jnp.asarray(rng.standard_normal(x.shape) * 0.1, x.dtype) for x in MG.opt_float_leaves(opt)]
    opt = _mid_run_opt_state(opt, np.random.default_rng(7))
    args = (params, opt, batch, w, None, ct_p, ct_o)
    want = jax.tree.leaves(plain.backward(*args))
    assert "remat2" not in _primitives(jax.make_jaxpr(plain.backward)(*args).jaxpr)
    meta, _, _ = _meta_step(policy, scan)
    assert "remat2" in _primitives(jax.make_jaxpr(meta.backward)(*args).jaxpr)  # jax.checkpoint's primitive
    assert "remat2" not in _primitives(jax.make_jaxpr(meta.forward)(params, opt, batch, w, None).jaxpr)
    got = jax.tree.leaves(meta.backward(*args))
    assert len(got) == len(want)
    errors = _norm_rel_errors(got, want)
    worst = int(np.argmax(errors))
    assert errors[worst] <= REMAT_NORM_RTOL, (worst, errors[worst])
    assert np.any(np.asarray(got[-1]) != 0)  # the weights' cotangent is not trivially zero
    # The test can fail: a result changed as by one rollout's weight off by 1% is far outside the bound.
    off = jax.tree.leaves(plain.backward(params, opt, batch, w.at[0].multiply(1.01), None, ct_p, ct_o))
    assert max(_norm_rel_errors(off, want)) > 10 * REMAT_NORM_RTOL


def test_metagradient_remat_names_a_policy():
    with pytest.raises(ValueError, match="metagradient.remat='bogus'"):
        _meta_step("bogus", True)


# ------------------------------------------------------------------------------------------------
# A smoke GRPO run: the forward is the run, and replays at w = 1 +- eps agree with dM/dw.
# ------------------------------------------------------------------------------------------------
def _assert_central_differences(mg, g, stop, indices, *, eps, rtol, atol):
    for i in indices:
        wp, wm = np.ones(mg.rp.num_rollouts), np.ones(mg.rp.num_rollouts)
        wp[i] += eps
        wm[i] -= eps
        fd = (mg.replay_margin(wp, stop) - mg.replay_margin(wm, stop)) / (2 * eps)
        assert abs(fd - g[i]) <= rtol * abs(g[i]) + atol, (i, fd, g[i])


def _assert_directional_difference(mg, g, stop, support, *, eps, rtol):
    v = np.zeros(mg.rp.num_rollouts)
    v[support] = np.sign(g[support])
    fd = (mg.replay_margin(1 + eps * v, stop) - mg.replay_margin(1 - eps * v, stop)) / (2 * eps)
    assert fd == pytest.approx(float(g @ v), rel=rtol)


def test_metagradient_forward_is_the_run_and_matches_central_differences(smoke_grpo_run):
    """float32 tolerances: M is a float32 mean log-prob margin (|log p| ~ 5, so 1 ulp ~ 5e-7), and a
    central difference with eps = 0.1 divides its rounding by 2 eps: ~2.5e-6 of noise per rollout
    against dM/dw ~ 4e-5 here, hence rtol 5 % + atol 2.5e-6 per rollout; a direction over 16 rollouts
    sums their effects (~5e-4) against the same noise: rtol 2 %. The truncation error (eps^2) is
    below 1 % at eps = 0.1 (measured: 0.01-1 % for the largest rollouts)."""
    config, w = smoke_grpo_run
    mg = MG.RunMetagradient(RunSpec.from_config(config).replay, w, layout=RunSpec.from_config(config).layout)
    ckpts, seen = RunSpec.from_config(config).schedule.checkpoint_steps(), []
    stop = min(int(config.contamination.early_step_cutoff), int(config.grpo.steps))

    def check(step, params, _):
        if step in ckpts:
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(R.restore_run_params(mg.rp, step))):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            seen.append(step)

    grads, values, stats = mg.run([stop], on_forward=check)
    assert seen == [c for c in ckpts if c <= stop]
    g = grads[stop]
    n = mg.n
    assert np.all(g[stop * n:] == 0) and np.count_nonzero(g[:stop * n]) > stop * n // 2
    assert stats.max_states_held <= -(-stop // stats.checkpoint_every) + stats.checkpoint_every + 1
    assert values[stop] == pytest.approx(mg.replay_margin(None, stop), abs=1e-6)
    top = np.argsort(-np.abs(g))
    _assert_central_differences(mg, g, stop, top[:2], eps=0.1, rtol=0.05, atol=2.5e-6)
    _assert_directional_difference(mg, g, stop, top[:16], eps=0.05, rtol=0.02)


@pytest.mark.slow  # a second compile of the metagradient's step and its vjp (~1 min on 2 cores)
def test_recomputed_advantage_metagradient_matches_central_differences(smoke_grpo_run):
    config, w = smoke_grpo_run
    stop = min(int(config.contamination.early_step_cutoff), int(config.grpo.steps))
    spec = RunSpec.from_config(config)
    mg = MG.RunMetagradient(spec.replay, w, advantages="recomputed", layout=spec.layout)
    g = mg.run([stop])[0][stop]
    logged = MG.RunMetagradient(RunSpec.from_config(config).replay, w, replayer=mg.rp).run([stop])[0][stop]
    assert not np.allclose(g, logged, rtol=0.02)  # the baselines' dependence on the weights matters
    top = np.argsort(-np.abs(g))
    _assert_central_differences(mg, g, stop, top[:2], eps=0.1, rtol=0.05, atol=2.5e-6)
    _assert_directional_difference(mg, g, stop, top[:16], eps=0.05, rtol=0.02)


@pytest.mark.slow  # the stage (compile + reverse sweep) and a rerun
def test_metagradient_stage_writes_scores_and_resumes(smoke_grpo_run, tmp_path):
    import shutil

    from behaviortrace_jax import pipeline
    from behaviortrace_jax.io.files import read_json
    from behaviortrace_jax.io.layout import RunLayout
    from behaviortrace_jax.attribution.scores import metagradient_scores

    config, src = smoke_grpo_run
    for sub in ("base", "sft", "grpo"):
        shutil.copytree(src / sub, tmp_path / sub)
    config = config.copy_and_resolve_references()
    config.stages = "metagradient"
    config.metagradient.advantages = "logged,recomputed"
    pipeline.run(config, str(tmp_path))
    paths = RunLayout(tmp_path)
    rec = read_json(paths.metagradient / "logged.json")
    at = RunSpec.from_config(config).schedule.measure_step(config.counterfactual.measure)
    assert set(rec["measures"]) == {str(at), str(RunSpec.from_config(config).schedule.target_checkpoint())}
    scores = metagradient_scores(paths, rec["rollout_ids"])
    np.testing.assert_array_equal(scores, rec["measures"][str(at)]["dM_dw"])
    assert rec["stats"]["max_states_held"] > 0 and (paths.metagradient / "recomputed.json").exists()
    mtime = (tmp_path / "metagradient" / "logged.json").stat().st_mtime_ns
    pipeline.run(config, str(tmp_path))  # resumes: nothing recomputed
    assert (tmp_path / "metagradient" / "logged.json").stat().st_mtime_ns == mtime
    with pytest.raises(ValueError, match="rollout ids"):
        metagradient_scores(paths, rec["rollout_ids"][:-1])
