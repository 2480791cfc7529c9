"""model.scan_layers: the decoder's layers as one lax.scan over their stacked parameters
give the unrolled decoder's logits, gradients and KV cache (fp32, tiny Qwen2 / Llama / Qwen3)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from behaviortrace_jax.models import decoder, families


def _models(family: str, remat: bool, layers: int = 3):
    cfg = families.preset("tiny", family, vocab_size=96, num_hidden_layers=layers)
    graphdef, params = nnx.split(decoder.init_model(cfg, seed=1, remat=remat), nnx.Param)
    graphdef_s, _ = nnx.split(decoder.abstract_model(cfg.replace(scan_layers=True), remat), nnx.Param)
    return cfg, graphdef, graphdef_s, params


def _inputs(b=2, t=9):
    ids = jax.random.randint(jax.random.key(0), (b, t), 0, 96)
    am = jnp.ones((b, t), jnp.int32).at[0, :3].set(0)  # left padding on row 0
    return ids, decoder.positions_from_mask(am), am


def _max_rel(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(x))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("family,remat", [pytest.param("qwen2", False, marks=pytest.mark.slow), ("qwen2", True),
                                           pytest.param("llama", True, marks=pytest.mark.slow), ("qwen3", False)])
def test_scanned_forward_and_grads_match_unrolled(family, remat):
    cfg, gd, gd_s, params = _models(family, remat)
    ids, pos, am = _inputs()
    fwd = lambda g, p: decoder.forward(g, p, ids, pos, am)  # noqa: E731
    ref = jax.jit(lambda p: fwd(gd, p))(params)
    out = jax.jit(lambda p: fwd(gd_s, p))(params)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-6)
    # StackedParams: the same logits, and a gradient that comes out stacked [L, ...]
    out_st = jax.jit(lambda p: fwd(gd_s, decoder.stack_layers(p)))(params)
    np.testing.assert_allclose(out_st, ref, rtol=0, atol=1e-6)
    text = jax.jit(lambda p: fwd(gd_s, p)).lower(params).as_text()
    assert "while" in text  # one loop, not L copies of the layer

    loss = lambda g, p: jnp.sum(jnp.tanh(fwd(g, p)))  # noqa: E731
    g_ref = jax.jit(jax.grad(lambda p: loss(gd, p)))(params)
    g_out = jax.jit(jax.grad(lambda p: loss(gd_s, p)))(params)
    assert jax.tree.structure(g_out) == jax.tree.structure(g_ref)
    assert _max_rel(g_ref, g_out) < 2e-6
    g_st = jax.jit(jax.grad(lambda sp: loss(gd_s, sp)))(decoder.stack_layers(params))
    assert isinstance(g_st, decoder.StackedParams)
    assert jax.tree.leaves(g_st.layers)[0].shape[0] == cfg.num_hidden_layers
    assert _max_rel(g_ref, decoder.unstack_layers(g_st)) < 2e-6


@pytest.mark.parametrize("family", ["qwen2", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_scanned_kv_cache_prefill_and_decode_match_unrolled(family):
    cfg, gd, gd_s, params = _models(family, False)
    ids, pos, am = _inputs()
    s_max = 12
    valid = jnp.zeros((2, s_max), jnp.int32).at[:, :9].set(am)

    def run(g):
        def f(p):
            cache = decoder.init_cache(cfg, 2, s_max)
            logits, cache = decoder.forward_with_cache(g, p, ids, pos, valid, cache, jnp.int32(0))
            v2 = valid.at[:, 9].set(1)
            nxt = jnp.argmax(logits[:, -1], -1)[:, None].astype(jnp.int32)
            step, cache = decoder.forward_with_cache(g, p, nxt, pos[:, -1:] + 1, v2, cache, jnp.int32(9))
            return logits, step, cache
        return jax.jit(f)(params)

    ref, out = run(gd), run(gd_s)
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    for x, y in zip(jax.tree.leaves(ref), jax.tree.leaves(out)):
        np.testing.assert_allclose(y, x, rtol=0, atol=1e-6)


def test_stack_unstack_round_trip_and_errors():
    cfg, _, _, params = _models("llama", False, layers=2)
    sp = decoder.stack_layers(params)
    assert ("model", "layers") not in {p[:2] for p, _ in nnx.to_flat_state(sp.rest)}
    back = decoder.unstack_layers(sp)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="model.layers"):
        decoder.stack_layers(nnx.State({"model": {"norm": {"weight": nnx.Param(jnp.ones(3))}}}))
    with pytest.raises(ValueError, match="scan_layers"):
        cfg.replace(scan_layers="yes")
    assert cfg.replace(scan_layers=True).to_hf_config() == cfg.to_hf_config()
