"""The architecture config every decoder family shares and the reading of a family's HF ``config.json``.

:class:`DecoderConfig` holds the fields of HF ``config.json`` that matter (sizes, RoPE, dtypes, the
layer scan) with the class-level switches a family sets (``qkv_bias``, ``qk_norm``);
:func:`hf_layer_rows` the HF weight rows of one decoder layer; :func:`read_hf_config`,
:func:`check_hf_values`, :func:`common_kwargs` and :func:`read_family_config` read and check a HF
config (RoPE through ``models/rope.py``). The NNX modules built from a config are ``models/decoder.py``'s.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from behaviortrace_jax.io.files import read_json
from behaviortrace_jax.models.rope import ROPE_TYPES, RopeScaling, rope_parameters, rope_scaling_from_hf

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

    def module_class(self) -> type:
        """The family's NNX module class, ``models/decoder.DecoderForCausalLM`` or its subclass: each
        family's config subclass returns its own (``models/qwen2.py``, ``llama.py``, ``qwen3.py``), so
        this module imports no model code.

        Raises:
            NotImplementedError: on a config class that is no family's (this base class).
        """
        raise NotImplementedError(f"{type(self).__name__} is not a model family's config: use a family's "
                                  "subclass (models/families.py), whose module_class() names its module")

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
