"""Model families Llama and Qwen3 beside Qwen2: the registry, parity with
transformers (logits <= 1e-4 fp32 on a left-padded batch, greedy = ``generate``, KV cache = full
forward), HF round trip, strict loading, weight-table order and the published presets' sizes."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file

from behaviortrace_jax.models import decoder, families, hf_io, sampler
from behaviortrace_jax.models.llama import LLAMA3P2_1B_HF_CONFIG, Llama3RopeScaling, LlamaConfig
from behaviortrace_jax.models.qwen2 import Qwen2Config
from behaviortrace_jax.models.qwen3 import QWEN3_1P7B_HF_CONFIG, Qwen3Config
from hf_fixtures import hf_model_config, save_random_hf

FAMILIES = ("llama", "qwen3")


def _left_padded_batch(vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = [12, 5, 1]  # 12 tokens: positions past the llama3 high-frequency wavelength (16/2pi)
    t = max(lengths)
    ids = np.zeros((len(lengths), t), np.int32)
    mask = np.zeros((len(lengths), t), np.int32)
    for b, n in enumerate(lengths):
        ids[b, t - n:] = rng.integers(3, vocab, n)
        mask[b, t - n:] = 1
    return ids, mask


def _torch_logits(hf_dir, ids, mask):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = m(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                position_ids=torch.tensor(pos, dtype=torch.long))
    return out.logits.float().numpy()


@pytest.fixture(scope="module", params=FAMILIES)
def hf_tied(request, tmp_path_factory):
    """(family, a tiny random tied HF checkpoint of it with a tokenizer)."""
    fam = request.param
    return fam, save_random_hf(tmp_path_factory.mktemp(fam) / "hf", fam, tie=True, seed=5)


def test_registry():
    assert {"qwen2", "llama", "qwen3"} <= set(families.names())
    for name, cls in (("qwen2", Qwen2Config), ("llama", LlamaConfig), ("qwen3", Qwen3Config)):
        fam = families.get_family(name)
        assert fam.config_cls is cls and families.family_of(cls.tiny(vocab_size=64)) is fam
        assert fam.architecture == f"{ {'qwen2': 'Qwen2', 'llama': 'Llama', 'qwen3': 'Qwen3'}[name]}ForCausalLM"
        assert isinstance(decoder.abstract_model(fam.preset("tiny", vocab_size=64)), fam.module_cls)
    with pytest.raises(ValueError, match="gpt2"):
        families.get_family("gpt2")
    with pytest.raises(ValueError, match="no preset"):
        families.get_family("llama").preset("qwen2p5_1p5b")
    assert families.resolve("", {"model_type": "qwen3"}).name == "qwen3"
    # config.json's model_type picks the family; an explicit family must agree with it
    with pytest.raises(ValueError, match="model_type"):
        families.config_from_hf(LLAMA3P2_1B_HF_CONFIG, "qwen3")


@pytest.mark.parametrize("fam, tie", [("llama", False), ("llama", True), ("qwen3", True), ("qwen3", False)])
def test_logits_match_transformers_left_padded(tmp_path, fam, tie):
    hf_dir = save_random_hf(tmp_path / "hf", fam, tie=tie, tokenizer=False, seed=1 + tie)
    model = hf_io.load_hf_checkpoint(hf_dir, param_dtype="float32")
    assert type(model) is families.get_family(fam).module_cls and model.config.tie_word_embeddings == tie
    ids, mask = _left_padded_batch(model.config.vocab_size)
    pos = decoder.positions_from_mask(jnp.asarray(mask))
    graphdef, params = nnx.split(model, nnx.Param)
    logits = jax.jit(decoder.forward)(graphdef, params, jnp.asarray(ids), pos, jnp.asarray(mask))
    assert logits.dtype == jnp.float32 and logits.shape == (*ids.shape, model.config.vocab_size)
    ref = _torch_logits(hf_dir, ids, mask)
    real = mask.astype(bool)
    err = np.abs(np.asarray(logits)[real] - ref[real]).max()
    print(f"{fam} tie={tie}: max |dlogit| = {err:.3g}")
    assert err <= 1e-4, err
    n = int(mask[1].sum())  # the padded rows do not change the real rows
    solo = decoder.forward(graphdef, params, jnp.asarray(ids[1:2, -n:]), jnp.arange(n, dtype=jnp.int32)[None],
                           jnp.ones((1, n), jnp.int32))
    np.testing.assert_allclose(np.asarray(solo[0]), np.asarray(logits[1, -n:]), atol=1e-5)


def test_llama3_rope_frequencies_match_transformers():
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for d in (LLAMA3P2_1B_HF_CONFIG, hf_model_config("llama").to_dict()):
        ref, scale = ROPE_INIT_FUNCTIONS["llama3"](HFLlamaConfig(**d), "cpu")
        ours = LlamaConfig.from_hf_config(d).rope_inv_freq()
        assert scale == 1.0
        np.testing.assert_allclose(np.asarray(ours), ref.numpy(), rtol=1e-6)
    plain = decoder.default_inv_freq(64, 500000.0)
    ours = np.asarray(LlamaConfig.llama3p2_1b().rope_inv_freq())
    assert ours[0] == plain[0] and ours[-1] == pytest.approx(plain[-1] / 32)  # both ends of the ramp


@pytest.mark.parametrize("fam", FAMILIES)
def test_kv_cache_decode_matches_full_forward(fam):
    cfg = families.get_family(fam).preset("tiny", vocab_size=97, num_hidden_layers=2)
    if fam == "llama":
        cfg = cfg.replace(rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 64))
    model = decoder.init_model(cfg, seed=3)
    ids, mask = _left_padded_batch(cfg.vocab_size, seed=4)
    b, t = ids.shape
    prompt, s_max = 6, t + 3
    full_mask = jnp.asarray(mask)
    pos = decoder.positions_from_mask(full_mask)
    graphdef, params = nnx.split(model, nnx.Param)
    full = jax.jit(decoder.forward)(graphdef, params, jnp.asarray(ids), pos, full_mask)
    slot_mask = jnp.zeros((b, s_max), jnp.int32).at[:, :prompt].set(full_mask[:, :prompt])
    step = jax.jit(decoder.forward_with_cache)
    out, cache = step(graphdef, params, jnp.asarray(ids[:, :prompt]), pos[:, :prompt], slot_mask,
                      decoder.init_cache(cfg, b, s_max), jnp.int32(0))
    got = [out]
    for i in range(prompt, t):
        slot_mask = slot_mask.at[:, i].set(full_mask[:, i])
        out, cache = step(graphdef, params, jnp.asarray(ids[:, i:i + 1]), pos[:, i:i + 1], slot_mask,
                          cache, jnp.int32(i))
        got.append(out)
    got = jnp.concatenate(got, axis=1)
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(full)[real], atol=1e-5)


@pytest.mark.parametrize("fam", FAMILIES)
def test_greedy_matches_transformers_generate(tmp_path, fam):
    """Left-padded mixed-length batch through the sampler == transformers greedy generate of each
    prompt alone (an EOS ends row 0 mid-way), log-probs within 1e-4."""
    from transformers import AutoModelForCausalLM

    n_new, pad = 16, 0
    hf = AutoModelForCausalLM.from_pretrained(save_random_hf(tmp_path / "m", fam, tokenizer=False),
                                              dtype=torch.float32).eval()
    with torch.no_grad():  # peaked, varied greedy continuations (as tests/models/test_sampler.py)
        for p in hf.parameters():
            p.mul_(8.0 if p.ndim == 2 else 1.0)
    hf.save_pretrained(tmp_path / "scaled")
    model = hf_io.load_hf_checkpoint(tmp_path / "scaled")
    graphdef, params = nnx.split(model, nnx.Param)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 320, n).tolist() for n in (5, 11, 16)]

    def generate(prompt, eos):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=n_new, do_sample=False, eos_token_id=eos, pad_token_id=pad,
                              return_dict_in_generate=True, output_logits=True)
        toks = out.sequences[0, len(prompt):].numpy()
        lp = torch.stack(out.logits, 1)[0].log_softmax(-1).gather(-1, torch.tensor(toks)[:, None])[:, 0]
        return toks, lp.numpy()

    free, _ = generate(prompts[0], None)
    k = next(j for j in range(3, n_new) if free[j] not in free[:j])
    eos = int(free[k])
    s = sampler.Sampler(graphdef, model.config, max_prompt_tokens=16, max_new_tokens=n_new, eos_ids=[eos],
                        pad_id=pad)
    out = s.sample(params, prompts, jax.random.key(0), temperature=0.0)
    assert out.lengths[0] == k + 1
    for r, prompt in enumerate(prompts):
        ref, ref_lp = generate(prompt, eos)
        n = len(ref)
        assert out.lengths[r] == n, r
        np.testing.assert_array_equal(out.tokens[r, :n], ref)
        np.testing.assert_allclose(out.logprobs[r, :n], ref_lp, atol=1e-4)


@pytest.mark.parametrize("fam, tie", [("llama", False), ("llama", True), ("qwen3", True), ("qwen3", False)])
def test_table_order_equals_transformers_named_parameters(fam, tie):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(hf_model_config(fam, tie=tie))
    cfg = families.config_from_hf(hf.config.to_dict())
    want = [(n, tuple(p.shape)) for n, p in hf.named_parameters()]
    assert [(p.hf_key, p.shape) for p in hf_io.hf_param_table(cfg)] == want
    model = decoder.init_model(cfg, seed=0)
    assert list(hf_io.hf_state_dict(model, cfg)) == [n for n, _ in want]
    assert decoder.count_params(cfg) == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("fam", FAMILIES)
def test_round_trip_flax_to_transformers(tmp_path, fam):
    from transformers import AutoModelForCausalLM

    cfg = families.config_from_hf(hf_model_config(fam, tie=False).to_dict())
    model = decoder.init_model(cfg, seed=7)
    out = hf_io.save_hf_checkpoint(model, cfg, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["model_type"] == fam
    ids, mask = _left_padded_batch(cfg.vocab_size, seed=2)
    pos = decoder.positions_from_mask(jnp.asarray(mask))
    ours = np.asarray(model(jnp.asarray(ids), pos, jnp.asarray(mask))[0])
    ref = _torch_logits(out, ids, mask)
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == cfg.architecture
    real = mask.astype(bool)
    assert np.abs(ours[real] - ref[real]).max() <= 1e-4
    back = hf_io.load_hf_checkpoint(out)
    assert back.config == cfg and type(back) is type(model)
    a, b = hf_io.hf_state_dict(model, cfg), hf_io.hf_state_dict(back, cfg)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _rewrite(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("edit, err, needle", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), KeyError, "model.layers.1.mlp.up_proj.weight"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}),
     ValueError, "model.layers.0.self_attn.q_proj.bias"),
    (lambda t: t.update({"model.norm.weight": np.ones(65, np.float32)}), ValueError, r"model.norm.weight.*\(65,\)"),
    (lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1}), ValueError, "lm_head.weight"),
], ids=["missing", "extra", "shape", "tied-head"])
def test_strict_load_names_the_bad_tensor(tmp_path, hf_tied, edit, err, needle):
    fam, hf_dir = hf_tied
    bad = _rewrite(hf_dir, tmp_path / "bad", edit)
    with pytest.raises(err, match=needle):
        hf_io.load_hf_checkpoint(bad)


def test_strict_load_qwen3_qk_norm(tmp_path, hf_tied):
    fam, hf_dir = hf_tied
    key = "model.layers.0.self_attn.k_norm.weight"
    if fam == "qwen3":  # the per-head norms are part of the table: missing / mis-shaped ones are named
        with pytest.raises(KeyError, match=key):
            hf_io.load_hf_checkpoint(_rewrite(hf_dir, tmp_path / "a", lambda t: t.pop(key)))
        with pytest.raises(ValueError, match=key):
            hf_io.load_hf_checkpoint(_rewrite(hf_dir, tmp_path / "b", lambda t: t.update({key: np.ones(7, np.float32)})))
    else:  # a Llama checkpoint with Qwen3's norms is refused, naming them
        with pytest.raises(ValueError, match=key):
            hf_io.load_hf_checkpoint(_rewrite(hf_dir, tmp_path / "c", lambda t: t.update({key: np.ones(16, np.float32)})))


def test_config_json_family_mismatch_is_refused(tmp_path, hf_tied):
    fam, hf_dir = hf_tied
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    for name in ("model.safetensors", "tokenizer.json"):
        if (hf_dir / name).is_file():
            (tmp_path / name).write_bytes((hf_dir / name).read_bytes())
    other = "qwen2" if fam == "llama" else "llama"
    with pytest.raises(ValueError, match="model_type"):
        hf_io.load_hf_checkpoint(tmp_path, family=other)
    cfg = json.loads((hf_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": other}))
    with pytest.raises(ValueError, match="model_type"):
        hf_io.load_hf_checkpoint(tmp_path)
    assert type(hf_io.load_hf_checkpoint(hf_dir, family=fam)).__name__ == cfg["architectures"][0]


@pytest.mark.parametrize("fam, preset, published, n", [
    ("llama", "llama3p2_1b", LLAMA3P2_1B_HF_CONFIG, 1_235_814_400),
    ("qwen3", "qwen3_1p7b", QWEN3_1P7B_HF_CONFIG, 1_720_574_976),
])
def test_presets_equal_published_configs_and_transformers_counts(fam, preset, published, n):
    import transformers

    cfg = families.get_family(fam).preset(preset)
    assert cfg == families.config_from_hf(published, param_dtype="float32")
    assert cfg.tie_word_embeddings and decoder.count_params(cfg) == n
    hf_cfg = getattr(transformers, type(cfg).__name__)(**published)
    with torch.device("meta"):  # no weights allocated, no download
        hf = getattr(transformers, cfg.architecture)(hf_cfg)
    assert sum(p.numel() for p in hf.parameters()) == n
    assert [(k, tuple(p.shape)) for k, p in hf.named_parameters()] == \
        [(p.hf_key, p.shape) for p in hf_io.hf_param_table(cfg)]
    # our own config.json round-trips through transformers' config class
    again = families.config_from_hf(getattr(transformers, type(cfg).__name__)(**cfg.to_hf_config()).to_dict(),
                                    param_dtype="float32")
    assert again == cfg


@pytest.mark.parametrize("cls, change, needle", [
    (LlamaConfig, {"attention_bias": True}, "attention_bias"),
    (LlamaConfig, {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_type"),
    (LlamaConfig, {"rope_scaling": {"rope_type": "llama3", "factor": 4.0}}, "low_freq_factor"),
    (Qwen3Config, {"use_sliding_window": True}, "use_sliding_window"),
    (Qwen3Config, {"model_type": "qwen2"}, "model_type"),
    (Qwen2Config, {"model_type": "qwen3"}, "model_type"),
])
def test_from_hf_config_refuses_unsupported(cls, change, needle):
    base = LLAMA3P2_1B_HF_CONFIG if cls is LlamaConfig else QWEN3_1P7B_HF_CONFIG
    with pytest.raises(ValueError, match=needle):
        cls.from_hf_config({**base, **change})


def test_qwen3_head_dim_is_explicit():
    d = {k: v for k, v in QWEN3_1P7B_HF_CONFIG.items() if k != "head_dim"}
    assert Qwen3Config.from_hf_config(d).head_dim == 128  # transformers' Qwen3Config default
    assert Qwen3Config.from_hf_config({**d, "head_dim": 64}).head_dim == 64


@pytest.mark.parametrize("fam", FAMILIES)
def test_per_rollout_sketch_matches_pytorch(tmp_path, fam):
    """As tests/sketch/test_sketcher.py's Qwen2 test, per family: JAX per-example sketches of -(masked mean
    completion log-prob) equal numpy CountSketch of transformers' per-example gradients in HF
    ``model.parameters()`` order (SPEC §3.2)."""
    from transformers import AutoModelForCausalLM

    from behaviortrace_jax.sketch.countsketch import numpy_countsketch
    from behaviortrace_jax.sketch.sketcher import PerExampleSketcher, completion_loss, hf_param_order

    hf_dir = save_random_hf(tmp_path / "hf", fam, tie=fam == "qwen3", tokenizer=False)
    model = hf_io.load_hf_checkpoint(hf_dir)
    graphdef, params = nnx.split(model, nnx.Param)
    eos, b, t, p_len, dim = 2, 3, 16, 6, 2**14
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 320, (b, t))
    am = np.ones((b, t), np.int64)
    am[1, :2] = 0
    ids[1, :2] = eos
    ids[0, 12:] = eos
    loss_mask = ((np.arange(t) >= p_len)[None] & (ids != eos)).astype(np.float32)
    batch = {"input_ids": jnp.asarray(ids, jnp.int32), "attention_mask": jnp.asarray(am, jnp.int32),
             "loss_mask": jnp.asarray(loss_mask)}
    sk = PerExampleSketcher(completion_loss(graphdef), params, dim=dim, chunk_size=2,
                            param_order=hf_param_order(model.config))
    out = sk(params, batch)
    tm = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").float().eval()
    named = list(tm.named_parameters())
    assert [n for n, _ in named] == list(sk.layout.names)
    pos = np.maximum(np.cumsum(am, axis=1) - 1, 0)
    for i in range(b):
        tm.zero_grad(set_to_none=True)
        logits = tm(input_ids=torch.tensor(ids[i:i + 1]), attention_mask=torch.tensor(am[i:i + 1]),
                    position_ids=torch.tensor(pos[i:i + 1])).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, torch.tensor(ids[i:i + 1, 1:, None]))[..., 0]
        m = torch.tensor(loss_mask[i:i + 1, 1:])
        (-(logp * m).sum() / m.sum()).backward()
        vec = np.concatenate([p.grad.detach().numpy().ravel() for _, p in named])
        ref = numpy_countsketch(vec, dim, 0)
        rel = np.linalg.norm(np.asarray(out.sketches[i], np.float64) - ref) / np.linalg.norm(ref)
        assert rel < 1e-4, rel
        np.testing.assert_allclose(out.norms[i], np.linalg.norm(vec), rtol=1e-4)
    assert sk.group_names[-1] == ("model.norm" if fam == "qwen3" else "lm_head")
