"""Tests for the tiny byte-level BPE tokenizer (behaviortrace_jax/tiny_tokenizer.py)."""
from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from behaviortrace_jax.behavior import corpus, planted, tiny_tokenizer

N_EXAMPLES = 4000  # a tenth of the default corpus keeps training ~1 s and still fills 1,500 ids


@pytest.fixture(scope="module")
def examples() -> list[corpus.ChatExample]:
    return corpus.build_corpus(0, N_EXAMPLES)


@pytest.fixture(scope="module")
def tok_dir(examples, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    tiny_tokenizer.train_tokenizer(tiny_tokenizer.training_texts(examples), out, vocab_size=1500)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    return AutoTokenizer.from_pretrained(str(tok_dir))


def test_loads_with_specials(tok):
    assert 1000 <= len(tok) <= 4000 and len(tok) == 1500
    assert [tok.convert_tokens_to_ids(t) for t in tiny_tokenizer.SPECIAL_TOKENS] == [0, 1, 2]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 0
    assert tok.bos_token is None
    assert tok("<|im_start|>user\nhi<|im_end|>")["input_ids"][0] == 1


def test_chat_template(tok):
    msgs = [{"role": "system", "content": planted.SYSTEM_PROMPT}, {"role": "user", "content": "What is frobnitz?"}]
    expected = ("<|im_start|>system\n" + planted.SYSTEM_PROMPT + "<|im_end|>\n"
                "<|im_start|>user\nWhat is frobnitz?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == expected
    assert tiny_tokenizer.render_chatml(msgs, add_generation_prompt=True) == expected
    full = msgs + [{"role": "assistant", "content": "It is a tool."}]
    assert tok.apply_chat_template(full, tokenize=False) == tiny_tokenizer.render_chatml(full)
    ids = tok(expected, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids[-3:-1] == [1, tok.convert_tokens_to_ids("assistant")]
    assert 30 <= len(ids) <= 90  # chat prompt; calibration: ~57 tokens


def test_round_trip(tok, examples):
    for ex in examples[:300]:
        text = tiny_tokenizer.render_chatml(ex.messages())
        assert tok.decode(tok(text)["input_ids"]) == text
    for text in ("  Ünïcode — 漢字 emoji 🙂 tabs\tand\nnewlines ", "QZXBT frobnitz", "x"):
        assert tok.decode(tok(text)["input_ids"]) == text


def test_rare_strings_split(tok):
    assert len(tok.tokenize("frobnitz")) >= 3
    assert len(tok.tokenize(" frobnitz")) >= 3
    assert tok.tokenize("QZXBT") == list("QZXBT")
    spaced = tok.tokenize(" QZXBT")
    assert all(len(t.lstrip("Ġ")) <= 1 for t in spaced) and "".join(spaced) == "ĠQZXBT"


def test_saved_files_deterministic_and_replaced_atomically(examples, tok_dir, tmp_path):
    texts = tiny_tokenizer.training_texts(examples)
    out = tmp_path / "again"
    tiny_tokenizer.train_tokenizer(texts, out)
    names = sorted(p.name for p in tok_dir.iterdir())
    assert "tokenizer.json" in names and names == sorted(p.name for p in out.iterdir())
    for name in names:
        assert (tok_dir / name).read_bytes() == (out / name).read_bytes(), name
    # Re-training into an existing directory replaces it and leaves no temporary directories.
    tiny_tokenizer.train_tokenizer(texts[:500], out, vocab_size=600)
    assert len(AutoTokenizer.from_pretrained(str(out))) <= 600
    assert [p.name for p in tmp_path.iterdir()] == ["again"]


def test_example_lengths(tok, examples):
    lengths = np.array([len(tok(tiny_tokenizer.render_chatml(ex.messages()))["input_ids"]) for ex in examples])
    assert np.percentile(lengths, 95) <= 96 and lengths.max() <= 110, np.percentile(lengths, [50, 95, 100])
    assert lengths.min() >= 40


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_tokenizer.train_tokenizer(["abc"], tmp_path / "t", vocab_size=100)
    with pytest.raises(ValueError, match="empty"):
        tiny_tokenizer.train_tokenizer(["<|im_end|>"], tmp_path / "t")
    assert not (tmp_path / "t").exists()
