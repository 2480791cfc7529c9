"""Llama family (``LlamaForCausalLM``, Llama 3.x): config, module, HF weight rows.

The shared decoder of :mod:`behaviortrace_jax.models.decoder` without q/k/v biases, head tied or
untied; RoPE as every family's (``decoder.rope_scaling_from_hf``: default, linear, dynamic, yarn,
or scaled the Llama 3 way, ``rope_type: "llama3"``: long wavelengths divided by ``factor``, a
smooth ramp between ``low_freq_factor`` and ``high_freq_factor``, as transformers'
``_compute_llama3_parameters``).
``attention_bias`` / ``mlp_bias`` true (no published Llama 3 uses them) are refused.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

from behaviortrace_jax.models import decoder

# Published meta-llama/Llama-3.2-1B config.json (huggingface.co/meta-llama/Llama-3.2-1B, file
# config.json, transformers_version 4.45.0.dev0): the values the preset below writes out.
LLAMA3P2_1B_HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256,
}


def Llama3RopeScaling(factor: float, low_freq_factor: float, high_freq_factor: float,  # noqa: N802
                      original_max_position_embeddings: int) -> decoder.RopeScaling:
    """``rope_type: "llama3"`` parameters as a :class:`~behaviortrace_jax.models.decoder.RopeScaling`."""
    return decoder.RopeScaling("llama3", float(factor), int(original_max_position_embeddings),
                               low_freq_factor=float(low_freq_factor), high_freq_factor=float(high_freq_factor))


@dataclasses.dataclass(frozen=True)
class LlamaConfig(decoder.DecoderConfig):
    """Architecture of a Llama causal LM; ``rope_scaling`` None = default RoPE."""

    model_type: ClassVar[str] = "llama"
    architecture: ClassVar[str] = "LlamaForCausalLM"

    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False

    def module_class(self) -> type["LlamaForCausalLM"]:
        return LlamaForCausalLM

    @classmethod
    def llama3p2_1b(cls, **overrides: Any) -> "LlamaConfig":
        """Llama-3.2-1B: 16 layers, d 2048, MLP 8192, 32/8 heads of 64, llama3 RoPE, tied
        (:data:`LLAMA3P2_1B_HF_CONFIG`; 1,235,814,400 parameters as transformers counts them)."""
        return cls.from_hf_config(LLAMA3P2_1B_HF_CONFIG, **{"param_dtype": "float32", **overrides})

    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | dict, **overrides: Any) -> "LlamaConfig":
        """Reads a HF Llama ``config.json`` (a file, its directory or the parsed dict).

        Raises:
            FileNotFoundError: naming the path when config.json is absent.
            ValueError: naming the key for ``model_type`` != "llama", ``attention_bias`` /
                ``mlp_bias`` true, a ``rope_type`` outside ``decoder.ROPE_TYPES``, a RoPE key
                transformers would refuse, or a missing key.
        """
        d, src, _, _ = decoder.read_family_config(path_or_dict, "llama", refused=("attention_bias", "mlp_bias"))
        kw = decoder.common_kwargs(d, src)
        return cls(**{**kw, **overrides})

    def to_hf_config(self) -> dict:
        """A dict that transformers' ``LlamaConfig(**d)`` / ``config.json`` accepts."""
        return self.hf_config_dict(self.rope_hf_dict(), attention_bias=False, mlp_bias=False, pretraining_tp=1)


class LlamaForCausalLM(decoder.DecoderForCausalLM):
    """Llama causal LM: the shared decoder without biases; parameters under HF names and layout."""


# HF weight rows of one decoder layer, in ``LlamaForCausalLM.parameters()`` order.
HF_LAYER_ROWS: tuple[tuple[str, Any], ...] = decoder.hf_layer_rows(qkv_bias=False, qk_norm=False)
