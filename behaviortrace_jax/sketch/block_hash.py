"""The scatter-free block hash (``hash_families.BLOCK``, config ``sketch.hash``), numpy and JAX.

Each parameter's flattened coordinates are cut into consecutive blocks of D, and the last block
may be partial. Block b of the parameter with global offset ``o`` starts at global index
``start = o + b * D``. Its coordinates at positions ``p = 0 .. D-1`` then go to

    offset_b  = splitmix64(start + seed + OFFSET_SALT) & (D - 1)    (keyed by (seed, parameter, block))
    bucket(i) = (offset_b + p) & (D - 1)
    sign(i)   = the splitmix64 family's sign of the global index i = start + p

so a block's sketch is ``roll(sign_b * g_b, offset_b)`` (:func:`block_sketch_at`: a dense multiply,
one gather, a sum). Inner products stay unbiased. Two coordinates in different blocks collide with
probability 1/D (independent offsets) and two in one block never collide, so
``Var <S a, S b> = (1/D) sum_{i != j, different blocks} (a_i^2 b_j^2 + a_i b_i a_j b_j)
<= (|a|^2 |b|^2 + <a, b>^2) / D <= 2 |a|^2 |b|^2 / D``, the splitmix64 family's bound
(:func:`block_pair_variance`). :func:`numpy_block_bucket_sign` is the numpy reference: an explicit
per-coordinate bucket (``countsketch.numpy_sketch`` bincounts it). The block family has no hash tables.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from behaviortrace_jax.sketch.splitmix64 import (U32, add64, bucket_sign_u32, check_dim, check_seed, const_u32,
                                                 global_u32, numpy_bucket_sign, splitmix64_numpy, splitmix64_u32)

OFFSET_SALT = 0xD1B54A32D192ED03  # salt of a block's offset hash (distinct from the bucket and sign salts)


def numpy_block_offsets(starts: np.ndarray, dim: int, seed: int = 0) -> np.ndarray:
    """The random offset of each block, given the global index of its first coordinate.

    ``offset = splitmix64(start + seed + OFFSET_SALT) & (dim - 1)`` (uint64 wrapping); ``starts``
    any uint64 array; returns int64 in [0, dim), same shape.
    """
    dim, seed = check_dim(dim), check_seed(seed)
    with np.errstate(over="ignore"):
        x = np.asarray(starts, dtype=np.uint64) + np.uint64(seed) + np.uint64(OFFSET_SALT)
        return (splitmix64_numpy(x) & np.uint64(dim - 1)).astype(np.int64)


def numpy_block_bucket_sign(local: np.ndarray, offset: int, dim: int, seed: int = 0
                            ) -> tuple[np.ndarray, np.ndarray]:
    """Reference hash of coordinates ``local`` (uint64, inside one parameter) of the parameter whose
    first coordinate has global index ``offset``.

    Block ``b = local // dim`` of the parameter starts at global index ``offset + b * dim``;
    ``bucket = (numpy_block_offsets(offset + b * dim) + local % dim) % dim``; the sign is the
    splitmix64 family's sign of the global index ``offset + local`` (``splitmix64.numpy_bucket_sign``).
    Returns (bucket int64, sign float32), shaped like ``local``.
    """
    dim = check_dim(dim)
    local = np.asarray(local, dtype=np.uint64)
    with np.errstate(over="ignore"):
        _, sign = numpy_bucket_sign(local + np.uint64(offset), dim, seed)
        pos = local & np.uint64(dim - 1)
        start = local - pos + np.uint64(offset)
    bucket = (numpy_block_offsets(start, dim, seed) + pos.astype(np.int64)) & (dim - 1)
    return bucket, sign


def block_pair_variance(a: Sequence[np.ndarray], b: Sequence[np.ndarray], dim: int) -> float:
    """Variance over hash seeds of the block family's sketched inner product ``<S a, S b>``.

    ``a``, ``b``: gradients as arrays in layout order. With fully random signs and offsets, two
    coordinates collide with probability 1/dim when they lie in different blocks and never inside
    one block, so (the CountSketch variance with the same-block pairs removed)

        Var = (1/dim) sum_{i != j, block(i) != block(j)} (a_i^2 b_j^2 + a_i b_i a_j b_j)
            <= (|a|^2 |b|^2 + <a, b>^2) / dim <= 2 |a|^2 |b|^2 / dim,

    the splitmix64 family's bound (whose sum runs over all pairs i != j). Returns the exact sum
    (float, computed in float64 per block).
    """
    sq, cr = [], []  # per block: sum a^2, sum b^2, sum a b
    for x, y in zip(a, b):
        x, y = np.asarray(x, np.float64).reshape(-1), np.asarray(y, np.float64).reshape(-1)
        nb = -(-x.size // dim)
        xp, yp = np.zeros(nb * dim), np.zeros(nb * dim)
        xp[:x.size], yp[:y.size] = x, y
        xb, yb = xp.reshape(nb, dim), yp.reshape(nb, dim)
        sq.append(np.stack([np.sum(xb * xb, 1), np.sum(yb * yb, 1)], 1))
        cr.append(np.sum(xb * yb, 1))
    s, c = np.concatenate(sq), np.concatenate(cr)
    total = s[:, 0].sum() * s[:, 1].sum() + c.sum() ** 2
    same = np.sum(s[:, 0] * s[:, 1]) + np.sum(c * c)  # pairs inside one block, i == j included
    return float((total - same) / dim)


def block_offsets_u32(hi: jax.Array, lo: jax.Array, dim: int, seed: int = 0) -> jax.Array:
    """JAX :func:`numpy_block_offsets` of block starts given as (hi, lo) uint32 arrays -> int32 [0, dim)."""
    dim, seed = check_dim(dim), check_seed(seed)
    _, o_lo = splitmix64_u32(*add64(*add64(hi.astype(U32), lo.astype(U32), seed), OFFSET_SALT))
    return (o_lo & const_u32(dim - 1)).astype(jnp.int32)


def block_index_bucket_sign(offset_hi: jax.Array, offset_lo: jax.Array, local: jax.Array, dim: int,
                            seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """The block family's hash of coordinates ``local`` (any uint32 array) of the parameter whose
    first coordinate has global index ``offset = offset_hi * 2**32 + offset_lo`` ((possibly traced)
    uint32 scalars); jittable. Bit-exact with :func:`numpy_block_bucket_sign`. Used where
    coordinates sit at data-dependent places (the embedding rows of an example's tokens).
    Returns (bucket int32, sign float32), shaped like ``local``."""
    _, sign = bucket_sign_u32(*global_u32(offset_hi, offset_lo, local), dim, seed)
    local = jnp.asarray(local).astype(U32)
    pos = local & const_u32(dim - 1)
    return (block_offsets_u32(*global_u32(offset_hi, offset_lo, local - pos), dim, seed) + pos.astype(jnp.int32)
            ) & jnp.int32(dim - 1), sign


def block_sketch_at(g: jax.Array, offset_hi: Any, offset_lo: Any, first: Any, dim: int, seed: int = 0,
                    aligned: bool | None = None) -> jax.Array:
    """Block-family sketch of coordinates ``first .. first + n - 1`` of one parameter, per row; jittable.

    Args:
        g: float [C, n], row c = example c's values of those coordinates (cast to float32).
        offset_hi, offset_lo: uint32 scalars (may be traced): global index of the parameter's first
            coordinate (``ParamLayout.offsets``).
        first: local index of ``g[:, 0]`` inside the parameter (int or traced uint32 scalar).
        dim, seed: sketch width (power of two <= 2**31) and hash seed (static).
        aligned: ``first`` is a multiple of ``dim`` (default: known only for an int ``first``).
    Returns:
        float32 [C, dim] = sum over the parameter's D-sized blocks b touched of
        ``roll(sign_b * g_b, offset_b)`` (:func:`numpy_block_bucket_sign`), the blocks' values
        placed in a zero-padded [C, nb, dim] array: a dense multiply, one gather (the roll) and a
        sum, no scatter.
    Raises:
        ValueError: ``n`` too large for uint32 local indices, or a bad dim.
    """
    dim, (c, n) = check_dim(dim), g.shape
    if dim > 1 << 31 or n + 2 * dim >= 1 << 32:
        raise ValueError(f"block sketch: dim={dim} and n={n} must keep local indices below 2**32")
    aligned = (isinstance(first, int) and first % dim == 0) if aligned is None else bool(aligned)
    nb = -(-n // dim) + (0 if aligned else 1)
    first = jnp.asarray(np.uint32(first)) if isinstance(first, int) else jnp.asarray(first).astype(U32)
    shift = first & const_u32(dim - 1)
    x = g.astype(jnp.float32)
    if aligned:
        x = jnp.pad(x, ((0, 0), (0, nb * dim - n)))
    else:
        x = jax.lax.dynamic_update_slice(jnp.zeros((c, nb * dim), jnp.float32), x, (jnp.int32(0), shift.astype(jnp.int32)))
    starts = first - shift + jax.lax.iota(U32, nb) * const_u32(dim)  # local index of each block's first coordinate
    _, sign = bucket_sign_u32(*global_u32(offset_hi, offset_lo, starts[:, None] + jax.lax.iota(U32, dim)), dim, seed)
    offs = block_offsets_u32(*global_u32(offset_hi, offset_lo, starts), dim, seed)
    src = (jax.lax.iota(jnp.int32, dim)[None, :] - offs[:, None]) & jnp.int32(dim - 1)  # roll: out[j] = x[j - o]
    x = x.reshape(c, nb, dim) * sign
    # indices [1, nb, dim]: the batch axis is a gather slice (no index array per example)
    return jnp.sum(jnp.take_along_axis(x, src[None], axis=2, mode="promise_in_bounds"), axis=1)
