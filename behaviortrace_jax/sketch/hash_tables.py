"""CountSketch hash tables: precomputed buckets and signs on device, and the config switches that
ask for them (``sketch.in_run_tables``, ``targets.use_tables``).

Hashing is done on the fly inside the jitted function (the default): on CPU it measured about as
fast as streaming precomputed bucket/sign tables and it costs no memory (docs/records/benchmarks.md). Pass
``tables=layout_tables(...)`` to ``countsketch.sketch_tree`` / ``sketch_batch`` to use device
tables. Only a family summed with a scatter has tables (``HashFamily.takes_tables``).
"""
from __future__ import annotations


import jax
import jax.numpy as jnp

from behaviortrace_jax.sketch.hash_families import CONFIG_KEY, DEFAULT_HASH_FAMILY, HashFamily
from behaviortrace_jax.sketch.param_layout import ParamLayout
from behaviortrace_jax.sketch.splitmix64 import U32, check_dim, check_seed, split_u64

TABLE_KEYS = ("sketch.in_run_tables", "targets.use_tables")  # the config's two hash-table switches


def check_tables(hash_family: HashFamily, has_tables: bool) -> HashFamily:
    """Returns ``hash_family``; ``has_tables``: hash tables will be used.

    Raises:
        ValueError: tables with a family that takes none (a scatter-free one), naming both switches.
    """
    if has_tables and not hash_family.takes_tables:
        raise ValueError(f"{CONFIG_KEY}={hash_family.name!r} takes no hash tables: turn off sketch.in_run_tables "
                         "and targets.use_tables")
    return hash_family


def layout_tables(layout: ParamLayout, dim: int, seed: int = 0, hash_family: HashFamily = DEFAULT_HASH_FAMILY
                  ) -> list[jax.Array]:
    """Precomputed device hash tables, one int32 array per parameter in the parameter's shape.

    Entry = ``bucket | (sign < 0) << 31``: ``code & (dim - 1)`` is the bucket and ``code < 0`` the
    negative sign (:func:`table_bucket_sign`). Costs 4 bytes per parameter; shard them like the
    parameters if needed. Raises ValueError for ``dim > 2**31`` or a family that takes no tables.
    """
    dim, seed = check_dim(dim), check_seed(seed)
    check_tables(hash_family, True)
    if dim > 1 << 31:
        raise ValueError(f"layout_tables needs dim <= 2**31, got {dim}")

    def table(offset: int, n: int, shape: tuple[int, ...]) -> jax.Array:
        hi, lo = split_u64([offset])
        b, s = hash_family.index_bucket_sign(jnp.asarray(hi[0]), jnp.asarray(lo[0]), jax.lax.iota(U32, n), dim, seed)
        return (b | jnp.where(s < 0, jnp.int32(-(1 << 31)), jnp.int32(0))).reshape(shape)

    entries = list(zip(layout.offsets, layout.sizes, layout.shapes))
    return jax.jit(lambda: [table(*e) for e in entries])()


def table_bucket_sign(code: jax.Array, dim: int) -> tuple[jax.Array, jax.Array]:
    """(bucket int32, sign float32) of a flat :func:`layout_tables` entry array ``code``."""
    return code & jnp.int32(dim - 1), jnp.where(code < 0, jnp.float32(-1), jnp.float32(1))


def table_switch(key: str, on: bool, fused: bool) -> bool:
    """The hash-table switch ``key`` of :data:`TABLE_KEYS` (its value ``on``), refused where nothing
    would honour it: the fused sketcher (``fused``: ``sketch.fused``, the default) forms and hashes
    each example's gradient in its backward and takes no tables, so tables there would be ignored.
    Called where the run's spec is built (``stages/spec.py``).

    Raises:
        ValueError: ``key`` is not one of :data:`TABLE_KEYS`; or ``on`` with ``fused``, naming both keys.
    """
    if key not in TABLE_KEYS:
        raise ValueError(f"table_switch: {key!r} is not one of {TABLE_KEYS}")
    on = bool(on)
    if on and bool(fused):
        raise ValueError(f"config.{key}=True is ignored by the fused sketcher (config.sketch.fused=True, the default): "
                         f"it hashes on the fly and takes no tables; set config.{key}=False, or "
                         "config.sketch.fused=False for the vmap(grad) sketcher that reads them")
    return on
