"""Token ids checked at every public entry that takes them (issue 32, item 5): an id >= vocab_size
or < 0 is a ValueError naming the id, where it is and the vocab size (``tokenizer.check_token_ids``,
host-side where the ids arrive), at the GRPO batch builder, both per-example sketcher paths (fused
and ``vmap(grad)``), the completion loss, the forced sketcher, the sampler and the LM trainer.
Before, the embedding clamped (>= V) or wrapped (< 0) them on device without a word."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from behaviortrace_jax.models import decoder, qwen2, sampler, tokenizer as tok_lib
from behaviortrace_jax.sketch import sketcher, targets
from behaviortrace_jax.train import grpo_step, lm_trainer

V = 97
BAD = (V, V + 40, -1, -7)  # >= vocab and < 0


@pytest.fixture(scope="module")
def model():
    cfg = qwen2.Qwen2Config.tiny(vocab_size=V, num_hidden_layers=1)
    graphdef, params = nnx.split(decoder.init_model(cfg, seed=0), nnx.Param)
    return cfg, graphdef, params


def _message(bad: int, where: str, index: tuple) -> str:
    return rf"{where}.*token id {bad} at index {re.escape(str(index))} is outside \[0, {V}\)"


def _batch(bad: int | None = None, at=(1, 5)) -> dict:
    ids = np.arange(12, dtype=np.int32).reshape(2, 6) + 3
    if bad is not None:
        ids[at] = bad
    return {"input_ids": ids, "attention_mask": np.ones((2, 6), np.int32),
            "loss_mask": np.array([[0, 0, 0, 1, 1, 1]] * 2, np.float32)}


@pytest.mark.parametrize("bad", BAD)
def test_build_batch(bad):
    shapes = grpo_step.StepShapes(num_prompts=1, group_size=2, prompt_len=4, completion_len=3)
    prompts, comps = [[3, 4], [5, 6, 7]], np.array([[8, 9, 2], [10, 2, 0]], np.int32)
    args = (np.array([3, 2], np.int32), np.zeros(2, np.float32), (2,), shapes, 0)
    grpo_step.build_batch(prompts, comps, *args, vocab_size=V)  # in range: fine
    with pytest.raises(ValueError, match=_message(bad, "prompt_ids of rollout 1", (2,))):
        grpo_step.build_batch([[3, 4], [5, 6, bad]], comps, *args, vocab_size=V)
    c = comps.copy()
    c[0, 1] = bad
    with pytest.raises(ValueError, match=_message(bad, "completions", (0, 1))):
        grpo_step.build_batch(prompts, c, *args, vocab_size=V)


@pytest.mark.parametrize("fused", (True, False))
@pytest.mark.parametrize("bad", (V, -1))
def test_per_example_sketcher(model, fused, bad):
    cfg, graphdef, params = model
    sk = sketcher.PerExampleSketcher(sketcher.completion_loss(graphdef), params, dim=64, chunk_size=2,
                                     param_order=sketcher.hf_param_order(cfg), fused=fused)
    assert sk.fused is fused and sk.vocab_size == V
    with pytest.raises(ValueError, match=_message(bad, "PerExampleSketcher", (1, 5))):
        sk(params, _batch(bad))


@pytest.mark.parametrize("bad", BAD)
def test_completion_loss(model, bad):
    _, graphdef, params = model
    loss = sketcher.completion_loss(graphdef)
    assert np.isfinite(float(loss(params, {k: v[0] for k, v in _batch().items()})))
    with pytest.raises(ValueError, match=_message(bad, "DecoderLoss", (5,))):
        loss(params, {k: v[1] for k, v in _batch(bad).items()})
    with pytest.raises(ValueError, match=_message(bad, "completion_loss", (1, 5))):
        loss.per_example(params, _batch(bad))
    # the jitted path is unchanged: traced ids are not read back (the check is host-side)
    out = jax.jit(lambda p, b: loss.per_example(p, b))(params, jax.tree.map(jnp.asarray, _batch()))
    assert out.shape == (2,)


@pytest.mark.parametrize("bad", (V, -3))
def test_forced_sketcher(model, bad):
    cfg, graphdef, params = model
    forced = targets.ForcedSketcher(graphdef, cfg, params, dim=64, seed=0, block_size=2)
    ex = targets.ForcedExample(np.array([3, 4, bad, 5]), np.array([0, 1, 1, 1], np.float32))
    with pytest.raises(ValueError, match=_message(bad, "ForcedSketcher.pack: example 0", (2,))):
        forced(params, [ex])


@pytest.mark.parametrize("bad", (V, -1))
def test_sampler(model, bad):
    cfg, graphdef, _ = model
    s = sampler.Sampler(graphdef, cfg, max_prompt_tokens=8, max_new_tokens=2, eos_ids=2, pad_id=0)
    with pytest.raises(ValueError, match=_message(bad, "Sampler: prompt 1", (1,))):
        s.pad_prompts([[3, 4], [5, bad]])


@pytest.mark.parametrize("bad", (V, -2))
def test_lm_trainer(model, bad):
    cfg, graphdef, _ = model
    with pytest.raises(ValueError, match=_message(bad, "LMTrainer: prefix", (1,))):
        lm_trainer.LMTrainer(graphdef, cfg, optax.sgd(0.1), np.array([3, bad], np.int32))
    trainer = lm_trainer.LMTrainer(graphdef, cfg, optax.sgd(0.1), np.array([3], np.int32))
    tokens = np.full((2, 4), 5, np.int32)
    tokens[1, 2] = bad
    batch = {"tokens": tokens, "mask": np.ones((2, 4), np.int32), "targets": np.ones((2, 4), np.float32)}
    with pytest.raises(ValueError, match=_message(bad, "LMTrainer: batch tokens", (1, 2))):
        trainer.put_batch(batch)


def test_the_helper_names_the_count_and_refuses_floats():
    with pytest.raises(ValueError, match=r"token id 100 at index \(0, 1\).*\[0, 97\).*2 such id"):
        tok_lib.check_token_ids(np.array([[1, 100, -1]]), V, "here")
    with pytest.raises(ValueError, match="integers"):
        tok_lib.check_token_ids(np.array([1.5]), V, "here")
    tok_lib.check_token_ids(jnp.array([V + 1]), V, "device arrays are not read back")
