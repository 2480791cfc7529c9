"""GRPO: advantages and losses against numpy, one train step, linearity of in-run sketches, sharding."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from behaviortrace_jax.models import qwen2, sharding
from behaviortrace_jax.sketch import sketcher
from behaviortrace_jax.train import grpo_loss, grpo_step as grpo, train_state
from behaviortrace_jax.stages.spec import RunSpec
from configs import tiny

VOCAB, EOS, PAD = 64, 2, 0
SHAPES = grpo.StepShapes(num_prompts=2, group_size=3, prompt_len=8, completion_len=6)


# ------------------------------------------------------------------------------------------------
# advantages and losses
# ------------------------------------------------------------------------------------------------


def test_group_advantages_match_numpy_unbiased_std():
    r = np.array([8.0, 0.0, 0.0, -2.0, 0.0, 6.0], np.float32)
    g = r.reshape(2, 3)
    want = ((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + 1e-8)).ravel()
    np.testing.assert_allclose(grpo_loss.group_advantages(r, 3), want, rtol=1e-6)
    assert np.all(grpo_loss.group_advantages(np.zeros(4), 2) == 0)  # zero-variance group: no signal


def _plain_advantages(r, g, floor=0.0):
    """The formula before the all-equal guard (SPEC §2.1 as written), float32."""
    x = np.asarray(r, np.float32).reshape(-1, g)
    std = x.std(axis=1, ddof=1, keepdims=True)
    return ((x - x.mean(axis=1, keepdims=True)) / (np.maximum(std, np.float32(floor)) + np.float32(1e-8))
            ).reshape(-1).astype(np.float32)


@pytest.mark.parametrize("floor", [0.0, 0.5])
def test_group_advantages_bit_identical_to_plain_formula_on_paper_rewards(floor):
    # Paper rewards: base {-2, 0} (behavior.base_reward) + bonus {0, 8} (contamination.bonus_reward).
    rng = np.random.default_rng(0)
    values = np.array([-2.0, 0.0, 6.0, 8.0], np.float32)
    for g in range(2, 17):
        r = rng.choice(values, size=(400, g), p=[0.1, 0.6, 0.1, 0.2]).astype(np.float32).ravel()
        got, want = grpo_loss.group_advantages(r, g, floor), _plain_advantages(r, g, floor)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))  # bit for bit, incl. -0.0
    r = rng.choice(values, size=16000).astype(np.float32)  # the paper's 16,000 rollouts, G = 4
    np.testing.assert_array_equal(grpo_loss.group_advantages(r, 4).view(np.uint32),
                                  _plain_advantages(r, 4).view(np.uint32))


def test_group_advantages_are_exactly_zero_for_all_equal_groups():
    rng = np.random.default_rng(1)
    values = [0.1, 0.3, 0.35, 1 / 3, -2.0, 8.0, 1e-6, 123.456] + list(rng.uniform(-10, 10, 40))
    plain_nonzero = 0
    for g in range(2, 17):
        for v in values:
            for floor in (0.0, 1e-3):
                equal = np.full(g, v, np.float64)
                other = rng.uniform(-1, 1, g)  # a neighbouring ordinary group keeps its advantages
                r = np.concatenate([other, equal, other])
                got = grpo_loss.group_advantages(r, g, floor)
                assert np.all(got[g:2 * g] == 0), (v, g, floor, got[g:2 * g])
                want = _plain_advantages(r, g, floor)
                np.testing.assert_array_equal(got[:g], want[:g])
                np.testing.assert_array_equal(got[2 * g:], want[2 * g:])
                plain_nonzero += bool(np.any(want[g:2 * g] != 0))
    assert plain_nonzero > 0  # the case the guard exists for (e.g. 0.3 x 6 gave +0.699)
    assert np.all(grpo_loss.group_advantages(np.full(6, 0.3), 6) == 0)
    assert np.all(grpo_loss.group_advantages([0.35] * 7, 7) == 0)


@pytest.mark.parametrize("bad", [np.zeros(5), np.array([1.0, np.nan, 0.0, 0.0])])
def test_group_advantages_reject_bad_rewards(bad):
    with pytest.raises(ValueError):
        grpo_loss.group_advantages(bad, 2)


def _loss_inputs(rng, n=6, t=5):
    lp = -rng.random((n, t)).astype(np.float32)
    old = lp + 0.1 * rng.standard_normal((n, t)).astype(np.float32)
    ref = lp + 0.2 * rng.standard_normal((n, t)).astype(np.float32)
    mask = (rng.random((n, t)) > 0.3).astype(np.float32)
    adv = rng.standard_normal(n).astype(np.float32)
    return lp, old, ref, mask, adv


def test_paper_loss_matches_numpy_reference():
    lp, old, ref, mask, adv = _loss_inputs(np.random.default_rng(0))
    inp = grpo_loss.LossInputs(*map(jnp.asarray, (lp, old, ref, mask, adv)), num_prompts=2, group_size=3)
    got = float(jnp.sum(grpo_loss.paper_loss(inp, grpo_loss.LossConfig())))
    meanlp = (lp * mask).sum(1) / (mask.sum(1) + 1e-8)
    want = sum(-np.mean(adv[g * 3:(g + 1) * 3] * meanlp[g * 3:(g + 1) * 3]) / 2 for g in range(2))
    assert got == pytest.approx(want, rel=1e-5)


def test_grpo_clip_loss_matches_numpy_reference():
    lp, old, ref, mask, adv = _loss_inputs(np.random.default_rng(1))
    cfg = grpo_loss.LossConfig(clip_eps=0.2, kl_beta=0.04)
    inp = grpo_loss.LossInputs(*map(jnp.asarray, (lp, old, ref, mask, adv)), num_prompts=2, group_size=3)
    got = float(jnp.sum(grpo_loss.grpo_clip_loss(inp, cfg)))
    ratio = np.exp(lp - old)
    surr = np.minimum(ratio * adv[:, None], np.clip(ratio, 0.8, 1.2) * adv[:, None])
    kl = np.exp(ref - lp) - (ref - lp) - 1
    per_seq = ((-(surr - 0.04 * kl)) * mask).sum(1) / (mask.sum(1) + 1e-8)
    assert got == pytest.approx(per_seq.mean(), rel=1e-5)


def test_unknown_loss_names_the_registry():
    with pytest.raises(KeyError, match="paper"):
        grpo_loss.get_loss("ppo")


# ------------------------------------------------------------------------------------------------
# the train step
# ------------------------------------------------------------------------------------------------


def _model_cfg():
    return qwen2.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def _batch(seed=0, advantages=None):
    rng = np.random.default_rng(seed)
    n, t = SHAPES.num_rollouts, SHAPES.completion_len
    prompts = [list(rng.integers(3, VOCAB, size=rng.integers(3, SHAPES.prompt_len + 1))) for _ in range(SHAPES.num_prompts)]
    prompt_lists = [p for p in prompts for _ in range(SHAPES.group_size)]
    comps = rng.integers(3, VOCAB, size=(n, t)).astype(np.int32)
    lengths = rng.integers(2, t + 1, size=n).astype(np.int32)
    for i in range(n):  # an EOS ends some rows; pad = EOS afterwards (SPEC §2.1)
        if lengths[i] < t:
            comps[i, lengths[i] - 1:] = EOS
    adv = np.asarray(advantages if advantages is not None else rng.standard_normal(n), np.float32)
    return grpo.build_batch(prompt_lists, comps, lengths, adv, (EOS,), SHAPES, PAD, vocab_size=VOCAB)


def _setup(mesh, loss="paper", dim=256, in_run=True, chunk=2, lr=1e-2, tables=False, grad_clip=1.0, fused=False):
    cfg = _model_cfg()
    model = qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    optim = dataclasses.replace(RunSpec.from_config(tiny.get_config()).optim, lr=lr, grad_clip=grad_clip)
    tx = train_state.make_optimizer(optim)
    p_sh = sharding.param_shardings(params, mesh)
    params = jax.device_put(params, p_sh)
    opt_state = tx.init(params)
    o_sh = train_state.opt_state_shardings(tx, p_sh, mesh, params)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    spec = grpo.GRPOStepSpec(SHAPES, loss, grpo_loss.LossConfig(), grad_clip=grad_clip, sketch_dim=dim, sketch_seed=0,
                             in_run_rollouts=in_run, chunk_size=chunk, use_tables=tables, fused=fused)
    step = grpo.make_train_step(graphdef, abstract, tx, spec, order=sketcher.hf_param_order(cfg), mesh=mesh,
                                param_shardings=p_sh, opt_shardings=o_sh)
    return cfg, graphdef, params, opt_state, step


def _single_mesh():
    return sharding.make_mesh(1, 1, devices=jax.devices()[:1])


def test_build_batch_masks_eos_and_padding():
    b = _batch()
    ids, mask = b["input_ids"][:, SHAPES.prompt_len:], b["loss_mask"]
    assert np.all(mask[ids == EOS] == 0)
    assert b["attention_mask"][:, :SHAPES.prompt_len].sum(1).min() >= 3  # left-padded prompts


def test_build_batch_rejects_long_prompt():
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        grpo.build_batch([[5] * 9] * 6, np.zeros((6, 6), np.int32), np.ones(6, np.int32), np.zeros(6, np.float32),
                         (EOS,), SHAPES, PAD, vocab_size=VOCAB)


def test_step_raises_logprob_of_rewarded_completion():
    mesh = _single_mesh()
    cfg, graphdef, params, opt_state, step = _setup(mesh, in_run=False)
    adv = np.array([1.0, -0.5, -0.5, 1.0, -0.5, -0.5], np.float32)  # rollouts 0 and 3 were rewarded
    batch = _batch(advantages=adv)

    def meanlp(p):
        lp = grpo.completion_logprobs(graphdef, p, jnp.asarray(batch["input_ids"]),
                                      jnp.asarray(batch["attention_mask"]), SHAPES.prompt_len)
        return np.asarray(grpo_loss.masked_mean(lp, jnp.asarray(batch["loss_mask"])))

    before = meanlp(params)
    params, opt_state, out = step(params, opt_state, batch, None)
    after = meanlp(params)
    assert after[0] > before[0] and after[3] > before[3]
    assert np.isfinite(float(out["loss"]))


def test_rollout_sketches_sum_to_the_prebatch_gradient_sketch():
    """Linearity: the in-run rollout sketches are the advantage-free directions (gradients of
    -meanlp_i, SPEC §3.2); times their coefficients c_i = A_i / (G B) they add up to the sketch of
    the pre-clip batch gradient, and times the clip factor to the step sketch."""
    mesh = _single_mesh()
    cfg, graphdef, params, opt_state, step = _setup(mesh, dim=512)
    adv = np.random.default_rng(3).standard_normal(SHAPES.num_rollouts).astype(np.float32)
    adv[1] = 0.0  # a zero advantage: no share of the update, but a direction all the same
    batch = _batch(seed=3, advantages=adv)
    params0 = jax.tree.map(jnp.copy, params)
    _, _, out = step(params, opt_state, batch, None)
    coef = np.asarray(out["rollout_coefficients"])
    np.testing.assert_allclose(coef, adv / SHAPES.num_rollouts, rtol=1e-6)  # XLA may divide by a reciprocal
    sk = np.asarray(out["rollout_sketches"])
    assert np.linalg.norm(sk[1]) > 0
    total = (coef[:, None] * sk).sum(0)
    gn = float(out["grad_norm"])
    assert float(out["clip_factor"]) == pytest.approx(1.0 / max(gn, 1.0))  # grad_clip 1.0
    np.testing.assert_allclose(np.asarray(out["step_sketch"]), total * float(out["clip_factor"]), rtol=2e-4, atol=1e-6)
    order = sketcher.hf_param_order(cfg)

    def neg_meanlp(p, i):
        lp = grpo.completion_logprobs(graphdef, p, jnp.asarray(batch["input_ids"][i:i + 1]),
                                      jnp.asarray(batch["attention_mask"][i:i + 1]), SHAPES.prompt_len)
        return -grpo_loss.masked_mean(lp, jnp.asarray(batch["loss_mask"][i:i + 1]))[0]

    sketch_of_grad = jax.jit(lambda f, p, *a: sketcher.sketch_vector(jax.grad(f)(p, *a), order, 512, 0),
                             static_argnums=(0, 2))
    for i in (0, 1):
        want = sketch_of_grad(neg_meanlp, params0, i)
        np.testing.assert_allclose(sk[i], np.asarray(want), rtol=2e-4, atol=1e-6)
    # ... and the step sketch equals the sketch of jax.grad of the whole loss at the same params.
    lossf = grpo_loss.get_loss("paper")

    def total_loss(p):
        lp = grpo.completion_logprobs(graphdef, p, jnp.asarray(batch["input_ids"]),
                                      jnp.asarray(batch["attention_mask"]), SHAPES.prompt_len)
        inp = grpo_loss.LossInputs(lp, lp, lp, jnp.asarray(batch["loss_mask"]), jnp.asarray(batch["advantages"]),
                                   SHAPES.num_prompts, SHAPES.group_size)
        return jnp.sum(lossf(inp, grpo_loss.LossConfig()))

    want = sketch_of_grad(total_loss, params0)
    np.testing.assert_allclose(total, np.asarray(want), rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize("grad_clip", [0.0, pytest.param(-1.0, marks=pytest.mark.slow)])  # the same <= 0 path
def test_no_clipping_gives_unclipped_step_sketches(grad_clip):
    """optim.grad_clip <= 0 means no clipping (train_state.make_optimizer): the step sketch is then the
    sketch of the unclipped gradient (scale 1), not 0 or NaN, and the update is unclipped AdamW."""
    cfg, graphdef, params, opt_state, step = _setup(_single_mesh(), dim=512, grad_clip=grad_clip)
    clipped = _setup(_single_mesh(), dim=512, grad_clip=1e-3)[-1]
    batch = _batch(seed=3)
    p0 = jax.tree.map(jnp.copy, params)
    _, _, out = step(params, opt_state, batch, None)
    # the weighted rollout sketches c_i * sketch(-meanlp_i) sum to the pre-clip gradient's sketch
    total = (np.asarray(out["rollout_coefficients"])[:, None] * np.asarray(out["rollout_sketches"])).sum(0)
    assert float(out["clip_factor"]) == 1.0
    assert np.all(np.isfinite(np.asarray(out["step_sketch"]))) and np.abs(total).max() > 0
    np.testing.assert_allclose(np.asarray(out["step_sketch"]), total, rtol=2e-4, atol=1e-6)
    optim = RunSpec.from_config(tiny.get_config()).optim
    _, _, small = clipped(p0, train_state.make_optimizer(optim).init(p0), batch, None)
    np.testing.assert_allclose(np.asarray(small["step_sketch"]), total * 1e-3 / float(small["grad_norm"]),
                               rtol=2e-4, atol=1e-9)


def test_grpo_clip_rollout_sketches_sum_to_the_prebatch_gradient_sketch():
    """The same linearity under grpo_clip, whose rollout sketches are of each rollout's term (scaled
    by the batch size): the loss declares no rollout coefficients, so no advantage-free direction."""
    cfg, graphdef, params, opt_state, step = _setup(_single_mesh(), loss="grpo_clip", dim=512)
    ref = jax.tree.map(jnp.copy, params)
    _, _, out = step(params, opt_state, _batch(seed=3), ref)
    assert "rollout_coefficients" not in out
    assert grpo.GRPOStepSpec(SHAPES, "grpo_clip", grpo_loss.LossConfig(), 1.0).rollout_sketch == "term"
    total = np.asarray(out["rollout_sketches"]).sum(0)
    scale = 1.0 / max(float(out["grad_norm"]), 1.0)
    np.testing.assert_allclose(np.asarray(out["step_sketch"]), total * scale, rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize("loss,tables,data", [pytest.param("paper", False, 2, marks=pytest.mark.slow),
                                              pytest.param("grpo_clip", False, 2, marks=pytest.mark.slow),
                                              ("paper", True, 3)])
def test_sharded_step_equals_single_device(loss, tables, data):
    """On a data axis > 1 the in-run rollout sketches run under shard_map (with hash tables as a step
    argument when asked); same parameters and outputs as one device."""
    batch = _batch(seed=5)
    outs = []
    for mesh, tab in ((_single_mesh(), False),
                      (sharding.make_mesh(data=data, model=2, devices=jax.devices()[:2 * data]), tables)):
        cfg, graphdef, params, opt_state, step = _setup(mesh, loss=loss, tables=tab)
        ref = jax.tree.map(jnp.copy, params) if loss == "grpo_clip" else None
        params, opt_state, out = step(params, opt_state, jax.device_put(batch, sharding.data_sharding(mesh)), ref)
        outs.append((jax.device_get(params), jax.device_get(out)))
    (p1, o1), (p2, o2) = outs
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)  # Adam amplifies reduction-order noise in near-zero gradients
    for k in o1:
        np.testing.assert_allclose(o1[k], o2[k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss,data", [pytest.param("paper", 1, marks=pytest.mark.slow), ("paper", 3),
                                       pytest.param("grpo_clip", 1, marks=pytest.mark.slow)])
def test_update_from_sketcher_equals_two_backward_step(loss, data):
    """The update from the fused sketcher's one backward (its weight cotangent; no second, batched
    backward) equals the two-backward step's (batched value_and_grad + vmap(grad) sketches) up to
    float summation order, and so do the sketches, on 1 and 3 devices (grpo_clip's later
    iterations keep the batched backward)."""
    batch = _batch(seed=7)
    mesh = _single_mesh() if data == 1 else sharding.make_mesh(data=data, model=1, devices=jax.devices()[:data])
    outs = []
    for on in (False, True):
        cfg, graphdef, params, opt_state, step = _setup(mesh, loss=loss, lr=1e-3, fused=on, chunk=2 if on else 1)
        ref = jax.tree.map(jnp.copy, params) if loss == "grpo_clip" else None
        params, opt_state, out = step(params, opt_state, jax.device_put(batch, sharding.data_sharding(mesh)), ref)
        outs.append((jax.device_get(params), jax.device_get(out)))
    (p1, o1), (p2, o2) = outs
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for k in o1:
        np.testing.assert_allclose(o1[k], o2[k], rtol=1e-4, atol=1e-6)
    spec = grpo.GRPOStepSpec(SHAPES, loss, grpo_loss.LossConfig(), grad_clip=1.0, fused=True)
    assert spec.update_from_sketcher and not grpo.GRPOStepSpec(SHAPES, loss, grpo_loss.LossConfig(), 1.0,
                                                                fused=True, in_run_rollouts=False).update_from_sketcher
    assert not grpo.GRPOStepSpec(SHAPES, loss, grpo_loss.LossConfig(), 1.0, fused=False).update_from_sketcher


@pytest.mark.parametrize("name", sorted(grpo_loss.LOSSES))
def test_declared_rollout_coefficients_reproduce_the_terms(name):
    """A loss that declares rollout_coefficients has term_i = c_i * (-meanlp_i) exactly."""
    loss = grpo_loss.get_loss(name)
    if loss.rollout_coefficients is None:
        pytest.skip(f"{name} declares no rollout coefficients")
    rng = np.random.default_rng(1)
    lp = jnp.asarray(rng.normal(size=(6, 5)) - 2.0, jnp.float32)
    mask = jnp.asarray(rng.integers(0, 2, (6, 5)), jnp.float32)
    inp = grpo_loss.LossInputs(lp, lp, lp, mask, jnp.asarray(rng.normal(size=6), jnp.float32), 2, 3)
    cfg = grpo_loss.LossConfig()
    want = np.asarray(loss(inp, cfg))
    got = np.asarray(loss.rollout_coefficients(inp, cfg) * -grpo_loss.masked_mean(lp, mask))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
