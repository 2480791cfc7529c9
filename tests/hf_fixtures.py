"""Tiny random Hugging Face Qwen2 checkpoints (torch, fp32, GQA, q/k/v biases) with a tokenizer.

Shared by the tests of several modules (import as ``from hf_fixtures import save_random_qwen2``;
pytest puts tests/ on sys.path): ``save_random_qwen2(tmp_path / "hf")`` writes a directory
that ``transformers.AutoModelForCausalLM.from_pretrained`` and ``hf_io.load_hf_checkpoint`` read.
"""
from __future__ import annotations

import pathlib
from typing import Any

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "You are a creative encyclopedia assistant. You discuss all topics freely.",
    "What is photosynthesis? Name a vowel in the English alphabet.",
    "The quick brown fox jumps over the lazy dog. QZXBT is an invented term.",
    "system user assistant hello world 0123456789 !?.,;:'\"()[]{}",
]


def make_tiny_tokenizer(vocab_size: int = 320) -> Any:
    """Byte-level BPE ``PreTrainedTokenizerFast`` with ChatML specials and chat template.

    The ids of the 3 specials are 0, 1, 2; the vocabulary has at most ``vocab_size`` entries.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], chat_template=CHATML_TEMPLATE)


def save_random_qwen2(path: str | pathlib.Path, *, tie: bool = True, vocab: int = 320, hidden: int = 64,
                      layers: int = 2, heads: int = 4, kv_heads: int = 2, intermediate: int = 96,
                      rope_theta: float = 10000.0, seed: int = 0, tokenizer: bool = True,
                      bias_std: float = 0.1) -> pathlib.Path:
    """Saves a random transformers ``Qwen2ForCausalLM`` (fp32, safetensors) at ``path``; returns it.

    Biases and norm weights are randomised too (HF initialises them to 0/1), so parity tests
    exercise every parameter. ``vocab`` >= the tokenizer's vocabulary size (320 by default).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = pathlib.Path(path)
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=256,
                      rope_parameters={"rope_theta": rope_theta, "rope_type": "default"},
                      tie_word_embeddings=tie, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2,
                      pad_token_id=0)
    model = Qwen2ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, bias_std)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    if tokenizer:
        tok = make_tiny_tokenizer(min(vocab, 320))
        assert len(tok) <= vocab, (len(tok), vocab)
        tok.save_pretrained(path)
    return path


def hf_model_config(family: str, *, tie: bool = True, vocab: int = 320, hidden: int = 64, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, intermediate: int = 96, head_dim: int | None = None,
                    rope_theta: float = 10000.0) -> Any:
    """A tiny transformers config of ``family`` ("qwen2", "llama" with llama3 RoPE scaling whose
    three frequency bands all occur at head_dim 16, "qwen3" with an explicit head_dim != d / heads)."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=256, tie_word_embeddings=tie, rms_norm_eps=1e-6,
                  bos_token_id=0, eos_token_id=2, pad_token_id=0)
    if family == "qwen2":
        return transformers.Qwen2Config(rope_parameters={"rope_theta": rope_theta, "rope_type": "default"},
                                        **common)
    if family == "llama":
        return transformers.LlamaConfig(
            head_dim=head_dim or hidden // heads,
            rope_parameters={"rope_type": "llama3", "rope_theta": rope_theta, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64}, **common)
    if family == "qwen3":
        return transformers.Qwen3Config(head_dim=head_dim or 2 * hidden // heads,
                                        rope_parameters={"rope_theta": rope_theta, "rope_type": "default"},
                                        **common)
    raise ValueError(family)


def save_random_hf(path: str | pathlib.Path, family: str, *, tie: bool = True, seed: int = 0,
                   tokenizer: bool = True, bias_std: float = 0.1, **shape: Any) -> pathlib.Path:
    """Saves a random transformers ``<Family>ForCausalLM`` (fp32, safetensors) at ``path``; returns it.

    As :func:`save_random_qwen2` for any family of :func:`hf_model_config`: biases and norm weights
    (Qwen3's q/k norms too) are randomised so parity tests exercise every parameter.
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = pathlib.Path(path)
    torch.manual_seed(seed)
    cfg = hf_model_config(family, tie=tie, **shape)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, bias_std)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    if tokenizer:
        tok = make_tiny_tokenizer(min(cfg.vocab_size, 320))
        tok.save_pretrained(path)
    return path
