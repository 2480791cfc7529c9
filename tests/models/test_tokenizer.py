"""tokenizer.eos_ids / mask_eos_ids: one EOS set from the tokenizer, generation_config.json and
config.json, and the GRPO loss mask (grpo.build_batch) equal to the targets' mask (SPEC §2.2 f)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from behaviortrace_jax.models import tokenizer as tok_lib
from behaviortrace_jax.sketch import targets
from behaviortrace_jax.train import grpo_step as grpo
from configs import common
from hf_fixtures import make_tiny_tokenizer

EOT, IM_START, IM_END = 0, 1, 2  # hf_fixtures.SPECIAL_TOKENS; the tokenizer's eos is <|im_end|>


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    make_tiny_tokenizer().save_pretrained(d)
    return d


def _hf_dir(tmp_path, tok_dir, config=None, generation=None):
    import shutil

    d = tmp_path / "hf"
    shutil.copytree(tok_dir, d)
    for name, obj in (("config.json", config), ("generation_config.json", generation)):
        if obj is not None:
            (d / name).write_text(json.dumps(obj))
    return tok_lib.load_tokenizer(d)


def test_eos_ids_tokenizer_only(tmp_path, tok_dir):
    tok = _hf_dir(tmp_path, tok_dir)
    assert tok.eos_token_id == IM_END and tok_lib.eos_ids(tok) == (IM_END,)


@pytest.mark.parametrize("eos", [EOT, [EOT], [IM_END, EOT]])
def test_eos_ids_from_config_json_only(tmp_path, tok_dir, eos):
    tok = _hf_dir(tmp_path, tok_dir, config={"model_type": "qwen2", "eos_token_id": eos})
    assert tok_lib.eos_ids(tok) == (IM_END, EOT)


@pytest.mark.parametrize("eos", [EOT, [EOT, IM_END]])
def test_eos_ids_from_generation_config_only(tmp_path, tok_dir, eos):
    tok = _hf_dir(tmp_path, tok_dir, generation={"eos_token_id": eos})
    assert tok_lib.eos_ids(tok) == (IM_END, EOT)


def test_eos_ids_union_in_order(tmp_path, tok_dir):
    tok = _hf_dir(tmp_path, tok_dir, config={"eos_token_id": [IM_START, IM_END]},
                  generation={"eos_token_id": [IM_END, EOT]})
    assert tok_lib.eos_ids(tok) == (IM_END, EOT, IM_START)  # tokenizer, generation_config, config.json
    tok = _hf_dir(tmp_path / "b", tok_dir, config={"eos_token_id": None}, generation={"pad_token_id": EOT})
    assert tok_lib.eos_ids(tok) == (IM_END,)


@pytest.mark.parametrize("bad", ["2", [2, "0"], 2.0, True])
def test_eos_ids_reject_malformed_json_ids(tmp_path, tok_dir, bad):
    tok = _hf_dir(tmp_path, tok_dir, config={"eos_token_id": bad})
    with pytest.raises(ValueError, match="config.json"):
        tok_lib.eos_ids(tok)


def test_mask_eos_ids_modes_and_paper_default(tmp_path, tok_dir):
    tok = _hf_dir(tmp_path, tok_dir, generation={"eos_token_id": [IM_END, EOT]})
    assert tok_lib.mask_eos_ids(tok, "eos_token_id") == (IM_END,)
    assert tok_lib.mask_eos_ids(tok, "all") == tok_lib.eos_ids(tok) == (IM_END, EOT)
    assert common.get_config().model.mask_eos == "eos_token_id"  # SPEC §2.2 f: token != eos_token_id
    with pytest.raises(ValueError, match="mask_eos"):
        tok_lib.mask_eos_ids(tok, "first")


@pytest.mark.parametrize("mode", ["eos_token_id", "all"])
def test_build_batch_masks_non_primary_eos_like_targets(tmp_path, tok_dir, mode):
    """A rollout that stops on <|endoftext|> (not the tokenizer's eos) is masked identically in the
    GRPO loss and in its sketch target / rollout sketch, whichever mask mode is configured."""
    tok = _hf_dir(tmp_path, tok_dir, generation={"eos_token_id": [IM_END, EOT]})
    stop, mask_ids = tok_lib.eos_ids(tok), tok_lib.mask_eos_ids(tok, mode)
    assert EOT in stop  # the sampler stops on it
    shapes = grpo.StepShapes(num_prompts=1, group_size=3, prompt_len=6, completion_len=6)
    pad = tok_lib.pad_id(tok)
    prompts = [[IM_START, 40, 41], [IM_START, 42], [IM_START, 43, 44, 45]]
    comps = np.array([[50, 51, EOT, pad, pad, pad],  # ends on the non-primary EOS, then pad
                      [52, IM_END, pad, pad, pad, pad],  # ends on the tokenizer's EOS
                      [53, 54, 55, 56, 57, 58]], np.int32)  # no EOS within max_new_tokens
    lengths = np.array([3, 2, 6], np.int32)
    batch = grpo.build_batch(prompts, comps, lengths, np.zeros(3, np.float32), mask_ids, shapes, pad,
                             vocab_size=len(tok))
    for i in range(3):
        whole, _, _ = targets.response_examples(prompts[i], comps[i], lengths[i], mask_ids, frozenset())
        want = np.zeros(shapes.completion_len, np.float32)
        want[:lengths[i]] = whole.weights[len(prompts[i]):]
        np.testing.assert_array_equal(batch["loss_mask"][i], want)
    assert batch["loss_mask"][0, 2] == (0.0 if mode == "all" else 1.0)  # the <|endoftext|> itself
    assert batch["loss_mask"][1, 1] == 0.0 and batch["loss_mask"][2].sum() == 6
