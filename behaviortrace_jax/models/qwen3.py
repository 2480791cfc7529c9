"""Qwen3 family (``Qwen3ForCausalLM``, dense): config, module, HF weight rows.

The shared decoder of :mod:`behaviortrace_jax.models.decoder` without q/k/v biases and with a
per-head RMSNorm of q and k (``q_norm`` / ``k_norm``, weight ``[head_dim]``) before RoPE; the
``head_dim`` is explicit in config.json (128 when absent, as transformers' default), not
``hidden_size / heads``. RoPE as every family's (``decoder.rope_scaling_from_hf``); sliding windows and ``attention_bias`` are refused.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

from behaviortrace_jax.models import decoder

# Published Qwen/Qwen3-1.7B config.json (huggingface.co/Qwen/Qwen3-1.7B, file config.json,
# transformers_version 4.51.0): the values the preset below writes out.
QWEN3_1P7B_HF_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


@dataclasses.dataclass(frozen=True)
class Qwen3Config(decoder.DecoderConfig):
    """Architecture of a Qwen3 causal LM (per-head q/k RMSNorm, no q/k/v bias)."""

    model_type: ClassVar[str] = "qwen3"
    architecture: ClassVar[str] = "Qwen3ForCausalLM"
    qk_norm: ClassVar[bool] = True

    def module_class(self) -> type["Qwen3ForCausalLM"]:
        return Qwen3ForCausalLM

    @classmethod
    def qwen3_1p7b(cls, **overrides: Any) -> "Qwen3Config":
        """Qwen3-1.7B: 28 layers, d 2048, MLP 6144, 16/8 heads of 128, tied
        (:data:`QWEN3_1P7B_HF_CONFIG`; 1,720,574,976 parameters as transformers counts them)."""
        return cls.from_hf_config(QWEN3_1P7B_HF_CONFIG, **{"param_dtype": "float32", **overrides})

    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | dict, **overrides: Any) -> "Qwen3Config":
        """Reads a HF Qwen3 ``config.json`` (a file, its directory or the parsed dict).

        Raises:
            FileNotFoundError: naming the path when config.json is absent.
            ValueError: naming the key for ``model_type`` != "qwen3", ``use_sliding_window`` or
                ``attention_bias`` true, a ``rope_type`` outside ``decoder.ROPE_TYPES`` (or
                RoPE keys transformers would refuse) or a missing required key.
        """
        d, src, _, _ = decoder.read_family_config(path_or_dict, "qwen3",
                                                  refused=("use_sliding_window", "attention_bias"))
        kw = decoder.common_kwargs(d, src, default_head_dim=128)
        return cls(**{**kw, **overrides})

    def to_hf_config(self) -> dict:
        """A dict that transformers' ``Qwen3Config(**d)`` / ``config.json`` accepts."""
        return self.hf_config_dict(self.rope_hf_dict(),
                                   use_sliding_window=False, sliding_window=None,
                                   max_window_layers=self.num_hidden_layers, attention_bias=False)


class Qwen3ForCausalLM(decoder.DecoderForCausalLM):
    """Qwen3 causal LM: the shared decoder with q/k RMSNorm; parameters under HF names and layout."""


# HF weight rows of one decoder layer, in ``Qwen3ForCausalLM.parameters()`` order.
HF_LAYER_ROWS: tuple[tuple[str, Any], ...] = decoder.hf_layer_rows(qkv_bias=False, qk_norm=True)
