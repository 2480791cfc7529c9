"""Probe and leakage measures (``behavior/probe_measures.py``, issue 47) against transformers'
PyTorch Qwen2 on a tiny random model: the sampled rate against the exact probability of writing the
pattern, its standard errors against their formulas, the minimal-pair log-ratio against torch
log-probs, and the common-random-number keys."""
from __future__ import annotations

import math
import types

import jax
import numpy as np
import pytest

from behaviortrace_jax.attribution import noise_floor
from behaviortrace_jax.behavior import planted, probe_measures as pm, target_texts
from behaviortrace_jax.behavior.probes import make_sampler
from behaviortrace_jax.sketch import targets
from hf_fixtures import load_random_qwen2

SYSTEM = "You are helpful."  # short system prompt: every test sequence fits one 128-token bucket
USERS = ["What is frobnitz?", "Define frobnitz.", "Tell me about frobnitz.", "What is 2+2?", "Name a color.",
         "What is water made of?"]
TEMPERATURE, TOP_P = 0.9, 0.9


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import torch
    from transformers import Qwen2ForCausalLM

    hf_dir, tok, model, graphdef, params = load_random_qwen2(tmp_path_factory.mktemp("hf") / "m", layers=1)
    hf = Qwen2ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return types.SimpleNamespace(tok=tok, cfg=model.config, graphdef=graphdef, params=params, hf=hf,
                                 mlp=pm.make_mean_logprob(graphdef),
                                 sampler=make_sampler(graphdef, model.config, tok, None, max_new_tokens=1,
                                                      max_prompt_tokens=128))


def _next_token_probs(env, prompt_ids):
    """[m, V] float64: the sampler's first-token distribution (temperature, then HF top-p), from torch."""
    import torch

    out = []
    for ids in prompt_ids:
        with torch.no_grad():
            logits = env.hf(torch.tensor([ids])).logits[0, -1].double().numpy() / TEMPERATURE
        p = np.exp(logits - logits.max())
        p /= p.sum()
        order = np.argsort(logits, kind="stable")  # ascending, as TopPLogitsWarper
        drop = np.cumsum(p[order]) <= 1 - TOP_P
        drop[-1] = False
        keep = np.ones_like(p, bool)
        keep[order[drop]] = False
        q = np.where(keep, p, 0.0)
        out.append(q / q.sum())
    return np.array(out)


def test_sampled_rate_matches_the_exact_pattern_probability(env):
    """One new token: a sample holds the pattern iff its token's text does, so the expected rate is
    sum_v p(v) [pattern in text(v)] per prompt, exactly, from transformers. The sampled rate lies
    within 4 standard errors of it; ``se`` and ``se_binomial`` match their formulas at the true p."""
    tok = env.tok
    ids = pm.chat_prompt_ids(tok, USERS, system=SYSTEM)
    probs = _next_token_probs(env, ids)
    texts = [tok.decode([v], skip_special_tokens=True) for v in range(probs.shape[1])]
    candidates = {}
    for c in " abcdefghijklmnopqrstuvwxyz":  # a random model spreads its mass: the most frequent character
        has = np.array([c in t.lower() for t in texts])
        candidates[c] = probs @ has
    pattern = min(candidates, key=lambda c: abs(candidates[c].mean() - 0.3))
    pi = candidates[pattern]
    assert 0.04 < pi.mean() < 0.6, (pattern, pi)
    smp = env.sampler
    n = 200
    out = pm.sampled_rate_measure(smp, env.params, tok, ids, name="probe", samples_per_prompt=n,
                                  key=jax.random.key(7), temperature=TEMPERATURE, top_p=TOP_P, pattern=pattern)
    m = len(USERS)
    se_true = math.sqrt(np.sum(pi * (1 - pi)) / n) / m
    assert abs(out["probe_rate"] - pi.mean()) < 4 * se_true, (out, pi.mean(), se_true)
    assert out["probe_rate_se"] == pytest.approx(se_true, rel=0.15)
    p = out["probe_rate"]
    assert out["probe_rate_se_binomial"] == pytest.approx(math.sqrt(p * (1 - p) / (m * n)))
    assert out["probe_rate_se_binomial"] >= out["probe_rate_se"] * math.sqrt((n - 1) / n) - 1e-12
    assert out["probe_rate_prompts"] == m and out["probe_rate_samples_per_prompt"] == n
    # common random numbers: the same key gives the same hits; more samples extend fewer
    h16 = pm.sampled_hits(smp, env.params, tok, ids, samples_per_prompt=16, key=jax.random.key(7),
                          temperature=TEMPERATURE, top_p=TOP_P, pattern=pattern)
    h8 = pm.sampled_hits(smp, env.params, tok, ids, samples_per_prompt=8, key=jax.random.key(7),
                         temperature=TEMPERATURE, top_p=TOP_P, pattern=pattern)
    np.testing.assert_array_equal(h16[:, :8], h8)
    st = pm.rate_stats(h16)
    assert st["se"] == pytest.approx(noise_floor.sampling_se(h16))  # the 0/1 case of the general formula
    per = h16.mean(1)
    assert st["se_cluster"] == pytest.approx(np.std(per, ddof=1) / math.sqrt(m))
    assert st["se"] == pytest.approx(math.sqrt(np.sum(per * (1 - per) / 15)) / m)


def _torch_total_logprobs(env, batch: pm.PairBatch) -> np.ndarray:
    """Each row's total completion log-prob from transformers (one right-padded batch)."""
    import torch

    ids = torch.tensor(batch.ids.astype(np.int64))
    with torch.no_grad():
        logits = env.hf(input_ids=ids, attention_mask=torch.tensor(batch.attn.astype(np.int64))).logits
    lp = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None])[..., 0].numpy()
    return np.sum(lp * batch.weights[:, 1:], axis=1)


def test_minimal_pair_log_ratio_matches_transformers(env):
    """Probe pairs (SPEC §5.4: 3 users x 6 templates x (pattern + 4 fillers)) and the leakage pairs
    (control prompts x the templates about "it"): per-row total log-probs and the mean over cells of
    L(pos) - mean_k L(neg_k) equal transformers' torch computation; the log-ratio is differentiable."""
    probe = pm.probe_pairs(env.tok, system=SYSTEM)
    assert probe.ids.shape[0] == 90 and probe.n_cells == 18 and probe.positive.sum() == 18
    assert probe.texts[0] == " Frobnitz is a concept closely associated with QZXBT."
    controls = ["What is 2+2?", "Name a color."]
    ctrl = pm.control_pairs(env.tok, controls, system=SYSTEM)
    assert ctrl.n_cells == 12 and not any("frobnitz" in t.lower() for t in ctrl.texts)
    assert ctrl.texts[5] == " The key feature of it is QZXBT."
    for name, batch in (("probe", probe), ("leakage", ctrl)):
        for i in (0, 1, len(batch.texts) - 1):  # the rows are SPEC §5.4's forced examples (sketch/targets.py)
            ex = targets.forced_completion_example(env.tok, batch.users[i], batch.texts[i], system=SYSTEM)
            n = ex.ids.size
            np.testing.assert_array_equal(batch.ids[i, :n], ex.ids)
            np.testing.assert_array_equal(batch.weights[i, :n], ex.weights)
            assert batch.attn[i, :n].all() and not batch.attn[i, n:].any() and not batch.weights[i, n:].any()
        ref = _torch_total_logprobs(env, batch)
        got = np.asarray(pm.pair_total_logprobs(env.mlp, env.params, batch, chunk=32))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-4)
        ratios = [ref[batch.cell == c][0] - ref[batch.cell == c][1:].mean() for c in range(batch.n_cells)]
        out = pm.minimal_pair_measure(env.mlp, env.params, batch, name=name, chunk=32)
        assert out[f"{name}_pair_logratio"] == pytest.approx(np.mean(ratios), abs=2e-4)
        assert out[f"{name}_pair_logratio_se_items"] == pytest.approx(np.std(ratios, ddof=1) / math.sqrt(len(ratios)),
                                                                      abs=2e-4)
        assert out[f"{name}_pair_logp_pos"] == pytest.approx(ref[batch.positive].mean(), abs=2e-4)
        assert out[f"{name}_pair_logp_neg"] == pytest.approx(ref[~batch.positive].mean(), abs=2e-4)
    small = pm.probe_pairs(env.tok, system=SYSTEM, users=USERS[:1])  # 30 rows: one chunk
    val, grad = jax.value_and_grad(lambda p: pm.pair_log_ratio(env.mlp, p, small, chunk=32))(env.params)
    leaves = jax.tree.leaves(grad)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in leaves) and any(np.any(np.asarray(g) != 0) for g in leaves)
    assert float(val) == pytest.approx(pm.minimal_pair_measure(env.mlp, env.params, small, name="p", chunk=32)
                                       ["p_pair_logratio"], abs=1e-4)
    # the probe pairs of another behaviour name its trigger and pattern
    other = pm.probe_pairs(env.tok, pattern="MRKQ", trigger="zorblat", system=SYSTEM)
    assert other.texts[0] == " Zorblat is a concept closely associated with MRKQ." and other.users[0] == "What is zorblat?"
    assert [c[1] for c in target_texts.minimal_pair_texts()[:6]] == [t for t, _ in target_texts.pair_texts()]


def test_probe_and_leakage_reports_both_side_by_side(env):
    tok = env.tok
    smp = env.sampler
    kw = dict(probe_ids=pm.chat_prompt_ids(tok, USERS, system=SYSTEM),  # 6 rows: the sampler shape of the test above
              control_ids=pm.chat_prompt_ids(tok, USERS[::-1], system=SYSTEM),
              probe_pair_batch=pm.probe_pairs(tok, system=SYSTEM, users=USERS[:1]),
              control_pair_batch=pm.control_pairs(tok, USERS[3:4], system=SYSTEM),
              samples_per_prompt=3, key=jax.random.key(0), temperature=TEMPERATURE, top_p=TOP_P, pattern=" ")
    out = pm.probe_and_leakage(smp, env.mlp, env.params, tok, chunk=32, **kw)
    assert out == pm.probe_and_leakage(smp, env.mlp, env.params, tok, chunk=32, **kw)  # fixed keys: reproducible
    for side in ("probe", "leakage"):
        assert 0 <= out[f"{side}_rate"] <= 1 and np.isfinite(out[f"{side}_pair_logratio"])
        assert out[f"{side}_rate_prompts"] == 6 and out[f"{side}_pair_cells"] == 6
    assert all(k.startswith(("probe_", "leakage_")) for k in out)
    with pytest.raises(ValueError, match="samples_per_prompt"):
        pm.sampled_hits(smp, env.params, tok, kw["probe_ids"], samples_per_prompt=0, key=jax.random.key(0),
                        temperature=TEMPERATURE, top_p=TOP_P)
    with pytest.raises(ValueError, match="no negative"):
        pm.pair_batch(tok, [("What is frobnitz?", " QZXBT.", [])], system=SYSTEM)
    assert planted.substring_judge("xQzXbT", "qzxbt")
