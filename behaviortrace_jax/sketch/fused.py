"""The fused per-example sketcher: each example's CountSketch, exact gradient norms and the weighted
batch gradient of a decoder from ONE backward pass of the batched loss (SPEC §3.1, §3.2).

``vmap(grad(loss))`` (the generic path of :class:`sketcher.PerExampleSketcher`) forms every
example's whole gradient and then hashes it. A decoder's parameters are all used by a few kinds of
operation, and each example's gradient of one parameter can be formed from what the backward of the
batched loss ``sum_i l_i`` computes anyway (the examples are independent, so the cotangent that
reaches example i's rows is that of ``l_i`` alone):

* linear ``y = x W^T + b`` (q/k/v/o, MLP, untied lm_head): ``dW_i = sum_t dy_{i,t} x_{i,t}^T``,
  ``db_i = sum_t dy_{i,t}`` from the use's input x and output cotangent dy;
* RMSNorm scale ``y = w * h`` (layer norms, final norm, Qwen3's q/k norms): ``dw_i = sum dy_i * h_i``;
* embedding ``x = E[ids]``: ``dE_i`` is the rows ``dx_{i,t}`` at the token ids ``ids_{i,t}``,
  sketched from (ids, rows), never as a [V, d] array;
* tied embedding / lm_head: one parameter with two uses. Its sketch is the sum of both uses'
  sketches (CountSketch is linear); its squared norm is ``|H_i|^2 + 2 <E_i, H_i> + |E_i|^2`` with
  H_i the head part, where ``<E_i, H_i> = sum_t <dx_{i,t}, H_i[ids_{i,t}]>`` and the rows
  ``H_i[ids_{i,t}] = sum_s dlogits_{i,s,ids_{i,t}} h_{i,s}`` are passed from the head's backward to
  the embedding's through the cotangent of a zero "carrier" output of the embedding, and
  ``|E_i|^2 = sum_{t,t'} [ids_t = ids_t'] <dx_t, dx_t'>`` (repeated tokens share a row).

Each use is a ``jax.custom_vjp`` (:class:`Taps`, handed to ``decoder.forward(..., taps=)``) whose
forward is the decoder's own (``decoder.linear_apply`` etc.) and whose backward returns JAX's own
input cotangent, adds the per-example gradients' CountSketch to the cotangent of a zero
accumulator ``acc`` float32 [B, D] and their squared norms to that of a zero ``sq`` float32 [B, G]
(column = parameter group) - both threaded through every use in order (and through the scan over
the layers), so each use scatters into one running cotangent in place - and returns as the weight's
cotangent ``sum_i c_i dW_i`` for given
coefficients c [B]: c = 1 gives the batch gradient of ``sum_i l_i``, so one backward yields the
update and every sketch. Per-example gradients exist one parameter use at a time (large weights in
row tiles of at most ``tile_elements`` values for the whole batch) and are dropped after hashing.
The hash is the plan's hash family (``hash_families``: by default splitmix64 of the HF-order
global index, ``HashFamily.index_bucket_sign``), so the sketches equal ``vmap(grad)``'s up to float
rounding; under a scan over the layers the per-layer offsets are looked up with the traced layer
index. With a scatter-free family (``hash_families.BLOCK``) every weight, bias and scale block is
rolled in, with no scatter (its ``block_sketch``, ``block_hash.block_sketch_at``; a row tile that
starts inside a block is placed at its position in a zero-padded window). The embedding rows still
scatter, because they sit at the data-dependent coordinates of the example's tokens; that is
B x T x d values per chunk, against the parameters' P per example.

The losses it applies to are :class:`DecoderLoss` objects (e.g. ``sketcher.completion_loss``, the
GRPO step's rollout terms); any other ``loss(params, example)`` goes through ``vmap(grad)``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from behaviortrace_jax.models import decoder, tokenizer as tok_lib
from behaviortrace_jax.sketch import pallas_sketch
from behaviortrace_jax.sketch.hash_families import DEFAULT_HASH_FAMILY, HashFamily
from behaviortrace_jax.sketch.splitmix64 import check_dim, split_u64

PyTree = Any
F32 = jnp.float32
_U32 = jnp.uint32
TILE_ELEMENTS = 1 << 23  # per-example gradient values held at once per parameter use (32 MiB in float32)


@dataclasses.dataclass(frozen=True)
class DecoderLoss:
    """A per-example loss of a decoder in batched form, usable by both sketcher paths.

    ``per_example(params, batch, taps) -> float32 [B]``: the loss of each example of ``batch``
    (leaves with a leading axis B), computed with ``decoder.forward(graphdef, params, ...,
    taps=taps)``; it must reach ``params`` only through that forward (so every parameter use is
    tapped) and compute row i's loss from row i alone. Called with ``taps=None`` it is the plain loss.
    ``loss(params, example)`` (one example, no batch axis) is ``per_example`` on a batch of one:
    the generic ``vmap(grad)`` path's loss. Host ``input_ids`` (numpy) are checked against the
    embedding's rows (:func:`check_batch_ids`); traced ones are not.

    Raises:
        ValueError: a host token id outside ``[0, vocab_size)``, naming it (``tokenizer.check_token_ids``).
    """

    per_example: Callable[[PyTree, PyTree, Any], jax.Array]

    def __call__(self, params: PyTree, example: PyTree) -> jax.Array:
        check_batch_ids(example, vocab_rows(params), "DecoderLoss: example input_ids")
        return self.per_example(params, jax.tree.map(lambda x: x[None], example), None)[0]


def vocab_rows(params: PyTree) -> int | None:
    """The rows V of a decoder's ``model.embed_tokens.weight`` in ``params`` (arrays or
    ``ShapeDtypeStruct`` leaves); None where ``params`` is not a decoder's."""
    try:
        shape = getattr(params["model"]["embed_tokens"]["weight"], "shape", None)
    except (KeyError, TypeError, IndexError, AttributeError):
        return None
    return int(shape[0]) if shape else None


def check_batch_ids(batch: Any, vocab_size: int | None, where: str) -> None:
    """``tokenizer.check_token_ids`` of ``batch["input_ids"]`` when the batch is a dict holding
    them and ``vocab_size`` is known (host arrays only; a ``jax.Array`` passes unread)."""
    if vocab_size is not None and isinstance(batch, dict) and "input_ids" in batch:
        tok_lib.check_token_ids(batch["input_ids"], vocab_size, where)


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Static settings of one tapped use (hashable: the custom_vjp's non-differentiable argument)."""

    dim: int
    seed: int
    n_groups: int
    tile_elements: int
    weights: bool  # form the weight cotangent sum_i c_i dW_i (else None: sketches and norms only)
    dtype: str = "float32"  # the use's compute dtype
    tied: bool = False  # embedding: the head uses the same weight (carrier output); head: reads it
    head: bool = False  # the logits (decoder.head_apply) rather than a linear layer (decoder.linear_apply)
    hash_family: HashFamily = DEFAULT_HASH_FAMILY  # the hash family (hash_families; config sketch.hash)
    kernel: str = "xla"  # matmul weight uses: "xla", or the Pallas kernel "pallas" / "interpret" (pallas_sketch)


class FusedPlan:
    """Where each parameter's coordinates go: global offset (HF order) and group, by NNX path.

    Args:
        paths: NNX path of each parameter (``ParamOrder.paths``), in layout order.
        offsets: global index of each parameter's first coordinate (``ParamLayout.offsets``).
        groups: the group index of each parameter; n_groups: their number.
        dim, seed: CountSketch width and hash seed; tile_elements: see the module docstring.
        hash_family: the hash family (a ``hash_families.HashFamily``; config ``sketch.hash``).
        kernel: how matmul weight uses are sketched: "xla" (``_matrix_grads``' tiles in XLA), or
            the Pallas kernel ``pallas_sketch.matmul_sketch`` compiled ("pallas", TPU) or interpreted
            ("interpret", any backend) for the block family (config ``sketch.kernel``).
    Raises:
        ValueError: a decoder layer leaf missing from some layer (the layers must share leaves); a
            kernel other than "xla" with another family than the block one (``pallas_sketch.check_kernel``).
    """

    def __init__(self, paths, offsets, groups, n_groups: int, *, dim: int, seed: int,
                 tile_elements: int = TILE_ELEMENTS, hash_family: HashFamily = DEFAULT_HASH_FAMILY,
                 kernel: str = "xla"):
        self.dim, self.seed, self.n_groups = check_dim(dim), int(seed), int(n_groups)
        self.hash_family, self.kernel = hash_family, pallas_sketch.check_kernel(kernel, hash_family)
        self.tile_elements = int(tile_elements)
        self.static = {tuple(p): (int(o), int(g)) for p, o, g in zip(paths, offsets, groups)}
        n = len(decoder.LAYERS_PATH)
        per_leaf: dict[tuple, dict[int, tuple[int, int]]] = {}
        for p, (o, g) in self.static.items():
            if p[:n] == decoder.LAYERS_PATH and len(p) > n:
                per_leaf.setdefault(p[n + 1:], {})[int(p[n])] = (o, g)
        n_layers = max((len(d) for d in per_leaf.values()), default=0)
        self.layers = {}
        for leaf, d in per_leaf.items():
            if sorted(d) != list(range(n_layers)):
                raise ValueError(f"fused sketcher: layer leaf {'.'.join(map(str, leaf))} is not in every layer")
            hi, lo = split_u64([d[i][0] for i in range(n_layers)])
            self.layers[leaf] = (hi, lo, np.asarray([d[i][1] for i in range(n_layers)], np.int32))
        self.tied = ("lm_head", "weight") not in self.static

    def cfg(self, weights: bool) -> _Cfg:
        return _Cfg(self.dim, self.seed, self.n_groups, self.tile_elements, bool(weights), hash_family=self.hash_family,
                    kernel=self.kernel)

    def where(self, path: tuple) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(offset hi uint32, offset lo uint32, group int32) scalars of the parameter at ``path``; a
        decoder layer index may be traced (a scanned layer). Raises KeyError naming the path."""
        n = len(decoder.LAYERS_PATH)
        if len(path) > n and path[:n] == decoder.LAYERS_PATH and not isinstance(path[n], (int, np.integer)):
            if path[n + 1:] not in self.layers:
                raise KeyError(f"fused sketcher: layer parameter {path[n + 1:]} is not in the sketch's parameter order")
            hi, lo, g = self.layers[path[n + 1:]]
            i = path[n]
            return jnp.asarray(hi)[i], jnp.asarray(lo)[i], jnp.asarray(g)[i]
        if path not in self.static:
            raise KeyError(f"fused sketcher: parameter {path} used by the decoder is not in the sketch's "
                           f"parameter order")
        off, g = self.static[path]
        hi, lo = split_u64([off])
        return jnp.asarray(hi[0], _U32), jnp.asarray(lo[0], _U32), jnp.asarray(g, jnp.int32)


class _State:
    """What one forward's uses share: the threaded accumulators (acc, sq), the coefficients and the
    tied weight's carrier."""

    def __init__(self, acc: jax.Array, sq: jax.Array, coef: jax.Array):
        self.acc, self.sq, self.coef = acc, sq, coef
        self.carrier: dict[tuple, tuple[jax.Array, jax.Array]] = {}


class Taps:
    """The ``taps`` of ``decoder.forward`` for the fused sketcher (protocol: ``decoder.forward``).

    Every use reads the accumulators (acc [B, D], sq [B, G]) and returns them unchanged, so they
    run through the uses in forward order and their cotangents run back through the uses in
    backward order: each use adds its per-example sketches and squared norms to the cotangent it
    receives, in place, and passes it on. Where the decoder loops (``lax.scan`` over the layers,
    ``nnx.remat``) the accumulators are part of the loop carry: :meth:`carry` / :meth:`set_carry`.
    """

    def __init__(self, plan: FusedPlan, cfg: _Cfg, state: _State, prefix: tuple = ()):
        self.plan, self.cfg, self.state, self.prefix = plan, cfg, state, prefix

    def sub(self, *names: Any) -> "Taps":
        return Taps(self.plan, self.cfg, self.state, self.prefix + tuple(names))

    def carry(self) -> tuple[jax.Array, jax.Array]:
        """The accumulators, to thread through a loop or a rematerialised block."""
        return self.state.acc, self.state.sq

    def set_carry(self, carry: tuple[jax.Array, jax.Array]) -> None:
        self.state.acc, self.state.sq = carry

    def _where(self, leaf: str) -> tuple:
        return self.plan.where(self.prefix + (leaf,))

    def _use(self, fn: Callable, cfg: _Cfg, *args: Any) -> Any:
        out, self.state.acc, self.state.sq = fn(cfg, *args[:-1], self.state.acc, self.state.sq, self.state.coef,
                                                args[-1])
        return out

    def linear(self, x: jax.Array, weight: jax.Array, bias: jax.Array | None, dtype: Any) -> jax.Array:
        cfg = dataclasses.replace(self.cfg, dtype=jnp.dtype(dtype).name)
        where = (self._where("weight"), None if bias is None else self._where("bias"))
        return self._use(_linear, cfg, x, weight, bias, None, where)

    def head(self, x: jax.Array, weight: jax.Array, dtype: Any) -> jax.Array:
        carrier = self.state.carrier.get(self.prefix)
        cfg = dataclasses.replace(self.cfg, dtype=jnp.dtype(dtype).name, tied=carrier is not None, head=True)
        return self._use(_linear, cfg, x, weight, None, carrier, (self._where("weight"), None))

    def scale(self, weight: jax.Array, h: jax.Array) -> jax.Array:
        return self._use(_scale, self.cfg, weight, h, self._where("weight"))

    def embed(self, weight: jax.Array, ids: jax.Array, dtype: Any) -> jax.Array:
        cfg = dataclasses.replace(self.cfg, dtype=jnp.dtype(dtype).name, tied=self.plan.tied)
        out = self._use(_embed, cfg, weight, ids, self._where("weight"))
        if not cfg.tied:
            return out
        x, carrier = out
        self.state.carrier[self.prefix] = (carrier, ids)
        return x


# ------------------------------------------------------------------------------------------------
# Hashing per-example gradient blocks into the accumulator's cotangent
# ------------------------------------------------------------------------------------------------


SMALL_BLOCK = 4096  # per-example blocks up to this size are hashed in one scatter over the batch


def _sketch_into(acc: jax.Array, g: jax.Array, hi: jax.Array, lo: jax.Array, cfg: _Cfg, first: Any = 0,
                 aligned: bool | None = None) -> jax.Array:
    """``acc`` float32 [B, D] plus, in row b, the sketch of ``g[b]`` (float32 [B, n]): coordinates
    ``first .. first + n - 1`` (int or traced uint32) of the parameter whose first coordinate has
    global index ``offset`` = (hi, lo). A family summed with a scatter: the hash
    (``index_bucket_sign``) is computed once for the B rows; a small block is one scatter over the
    batch, a large one is scattered row by row in place (each row's random writes stay within its D
    buckets). A scatter-free family: its ``block_sketch`` for the whole batch (``aligned``:
    ``first`` is a multiple of D), no scatter."""
    family = cfg.hash_family
    if family.scatter_free:
        return acc + family.block_sketch(g, hi, lo, first, cfg.dim, cfg.seed, aligned=aligned)
    bsz, n = g.shape
    local = jax.lax.iota(_U32, n)
    if not (isinstance(first, int) and first == 0):
        start = jnp.asarray(np.uint32(first)) if isinstance(first, int) else jnp.asarray(first).astype(_U32)
        local = local + start  # first + n < 2**32 (checked by the callers)
    bucket, sign = family.index_bucket_sign(hi, lo, local, cfg.dim, cfg.seed)
    if n <= SMALL_BLOCK:
        return acc.at[jnp.arange(bsz)[:, None], bucket[None, :]].add(g * sign)
    return jax.lax.fori_loop(0, bsz, lambda b, a: a.at[b].set(a[b].at[bucket].add(g[b] * sign)), acc)


def _add_sq(sq: jax.Array, norms2: jax.Array, group: jax.Array) -> jax.Array:
    """``sq`` float32 [B, G] plus the per-example squared norms ``norms2`` [B] in column ``group``."""
    return sq.at[:, group].add(norms2)


def _weighted(coef: jax.Array, g: jax.Array) -> jax.Array:
    """``sum_b coef[b] * g[b]`` in float32 (g [B, ...])."""
    return jnp.tensordot(coef.astype(F32), g, axes=1)


def _matrix_grads(cfg: _Cfg, acc: jax.Array, sq: jax.Array, dy: jax.Array, x: jax.Array, coef: jax.Array,
                  where: tuple, shape: tuple) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Per-example gradients ``dW_i = dy_i^T x_i`` of a weight [out, in] (dy [B, N, out], x [B, N, in]),
    in row tiles of at most ``cfg.tile_elements`` values over the batch, added to the accumulators'
    cotangents: (acc, sq, ``sum_i c_i dW_i`` float32 [out, in] or None). With ``cfg.kernel`` and a
    shape the kernel takes, ``pallas_sketch.matmul_sketch`` does it all with the tiles on chip."""
    out, inn = shape
    bsz = dy.shape[0]
    hi, lo, group = where
    if cfg.kernel != "xla" and pallas_sketch.kernel_supported(shape, cfg.dim):  # the tiles stay on chip
        acc, norms2, dw = pallas_sketch.matmul_sketch(acc, x, dy, coef if cfg.weights else None, hi, lo, cfg.dim,
                                                      cfg.seed, interpret=cfg.kernel == "interpret")
        return acc, _add_sq(sq, norms2, group), dw
    tiles = max(1, -(-bsz * out * inn // cfg.tile_elements))
    rows = -(-out // tiles)
    tiles = -(-out // rows)

    def block(acc: jax.Array, sq: jax.Array, dy_rows: jax.Array, first: Any) -> tuple:
        g = jnp.einsum("bnr,bni->bri", dy_rows, x, preferred_element_type=F32)
        aligned = None if isinstance(first, int) else (rows * inn) % cfg.dim == 0
        acc = _sketch_into(acc, g.reshape(bsz, -1), hi, lo, cfg, first, aligned)
        sq = _add_sq(sq, jnp.sum(jnp.square(g), axis=(1, 2)), group)
        return acc, sq, (_weighted(coef, g) if cfg.weights else None)

    if tiles == 1:
        return block(acc, sq, dy, 0)
    if tiles * rows * inn >= 1 << 32:
        raise ValueError(f"fused sketcher: a parameter of shape {shape} has more than 2**32 coordinates")
    dy = jnp.pad(dy, ((0, 0), (0, 0), (0, tiles * rows - out)))  # zero rows: they add nothing

    def body(carry: tuple, t: jax.Array) -> tuple:
        dy_rows = jax.lax.dynamic_slice_in_dim(dy, t * rows, rows, axis=2)
        acc, sq, dw = block(*carry, dy_rows, t.astype(_U32) * (rows * inn))
        return (acc, sq), dw

    (acc, sq), dw = jax.lax.scan(body, (acc, sq), jnp.arange(tiles, dtype=jnp.int32))
    return acc, sq, (dw.reshape(tiles * rows, inn)[:out] if cfg.weights else None)


# ------------------------------------------------------------------------------------------------
# The tapped uses: forward = the decoder's own op (and the accumulators unchanged); backward = its
# input cotangent, the weights' cotangent sum_i c_i dW_i, and the accumulators' cotangents plus
# this use's per-example sketches and squared norms
# ------------------------------------------------------------------------------------------------


def _apply_linear(cfg: _Cfg, x: jax.Array, weight: jax.Array, bias: jax.Array | None) -> jax.Array:
    dt = jnp.dtype(cfg.dtype)
    return decoder.head_apply(x, weight, dt) if cfg.head else decoder.linear_apply(x, weight, bias, dt)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _linear(cfg: _Cfg, x, weight, bias, carrier, acc, sq, coef, where):
    """A linear layer (``decoder.linear_apply``) or the logits (``cfg.head``: ``decoder.head_apply``;
    ``carrier`` = (zeros, ids) from a tied embedding, else None). Returns (y, acc, sq)."""
    del carrier, coef, where
    return _apply_linear(cfg, x, weight, bias), acc, sq


def _linear_fwd(cfg, x, weight, bias, carrier, acc, sq, coef, where):
    ids = None if carrier is None else carrier[1]
    return (_apply_linear(cfg, x, weight, bias), acc, sq), (x, weight, bias, coef, where, ids)


def _linear_bwd(cfg, res, cts):
    x, weight, bias, coef, (w_where, b_where), ids = res
    dy, acc, sq = cts
    dt = jnp.dtype(cfg.dtype)
    (dx,) = jax.vjp(lambda x_: _apply_linear(cfg, x_, weight, bias), x)[1](dy)
    bsz, out, inn = dy.shape[0], weight.shape[0], weight.shape[1]
    dy2, x2 = dy.reshape(bsz, -1, out), x.astype(dt).reshape(bsz, -1, inn)
    acc, sq, dw = _matrix_grads(cfg, acc, sq, dy2, x2, coef, w_where, weight.shape)
    db = None
    if bias is not None:
        gb = jnp.sum(dy2.astype(F32), axis=1)  # [B, out]
        acc = _sketch_into(acc, gb, b_where[0], b_where[1], cfg)
        sq = _add_sq(sq, jnp.sum(jnp.square(gb), axis=1), b_where[2])
        db = _weighted(coef, gb).astype(bias.dtype) if cfg.weights else None
    carrier_ct = None
    if ids is not None:  # the head part's rows at the example's own tokens: H_i[ids_{i,t}] [B, T, d]
        at_ids = jnp.take_along_axis(dy, jnp.broadcast_to(ids[:, None, :], dy.shape[:2] + ids.shape[1:]), axis=2)
        carrier_ct = (jnp.einsum("bst,bsd->btd", at_ids.astype(F32), x.astype(F32)), None)
    dw = None if dw is None else dw.astype(weight.dtype)
    return dx, dw, db, carrier_ct, acc, sq, None, None


_linear.defvjp(_linear_fwd, _linear_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scale(cfg: _Cfg, weight, h, acc, sq, coef, where):
    """An RMSNorm scale ``decoder.scale_apply(weight, h)`` (weight [d], h [B, ..., d]); (y, acc, sq)."""
    del cfg, coef, where
    return decoder.scale_apply(weight, h), acc, sq


def _scale_fwd(cfg, weight, h, acc, sq, coef, where):
    del cfg
    return (decoder.scale_apply(weight, h), acc, sq), (weight, h, coef, where)


def _scale_bwd(cfg, res, cts):
    weight, h, coef, where = res
    dy, acc, sq = cts
    (dh,) = jax.vjp(lambda h_: decoder.scale_apply(weight, h_), h)[1](dy)
    bsz, d = h.shape[0], h.shape[-1]
    g = jnp.sum(dy.astype(F32).reshape(bsz, -1, d) * h.astype(F32).reshape(bsz, -1, d), axis=1)  # [B, d]
    acc = _sketch_into(acc, g, where[0], where[1], cfg)
    sq = _add_sq(sq, jnp.sum(jnp.square(g), axis=1), where[2])
    dw = _weighted(coef, g).astype(weight.dtype) if cfg.weights else None
    return dw, dh, acc, sq, None, None


_scale.defvjp(_scale_fwd, _scale_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _embed(cfg: _Cfg, weight, ids, acc, sq, coef, where):
    """The embedding rows ``decoder.embed_apply(weight, ids, dtype)`` (with ``cfg.tied``, also a zero
    float32 carrier [B, T, d] whose cotangent, from the tied head, is ``H_i[ids_{i,t}]``); (out, acc, sq)."""
    del coef, where
    x = decoder.embed_apply(weight, ids, jnp.dtype(cfg.dtype))
    return ((x, jnp.zeros(x.shape, F32)) if cfg.tied else x), acc, sq


def _embed_fwd(cfg, weight, ids, acc, sq, coef, where):
    return _embed(cfg, weight, ids, acc, sq, coef, where), (weight, ids, coef, where)


def _embed_bwd(cfg, res, cts):
    weight, ids, coef, (hi, lo, group) = res
    ct, acc, sq = cts
    dx, head_rows = ct if cfg.tied else (ct, None)
    r = dx.astype(F32)  # [B, T, d]: example i's gradient rows, at its token ids
    bsz, d = r.shape[0], r.shape[-1]
    local = ids.astype(_U32)[..., None] * jnp.asarray(d, _U32) + jax.lax.iota(_U32, d)
    # the rows sit at data-dependent coordinates, so both families scatter these B x T x d values
    # (a scatter-free family's too: its index_bucket_sign, e.g. the block family's block offset + position)
    bucket, sign = cfg.hash_family.index_bucket_sign(hi, lo, local, cfg.dim, cfg.seed)
    acc = acc.at[jnp.arange(bsz)[:, None, None], bucket].add(r * sign)
    same = (ids[:, :, None] == ids[:, None, :]).astype(F32)  # a token's rows add up in one row of E
    norms2 = jnp.einsum("bts,btd,bsd->b", same, r, r)
    if head_rows is not None:
        norms2 = norms2 + 2.0 * jnp.einsum("btd,btd->b", head_rows, r)
    dw = None
    if cfg.weights:
        dw = jnp.zeros(weight.shape, F32).at[ids].add(r * coef.astype(F32)[:, None, None]).astype(weight.dtype)
    return dw, None, acc, _add_sq(sq, norms2, group), None, None


_embed.defvjp(_embed_fwd, _embed_bwd)


# ------------------------------------------------------------------------------------------------
# The fused backward
# ------------------------------------------------------------------------------------------------


def fused_grads(plan: FusedPlan, loss: DecoderLoss, params: PyTree, batch: PyTree, coef: jax.Array | None = None
                ) -> tuple[jax.Array, PyTree | None, jax.Array, jax.Array]:
    """One forward and one backward of ``sum_i loss_i`` over ``batch`` (traceable).

    Args:
        plan: the :class:`FusedPlan` of the parameters' order.
        loss: a :class:`DecoderLoss`; params: its parameters (``nnx.State`` or ``decoder.StackedParams``).
        batch: pytree of arrays with a leading axis B.
        coef: float [B] weights of the gradient sum, or None for no sum (sketches and norms only).
    Returns:
        (losses float32 [B], ``sum_i coef_i * grad loss_i`` in the structure and dtypes of ``params``
        or None, sketches float32 [B, D] of each ``grad loss_i``, squared gradient norms float32
        [B, n_groups] per parameter group).
    """
    bsz = jax.tree.leaves(batch)[0].shape[0]
    cfg = plan.cfg(weights=coef is not None)
    c = jnp.zeros((bsz,), F32) if coef is None else jnp.asarray(coef, F32)

    def total(p: PyTree, acc: jax.Array, sq: jax.Array) -> tuple[jax.Array, jax.Array]:
        losses = loss.per_example(p, batch, Taps(plan, cfg, _State(acc, sq, c)))
        return jnp.sum(losses), losses

    acc, sq = jnp.zeros((bsz, plan.dim), F32), jnp.zeros((bsz, plan.n_groups), F32)
    # params are differentiated even without a sum (their cotangents are then zeros, dead code for
    # XLA): a model merged from non-differentiated outer tracers cannot pass through nnx.remat.
    (_, losses), (grads, sk, sqn) = jax.value_and_grad(total, argnums=(0, 1, 2), has_aux=True)(params, acc, sq)
    return losses.astype(F32), (None if coef is None else grads), sk, sqn
