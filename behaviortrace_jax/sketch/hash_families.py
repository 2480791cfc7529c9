"""Hash families of the CountSketch, as objects, and the one registry of them by name (SPEC §3.1).

A :class:`HashFamily` says where each gradient coordinate goes (its bucket in [0, D) and its sign)
and how that is computed: a JAX hash of coordinates, its bit-exact numpy reference, and optionally
a scatter-free sketch of a run of coordinates. It also says what it writes into a sketch store's
metadata (``hash_family``, a versioned name) and checks a store's metadata against itself.

Config ``sketch.hash`` names a family; it is resolved once, where the run's spec is built at the
stage boundary (``stages/spec.py``: ``RunSpec.sketch``, ``RunSpec.step``, ``RunSpec.forced``), with
:func:`hash_family`. Code below that takes the object.

The families (docs/architecture.md, "Add a hash family", says how to add one):

* :data:`SPLITMIX64` (``splitmix64``, the default, SPEC §3.1, paper-exact): a splitmix64 bucket and
  sign per global coordinate index (``splitmix64.py``), summed with a scatter-add.
* :data:`BLOCK` (``block``): scatter-free; each D-sized block of a parameter rolled by a splitmix64
  offset, the same signs (``block_hash.py``); no hash tables.

``sketch.hash = "auto"`` (the default) and ``sketch.kernel = "auto"`` are chosen per backend by
:func:`choose_sketch` (:data:`AUTO_RULES`): CPU keeps splitmix64 on the XLA path (the paper's hash;
the block family's roll is slower than its scatter there, docs/records/benchmarks.md); TPU takes the block
family with the Pallas kernel (``pallas_sketch.py``); GPU the block family on the XLA path (the
kernel is Mosaic-TPU only). The chosen family is what every store records (``hash_family``), so
sketches of a CPU run and a TPU run are never compared.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from behaviortrace_jax.sketch import block_hash, splitmix64

CONFIG_KEY = "sketch.hash"  # the config key naming the family


@dataclasses.dataclass(frozen=True)
class HashFamily:
    """One CountSketch hash family. Every hash takes the CountSketch seed (``sketch.seed``) and the
    width D (a power of two) as arguments, so one object serves every seed and D; the store records
    the seed and D beside the family's name.

    Fields:
        name (str): the config value (``sketch.hash``) and registry key.
        metadata_name (str): recorded as ``hash_family`` in every sketch store's metadata; version
            it (``-v1``) and change it whenever the buckets or signs change.
        index_bucket_sign: JAX, jittable ``(offset_hi, offset_lo, local, dim, seed) -> (bucket int32,
            sign float32)``: the hash of coordinates ``local`` (a uint32 array, any shape) of the
            parameter whose first coordinate has global index ``offset_hi * 2**32 + offset_lo``
            (uint32 scalars, possibly traced; HF parameter order), buckets in [0, dim), signs +-1,
            shaped like ``local``. Every path that scatters uses it.
        numpy_bucket_sign: numpy ``(local uint64 array, offset int, dim, seed) -> (bucket int64, sign
            float32)``, bit-exact with ``index_bucket_sign`` (the reference ``countsketch.numpy_sketch``).
        block_sketch: None (the family is summed with a scatter-add, and may use hash tables), or
            the scatter-free sketch ``(g float [C, n], offset_hi, offset_lo, first, dim, seed,
            aligned=None) -> float32 [C, dim]`` of coordinates ``first .. first + n - 1`` of one
            parameter per row (``block_hash.block_sketch_at``), equal to scattering ``g`` with
            ``index_bucket_sign`` up to float rounding.
        kernel_layout (bool): the Pallas kernel (``pallas_sketch.py``) sketches in this family's
            layout (dense bucket updates by rotations: the block family's); only such a family takes
            ``sketch.kernel`` "pallas" / "interpret".
        global_index (bool): ``index_bucket_sign`` depends on the global index ``offset + local``
            alone, not on where one parameter ends and the next begins (splitmix64: yes; the block
            family keys each block: no). Then consecutive parameters may be hashed as one segment
            (``countsketch.sketch_tree``, ``sketch_batch``, ``sketch_batch_stacked``: one hash and
            one scatter per ``hash_segments`` run instead of one per parameter, the same buckets and
            signs, and far less for XLA to compile). Default False, the safe choice for a new family.
    Raises:
        ValueError: an empty name or metadata name; TypeError: a hash that is not callable.
    """

    name: str
    metadata_name: str
    index_bucket_sign: Callable
    numpy_bucket_sign: Callable
    block_sketch: Callable | None = None
    kernel_layout: bool = False
    global_index: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not isinstance(self.metadata_name, str) \
                or not self.metadata_name:
            raise ValueError(f"HashFamily needs a non-empty name and metadata_name, got {self.name!r}, "
                             f"{self.metadata_name!r}")
        for field in ("index_bucket_sign", "numpy_bucket_sign", "block_sketch"):
            fn = getattr(self, field)
            if not callable(fn) and not (field == "block_sketch" and fn is None):
                raise TypeError(f"HashFamily {self.name!r}: {field} must be callable, got {fn!r}")

    @property
    def scatter_free(self) -> bool:
        """Sketched per parameter by :attr:`block_sketch` (a dense multiply and a gather), no scatter."""
        return self.block_sketch is not None

    @property
    def takes_tables(self) -> bool:
        """Whether precomputed hash tables (``hash_tables.layout_tables``) can stand in for the hash: only
        for a family summed with a scatter (a scatter-free one has no per-coordinate table to read)."""
        return not self.scatter_free

    def store_metadata(self) -> dict[str, str]:
        """What the family writes into a sketch store's metadata: ``{"hash_family": metadata_name}``."""
        return {"hash_family": self.metadata_name}

    def check_store_metadata(self, metadata: Mapping, where: str) -> None:
        """Refuses a sketch store whose metadata (``metadata.json``, read at ``where``) records
        another hash family: sketches of two families cannot be compared or mixed.

        Raises:
            ValueError: naming ``where``, both families (name and ``hash_family``) and ``sketch.hash``.
        """
        stored = metadata.get("hash_family", "<absent>")
        if stored == self.metadata_name:
            return
        other = family_for_metadata(stored)
        theirs = f"hash family {other.name!r}" if other is not None else "an unregistered hash family"
        raise ValueError(f"{where}: the store's hash_family is {stored!r} ({theirs}), but these sketches use hash "
                         f"family {self.name!r} (hash_family {self.metadata_name!r}, config {CONFIG_KEY}); sketches "
                         "of two hash families cannot be compared or mixed: rerun the stage that wrote the store "
                         f"or set {CONFIG_KEY} to the store's family")


_FAMILIES: dict[str, HashFamily] = {}


def register_hash_family(family: HashFamily) -> HashFamily:
    """Adds ``family`` to the registry under ``family.name`` and returns it (registering the same
    object twice is a no-op).

    Raises:
        TypeError: not a :class:`HashFamily`. ValueError: another family already has that name or
            that ``metadata_name``.
    """
    if not isinstance(family, HashFamily):
        raise TypeError(f"register_hash_family: expected a HashFamily, got {type(family).__name__}")
    if _FAMILIES.get(family.name) is family:
        return family
    if family.name in _FAMILIES:
        raise ValueError(f"hash family {family.name!r} is already registered")
    clash = [f.name for f in _FAMILIES.values() if f.metadata_name == family.metadata_name]
    if clash:
        raise ValueError(f"hash family {family.name!r}: metadata_name {family.metadata_name!r} is {clash[0]!r}'s")
    _FAMILIES[family.name] = family
    return family


def hash_family_names() -> tuple[str, ...]:
    """The registered families' names, sorted."""
    return tuple(sorted(_FAMILIES))


def hash_family(name: str, key: str = CONFIG_KEY) -> HashFamily:
    """The registered family called ``name`` (e.g. the value of config ``sketch.hash``).

    Raises:
        ValueError: naming ``key``, the value and the known families, for an unregistered name.
    """
    if not isinstance(name, str) or name not in _FAMILIES:
        raise ValueError(f"{key}={name!r}: expected one of {list(hash_family_names())}")
    return _FAMILIES[name]


def family_for_metadata(metadata_name: str) -> HashFamily | None:
    """The registered family whose ``metadata_name`` is ``metadata_name``, or None."""
    return next((f for f in _FAMILIES.values() if f.metadata_name == metadata_name), None)


SPLITMIX64 = register_hash_family(HashFamily(
    name="splitmix64", metadata_name="splitmix64-countsketch-v3",
    index_bucket_sign=splitmix64.index_bucket_sign, numpy_bucket_sign=splitmix64.numpy_index_bucket_sign,
    global_index=True))
BLOCK = register_hash_family(HashFamily(
    name="block", metadata_name="splitmix64-block-countsketch-v1",
    index_bucket_sign=block_hash.block_index_bucket_sign, numpy_bucket_sign=block_hash.numpy_block_bucket_sign,
    block_sketch=block_hash.block_sketch_at, kernel_layout=True))
DEFAULT_HASH_FAMILY = SPLITMIX64  # the family where none is chosen (library default); SPEC §3.1's hash
AUTO = "auto"  # config sketch.hash / sketch.kernel: chosen per backend (choose_sketch)
KERNEL_KEY = "sketch.kernel"
# backend platform -> (family, kernel) of "auto"; any other platform takes the "tpu" row's family
# and the XLA path
AUTO_RULES = {"cpu": (SPLITMIX64, "xla"), "tpu": (BLOCK, "pallas"), "gpu": (BLOCK, "xla"),
              "cuda": (BLOCK, "xla"), "rocm": (BLOCK, "xla")}


def choose_sketch(hash_name: str, kernel_name: str = AUTO, platform: str | None = None) -> tuple[HashFamily, str]:
    """The hash family and the matmul-use kernel of config ``sketch.hash`` / ``sketch.kernel`` on
    backend ``platform`` (``jax.default_backend()`` when None; the compile stage passes its target's).

    ``"auto"`` takes :data:`AUTO_RULES`; an explicit family or kernel is kept (a kernel other than
    "xla" needs a family with ``kernel_layout``, the block family: ``pallas_sketch.check_kernel``).
    An "auto" kernel with an explicit family takes the Pallas kernel only for such a family on TPU. Returns (HashFamily, kernel in
    ``pallas_sketch.KERNELS``).

    Raises:
        ValueError: an unknown family (naming ``sketch.hash``) or kernel, or a kernel the family
            cannot take (naming ``sketch.kernel``).
    """
    from behaviortrace_jax.sketch import pallas_sketch  # the kernel module imports jax's Pallas

    if platform is None:
        import jax

        platform = jax.default_backend()
    rule_family, rule_kernel = AUTO_RULES.get(str(platform), (AUTO_RULES["tpu"][0], "xla"))
    family = rule_family if hash_name == AUTO else hash_family(hash_name)
    if kernel_name == AUTO:
        kernel = rule_kernel if family.kernel_layout else "xla"
    else:
        kernel = kernel_name
    return family, pallas_sketch.check_kernel(kernel, family)
