"""Mesh, partition rules and sharded forward/backward parity on the 8 fake CPU devices."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from behaviortrace_jax.models import decoder, qwen2, sharding

CFG = qwen2.Qwen2Config.tiny(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _specs(mesh, cfg=CFG):
    state = nnx.state(decoder.abstract_model(cfg), nnx.Param)
    shards = sharding.param_shardings(state, mesh)
    return {".".join(str(k) for k in path): v.get_value().spec for path, v in nnx.to_flat_state(shards)}


def test_make_mesh_axes_and_errors():
    mesh = sharding.make_mesh(data=4, model=2)
    assert mesh.axis_names == ("data", "model") and dict(mesh.shape) == {"data": 4, "model": 2}
    assert dict(sharding.make_mesh().shape) == {"data": 8, "model": 1}
    assert dict(sharding.make_mesh(model=4).shape) == {"data": 2, "model": 4}
    with pytest.raises(ValueError, match="model=3"):
        sharding.make_mesh(model=3)
    with pytest.raises(ValueError, match="data=3"):
        sharding.make_mesh(data=3, model=2)
    with pytest.raises(ValueError, match="model=-2"):
        sharding.make_mesh(model=-2)


def test_model_axis_chosen_from_the_device_count():
    devs = jax.devices()
    assert [sharding.auto_model_axis(n) for n in (1, 2, 3, 4, 5, 8, 16)] == [1, 2, 1, 2, 1, 2, 2]
    for n, shape in ((1, (1, 1)), (3, (3, 1)), (8, (4, 2))):  # one GPU; an odd count; a v5e:2x4 slice
        mesh = sharding.make_mesh(-1, -1, devices=devs[:n])
        assert (mesh.shape["data"], mesh.shape["model"]) == shape, n


def test_partition_rules_by_role():
    specs = _specs(sharding.make_mesh(data=4, model=2))
    assert specs["model.embed_tokens.weight"] == P("model", None)
    for name in ("q_proj", "k_proj", "v_proj"):
        assert specs[f"model.layers.1.self_attn.{name}.weight"] == P("model", None)
        assert specs[f"model.layers.1.self_attn.{name}.bias"] == P(None)
    assert specs["model.layers.0.self_attn.o_proj.weight"] == P(None, "model")
    assert specs["model.layers.0.mlp.gate_proj.weight"] == P("model", None)
    assert specs["model.layers.0.mlp.up_proj.weight"] == P("model", None)
    assert specs["model.layers.0.mlp.down_proj.weight"] == P(None, "model")
    assert specs["model.layers.0.input_layernorm.weight"] == P(None)
    assert specs["model.norm.weight"] == P(None)
    untied = _specs(sharding.make_mesh(data=4, model=2), CFG.replace(tie_word_embeddings=False))
    assert untied["lm_head.weight"] == P("model", None)
    # an axis that does not divide the mesh axis is replicated (vocab 255 on model=2)
    odd = _specs(sharding.make_mesh(data=4, model=2), CFG.replace(vocab_size=255))
    assert odd["model.embed_tokens.weight"] == P(None, None)


def test_unknown_parameter_raises():
    with pytest.raises(ValueError, match="model.layers.0.rotary.inv_freq"):
        sharding.param_shardings({"model": {"layers": {0: {"rotary": {"inv_freq": jnp.zeros(4)}}}}},
                                 sharding.make_mesh())


def test_with_constraint_is_noop_without_mesh():
    x = jnp.ones((8, 3))
    assert sharding.with_constraint(x, ("batch", None)) is x
    mesh = sharding.make_mesh(data=8)
    y = jax.jit(lambda a: sharding.with_constraint(a * 2, ("batch", None), mesh))(x)
    assert y.sharding.spec == P("data")


def _batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CFG.vocab_size, (8, 12)).astype(np.int32)
    mask = np.ones((8, 12), np.int32)
    for r, pad in enumerate((0, 3, 5, 0, 1, 7, 2, 4)):  # left padding
        mask[r, :pad] = 0
    return jnp.asarray(ids), jnp.asarray(mask)


def _loss_and_grad(graphdef, mesh):
    def loss(params, ids, mask):
        logits = decoder.forward(graphdef, params, ids, decoder.positions_from_mask(mask), mask)
        logits = sharding.with_constraint(logits, ("batch", None, None), mesh)
        lp = decoder.token_logprobs(logits[:, :-1], ids[:, 1:])
        m = mask[:, 1:].astype(jnp.float32)
        return -(lp * m).sum() / m.sum(), logits

    return jax.value_and_grad(loss, has_aux=True)


@pytest.fixture(scope="module")
def single_device():
    """Model, batch and the single-device (loss, logits), grads."""
    graphdef, params = nnx.split(qwen2.Qwen2ForCausalLM(CFG, rngs=nnx.Rngs(0)), nnx.Param)
    ids, mask = _batch()
    return graphdef, params, ids, mask, jax.jit(_loss_and_grad(graphdef, None))(params, ids, mask)


@pytest.mark.parametrize("data,model", [(4, 2), (8, 1)])
def test_sharded_forward_backward_equal_single_device(single_device, data, model):
    graphdef, params, ids, mask, ((ref_loss, ref_logits), ref_grads) = single_device

    mesh = sharding.make_mesh(data=data, model=model)
    p_sh = sharding.param_shardings(params, mesh)
    d_sh = sharding.data_sharding(mesh)
    fn = jax.jit(_loss_and_grad(graphdef, mesh), in_shardings=(p_sh, d_sh, d_sh),
                 out_shardings=((sharding.replicated(mesh), d_sh), p_sh))
    (loss, logits), grads = fn(sharding.shard_params(params, mesh), jax.device_put(ids, d_sh),
                               jax.device_put(mask, d_sh))
    assert len(logits.sharding.device_set) == 8
    q = grads["model"]["layers"][0]["self_attn"]["q_proj"]["weight"]
    assert q.get_value().sharding.spec == P("model", None)  # a model axis of size 1 is trivial
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5)
    for (path, g), (_, r) in zip(jax.tree_util.tree_leaves_with_path(grads),
                                 jax.tree_util.tree_leaves_with_path(ref_grads)):
        np.testing.assert_allclose(g, r, atol=1e-5, err_msg=jax.tree_util.keystr(path))


def test_fsdp_splits_the_largest_free_axis_over_data():
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from behaviortrace_jax.models import sharding as sh

    devs = jax.devices()
    if len(devs) < 8:
        import pytest
        pytest.skip("needs the 8 fake CPU devices of tests/conftest.py")
    mesh = sh.make_mesh(4, 2, devices=devs[:8])
    params = {"model": {"embed_tokens": {"weight": jax.ShapeDtypeStruct((64, 16), np.float32)},
                        "layers": {0: {"mlp": {"down_proj": {"weight": jax.ShapeDtypeStruct((16, 48), np.float32)}},
                                       "input_layernorm": {"weight": jax.ShapeDtypeStruct((16,), np.float32)}}}}}
    plain = sh.param_shardings(params, mesh)
    fsdp = sh.param_shardings(params, mesh, fsdp=True)
    assert plain["model"]["embed_tokens"]["weight"].spec == P("model", None)
    assert fsdp["model"]["embed_tokens"]["weight"].spec == P("model", "data")
    assert fsdp["model"]["layers"][0]["mlp"]["down_proj"]["weight"].spec == P("data", "model")
    assert fsdp["model"]["layers"][0]["input_layernorm"]["weight"].spec == plain["model"]["layers"][0]["input_layernorm"]["weight"].spec
    one = sh.make_mesh(1, 1, devices=devs[:1])
    assert (sh.param_shardings(params, one, fsdp=True)["model"]["embed_tokens"]["weight"].spec
            == sh.param_shardings(params, one)["model"]["embed_tokens"]["weight"].spec)
