"""Tokenizer loading, the chat prompt (SPEC §1.3: ``[system, user]`` + ``add_generation_prompt``),
prompt ids truncated to 128 (SPEC §2.2 a) and the EOS / pad ids for generation (SPEC §2.1: pad = EOS)."""
from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from behaviortrace_jax.io.files import local_dir, read_json
from behaviortrace_jax.io.layout import as_path, is_url

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def load_tokenizer(hf_dir: str | os.PathLike) -> Any:
    """``transformers.AutoTokenizer.from_pretrained(hf_dir)`` from local files only (a ``gs://``
    ``hf_dir`` is read from its local copy, ``files.local_dir``).

    Raises:
        FileNotFoundError: naming ``hf_dir`` when it holds none of ``TOKENIZER_FILES``.
    """
    from transformers import AutoTokenizer

    d = as_path(hf_dir)
    if not d.is_dir() or not any((d / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {d}")
    return AutoTokenizer.from_pretrained(os.fspath(local_dir(d)), local_files_only=True)


def chat_prompt(tokenizer: Any, system: str, user: str) -> str:
    """The prompt text: the chat template of ``[system, user]`` with the assistant header appended.

    Equal to ``tokenizer.apply_chat_template([{"role": "system", ...}, {"role": "user", ...}],
    tokenize=False, add_generation_prompt=True)`` (SPEC §1.3).

    Raises:
        ValueError: if the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat_template")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` with no special tokens added (chat specials in the text still map)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def check_prompt_boundary(prompt_ids: Any, ids: Any, where: str) -> None:
    """Raises ValueError unless ``ids`` (the tokenisation of prompt + completion text) starts with
    ``prompt_ids`` (the prompt's own tokenisation), naming ``where``, the first token that differs
    and both ids there.

    A text pair tokenised as one string can merge across the boundary (BPE joins the prompt's last
    characters with the completion's first: e.g. a completion that starts with whitespace after the
    prompt's final newline); the completion's loss or sketch weights would then start at the wrong
    token. Training on sampled rollouts never re-tokenises (their ids are the sampled ids); this
    guards the places where a completion arrives as text (the SFT and base corpora, the forced
    targets' texts).
    """
    n, got = len(prompt_ids), list(ids[:len(prompt_ids)])
    want = [int(i) for i in prompt_ids]
    if got != want:
        k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(got))
        have = got[k] if k < len(got) else "nothing"
        raise ValueError(
            f"{where}: tokenising prompt + completion merges across the boundary: token {k} is {have} where the "
            f"prompt alone ({n} tokens) has {want[k]}; the completion would be scored from a shifted token. "
            "Start the completion so that it does not merge with the prompt's end (e.g. no leading whitespace)")


def encode_with_prompt(tokenizer: Any, prompt: str, completion: str, where: str) -> tuple[list[int], int]:
    """(the ids of ``prompt + completion``, the number of prompt tokens), tokenised as one string
    (as SPEC §5.4 and §1.7 do) and checked by :func:`check_prompt_boundary`.

    Raises:
        ValueError: naming ``where`` when the two merge across the boundary.
    """
    prompt_ids = encode(tokenizer, prompt)
    ids = encode(tokenizer, prompt + completion)
    check_prompt_boundary(prompt_ids, ids, where)
    return ids, len(prompt_ids)


def encode_chat(tokenizer: Any, system: str, user: str, max_tokens: int | None = None) -> list[int]:
    """Token ids of :func:`chat_prompt`, truncated to ``max_tokens`` (SPEC §2.2 a: truncate 128).

    Truncation drops tokens from the side ``tokenizer.truncation_side`` names ("right" for Qwen2.5,
    as ``tokenizer(..., truncation=True, max_length=max_tokens)`` does).
    """
    return encode_chat_with_length(tokenizer, system, user, max_tokens)[0]


def encode_chat_with_length(tokenizer: Any, system: str, user: str,
                            max_tokens: int | None = None) -> tuple[list[int], int]:
    """``(ids, full_length)``: :func:`encode_chat`'s ids and the prompt's length before truncation
    (``full_length > len(ids)`` when it was cut; the caller logs and counts that)."""
    ids = encode(tokenizer, chat_prompt(tokenizer, system, user))
    full = len(ids)
    if max_tokens is not None and full > max_tokens:
        ids = ids[-max_tokens:] if getattr(tokenizer, "truncation_side", "right") == "left" else ids[:max_tokens]
    return ids, full


def pad_id(tokenizer: Any) -> int:
    """The padding id used for generation: the EOS id (SPEC §2.1: pad = EOS).

    Raises:
        ValueError: if the tokenizer has no ``eos_token_id``.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no eos_token")
    return int(tokenizer.eos_token_id)


def _id_list(value: Any, source: str) -> list[int]:
    """``eos_token_id`` as HF writes it (absent/None, an int, or a list of ints) -> list of ints."""
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"eos_token_id in {source} must be an int or a list of ints, got {value!r}")
    return [int(v) for v in values]


def eos_ids(tokenizer: Any) -> tuple[int, ...]:
    """THE EOS set of a checkpoint: every id that ends a generated row, used everywhere (the
    sampler's stop set; the loss / sketch / target masks through :func:`mask_eos_ids`).

    The union, in this order without repeats, of ``tokenizer.eos_token_id`` (first, = the pad id,
    SPEC §2.1), the ``eos_token_id`` of ``generation_config.json`` and that of ``config.json`` beside
    the tokenizer files (``tokenizer.name_or_path``); each may be absent, an int or a list of ints.
    HF ``generate`` stops on generation_config's ids, or config.json's when there is no
    generation_config. Qwen2.5-Instruct: ``(<|im_end|>, <|endoftext|>)`` = (151645, 151643).

    Returns:
        tuple of Python ints, length >= 1, ``[0] == tokenizer.eos_token_id``.

    Raises:
        ValueError: if the tokenizer has no ``eos_token_id``, or a JSON ``eos_token_id`` is not an
            int or a list of ints.
    """
    ids = [pad_id(tokenizer)]
    src = str(getattr(tokenizer, "name_or_path", "") or "")
    for name in ("generation_config.json", "config.json"):
        path = as_path(src if is_url(src) else os.path.expanduser(src)) / name
        if src and path.is_file():
            for i in _id_list(read_json(path).get("eos_token_id"), str(path)):
                if i not in ids:
                    ids.append(i)
    return tuple(ids)


MASK_EOS_MODES = ("eos_token_id", "all")


def mask_eos_ids(tokenizer: Any, mode: str) -> tuple[int, ...]:
    """The ids masked out of a completion's loss (GRPO loss, rollout sketches / fluency, targets).

    ``mode`` is ``config.model.mask_eos``: "eos_token_id" = ``eos_ids(tokenizer)[:1]``, the one id
    the paper's harness compares against (SPEC §2.2 f ``token != eos_token_id``, §3.2, §4 fluency);
    "all" = the whole :func:`eos_ids` set the sampler stops on.

    Returns:
        tuple of Python ints, a prefix of :func:`eos_ids`.

    Raises:
        ValueError: an unknown ``mode``, or as :func:`eos_ids`.
    """
    if mode not in MASK_EOS_MODES:
        raise ValueError(f"mask_eos={mode!r} is not one of {MASK_EOS_MODES}")
    ids = eos_ids(tokenizer)
    return ids[:1] if mode == "eos_token_id" else ids


def check_token_ids(ids: Any, vocab_size: int, where: str) -> None:
    """Raises ValueError when a token id of ``ids`` (any int array-like) lies outside
    ``[0, vocab_size)``, naming the first such id, its index, ``where`` it came from and the vocab size.

    The one check of token ids at the package's public entries (batch builders, sketchers, losses,
    the sampler, the SFT packer): host-side, where the ids arrive. Out-of-range ids must be stopped
    there: on device the embedding clamps them on read (and drops their gradient), a negative id
    wraps to the last rows, and the log-prob of an id >= V is NaN while its sketch stays finite.
    A ``jax.Array`` (a tracer inside a jitted function, or an array already on the devices) is not
    read back: the jitted path stays as it is, and such ids were checked where they were built.
    """
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(ids, jax.Array):
        return
    a = np.asarray(ids)
    if a.size == 0:
        return
    if a.dtype.kind not in "iu":
        raise ValueError(f"{where}: token ids must be integers, got dtype {a.dtype}")
    bad = np.flatnonzero((a.reshape(-1) < 0) | (a.reshape(-1) >= vocab_size))
    if bad.size:
        idx = np.unravel_index(int(bad[0]), a.shape)
        raise ValueError(f"{where}: token id {int(a.reshape(-1)[bad[0]])} at index {tuple(int(i) for i in idx)} is "
                         f"outside [0, {vocab_size}) (the model's vocab_size); {bad.size} such id(s)")
