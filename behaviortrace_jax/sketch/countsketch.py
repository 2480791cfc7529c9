"""The v3 gradient embedding: a CountSketch over HF-ordered parameters (SPEC §3.1).

Coordinate ``i`` of the concatenated, row-major-flattened gradient (parameters in Hugging Face
``model.parameters()`` order, ``ParamLayout.offsets``) is added, times its sign, to its bucket:

    sketch[bucket(i)] += sign(i) * float32(g_i)

with (bucket, sign) given by the hash family (``hash_families.py``; config ``sketch.hash``): by
default splitmix64 of ``i + seed`` (``splitmix64.py``, SPEC §3.1), summed with a scatter-add; a
scatter-free family (the ``block`` family, ``block_hash.py``) sketches each parameter with its own
``block_sketch`` instead. :func:`numpy_countsketch` (splitmix64) and :func:`numpy_sketch` (any
family: an explicit per-coordinate bucket and a bincount) are the plain numpy references. Hash
tables (``hash_tables.py``) can stand in for the hash of a family summed with a scatter.

Example::

    layout = ParamLayout.from_entries([("w", (3, 4)), ("b", (4,))])
    s = jax.jit(lambda g: sketch_tree(g, layout, 2**16, 0))([gw, gb])   # float32[65536]
    assert np.allclose(s, numpy_countsketch(np.concatenate([gw.ravel(), gb]), 2**16, 0), rtol=1e-6)
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from behaviortrace_jax.sketch.hash_families import DEFAULT_HASH_FAMILY, HashFamily
from behaviortrace_jax.sketch.param_layout import ParamLayout, StackedLayout
from behaviortrace_jax.sketch.splitmix64 import MASK64, U32, check_dim, numpy_bucket_sign, split_u64
from behaviortrace_jax.sketch.hash_tables import check_tables, table_bucket_sign

_NP_BLOCK = 1 << 23  # numpy reference works in blocks of 8M coordinates (as the torch code)
# Consecutive parameters hashed at once (a family with ``global_index``): up to this many coordinates
# per segment, 128 MiB of buckets and signs; a larger parameter is a segment of its own.
HASH_SEGMENT = 1 << 24


# ------------------------------------------------------------------------------------------------
# numpy references
# ------------------------------------------------------------------------------------------------


def numpy_countsketch(vec: np.ndarray, dim: int, seed: int = 0, offset: int = 0) -> np.ndarray:
    """Reference splitmix64 CountSketch of a flat vector whose first entry has global index ``offset``.

    Args:
        vec: any array; flattened row-major and cast to float32.
        dim: sketch width D (power of two).
        seed: hash seed (SPEC: 0).
        offset: global index of ``vec[0]`` (Python int, may exceed 2**32).
    Returns:
        float32[D]. Accumulated in float64 (``np.bincount``, blocks of 8M coordinates) and rounded
        once, so it is a slightly more accurate reference than float32 accumulation.
    """
    v = np.asarray(vec).reshape(-1).astype(np.float32)
    dim, offset = check_dim(dim), int(offset)
    if not 0 <= offset <= MASK64:
        raise ValueError(f"offset must be in [0, 2**64), got {offset}")
    out = np.zeros(dim, np.float64)
    for s in range(0, v.size, _NP_BLOCK):
        blk = v[s:s + _NP_BLOCK]
        with np.errstate(over="ignore"):
            idx = np.arange(blk.size, dtype=np.uint64) + np.uint64((offset + s) & MASK64)
        bucket, sign = numpy_bucket_sign(idx, dim, seed)
        out += np.bincount(bucket, (sign * blk).astype(np.float64), minlength=dim)
    return out.astype(np.float32)


def numpy_sketch(arrays: Sequence[np.ndarray], dim: int, seed: int = 0,
                 hash_family: HashFamily = DEFAULT_HASH_FAMILY) -> np.ndarray:
    """Reference sketch float32[dim] of a gradient given as arrays in layout (HF) order (SPEC §3.1).

    Each array is flattened row-major (float32) and hashed as coordinates ``local`` of a parameter
    at global offset ``offset_k`` (the summed sizes of the preceding arrays) with
    ``hash_family.numpy_bucket_sign``, accumulated in float64 with ``np.bincount`` and rounded once.
    An explicit per-coordinate bucket + bincount, independent of a scatter-free family's
    ``block_sketch``.
    """
    dim, offset = check_dim(dim), 0
    out = np.zeros(dim, np.float64)
    for a in arrays:
        v = np.asarray(a).reshape(-1).astype(np.float32)
        for s in range(0, v.size, _NP_BLOCK):
            blk = v[s:s + _NP_BLOCK]
            local = np.arange(s, s + blk.size, dtype=np.uint64)
            bucket, sign = hash_family.numpy_bucket_sign(local, offset, dim, seed)
            out += np.bincount(bucket, (sign * blk).astype(np.float64), minlength=dim)
        offset += v.size
    return out.astype(np.float32)


# ------------------------------------------------------------------------------------------------
# JAX: the sketch of a gradient list in layout order
# ------------------------------------------------------------------------------------------------


def _static_u32(offset: int) -> tuple[jax.Array, jax.Array]:
    hi, lo = split_u64([offset])
    return jnp.asarray(hi[0]), jnp.asarray(lo[0])


def _param_bucket_sign(k: int, layout: ParamLayout, dim: int, seed: int, tables: Sequence[jax.Array] | None,
                       hash_family: HashFamily) -> tuple[jax.Array, jax.Array]:
    """(bucket int32[n_k], sign float32[n_k]) of every coordinate of parameter ``k``."""
    if tables is None:
        return hash_family.index_bucket_sign(*_static_u32(layout.offsets[k]), jax.lax.iota(U32, layout.sizes[k]),
                                             dim, seed)
    return table_bucket_sign(tables[k].reshape(-1), dim)


def hash_segments(sizes: Sequence[int], limit: int = HASH_SEGMENT) -> list[list[int]]:
    """The indices of the non-empty parameters (``sizes[k] > 0``), in order, cut into runs of
    consecutive parameters of at most ``limit`` coordinates in all; a parameter larger than
    ``limit`` is a run of its own. E.g. ``hash_segments([4, 0, 4, 9], 8) == [[0, 2], [3]]``."""
    runs: list[list[int]] = []
    total = 0
    for k, n in enumerate(sizes):
        if not n:
            continue
        if runs and total + n <= limit:
            runs[-1].append(k)
            total += n
        else:
            runs.append([k])
            total = n
    return runs


_Run = tuple[list[int], jax.Array, jax.Array]  # (members, bucket int32[n], sign float32[n]) of one hash


def _hash_runs(sizes: Sequence[int], rel: Sequence[int], base: int | tuple[Any, Any], dim: int, seed: int,
               hash_family: HashFamily) -> list[_Run]:
    """One hash per :func:`hash_segments` run of consecutive non-empty arrays: array m holds
    ``sizes[m]`` coordinates from global index ``base + rel[m]`` (``rel`` static ints, increasing by
    ``sizes``; ``base`` a static int, or (hi, lo) uint32 scalars, possibly traced: a scanned
    layer's offset). Returns (the run's array indices m, bucket, sign) over the run's coordinates.
    Only for a family with ``global_index``."""
    out = []
    for run in hash_segments(sizes):
        start, n = rel[run[0]], rel[run[-1]] + sizes[run[-1]] - rel[run[0]]
        if isinstance(base, int):
            bucket, sign = hash_family.index_bucket_sign(*_static_u32(base + start), jax.lax.iota(U32, n), dim, seed)
        else:
            if start + n >= 1 << 32:
                raise ValueError(f"hash segment of {n} coordinates at {start} past a traced offset exceeds 2**32")
            local = jax.lax.iota(U32, n) + np.uint32(start) if start else jax.lax.iota(U32, n)
            bucket, sign = hash_family.index_bucket_sign(*base, local, dim, seed)
        out.append((run, bucket, sign))
    return out


def _layout_hash_runs(layout: ParamLayout, dim: int, seed: int, tables: Sequence[jax.Array] | None,
                      hash_family: HashFamily) -> list[_Run]:
    """The hashes of the non-empty parameters of ``layout``, as (members, bucket, sign) with members
    indexing the non-empty parameters in layout order.

    With tables, or a family without ``global_index``, one hash per parameter. Otherwise one hash per
    :func:`hash_segments` run of consecutive parameters (their global indices): the same buckets and
    signs, but XLA compiles one hash and one scatter per run instead of one per parameter (a 2-layer
    Qwen2's two-backward GRPO step: ~21,000 -> ~5,000 lines of StableHLO)."""
    live = [k for k in range(len(layout)) if layout.sizes[k]]
    if tables is not None or not hash_family.global_index:
        return [([m], *_param_bucket_sign(k, layout, dim, seed, tables, hash_family)) for m, k in enumerate(live)]
    return _hash_runs([layout.sizes[k] for k in live], [layout.offsets[k] for k in live], 0, dim, seed, hash_family)


def _scatter_runs(acc: jax.Array, flat: Sequence[jax.Array], runs: Sequence[_Run]) -> jax.Array:
    """``acc`` float32 [D] plus the signed scatter-add of the flat arrays ``flat`` (one example's
    non-empty parameters, any float dtype) run by run: a run's arrays are concatenated in order, so
    its coordinates are added in the same order as one scatter per array would add them."""
    for members, bucket, sign in runs:
        parts = [flat[m].reshape(-1).astype(jnp.float32) for m in members]
        acc = acc.at[bucket].add((parts[0] if len(parts) == 1 else jnp.concatenate(parts)) * sign)
    return acc


def _scatter_free_add(acc: jax.Array, gs: Sequence[jax.Array], offsets: Sequence[tuple[Any, Any]], dim: int,
                      seed: int, hash_family: HashFamily) -> jax.Array:
    """``acc`` float32 [C, dim] plus the scatter-free family's sketches of the flat [C, n_k] arrays
    ``gs``, each a whole parameter whose first global index is ``offsets[k]`` = (hi, lo) uint32 scalars."""
    for g, (hi, lo) in zip(gs, offsets):
        acc = acc + hash_family.block_sketch(g, hi, lo, 0, dim, seed)
    return acc


def sketch_tree(grads: Sequence[jax.Array], layout: ParamLayout, dim: int, seed: int = 0,
                tables: Sequence[jax.Array] | None = None, hash_family: HashFamily = DEFAULT_HASH_FAMILY
                ) -> jax.Array:
    """CountSketch of one gradient given as arrays in layout (HF) order (SPEC §3.1); jittable.

    Args:
        grads: one array per layout entry, shapes as in the layout, any float dtype (cast to
            float32 before the signed scatter-add).
        layout: the :class:`ParamLayout` (static).
        dim, seed: sketch width (power of two) and hash seed (static).
        tables: optional ``hash_tables.layout_tables`` for ``(layout, dim, seed, hash_family)``; default
            hashes on the fly.
        hash_family: the hash family (``hash_families``; config ``sketch.hash``); a scatter-free
            one sketches each parameter with its ``block_sketch`` and takes no tables. A family with
            ``global_index`` (splitmix64) is hashed and scattered once per :func:`hash_segments`
            run of consecutive parameters (concatenated in order: the same additions in the same
            order as one scatter per parameter).
    Returns:
        float32[dim] = sum over parameters of ``segment_sum(sign * g.ravel(), bucket, dim)``.
    Raises:
        ValueError: wrong number of arrays, a shape mismatch (naming the parameter), a bad dim,
            tables with a scatter-free family.
    """
    dim = check_dim(dim)
    if check_tables(hash_family, tables is not None).scatter_free:
        return sketch_batch([g[None] for g in grads], layout, dim, seed, hash_family=hash_family)[0]
    layout.check(grads)
    live = [g for k, g in enumerate(grads) if layout.sizes[k]]
    return _scatter_runs(jnp.zeros((dim,), jnp.float32), live,
                         _layout_hash_runs(layout, dim, seed, tables, hash_family))


def sketch_batch(grads: Sequence[jax.Array], layout: ParamLayout, dim: int, seed: int = 0,
                 tables: Sequence[jax.Array] | None = None, hash_family: HashFamily = DEFAULT_HASH_FAMILY
                 ) -> jax.Array:
    """Per-example CountSketch of a batch of gradients; arrays in layout order with a leading axis C.

    Returns float32[C, dim]; row c equals ``sketch_tree([g[c] for g in grads], ...)``. The hash is
    computed once per call (per :func:`hash_segments` run, as :func:`sketch_tree`) and the examples
    are scattered one after another (``lax.map``), which measured faster on CPU than a batched
    scatter (docs/records/benchmarks.md). A scatter-free ``hash_family``: the whole batch at once per
    parameter (its ``block_sketch``, no scatter).
    """
    dim = check_dim(dim)
    layout.check(grads, batch_dims=1)
    c = grads[0].shape[0] if grads else 0
    if check_tables(hash_family, tables is not None).scatter_free:
        live = [k for k in range(len(layout)) if layout.sizes[k]]
        return _scatter_free_add(jnp.zeros((c, dim), jnp.float32), [grads[k].reshape(c, -1) for k in live],
                                 [_static_u32(layout.offsets[k]) for k in live], dim, seed, hash_family)
    runs = _layout_hash_runs(layout, dim, seed, tables, hash_family)
    flat = [g.reshape(c, -1) for k, g in enumerate(grads) if layout.sizes[k]]

    def one(gs: list[jax.Array]) -> jax.Array:
        return _scatter_runs(jnp.zeros((dim,), jnp.float32), gs, runs)

    return jax.lax.map(one, flat)


# ------------------------------------------------------------------------------------------------
# Repeated blocks (decoder layers) sketched in a lax.scan, hashing with traced offsets
# ------------------------------------------------------------------------------------------------


def _check_stacked(pre: Sequence[jax.Array], blocks: Sequence[jax.Array], post: Sequence[jax.Array],
                   slayout: StackedLayout) -> None:
    """ValueError when the (pre, stacked blocks, post) arrays do not match ``slayout`` (naming the leaf)."""
    lay = slayout.layout
    if len(pre) != len(slayout.pre) or len(post) != len(slayout.post) or len(blocks) != len(slayout.leaf_names):
        raise ValueError(f"sketch_batch_stacked: expected {len(slayout.pre)} + {len(slayout.leaf_names)} + "
                         f"{len(slayout.post)} arrays, got {len(pre)} + {len(blocks)} + {len(post)}")
    for k, g in zip(slayout.pre + slayout.post, list(pre) + list(post)):
        if tuple(g.shape[1:]) != lay.shapes[k]:
            raise ValueError(f"gradient of {lay.names[k]!r} has shape {tuple(g.shape)}, expects [batch] + {lay.shapes[k]}")
    for j, g in enumerate(blocks):
        if tuple(g.shape[1:]) != (slayout.num_blocks,) + slayout.block_shape(j):
            raise ValueError(f"stacked gradient of {slayout.leaf_names[j]!r} has shape {tuple(g.shape)}, "
                             f"expects [batch, {slayout.num_blocks}] + {slayout.block_shape(j)}")


def sketch_batch_stacked(pre: Sequence[jax.Array], blocks: Sequence[jax.Array], post: Sequence[jax.Array],
                         slayout: StackedLayout, dim: int, seed: int = 0,
                         hash_family: HashFamily = DEFAULT_HASH_FAMILY) -> jax.Array:
    """Per-example CountSketch like :func:`sketch_batch`, with the block leaves stacked and sketched
    in a ``lax.scan`` over the blocks (hashing on the fly with traced per-block offsets, so the hash
    of each leaf kind is compiled once, and no hash tables are needed; a family with
    ``global_index`` is hashed once per :func:`hash_segments` run of a block's leaves).

    Args:
        pre, post: the gradients of ``slayout.pre`` / ``slayout.post`` parameters, each [C, *shape].
        blocks: one array per block leaf j, [C, L, *shape_j] (e.g. the gradient with respect to
            ``decoder.StackedParams.layers`` under ``vmap``).
        slayout: the :class:`StackedLayout`; dim, seed, hash_family: as :func:`sketch_tree`.
    Returns:
        float32[C, dim], equal to ``sketch_batch`` of the same gradients in layout order: the same
        hashes, and each example's scatter-adds run in the same (layout) order.
    Raises:
        ValueError: a count or shape that does not match ``slayout``.
    """
    dim = check_dim(dim)
    _check_stacked(pre, blocks, post, slayout)
    lay, n_blocks = slayout.layout, slayout.num_blocks
    c = (list(pre) + list(blocks) + list(post))[0].shape[0]

    def add(acc, gs, wheres, base, rel):
        # gs: flat [C, n] arrays of consecutive whole parameters; wheres: their (hi, lo) offsets; base,
        # rel: the first one's offset (an int, or traced (hi, lo)) and the static offsets relative to it
        # (a global_index family: one hash per hash_segments run)
        if hash_family.scatter_free or not gs:
            return _scatter_free_add(acc, gs, wheres, dim, seed, hash_family)
        if hash_family.global_index:
            runs = _hash_runs([g.shape[1] for g in gs], rel, base, dim, seed, hash_family)
        else:
            runs = [([m], *hash_family.index_bucket_sign(h, l_, jax.lax.iota(U32, g.shape[1]), dim, seed))
                    for m, (g, (h, l_)) in enumerate(zip(gs, wheres))]

        def one(args):
            a, g = args
            return _scatter_runs(a, g, runs)

        return jax.lax.map(one, (acc, list(gs)))

    def static(acc, ks, gs):
        keep = [(k, g) for k, g in zip(ks, gs) if lay.sizes[k]]
        return add(acc, [g.reshape(c, -1) for _, g in keep], [_static_u32(lay.offsets[k]) for k, _ in keep], 0,
                   [lay.offsets[k] for k, _ in keep])

    acc = static(jnp.zeros((c, dim), jnp.float32), slayout.pre, pre)
    live = [j for j in range(len(blocks)) if lay.sizes[slayout.blocks[0][j]]]
    if live:
        hi, lo = split_u64(slayout.block_offsets[:, live])
        xs = ([jnp.moveaxis(blocks[j], 1, 0).reshape(n_blocks, c, -1) for j in live], jnp.asarray(hi), jnp.asarray(lo))
        rel = [int(slayout.block_offsets[0, j] - slayout.block_offsets[0, live[0]]) for j in live]

        def body(a, x):
            gs, h, l_ = x
            return add(a, gs, [(h[m], l_[m]) for m in range(len(gs))], (h[0], l_[0]), rel), None

        acc = jax.lax.scan(body, acc, xs)[0]
    return static(acc, slayout.post, post)
