"""A Pallas kernel for the per-example CountSketch of one matmul weight use, tiles kept on chip
(SPEC §3.1, §3.2; the fused sketcher's ``_matrix_grads``, ``sketch/fused.py``).

For a linear use ``y = x W^T`` (W [out, in]) with input x [B, N, in] and output cotangent
dy [B, N, out], example b's gradient is ``dW_b = dy_b^T x_b``. The kernel forms it one row tile
``G = dy_b[:, rows]^T x_b`` ([tr, in], float32) at a time in on-chip memory (VMEM), multiplies by
the block hash family's signs, adds the tile into example b's D buckets, adds ``|G|^2`` to b's
squared norm and ``c_b G`` to the weight cotangent ``sum_b c_b dW_b``. The per-example tile is never
written to HBM; what leaves the chip is the buckets [B, D], the norms [B] and the weight cotangent
[out, in] (once, not per example).

Why the block hash's layout (``block_hash.py``, ``hash_families.BLOCK``) and not a sort-free scatter:
in the block family coordinate ``L`` (row-major, inside the parameter) of block ``b = L // D`` goes
to bucket ``(offset_b + L) mod D``: inside a block the map is a cyclic shift. Seen as rows of 128
lanes (``L = 128 k + l``, ``in`` a multiple of 128, so no 128-lane segment straddles two blocks),
the D buckets are R = D / 128 rows, and a run of R consecutive segments of one block lands on the
bucket rows by one lane rotation by ``offset_b mod 128`` and one sublane rotation (two: the lanes
that wrap go one row further). Every bucket update is therefore a dense, full-vector add of rotated
tiles (``pltpu.roll``), no scatter, no sort and no one-hot matmul; a scatter on TPU is serialised
per element (or sorted first, which costs a sort of B x P keys), and a one-hot matmul costs 2 D
FLOPs per coordinate. The price: the block family's sketches are not the paper's splitmix64 ones
(same variance bound; ``docs/records/benchmarks.md``, "Block hash"), so the family is recorded in every
store and never compared with another (``HashFamily.check_store_metadata``).

Grid ``(row tile t, example b, token chunk n)``: the token chunks are the matmul's reduction (G in
a VMEM scratch); the signs of a tile are hashed once, at b = 0, and reused by the other examples;
the buckets of all B examples and the row tile of the weight cotangent stay resident in VMEM.
Each example's input x_b is read once per row tile, dy once. Supported where ``in`` is a multiple
of 128 and D a multiple of 1024 (:func:`kernel_supported`: every attention, MLP and head weight of
the Qwen2 / Qwen3 / Llama families at their published sizes); other weights, biases, norm scales
and the embedding stay on the XLA path. ``interpret=True`` runs the same kernel on CPU (tests).
TPU only (Mosaic): GPU runs take the XLA path (``stores.SketchOptions``).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from behaviortrace_jax.sketch import splitmix64 as sm
from behaviortrace_jax.sketch.block_hash import block_offsets_u32

F32 = jnp.float32
LANES = 128
TILE_TARGET = 1 << 19  # per-example gradient values per row tile (2 MiB in float32) held in VMEM
TOKEN_TILE = 512  # tokens per reduction step when N is larger
VMEM_LIMIT = 64 << 20  # bytes of scoped VMEM asked for (a v5e / v6e core has 128 MiB)
ELEMENT_OPS = 20  # vector ops per tile value and example (sign, two masked rotations, adds), for the cost
HASH_OPS = 70  # vector ops of the sign hash per tile value (once per tile, shared by the examples)


KERNELS = ("xla", "pallas", "interpret")  # config sketch.kernel's resolved values (stores.SketchOptions)


def check_kernel(kernel: str, family: Any) -> str:
    """``kernel`` if it is one of :data:`KERNELS` and, unless "xla", ``family`` is the block family
    (``HashFamily.kernel_layout``: the kernel's layout). Raises ValueError naming config
    ``sketch.kernel`` otherwise."""
    if kernel not in KERNELS:
        raise ValueError(f"sketch.kernel={kernel!r}: expected one of {KERNELS} (or 'auto' in the config)")
    if kernel != "xla" and not getattr(family, "kernel_layout", False):
        raise ValueError(f"sketch.kernel={kernel!r} sketches with the block hash's layout: it needs sketch.hash="
                         f"'block', got {getattr(family, 'name', family)!r}")
    return kernel


def kernel_supported(shape: tuple[int, int], dim: int) -> bool:
    """Whether a weight of ``shape`` = (out, in) can be sketched by :func:`matmul_sketch` with
    sketch width ``dim``: ``in`` a multiple of 128, ``dim`` a multiple of 1024 and < 2**31, and
    fewer than 2**32 coordinates."""
    out, inn = int(shape[0]), int(shape[1])
    return inn % LANES == 0 and dim % (8 * LANES) == 0 and dim < 1 << 31 and out * inn + 2 * dim < 1 << 32


def tile_rows(out: int, inn: int, target: int = TILE_TARGET) -> int:
    """Rows per tile: a multiple of 16 near ``target / in``, at most ``out`` rounded up to 16."""
    tr = max(16, (target // inn) // 16 * 16)
    return min(tr, -(-out // 16) * 16)


def _signs(off_hi: jax.Array, off_lo: jax.Array, first_seg: jax.Array, shape: tuple[int, int], seed: int
           ) -> jax.Array:
    """float32 ±1 of shape [S, 128]: the block family's sign (the splitmix64 sign of the global
    index) of local coordinates ``128 * (first_seg + k) + l`` of the parameter at global offset
    (off_hi, off_lo)."""
    k = jax.lax.broadcasted_iota(jnp.uint32, shape, 0)
    lane = jax.lax.broadcasted_iota(jnp.uint32, shape, 1)
    local = (first_seg.astype(jnp.uint32) + k) * jnp.uint32(LANES) + lane
    lo = local + off_lo
    hi = off_hi + (lo < local).astype(jnp.uint32)
    hi, lo = sm.add64(hi, lo, seed)
    _, s_lo = sm.splitmix64_u32(*sm.add64(hi, lo, sm.SIGN_SALT))
    return (s_lo & jnp.uint32(1)).astype(F32) * 2.0 - 1.0


def _roll(x: jax.Array, shift: jax.Array, axis: int, interpret: bool) -> jax.Array:
    """``jnp.roll(x, shift, axis)`` (element j moves to j + shift); ``pltpu.roll`` when compiled."""
    return jnp.roll(x, shift, axis) if interpret else pltpu.roll(x, shift, axis)


def _add_chunk(acc: jax.Array, v: jax.Array, g0: jax.Array, offs_ref: Any, n_blocks: int, interpret: bool
               ) -> jax.Array:
    """``acc`` [R, 128] plus the block-hash sketch of R consecutive signed segments ``v`` [R, 128]
    whose first has local segment index ``g0``: the chunk touches blocks ``g0 // R`` and the next;
    each block's rows are rotated by its offset (lanes by ``offset % 128``, rows by ``offset // 128``
    plus the chunk's place in the block, the wrapped lanes one row further)."""
    rows = v.shape[0]  # R = D / 128, a power of two; every index below is >= 0 (shifts and masks, no signed %)
    mask, log_rows = rows - 1, rows.bit_length() - 1
    row = jax.lax.broadcasted_iota(jnp.int32, v.shape, 0)
    lane = jax.lax.broadcasted_iota(jnp.int32, v.shape, 1)
    b0 = jax.lax.shift_right_logical(g0, jnp.int32(log_rows))
    split = (b0 + 1) * rows - g0  # rows before it are in block b0, the others in b0 + 1
    for j in range(2):
        b = b0 + j
        o = offs_ref[jnp.minimum(b, n_blocks - 1)]
        s, a = o & (LANES - 1), jax.lax.shift_right_logical(o, jnp.int32(7))
        part = jnp.where((row < split) if j == 0 else (row >= split), v, 0.0)
        pr = _roll(part, s, 1, interpret)
        q = (a + g0 - b * rows + rows) & mask  # g0 - b * rows >= -rows
        acc = acc + _roll(jnp.where(lane >= s, pr, 0.0), q, 0, interpret)
        acc = acc + _roll(jnp.where(lane < s, pr, 0.0), (q + 1) & mask, 0, interpret)
    return acc


def _kernel(offs_ref, hilo_ref, coef_ref, dyt_ref, x_ref, acc_in_ref, acc_ref, sq_ref, dw_ref, g_scr, sign_scr,
            v_scr, *, seed: int, n_blocks: int, n_chunks: int, rows: int, weights: bool, interpret: bool):
    """One grid step (t, b, n) of :func:`matmul_sketch`; see the module docstring."""
    t, b, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    last_n = n == pl.num_programs(2) - 1
    tr, inn = g_scr.shape
    segs = tr * inn // LANES
    first_seg = t * segs

    @pl.when((t == 0) & (b == 0) & (n == 0))
    def _init():
        acc_ref[...] = acc_in_ref[...]
        sq_ref[...] = jnp.zeros(sq_ref.shape, F32)
        v_scr[...] = jnp.zeros(v_scr.shape, F32)  # rows past the tile's segments stay zero

    @pl.when(n == 0)
    def _zero():
        g_scr[...] = jnp.zeros(g_scr.shape, F32)

    dyt, x = dyt_ref[0], x_ref[0]
    ct = jnp.promote_types(dyt.dtype, x.dtype)
    g_scr[...] += jnp.dot(dyt.astype(ct), x.astype(ct), preferred_element_type=F32)

    @pl.when(last_n & (b == 0))
    def _hash():  # once per tile, shared by the examples
        hi, lo = hilo_ref[0].astype(jnp.uint32), hilo_ref[1].astype(jnp.uint32)
        sign_scr[...] = _signs(hi, lo, first_seg, (segs, LANES), seed)

    @pl.when(last_n)
    def _sketch():
        g = g_scr[...]
        if weights:
            c = coef_ref[0][:1, :1]

            @pl.when(b == 0)
            def _first():
                dw_ref[...] = c * g

            @pl.when(b > 0)
            def _more():
                dw_ref[...] += c * g

        sq_ref[b] = sq_ref[b] + jnp.sum(g * g)
        v_scr[pl.ds(0, segs), :] = sign_scr[...] * g.reshape(segs, LANES)

        def chunk(k, acc):
            start = pl.multiple_of(k * rows, 8)
            return _add_chunk(acc, v_scr[pl.ds(start, rows), :], first_seg + k * rows, offs_ref, n_blocks,
                              interpret)

        acc_ref[b] = jax.lax.fori_loop(0, n_chunks, chunk, acc_ref[b])


def _pad_to(a: jax.Array, axis: int, size: int) -> jax.Array:
    """``a`` zero-padded along ``axis`` to ``size``."""
    if a.shape[axis] == size:
        return a
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, pad)


def matmul_sketch(acc: jax.Array, x: jax.Array, dy: jax.Array, coef: jax.Array | None, offset_hi: Any,
                  offset_lo: Any, dim: int, seed: int = 0, *, interpret: bool = False,
                  tile_target: int = TILE_TARGET, token_tile: int = TOKEN_TILE
                  ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Block-family sketches, squared norms and weighted sum of the per-example gradients
    ``dW_b = dy_b^T x_b`` of one weight [out, in], tiles kept on chip (module docstring).

    Args:
        acc: float32 [B, dim]: the running sketches; the result is ``acc`` plus these (aliased).
        x: [B, N, in] (bfloat16 or float32): the use's input; dy: [B, N, out]: its output cotangent.
        coef: float [B] coefficients of the weight cotangent ``sum_b coef_b dW_b``, or None (none formed).
        offset_hi, offset_lo: uint32 scalars (may be traced): global index of the weight's first
            coordinate (``ParamLayout.offsets``, HF order).
        dim, seed: sketch width D and hash seed (static); interpret: run the kernel in Pallas's
            interpreter (CPU).
        tile_target: per-example gradient values per row tile; token_tile: tokens per reduction step.
    Returns:
        (acc + sketches float32 [B, dim], squared Frobenius norms float32 [B], ``sum_b coef_b dW_b``
        float32 [out, in] or None); the sketches equal ``hash_families.BLOCK.block_sketch`` of the
        flattened ``dW_b`` up to float rounding.
    Raises:
        ValueError: a shape :func:`kernel_supported` refuses, or x / dy / acc that disagree.
    """
    bsz, n_tok, inn = x.shape
    out = dy.shape[-1]
    if dy.shape[:2] != (bsz, n_tok) or acc.shape != (bsz, dim) or not kernel_supported((out, inn), dim):
        raise ValueError(f"matmul_sketch: x {x.shape}, dy {dy.shape}, acc {acc.shape}, dim {dim}: needs matching "
                         "batch and tokens, acc [B, dim] and kernel_supported((out, in), dim)")
    rows = dim // LANES
    tr = tile_rows(out, inn, tile_target)
    out_p = -(-out // tr) * tr
    steps = -(-n_tok // token_tile)  # token chunks: the fewest of at most token_tile, each a multiple of 128
    tn = n_tok if steps == 1 else -(-(-(-n_tok // steps)) // LANES) * LANES
    n_p = -(-n_tok // tn) * tn
    n_blocks = -(-out * inn // dim)
    segs = tr * inn // LANES
    n_chunks = -(-segs // rows)  # chunks of R consecutive segments: each touches at most two blocks
    dyt = _pad_to(_pad_to(jnp.swapaxes(dy, 1, 2), 1, out_p), 2, n_p)  # [B, out_p, n_p]
    xp = _pad_to(x, 1, n_p)
    hi, lo = jnp.asarray(offset_hi).astype(jnp.uint32), jnp.asarray(offset_lo).astype(jnp.uint32)
    starts = sm.global_u32(hi, lo, jnp.arange(n_blocks, dtype=jnp.uint32) * jnp.uint32(dim))
    offs = block_offsets_u32(*starts, dim, seed)  # int32 [n_blocks]
    hilo = jax.lax.bitcast_convert_type(jnp.stack([hi, lo]), jnp.int32)
    c = jnp.zeros((bsz,), F32) if coef is None else jnp.asarray(coef, F32)
    coef3 = jnp.broadcast_to(c[:, None, None], (bsz, 8, LANES))
    grid = (out_p // tr, bsz, n_p // tn)
    weights = coef is not None
    kernel = functools.partial(_kernel, seed=int(seed), n_blocks=n_blocks, n_chunks=n_chunks, rows=rows,
                               weights=weights, interpret=interpret)
    isz = jnp.dtype(x.dtype).itemsize
    cost = pl.CostEstimate(
        flops=int(2 * bsz * n_p * out_p * inn + bsz * out_p * inn * ELEMENT_OPS + out_p * inn * HASH_OPS),
        transcendentals=0,
        bytes_accessed=int(grid[0] * bsz * n_p * inn * isz + bsz * n_p * out_p * jnp.dtype(dy.dtype).itemsize
                           + (out_p * inn * 4 if weights else 0) + 2 * bsz * dim * 4 + bsz * 8 * LANES * 4))
    full = lambda shape: pl.BlockSpec(shape, lambda t, b, n, *_: (0,) * len(shape))  # noqa: E731
    acc_sk, sq, dw = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((bsz, rows, LANES), F32), jax.ShapeDtypeStruct((bsz, 8, LANES), F32),
                   jax.ShapeDtypeStruct((out_p, inn) if weights else (8, LANES), F32)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=grid,
            in_specs=[pl.BlockSpec((1, 8, LANES), lambda t, b, n, *_: (b, 0, 0)),
                      pl.BlockSpec((1, tr, tn), lambda t, b, n, *_: (b, t, n)),
                      pl.BlockSpec((1, tn, inn), lambda t, b, n, *_: (b, n, 0)),
                      full((bsz, rows, LANES))],
            out_specs=[full((bsz, rows, LANES)), full((bsz, 8, LANES)),
                       pl.BlockSpec((tr, inn), lambda t, b, n, *_: (t, 0)) if weights else full((8, LANES))],
            scratch_shapes=[pltpu.VMEM((tr, inn), F32), pltpu.VMEM((segs, LANES), F32),
                            pltpu.VMEM((n_chunks * rows, LANES), F32)]),
        input_output_aliases={5: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary", "arbitrary"),
                                             vmem_limit_bytes=VMEM_LIMIT),
        cost_estimate=cost, interpret=interpret,
    )(offs, hilo, coef3, dyt, xp, acc.reshape(bsz, rows, LANES))
    return acc_sk.reshape(bsz, dim), sq[:, 0, 0], (dw[:out] if weights else None)
