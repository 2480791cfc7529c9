"""Device mesh, parameter partition rules by role, and activation sharding constraints.

The mesh has two axes: ``"data"`` (rows of a batch: prompts, rollouts, examples) and ``"model"``
(tensor parallelism inside a layer, Megatron style). Parameters are in Hugging Face layout
(``[out, in]`` linear weights, ``embed_tokens.weight [vocab, embed]``; see ``decoder.py``), so a
partition rule is a row of :data:`PARAM_RULES`: a regex on the HF key and the *logical* name of
each weight axis; :data:`LOGICAL_AXES` maps logical names to mesh axes. Column-parallel layers
(q/k/v, gate/up) split their output rows over ``"model"``; row-parallel layers (o_proj, down) split
their input columns, so each attention / MLP block needs one reduction; biases and norms (Qwen3's
per-head ``q_norm`` / ``k_norm`` too) are replicated. A weight axis whose size is not divisible by the mesh axis is replicated instead.

:class:`Layout` is the run's one layout (``config.mesh``: axis sizes, FSDP, devices): its
:meth:`Layout.mesh` is the only place the package builds a mesh, and :meth:`Layout.param_shardings`
places parameters with its FSDP setting, so every stage and the compile stage shard alike.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from behaviortrace_jax.io.checkpoints import tree_path_name

DATA, MODEL = "data", "model"

# Logical weight/activation axis -> mesh axis (None = replicated).
LOGICAL_AXES: dict[str, str | None] = {
    "batch": DATA,
    "vocab": MODEL,
    "embed": None,
    "heads": MODEL,  # n_heads * head_dim (or n_kv_heads * head_dim for k/v)
    "mlp": MODEL,
    "norm": None,
}

# (regex on the HF parameter key, logical axes of the weight). First match wins; every parameter
# must match one row (an unknown parameter is an error, not silently replicated).
PARAM_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"(^|\.)embed_tokens\.weight$", ("vocab", "embed")),
    (r"(^|\.)lm_head\.weight$", ("vocab", "embed")),
    (r"\.self_attn\.[qkv]_proj\.weight$", ("heads", "embed")),
    (r"\.self_attn\.o_proj\.weight$", ("embed", "heads")),
    (r"\.mlp\.(gate|up)_proj\.weight$", ("mlp", "embed")),
    (r"\.mlp\.down_proj\.weight$", ("embed", "mlp")),
    (r"\.bias$", ("norm",)),
    (r"norm\.weight$", ("norm",)),
)


def make_mesh(data: int = -1, model: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A ``("data", "model")`` mesh of shape ``(data, model)`` over ``devices`` (default: all).

    The implementation of :meth:`Layout.mesh`, which is the package's only caller
    (``tests/models/test_layout.py``); tests build ad hoc meshes with it.

    ``model=-1`` chooses the model axis from the device count (:func:`auto_model_axis`: tensor-parallel
    pairs whenever the devices pair up); ``data=-1`` takes ``len(devices) // model``. Axes are
    ``AxisType.Auto`` (GSPMD propagation).

    Raises:
        ValueError: naming the sizes when ``model`` is not -1 or >= 1, ``data`` is not -1 or >= 1,
            or ``data * model`` != the number of devices.
    """
    devs = list(jax.devices() if devices is None else devices)
    n = len(devs)
    if model == -1:
        model = auto_model_axis(n)
    if model < 1 or n % model:
        raise ValueError(f"mesh.model={model} must be -1 (chosen from the device count) or >= 1 and divide the "
                         f"device count {n}")
    if data == -1:
        data = n // model
    if data < 1 or data * model != n:
        raise ValueError(f"mesh.data={data} x mesh.model={model} = {data * model} != {n} devices")
    return Mesh(np.asarray(devs, dtype=object).reshape(data, model), (DATA, MODEL),
                axis_types=(AxisType.Auto, AxisType.Auto))


_MESH_KEYS = ("mesh.data", "mesh.model", "mesh.fsdp")


@dataclasses.dataclass(frozen=True)
class Layout:
    """The run's device layout: the one ``("data", "model")`` mesh and how parameters lie on it.

    Built once at the stage boundary (``stages/spec.py``, from ``config.mesh``) and handed down:
    :meth:`mesh` is the only place the package constructs a ``jax.sharding.Mesh`` (through
    :func:`make_mesh`), and :meth:`param_shardings` is how every stage, the checkpoint loader
    (``loader.load_policy``), the GRPO start state (replay and metagradient included) and the
    compile stage place parameters, so FSDP is honoured wherever they are placed and the compile
    stage lowers the programs the stages run (``tests/models/test_layout.py``).

    Fields:
        data: size of the ``"data"`` axis (rows of a batch: prompts, rollouts, examples); -1 = the
            device count / ``model`` (``mesh.data``).
        model: size of the ``"model"`` axis (tensor parallel); -1 = :func:`auto_model_axis` of the
            device count (``mesh.model``).
        fsdp: also split each matrix, and the AdamW moments that follow it, over ``"data"``
            (:func:`fsdp_spec`; ``mesh.fsdp``). A no-op on a data axis of 1.
        devices: the mesh's devices in order; None = ``jax.devices()`` (every process's) when
            :meth:`mesh` is called. The compile stage gives its target's (:meth:`on`).

    Raises:
        ValueError: naming the key (``mesh.data``, ``mesh.model``, ``mesh.fsdp``) when ``data`` or
            ``model`` is not an int that is -1 or >= 1, ``fsdp`` is not a bool, or ``devices`` is
            empty; :meth:`mesh` when ``data * model`` != the device count.
    """

    data: int = -1
    model: int = 1
    fsdp: bool = False
    devices: tuple[Any, ...] | None = None

    def __post_init__(self):
        for key, v in zip(_MESH_KEYS[:2], (self.data, self.model)):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or not (v == -1 or v >= 1):
                raise ValueError(f"{key}={v!r} must be an int, -1 (chosen from the device count) or >= 1")
        if not isinstance(self.fsdp, (bool, np.bool_)):
            raise ValueError(f"mesh.fsdp={self.fsdp!r} must be a bool")
        object.__setattr__(self, "data", int(self.data))
        object.__setattr__(self, "model", int(self.model))
        object.__setattr__(self, "fsdp", bool(self.fsdp))
        if self.devices is not None:
            if not len(self.devices):
                raise ValueError("Layout.devices: no devices (None = every device)")
            object.__setattr__(self, "devices", tuple(self.devices))

    def on(self, devices: Sequence[Any]) -> "Layout":
        """This layout over ``devices`` (e.g. a compile target's, ``stages/compile.target_devices``)."""
        return dataclasses.replace(self, devices=tuple(devices))

    def mesh(self) -> Mesh:
        """The ``("data", "model")`` mesh (:func:`make_mesh`); equal layouts give equal meshes.

        Raises:
            ValueError: naming ``mesh.data`` / ``mesh.model`` when their product is not the device count.
        """
        return make_mesh(self.data, self.model, self.devices)

    def param_shardings(self, abstract_params: Any, mesh: Mesh | None = None,
                        rules: Sequence[tuple[str, tuple[str, ...]]] | None = None) -> Any:
        """:func:`param_shardings` of ``abstract_params`` with this layout's ``fsdp``, on ``mesh``
        (this layout's :meth:`mesh`, given where the caller holds it already; default: built here)."""
        return param_shardings(abstract_params, self.mesh() if mesh is None else mesh, rules, fsdp=self.fsdp)


def auto_model_axis(n_devices: int) -> int:
    """The model (tensor-parallel) axis ``mesh.model = -1`` chooses for ``n_devices`` devices: 2 when
    the count is even, else 1. A pair halves each chip's share of the gathered parameters, of the
    per-rollout gradients and of their sum inside the in-run sketcher's ``shard_map`` (manual over
    ``"data"`` only), which is what fits Qwen2.5-1.5B's GRPO step on a 16 GiB v5e chip
    (docs/records/benchmarks.md, "Compile stage"); one device (a single GPU) keeps the whole model."""
    return 2 if n_devices > 1 and n_devices % 2 == 0 else 1


def logical_axes(key: str, rules: Sequence[tuple[str, tuple[str, ...]]] | None = None) -> tuple[str, ...]:
    """The logical axes of the parameter with HF key ``key`` (from ``rules``, default :data:`PARAM_RULES`;
    a family's own rules are ``families.family_of(config).param_rules``).

    Raises:
        ValueError: naming ``key`` when no rule matches.
    """
    for pattern, axes in (PARAM_RULES if rules is None else rules):
        if re.search(pattern, key):
            return axes
    raise ValueError(f"no partition rule matches parameter {key!r}; add a row to sharding.PARAM_RULES")


def spec_for(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> P:
    """PartitionSpec for logical ``axes`` of an array of ``shape``; indivisible axes are replicated.

    Raises:
        ValueError: when ``len(axes) != len(shape)`` or a logical axis is not in :data:`LOGICAL_AXES`.
    """
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
    out = []
    for name, size in zip(axes, shape):
        if name is not None and name not in LOGICAL_AXES:
            raise ValueError(f"unknown logical axis {name!r}; known: {sorted(LOGICAL_AXES)}")
        mesh_axis = None if name is None else LOGICAL_AXES[name]
        if mesh_axis is not None and size % mesh.shape[mesh_axis]:
            mesh_axis = None  # e.g. 2 KV heads on a model axis of 4 is fine (rows), 3 rows are not
        out.append(mesh_axis)
    return P(*out)


def fsdp_spec(spec: P, shape: Sequence[int], mesh: Mesh) -> P:
    """``spec`` with the largest still-replicated axis of ``shape`` that ``"data"`` divides split over
    ``"data"`` (FSDP / ZeRO-3: parameters and optimizer moments sharded over the data axis, gathered
    per use by GSPMD). Vectors (biases, norms) and a data axis of 1 are left as they are."""
    n = mesh.shape[DATA]
    parts = list(spec) + [None] * (len(shape) - len(spec))
    if n == 1 or len(shape) < 2 or DATA in parts:
        return spec
    free = [i for i, (p, size) in enumerate(zip(parts, shape)) if p is None and size % n == 0]
    if not free:
        return spec
    parts[max(free, key=lambda i: shape[i])] = DATA
    return P(*parts)


def param_shardings(abstract_params: Any, mesh: Mesh,
                    rules: Sequence[tuple[str, tuple[str, ...]]] | None = None, fsdp: bool = False) -> Any:
    """``NamedSharding`` for every parameter, in the structure of ``abstract_params``.

    Args:
        abstract_params: the ``nnx.State`` from ``nnx.split(model, nnx.Param)`` (arrays or
            ``jax.ShapeDtypeStruct`` leaves, e.g. of ``decoder.abstract_model``), or any pytree whose
            key paths spell HF keys.
        mesh: a ``("data", "model")`` mesh (the run's: :meth:`Layout.mesh`).
        rules: partition rules (default :data:`PARAM_RULES`, which covers every registered family).
        fsdp: also split each matrix over ``"data"`` (:func:`fsdp_spec`; config ``mesh.fsdp``), so the
            parameters and the AdamW moments that follow them take 1/data of the memory per device.

    Returns:
        The same pytree with ``NamedSharding`` leaves: pass it to ``jax.device_put``,
        ``jax.jit(in_shardings=/out_shardings=)`` or ``hf_io.load_hf_checkpoint(shardings=)``.

    Raises:
        ValueError: naming the parameter when no rule of :data:`PARAM_RULES` matches it.
    """
    def one(path, leaf):
        axes = logical_axes(tree_path_name(path), rules)
        shape = tuple(leaf.shape)
        if len(axes) != len(shape):
            raise ValueError(f"parameter {tree_path_name(path)!r}: rule axes {axes} vs shape {shape}")
        spec = spec_for(axes, shape, mesh)
        return NamedSharding(mesh, fsdp_spec(spec, shape, mesh) if fsdp else spec)

    return jax.tree_util.tree_map_with_path(one, abstract_params)


def shard_params(params: Any, mesh: Mesh) -> Any:
    """``jax.device_put`` of the parameter state onto :func:`param_shardings` (a new state)."""
    return put(params, param_shardings(params, mesh))


def put(tree: Any, shardings: Any) -> Any:
    """``jax.device_put(tree, shardings)`` that also works in a multi-process run, where a sharding
    spans other processes' devices and JAX only places host (numpy) values there: a local jax array
    (a fresh parameter, a PRNG key) goes through host memory first (every process holds the same
    value: same seeds, same code). ``shardings``: one sharding or a tree matching ``tree``. In a
    single process this is ``jax.device_put``."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    leaves, treedef = jax.tree.flatten(tree)
    impls = [jax.random.key_impl(x) if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
             else None for x in leaves]
    host = [np.asarray(jax.random.key_data(x)) if impl is not None
            else np.asarray(x) if isinstance(x, jax.Array) and x.is_fully_addressable else x
            for x, impl in zip(leaves, impls)]
    out = jax.tree.leaves(jax.device_put(jax.tree.unflatten(treedef, host), shardings))
    out = [x if impl is None else jax.random.wrap_key_data(x, impl=impl) for x, impl in zip(out, impls)]
    return jax.tree.unflatten(treedef, out)


def to_host(tree: Any) -> Any:
    """``jax.device_get(tree)`` that also works in a multi-process run: a leaf split over devices of
    other processes (a ``"data"``-sharded batch output) is first gathered to every process
    (``multihost_utils.process_allgather``, a collective: every process must call this in the same
    order). In a single process this is ``jax.device_get``."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return x

    return jax.device_get(jax.tree.map(one, tree))


def data_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a ``[B, ...]`` batch: rows split over ``"data"``, other axes replicated.

    B must be divisible by ``mesh.shape["data"]`` (pad the batch; the sampler does).
    """
    return NamedSharding(mesh, P(DATA))


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated sharding (scalars, PRNG keys)."""
    return NamedSharding(mesh, P())


def with_constraint(x: jax.Array, spec: P | Sequence[str | None], mesh: Mesh | None = None) -> jax.Array:
    """``jax.lax.with_sharding_constraint`` of an activation, a no-op without a mesh.

    Args:
        x: an array inside ``jax.jit`` (e.g. hidden [B, T, d] or logits [B, T, V]).
        spec: a ``PartitionSpec`` over mesh axes, or a tuple of *logical* names from
            :data:`LOGICAL_AXES` (e.g. ``("batch", None, "vocab")``); logical axes whose size
            does not divide are replicated.
        mesh: the mesh; None uses the mesh set by ``jax.set_mesh`` and returns ``x`` unchanged
            when there is none (single-device code paths).
    """
    if mesh is None:
        abstract = jax.sharding.get_abstract_mesh()
        if abstract.empty:
            return x
        if not isinstance(spec, P):
            spec = spec_for(tuple(spec), x.shape, abstract)
        return jax.lax.with_sharding_constraint(x, spec)
    if not isinstance(spec, P):
        spec = spec_for(tuple(spec), x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
