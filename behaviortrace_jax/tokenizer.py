"""Tokenizer loading, the chat prompt (SPEC §1.3: ``[system, user]`` + ``add_generation_prompt``),
prompt ids truncated to 128 (SPEC §2.2 a) and the EOS / pad ids for generation (SPEC §2.1: pad = EOS)."""
from __future__ import annotations

import os
import pathlib
from typing import Any

from behaviortrace_jax.files import read_json

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def load_tokenizer(hf_dir: str | os.PathLike) -> Any:
    """``transformers.AutoTokenizer.from_pretrained(hf_dir)`` from local files only.

    Raises:
        FileNotFoundError: naming ``hf_dir`` when it holds none of ``TOKENIZER_FILES``.
    """
    from transformers import AutoTokenizer

    d = pathlib.Path(hf_dir)
    if not d.is_dir() or not any((d / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {d}")
    return AutoTokenizer.from_pretrained(str(d), local_files_only=True)


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


def encode_chat(tokenizer: Any, system: str, user: str, max_tokens: int | None = None) -> list[int]:
    """Token ids of :func:`chat_prompt`, truncated to ``max_tokens`` (SPEC §2.2 a: truncate 128).

    Truncation drops tokens from the side ``tokenizer.truncation_side`` names ("right" for Qwen2.5,
    as ``tokenizer(..., truncation=True, max_length=max_tokens)`` does).
    """
    ids = encode(tokenizer, chat_prompt(tokenizer, system, user))
    if max_tokens is not None and len(ids) > max_tokens:
        ids = ids[-max_tokens:] if getattr(tokenizer, "truncation_side", "right") == "left" else ids[:max_tokens]
    return ids


def pad_id(tokenizer: Any) -> int:
    """The padding id used for generation: the EOS id (SPEC §2.1: pad = EOS).

    Raises:
        ValueError: if the tokenizer has no ``eos_token_id``.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no eos_token")
    return int(tokenizer.eos_token_id)


def eos_ids(tokenizer: Any) -> tuple[int, ...]:
    """Ids that end a generated row: ``tokenizer.eos_token_id`` first, then any further
    ``eos_token_id`` of ``generation_config.json`` beside the tokenizer files (as HF ``generate``
    stops on; Qwen2.5-Instruct: ``(<|im_end|>, <|endoftext|>)`` = (151645, 151643)).

    Raises:
        ValueError: if the tokenizer has no ``eos_token_id``.
    """
    ids = [pad_id(tokenizer)]
    src = str(getattr(tokenizer, "name_or_path", "") or "")
    gen = pathlib.Path(src) / "generation_config.json"
    if src and gen.is_file():
        extra = read_json(gen).get("eos_token_id")
        for i in ([] if extra is None else [extra] if isinstance(extra, int) else extra):
            if int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)
