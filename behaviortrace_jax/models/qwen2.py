"""Qwen2 / Qwen2.5 family (SPEC §2.1: Qwen2.5-1.5B-Instruct): config, module, HF weight rows.

The architecture is the shared decoder of :mod:`behaviortrace_jax.models.decoder` with q/k/v biases
(``qkv_bias``), RoPE as every family's and no q/k norm; numerics follow transformers' ``Qwen2ForCausalLM``.
The pure functions that run it (``forward``, ``forward_with_cache``, ``init_cache``, ...) are
:mod:`~behaviortrace_jax.models.decoder`'s and serve every family.
"""
from __future__ import annotations

import os
from typing import Any, ClassVar

import dataclasses

from behaviortrace_jax.models import decoder


@dataclasses.dataclass(frozen=True)
class Qwen2Config(decoder.DecoderConfig):
    """Architecture of a Qwen2 causal LM (the fields of HF ``config.json`` that matter).

    ``param_dtype`` / ``compute_dtype`` are "float32" | "bfloat16" (| "float16"): the storage dtype of
    the parameters and the dtype activations are computed in (logits are always float32).
    """

    model_type: ClassVar[str] = "qwen2"
    architecture: ClassVar[str] = "Qwen2ForCausalLM"
    qkv_bias: ClassVar[bool] = True

    def module_class(self) -> type["Qwen2ForCausalLM"]:
        return Qwen2ForCausalLM

    @classmethod
    def qwen2p5_1p5b(cls, **overrides: Any) -> "Qwen2Config":
        """Qwen2.5-1.5B(-Instruct): 28 layers, d 1536, MLP 8960, 12/2 heads, tied (SPEC §2.1)."""
        kw = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, head_dim=128, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=32768)
        return cls(**{**kw, **overrides})

    @classmethod
    def qwen2p5_7b(cls, **overrides: Any) -> "Qwen2Config":
        """Qwen2.5-7B(-Instruct)'s published config.json: 28 layers, d 3584, MLP 18944, 28/4 heads of
        128, vocab 152064, untied ``lm_head``."""
        kw = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                  num_attention_heads=28, num_key_value_heads=4, head_dim=128, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=32768)
        return cls(**{**kw, **overrides})

    @classmethod
    def qwen2p5_32b(cls, **overrides: Any) -> "Qwen2Config":
        """Qwen2.5-32B-Instruct's published config.json: 64 layers, d 5120, MLP 27648, 40/8 heads of
        128, vocab 152064, untied ``lm_head``, RMSNorm eps 1e-6, 32,768 positions (the base model's
        config.json, Qwen/Qwen2.5-32B, differs only in eps 1e-5 and 131,072 positions):
        32,763,876,352 parameters."""
        kw = dict(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                  num_attention_heads=40, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=32768)
        return cls(**{**kw, **overrides})

    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | dict, **overrides: Any) -> "Qwen2Config":
        """Reads a HF Qwen2 ``config.json`` (a file, the directory holding it, or the parsed dict).

        RoPE (``rope_scaling`` + ``rope_theta``, or ``rope_parameters``) is read as transformers reads it
        (``decoder.rope_scaling_from_hf``).
        ``overrides`` (e.g. ``param_dtype="bfloat16"``) replace fields after reading.

        Raises:
            FileNotFoundError: naming the path when config.json is absent.
            ValueError: naming the key for ``model_type`` != "qwen2", ``use_sliding_window: true``,
                a ``rope_type`` outside ``decoder.ROPE_TYPES`` (or
                RoPE keys transformers would refuse) or a missing required key.
        """
        d, src, _, _ = decoder.read_family_config(path_or_dict, "qwen2", refused=("use_sliding_window",))
        kw = decoder.common_kwargs(d, src)
        return cls(**{**kw, **overrides})

    def to_hf_config(self) -> dict:
        """A dict that transformers' ``Qwen2Config(**d)`` / ``config.json`` accepts."""
        return self.hf_config_dict(self.rope_hf_dict(),
                                   use_sliding_window=False, sliding_window=None,
                                   max_window_layers=self.num_hidden_layers)


class Qwen2ForCausalLM(decoder.DecoderForCausalLM):
    """Qwen2 causal LM: the shared decoder with q/k/v biases; parameters under HF names and layout."""


# HF weight rows of one decoder layer, in ``Qwen2ForCausalLM.parameters()`` order: (name, shape of cfg).
HF_LAYER_ROWS: tuple[tuple[str, Any], ...] = decoder.hf_layer_rows(qkv_bias=True, qk_norm=False)
