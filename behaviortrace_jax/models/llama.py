"""Llama family (``LlamaForCausalLM``, Llama 3.x): config, module, HF weight rows.

The shared decoder of :mod:`behaviortrace_jax.models.decoder` without q/k/v biases, head tied or
untied, and RoPE either default or scaled the Llama 3 way (``rope_scaling`` / ``rope_parameters``
``rope_type: "llama3"``: long wavelengths divided by ``factor``, a smooth ramp between
``low_freq_factor`` and ``high_freq_factor``), as transformers' ``_compute_llama3_parameters``.
``attention_bias`` / ``mlp_bias`` true (no published Llama 3 uses them) are refused.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

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


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """``rope_type: "llama3"`` parameters (hashable, so the config stays a static jit argument)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def to_hf(self, theta: float) -> dict:
        return {"rope_type": "llama3", "rope_theta": theta, "factor": self.factor,
                "low_freq_factor": self.low_freq_factor, "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings}


@dataclasses.dataclass(frozen=True)
class LlamaConfig(decoder.DecoderConfig):
    """Architecture of a Llama causal LM; ``rope_scaling`` None = default RoPE."""

    model_type: ClassVar[str] = "llama"
    architecture: ClassVar[str] = "LlamaForCausalLM"

    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope_scaling: Llama3RopeScaling | None = None

    def module_class(self) -> type["LlamaForCausalLM"]:
        return LlamaForCausalLM

    def rope_inv_freq(self) -> jax.Array | None:
        """Llama 3 scaled inverse frequencies (float32, transformers' arithmetic); None = default."""
        s = self.rope_scaling
        if s is None:
            return None
        inv_freq = decoder.default_inv_freq(self.head_dim, self.rope_theta)
        old = s.original_max_position_embeddings
        low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return jnp.where(medium, smoothed, scaled)

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
                ``mlp_bias`` true, a ``rope_type`` other than "default" / "llama3" or a missing key.
        """
        d, src, rope_type, rope = decoder.read_family_config(
            path_or_dict, "llama", refused=("attention_bias", "mlp_bias"), rope_types=("default", "llama3"))
        kw = decoder.common_kwargs(d, src)
        if rope_type == "llama3":
            try:
                kw["rope_scaling"] = Llama3RopeScaling(
                    factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                    high_freq_factor=float(rope["high_freq_factor"]),
                    original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
            except KeyError as e:
                raise ValueError(f"{src}: rope_scaling of type llama3 lacks {e.args[0]!r}") from None
        return cls(**{**kw, **overrides})

    def to_hf_config(self) -> dict:
        """A dict that transformers' ``LlamaConfig(**d)`` / ``config.json`` accepts."""
        rope = (self.rope_scaling.to_hf(self.rope_theta) if self.rope_scaling is not None
                else {"rope_theta": self.rope_theta, "rope_type": "default"})
        return self.hf_config_dict(rope, attention_bias=False, mlp_bias=False, pretraining_tp=1)


class LlamaForCausalLM(decoder.DecoderForCausalLM):
    """Llama causal LM: the shared decoder without biases; parameters under HF names and layout."""


# HF weight rows of one decoder layer, in ``LlamaForCausalLM.parameters()`` order.
HF_LAYER_ROWS: tuple[tuple[str, Any], ...] = decoder.hf_layer_rows(qkv_bias=False, qk_norm=False)
