"""The decoder-only transformer every model family shares (Qwen2, Llama, Qwen3), in Flax NNX.

One module tree with switches read from the family's config class: ``qkv_bias`` (Qwen2's q/k/v
biases), ``qk_norm`` (Qwen3's per-head RMSNorm of q and k before RoPE) and the RoPE inverse
frequencies and cos/sin scale (:meth:`DecoderConfig.rope_inv_freq`, :attr:`DecoderConfig.rope_attention_scaling`:
default, linear, dynamic, yarn or llama3, read from HF config.json as transformers reads it,
``models/rope.py``). The config (:class:`DecoderConfig`, HF ``config.json`` reading) lives in
``models/decoder_config.py`` and RoPE in ``models/rope.py``; both are re-exported here. A family
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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from behaviortrace_jax.models.decoder_config import (  # noqa: F401 - re-exported: the decoder's config API
    DecoderConfig, check_hf_values, common_kwargs, hf_layer_rows, read_family_config, read_hf_config)
from behaviortrace_jax.models.rope import (  # noqa: F401 - re-exported: RoPE, as the families import it
    DEFAULT_ROPE_THETA, ROPE_TYPES, RopeScaling, default_inv_freq, rope_cos_sin, rope_parameters,
    rope_scaling_from_hf)


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
        remat: rematerialise each decoder layer in the backward pass (gradient checkpointing):
            False, True (save nothing but the layer's input) or a name of :data:`REMAT_POLICIES`
            (what a layer's backward keeps, :func:`remat_policy`).
    """

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs, remat: bool | str = False):
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
                    policy = None if self.remat is True else remat_policy(self.remat)
                    x, _ = nnx.remat(lambda lyr, *a: lyr(*a), policy=policy)(layer, x, cos, sin, mask)
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
        with ``remat`` and no cache it is ``jax.checkpoint``-ed with :func:`remat_policy` (True: saving
        nothing but its input, what ``nnx.remat`` does per layer unrolled). With a cache, the per-layer k/v enter as scan inputs
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
                body = jax.checkpoint(body, prevent_cse=False, policy=remat_policy(self.remat))
            if taps is None:
                return jax.lax.scan(body, x, (stacked, None, None))[0], None
            idx = jnp.arange(len(self.model.layers), dtype=jnp.int32)
            (x, c), _ = jax.lax.scan(body, (x, taps.carry()), (stacked, None, idx))
            taps.set_carry(c)
            return x, None
        x, (ks, vs) = jax.lax.scan(body, x, (stacked, (jnp.stack(cache.k), jnp.stack(cache.v)), None))
        n = len(cache.k)
        return x, KVCache(k=tuple(ks[i] for i in range(n)), v=tuple(vs[i] for i in range(n)))


# Rematerialisation policies of a decoder layer by name (``jax.checkpoint_policies``): what a layer's
# backward keeps from its forward; everything else is recomputed.
REMAT_POLICIES: dict[str, Any] = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,  # only the layer's input (True)
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # the projections' outputs
    "dots_saveable": jax.checkpoint_policies.dots_saveable,  # every matmul's output (attention scores too)
}


def remat_policy(remat: bool | str) -> Any:
    """The ``jax.checkpoint`` policy of a decoder's ``remat``: True = ``nothing_saveable``, a name of
    :data:`REMAT_POLICIES` = that policy.

    Raises:
        ValueError: an unknown policy name (lists the known ones).
    """
    name = "nothing_saveable" if remat is True else str(remat)
    if name not in REMAT_POLICIES:
        raise ValueError(f"remat policy {name!r}: expected True or one of {sorted(REMAT_POLICIES)}")
    return REMAT_POLICIES[name]


def with_remat(graphdef: nnx.GraphDef, params: nnx.State, remat: bool | str) -> nnx.GraphDef:
    """The graphdef of the same decoder (``graphdef`` of ``nnx.split(model, nnx.Param)``, ``params``
    its state: arrays or ``jax.ShapeDtypeStruct``) with ``remat`` set (False, True or a
    :data:`REMAT_POLICIES` name); same parameter tree, so the same ``params`` run in it.

    Raises:
        ValueError: an unknown policy name.
    """
    if remat and remat is not True:
        remat_policy(remat)
    model = nnx.merge(graphdef, params)
    model.remat = remat
    return nnx.split(model, nnx.Param)[0]


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


def masked_mean_logprob(graphdef: nnx.GraphDef, params: nnx.State, input_ids: jax.Array, attention_mask: jax.Array,
                        mask: jax.Array, taps: Any = None) -> jax.Array:
    """Each sequence's masked mean token log-prob, float32 [B]: ``sum_t lp_t m_t / max(sum_t m_t, 1)``
    with ``lp_t = log p(input_ids[t] | input_ids[:t])`` and ``m = mask[:, 1:]`` (token t scored where
    ``mask[t]`` = 1; the first token is never scored). The one home of this formula: SPEC §3.2's
    rollout loss is its negative (``sketch.sketcher.completion_loss``), the forced targets' fluency
    and the replay's behaviour measure are it (``sketch.targets.ForcedSketcher.mean_logprob``,
    ``train/measures.py``). A sequence with no scored token gets 0.

    The GRPO loss's masked mean (``train.grpo_loss.masked_mean``, ``sum / (sum(mask) + 1e-8)`` over the
    completion positions only, SPEC §2.2 f) is another formula and stays there.

    Args:
        input_ids: int32 [B, T]; attention_mask: int [B, T] (1 = real token, left or right padding);
        mask: [B, T] float weights of the scored tokens (cast to float32); taps: as :func:`forward`.
    """
    logits = forward(graphdef, params, input_ids, positions_from_mask(attention_mask), attention_mask, taps=taps)
    lp = token_logprobs(logits[:, :-1], input_ids[:, 1:])
    m = mask[:, 1:].astype(jnp.float32)
    return jnp.sum(lp * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)


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
