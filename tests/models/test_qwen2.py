"""Qwen2 model: logits parity with transformers, KV-cache decode, config parsing, parameter count."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from behaviortrace_jax.models import decoder, hf_io, qwen2
from behaviortrace_jax.models.qwen2 import Qwen2Config
from hf_fixtures import save_random_qwen2

# The published Qwen/Qwen2.5-1.5B-Instruct config.json values.
QWEN25_1P5B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 1536, "initializer_range": 0.02,
    "intermediate_size": 8960, "max_position_embeddings": 32768, "max_window_layers": 21,
    "model_type": "qwen2", "num_attention_heads": 12, "num_hidden_layers": 28,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}


def _left_padded_batch(vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = [9, 5, 1]
    t = max(lengths)
    ids = np.zeros((len(lengths), t), np.int32)
    mask = np.zeros((len(lengths), t), np.int32)
    for b, n in enumerate(lengths):
        ids[b, t - n:] = rng.integers(3, vocab, n)
        mask[b, t - n:] = 1
    return ids, mask


def _torch_logits(hf_dir, ids, mask):
    import torch
    from transformers import Qwen2ForCausalLM

    m = Qwen2ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = m(input_ids=torch.tensor(ids, dtype=torch.long),
                attention_mask=torch.tensor(mask, dtype=torch.long),
                position_ids=torch.tensor(pos, dtype=torch.long))
    return out.logits.float().numpy()


@pytest.mark.parametrize("tie", [True, False])
def test_logits_match_transformers_left_padded(tmp_path, tie):
    hf_dir = save_random_qwen2(tmp_path / "hf", tie=tie, tokenizer=False, seed=1 + tie)
    model = hf_io.load_hf_checkpoint(hf_dir, param_dtype="float32")
    ids, mask = _left_padded_batch(model.config.vocab_size)
    pos = decoder.positions_from_mask(jnp.asarray(mask))
    graphdef, params = nnx.split(model, nnx.Param)
    logits = jax.jit(decoder.forward)(graphdef, params, jnp.asarray(ids), pos, jnp.asarray(mask))
    assert logits.dtype == jnp.float32 and logits.shape == (*ids.shape, model.config.vocab_size)
    ref = _torch_logits(hf_dir, ids, mask)
    real = mask.astype(bool)
    err = np.abs(np.asarray(logits)[real] - ref[real]).max()
    assert err <= 1e-4, err
    # The padded rows must not change the real rows: row 1 alone equals row 1 in the batch.
    n = int(mask[1].sum())
    solo = decoder.forward(graphdef, params, jnp.asarray(ids[1:2, -n:]),
                         jnp.arange(n, dtype=jnp.int32)[None], jnp.ones((1, n), jnp.int32))
    np.testing.assert_allclose(np.asarray(solo[0]), np.asarray(logits[1, -n:]), atol=1e-5)


def test_kv_cache_decode_matches_full_forward():
    cfg = Qwen2Config.tiny(vocab_size=97, num_hidden_layers=2)
    model = qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(3))
    ids, mask = _left_padded_batch(cfg.vocab_size, seed=4)
    b, t = ids.shape
    prompt = 6  # prefill the first 6 columns, then decode the rest one token at a time
    s_max = t + 3
    full_mask = jnp.asarray(mask)
    pos = decoder.positions_from_mask(full_mask)
    graphdef, params = nnx.split(model, nnx.Param)
    full = jax.jit(decoder.forward)(graphdef, params, jnp.asarray(ids), pos, full_mask)
    slot_mask = jnp.zeros((b, s_max), jnp.int32).at[:, :prompt].set(full_mask[:, :prompt])
    step = jax.jit(decoder.forward_with_cache)
    cache = decoder.init_cache(cfg, b, s_max)
    out, cache = step(graphdef, params, jnp.asarray(ids[:, :prompt]), pos[:, :prompt], slot_mask,
                      cache, jnp.int32(0))
    got = [out]
    for i in range(prompt, t):
        slot_mask = slot_mask.at[:, i].set(full_mask[:, i])
        out, cache = step(graphdef, params, jnp.asarray(ids[:, i:i + 1]), pos[:, i:i + 1], slot_mask,
                          cache, jnp.int32(i))
        got.append(out)
    got = jnp.concatenate(got, axis=1)
    assert cache.k[0].shape == (b, s_max, cfg.num_key_value_heads, cfg.head_dim)
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(full)[real], atol=1e-5)


def test_token_logprobs_and_positions():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 5)), jnp.float32)
    toks = jnp.asarray([[0, 4, 2], [1, 1, 3]], jnp.int32)
    lp = decoder.token_logprobs(logits, toks)
    ref = jax.nn.log_softmax(logits, -1)
    assert lp.shape == (2, 3) and lp.dtype == jnp.float32
    np.testing.assert_allclose(lp[1, 2], ref[1, 2, 3], rtol=1e-6)
    pos = decoder.positions_from_mask(jnp.asarray([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]))
    np.testing.assert_array_equal(pos, [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])


def test_count_params_1p5b_without_allocating():
    assert decoder.count_params(Qwen2Config.qwen2p5_1p5b()) == 1_543_714_304
    abstract = decoder.abstract_model(Qwen2Config.qwen2p5_1p5b())
    leaf = abstract.model.embed_tokens.weight.get_value()
    assert isinstance(leaf, jax.ShapeDtypeStruct)


def test_from_hf_config_published_1p5b_equals_preset(tmp_path):
    cfg = Qwen2Config.from_hf_config(QWEN25_1P5B_INSTRUCT)
    assert cfg == Qwen2Config.qwen2p5_1p5b(param_dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_1P5B_INSTRUCT))
    assert Qwen2Config.from_hf_config(tmp_path, param_dtype="float32") == Qwen2Config.qwen2p5_1p5b()
    # transformers-5 style rope_parameters
    d = {k: v for k, v in QWEN25_1P5B_INSTRUCT.items() if k != "rope_theta"}
    d["rope_parameters"] = {"rope_theta": 1e6, "rope_type": "default"}
    assert Qwen2Config.from_hf_config(d).rope_theta == 1e6


def test_to_hf_config_is_accepted_by_transformers():
    from transformers import Qwen2Config as HFQwen2Config

    cfg = Qwen2Config.tiny()
    hf = HFQwen2Config(**cfg.to_hf_config())
    assert hf.model_type == "qwen2" and hf.num_key_value_heads == 2 and hf.hidden_size == 128
    assert Qwen2Config.from_hf_config(hf.to_dict()) == cfg


@pytest.mark.parametrize("change, needle", [
    ({"model_type": "llama"}, "model_type"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, "rope_type"),
])
def test_from_hf_config_refuses_unsupported(change, needle):
    with pytest.raises(ValueError, match=needle):
        Qwen2Config.from_hf_config({**QWEN25_1P5B_INSTRUCT, **change})


def test_from_hf_config_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        Qwen2Config.from_hf_config(tmp_path)
    d = {k: v for k, v in QWEN25_1P5B_INSTRUCT.items() if k != "hidden_size"}
    with pytest.raises(ValueError, match="hidden_size"):
        Qwen2Config.from_hf_config(d)


def test_bf16_params_run_and_stay_close_to_fp32():
    cfg = Qwen2Config.tiny(vocab_size=97, num_hidden_layers=2)
    m32 = qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
    m16 = qwen2.Qwen2ForCausalLM(cfg.replace(param_dtype="bfloat16", compute_dtype="bfloat16"),
                                 rngs=nnx.Rngs(0))
    nnx.update(m16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(m32, nnx.Param)))
    assert m16.model.layers[0].mlp.up_proj.weight[...].dtype == jnp.bfloat16
    ids, mask = _left_padded_batch(cfg.vocab_size)
    pos = decoder.positions_from_mask(jnp.asarray(mask))
    fwd = jax.jit(decoder.forward)
    l32 = fwd(*nnx.split(m32, nnx.Param), jnp.asarray(ids), pos, jnp.asarray(mask))
    l16 = fwd(*nnx.split(m16, nnx.Param), jnp.asarray(ids), pos, jnp.asarray(mask))
    assert l16.dtype == jnp.float32
    real = mask.astype(bool)
    assert np.isfinite(np.asarray(l16)).all()
    assert np.abs(np.asarray(l16 - l32)[real]).max() < 0.05


def test_remat_gives_same_grads():
    cfg = Qwen2Config.tiny(vocab_size=61, num_hidden_layers=1)
    ids, mask = _left_padded_batch(cfg.vocab_size)
    pos = decoder.positions_from_mask(jnp.asarray(mask))
    grads = []
    for remat in (False, True):
        g, p = nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0), remat=remat), nnx.Param)
        loss = lambda p: decoder.token_logprobs(decoder.forward(g, p, ids, pos, mask), ids).sum()
        grads.append(jax.tree.leaves(jax.jit(jax.grad(loss))(p)))
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_init_model_into_a_sharded_layout():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    cfg = Qwen2Config.tiny(vocab_size=64, num_hidden_layers=1)
    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    rows = NamedSharding(mesh, P("model"))
    model = decoder.init_model(cfg, seed=3, shardings=lambda path: rows)
    w = model.model.layers[0].mlp.up_proj.weight[...]
    assert w.sharding == rows and w.addressable_shards[0].data.shape == (384 // 4, 128)
    assert abs(float(jnp.std(w)) - 0.02) < 0.002  # N(0, 0.02) as the constructor
    np.testing.assert_array_equal(model.model.norm.weight[...], np.ones(128, np.float32))
    np.testing.assert_array_equal(model.model.layers[0].self_attn.q_proj.bias[...], np.zeros(128))
    again = decoder.init_model(cfg, seed=3)
    np.testing.assert_array_equal(again.model.embed_tokens.weight[...], model.model.embed_tokens.weight[...])
    assert decoder.count_params(cfg) == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
