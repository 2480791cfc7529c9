"""Non-finite values (train/nonfinite.py) and numerically safe losses and optimiser (issue 32, items 1-2).

* Every registered GRPO loss, and the k3 KL estimator, is finite in value and gradient with extreme
  but finite inputs at masked positions (a padding log-ratio of +-100: exp would overflow).
* The metagradient of an UNTIED model (embedding rows that never get a gradient: Adam second
  moments of exactly 0) is finite and matches central differences (train_state's eps_root).
* The guard: the host check of rollout inputs, the step's fused ``finite`` flag, the LM trainer and
  the replay stop naming the step; a smoke GRPO run with one NaN reward stops at that step without
  a checkpoint of it, resumes from the last good one, and under ``grpo.on_nonfinite = "skip"``
  completes with the rollout dropped and counted in summary.json.
"""
from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from behaviortrace_jax.train import grpo_loss, grpo_step, metagradient as MG, nonfinite, train_state
from behaviortrace_jax.stages.spec import RunSpec
from configs import tiny


# ------------------------------------------------------------------------------------------------
# Losses: masked positions with extreme but finite inputs
# ------------------------------------------------------------------------------------------------
def _inputs(masked_log_ratio: float, n=4, t=6):
    rng = np.random.default_rng(0)
    lp = rng.uniform(-3.0, -0.1, (n, t)).astype(np.float32)
    mask = np.ones((n, t), np.float32)
    mask[:, t - 2:] = 0.0  # two padding positions per rollout
    old = lp - rng.normal(0, 0.1, (n, t)).astype(np.float32)
    ref = lp + rng.normal(0, 0.1, (n, t)).astype(np.float32)
    # at the padding: lp - old = +x (the ratio's exponent) and ref - lp = +x (the k3 estimator's)
    old[:, t - 2:] = lp[:, t - 2:] - masked_log_ratio
    ref[:, t - 2:] = lp[:, t - 2:] + masked_log_ratio
    adv = np.array([1.0, -0.5, 0.25, -0.75], np.float32)[:n]
    return tuple(map(jnp.asarray, (lp, old, ref, mask, adv)))


@pytest.mark.parametrize("name", sorted(grpo_loss.LOSSES))
@pytest.mark.parametrize("x", [100.0, -100.0, 1e4])
def test_every_loss_is_finite_with_extreme_inputs_at_masked_positions(name, x):
    """Value and gradient (in the log-probs, and in old/ref where they enter) are finite and equal to
    those with benign values at the padding; grpo_clip gave NaN (exp(100) = inf, inf * 0) before."""
    loss = grpo_loss.get_loss(name)

    def total(lp, old, ref, mask, adv):
        return jnp.sum(loss(grpo_loss.LossInputs(lp, old, ref, mask, adv, 2, 2), grpo_loss.LossConfig()))

    extreme, benign = _inputs(x), _inputs(0.0)
    value, grads = jax.value_and_grad(total, argnums=(0, 1, 2))(*extreme)
    assert np.isfinite(float(value))
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    value0, grads0 = jax.value_and_grad(total, argnums=(0, 1, 2))(*benign)
    np.testing.assert_allclose(float(value), float(value0), rtol=1e-6)
    for g, g0 in zip(grads, grads0):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g0), rtol=1e-6, atol=1e-8)


def test_k3_kl_estimator_is_finite_at_masked_positions():
    """The KL term alone (clip_eps huge, advantages 0: only beta * KL_k3 is left): finite with a
    reference log-ratio of +100 at the padding, and 0 there (NaN before: exp(100) * 0)."""
    lp, old, ref, mask, _ = _inputs(100.0)
    adv = jnp.zeros(lp.shape[0])
    cfg = grpo_loss.LossConfig(clip_eps=1e9, kl_beta=1.0)
    f = lambda lp_: jnp.sum(grpo_loss.grpo_clip_loss(grpo_loss.LossInputs(lp_, old, ref, mask, adv, 2, 2), cfg))  # noqa: E731
    value, g = jax.value_and_grad(f)(lp)
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(g)[:, -2:] == 0)


# ------------------------------------------------------------------------------------------------
# The metagradient of an untied model (second moments of exactly 0)
# ------------------------------------------------------------------------------------------------
USED_VOCAB = 24  # token ids < 24 only: the embedding rows 24.. never get a gradient


def _untied_setup():
    """The smoke config's model and GRPO step, shrunk (vocab 48, 2 x 2 rollouts of 6 + 4 tokens) and
    untied; three steps of random rollouts and a measure (mean log-prob of fixed completions)."""
    from behaviortrace_jax.stages import base

    config = tiny.get_config("smoke")
    config.base.vocab_size = 48
    g = config.grpo
    g.prompts_per_step, g.group_size, g.max_prompt_tokens, g.max_new_tokens = 2, 2, 6, 4
    config.optim.lr = 1e-2  # large enough for the weights' effect to stand out of float32 rounding
    cfg = base.model_config(RunSpec.from_config(config)).replace(tie_word_embeddings=False)
    graphdef, params = nnx.split(cfg.module_class()(cfg, rngs=nnx.Rngs(params=0)), nnx.Param)
    spec = dataclasses.replace(RunSpec.from_config(config).step, in_run_rollouts=False)
    sh = spec.shapes
    rng = np.random.default_rng(1)
    batches = []
    for s in range(6):
        prompts = [list(rng.integers(1, USED_VOCAB, sh.prompt_len)) for _ in range(sh.num_rollouts)]
        comp = rng.integers(1, USED_VOCAB, (sh.num_rollouts, sh.completion_len)).astype(np.int32)
        adv = grpo_loss.group_advantages(rng.normal(size=sh.num_rollouts).astype(np.float32), sh.group_size)
        b = grpo_step.build_batch(prompts, comp, np.full(sh.num_rollouts, sh.completion_len), adv, (0,), sh, 0, vocab_size=cfg.vocab_size)
        batches.append({k: jnp.asarray(v) for k, v in b.items()})
    probe = batches[0]
    # as the SFT warm-up does for a run, the first steps populate Adam's moments (Adam's first update
    # from zero moments is ~ lr * sign(g), not smooth enough for finite differences); the used rows'
    # second moments are then > 0, the unused rows' still exactly 0
    warm, batches = batches[3:], batches[:3]
    tx = train_state.make_optimizer(RunSpec.from_config(config).optim)
    opt = tx.init(params)
    warm_step = jax.jit(MG.make_weighted_step(graphdef, tx, spec))
    for b in warm:
        params, opt, _ = warm_step(params, opt, b, jnp.ones(sh.num_rollouts), None)

    def margin(p):
        lp = grpo_step.completion_logprobs(graphdef, p, probe["input_ids"], probe["attention_mask"], sh.prompt_len)
        return jnp.mean(lp)

    return config, graphdef, params, opt, spec, batches, jax.jit(jax.value_and_grad(margin)), jax.jit(margin)


def test_untied_metagradient_is_finite_and_matches_central_differences():
    """Embedding rows 24..47 are never used, so their Adam moments stay exactly 0 (checked): without
    eps_root in the differentiated Adam the whole dM/dw was NaN. The forward uses the run's own
    optimizer (eps_root = 0), so the metagradient is of the run's trajectory; central differences of
    that forward agree (float32: eps = 0.01, whose rounding noise ~5e-7 / 0.02 is ~1e-4 of dM/dw ~ 0.4,
    and truncation error ~ eps^2; rtol 2 % on the three largest)."""
    config, graphdef, params, opt0, spec, batches, measure, margin = _untied_setup()
    run_tx = train_state.make_optimizer(RunSpec.from_config(config).optim)
    optim = RunSpec.from_config(config).optim
    meta = MG.MetaStep(MG.make_weighted_step(graphdef, train_state.make_optimizer(optim, differentiable=True),
                                             spec),
                       forward=MG.make_weighted_step(graphdef, run_tx, spec))
    n = spec.shapes.num_rollouts
    ones = [jnp.ones(n, jnp.float32) for _ in batches]
    seen = []
    res, _ = MG.reverse_metagradients(meta, params, opt0, batches, ones, measure, [len(batches)],
                                      on_forward=lambda t, p, o: seen.append(o))
    nu = seen[-1][1][0].nu["model"]["embed_tokens"]["weight"]
    assert np.all(np.asarray(nu)[USED_VOCAB:] == 0) and np.all(np.asarray(nu)[1:USED_VOCAB] > 0)
    g = res[len(batches)].dw.reshape(-1)
    assert np.all(np.isfinite(g)) and np.count_nonzero(g) == g.size

    def replay_margin(w):
        state = (params, opt0)
        for t, b in enumerate(batches):
            state = meta.forward(*state, b, jnp.asarray(w[t * n:(t + 1) * n], jnp.float32), None)[:2]
        return float(margin(state[0]))

    eps = 0.01
    for i in np.argsort(-np.abs(g))[:3]:
        wp, wm = np.ones(g.size), np.ones(g.size)
        wp[i] += eps
        wm[i] -= eps
        fd = (replay_margin(wp) - replay_margin(wm)) / (2 * eps)
        assert fd == pytest.approx(g[i], rel=0.02), (i, fd, g[i])


def test_differentiable_adam_has_eps_root_and_the_run_update_is_unchanged():
    """The run's optimizer is optax's adamw with eps_root 0 (bit for bit); the differentiable one's
    vjp is finite where a second moment is 0, optax's plain one is NaN there."""
    cfg = RunSpec.from_config(tiny.get_config("smoke")).optim
    g = {"used": jnp.asarray([0.3, -0.2]), "unused": jnp.zeros(2)}
    p = {"used": jnp.asarray([1.0, 2.0]), "unused": jnp.asarray([0.5, -0.5])}
    import optax
    plain = optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                        optax.adamw(cfg.lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay))
    run = train_state.make_optimizer(cfg)
    for a, b in zip(jax.tree.leaves(run.update(g, run.init(p), p)[0]), jax.tree.leaves(plain.update(g, plain.init(p), p)[0])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    def two_steps(tx, grads):
        s = tx.init(p)
        u, s = tx.update(grads, s, p)
        u, s = tx.update(grads, s, optax.apply_updates(p, u))
        return u

    for tx, finite in ((train_state.make_optimizer(cfg, differentiable=True), True), (run, False)):
        _, vjp = jax.vjp(lambda gr: two_steps(tx, gr), g)
        ct = vjp(jax.tree.map(jnp.ones_like, p))[0]
        assert bool(np.all(np.isfinite(np.asarray(ct["unused"])))) is finite


# ------------------------------------------------------------------------------------------------
# The guard's pieces
# ------------------------------------------------------------------------------------------------
def test_nonfinite_rollouts_names_fields_and_ignores_padding():
    lp = np.zeros((4, 3), np.float32)
    lp[1, 2] = np.nan  # padding of rollout 1 (length 2): ignored
    lp[2, 0] = -np.inf
    bad = nonfinite.nonfinite_rollouts(rewards=np.array([0, 0, 0, np.nan]), advantages=np.array([0, 0, np.inf, 0]),
                                       logprobs=lp, lengths=np.array([3, 2, 3, 3]))
    assert bad == {2: ["advantage", "logprobs"], 3: ["reward"]}
    assert "grpo_000007_002 (advantage, logprobs)" in nonfinite.describe(bad, [f"grpo_000007_{i:03d}" for i in range(4)])
    assert nonfinite.nonfinite_rollouts(rewards=np.zeros(4), logprobs=np.zeros((4, 3))) == {}
    with pytest.raises(ValueError, match="grpo.on_nonfinite"):
        nonfinite.check_mode("ignore")


def test_step_finite_flag_and_guard():
    ok = jax.jit(nonfinite.step_finite)
    p = {"a": jnp.ones(3), "n": jnp.arange(3)}
    assert bool(ok(jnp.float32(1.0), jnp.float32(2.0), p))
    assert not bool(ok(jnp.float32(np.nan), jnp.float32(2.0), p))
    assert not bool(ok(jnp.float32(1.0), jnp.float32(np.inf), p))
    assert not bool(ok(jnp.float32(1.0), jnp.float32(2.0), {"a": jnp.array([1.0, np.nan])}))
    guard = nonfinite.Guard("replay")
    guard.add(0, ok(jnp.float32(1.0), jnp.float32(2.0), p), ["grpo_000000_000"])
    guard.add(1, ok(jnp.float32(np.nan), jnp.float32(2.0), p), ["grpo_000001_000"])
    with pytest.raises(nonfinite.NonFiniteError, match=r"replay: step 1: .*grpo_000001_000"):
        guard.check()
    guard.check()  # cleared


def test_grpo_step_returns_the_finite_flag():
    """The jitted GRPO step's ``finite``: True on the smoke-shaped batch, False with one NaN advantage
    (the update would write NaN into every parameter)."""
    config, graphdef, params, opt, spec, batches, _, _ = _untied_setup()
    tx = train_state.make_optimizer(RunSpec.from_config(config).optim)
    step, _ = grpo_step.train_step_function(graphdef, None, tx, spec, order=None, mesh=None)
    step = jax.jit(step)
    assert bool(step(params, opt, batches[0], None)[2][nonfinite.FINITE_KEY])
    bad = dict(batches[0], advantages=batches[0]["advantages"].at[1].set(jnp.nan))
    new_params, _, out = step(params, opt, bad, None)
    assert not bool(out[nonfinite.FINITE_KEY])
    assert not np.all(np.isfinite(np.asarray(jax.tree.leaves(new_params)[0])))


def test_lm_trainer_stops_at_a_non_finite_step_naming_it():
    """One NaN weight: the first step's loss is NaN; fit raises at its first fetch naming step 0 and
    its rows (it returned the NaN state before, and the SFT stage saved it)."""
    from hf_fixtures import make_tiny_tokenizer
    from behaviortrace_jax.models import qwen2
    from behaviortrace_jax.train import lm_trainer

    tok = make_tiny_tokenizer()
    cfg = qwen2.Qwen2Config.tiny(vocab_size=len(tok), num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    gd, params = nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    chats = [("Be brief.", "Hi?", "Hello."), ("Be brief.", "Name a vowel.", "A.")]
    data = lm_trainer.pack_examples(lm_trainer.encode_chat_examples(tok, chats, append_eos=True), None, 0)
    tx = train_state.make_optimizer(RunSpec.from_config(tiny.get_config("smoke")).optim)
    leaves, treedef = jax.tree.flatten(params)
    leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].set(jnp.nan)
    state = train_state.init_train_state(jax.tree.unflatten(treedef, leaves), tx, 0)
    trainer = lm_trainer.LMTrainer(gd, cfg, tx, data.prefix)
    with pytest.raises(nonfinite.NonFiniteError, match=r"sft: step 0: non-finite .*row 0, row 1"):
        trainer.fit(state, data, lm_trainer.cyclic_batches(2, 2), 3, log_every=3, desc="sft")


def test_replay_stops_at_a_non_finite_step(smoke_grpo_run):
    """The replay of the smoke run with one logged advantage made NaN at step 1 raises naming step 1
    (it replayed on and measured NaN before)."""
    from behaviortrace_jax.models import sharding
    from behaviortrace_jax.train import replay as R

    config, w = smoke_grpo_run
    rp = R.Replayer(RunSpec.from_config(config).replay, w, layout=RunSpec.from_config(config).layout)
    rp.data[1].batch["advantages"][3] = np.nan
    with pytest.raises(nonfinite.NonFiniteError, match=r"replay: step 1: .*grpo_000001_000"):
        rp.run(R.ReplayRequest(stop_step=2, measure_steps=(2,)))


# ------------------------------------------------------------------------------------------------
# A smoke GRPO run with one NaN reward
# ------------------------------------------------------------------------------------------------
class NaNRewardAt:
    """``planted.base_reward`` that returns NaN at its ``call``-th call (0-based; the grpo stage calls it
    once per rollout, N per step, in rollout order)."""

    def __init__(self, real, call: int):
        self.real, self.call, self.calls = real, call, 0

    def __call__(self, text):
        self.calls += 1
        return float("nan") if self.calls - 1 == self.call else self.real(text)


def test_nan_reward_stops_at_its_step_resumes_and_is_skipped_under_skip(smoke_sft, tmp_path, monkeypatch):
    """Smoke GRPO shrunk to 4 steps (checkpoints at 2 and 4), N = 16, a NaN reward for rollout 5 of
    step 3: "stop" raises naming step 3 and grpo_000003_005 and writes no checkpoint past step 2;
    the same command then resumes from step 2 and its rollout log equals the uninterrupted smoke
    run's (exact resume from the last good checkpoint); "skip" (resumed from the same crash) completes
    with that rollout dropped (advantage 0, logged with extra.nonfinite) and counted in summary.json."""
    from behaviortrace_jax import pipeline
    from behaviortrace_jax.behavior import planted
    from behaviortrace_jax.io import checkpoints, rollout_log
    from conftest import copy_start

    config, start = smoke_sft
    config = config.copy_and_resolve_references()
    config.stages, config.grpo.steps = "grpo", 4
    n = config.grpo.prompts_per_step * config.grpo.group_size
    w = copy_start(start, tmp_path / "run")
    real = planted.base_reward
    monkeypatch.setattr(planted, "base_reward", NaNRewardAt(real, 3 * n + 5))
    with pytest.raises(nonfinite.NonFiniteError, match=r"grpo: step 3: 1 rollout.*grpo_000003_005 \(reward\)"
                       r".*resume from the last good checkpoint \(step 2\)"):
        pipeline.run(config, str(w))
    assert checkpoints.latest_step(w / "grpo" / "state") == 2
    assert not (w / "grpo" / "checkpoints" / "step_00000004").exists()
    crashed = tmp_path / "crashed"
    shutil.copytree(w, crashed)

    monkeypatch.setattr(planted, "base_reward", real)  # the same command, the fault gone: resumes from 2
    pipeline.run(config, str(w))
    ours = [r for r in rollout_log.read_rollouts(w / "grpo" / "rollouts")]
    theirs = [r for r in rollout_log.read_rollouts(start / "grpo" / "rollouts") if r.step < 4]
    assert [json.dumps(r.__dict__, sort_keys=True) for r in ours] == [json.dumps(r.__dict__, sort_keys=True)
                                                                     for r in theirs]

    skip = config.copy_and_resolve_references()
    skip.grpo.on_nonfinite = "skip"
    monkeypatch.setattr(planted, "base_reward", NaNRewardAt(real, 1 * n + 5))  # resumed at 2: step 3 is call 1 * n
    pipeline.run(skip, str(crashed))
    summary = json.loads((crashed / "grpo" / "summary.json").read_text())
    assert summary["complete"] and summary["nonfinite"]["skipped_rollouts"] == 1
    assert summary["nonfinite"]["steps"] == [{"step": 3, "rollouts": {"grpo_000003_005": ["reward"]}}]
    rec = {r.rollout_id: r for r in rollout_log.read_rollouts(crashed / "grpo" / "rollouts")}
    assert rec["grpo_000003_005"].extra["nonfinite"] == ["reward"] and rec["grpo_000003_005"].advantage == 0.0
    assert np.isfinite(rec["grpo_000003_005"].reward)
    assert len(rec) == 4 * n and all(np.isfinite(r.advantage) for r in rec.values())
