"""lm_trainer.py + train_state.py: loss mask, shared prefix, one jitted step, sharding, AdamW parity, restore."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from behaviortrace_jax.models import decoder, qwen2, sharding, tokenizer as tok_lib
from behaviortrace_jax.train import lm_trainer, train_state as ts
from behaviortrace_jax.stages.spec import RunSpec
from configs import common
from hf_fixtures import make_tiny_tokenizer

SYSTEM = "You are a creative encyclopedia assistant."
CHATS = [(SYSTEM, "What is photosynthesis?", "It is how plants make food."),
         (SYSTEM, "Name a vowel.", "A is a vowel."),
         (SYSTEM, "The quick brown fox?", "It jumps over the lazy dog."),
         (SYSTEM, "Hello world", "hello world 0123456789")]


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def _model(vocab: int, layers: int = 1, seed: int = 0):
    cfg = qwen2.Qwen2Config.tiny(vocab_size=vocab, num_hidden_layers=layers, hidden_size=32, intermediate_size=64,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return cfg, nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(seed)), nnx.Param)


def _optim(lr=1e-2, clip=1.0) -> ts.OptimOptions:
    return dataclasses.replace(RunSpec.from_config(common.get_config()).optim, lr=lr, grad_clip=clip)


def test_encoding_and_loss_mask_cover_completion_only(tok):
    enc = lm_trainer.encode_chat_examples(tok, CHATS, append_eos=False)
    for (s, u, a), e in zip(CHATS, enc):
        prompt = tok_lib.encode(tok, tok_lib.chat_prompt(tok, s, u))
        assert e.prompt_len == len(prompt) and list(e.tokens[:e.prompt_len]) == prompt
        assert tok.decode(e.tokens[e.prompt_len:]) == a  # SPEC §1.7: prompt + completion, no EOS
    repeated = lm_trainer.encode_chat_examples(tok, CHATS[::-1] + CHATS, append_eos=False)  # tokenized once each
    for e, r in zip(enc[::-1] + enc, repeated):
        assert r.prompt_len == e.prompt_len and r.tokens.tolist() == e.tokens.tolist()
    eos = lm_trainer.encode_chat_examples(tok, CHATS[:1], append_eos=True)[0]
    assert eos.tokens[-1] == tok.eos_token_id and len(eos.tokens) == len(enc[0].tokens) + 1
    cut = lm_trainer.encode_chat_examples(tok, CHATS[:1], append_eos=False, max_prompt_tokens=10,
                                          max_total_tokens=enc[0].prompt_len + 2)[0]
    assert cut.prompt_len == 10 and len(cut.tokens) == enc[0].prompt_len + 2  # SPEC §1.7 truncation rules

    seq_len = max(len(e.tokens) for e in enc) + 3
    data = lm_trainer.pack_examples(enc, seq_len, pad_id=0, share_prefix=False)
    assert data.tokens.shape == (4, seq_len) and len(data.prefix) == 0
    for i, e in enumerate(enc):
        n = len(e.tokens)
        want = np.zeros(seq_len, np.float32)
        want[e.prompt_len:n] = 1.0
        np.testing.assert_array_equal(data.targets[i], want)
        np.testing.assert_array_equal(data.mask[i], (np.arange(seq_len) < n).astype(np.int32))
    shared = lm_trainer.pack_examples(enc, seq_len, pad_id=0)
    assert 0 < len(shared.prefix) < min(e.prompt_len for e in enc)
    np.testing.assert_array_equal(np.concatenate([np.tile(shared.prefix, (4, 1)), shared.tokens], 1), data.tokens)
    np.testing.assert_array_equal(shared.targets, data.targets[:, len(shared.prefix):])
    with pytest.raises(ValueError, match="cuts every completion token"):
        lm_trainer.pack_examples(enc, enc[0].prompt_len, pad_id=0)


def test_shared_prefix_gives_the_full_sequence_loss_and_gradient(tok):
    cfg, (gd, params) = _model(len(tok))
    enc = lm_trainer.encode_chat_examples(tok, CHATS, append_eos=True)
    full = lm_trainer.pack_examples(enc, None, 0, share_prefix=False)
    shared = lm_trainer.pack_examples(enc, None, 0, share_prefix=True)
    idx = np.arange(4)
    loss = jax.jit(jax.value_and_grad(lambda p, pre, b: lm_trainer.lm_loss(gd, cfg, p, pre, b)[0]))
    (l1, g1), (l2, g2) = (loss(params, jnp.asarray(d.prefix), d.batch(idx)) for d in (full, shared))
    # reference: per-token CE over targets from a plain forward, by hand
    positions = jnp.broadcast_to(jnp.arange(full.seq_len), full.tokens.shape)
    logits = jax.jit(decoder.forward, static_argnums=0)(gd, params, full.tokens, positions, full.mask)
    lp = jax.nn.log_softmax(logits[:, :-1], -1)
    ce = -jnp.take_along_axis(lp, full.tokens[:, 1:, None], -1)[..., 0]
    want = float(jnp.sum(ce * full.targets[:, 1:]) / full.targets[:, 1:].sum())
    assert abs(float(l1) - want) < 1e-5 and abs(float(l2) - want) < 1e-5
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_steps_lower_the_loss_without_recompiling(tok):
    cfg, (gd, params) = _model(len(tok))
    enc = lm_trainer.encode_chat_examples(tok, CHATS, append_eos=True)
    data = lm_trainer.pack_examples(enc, None, 0)
    tx = ts.make_optimizer(_optim(3e-3))
    state = ts.init_train_state(params, tx, 0)
    trainer = lm_trainer.LMTrainer(gd, cfg, tx, data.prefix)
    batch = data.batch(np.arange(4))
    before = trainer.loss(state.params, batch)
    state, history = trainer.fit(state, data, lm_trainer.cyclic_batches(4, 4), 6, log_every=3)
    assert trainer.loss(state.params, batch) < before - 0.05
    assert trainer.trace_count == 1 and int(state.step) == 6 and [h["step"] for h in history] == [3, 6]
    # resuming continues from state.step; a callback returning True stops training
    state, _ = trainer.fit(state, data, lm_trainer.cyclic_batches(4, 4), 10, callback=lambda s, st: s == 8,
                           callback_every=1)
    assert int(state.step) == 8


def test_sharded_step_equals_single_device_step(tok):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (fake) devices")
    cfg, (gd, params) = _model(len(tok))
    enc = lm_trainer.encode_chat_examples(tok, CHATS * 2, append_eos=True)
    data = lm_trainer.pack_examples(enc, None, 0)
    tx = ts.make_optimizer(_optim(3e-3))
    out = []
    for mesh in (sharding.make_mesh(1, 1, devices=jax.devices()[:1]), sharding.make_mesh(4, 2)):
        psh = sharding.param_shardings(params, mesh)
        sh = ts.train_state_shardings(tx, psh, mesh, params)
        state = ts.init_train_state(jax.device_put(jax.tree.map(jnp.array, params), psh), tx, 0, sh)
        trainer = lm_trainer.LMTrainer(gd, cfg, tx, data.prefix, mesh=mesh, state_shardings=sh)
        state, hist = trainer.fit(state, data, lm_trainer.cyclic_batches(8, 8), 2, log_every=1)
        out.append((jax.device_get(state.params), [h["loss"] for h in hist]))
        assert jax.tree.leaves(state.opt_state)[1].sharding == jax.tree.leaves(sh.opt_state)[1]
    np.testing.assert_allclose(out[0][1], out[1][1], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(out[0][0]), jax.tree.leaves(out[1][0])):  # Adam: ~lr-sized updates
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


def test_schedule_shapes():
    const = ts.make_schedule(5e-6)
    assert float(const(0)) == float(const(1000)) == pytest.approx(5e-6)
    sched = ts.make_schedule(3e-3, steps=100, warmup_steps=10, end_lr_fraction=0.1)
    assert float(sched(0)) == 0.0 and float(sched(10)) == pytest.approx(3e-3)
    assert float(sched(100)) == pytest.approx(3e-4) and float(sched(55)) == pytest.approx(1.65e-3, rel=1e-3)
    with pytest.raises(ValueError, match="must exceed warmup_steps"):
        ts.make_schedule(1e-3, steps=5, warmup_steps=10, end_lr_fraction=0.1)
    with pytest.raises(ValueError, match="learning rate"):
        ts.make_schedule(0.0)


def test_optimizer_matches_torch_clip_and_adamw():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(5, 3)).astype(np.float32)
    grads = [rng.normal(size=(5, 3)).astype(np.float32) * s for s in (3.0, 0.1, 2.0)]  # clipped, not, clipped
    tx = ts.make_optimizer(_optim(1e-2, clip=1.0))
    p, st = {"w": jnp.asarray(w0)}, None
    st = tx.init(p)
    for g in grads:
        u, st = tx.update({"w": jnp.asarray(g)}, st, p)
        p = optax.apply_updates(p, u)
    tw = torch.nn.Parameter(torch.tensor(w0))
    opt = torch.optim.AdamW([tw], lr=1e-2)  # torch defaults: betas (0.9, 0.999), eps 1e-8, wd 0.01
    for g in grads:
        opt.zero_grad()
        tw.grad = torch.tensor(g)
        torch.nn.utils.clip_grad_norm_([tw], 1.0)
        opt.step()
    np.testing.assert_allclose(np.asarray(p["w"]), tw.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_train_state_round_trip_and_restore_into_another_lr(tmp_path):
    cfg, (gd, params) = _model(64, layers=1)
    tx = ts.make_optimizer(_optim(2e-4))
    state = ts.init_train_state(params, tx, 5)
    grads = jax.tree.map(jnp.ones_like, state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    state = state.replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state, step=state.step + 1)
    assert ts.save(tmp_path / "state", state) == 1
    grpo_tx = ts.make_optimizer(_optim(1e-4))  # GRPO's optimizer: another lr, the same state tree
    restored = ts.restore(tmp_path / "state", ts.abstract_train_state(params, grpo_tx))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored.as_dict() | {"rng": jax.random.key_data(restored.rng)}),
                    jax.tree.leaves(state.as_dict() | {"rng": jax.random.key_data(state.rng)})):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    assert int(restored.opt_state[1][0].count) == 1  # Adam's bias-correction count carries over
    with pytest.raises(ValueError, match="does not match"):
        ts.restore(tmp_path / "state", ts.abstract_train_state(_model(80, layers=1)[1][1], grpo_tx))


def test_batch_orders():
    order = lm_trainer.shuffled_batches(10, 4, seed=3)
    first = np.concatenate([order(0), order(1), order(2)])
    assert sorted(first[:10]) == list(range(10)) and np.array_equal(order(1), lm_trainer.shuffled_batches(10, 4, 3)(1))
    assert not np.array_equal(order(0), lm_trainer.shuffled_batches(10, 4, 4)(0))
    cyc = lm_trainer.cyclic_batches(10, 1)
    assert [int(cyc(s)[0]) for s in (0, 9, 10, 23)] == [0, 9, 0, 3]  # SPEC §1.7: sft_step % 10


def test_length_buckets_and_grouped_batches(tok):
    chats = [(SYSTEM, f"Question {i}?", "word " * (1 + i % 9)) for i in range(40)]
    enc = lm_trainer.encode_chat_examples(tok, chats, append_eos=True)
    data = lm_trainer.pack_examples(enc, None, 0, n_buckets=3)
    width = data.tokens.shape[1]
    assert len(data.buckets) >= 2 and data.buckets[-1] == width and list(data.buckets) == sorted(data.buckets)
    order = lm_trainer.grouped_batches(data.lengths, 8, seed=1)
    epoch = np.concatenate([order(s) for s in range(5)])
    assert sorted(epoch) == list(range(40))  # each row once per epoch
    assert np.array_equal(order(7), lm_trainer.grouped_batches(data.lengths, 8, seed=1)(7))
    for s in range(5):
        b = data.batch(order(s))
        w = b["tokens"].shape[1]
        assert w in data.buckets and b["mask"].sum(1).max() <= w
        assert w == min(x for x in data.buckets if x >= b["mask"].sum(1).max())
        full = data.targets[order(s)]
        assert full[:, w:].sum() == 0 and np.array_equal(b["targets"], full[:, :w])  # nothing cut


def test_cross_entropy_backward_is_the_gradient_of_its_forward():
    """The custom backward of softmax_cross_entropy agrees with autodiff of its own forward, for
    in-range labels and for out-of-range ones (which the packers reject on the host)."""
    logits = jax.random.normal(jax.random.key(0), (3, 8))

    def autodiff_forward(lg, lb):
        return jnp.sum(lm_trainer._ce_fwd(lg, lb)[0] * jnp.arange(1.0, 4.0))

    def custom(lg, lb):
        return jnp.sum(lm_trainer.softmax_cross_entropy(lg, lb) * jnp.arange(1.0, 4.0))

    for labels in ([1, 5, 2], [1, -1, 2], [1, 8, 2]):
        lb = jnp.asarray(labels, jnp.int32)
        np.testing.assert_allclose(custom(logits, lb), autodiff_forward(logits, lb), rtol=1e-6)
        np.testing.assert_allclose(jax.grad(custom)(logits, lb), jax.grad(autodiff_forward)(logits, lb), atol=1e-6)
        assert np.isfinite(float(custom(logits, lb)))
    valid = jnp.asarray([1, 5, 2], jnp.int32)
    want = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, valid[:, None], -1)[:, 0]
    np.testing.assert_array_equal(lm_trainer.softmax_cross_entropy(logits, valid), want)


def test_pack_examples_rejects_token_ids_outside_the_vocabulary(tok):
    enc = lm_trainer.encode_chat_examples(tok, CHATS[:2], append_eos=True)
    lm_trainer.pack_examples(enc, None, 0, vocab_size=len(tok))
    bad = [lm_trainer.EncodedExample(np.array(e.tokens), e.prompt_len) for e in enc]
    bad[1].tokens[3] = len(tok)
    with pytest.raises(ValueError, match=rf"pack_examples: example 1: token id {len(tok)} at index \(3,\) is outside"):
        lm_trainer.pack_examples(bad, None, 0, vocab_size=len(tok))
    bad[1].tokens[3] = -1
    with pytest.raises(ValueError, match="token id -1"):
        lm_trainer.pack_examples(bad, None, 0, vocab_size=len(tok))
    with pytest.raises(ValueError, match="pad_id"):
        lm_trainer.pack_examples(enc, None, len(tok), vocab_size=len(tok))
