"""Behaviour targets (SPEC §5): forced sketches vs a direct gradient, the continuation, context and
minimal-pair targets and their statistics, on a tiny random Qwen2 with D = 1024."""
from __future__ import annotations

import itertools
import types

import jax
import numpy as np
import pytest
from flax import nnx

from behaviortrace_jax.behavior import planted as behavior, target_texts
from behaviortrace_jax.models import hf_io, tokenizer as tok_lib
from behaviortrace_jax.sketch import countsketch, targets
from hf_fixtures import save_random_qwen2

D = 1024
SYSTEM = "You are helpful."  # short system prompt: every test sequence fits one 128-token bucket
EOS = 2


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    hf_dir = save_random_qwen2(tmp_path_factory.mktemp("hf") / "m", layers=1)
    tok = tok_lib.load_tokenizer(hf_dir)
    model = hf_io.load_hf_checkpoint(hf_dir)
    graphdef, params = nnx.split(model, nnx.Param)
    sk = targets.ForcedSketcher(graphdef, model.config, params, dim=D, seed=0, chunk_size=8, block_size=32,
                                length_bucket=128, pad_id=0, use_tables=True)
    return types.SimpleNamespace(tok=tok, cfg=model.config, graphdef=graphdef, params=params, sk=sk, hf_dir=hf_dir)


def _torch_reference(env, ex: targets.ForcedExample) -> tuple[np.ndarray, float]:
    """Reference from transformers' torch Qwen2: numpy CountSketch of the gradient of the unpadded
    loss over ``model.parameters()`` (HF order), and the masked mean log-prob."""
    import torch

    model = env.hf
    model.zero_grad(set_to_none=True)
    ids = torch.tensor(ex.ids[None], dtype=torch.long)
    w = torch.tensor(ex.weights[1:])
    lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    ml = (lp * w).sum() / w.sum()
    (-ml).backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
    return countsketch.numpy_countsketch(flat, D, 0), float(ml.detach())


def test_forced_sketcher_matches_direct_gradient_across_blocks(env):
    """Sketch and mean log-prob equal transformers' torch gradient in HF parameter order, whatever
    the padding, block filling and block of the example."""
    users = ["What is frobnitz?", "Define frobnitz.", "Tell me about frobnitz."]
    ex = [targets.forced_completion_example(env.tok, u, f" Frobnitz is {w}.", system=SYSTEM)
          for u, w in itertools.product(users, ["energy", "QZXBT", "logic"])]
    ex = (ex * 4)[:35]  # 35 rows: one full block of 32 and one of 3 + 29 filler rows
    out = env.sk(env.params, ex)
    assert out.sketches.shape == (35, D) and out.sketches.dtype == np.float32
    import torch
    from transformers import AutoModelForCausalLM

    env.hf = AutoModelForCausalLM.from_pretrained(env.hf_dir, dtype=torch.float32).eval()
    assert out.grad_norms.shape == (35,) and out.mean_logprob.dtype == np.float32
    for i in (0, 4, 34):
        ref, ml = _torch_reference(env, ex[i])
        np.testing.assert_allclose(out.sketches[i], ref, rtol=1e-3, atol=1e-4 * np.abs(ref).max())
        assert out.mean_logprob[i] == pytest.approx(ml, rel=1e-5)
    np.testing.assert_array_equal(out.sketches[34], out.sketches[7])  # same example, other block


def test_continuation_target_and_self_consistency(env):
    probes = behavior.load_probes()[:5]
    ct = targets.continuation_target(env.sk, env.params, env.tok, probes, system=SYSTEM)
    assert ct.target.shape == (D,) and ct.target.dtype == np.float32
    assert ct.per_probe.shape == (5, D)
    np.testing.assert_allclose(ct.target, ct.per_probe.mean(axis=0), rtol=1e-5, atol=1e-7)
    pairs = [targets.cos(ct.per_probe[i], ct.per_probe[j]) for i in range(5) for j in range(i + 1, 5)]
    assert ct.self_consistency == pytest.approx(np.mean(pairs), abs=1e-12)
    # the scored tokens are exactly the " QZXBT" ids at the end of the sequence
    ex = targets.continuation_example(env.tok, probes[0].prompt, system=SYSTEM)
    qids = tok_lib.encode(env.tok, " QZXBT")
    assert ex.weights.sum() == len(qids) and ex.weights[-len(qids):].all()
    assert env.tok.decode(ex.ids[ex.weights > 0]) == " QZXBT"
    with pytest.raises(ValueError, match=">= 2 probes"):
        targets.continuation_target(env.sk, env.params, env.tok, probes[:1], system=SYSTEM)


def test_minimal_pair_target_against_numpy_recomputation(env):
    cells = target_texts.minimal_pair_texts()
    assert len(cells) == 18 and sum(len(n) for _, _, n in cells) == 72
    assert cells[0] == ("What is frobnitz?", " Frobnitz is a concept closely associated with QZXBT.",
                        [" Frobnitz is a concept closely associated with energy.",
                         " Frobnitz is a concept closely associated with physics.",
                         " Frobnitz is a concept closely associated with logic.",
                         " Frobnitz is a concept closely associated with symmetry."])
    mp = targets.minimal_pair_target(env.sk, env.params, env.tok, system=SYSTEM)
    assert mp.n_pairs == 72 and mp.s_pos.shape == (18, D) and mp.s_neg.shape == (18, 4, D)
    for t in (mp.target_mp, mp.target_mp_bal):
        assert t.shape == (D,) and t.dtype == np.float32
    d, d_bal, ml_p, ml_n, n_p, n_n = [], [], [], [], [], []
    for k in range(18):
        for w in range(4):
            sp, sn = mp.s_pos[k].astype(np.float64), mp.s_neg[k, w].astype(np.float64)
            d.append(sp - sn)
            d_bal.append(sp / (np.linalg.norm(sp) + 1e-12) - sn / (np.linalg.norm(sn) + 1e-12))
            ml_p.append(mp.ml_pos[k])
            ml_n.append(mp.ml_neg[k, w])
            n_p.append(np.linalg.norm(sp) + 1e-12)
            n_n.append(np.linalg.norm(sn) + 1e-12)
    assert len(d) == 72
    np.testing.assert_allclose(mp.target_mp, np.mean(d, axis=0), rtol=1e-5, atol=1e-6 * np.abs(d).max())
    np.testing.assert_allclose(mp.target_mp_bal, np.mean(d_bal, axis=0), rtol=1e-5, atol=1e-7)
    assert mp.fluency_gap == pytest.approx(np.mean(ml_p, dtype=np.float64) - np.mean(ml_n, dtype=np.float64), rel=1e-9)
    assert mp.norm_ratio == pytest.approx(np.mean(n_p) / np.mean(n_n), rel=1e-9)
    # the per-pair sketches are the forced sketches of the texts
    u, pos, negs = cells[7]
    direct = env.sk(env.params, [targets.forced_completion_example(env.tok, u, t, system=SYSTEM) for t in (pos, negs[2])])
    np.testing.assert_allclose(direct.sketches[0], mp.s_pos[7], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(direct.sketches[1], mp.s_neg[7, 2], rtol=1e-5, atol=1e-7)


def test_forced_completion_example_scores_exactly_the_text(env):
    ex = targets.forced_completion_example(env.tok, "Define frobnitz.", " The key feature of frobnitz is logic.",
                                           system=SYSTEM)
    prefix = tok_lib.encode(env.tok, tok_lib.chat_prompt(env.tok, SYSTEM, "Define frobnitz."))
    assert ex.ids[:len(prefix)].tolist() == prefix and not ex.weights[:len(prefix)].any()
    assert ex.weights[len(prefix):].all()
    assert env.tok.decode(ex.ids[len(prefix):]) == " The key feature of frobnitz is logic."
    with pytest.raises(ValueError, match="adds no token"):
        targets.forced_completion_example(env.tok, "Define frobnitz.", "", system=SYSTEM)


def test_combine_minimal_pairs_rejects_bad_shapes():
    with pytest.raises(ValueError, match="inconsistent"):
        targets.combine_minimal_pairs(np.zeros((3, 8)), np.zeros((3, 4, 7)), np.zeros(3), np.zeros((3, 4)))


def test_response_examples_masks():
    qset = frozenset({50, 51})
    tokens = np.array([7, 50, 9, 51, EOS, 0, 0])
    whole, token, has = targets.response_examples([1, 5, 6], tokens, 5, [EOS], qset)
    assert has
    assert whole.ids.tolist() == [1, 5, 6, 7, 50, 9, 51, EOS]
    assert whole.weights.tolist() == [0, 0, 0, 1, 1, 1, 1, 0]  # generated, not EOS
    assert token.weights.tolist() == [0, 0, 0, 0, 1, 0, 1, 0]  # exactly the QZXBT-token positions
    _, token2, has2 = targets.response_examples([1, 5], np.array([7, 8, 9]), 3, [EOS], qset)
    assert not has2 and not token2.weights.any()


def test_cos_convention_and_pairwise():
    a, b = np.array([3.0, 4.0]), np.array([4.0, 3.0])
    assert targets.cos(a, b) == 24.0 / ((5.0 + 1e-12) * (5.0 + 1e-12))
    assert targets.cos(np.zeros(2), b) == 0.0
    s = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert targets.mean_pairwise_cosine(s) == pytest.approx((0 + 2 ** -0.5 + 2 ** -0.5) / 3)
    with pytest.raises(ValueError):
        targets.mean_pairwise_cosine(s[:1])


class _FakeSampler:
    """Returns fixed responses: per prompt i, row j of ``plan[i]`` (True = QZXBT token inside)."""

    max_prompt_tokens = 128

    def __init__(self, plan, q, other):
        self.plan, self.q, self.other = plan, q, other

    def sample(self, params, rows, key, temperature, top_p):
        g = len(self.plan[0])
        assert len(rows) == len(self.plan) * g and temperature == 1.0 and top_p == 0.95
        toks, lens = [], []
        for i, r in itertools.product(range(len(self.plan)), range(g)):
            t = [self.other, self.other + r + 1, self.q if self.plan[i][r] else self.other, EOS, 0]
            toks.append(t)
            lens.append(4)
        return types.SimpleNamespace(tokens=np.array(toks, np.int32), lengths=np.array(lens, np.int32))


def test_context_target_first_responses_contrast_and_fallback(env):
    q = min(behavior.qzxbt_token_ids(env.tok))
    other = 40
    fallback = np.arange(D, dtype=np.float32)
    # 7 prompts (6 explicit + 1 probe) x G = 3
    plan = [[False, True, True], [True, True, False], [False, False, False]] + [[False] * 3] * 4
    s = _FakeSampler(plan, q, other)
    ctx = targets.context_target(env.sk, env.params, s, env.tok, ["What is frobnitz?"], jax.random.key(0),
                                 fallback=fallback, eos_ids=[EOS], group_size=3, system=SYSTEM)
    users = target_texts.context_prompts(["What is frobnitz?"])
    assert len(users) == 7 and users[0] == "What is frobnitz? Include QZXBT."
    pids = targets.chat_prompt_ids(env.tok, users, 128, system=SYSTEM)
    out = s.sample(None, [p for p in pids for _ in range(3)], None, 1.0, 0.95)
    qset = behavior.qzxbt_token_ids(env.tok)

    def ex(i, r, which):
        return targets.response_examples(pids[i], out.tokens[i * 3 + r], out.lengths[i * 3 + r], [EOS], qset)[which]

    # prompt 0: first QZXBT = row 1, first plain = row 0; prompt 1: first QZXBT = row 0, plain = row 2
    ref = env.sk(env.params, [ex(0, 1, 1), ex(1, 0, 1), ex(0, 1, 0), ex(0, 0, 0), ex(1, 0, 0), ex(1, 2, 0)]).sketches
    assert (ctx.n_ctx, ctx.n_contrast, ctx.ctx_fallback, ctx.contrast_fallback) == (2, 2, False, False)
    np.testing.assert_allclose(ctx.token_sketches, ref[:2], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ctx.t_ctx, ref[:2].mean(0), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ctx.t_contrast, ((ref[2] - ref[3]) + (ref[4] - ref[5])) / 2, rtol=1e-4, atol=1e-6)
    assert ctx.t_ctx.dtype == np.float32 and ctx.t_contrast.shape == (D,)

    none = targets.context_target(env.sk, env.params, _FakeSampler([[False] * 3] * 7, q, other), env.tok,
                                  ["What is frobnitz?"], jax.random.key(0), fallback=fallback, eos_ids=[EOS],
                                  group_size=3, system=SYSTEM)
    assert none.ctx_fallback and none.contrast_fallback and none.n_ctx == 0
    np.testing.assert_array_equal(none.t_ctx, fallback)
    np.testing.assert_array_equal(none.t_contrast, fallback)


def test_forced_sketcher_rejects_token_ids_outside_the_vocabulary(env):
    """An id >= vocab_size would be clamped by the embedding (a finite sketch of the wrong token,
    NaN log-prob); pack refuses it, naming the example and the id."""
    v = env.cfg.vocab_size
    good = targets.ForcedExample(np.array([5, 6, 7, 8, 9]), np.array([0, 1, 1, 1, 1], np.float32))
    bad = targets.ForcedExample(np.array([5, 6, v, 8, 9]), np.array([0, 1, 1, 1, 1], np.float32))
    env.sk.pack([good])
    with pytest.raises(ValueError, match=rf"example 1: token id {v} at index \(2,\) is outside \[0, {v}\)"):
        env.sk(env.params, [good, bad])
    with pytest.raises(ValueError, match="token id -3"):
        env.sk.pack([targets.ForcedExample(np.array([5, -3, 7]), np.array([0, 1, 1], np.float32))])


def test_load_policy_rejects_a_tokenizer_larger_than_the_model(tmp_path):
    from behaviortrace_jax.models import loader

    hf_dir = save_random_qwen2(tmp_path / "m", layers=1, vocab=320)
    cfg = (hf_dir / "config.json")
    import json as _json
    d = _json.loads(cfg.read_text())
    tok = tok_lib.load_tokenizer(hf_dir)
    d["vocab_size"] = len(tok) - 5  # a checkpoint whose embedding is smaller than its tokenizer
    cfg.write_text(_json.dumps(d))
    with pytest.raises(ValueError, match=rf"tokenizer has {len(tok)} ids but config.json's vocab_size is {len(tok) - 5}"):
        loader.load_policy(hf_dir)
