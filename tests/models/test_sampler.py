"""KV-cache sampler: parity with transformers ``generate``, cache vs full forward, PRNG, top-p, EOS,
left padding, compile counts, and the logits pipeline against transformers' logits processors."""
from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from behaviortrace_jax.models import decoder, hf_io, sampler, sharding
from flax import nnx
from hf_fixtures import save_random_qwen2

N_NEW, PAD = 32, 0
PROMPT_LENS = (5, 11, 16)  # one bucket (16): left padding of 11, 5 and 0 tokens


def _hf_generate(hf, prompt, eos, **kw):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=N_NEW, do_sample=False, eos_token_id=eos, pad_token_id=PAD,
                          return_dict_in_generate=True, output_logits=True, **kw)
    toks = out.sequences[0, len(prompt):].numpy()
    lp = torch.stack(out.logits, 1)[0].log_softmax(-1).gather(-1, torch.tensor(toks)[:, None])[:, 0]
    return toks, lp.numpy()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Tiny random HF Qwen2 (fp32), its JAX twin, one Sampler whose EOS ends row 0 mid-way."""
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("hf")
    hf = AutoModelForCausalLM.from_pretrained(save_random_qwen2(tmp / "m", tokenizer=False),
                                              dtype=torch.float32).eval()
    with torch.no_grad():  # N(0, 0.16) matrices: peaked, varied greedy continuations (not one token)
        for p in hf.parameters():
            p.mul_(8.0 if p.ndim == 2 else 1.0)
    hf_dir = tmp / "scaled"
    hf.save_pretrained(hf_dir)
    model = hf_io.load_hf_checkpoint(hf_dir)
    graphdef, params = nnx.split(model, nnx.Param)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 320, n).tolist() for n in PROMPT_LENS]
    free, _ = _hf_generate(hf, prompts[0], None)
    k = next(j for j in range(4, N_NEW) if free[j] not in free[:j])  # first occurrence at step k
    eos = int(free[k])
    s = sampler.Sampler(graphdef, model.config, max_prompt_tokens=32, max_new_tokens=N_NEW,
                        eos_ids=[eos], pad_id=PAD)
    greedy = s.sample(params, prompts, jax.random.key(0), temperature=0.0)
    return types.SimpleNamespace(hf=hf, graphdef=graphdef, params=params, cfg=model.config,
                                 prompts=prompts, eos=eos, eos_step=k, s=s, greedy=greedy)


def test_greedy_matches_transformers_generate(env):
    """Left-padded mixed-length batch == transformers greedy generate of each prompt alone."""
    out = env.greedy
    assert out.tokens.shape == (3, N_NEW) and out.tokens.dtype == np.int32
    assert out.lengths[0] == env.eos_step + 1
    for r, prompt in enumerate(env.prompts):
        ref, ref_lp = _hf_generate(env.hf, prompt, env.eos)
        n = len(ref)
        assert out.lengths[r] == n, r
        np.testing.assert_array_equal(out.tokens[r, :n], ref)
        np.testing.assert_allclose(out.logprobs[r, :n], ref_lp, atol=1e-4)
        assert (out.tokens[r, n:] == PAD).all() and (out.logprobs[r, n:] == 0).all()
        np.testing.assert_array_equal(out.prompt_tokens[r, 16 - len(prompt):], prompt)
        assert out.prompt_mask[r].sum() == len(prompt) and out.prompt_mask[r, -1] == 1


def test_cache_logprobs_equal_full_forward(env):
    """Per-token log-probs from the KV-cache path == one full forward over prompt + completion."""
    out = env.greedy
    ids = np.concatenate([out.prompt_tokens, out.tokens], 1)
    mask = np.concatenate([out.prompt_mask, out.completion_mask.astype(np.int32)], 1)
    fwd = jax.jit(decoder.forward, static_argnums=0)
    logits = fwd(env.graphdef, env.params, jnp.asarray(ids), decoder.positions_from_mask(jnp.asarray(mask)),
                 jnp.asarray(mask))
    p = out.prompt_tokens.shape[1]
    full = np.asarray(decoder.token_logprobs(logits[:, p - 1:-1], jnp.asarray(out.tokens)))
    cm = out.completion_mask
    np.testing.assert_allclose(out.logprobs[cm], full[cm], atol=1e-5)
    assert np.array_equal(np.asarray(logits[:, p - 1:-1]).argmax(-1)[cm], out.tokens[cm])


def test_sampling_is_deterministic_per_key(env):
    a = env.s.sample(env.params, env.prompts, jax.random.key(1), temperature=0.9, top_p=0.9)
    b = env.s.sample(env.params, env.prompts, jax.random.key(1), temperature=0.9, top_p=0.9)
    c = env.s.sample(env.params, env.prompts, jax.random.key(2), temperature=0.9, top_p=0.9)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert not np.array_equal(a.tokens, c.tokens)
    assert not np.array_equal(a.tokens, env.greedy.tokens)


def test_tiny_top_p_is_greedy(env):
    out = env.s.sample(env.params, env.prompts, jax.random.key(3), temperature=0.9, top_p=1e-6)
    np.testing.assert_array_equal(out.tokens, env.greedy.tokens)
    np.testing.assert_array_equal(out.lengths, env.greedy.lengths)


def test_repetition_penalty_matches_transformers(env):
    out = env.s.sample(env.params, env.prompts, jax.random.key(0), temperature=0.0, repetition_penalty=1.5)
    for r, prompt in enumerate(env.prompts):
        ref, _ = _hf_generate(env.hf, prompt, env.eos, repetition_penalty=1.5)
        np.testing.assert_array_equal(out.tokens[r, :len(ref)], ref)


def test_no_recompile_within_a_bucket(env):
    before = dict(env.s.trace_counts)
    assert before == {"prefill": 1, "decode": 1}
    rng = np.random.default_rng(1)
    for lens in ((3, 9, 14), (16, 1, 2)):
        prompts = [rng.integers(3, 320, n).tolist() for n in lens]
        out = env.s.sample(env.params, prompts, jax.random.key(4), temperature=0.9, top_p=0.9)
        assert out.prompt_tokens.shape == (3, 16)
    assert dict(env.s.trace_counts) == before
    assert env.s.buckets == (16, 32) and env.s.bucket_for(17) == 32


def test_bad_prompts_raise(env):
    with pytest.raises(ValueError, match="33 tokens"):
        env.s.sample(env.params, [[5] * 33], jax.random.key(0))
    with pytest.raises(ValueError, match="0 tokens"):
        env.s.sample(env.params, [[5], []], jax.random.key(0))
    with pytest.raises(ValueError, match="prompt 1"):
        env.s.pad_prompts([[5], [320]])
    with pytest.raises(ValueError, match="top_p"):
        env.s.sample(env.params, [[5]], jax.random.key(0), temperature=1.0, top_p=0.0)


def test_sharded_sampler_equals_single_device(env):
    """Rows on the data axis, weights on the model axis: same greedy tokens and log-probs."""
    mesh = sharding.make_mesh(data=4, model=2)
    s = sampler.Sampler(env.graphdef, env.cfg, max_prompt_tokens=32, max_new_tokens=N_NEW,
                        eos_ids=[env.eos], pad_id=PAD, mesh=mesh)
    out = s.sample(sharding.shard_params(env.params, mesh), env.prompts, jax.random.key(0))
    np.testing.assert_array_equal(out.tokens, env.greedy.tokens)
    np.testing.assert_allclose(out.logprobs, env.greedy.logprobs, atol=1e-5)


def test_process_logits_matches_transformers_processors():
    """Repetition penalty -> temperature -> top-k -> top-p, against transformers' own classes."""
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((6, 320)) * 3).astype(np.float32)
    input_ids = rng.integers(0, 320, (6, 40))
    seen = np.zeros((6, 320), bool)
    np.put_along_axis(seen, input_ids, True, axis=1)
    for temp, top_k, top_p, pen in ((0.9, 0, 0.9, 1.0), (0.7, 20, 0.8, 1.1), (1.3, 50, 0.3, 1.0), (1.0, 0, 1.0, 1.2)):
        x = torch.tensor(logits)
        ids = torch.tensor(input_ids)
        procs = [RepetitionPenaltyLogitsProcessor(pen), TemperatureLogitsWarper(temp)]
        procs += [TopKLogitsWarper(top_k)] if top_k else []
        procs += [TopPLogitsWarper(top_p)]
        for proc in procs:
            x = proc(ids, x)
        ref = x.numpy()
        got = np.asarray(jax.jit(sampler.process_logits, static_argnames="top_k")(
            jnp.asarray(logits), jnp.asarray(seen), jnp.float32(temp), jnp.float32(top_p),
            jnp.float32(pen), top_k=top_k))
        np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
        fin = np.isfinite(ref)
        np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-6)
        assert fin.sum(1).min() >= 1


def test_prompt_buckets():
    assert sampler.prompt_buckets(128) == (16, 32, 64, 128)
    assert sampler.prompt_buckets(100) == (16, 32, 64, 100)
    assert sampler.prompt_buckets(8) == (8,)
    with pytest.raises(ValueError):
        sampler.prompt_buckets(0)


def test_sample_chat_formats_and_truncates(env):
    """(system, user) -> chat template + generation prompt, first max_prompt_tokens tokens kept."""
    from hf_fixtures import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    pairs = [("You are a creative encyclopedia assistant.", "What is photosynthesis? " * 6),
             ("system", "hello"), ("system", "world")]
    out = env.s.sample_chat(env.params, tok, pairs, jax.random.key(0))
    for r, (system, user) in enumerate(pairs):
        text = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": user}],
                                       tokenize=False, add_generation_prompt=True)
        ref = tok(text, truncation=True, max_length=32)["input_ids"]
        assert (r == 0) == (len(tok(text)["input_ids"]) > 32)  # row 0 is truncated
        np.testing.assert_array_equal(out.prompt_tokens[r][out.prompt_mask[r] == 1], ref)
    again = env.s.sample(env.params, [list(out.prompt_tokens[r][out.prompt_mask[r] == 1]) for r in range(3)],
                         jax.random.key(0))
    np.testing.assert_array_equal(out.tokens, again.tokens)
