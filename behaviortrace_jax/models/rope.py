"""Rotary position embeddings as transformers 5 reads and computes them: the RoPE of a HF
``config.json`` (:func:`rope_parameters`: ``rope_scaling`` / ``rope_parameters`` precedence, spellings,
defaults; :func:`rope_scaling_from_hf` -> :class:`RopeScaling`: linear, dynamic, yarn, llama3), the
inverse frequencies of each variant (:meth:`RopeScaling.inv_freq`, :func:`default_inv_freq`) and the
cos/sin tables (:func:`rope_cos_sin`) the decoder's attention rotates q and k with
(``models/decoder.py``). Formulas and defaults are transformers' ``modeling_rope_utils``, in float32.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging


# The RoPE variants the shared decoder implements (transformers' ``ROPE_INIT_FUNCTIONS`` names, plus
# "default"); ``longrope`` and ``proportional`` are refused by name.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
# Keys transformers requires per rope_type (``RotaryEmbeddingConfigMixin._validate_<type>_rope_parameters``,
# after ``standardize_rope_params`` filled ``rope_type``, ``rope_theta`` and, for yarn / llama3,
# ``original_max_position_embeddings``); a missing one is transformers' KeyError, ours a ValueError.
_ROPE_REQUIRED = {"default": (), "linear": ("factor",), "dynamic": ("factor",),
                  "yarn": ("factor", "original_max_position_embeddings"),
                  "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor")}
DEFAULT_ROPE_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta


def rope_parameters(d: dict, src: str = "<dict>") -> tuple[str, dict, float]:
    """(rope_type, the standardised rope dict, rope_theta) of a HF config dict, as transformers 5
    resolves them (``PreTrainedConfig.convert_rope_params_to_dict`` + ``standardize_rope_params``).

    Precedence (transformers'): a non-empty ``rope_scaling`` replaces ``rope_parameters`` whole; the
    dict's ``rope_theta`` wins over the top-level ``rope_theta``, which wins over 10000; the dict's
    ``rope_type`` wins over its legacy ``type``, else "default"; yarn / llama3 without
    ``original_max_position_embeddings`` take ``max_position_embeddings``. Where both spellings are
    given and disagree, transformers takes the one above without a word; this logs a warning naming
    both keys and takes the same one.

    Raises:
        ValueError: naming the key when ``rope_scaling`` / ``rope_parameters`` is not a dict (transformers'
            strict-dataclass error), or ``rope_theta`` is not a number.
    """
    given = {k: d.get(k) for k in ("rope_scaling", "rope_parameters")}
    for key, value in given.items():
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{src}: {key} must be a dict or null, got {value!r}")
    rs, rp = given["rope_scaling"], given["rope_parameters"]
    if rs and rp and _rope_differs(rs, rp):
        logging.warning("%s: rope_scaling=%r and rope_parameters=%r disagree; rope_scaling is used "
                        "(transformers' precedence)", src, rs, rp)
    rope = dict(rs or rp or {})
    if "rope_theta" in rope and "rope_theta" in d and _num(rope["rope_theta"]) != _num(d["rope_theta"]):
        logging.warning("%s: rope_theta=%r and %s.rope_theta=%r disagree; the latter is used "
                        "(transformers' precedence)", src, d["rope_theta"],
                        "rope_scaling" if rs else "rope_parameters", rope["rope_theta"])
    rope.setdefault("rope_theta", d.get("rope_theta", DEFAULT_ROPE_THETA))
    if "type" in rope and "rope_type" in rope and rope["type"] != rope["rope_type"]:
        logging.warning("%s: rope type=%r and rope_type=%r disagree; rope_type is used (transformers' "
                        "precedence)", src, rope["type"], rope["rope_type"])
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] in ("llama3", "yarn", "longrope"):
        rope.setdefault("original_max_position_embeddings", d.get("max_position_embeddings", 32768))
    theta = rope["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ValueError(f"{src}: rope_theta must be a number, got {theta!r}")
    return rope["rope_type"], rope, float(theta)


def _num(v: Any) -> Any:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v


def _rope_differs(a: dict, b: dict) -> bool:
    """Whether two rope dicts mean different things (``type`` read as ``rope_type``, numbers as floats)."""
    def norm(r: dict) -> dict:
        out = {("rope_type" if k == "type" else k): _num(v) for k, v in r.items()}
        out.setdefault("rope_type", "default")
        return out
    return norm(a) != norm(b)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A non-default RoPE variant, resolved from a HF config (:func:`rope_scaling_from_hf`); hashable,
    so the model config stays a static jit argument. Formulas and defaults are transformers'
    (``modeling_rope_utils._compute_<type>_parameters``), in float32 as there.

    Attributes:
        rope_type: "linear" | "dynamic" | "yarn" | "llama3".
        factor: the scaling factor (yarn without one: ``max_position_embeddings / original``).
        original_max_position_embeddings: the pre-training context (yarn, llama3).
        low_freq_factor, high_freq_factor: llama3's ramp ends.
        attention_factor, beta_fast, beta_slow, mscale, mscale_all_dim, truncate: yarn's options
            (None = transformers' default: attention factor from ``factor``, betas 32 / 1).
    """

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def to_hf(self, theta: float) -> dict:
        """The ``rope_parameters`` dict transformers reads back to the same variant."""
        out = {"rope_type": self.rope_type, "rope_theta": theta, "factor": self.factor}
        for f in dataclasses.fields(self)[2:]:
            v = getattr(self, f.name)
            if v is not None and not (f.name == "truncate" and v is True):
                out[f.name] = v
        return out

    def attention_scaling(self) -> float:
        """transformers' ``attention_factor`` (cos/sin multiplier): yarn's, 1.0 for the others."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return float(_yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim))
        return _yarn_mscale(self.factor)

    def inv_freq(self, head_dim: int, theta: float, max_position_embeddings: int,
                 seq_len: jax.Array | int | None = None) -> jax.Array:
        """Inverse frequencies float32 [head_dim/2] (``seq_len``: see :meth:`DecoderConfig.rope_inv_freq`)."""
        base = default_inv_freq(head_dim, theta)
        if self.rope_type == "linear":
            return base / self.factor
        if self.rope_type == "dynamic":
            if seq_len is None:  # at init transformers' formula gives the default frequencies
                return base
            mpe, dim = max_position_embeddings, head_dim
            seq = jnp.maximum(jnp.asarray(seq_len, jnp.int32), mpe).astype(jnp.float32)
            grown = theta * ((self.factor * seq / mpe) - (self.factor - 1)) ** (dim / (dim - 2))
            scaled = 1.0 / (grown ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
            # transformers recomputes only when the sequence outgrows max_position_embeddings
            return jnp.where(jnp.asarray(seq_len) > mpe, scaled, base)
        if self.rope_type == "yarn":
            return self._yarn_inv_freq(head_dim, theta)
        if self.rope_type == "llama3":
            old = self.original_max_position_embeddings
            low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
            wavelen = 2 * math.pi / base
            scaled = jnp.where(wavelen > low_wavelen, base / self.factor, base)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return jnp.where(medium, smoothed, scaled)
        raise ValueError(f"rope_type={self.rope_type!r}; supported: {', '.join(map(repr, ROPE_TYPES))}")

    def _yarn_inv_freq(self, dim: int, theta: float) -> jax.Array:
        beta_fast, beta_slow = self.beta_fast or 32, self.beta_slow or 1
        omp = self.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(omp / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        pos_freqs = theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)
        ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
        keep = 1 - ramp
        return interpolation * (1 - keep) + extrapolation * keep


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * log(scale) + 1`` (1 for scale <= 1), transformers' ``yarn_get_mscale``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_scaling_from_hf(d: dict, src: str = "<dict>",
                         rope_types: tuple[str, ...] = ROPE_TYPES) -> tuple[float, RopeScaling | None]:
    """(rope_theta, the :class:`RopeScaling` or None for default RoPE) of a HF config dict, resolved
    as transformers does (:func:`rope_parameters`).

    Raises:
        ValueError: naming the key for a ``rope_type`` outside ``rope_types``, a key the type requires
            that is missing (transformers' KeyError), a non-numeric one, or ``partial_rotary_factor``
            != 1 with a scaled type (the decoder rotates whole heads).
    """
    rope_type, rope, theta = rope_parameters(d, src)
    if rope_type not in rope_types:
        raise ValueError(f"{src}: rope_type={rope_type!r}; supported: {', '.join(map(repr, rope_types))}")
    missing = [k for k in _ROPE_REQUIRED[rope_type] if k not in rope]
    if missing:
        raise ValueError(f"{src}: rope_scaling / rope_parameters of rope_type={rope_type!r} lacks "
                         f"{', '.join(map(repr, missing))}")
    if rope_type == "default":
        return theta, None
    if rope.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
        raise ValueError(f"{src}: partial_rotary_factor={rope['partial_rotary_factor']!r} is not supported "
                         f"(rope_type={rope_type!r})")
    factor = rope["factor"]
    if factor is None and rope_type == "yarn":  # transformers: the ratio of the two context lengths
        factor = d.get("max_position_embeddings", 32768) / rope["original_max_position_embeddings"]

    def num(key: str, value: Any, kind: type = float) -> Any:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{src}: rope {key} must be a number, got {value!r}")
        return kind(value)

    omp = rope.get("original_max_position_embeddings") if rope_type in ("yarn", "llama3") else None
    keys = ("low_freq_factor", "high_freq_factor") if rope_type == "llama3" else \
        ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim") if rope_type == "yarn" else ()
    extra = {k: num(k, rope.get(k)) for k in keys}
    if num("factor", factor) is None:
        raise ValueError(f"{src}: rope factor must be a number, got None (rope_type={rope_type!r})")
    return theta, RopeScaling(rope_type=rope_type, factor=num("factor", factor),
                              original_max_position_embeddings=num("original_max_position_embeddings", omp, int),
                              truncate=bool(rope.get("truncate", True)) if rope_type == "yarn" else True, **extra)



def default_inv_freq(head_dim: int, theta: float) -> jax.Array:
    """HF default RoPE inverse frequencies ``1 / theta^(2i/d)``, float32 [head_dim/2]."""
    return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float,
                 inv_freq: jax.Array | None = None, scaling: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """RoPE tables: positions [B, T] int -> (cos, sin) float32 [B, T, head_dim].

    ``inv_freq`` None = the HF default frequencies of ``theta`` (see :func:`default_inv_freq`);
    ``scaling``: transformers' ``attention_scaling`` multiplying both (yarn; 1.0 multiplies nothing).
    """
    if inv_freq is None:
        inv_freq = default_inv_freq(head_dim, theta)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    if scaling == 1.0:
        return jnp.cos(emb), jnp.sin(emb)
    return jnp.cos(emb) * scaling, jnp.sin(emb) * scaling
