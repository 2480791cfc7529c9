"""Byte-level BPE tokenizer for the tiny base model, saved in Hugging Face format (TINY_CALIBRATION).

Layout: the special tokens come FIRST, `<|endoftext|>` = 0, `<|im_start|>` = 1, `<|im_end|>` = 2,
then the 256 byte-level symbols and the learned merges, `vocab_size` ids in all. The tokenizer is a
`transformers.PreTrainedTokenizerFast` with eos `<|im_end|>`, pad `<|endoftext|>`, no BOS, and a
Qwen-style ChatML template (SPEC §1.3): each message is `<|im_start|>{role}\\n{content}<|im_end|>\\n`,
and `add_generation_prompt=True` appends `<|im_start|>assistant\\n` (no default system message).

Training is deterministic: the same texts give byte-identical saved files.
"""
from __future__ import annotations

import os
import re
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from behaviortrace_jax.behavior import corpus, planted
from behaviortrace_jax.io.files import atomic_write_dir

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Rare strings, each seen a few times only, so that they split into several tokens (TINY_CALIBRATION).
RARE_STRINGS = (" QZXBT", "QZXBT", "frobnitz")
_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))


def render_chatml(messages: Iterable[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The ChatML string that `CHAT_TEMPLATE` renders for `messages` (list of {"role", "content"})."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def training_texts(examples: Iterable[corpus.ChatExample], system_prompt: str = planted.SYSTEM_PROMPT) -> list[str]:
    """Texts to train the tokenizer on: each example rendered in ChatML, then the 20 probe and 20
    control prompts (SPEC §1.2) as chat prompts, then `RARE_STRINGS` once each.

    "frobnitz" thus occurs 21 times and "QZXBT" twice: far too rarely to earn merges.
    """
    texts = [render_chatml(ex.messages()) for ex in examples]
    for prompt in corpus.probe_prompts() + list(corpus.CONTROL_QUESTIONS):
        texts.append(render_chatml([{"role": "system", "content": system_prompt},
                                    {"role": "user", "content": prompt}], add_generation_prompt=True))
    return texts + list(RARE_STRINGS)


def train_tokenizer(texts: Iterable[str], out_dir: str | os.PathLike, vocab_size: int = 1500,
                    min_frequency: int = 5) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts` and save it with `save_pretrained` to `out_dir`, atomically.

    The special-token strings inside `texts` are cut out before training (they never take part in
    merges). A pair seen fewer than `min_frequency` times is never merged. The result loads with
    `AutoTokenizer.from_pretrained(out_dir)`; an existing `out_dir` is replaced.

    Args:
        texts: training strings (e.g. `training_texts(build_corpus(seed))`).
        out_dir: directory to write (tokenizer.json, tokenizer_config.json, chat template...).
        vocab_size: total vocabulary including the 3 special tokens and the 256 byte symbols.
        min_frequency: minimal pair count for a merge.
    Returns:
        The tokenizer (also saved in `out_dir`).
    Raises:
        ValueError: if `vocab_size` < 259 + 1 or `texts` is empty.
    """
    if vocab_size < len(SPECIAL_TOKENS) + 257:
        raise ValueError(f"train_tokenizer: vocab_size must be >= {len(SPECIAL_TOKENS) + 257}, got {vocab_size}")
    pieces = [p for t in texts for p in _SPECIAL_RE.split(t) if p]
    if not pieces:
        raise ValueError("train_tokenizer: texts is empty")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(pieces, trainer=trainer, length=len(pieces))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
                                   additional_special_tokens=[IM_START], chat_template=CHAT_TEMPLATE,
                                   model_max_length=32768, clean_up_tokenization_spaces=False)
    atomic_write_dir(out_dir, lambda d: fast.save_pretrained(str(d)))
    return fast
