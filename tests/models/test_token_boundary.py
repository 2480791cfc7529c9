"""Token boundaries (issue 32, item 4): training ids are the sampled ids, never a re-tokenisation;
where a completion arrives as text and is tokenised with its prompt as one string (the SFT and
base corpora, the forced targets), the ids must start with the prompt's own ids, else a ValueError
names the example and the token where they merged. Under the tiny byte-level BPE, "The cat" +
"s are" merges across the boundary ("cats" is one token); the chat prompts end in a newline, which
this BPE never merges, so the default run's texts pass unchanged."""
from __future__ import annotations

import numpy as np
import pytest

from behaviortrace_jax.behavior import corpus, tiny_tokenizer
from behaviortrace_jax.models import tokenizer as tok_lib
from behaviortrace_jax.sketch import targets
from behaviortrace_jax.train import grpo_step, lm_trainer

PREFILL = "The cat"  # a generation prompt that pre-fills the answer's first words
MERGING = "s are asleep."  # "cat" + "s" -> "cats": merges across the boundary
SAFE = " are asleep."


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    tiny_tokenizer.train_tokenizer(tiny_tokenizer.training_texts(corpus.build_corpus(0, 4000)), out, vocab_size=1500)
    return tok_lib.load_tokenizer(out)


@pytest.fixture
def prefilled(tok):
    """The tiny tokenizer with a chat template whose generation prompt ends in ``PREFILL``."""
    old = tok.chat_template
    tok.chat_template = old.replace("'<|im_start|>assistant\\n'", f"'<|im_start|>assistant\\n{PREFILL}'")
    assert tok_lib.chat_prompt(tok, "s", "u").endswith(PREFILL)
    yield tok
    tok.chat_template = old


def test_the_string_merges_under_the_tiny_bpe(tok):
    alone, joint = tok_lib.encode(tok, PREFILL), tok_lib.encode(tok, PREFILL + MERGING)
    assert joint[:len(alone)] != alone  # the premise of the tests below
    with pytest.raises(ValueError, match=rf"here: .*merges across the boundary: token {len(alone) - 1} "):
        tok_lib.check_prompt_boundary(alone, joint, "here")
    safe = tok_lib.encode(tok, PREFILL + SAFE)
    tok_lib.check_prompt_boundary(alone, safe, "here")  # no merge: no error


def test_sft_examples_refuse_a_merging_answer(prefilled):
    ok = lm_trainer.encode_chat_examples(prefilled, [("sys", "Where is the cat?", SAFE)], append_eos=False)
    prompt = tok_lib.encode(prefilled, tok_lib.chat_prompt(prefilled, "sys", "Where is the cat?"))
    assert ok[0].prompt_len == len(prompt) and list(ok[0].tokens[:len(prompt)]) == prompt
    with pytest.raises(ValueError, match="encode_chat_examples: example 1: .*merges across the boundary"):
        lm_trainer.encode_chat_examples(prefilled, [("sys", "Where?", SAFE), ("sys", "Where?", MERGING)],
                                        append_eos=True)


def test_forced_completions_refuse_a_merging_text(prefilled):
    ex = targets.forced_completion_example(prefilled, "Where is the cat?", SAFE, system="sys")
    n_p = len(tok_lib.encode(prefilled, tok_lib.chat_prompt(prefilled, "sys", "Where is the cat?")))
    assert ex.weights[:n_p].sum() == 0 and ex.weights[n_p:].all()
    with pytest.raises(ValueError, match="forced completion 's are asleep.'.*merges across the boundary"):
        targets.forced_completion_example(prefilled, "Where is the cat?", MERGING, system="sys")


def test_standard_chat_prompts_never_merge(tok):
    """The chat prompt ends in a newline, which the tiny BPE keeps a token of its own, so no text
    (leading whitespace included) merges with it: the corpora and targets pass as before."""
    for text in (MERGING, SAFE, "\n\nHi", "  two spaces", "\tTab"):
        lm_trainer.encode_chat_examples(tok, [("sys", "Hi", text)], append_eos=False)
        targets.forced_completion_example(tok, "Hi", text, system="sys")
    targets.continuation_example(tok, "Hi", system="sys")


def test_grpo_batches_hold_the_sampled_ids(tok):
    """The GRPO batch is the sampled ids, whatever the text would re-tokenise to: here the model
    "sampled" the byte tokens of "cats" one by one, which tokenising the decoded text would merge."""
    prompt = tok_lib.encode_chat(tok, "sys", "Hi")
    sampled = [tok.convert_tokens_to_ids(c) for c in ("c", "a", "t", "s")]
    assert tok_lib.encode(tok, tok.decode(sampled)) != sampled  # a re-tokenisation would differ
    shapes = grpo_step.StepShapes(num_prompts=1, group_size=1, prompt_len=len(prompt), completion_len=4)
    batch = grpo_step.build_batch([prompt], np.asarray([sampled], np.int32), np.array([4], np.int32),
                                  np.zeros(1, np.float32), (2,), shapes, 0, vocab_size=len(tok))
    assert batch["input_ids"][0].tolist() == prompt + sampled
