"""The full-size checkpoint path on CPU (slow: ~3 GB written, 12.8 GB peak RSS measured).

transformers writes a random Qwen2.5-1.5B-shaped checkpoint (the published config values, bf16,
sharded safetensors of ~1 GB with an index); the tokenizer is the tests' tiny byte-level BPE one
(Qwen's own tokenizer files cannot be made offline - the ids used here are < 320 either way). The
``info`` stage loads it sharded onto the 8 fake CPU devices of tests/conftest.py (mesh data 1 x
model 8: every device holds 1/8 of the parameters, so host memory holds one copy; data 4 x model 2
held four and was killed at 18.9 GB of RSS on a 23 GB machine) and reports 1,543,714,304 parameters; logits on a 16-token prompt match transformers:
fp32 weights + fp32 compute within 1e-4 (max abs); bf16 weights + bf16 compute within 0.25 max abs
(bf16 has 8 bits of mantissa; 28 layers of rounding in two implementations).
"""
from __future__ import annotations

import gc
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny

# https://huggingface.co/Qwen/Qwen2.5-1.5B-Instruct/blob/main/config.json
QWEN2P5_1P5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                    num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
                    bos_token_id=151643, eos_token_id=151645, sliding_window=32768, max_window_layers=21,
                    use_sliding_window=False, attention_dropout=0.0)
N_PARAMS = 1_543_714_304


@pytest.fixture(scope="module")
def paper_ckpt(tmp_path_factory):
    import torch
    from hf_fixtures import make_tiny_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("qwen2p5_1p5b")
    torch.manual_seed(0)
    cfg = Qwen2Config(**QWEN2P5_1P5B, torch_dtype="bfloat16")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():  # HF initialises biases to 0 and norms to 1: randomise them so they are tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(path, max_shard_size="1GB", safe_serialization=True)
    make_tiny_tokenizer().save_pretrained(path)
    del model
    gc.collect()
    return path


@pytest.mark.slow
def test_info_stage_loads_paper_sized_checkpoint_sharded(paper_ckpt, tmp_path, capsys):
    from behaviortrace_jax.stages import info

    index = json.loads((paper_ckpt / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3
    assert all((paper_ckpt / s).stat().st_size < 1.1e9 for s in shards)
    if len(jax.devices()) < 8:
        pytest.skip("needs the 8 fake CPU devices of tests/conftest.py")
    c = tiny.get_config()
    with c.unlocked():
        c.model.hf_dir = str(paper_ckpt)
        c.model.param_dtype = c.model.compute_dtype = "bfloat16"
        c.mesh.data, c.mesh.model = 1, 8
        c.info_max_new_tokens = 2
    info.info_stage(c, str(tmp_path))
    out = capsys.readouterr().out
    assert f"parameters: {N_PARAMS:,} (28 layers, d 1536, vocab 151936" in out
    assert "mesh: {'data': 1, 'model': 8}" in out


@pytest.mark.slow
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 0.25)])
def test_paper_sized_logits_match_transformers(paper_ckpt, dtype, tol):
    import torch
    from flax import nnx
    from transformers import AutoModelForCausalLM

    from behaviortrace_jax.models import hf_io, sharding

    ids = np.random.default_rng(0).integers(3, 320, size=(1, 16)).astype(np.int32)
    tdt = torch.float32 if dtype == "float32" else torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(paper_ckpt, dtype=tdt, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()[0]
    del hf
    gc.collect()
    mesh = sharding.make_mesh(1, 8, devices=jax.devices()[:8]) if len(jax.devices()) >= 8 else None
    model = hf_io.load_hf_checkpoint(paper_ckpt, param_dtype=dtype, compute_dtype=dtype, mesh=mesh)
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == N_PARAMS
    x = jnp.asarray(ids)
    logits = np.asarray(model(x, jnp.arange(16, dtype=jnp.int32)[None], jnp.ones_like(x))[0], np.float32)
    err = np.abs(logits - ref).max()
    assert err < tol, f"{dtype}: max |logits - transformers| = {err:.3g} (scale {np.abs(ref).max():.3g})"
