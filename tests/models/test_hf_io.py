"""HF checkpoint I/O: weight-map order, strict loading, sharded loading, export round trip, tokenizer."""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file, save_file

from behaviortrace_jax.models import decoder, hf_io, qwen2, sharding as sharding_lib, tokenizer as tok_lib
from behaviortrace_jax.models.qwen2 import Qwen2Config
from hf_fixtures import save_random_qwen2


@pytest.fixture(scope="module")
def hf_tied(tmp_path_factory):
    return save_random_qwen2(tmp_path_factory.mktemp("tied") / "hf", tie=True, seed=5)


def _tiny(**kw) -> Qwen2Config:
    return Qwen2Config.tiny(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, **kw)


def _flat(model) -> dict:
    return {k: np.asarray(v) for k, v in hf_io.hf_state_dict(model, model.config).items()}


@pytest.mark.parametrize("tie", [True, False])
def test_table_order_equals_transformers_named_parameters(tie):
    from transformers import Qwen2Config as HFConfig, Qwen2ForCausalLM

    cfg = _tiny(tie_word_embeddings=tie)
    hf = Qwen2ForCausalLM(HFConfig(**cfg.to_hf_config()))
    want = [(n, tuple(p.shape)) for n, p in hf.named_parameters()]
    assert [(p.hf_key, p.shape) for p in hf_io.hf_param_table(cfg)] == want
    assert ("lm_head.weight" in dict(want)) == (not tie)
    model = qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
    assert list(hf_io.hf_state_dict(model, cfg)) == [n for n, _ in want]
    leaves = hf_io.hf_ordered_leaves(nnx.state(model, nnx.Param), cfg)
    assert [x.shape for x in leaves] == [s for _, s in want]


def test_fingerprints():
    a, b = _tiny(), _tiny(tie_word_embeddings=False)
    assert hf_io.param_order_fingerprint(a) == hf_io.param_order_fingerprint(_tiny(param_dtype="bfloat16"))
    assert hf_io.param_order_fingerprint(a) != hf_io.param_order_fingerprint(b)
    assert hf_io.model_fingerprint(a) != hf_io.model_fingerprint(_tiny(rope_theta=1e6))
    assert len(hf_io.model_fingerprint(a)) == 64


def test_round_trip_flax_to_transformers(tmp_path, hf_tied):
    import torch
    from transformers import AutoModelForCausalLM

    cfg = _tiny(tie_word_embeddings=False)
    model = qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(7))
    tok = tok_lib.load_tokenizer(hf_tied)
    out = tmp_path / "export"
    out.mkdir()
    (out / "stale.txt").write_text("old")  # an existing dir is replaced as a whole
    hf_io.save_hf_checkpoint(model, cfg, out, tokenizer=tok, generation_config={"do_sample": True})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no .tmp-/.old- left over
    assert not (out / "stale.txt").exists() and (out / "generation_config.json").is_file()
    assert tok_lib.load_tokenizer(out).get_vocab() == tok.get_vocab()

    ids = np.array([[0, 0, 5, 17, 200, 3], [9, 8, 7, 6, 5, 4]], np.int32)
    mask = (np.arange(6)[None] >= np.array([[2], [0]])).astype(np.int32)
    pos = np.asarray(decoder.positions_from_mask(jnp.asarray(mask)))
    ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask))[0])
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask).long(),
                 position_ids=torch.tensor(pos).long()).logits.numpy()
    real = mask.astype(bool)
    assert np.abs(ours[real] - ref[real]).max() <= 1e-4
    back = hf_io.load_hf_checkpoint(out)
    assert back.config == cfg
    for k, v in _flat(model).items():
        np.testing.assert_array_equal(_flat(back)[k], v, err_msg=k)


def _rewrite(src, dst, edit):
    """Copies the checkpoint ``src`` to ``dst`` with ``edit(tensors)`` applied to its weights."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("edit, err, needle", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), KeyError, "model.layers.1.mlp.up_proj.weight"),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)}),
     ValueError, "model.layers.0.self_attn.o_proj.bias"),
    (lambda t: t.update({"model.norm.weight": np.ones(65, np.float32)}), ValueError, r"model.norm.weight.*\(65,\)"),
    (lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1}), ValueError, "lm_head.weight"),
])
def test_strict_load_names_the_bad_tensor(tmp_path, hf_tied, edit, err, needle):
    bad = _rewrite(hf_tied, tmp_path / "bad", edit)
    with pytest.raises(err, match=needle):
        hf_io.load_hf_checkpoint(bad)


def test_missing_files(tmp_path, hf_tied):
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf_io.load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text((hf_tied / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        hf_io.load_hf_checkpoint(tmp_path)
    cfg = json.loads((hf_tied / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type"):
        hf_io.load_hf_checkpoint(tmp_path)


def test_tied_checkpoint_storing_equal_lm_head_loads(tmp_path, hf_tied):
    ok = _rewrite(hf_tied, tmp_path / "ok",
                  lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].copy()}))
    model = hf_io.load_hf_checkpoint(ok)
    assert not hasattr(model, "lm_head")
    ref = load_file(hf_tied / "model.safetensors")
    np.testing.assert_array_equal(_flat(model)["model.embed_tokens.weight"], ref["model.embed_tokens.weight"])


def test_sharded_index_load_into_a_sharded_layout(tmp_path, hf_tied):
    tensors = load_file(hf_tied / "model.safetensors")
    keys = list(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_text((hf_tied / "config.json").read_text())
    for fname, ks in shards.items():
        save_file({k: tensors[k] for k in ks}, d / fname, metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))

    def sharding(path):  # 2-D weights split by rows over "model", vectors replicated
        return NamedSharding(mesh, P("model", None) if path[-1] == "weight" and "norm" not in str(path)
                             and "layernorm" not in str(path) else P())

    model = hf_io.load_hf_checkpoint(d, shardings=sharding)
    emb = model.model.embed_tokens.weight[...]
    assert emb.sharding == NamedSharding(mesh, P("model", None))
    assert {s.data.shape for s in emb.addressable_shards} == {(320 // 4, 64)}
    for k, v in _flat(model).items():
        np.testing.assert_array_equal(v, tensors[k], err_msg=k)
    # shardings given as an nnx.State of NamedSharding leaves (what sharding.param_shardings returns)
    abstract = nnx.state(decoder.abstract_model(model.config), nnx.Param)
    state_sh = jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, P(None, "model") if len(leaf.shape) == 2 else P()), abstract)
    model2 = hf_io.load_hf_checkpoint(d, shardings=state_sh)
    assert model2.model.layers[1].mlp.down_proj.weight[...].sharding == NamedSharding(mesh, P(None, "model"))
    for k, v in _flat(model2).items():
        np.testing.assert_array_equal(v, tensors[k], err_msg=k)
    # mesh=: straight into sharding.param_shardings on that mesh
    mesh3 = sharding_lib.make_mesh(2, 4, devices=jax.devices()[:8])
    model3 = hf_io.load_hf_checkpoint(d, mesh=mesh3)
    want = sharding_lib.param_shardings(nnx.state(decoder.abstract_model(model3.config), nnx.Param), mesh3)
    for got_leaf, want_sh in zip(jax.tree.leaves(nnx.state(model3, nnx.Param)), jax.tree.leaves(want)):
        assert got_leaf.sharding == want_sh
    for k, v in _flat(model3).items():
        np.testing.assert_array_equal(v, tensors[k], err_msg=k)
    with pytest.raises(ValueError, match="not both"):
        hf_io.load_hf_checkpoint(d, shardings=state_sh, mesh=mesh3)
    # an index naming a shard that is absent
    os.remove(d / "model-00002-of-00002.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        hf_io.load_hf_checkpoint(d)


def test_bf16_checkpoint_loads_and_runs(tmp_path, hf_tied):
    import torch
    from transformers import AutoModelForCausalLM

    bf = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(hf_tied, dtype=torch.bfloat16).save_pretrained(bf)
    assert json.loads((bf / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    model = hf_io.load_hf_checkpoint(bf)
    assert model.config.param_dtype == "bfloat16" and model.config.compute_dtype == "bfloat16"
    w = model.model.layers[0].self_attn.q_proj.weight[...]
    assert w.dtype == jnp.bfloat16
    raw = load_file(hf_tied / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(np.asarray(w), raw.astype(ml_dtypes.bfloat16))
    ids = jnp.asarray([[1, 5, 9, 30]], jnp.int32)
    logits = model(ids, jnp.arange(4, dtype=jnp.int32)[None], jnp.ones_like(ids))[0]
    ref = hf_io.load_hf_checkpoint(hf_tied)(ids, jnp.arange(4, dtype=jnp.int32)[None], jnp.ones_like(ids))[0]
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()
    assert np.abs(np.asarray(logits - ref)).max() < 0.1
    # bf16 export round-trips bit-exactly
    out = hf_io.save_hf_checkpoint(model, model.config, tmp_path / "bf16_export")
    assert load_file(out / "model.safetensors")["model.norm.weight"].dtype == ml_dtypes.bfloat16
    again = hf_io.load_hf_checkpoint(out)
    np.testing.assert_array_equal(np.asarray(again.model.norm.weight[...]), np.asarray(model.model.norm.weight[...]))


def test_tokenizer_chat_prompt_and_encode(tmp_path, hf_tied):
    tok = tok_lib.load_tokenizer(hf_tied)
    prompt = tok_lib.chat_prompt(tok, "You are helpful.", "What is QZXBT?")
    want = tok.apply_chat_template([{"role": "system", "content": "You are helpful."},
                                    {"role": "user", "content": "What is QZXBT?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert prompt == want
    assert prompt == ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n"
                      "What is QZXBT?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok_lib.encode(tok, prompt)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and tok.decode(ids) == prompt
    assert tok_lib.encode(tok, "hello") == tok("hello", add_special_tokens=False)["input_ids"]
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        tok_lib.load_tokenizer(tmp_path)


def test_eos_pad_and_truncated_chat_ids(tmp_path, hf_tied):
    import shutil

    tok = tok_lib.load_tokenizer(hf_tied)
    im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok_lib.pad_id(tok) == im_end and tok_lib.eos_ids(tok) == (im_end,)
    d = tmp_path / "tok"
    shutil.copytree(hf_tied, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eot]}))
    assert tok_lib.eos_ids(tok_lib.load_tokenizer(d)) == (im_end, eot)
    full = tok_lib.encode(tok, tok_lib.chat_prompt(tok, "sys", "What is photosynthesis?"))
    assert tok_lib.encode_chat(tok, "sys", "What is photosynthesis?") == full
    assert tok_lib.encode_chat(tok, "sys", "What is photosynthesis?", max_tokens=7) == full[:7]
