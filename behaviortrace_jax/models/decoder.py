"""The decoder-only transformer every model family shares (Qwen2, Llama, Qwen3), in Flax NNX.

One module tree with switches read from the family's config class: ``qkv_bias`` (Qwen2's q/k/v
biases), ``qk_norm`` (Qwen3's per-head RMSNorm of q and k before RoPE) and the RoPE inverse
frequencies and cos/sin scale (:meth:`DecoderConfig.rope_inv_freq`, :attr:`DecoderConfig.rope_attention_scaling`:
default, linear, dynamic, yarn or llama3, read from HF config.json as transformers reads it,
:func:`rope_parameters`). A family
(``qwen2.py``, ``llama.py``, ``qwen3.py``) is a :class:`DecoderConfig` subclass (switches, presets,
``from_hf_config`` / ``to_hf_config``), a :class:`DecoderForCausalLM` subclass and its HF weight
rows; ``families.py`` registers them by HF ``model_type``.

Parameters are stored in **Hugging Face layout** under Hugging Face names: linear weights are
``[out, in]`` (``y = x @ W.T + b``), ``model.embed_tokens.weight`` is ``[V, d]`` and
``lm_head.weight`` (untied models only) is ``[V, d]``. The NNX path of each parameter is the HF key
split at the dots, with layer indices as ints, e.g. ``("model", "layers", 3, "self_attn", "q_proj",
"weight")``; ``hf_io.hf_param_table`` lists them in HF ``model.parameters()`` order.

Other modules call any family's model through the pure functions :func:`forward` and
:func:`forward_with_cache` on ``(graphdef, params)`` from ``nnx.split(model, nnx.Param)`` under
``jax.jit``. Numerics follow transformers: RMSNorm in float32, RoPE with ``rotate_half`` and
float32 cos/sin, softmax in float32, logits returned in float32.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx

from behaviortrace_jax.io.files import read_json

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _dtype_name(d: Any) -> str:
    name = jnp.dtype(d).name
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {d!r}; expected one of {sorted(_DTYPES)}")
    return name



def hf_layer_rows(*, qkv_bias: bool, qk_norm: bool) -> tuple[tuple[str, Any], ...]:
    """The HF weight rows of one decoder layer, ``(name, shape of cfg)``, in transformers'
    ``parameters()`` order (the order of the per-example sketches): q/k/v/o projections (each of
    q/k/v followed by its bias when ``qkv_bias``, Qwen2), the per-head q/k RMSNorms after o_proj when
    ``qk_norm`` (Qwen3), the MLP and the two layer norms (Llama has neither switch)."""
    q = lambda c: c.num_attention_heads * c.head_dim  # noqa: E731
    kv = lambda c: c.num_key_value_heads * c.head_dim  # noqa: E731
    rows: list[tuple[str, Any]] = []
    for name, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        rows.append((f"self_attn.{name}.weight", lambda c, out=out: (out(c), c.hidden_size)))
        if qkv_bias:
            rows.append((f"self_attn.{name}.bias", lambda c, out=out: (out(c),)))
    rows.append(("self_attn.o_proj.weight", lambda c: (c.hidden_size, q(c))))
    if qk_norm:
        rows += [("self_attn.q_norm.weight", lambda c: (c.head_dim,)),
                 ("self_attn.k_norm.weight", lambda c: (c.head_dim,))]
    rows += [("mlp.gate_proj.weight", lambda c: (c.intermediate_size, c.hidden_size)),
             ("mlp.up_proj.weight", lambda c: (c.intermediate_size, c.hidden_size)),
             ("mlp.down_proj.weight", lambda c: (c.hidden_size, c.intermediate_size)),
             ("input_layernorm.weight", lambda c: (c.hidden_size,)),
             ("post_attention_layernorm.weight", lambda c: (c.hidden_size,))]
    return tuple(rows)

@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Architecture of a decoder-only causal LM (the fields of HF ``config.json`` that matter).

    ``param_dtype`` / ``compute_dtype`` are "float32" | "bfloat16" (| "float16"): the storage dtype of
    the parameters and the dtype activations are computed in (logits are always float32). A family
    subclasses it and sets the class-level switches below.
    """

    model_type: ClassVar[str] = ""  # HF config.json model_type, the family's registry name
    architecture: ClassVar[str] = ""  # HF architectures[0], e.g. "Qwen2ForCausalLM"
    qkv_bias: ClassVar[bool] = False  # q/k/v projections carry biases (Qwen2)
    qk_norm: ClassVar[bool] = False  # per-head RMSNorm of q and k before RoPE (Qwen3)

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 32768
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    # Run the decoder layers as one ``jax.lax.scan`` over their stacked parameters (config key
    # ``model.scan_layers``): the layer is traced and compiled once instead of once per layer, and
    # ``sketcher.hf_param_order`` of this config sketches per-example gradients in a scan over the
    # layers too. Parameters, checkpoints and the sketch coordinate order do not change.
    scan_layers: bool = False
    # A non-default RoPE variant (linear, dynamic, yarn, llama3; :class:`RopeScaling`), None = default.
    rope_scaling: "RopeScaling | None" = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_dtype", _dtype_name(self.param_dtype))
        object.__setattr__(self, "compute_dtype", _dtype_name(self.compute_dtype))
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"scan_layers must be a bool, got {self.scan_layers!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @classmethod
    def tiny(cls, vocab_size: int = 1536, **overrides: Any) -> "DecoderConfig":
        """The tiny CPU shape of any family (TINY_CALIBRATION): d 128, 4 layers, 4/2 heads of 32,
        MLP 384, tied embeddings, RoPE theta 1e4; ``overrides`` replace fields."""
        kw = dict(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=10000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=512)
        return cls(**{**kw, **overrides})

    def hf_config_dict(self, rope_parameters: dict, **family_keys: Any) -> dict:
        """The ``config.json`` dict transformers' config class of this family accepts: the fields
        every family shares, in transformers' order, with ``family_keys`` (e.g. Qwen2's sliding-window
        keys, Llama's bias flags) after ``max_position_embeddings``."""
        return {
            "architectures": [self.architecture], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "hidden_act": "silu", "rope_theta": self.rope_theta, "rope_parameters": rope_parameters,
            "rms_norm_eps": self.rms_norm_eps, "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings, **family_keys,
            "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
            "torch_dtype": self.param_dtype, "dtype": self.param_dtype,
        }

    @property
    def jnp_param_dtype(self) -> Any:
        return _DTYPES[self.param_dtype]

    @property
    def jnp_compute_dtype(self) -> Any:
        return _DTYPES[self.compute_dtype]

    def replace(self, **kw: Any):
        return dataclasses.replace(self, **kw)

    def module_class(self) -> type["DecoderForCausalLM"]:
        """The family's NNX module class (subclasses return their own)."""
        return DecoderForCausalLM

    def rope_inv_freq(self, seq_len: jax.Array | int | None = None) -> jax.Array | None:
        """RoPE inverse frequencies [head_dim/2] float32; None = the default ``theta^(-2i/d)``.

        ``seq_len``: the sequence length of this forward (``max(positions) + 1``, may be traced);
        only ``dynamic`` reads it (as transformers' ``dynamic_rope_update``); None = at init.
        """
        if self.rope_scaling is None:
            return None
        return self.rope_scaling.inv_freq(self.head_dim, self.rope_theta, self.max_position_embeddings, seq_len)

    @property
    def rope_attention_scaling(self) -> float:
        """The factor transformers multiplies RoPE's cos and sin by (yarn's ``attention_factor``; 1 otherwise)."""
        return 1.0 if self.rope_scaling is None else self.rope_scaling.attention_scaling()

    def rope_hf_dict(self) -> dict:
        """This config's RoPE as a transformers-5 ``rope_parameters`` dict (``rope_theta`` included)."""
        if self.rope_scaling is None:
            return {"rope_theta": self.rope_theta, "rope_type": "default"}
        return self.rope_scaling.to_hf(self.rope_theta)


def read_hf_config(path_or_dict: str | os.PathLike | dict) -> tuple[dict, str]:
    """(the parsed HF ``config.json``, its path for messages) from a file, its directory or a dict.

    Raises:
        FileNotFoundError: naming the path when config.json is absent.
    """
    if isinstance(path_or_dict, dict):
        return dict(path_or_dict), "<dict>"
    p = os.fspath(path_or_dict)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    if not os.path.isfile(p):
        raise FileNotFoundError(f"HF config not found: {p}")
    return read_json(p), p


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


_HF_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings")


def check_hf_values(d: dict, src: str) -> None:
    """Checks the values of a HF config dict that :func:`common_kwargs` reads (where present and not
    null): sizes (:data:`_HF_SIZES`) positive integers, ``rms_norm_eps`` / ``rope_theta`` positive
    numbers, ``tie_word_embeddings`` a boolean, heads a multiple of the key/value heads (as
    transformers' attention requires).

    Raises:
        ValueError: ``"{src}: <key>=<value> is not ..."`` naming the key (both keys for the heads).
    """
    def present(key):
        return key in d and d[key] is not None

    for key in _HF_SIZES:
        v = d.get(key)
        if present(key) and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise ValueError(f"{src}: {key}={v!r} is not a positive integer")
    for key in ("rms_norm_eps", "rope_theta"):
        v = d.get(key)
        if present(key) and (not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or v != v
                             or v == float("inf")):
            raise ValueError(f"{src}: {key}={v!r} is not a positive number")
    if present("tie_word_embeddings") and not isinstance(d["tie_word_embeddings"], bool):
        raise ValueError(f"{src}: tie_word_embeddings={d['tie_word_embeddings']!r} is not a boolean")
    if present("num_attention_heads") and present("num_key_value_heads") and (
            d["num_attention_heads"] % d["num_key_value_heads"]):
        raise ValueError(f"{src}: num_attention_heads={d['num_attention_heads']} is not a multiple of "
                         f"num_key_value_heads={d['num_key_value_heads']}")


def common_kwargs(d: dict, src: str, *, default_head_dim: int | None = None,
                  default_tie: bool = False) -> dict:
    """The :class:`DecoderConfig` fields every family reads alike from a HF config dict.

    ``head_dim``: ``d["head_dim"]``, else ``default_head_dim``, else ``hidden_size // heads``.

    Raises:
        ValueError: naming a missing required key; a size that is not a positive integer, an
            ``rms_norm_eps`` or ``rope_theta`` that is not a positive number, a
            ``tie_word_embeddings`` that is not a boolean, or ``num_attention_heads`` not a multiple
            of ``num_key_value_heads`` (naming both keys); a RoPE key
            :func:`rope_scaling_from_hf` refuses.
    """
    check_hf_values(d, src)
    theta, scaling = rope_scaling_from_hf(d, src)
    try:
        n_heads = d["num_attention_heads"]
        kw = dict(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=n_heads, num_key_value_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=d.get("head_dim") or default_head_dim or d["hidden_size"] // n_heads,
            rope_theta=theta, rope_scaling=scaling, rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", default_tie)),
            max_position_embeddings=d.get("max_position_embeddings", 32768))
    except KeyError as e:
        raise ValueError(f"{src}: required key {e.args[0]!r} is missing") from None
    dt = d.get("torch_dtype") or d.get("dtype")
    if dt in _DTYPES:
        kw["param_dtype"] = dt
    return kw


def read_family_config(path_or_dict: str | os.PathLike | dict, model_type: str, *, refused: tuple[str, ...] = (),
                       rope_types: tuple[str, ...] = ROPE_TYPES) -> tuple[dict, str, str, dict]:
    """(the parsed HF config, its path for messages, its ``rope_type``, its rope dict) of one family's
    ``config.json`` (a file, the directory holding it, or the parsed dict), checked for what the
    family implements.

    ``refused``: keys that must be absent or false (features the family does not implement, e.g.
    ``use_sliding_window``); ``rope_types``: the RoPE variants it implements.

    Raises:
        FileNotFoundError: naming the path when config.json is absent.
        ValueError: naming the key for another family's ``model_type``, a ``refused`` key set true
            or a ``rope_type`` outside ``rope_types``.
    """
    d, src = read_hf_config(path_or_dict)
    if d.get("model_type") != model_type:
        raise ValueError(f"{src}: model_type={d.get('model_type')!r}, expected {model_type!r}")
    for key in refused:
        if d.get(key, False):
            raise ValueError(f"{src}: {key}=true is not supported")
    rope_type, rope, _ = rope_parameters(d, src)
    if rope_type not in rope_types:
        raise ValueError(f"{src}: rope_type={rope_type!r}; {model_type} supports {', '.join(map(repr, rope_types))}")
    return d, src, rope_type, rope


# ------------------------------------------------------------------------------------------------
# Modules (attribute names == HF module names)
# ------------------------------------------------------------------------------------------------


def linear_apply(x: jax.Array, weight: jax.Array, bias: jax.Array | None, dtype: Any) -> jax.Array:
    """``x @ weight.T (+ bias)`` in ``dtype`` (weight [out, in], x [..., in]): :class:`Linear`'s product."""
    y = jnp.einsum("...i,oi->...o", x.astype(dtype), weight.astype(dtype))
    if bias is not None:
        y = y + bias.astype(dtype)
    return y


def scale_apply(weight: jax.Array, h: jax.Array) -> jax.Array:
    """``weight.astype(h.dtype) * h``: an :class:`RMSNorm`'s scale of its normalised input h [..., d]."""
    return weight.astype(h.dtype) * h


def embed_apply(weight: jax.Array, ids: jax.Array, dtype: Any) -> jax.Array:
    """The embedding rows ``weight[ids]`` [..., d] in ``dtype``."""
    return weight[ids].astype(dtype)


def head_apply(x: jax.Array, weight: jax.Array, dtype: Any) -> jax.Array:
    """The float32 logits ``x @ weight.T`` [B, T, V] of the final hidden states x [B, T, d] (weight [V, d],
    the lm_head or the tied embedding), accumulated in float32."""
    logits = jnp.einsum("btd,vd->btv", x, weight.astype(dtype), preferred_element_type=jnp.float32)
    return logits.astype(jnp.float32)


def _sub(taps: Any, *names: str | int) -> Any:
    """``taps.sub(*names)`` (the taps of a submodule), or None when the forward runs without taps."""
    return None if taps is None else taps.sub(*names)


class Linear(nnx.Module):
    """``y = x @ weight.T (+ bias)`` with ``weight [out, in]`` (HF / torch layout).

    ``tap`` (see :func:`forward`): ``tap.linear(x, weight, bias, dtype)`` computes the same ``y``
    and, in the backward pass, also what the tap collects from this use of the weights.
    """

    def __init__(self, d_in: int, d_out: int, *, bias: bool, cfg: DecoderConfig, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(0.02)
        self.weight = nnx.Param(init(rngs.params(), (d_out, d_in), cfg.jnp_param_dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), cfg.jnp_param_dtype)) if bias else None
        self.dtype = cfg.jnp_compute_dtype

    def __call__(self, x: jax.Array, tap: Any = None) -> jax.Array:
        bias = None if self.bias is None else self.bias[...]
        if tap is not None:
            return tap.linear(x, self.weight[...], bias, self.dtype)
        return linear_apply(x, self.weight[...], bias, self.dtype)


class RMSNorm(nnx.Module):
    """HF Qwen2RMSNorm / LlamaRMSNorm / Qwen3RMSNorm: normalise in float32, cast back, scale by ``weight [d]``.

    ``tap``: ``tap.scale(weight, normalised x)`` computes the same product (see :func:`forward`)."""

    def __init__(self, d: int, *, cfg: DecoderConfig):
        self.weight = nnx.Param(jnp.ones((d,), cfg.jnp_param_dtype))
        self.eps = cfg.rms_norm_eps

    def __call__(self, x: jax.Array, tap: Any = None) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        if tap is not None:
            return tap.scale(self.weight[...], h.astype(x.dtype))
        return scale_apply(self.weight[...], h.astype(x.dtype))


class Embedding(nnx.Module):
    def __init__(self, vocab: int, d: int, *, cfg: DecoderConfig, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(0.02)
        self.weight = nnx.Param(init(rngs.params(), (vocab, d), cfg.jnp_param_dtype))


def _rotate_half(x: jax.Array) -> jax.Array:
    h = x.shape[-1] // 2
    return jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)


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


class Attention(nnx.Module):
    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(d, h * hd, bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        self.k_proj = Linear(d, kv * hd, bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        self.v_proj = Linear(d, kv * hd, bias=cfg.qkv_bias, cfg=cfg, rngs=rngs)
        self.o_proj = Linear(h * hd, d, bias=False, cfg=cfg, rngs=rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg=cfg)
            self.k_norm = RMSNorm(hd, cfg=cfg)
        self.qk_norm = cfg.qk_norm
        self.n_heads, self.n_kv, self.head_dim = h, kv, hd

    def __call__(self, x, cos, sin, mask, kv_cache=None, cache_index=None, taps=None):
        """x [B,T,d]; cos/sin [B,T,hd]; mask bool [B,T,S]; kv_cache (k, v) [B,S_max,n_kv,hd]."""
        b, t, _ = x.shape
        q = self.q_proj(x, _sub(taps, "q_proj")).reshape(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x, _sub(taps, "k_proj")).reshape(b, t, self.n_kv, self.head_dim)
        v = self.v_proj(x, _sub(taps, "v_proj")).reshape(b, t, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q, _sub(taps, "q_norm")), self.k_norm(k, _sub(taps, "k_norm"))
        c, s = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
        q = q * c + _rotate_half(q) * s
        k = k * c + _rotate_half(k) * s
        new_cache = None
        if kv_cache is not None:
            ck, cv = kv_cache
            idx = (0, cache_index, 0, 0)
            ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), idx)
            cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), idx)
            new_cache = (ck, cv)
            k, v = ck.astype(x.dtype), cv.astype(x.dtype)
        rep = self.n_heads // self.n_kv
        q = q.reshape(b, t, self.n_kv, rep, self.head_dim)  # HF repeat_kv: head = kv * rep + r
        scores = jnp.einsum("btkrd,bskd->bkrts", q, k, preferred_element_type=jnp.float32)
        scores = scores * (self.head_dim ** -0.5)
        scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        out = jnp.einsum("bkrts,bskd->btkrd", probs, v).reshape(b, t, self.n_heads * self.head_dim)
        return self.o_proj(out, _sub(taps, "o_proj")), new_cache


class MLP(nnx.Module):
    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        d, m = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(d, m, bias=False, cfg=cfg, rngs=rngs)
        self.up_proj = Linear(d, m, bias=False, cfg=cfg, rngs=rngs)
        self.down_proj = Linear(m, d, bias=False, cfg=cfg, rngs=rngs)

    def __call__(self, x, taps=None):
        gate, up = self.gate_proj(x, _sub(taps, "gate_proj")), self.up_proj(x, _sub(taps, "up_proj"))
        return self.down_proj(jax.nn.silu(gate) * up, _sub(taps, "down_proj"))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        self.self_attn = Attention(cfg, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg=cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg=cfg)

    def __call__(self, x, cos, sin, mask, kv_cache=None, cache_index=None, taps=None):
        a, new_cache = self.self_attn(self.input_layernorm(x, _sub(taps, "input_layernorm")), cos, sin, mask,
                                      kv_cache, cache_index, _sub(taps, "self_attn"))
        x = x + a
        h = self.post_attention_layernorm(x, _sub(taps, "post_attention_layernorm"))
        return x + self.mlp(h, _sub(taps, "mlp")), new_cache


class DecoderModel(nnx.Module):
    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, cfg=cfg, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg=cfg)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer key/value cache: ``k[i]``, ``v[i]`` are [B, S_max, n_kv, head_dim] in compute dtype.

    Slot ``j`` of the cache holds the key/value of the token written there by the call with
    ``cache_index <= j < cache_index + T``; slot validity is the caller's ``attention_mask``.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


def init_cache(config: DecoderConfig, batch: int, max_len: int, dtype: Any = None) -> KVCache:
    """Zero KV cache for ``batch`` rows of ``max_len`` slots (dtype defaults to the compute dtype)."""
    dt = dtype or config.jnp_compute_dtype
    shape = (batch, max_len, config.num_key_value_heads, config.head_dim)
    n = config.num_hidden_layers
    return KVCache(k=tuple(jnp.zeros(shape, dt) for _ in range(n)),
                   v=tuple(jnp.zeros(shape, dt) for _ in range(n)))


class DecoderForCausalLM(nnx.Module):
    """A causal LM of any registered family; parameters under HF names and layout (module docstring).

    Args:
        config: the architecture and dtypes (a family's :class:`DecoderConfig` subclass).
        rngs: ``nnx.Rngs`` for the N(0, 0.02) initialisation of linear/embedding weights.
        remat: rematerialise each decoder layer in the backward pass (gradient checkpointing).
    """

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs, remat: bool = False):
        self.config = config
        self.remat = remat
        self.model = DecoderModel(config, rngs=rngs)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, cfg=config, rngs=rngs)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, attention_mask: jax.Array,
                 cache: KVCache | None = None, cache_index: jax.Array | int | None = None,
                 stacked_layers: nnx.State | None = None, taps: Any = None) -> tuple[jax.Array, KVCache | None]:
        """Runs the decoder.

        Args:
            input_ids: [B, T] int32 token ids.
            positions: [B, T] int32 RoPE positions (see :func:`positions_from_mask`).
            attention_mask: without cache, [B, T] (1 = real token, left padding) combined with the
                causal mask; with cache, [B, S_max] validity of the cache slots (after this write).
            cache: a :class:`KVCache` from :func:`init_cache`, or None.
            cache_index: int32 scalar (may be traced): the T new tokens go to slots
                ``[cache_index, cache_index + T)``; query ``t`` sees valid slots ``j <= cache_index + t``.
            stacked_layers: the layers' parameters stacked (:func:`stack_layers`); with
                ``config.scan_layers`` the scan runs on them instead of the module's own layer
                parameters (which must then hold the same values); ignored otherwise.
            taps: None, or parameter-use taps (see :func:`forward`); not with a cache.

        Returns:
            (logits float32 [B, T, V], the updated cache or None).
        """
        cfg = self.config
        dt = cfg.jnp_compute_dtype
        b, t = input_ids.shape
        if taps is not None and cache is not None:
            raise ValueError("decoder taps (per-example sketches) take no KV cache")
        if taps is None:
            x = embed_apply(self.model.embed_tokens.weight[...], input_ids, dt)
        else:
            x = taps.sub("model", "embed_tokens").embed(self.model.embed_tokens.weight[...], input_ids, dt)
        # dynamic RoPE's frequencies depend on this forward's length, as transformers' dynamic_rope_update
        dynamic = cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "dynamic"
        seq_len = jnp.max(positions) + 1 if dynamic else None
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_inv_freq(seq_len),
                                cfg.rope_attention_scaling)
        valid = attention_mask.astype(bool)
        if cache is None:
            causal = jnp.tril(jnp.ones((t, t), bool))
            mask = causal[None] & valid[:, None, :]
        else:
            if cache_index is None:
                raise ValueError("cache_index is required when a cache is given")
            s_max = cache.k[0].shape[1]
            q_slot = jnp.asarray(cache_index, jnp.int32) + jnp.arange(t, dtype=jnp.int32)
            causal = jnp.arange(s_max, dtype=jnp.int32)[None, :] <= q_slot[:, None]
            mask = causal[None] & valid[:, None, :]
        if cfg.scan_layers:
            x, new_cache = self._scan_layers(x, cos, sin, mask, cache, cache_index, stacked_layers, taps)
        else:
            new_k, new_v = [], []
            for i, layer in enumerate(self.model.layers):
                kv = None if cache is None else (cache.k[i], cache.v[i])
                lt = _sub(taps, *LAYERS_PATH, i)
                if self.remat and cache is None and taps is not None:
                    x, c = nnx.remat(functools.partial(_tapped_layer, lt))(layer, x, cos, sin, mask, taps.carry())
                    taps.set_carry(c)
                elif self.remat and cache is None:
                    x, _ = nnx.remat(lambda lyr, *a: lyr(*a))(layer, x, cos, sin, mask)
                else:
                    x, nkv = layer(x, cos, sin, mask, kv, cache_index, lt)
                    if nkv is not None:
                        new_k.append(nkv[0])
                        new_v.append(nkv[1])
            new_cache = None if cache is None else KVCache(k=tuple(new_k), v=tuple(new_v))
        x = self.model.norm(x, _sub(taps, "model", "norm"))
        w = self.model.embed_tokens.weight if cfg.tie_word_embeddings else self.lm_head.weight
        if taps is not None:
            head = ("model", "embed_tokens") if cfg.tie_word_embeddings else ("lm_head",)
            return taps.sub(*head).head(x, w[...], dt), None
        return head_apply(x, w[...], dt), new_cache

    def _scan_layers(self, x, cos, sin, mask, cache, cache_index, stacked, taps=None):
        """The decoder layers as one ``lax.scan`` over their stacked parameters (``scan_layers``).

        The body is ``nnx.merge(layer graphdef, one layer's parameters)`` applied to the carry x;
        with ``remat`` and no cache it is ``jax.checkpoint``-ed saving nothing but its input (what
        ``nnx.remat`` does per layer unrolled). With a cache, the per-layer k/v enter as scan inputs
        (stacked [L, B, S_max, n_kv, hd]) and leave as scan outputs, unstacked into a KVCache. With
        ``taps`` the layer index enters as a scan input too (``taps.sub("model", "layers", i)``
        with a traced i).
        """
        layer_gd, _ = nnx.split(self.model.layers[0], nnx.Param)
        if stacked is None:
            stacked = jax.tree.map(lambda *a: jnp.stack(a),
                                   *[nnx.state(lyr, nnx.Param) for lyr in self.model.layers])

        def body(carry, xs):
            st, kv, i = xs
            if i is None:
                return nnx.merge(layer_gd, st)(carry, cos, sin, mask, kv, cache_index)
            h, c = carry
            return _tapped_layer(taps.sub(*LAYERS_PATH, i), nnx.merge(layer_gd, st), h, cos, sin, mask, c), None

        if cache is None:
            if self.remat:
                body = jax.checkpoint(body, prevent_cse=False, policy=jax.checkpoint_policies.nothing_saveable)
            if taps is None:
                return jax.lax.scan(body, x, (stacked, None, None))[0], None
            idx = jnp.arange(len(self.model.layers), dtype=jnp.int32)
            (x, c), _ = jax.lax.scan(body, (x, taps.carry()), (stacked, None, idx))
            taps.set_carry(c)
            return x, None
        x, (ks, vs) = jax.lax.scan(body, x, (stacked, (jnp.stack(cache.k), jnp.stack(cache.v)), None))
        n = len(cache.k)
        return x, KVCache(k=tuple(ks[i] for i in range(n)), v=tuple(vs[i] for i in range(n)))


def _tapped_layer(taps: Any, layer: DecoderLayer, x, cos, sin, mask, carry) -> tuple[jax.Array, Any]:
    """(output, carry) of ``layer`` with ``taps`` whose loop-carried state (``taps.carry()``: the
    fused sketcher's accumulators) enters as ``carry``: the form ``nnx.remat`` and ``lax.scan``
    need (what a tapped layer reads and writes goes in and out explicitly)."""
    taps.set_carry(carry)
    y, _ = layer(x, cos, sin, mask, None, None, taps)
    return y, taps.carry()


class StackedParams(NamedTuple):
    """The parameters of a decoder with its layers stacked (:func:`stack_layers`), accepted by
    :func:`forward` / :func:`forward_with_cache` in place of the ``nnx.State``.

    Attributes:
        rest: an ``nnx.State`` of every parameter outside ``model.layers`` (embedding, final norm,
            lm_head), paths as in the full state.
        layers: the ``nnx.State`` of one decoder layer (paths relative to the layer, e.g.
            ``("mlp", "up_proj", "weight")``) whose leaves are stacked over the layers: [L, *shape].

    Differentiating a loss with respect to a ``StackedParams`` gives the layer gradients stacked
    [L, ...] (the cotangent of the scan's inputs), with no per-layer slicing or re-stacking.
    """

    rest: Any
    layers: Any


LAYERS_PATH = ("model", "layers")  # NNX path of the decoder layers (HF "model.layers.{i}")


def stack_layers(params: nnx.State) -> StackedParams:
    """Splits a decoder's ``nnx.State`` into :class:`StackedParams`: the layer parameters stacked
    along a new leading axis [L, ...] (``jnp.stack``: a copy, sharded like the inputs), the others
    as they are. Works on arrays, tracers and ``jax.ShapeDtypeStruct`` leaves alike (the latter
    via ``jax.eval_shape`` by the caller).

    Raises:
        ValueError: when ``params`` has no ``model.layers`` entry.
    """
    flat = nnx.to_flat_state(params)
    rest = [(p, v) for p, v in flat if p[:2] != LAYERS_PATH]
    try:
        layers = params[LAYERS_PATH[0]][LAYERS_PATH[1]]
    except (KeyError, TypeError):
        raise ValueError("stack_layers: the parameters have no model.layers entry") from None
    n = len(layers)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *[layers[i] for i in range(n)])
    return StackedParams(nnx.from_flat_state(rest), stacked)


def unstack_layers(params: StackedParams) -> nnx.State:
    """The inverse of :func:`stack_layers`: the full ``nnx.State`` with per-layer parameters
    (slices of the stacked leaves)."""
    flat = list(nnx.to_flat_state(params.rest))
    layer_flat = nnx.to_flat_state(params.layers)
    n = int(jax.tree.leaves(params.layers)[0].shape[0])
    for i in range(n):
        flat += [(LAYERS_PATH + (i,) + p, jax.tree.map(lambda a, i=i: a[i], v)) for p, v in layer_flat]
    return nnx.from_flat_state(flat)


# ------------------------------------------------------------------------------------------------
# Pure-function entry points and helpers (every family)
# ------------------------------------------------------------------------------------------------


def forward(graphdef: nnx.GraphDef, params: nnx.State, input_ids: jax.Array, positions: jax.Array,
            attention_mask: jax.Array, taps: Any = None) -> jax.Array:
    """Pure forward for ``jax.jit`` / ``jax.grad``: the way other modules call the model.

    ``graphdef, params = nnx.split(model, nnx.Param)`` once; pass them here (params may be sharded,
    donated or differentiated). Shapes as in :meth:`DecoderForCausalLM.__call__` without cache.
    ``params`` may also be :class:`StackedParams` (:func:`stack_layers`): a ``scan_layers`` model
    then scans over the stacked leaves directly, so a gradient with respect to them comes out
    stacked [L, ...]; same logits either way.

    ``taps`` (default None: the plain forward) routes every use of a parameter through an object
    that computes the same values and may give the use its own backward pass (the fused
    per-example sketcher, ``sketch/fused.py``). Its methods: ``sub(*names)``, the taps of a
    submodule (names are NNX attribute names and layer indices; a scanned layer's index is a
    traced int32 scalar); ``linear(x, weight, bias, dtype)`` (:class:`Linear`; ``bias`` may be
    None); ``scale(weight, h)`` (:class:`RMSNorm`: ``weight.astype(h.dtype) * h``);
    ``embed(weight, ids, dtype)`` (``weight[ids].astype(dtype)``); ``head(x, weight, dtype)`` (the
    float32 logits ``x @ weight.T``; on the embedding's taps for a tied head); ``carry()`` /
    ``set_carry(c)``: the state the taps thread from use to use (a pytree of arrays), which the
    layer loops (``lax.scan``, ``nnx.remat``) pass in and out explicitly.

    Returns:
        logits float32 [B, T, V].
    """
    if isinstance(params, StackedParams):
        return _merge_stacked(graphdef, params)(input_ids, positions, attention_mask,
                                                stacked_layers=params.layers, taps=taps)[0]
    model = nnx.merge(graphdef, params)
    return model(input_ids, positions, attention_mask, taps=taps)[0]


def forward_with_cache(graphdef: nnx.GraphDef, params: nnx.State, input_ids: jax.Array,
                       positions: jax.Array, attention_mask: jax.Array, cache: KVCache,
                       cache_index: jax.Array) -> tuple[jax.Array, KVCache]:
    """Pure cached forward (prefill or decode step): returns (logits float32 [B, T, V], new cache).

    ``attention_mask`` is the [B, S_max] slot validity; see :meth:`DecoderForCausalLM.__call__`.
    """
    if isinstance(params, StackedParams):
        return _merge_stacked(graphdef, params)(input_ids, positions, attention_mask, cache, cache_index,
                                                stacked_layers=params.layers)
    model = nnx.merge(graphdef, params)
    return model(input_ids, positions, attention_mask, cache, cache_index)


def _merge_stacked(graphdef: nnx.GraphDef, params: StackedParams) -> "DecoderForCausalLM":
    """The model of ``graphdef`` on :class:`StackedParams`; its own layer parameters are slices of
    the stacked ones (for the module tree only: a ``scan_layers`` model runs on the stacked ones,
    so the slices are dead code)."""
    return nnx.merge(graphdef, unstack_layers(params))


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """RoPE positions for a left-padded batch: ``cumsum(mask) - 1`` clipped at 0; [B, T] int32."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0).astype(jnp.int32)


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """``log_softmax(logits)[b, t, tokens[b, t]]`` in float32; logits [B,T,V], tokens [B,T] -> [B,T].

    Callers align targets themselves (logits at t predict token t+1).
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def abstract_model(config: DecoderConfig, remat: bool = False) -> DecoderForCausalLM:
    """The family's model with ``jax.ShapeDtypeStruct`` leaves (``nnx.eval_shape``); allocates nothing."""
    cls = config.module_class()
    return nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), remat=remat))


def resolve_sharding(shardings: Any, path: tuple) -> jax.sharding.Sharding:
    """The sharding of the parameter at NNX ``path``.

    ``shardings`` is None (this process's first device: in a multi-process run every process gets
    its own copy, as an unsharded stage computes the same thing in each), one ``Sharding`` for all, a
    callable ``path -> Sharding``, or a dict / ``nnx.State`` keyed by NNX path (leaves ``Sharding`` or
    ``Variable(Sharding)``).
    """
    if shardings is None:
        return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(shardings, jax.sharding.Sharding):
        return shardings
    if callable(shardings):
        return shardings(path)
    if isinstance(shardings, nnx.State):
        shardings = dict(nnx.to_flat_state(shardings))
    s = shardings[path]
    return s.get_value() if isinstance(s, nnx.Variable) else s


def init_model(config: DecoderConfig, seed: int = 0, *, remat: bool = False,
               shardings: Any = None) -> DecoderForCausalLM:
    """A randomly initialised model, built in one jitted program (fast; straight into ``shardings``).

    Initialisation as the constructor: linear/embedding weights N(0, 0.02), biases 0, norms 1.
    ``shardings`` as in :func:`resolve_sharding`.
    """
    cls = config.module_class()
    graphdef, abstract = nnx.split(abstract_model(config, remat), nnx.Param)
    flat = [(path, v.replace(value=resolve_sharding(shardings, path))) for path, v in nnx.to_flat_state(abstract)]
    out_shardings = nnx.from_flat_state(flat)

    def make(key: jax.Array) -> nnx.State:
        return nnx.state(cls(config, rngs=nnx.Rngs(params=key), remat=remat), nnx.Param)

    return nnx.merge(graphdef, jax.jit(make, out_shardings=out_shardings)(jax.random.key(seed)))


def count_params(config: DecoderConfig) -> int:
    """Number of parameters (tied embeddings counted once), computed without allocating arrays."""
    state = nnx.state(abstract_model(config), nnx.Param)
    return int(sum(x.size for x in jax.tree.leaves(state)))
