"""The splitmix64 per-coordinate hash of the v3 CountSketch (SPEC §3.1), in numpy and in JAX.

Coordinate ``i`` of the concatenated, row-major-flattened gradient (parameters in Hugging Face
``model.parameters()`` order, ``offset`` = summed numel of the preceding parameters) goes to

    x = i + seed                                              (mod 2**64)
    bucket(i) = splitmix64(x + 0x9E3779B97F4A7C15) & (D - 1)
    sign(i)   = 2 * (splitmix64(x + 6971419160186945601) & 1) - 1

with the splitmix64 finalizer ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27;
z *= 0x94D049BB133111EB; z ^= z >> 31`` on wrapping uint64. :func:`numpy_bucket_sign` is the plain
numpy uint64 reference. The JAX side emulates uint64 with (hi, lo) pairs of uint32 (32x32->64
products from 16-bit limbs), so it runs inside ``jax.jit`` without ``jax_enable_x64`` and is
bit-exact with numpy for every index below 2**64 (tests/sketch/test_countsketch.py).

This module holds the arithmetic (also the block family's, ``block_hash.py``, which keys its
offsets with the same finalizer) and the per-coordinate hash; the family object that names it,
``hash_families.SPLITMIX64``, is defined in ``hash_families.py``.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

BUCKET_SALT = 0x9E3779B97F4A7C15  # SPEC §3.1 step 5 (the code's signed -7046029254386353131)
SIGN_SALT = 6971419160186945601  # SPEC §3.1 step 6 (0x60BF74CA3F4B8041)
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
MASK64 = (1 << 64) - 1
U32 = jnp.uint32


def check_dim(dim: int) -> int:
    """Returns ``dim`` as int; raises ValueError unless it is a power of two >= 2 (SPEC §3.1)."""
    d = int(dim)
    if d != dim or d < 2 or d & (d - 1):
        raise ValueError(f"sketch dim must be a power of two >= 2, got {dim!r}")
    return d


def check_seed(seed: int) -> int:
    """Returns ``seed`` as int; raises ValueError unless it is an integer in [0, 2**64)."""
    s = int(seed)
    if s != seed or not 0 <= s <= MASK64:
        raise ValueError(f"sketch seed must be an integer in [0, 2**64), got {seed!r}")
    return s


def split_u64(values: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative integers < 2**64 (any shape) as (hi, lo) uint32 numpy arrays."""
    v = np.asarray(values, dtype=np.uint64)
    return (v >> np.uint64(32)).astype(np.uint32), (v & np.uint64(0xFFFFFFFF)).astype(np.uint32)


# ------------------------------------------------------------------------------------------------
# numpy uint64 reference
# ------------------------------------------------------------------------------------------------


def splitmix64_numpy(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on a uint64 array (wrapping arithmetic, logical shifts) -> uint64."""
    z = np.asarray(x, dtype=np.uint64)
    z = z ^ (z >> np.uint64(30))
    z = z * np.uint64(_M1)
    z = z ^ (z >> np.uint64(27))
    z = z * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


def numpy_bucket_sign(indices: np.ndarray, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Reference hash of global coordinate indices (uint64 array, any value < 2**64).

    Returns (bucket int64 in [0, dim), sign float32 in {-1, +1}), same shape as ``indices``.
    Raises ValueError for a dim that is not a power of two or a seed outside [0, 2**64).
    """
    dim, seed = check_dim(dim), check_seed(seed)
    with np.errstate(over="ignore"):
        x = np.asarray(indices, dtype=np.uint64) + np.uint64(seed)
        bucket = splitmix64_numpy(x + np.uint64(BUCKET_SALT)) & np.uint64(dim - 1)
        sign = (splitmix64_numpy(x + np.uint64(SIGN_SALT)) & np.uint64(1)).astype(np.float32) * 2 - 1
    return bucket.astype(np.int64), sign.astype(np.float32)


def numpy_index_bucket_sign(local: np.ndarray, offset: int, dim: int, seed: int = 0
                            ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`numpy_bucket_sign` of the global indices ``offset + local`` (wrapping uint64): the
    numpy side of :func:`index_bucket_sign`, coordinates ``local`` (uint64) of the parameter whose
    first coordinate has global index ``offset``. Returns (bucket int64, sign float32)."""
    with np.errstate(over="ignore"):
        return numpy_bucket_sign(np.asarray(local, np.uint64) + np.uint64(int(offset) & MASK64), dim, seed)


# ------------------------------------------------------------------------------------------------
# JAX: uint64 emulated with (hi, lo) uint32 pairs
# ------------------------------------------------------------------------------------------------


def const_u32(v: int) -> jax.Array:
    """The low 32 bits of the Python int ``v`` as a uint32 scalar."""
    return jnp.asarray(v & 0xFFFFFFFF, U32)


_c = const_u32


def _mulhi32(a: jax.Array, c: int) -> jax.Array:
    """High 32 bits of the 64-bit product ``a * c`` (a uint32 array, c a 32-bit constant)."""
    a0, a1 = a & _c(0xFFFF), a >> _c(16)
    c0, c1 = _c(c & 0xFFFF), _c(c >> 16)
    p00, p01, p10, p11 = a0 * c0, a0 * c1, a1 * c0, a1 * c1
    mid = (p00 >> _c(16)) + (p01 & _c(0xFFFF)) + (p10 & _c(0xFFFF))
    return p11 + (p01 >> _c(16)) + (p10 >> _c(16)) + (mid >> _c(16))


def _mul64(hi: jax.Array, lo: jax.Array, c: int) -> tuple[jax.Array, jax.Array]:
    """(hi, lo) * c mod 2**64 for a 64-bit constant c."""
    c_hi, c_lo = c >> 32, c & 0xFFFFFFFF
    return _mulhi32(lo, c_lo) + hi * _c(c_lo) + lo * _c(c_hi), lo * _c(c_lo)


def _xorshift(hi: jax.Array, lo: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(hi, lo) ^ ((hi, lo) >>> k) for 0 < k < 32."""
    return hi ^ (hi >> _c(k)), lo ^ ((lo >> _c(k)) | (hi << _c(32 - k)))


def add64(hi: jax.Array, lo: jax.Array, c: int) -> tuple[jax.Array, jax.Array]:
    """(hi, lo) + c mod 2**64 for a 64-bit constant c."""
    new_lo = lo + _c(c)
    return hi + _c(c >> 32) + (new_lo < lo).astype(U32), new_lo


def splitmix64_u32(hi: jax.Array, lo: jax.Array) -> tuple[jax.Array, jax.Array]:
    """splitmix64 finalizer on uint64 values given as (hi, lo) uint32 arrays -> (hi, lo)."""
    hi, lo = _xorshift(hi, lo, 30)
    hi, lo = _mul64(hi, lo, _M1)
    hi, lo = _xorshift(hi, lo, 27)
    hi, lo = _mul64(hi, lo, _M2)
    return _xorshift(hi, lo, 31)


def global_u32(offset_hi: Any, offset_lo: Any, local: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(hi, lo) of ``offset + local`` for a uint32 array ``local``, carrying across 2**32."""
    local = jnp.asarray(local).astype(U32)
    lo = local + jnp.asarray(offset_lo).astype(U32)
    return jnp.asarray(offset_hi).astype(U32) + (lo < local).astype(U32), lo  # carry out of the low word


def bucket_sign_u32(hi: jax.Array, lo: jax.Array, dim: int, seed: int = 0
                    ) -> tuple[jax.Array, jax.Array]:
    """JAX hash of global indices given as (hi, lo) uint32 arrays (may be traced).

    Returns (bucket int32 in [0, dim), sign float32 in {-1, +1}); bit-exact with
    :func:`numpy_bucket_sign` of ``hi * 2**32 + lo``.
    """
    dim, seed = check_dim(dim), check_seed(seed)
    hi, lo = add64(hi.astype(U32), lo.astype(U32), seed)
    _, b_lo = splitmix64_u32(*add64(hi, lo, BUCKET_SALT))
    _, s_lo = splitmix64_u32(*add64(hi, lo, SIGN_SALT))
    bucket = (b_lo & _c(dim - 1)).astype(jnp.int32)
    sign = (s_lo & _c(1)).astype(jnp.float32) * 2.0 - 1.0
    return bucket, sign


def index_bucket_sign(offset_hi: jax.Array, offset_lo: jax.Array, local: jax.Array, dim: int, seed: int = 0
                      ) -> tuple[jax.Array, jax.Array]:
    """Hash of the global indices ``offset + local`` (JAX, jittable): ``offset = offset_hi * 2**32 +
    offset_lo`` given as (possibly traced) uint32 scalars, ``local`` any uint32 array of indices
    inside the parameter (e.g. ``token_id * d + column`` for embedding rows). The (hi, lo) sum
    carries across 2**32; bit-exact with :func:`numpy_index_bucket_sign` for every index < 2**64.
    Returns (bucket int32, sign float32), shaped like ``local``."""
    return bucket_sign_u32(*global_u32(offset_hi, offset_lo, local), dim, seed)


def segment_bucket_sign(offset: int, n: int, dim: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """Hash of the ``n`` consecutive global indices ``offset, ..., offset + n - 1`` (JAX, jittable).

    ``offset`` is a static Python int in [0, 2**64) and ``n < 2**32``; the (hi, lo) split of
    ``offset + local`` carries across 2**32. Returns (bucket int32[n], sign float32[n]).
    """
    if not 0 <= n < 1 << 32 or not 0 <= offset <= MASK64:
        raise ValueError(f"segment out of range: offset={offset}, n={n}")
    local = jax.lax.iota(U32, n)
    lo = local + _c(offset)
    hi = _c(offset >> 32) + (lo < local).astype(U32)  # carry out of the low word
    return bucket_sign_u32(hi, lo, dim, seed)


def segment_bucket_sign_at(offset_hi: jax.Array, offset_lo: jax.Array, n: int, dim: int, seed: int = 0
                           ) -> tuple[jax.Array, jax.Array]:
    """:func:`segment_bucket_sign` with a traced offset given as (hi, lo) uint32 scalars.

    Hashes the ``n`` consecutive global indices ``offset, ..., offset + n - 1`` with
    ``offset = offset_hi * 2**32 + offset_lo`` (e.g. a per-layer offset passed as a ``lax.scan``
    input, so one compiled hash serves every layer); ``n < 2**32`` static. Bit-exact with
    :func:`segment_bucket_sign` / :func:`numpy_bucket_sign` for every offset + n <= 2**64.
    Returns (bucket int32[n], sign float32[n]).
    """
    if not 0 <= n < 1 << 32:
        raise ValueError(f"segment length out of range: n={n}")
    return index_bucket_sign(offset_hi, offset_lo, jax.lax.iota(U32, n), dim, seed)
