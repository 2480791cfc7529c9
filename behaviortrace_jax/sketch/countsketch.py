"""The v3 gradient embedding: a splitmix64 CountSketch over HF-ordered parameters (SPEC §3.1).

Coordinate ``i`` of the concatenated, row-major-flattened gradient (parameters in Hugging Face
``model.parameters()`` order, ``offset`` = summed numel of the preceding parameters) goes to

    x = i + seed                                              (mod 2**64)
    bucket(i) = splitmix64(x + 0x9E3779B97F4A7C15) & (D - 1)
    sign(i)   = 2 * (splitmix64(x + 6971419160186945601) & 1) - 1
    sketch[bucket(i)] += sign(i) * float32(g_i)

with the splitmix64 finalizer ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27;
z *= 0x94D049BB133111EB; z ^= z >> 31`` on wrapping uint64. :func:`numpy_countsketch` is the plain
numpy uint64 reference. The JAX side emulates uint64 with (hi, lo) pairs of uint32 (32x32->64
products from 16-bit limbs), so it runs inside ``jax.jit`` without ``jax_enable_x64`` and is
bit-exact with numpy for every index below 2**64 (tests/test_countsketch.py).

Hashing is done on the fly inside the jitted function (the default): on CPU it measured about as
fast as streaming precomputed bucket/sign tables and it costs no memory (docs/benchmarks.md). Pass
``tables=layout_tables(...)`` to :func:`sketch_tree` / :func:`sketch_batch` to use device tables.

The block family (``hash_name="block"``, config ``sketch.hash``; metadata :data:`BLOCK_HASH_FAMILY`)
is scatter-free. Each parameter's flattened coordinates are cut into consecutive blocks of D, and
the last block may be partial. Block b of the parameter with global offset ``o`` starts at global
index ``start = o + b * D``. Its coordinates at positions ``p = 0 .. D-1`` then go to

    offset_b  = splitmix64(start + seed + OFFSET_SALT) & (D - 1)    (keyed by (seed, parameter, block))
    bucket(i) = (offset_b + p) & (D - 1)
    sign(i)   = the splitmix64 family's sign of the global index i = start + p

so a block's sketch is ``roll(sign_b * g_b, offset_b)`` (:func:`block_sketch_at`: a dense multiply,
one gather, a sum). Inner products stay unbiased. Two coordinates in different blocks collide with
probability 1/D (independent offsets) and two in one block never collide, so
``Var <S a, S b> = (1/D) sum_{i != j, different blocks} (a_i^2 b_j^2 + a_i b_i a_j b_j)
<= (|a|^2 |b|^2 + <a, b>^2) / D <= 2 |a|^2 |b|^2 / D``, the splitmix64 family's bound
(:func:`block_pair_variance`). :func:`numpy_sketch` is the numpy reference of both families: an
explicit per-coordinate bucket and a bincount. The block family has no hash tables.

Example::

    layout = ParamLayout.from_entries([("w", (3, 4)), ("b", (4,))])
    s = jax.jit(lambda g: sketch_tree(g, layout, 2**16, 0))([gw, gb])   # float32[65536]
    assert np.allclose(s, numpy_countsketch(np.concatenate([gw.ravel(), gb]), 2**16, 0), rtol=1e-6)
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

HASH_FAMILY = "splitmix64-countsketch-v3"  # recorded in every sketch store's metadata
BLOCK_HASH_FAMILY = "splitmix64-block-countsketch-v1"  # the scatter-free family (``sketch.hash = "block"``)
HASH_FAMILIES = {"splitmix64": HASH_FAMILY, "block": BLOCK_HASH_FAMILY}  # config ``sketch.hash`` -> metadata name
BUCKET_SALT = 0x9E3779B97F4A7C15  # SPEC §3.1 step 5 (the code's signed -7046029254386353131)
SIGN_SALT = 6971419160186945601  # SPEC §3.1 step 6 (0x60BF74CA3F4B8041)
OFFSET_SALT = 0xD1B54A32D192ED03  # block family: salt of a block's offset hash (distinct from both above)
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1
_NP_BLOCK = 1 << 23  # numpy reference works in blocks of 8M coordinates (as the torch code)


def check_dim(dim: int) -> int:
    """Returns ``dim`` as int; raises ValueError unless it is a power of two >= 2 (SPEC §3.1)."""
    d = int(dim)
    if d != dim or d < 2 or d & (d - 1):
        raise ValueError(f"sketch dim must be a power of two >= 2, got {dim!r}")
    return d


def check_hash(hash_name: str, key: str = "sketch.hash") -> str:
    """Returns ``hash_name`` if it is a hash family of :data:`HASH_FAMILIES`; else ValueError naming ``key``."""
    if hash_name not in HASH_FAMILIES:
        raise ValueError(f"{key}={hash_name!r}: expected one of {sorted(HASH_FAMILIES)}")
    return str(hash_name)


def hash_family(hash_name: str) -> str:
    """The ``hash_family`` recorded in sketch metadata for config ``sketch.hash = hash_name``."""
    return HASH_FAMILIES[check_hash(hash_name)]


def _check_seed(seed: int) -> int:
    s = int(seed)
    if s != seed or not 0 <= s <= _MASK64:
        raise ValueError(f"sketch seed must be an integer in [0, 2**64), got {seed!r}")
    return s


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
    dim, seed = check_dim(dim), _check_seed(seed)
    with np.errstate(over="ignore"):
        x = np.asarray(indices, dtype=np.uint64) + np.uint64(seed)
        bucket = splitmix64_numpy(x + np.uint64(BUCKET_SALT)) & np.uint64(dim - 1)
        sign = (splitmix64_numpy(x + np.uint64(SIGN_SALT)) & np.uint64(1)).astype(np.float32) * 2 - 1
    return bucket.astype(np.int64), sign.astype(np.float32)


def numpy_countsketch(vec: np.ndarray, dim: int, seed: int = 0, offset: int = 0) -> np.ndarray:
    """Reference CountSketch of a flat vector whose first entry has global index ``offset``.

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
    if not 0 <= offset <= _MASK64:
        raise ValueError(f"offset must be in [0, 2**64), got {offset}")
    out = np.zeros(dim, np.float64)
    for s in range(0, v.size, _NP_BLOCK):
        blk = v[s:s + _NP_BLOCK]
        with np.errstate(over="ignore"):
            idx = np.arange(blk.size, dtype=np.uint64) + np.uint64((offset + s) & _MASK64)
        bucket, sign = numpy_bucket_sign(idx, dim, seed)
        out += np.bincount(bucket, (sign * blk).astype(np.float64), minlength=dim)
    return out.astype(np.float32)


def numpy_block_offsets(starts: np.ndarray, dim: int, seed: int = 0) -> np.ndarray:
    """Block family: the random offset of each block, given the global index of its first coordinate.

    ``offset = splitmix64(start + seed + OFFSET_SALT) & (dim - 1)`` (uint64 wrapping); ``starts``
    any uint64 array; returns int64 in [0, dim), same shape.
    """
    dim, seed = check_dim(dim), _check_seed(seed)
    with np.errstate(over="ignore"):
        x = np.asarray(starts, dtype=np.uint64) + np.uint64(seed) + np.uint64(OFFSET_SALT)
        return (splitmix64_numpy(x) & np.uint64(dim - 1)).astype(np.int64)


def numpy_block_bucket_sign(local: np.ndarray, offset: int, dim: int, seed: int = 0
                            ) -> tuple[np.ndarray, np.ndarray]:
    """Block-family reference hash of coordinates ``local`` (uint64, inside one parameter) of the
    parameter whose first coordinate has global index ``offset``.

    Block ``b = local // dim`` of the parameter starts at global index ``offset + b * dim``;
    ``bucket = (numpy_block_offsets(offset + b * dim) + local % dim) % dim``; the sign is the
    splitmix64 family's sign of the global index ``offset + local`` (:func:`numpy_bucket_sign`).
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


def numpy_sketch(arrays: Sequence[np.ndarray], dim: int, seed: int = 0, hash_name: str = "splitmix64"
                 ) -> np.ndarray:
    """Reference sketch float32[dim] of a gradient given as arrays in layout (HF) order (SPEC §3.1).

    Each array is flattened row-major (float32) and hashed at global indices ``offset_k + local``
    (``offset_k`` = summed sizes of the preceding arrays) with the family ``hash_name``
    ("splitmix64": :func:`numpy_bucket_sign`; "block": :func:`numpy_block_bucket_sign`, blocks per
    array), accumulated in float64 with ``np.bincount`` and rounded once. An explicit per-coordinate
    bucket + bincount, independent of the JAX block family's roll-and-sum.
    """
    dim, offset = check_dim(dim), 0
    out = np.zeros(dim, np.float64)
    for a in arrays:
        v = np.asarray(a).reshape(-1).astype(np.float32)
        for s in range(0, v.size, _NP_BLOCK):
            blk = v[s:s + _NP_BLOCK]
            local = np.arange(s, s + blk.size, dtype=np.uint64)
            if check_hash(hash_name) == "block":
                bucket, sign = numpy_block_bucket_sign(local, offset, dim, seed)
            else:
                with np.errstate(over="ignore"):
                    bucket, sign = numpy_bucket_sign(local + np.uint64(offset), dim, seed)
            out += np.bincount(bucket, (sign * blk).astype(np.float64), minlength=dim)
        offset += v.size
    return out.astype(np.float32)


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


# ------------------------------------------------------------------------------------------------
# JAX: uint64 emulated with (hi, lo) uint32 pairs
# ------------------------------------------------------------------------------------------------

_U32 = jnp.uint32


def _c(v: int) -> jax.Array:
    return jnp.asarray(v & 0xFFFFFFFF, _U32)


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


def _add64(hi: jax.Array, lo: jax.Array, c: int) -> tuple[jax.Array, jax.Array]:
    """(hi, lo) + c mod 2**64 for a 64-bit constant c."""
    new_lo = lo + _c(c)
    return hi + _c(c >> 32) + (new_lo < lo).astype(_U32), new_lo


def splitmix64_u32(hi: jax.Array, lo: jax.Array) -> tuple[jax.Array, jax.Array]:
    """splitmix64 finalizer on uint64 values given as (hi, lo) uint32 arrays -> (hi, lo)."""
    hi, lo = _xorshift(hi, lo, 30)
    hi, lo = _mul64(hi, lo, _M1)
    hi, lo = _xorshift(hi, lo, 27)
    hi, lo = _mul64(hi, lo, _M2)
    return _xorshift(hi, lo, 31)


def bucket_sign_u32(hi: jax.Array, lo: jax.Array, dim: int, seed: int = 0
                    ) -> tuple[jax.Array, jax.Array]:
    """JAX hash of global indices given as (hi, lo) uint32 arrays (may be traced).

    Returns (bucket int32 in [0, dim), sign float32 in {-1, +1}); bit-exact with
    :func:`numpy_bucket_sign` of ``hi * 2**32 + lo``.
    """
    dim, seed = check_dim(dim), _check_seed(seed)
    hi, lo = _add64(hi.astype(_U32), lo.astype(_U32), seed)
    _, b_lo = splitmix64_u32(*_add64(hi, lo, BUCKET_SALT))
    _, s_lo = splitmix64_u32(*_add64(hi, lo, SIGN_SALT))
    bucket = (b_lo & _c(dim - 1)).astype(jnp.int32)
    sign = (s_lo & _c(1)).astype(jnp.float32) * 2.0 - 1.0
    return bucket, sign


def segment_bucket_sign(offset: int, n: int, dim: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """Hash of the ``n`` consecutive global indices ``offset, ..., offset + n - 1`` (JAX, jittable).

    ``offset`` is a static Python int in [0, 2**64) and ``n < 2**32``; the (hi, lo) split of
    ``offset + local`` carries across 2**32. Returns (bucket int32[n], sign float32[n]).
    """
    if not 0 <= n < 1 << 32 or not 0 <= offset <= _MASK64:
        raise ValueError(f"segment out of range: offset={offset}, n={n}")
    local = jax.lax.iota(_U32, n)
    lo = local + _c(offset)
    hi = _c(offset >> 32) + (lo < local).astype(_U32)  # carry out of the low word
    return bucket_sign_u32(hi, lo, dim, seed)


# ------------------------------------------------------------------------------------------------
# Parameter layout (HF order) and the sketch of a gradient list
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Names and shapes of the sketched parameters in HF ``model.parameters()`` order (SPEC §3.1).

    ``offsets[k]`` = summed numel of parameters ``0..k-1`` (the global index of the first
    coordinate of parameter k); ``fingerprint`` = sha256 hex of the JSON ``[[name, shape], ...]``,
    stored with every sketch so sketches of different layouts are never mixed.

    Raises ValueError on duplicate names, mismatched lengths or a shape with a negative/non-int dim.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        names, shapes = tuple(self.names), tuple(tuple(int(d) for d in s) for s in self.shapes)
        if len(names) != len(shapes):
            raise ValueError(f"ParamLayout: {len(names)} names but {len(shapes)} shapes")
        seen = set()
        for n, s in zip(names, shapes):
            if n in seen:
                raise ValueError(f"ParamLayout: duplicate parameter name {n!r}")
            seen.add(n)
            if any(d < 0 for d in s):
                raise ValueError(f"ParamLayout: parameter {n!r} has a negative dim in {s}")
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "shapes", shapes)

    @classmethod
    def from_entries(cls, entries: Iterable[tuple[str, Sequence[int]]]) -> "ParamLayout":
        """From ``[(name, shape), ...]`` in HF order (e.g. ``model.named_parameters()`` shapes)."""
        entries = list(entries)
        return cls(tuple(n for n, _ in entries), tuple(tuple(s) for _, s in entries))

    def __len__(self) -> int:
        return len(self.names)

    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(np.prod(s, dtype=np.int64)) for s in self.shapes)

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)[:-1]]))

    @property
    def total(self) -> int:
        """Total number of coordinates (parameters) P."""
        return int(sum(self.sizes))

    @functools.cached_property
    def fingerprint(self) -> str:
        blob = json.dumps([[n, list(s)] for n, s in zip(self.names, self.shapes)], separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def check(self, arrays: Sequence[jax.Array], batch_dims: int = 0) -> None:
        """Raises ValueError naming the parameter when ``arrays`` do not match the layout's shapes
        (after ``batch_dims`` leading axes)."""
        if len(arrays) != len(self.names):
            raise ValueError(f"expected {len(self.names)} gradient arrays in layout order, got {len(arrays)}")
        for n, s, a in zip(self.names, self.shapes, arrays):
            if tuple(a.shape[batch_dims:]) != s:
                raise ValueError(f"gradient of {n!r} has shape {tuple(a.shape)}, layout expects "
                                 f"{'[batch] + ' if batch_dims else ''}{s}")


def layout_tables(layout: ParamLayout, dim: int, seed: int = 0) -> list[jax.Array]:
    """Precomputed device hash tables, one int32 array per parameter in the parameter's shape.

    Entry = ``bucket | (sign < 0) << 31``: ``code & (dim - 1)`` is the bucket and ``code < 0`` the
    negative sign. Costs 4 bytes per parameter; shard them like the parameters if needed.
    """
    dim, seed = check_dim(dim), _check_seed(seed)
    if dim > 1 << 31:
        raise ValueError(f"layout_tables needs dim <= 2**31, got {dim}")

    def table(offset: int, n: int, shape: tuple[int, ...]) -> jax.Array:
        b, s = segment_bucket_sign(offset, n, dim, seed)
        return (b | jnp.where(s < 0, jnp.int32(-(1 << 31)), jnp.int32(0))).reshape(shape)

    entries = list(zip(layout.offsets, layout.sizes, layout.shapes))
    return jax.jit(lambda: [table(*e) for e in entries])()


def _bucket_sign(k: int, layout: ParamLayout, dim: int, seed: int, tables: Sequence[jax.Array] | None
                 ) -> tuple[jax.Array, jax.Array]:
    if tables is None:
        return segment_bucket_sign(layout.offsets[k], layout.sizes[k], dim, seed)
    code = tables[k].reshape(-1)
    return code & jnp.int32(dim - 1), jnp.where(code < 0, jnp.float32(-1), jnp.float32(1))


def sketch_tree(grads: Sequence[jax.Array], layout: ParamLayout, dim: int, seed: int = 0,
                tables: Sequence[jax.Array] | None = None, hash_name: str = "splitmix64") -> jax.Array:
    """CountSketch of one gradient given as arrays in layout (HF) order (SPEC §3.1); jittable.

    Args:
        grads: one array per layout entry, shapes as in the layout, any float dtype (cast to
            float32 before the signed scatter-add).
        layout: the :class:`ParamLayout` (static).
        dim, seed: sketch width (power of two) and hash seed (static).
        tables: optional :func:`layout_tables` for ``(layout, dim, seed)``; default hashes on the fly.
        hash_name: the hash family (config ``sketch.hash``): "splitmix64" (SPEC §3.1) or "block"
            (:func:`block_sketch_at` per parameter; no tables).
    Returns:
        float32[dim] = sum over parameters of ``segment_sum(sign * g.ravel(), bucket, dim)``.
    Raises:
        ValueError: wrong number of arrays, a shape mismatch (naming the parameter), a bad dim,
            tables with the block family.
    """
    dim = check_dim(dim)
    if check_tables(hash_name, tables is not None) == "block":
        return sketch_batch([g[None] for g in grads], layout, dim, seed, hash_name=hash_name)[0]
    layout.check(grads)
    acc = jnp.zeros((dim,), jnp.float32)
    for k, g in enumerate(grads):
        if layout.sizes[k]:
            b, s = _bucket_sign(k, layout, dim, seed, tables)
            acc = acc.at[b].add(g.reshape(-1).astype(jnp.float32) * s)
    return acc


def check_tables(hash_name: str, has_tables: bool) -> str:
    """Returns ``hash_name`` checked (:func:`check_hash`); ``has_tables``: hash tables will be used.

    Raises:
        ValueError: an unknown family, or tables with the block family (it has none).
    """
    if check_hash(hash_name) == "block" and has_tables:
        raise ValueError("sketch.hash='block' takes no hash tables: turn off sketch.in_run_tables and "
                         "targets.use_tables")
    return hash_name


TABLE_KEYS = ("sketch.in_run_tables", "targets.use_tables")  # the config's two hash-table switches


def tables_from_config(config: Any, key: str) -> bool:
    """The hash-table switch ``key`` of :data:`TABLE_KEYS` read from ``config``, refused where nothing
    would honour it: the fused sketcher (``sketch.fused``, the default) forms and hashes each
    example's gradient in its backward and takes no tables, so tables there would be ignored.

    Raises:
        ValueError: ``key`` is not one of :data:`TABLE_KEYS`; or ``key`` is on with ``sketch.fused``
            on, naming both keys.
    """
    if key not in TABLE_KEYS:
        raise ValueError(f"tables_from_config: {key!r} is not one of {TABLE_KEYS}")
    section, name = key.split(".")
    on = bool(getattr(getattr(config, section), name))
    if on and bool(config.sketch.fused):
        raise ValueError(f"config.{key}=True is ignored by the fused sketcher (config.sketch.fused=True, the default): "
                         f"it hashes on the fly and takes no tables; set config.{key}=False, or "
                         "config.sketch.fused=False for the vmap(grad) sketcher that reads them")
    return on


def _block_add(acc: jax.Array, gs: Sequence[jax.Array], offsets: Sequence[tuple[Any, Any]], dim: int,
               seed: int) -> jax.Array:
    """``acc`` float32 [C, dim] plus the block-family sketches of the flat [C, n_k] arrays ``gs``,
    each a whole parameter whose first global index is ``offsets[k]`` = (hi, lo) uint32 scalars."""
    for g, (hi, lo) in zip(gs, offsets):
        acc = acc + block_sketch_at(g, hi, lo, 0, dim, seed)
    return acc


def _static_u32(offset: int) -> tuple[jax.Array, jax.Array]:
    hi, lo = split_u64([offset])
    return jnp.asarray(hi[0]), jnp.asarray(lo[0])


def sketch_batch(grads: Sequence[jax.Array], layout: ParamLayout, dim: int, seed: int = 0,
                 tables: Sequence[jax.Array] | None = None, hash_name: str = "splitmix64") -> jax.Array:
    """Per-example CountSketch of a batch of gradients; arrays in layout order with a leading axis C.

    Returns float32[C, dim]; row c equals ``sketch_tree([g[c] for g in grads], ...)``. The hash is
    computed once per call and the examples are scattered one after another (``lax.map``), which
    measured faster on CPU than a batched scatter (docs/benchmarks.md). ``hash_name="block"``: the
    whole batch at once per parameter (:func:`block_sketch_at`, no scatter).
    """
    dim = check_dim(dim)
    layout.check(grads, batch_dims=1)
    c = grads[0].shape[0] if grads else 0
    if check_tables(hash_name, tables is not None) == "block":
        live = [k for k in range(len(layout)) if layout.sizes[k]]
        return _block_add(jnp.zeros((c, dim), jnp.float32), [grads[k].reshape(c, -1) for k in live],
                          [_static_u32(layout.offsets[k]) for k in live], dim, seed)
    hashes = [_bucket_sign(k, layout, dim, seed, tables) for k in range(len(layout)) if layout.sizes[k]]
    flat = [g.reshape(c, -1) for k, g in enumerate(grads) if layout.sizes[k]]

    def one(gs: list[jax.Array]) -> jax.Array:
        acc = jnp.zeros((dim,), jnp.float32)
        for g, (b, s) in zip(gs, hashes):
            acc = acc.at[b].add(g.astype(jnp.float32) * s)
        return acc

    return jax.lax.map(one, flat)


# ------------------------------------------------------------------------------------------------
# Repeated blocks (decoder layers) sketched in a lax.scan, hashing with traced offsets
# ------------------------------------------------------------------------------------------------


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
    return index_bucket_sign(offset_hi, offset_lo, jax.lax.iota(_U32, n), dim, seed)


def _global_u32(offset_hi: Any, offset_lo: Any, local: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(hi, lo) of ``offset + local`` for a uint32 array ``local``, carrying across 2**32."""
    local = jnp.asarray(local).astype(_U32)
    lo = local + jnp.asarray(offset_lo).astype(_U32)
    return jnp.asarray(offset_hi).astype(_U32) + (lo < local).astype(_U32), lo  # carry out of the low word


def index_bucket_sign(offset_hi: jax.Array, offset_lo: jax.Array, local: jax.Array, dim: int, seed: int = 0,
                      hash_name: str = "splitmix64") -> tuple[jax.Array, jax.Array]:
    """Hash of the global indices ``offset + local`` (JAX, jittable): ``offset = offset_hi * 2**32 +
    offset_lo`` given as (possibly traced) uint32 scalars, ``local`` any uint32 array of indices
    inside the parameter (e.g. ``token_id * d + column`` for embedding rows). The (hi, lo) sum
    carries across 2**32; bit-exact with :func:`numpy_bucket_sign` for every index < 2**64 (with
    ``hash_name="block"``: with :func:`numpy_block_bucket_sign`, ``offset`` being the parameter's
    first global index). Returns (bucket int32, sign float32), shaped like ``local``."""
    bucket, sign = bucket_sign_u32(*_global_u32(offset_hi, offset_lo, local), dim, seed)
    if check_hash(hash_name) == "splitmix64":
        return bucket, sign
    local = jnp.asarray(local).astype(_U32)
    pos = local & _c(dim - 1)
    return (block_offsets_u32(*_global_u32(offset_hi, offset_lo, local - pos), dim, seed) + pos.astype(jnp.int32)
            ) & jnp.int32(dim - 1), sign


def block_offsets_u32(hi: jax.Array, lo: jax.Array, dim: int, seed: int = 0) -> jax.Array:
    """JAX :func:`numpy_block_offsets` of block starts given as (hi, lo) uint32 arrays -> int32 [0, dim)."""
    dim, seed = check_dim(dim), _check_seed(seed)
    _, o_lo = splitmix64_u32(*_add64(*_add64(hi.astype(_U32), lo.astype(_U32), seed), OFFSET_SALT))
    return (o_lo & _c(dim - 1)).astype(jnp.int32)


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
    first = jnp.asarray(np.uint32(first)) if isinstance(first, int) else jnp.asarray(first).astype(_U32)
    shift = first & _c(dim - 1)
    x = g.astype(jnp.float32)
    if aligned:
        x = jnp.pad(x, ((0, 0), (0, nb * dim - n)))
    else:
        x = jax.lax.dynamic_update_slice(jnp.zeros((c, nb * dim), jnp.float32), x, (jnp.int32(0), shift.astype(jnp.int32)))
    starts = first - shift + jax.lax.iota(_U32, nb) * _c(dim)  # local index of each block's first coordinate
    _, sign = bucket_sign_u32(*_global_u32(offset_hi, offset_lo, starts[:, None] + jax.lax.iota(_U32, dim)), dim, seed)
    offs = block_offsets_u32(*_global_u32(offset_hi, offset_lo, starts), dim, seed)
    src = (jax.lax.iota(jnp.int32, dim)[None, :] - offs[:, None]) & jnp.int32(dim - 1)  # roll: out[j] = x[j - o]
    x = x.reshape(c, nb, dim) * sign
    # indices [1, nb, dim]: the batch axis is a gather slice (no index array per example)
    return jnp.sum(jnp.take_along_axis(x, src[None], axis=2, mode="promise_in_bounds"), axis=1)


def split_u64(values: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative integers < 2**64 (any shape) as (hi, lo) uint32 numpy arrays."""
    v = np.asarray(values, dtype=np.uint64)
    return (v >> np.uint64(32)).astype(np.uint32), (v & np.uint64(0xFFFFFFFF)).astype(np.uint32)


@dataclasses.dataclass(frozen=True)
class StackedLayout:
    """A :class:`ParamLayout` whose middle is L repeated blocks (decoder layers) of the same J leaves.

    Parameter ``k`` of the layout is one of: ``pre`` (before the blocks, e.g. the embedding),
    ``blocks[i][j]`` (leaf j of block i, e.g. ``model.layers.{i}.mlp.up_proj.weight``) or ``post``
    (after them: the final norm, lm_head). The blocks are contiguous in the layout and every block
    has the same leaf names (after the block prefix) and shapes, so block leaf j's gradients can be
    stacked [L, *shape_j] and sketched in one ``lax.scan`` with per-(block, leaf) offsets
    ``layout.offsets[blocks[i][j]]`` (:func:`sketch_batch_stacked`).

    Raises ValueError (from :meth:`from_prefix`) naming the parameter that breaks the pattern.
    """

    layout: ParamLayout
    pre: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]
    post: tuple[int, ...]
    leaf_names: tuple[str, ...]  # the J names inside a block, e.g. "mlp.up_proj.weight"

    @classmethod
    def from_prefix(cls, layout: ParamLayout, prefix: str = "model.layers.") -> "StackedLayout":
        """The blocks are the names ``f"{prefix}{i}.{leaf}"``, i = 0..L-1 in order."""
        blocks: list[list[int]] = []
        leaves: list[list[str]] = []
        pre, post = [], []
        for k, name in enumerate(layout.names):
            if name.startswith(prefix):
                idx, _, leaf = name[len(prefix):].partition(".")
                if not idx.isdigit() or not leaf:
                    raise ValueError(f"StackedLayout: cannot parse block index of {name!r}")
                i = int(idx)
                if post:
                    raise ValueError(f"StackedLayout: block parameter {name!r} after non-block parameters")
                if i == len(blocks):
                    blocks.append([])
                    leaves.append([])
                elif i != len(blocks) - 1:
                    raise ValueError(f"StackedLayout: {name!r} is out of block order")
                blocks[i].append(k)
                leaves[i].append(leaf)
            elif blocks:
                post.append(k)
            else:
                pre.append(k)
        if not blocks:
            raise ValueError(f"StackedLayout: no parameter name starts with {prefix!r}")
        for i in range(1, len(blocks)):
            same = leaves[i] == leaves[0] and all(
                layout.shapes[a] == layout.shapes[b] for a, b in zip(blocks[i], blocks[0]))
            if not same:
                raise ValueError(f"StackedLayout: block {prefix}{i} differs from block 0 in names or shapes")
        return cls(layout, tuple(pre), tuple(tuple(b) for b in blocks), tuple(post), tuple(leaves[0]))

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @functools.cached_property
    def block_offsets(self) -> np.ndarray:
        """uint64 [L, J]: global index of the first coordinate of leaf j of block i."""
        return np.array([[self.layout.offsets[k] for k in b] for b in self.blocks], dtype=np.uint64)

    def block_shape(self, j: int) -> tuple[int, ...]:
        return self.layout.shapes[self.blocks[0][j]]


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
                         slayout: StackedLayout, dim: int, seed: int = 0, hash_name: str = "splitmix64") -> jax.Array:
    """Per-example CountSketch like :func:`sketch_batch`, with the block leaves stacked and sketched
    in a ``lax.scan`` over the blocks (hashing on the fly with traced per-block offsets, so the hash
    of each leaf kind is compiled once, and no hash tables are needed).

    Args:
        pre, post: the gradients of ``slayout.pre`` / ``slayout.post`` parameters, each [C, *shape].
        blocks: one array per block leaf j, [C, L, *shape_j] (e.g. the gradient with respect to
            ``decoder.StackedParams.layers`` under ``vmap``).
        slayout: the :class:`StackedLayout`; dim, seed, hash_name: as :func:`sketch_tree`.
    Returns:
        float32[C, dim], equal to ``sketch_batch`` of the same gradients in layout order: the same
        hashes, and each example's scatter-adds run in the same (layout) order.
    Raises:
        ValueError: a count or shape that does not match ``slayout``.
    """
    dim = check_dim(dim)
    _check_stacked(pre, blocks, post, slayout)
    block = check_hash(hash_name) == "block"
    lay, n_blocks = slayout.layout, slayout.num_blocks
    c = (list(pre) + list(blocks) + list(post))[0].shape[0]

    def add(acc, gs, wheres):  # gs: flat [C, n] arrays of whole parameters; wheres: their (hi, lo) offsets
        if block or not gs:
            return _block_add(acc, gs, wheres, dim, seed)
        hashes = [segment_bucket_sign_at(h, l_, g.shape[1], dim, seed) for g, (h, l_) in zip(gs, wheres)]

        def one(args):
            a, g = args
            for gk, (b, s) in zip(g, hashes):
                a = a.at[b].add(gk.astype(jnp.float32) * s)
            return a

        return jax.lax.map(one, (acc, list(gs)))

    def static(acc, ks, gs):
        keep = [(k, g) for k, g in zip(ks, gs) if lay.sizes[k]]
        return add(acc, [g.reshape(c, -1) for _, g in keep], [_static_u32(lay.offsets[k]) for k, _ in keep])

    acc = static(jnp.zeros((c, dim), jnp.float32), slayout.pre, pre)
    live = [j for j in range(len(blocks)) if lay.sizes[slayout.blocks[0][j]]]
    if live:
        hi, lo = split_u64(slayout.block_offsets[:, live])
        xs = ([jnp.moveaxis(blocks[j], 1, 0).reshape(n_blocks, c, -1) for j in live], jnp.asarray(hi), jnp.asarray(lo))

        def body(a, x):
            gs, h, l_ = x
            return add(a, gs, [(h[m], l_[m]) for m in range(len(gs))]), None

        acc = jax.lax.scan(body, acc, xs)[0]
    return static(acc, slayout.post, post)
