"""Per-example gradient sketches: ``vmap(grad(loss))`` fused with CountSketch, chunked (SPEC §3.2).

The reusable library API. Given any pure ``loss(params, example) -> scalar`` and a batch pytree
whose leaves share a leading axis B, :class:`PerExampleSketcher` returns, from ONE jitted function,

* ``sketches``    float32[B, D]: CountSketch (SPEC §3.1) of each example's gradient in the
  parameter order of a :class:`ParamOrder` (HF ``model.parameters()`` order for a decoder);
* ``norms``       float32[B]: the exact L2 norm of each example's full gradient (not the sketch's);
* ``group_norms`` float32[B, G]: the same restricted to parameter groups (``sketcher.group_names``).

The batch is padded (by repeating its last example; outputs dropped) to a multiple of
``chunk_size`` and run chunk by chunk under ``jax.lax.map``; inside a chunk the gradients come from
``jax.vmap(jax.grad(loss), in_axes=(None, 0))`` and are sketched straight away, so peak memory is
about ``chunk_size x params`` whatever B is. One compilation per distinct B (and batch dtypes).
Parameters may be sharded: the result does not depend on the sharding.

With ``mesh=`` (a mesh whose ``"data"`` axis has more than one device) the chunked loop runs under
``jax.shard_map`` over that axis: the batch is split ``P("data")``, the parameters (and hash tables)
enter replicated ``P()``, and each device sketches its own examples - no per-example gradient crosses
devices. Left to GSPMD, the ``lax.map`` over a data-sharded batch is partitioned badly (all-gathers
of gradient slices inside the loop, redundant work, minutes of TPU code generation;
../shared/notes/AOT_FINDINGS.md). Examples are independent, so the sketches are the same.

Example (any model, here a 2-layer MLP in a plain dict)::

    import jax, jax.numpy as jnp
    from behaviortrace_jax.sketch.sketcher import PerExampleSketcher

    params = {"w1": jnp.zeros((16, 32)), "b1": jnp.zeros(32), "w2": jnp.zeros((32, 1))}

    def loss(p, ex):                       # one example, no batch axis
        h = jnp.tanh(ex["x"] @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] - ex["y"]) ** 2)

    sk = PerExampleSketcher(loss, params, dim=2**16, seed=0, chunk_size=8)
    out = sk(params, {"x": jnp.ones((100, 16)), "y": jnp.ones((100, 1))})
    out.sketches.shape, out.norms.shape, out.group_norms.shape   # (100, 65536) (100,) (100, 3)
    sk.layout.names                        # ('b1', 'w1', 'w2'): jax.tree_util flatten order

For a decoder of any family pass ``param_order=hf_param_order(config)`` (HF order and HF names, groups =
embedding / each decoder layer / final norm / lm_head) and a loss such as :func:`completion_loss`.
A single gradient (e.g. the GRPO step gradient) is sketched with :func:`sketch_vector`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from absl import logging

from behaviortrace_jax.models import programs, sharding
from behaviortrace_jax.sketch.countsketch import sketch_batch, sketch_batch_stacked, sketch_tree
from behaviortrace_jax.sketch.hash_families import DEFAULT_HASH_FAMILY, HashFamily
from behaviortrace_jax.sketch.param_layout import ParamLayout, StackedLayout
from behaviortrace_jax.sketch.splitmix64 import check_dim
from behaviortrace_jax.sketch.hash_tables import check_tables, layout_tables
from behaviortrace_jax.sketch import fused as fused_lib
from behaviortrace_jax.sketch.fused import DecoderLoss

PyTree = Any
DATA_AXIS = "data"  # the mesh axis of examples (models/sharding.DATA)
KeyPath = tuple[str | int, ...]


def _key_part(k: Any) -> str | int:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return getattr(k, attr)
    raise TypeError(f"unsupported pytree key {k!r}")


def flat_params(tree: PyTree) -> dict[KeyPath, jax.Array]:
    """``{path: array}`` over the leaves of ``tree`` in ``jax.tree_util`` flatten order.

    Paths are tuples of dict keys / attribute names / sequence indices; the trailing ``value``
    attribute of ``nnx.Variable`` leaves is dropped, so an ``nnx.State`` gives NNX paths such as
    ``("model", "layers", 0, "mlp", "up_proj", "weight")``.
    """
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = tuple(_key_part(k) for k in path)
        if parts and parts[-1] == "value" and type(path[-1]).__name__ == "GetAttrKey":
            parts = parts[:-1]
        out[parts] = leaf
    return out


def top_level_group(name: str) -> str:
    """Default group of a parameter: the first dotted component of its name (``"w1.kernel"`` -> ``"w1"``)."""
    return name.split(".", 1)[0]


@dataclasses.dataclass(frozen=True)
class ParamOrder:
    """How a params (or gradient) pytree is flattened into the sketch's parameter order.

    Attributes:
        names: parameter names in order (HF names for a decoder); they define the :class:`ParamLayout`.
        paths: the pytree key path of each name (see :func:`flat_params`).
        group_fn: name -> group name, for the per-group gradient norms.
        scan_layers: the parameters are a decoder's (``model.layers.{i}.*`` blocks, HF order) whose
            model scans over its layers (``DecoderConfig.scan_layers``): :class:`PerExampleSketcher`
            and :func:`sketch_vector` then sketch the layer leaves in a ``lax.scan`` over the
            layers (:func:`countsketch.sketch_batch_stacked`). Same sketches; set by
            :func:`hf_param_order` from the model config.
    """

    names: tuple[str, ...]
    paths: tuple[KeyPath, ...]
    group_fn: Callable[[str], str] = top_level_group
    scan_layers: bool = False

    def arrays(self, tree: PyTree) -> list[jax.Array]:
        """The arrays of ``tree`` in this order; raises KeyError naming a missing path and
        ValueError when ``tree`` has leaves this order does not know (nothing is dropped silently)."""
        flat = flat_params(tree)
        missing = [p for p in self.paths if p not in flat]
        if missing:
            raise KeyError(f"parameter path {missing[0]} ({len(missing)} in all) not found in the pytree")
        if len(flat) != len(self.paths):
            extra = sorted(map(str, set(flat) - set(self.paths)))
            raise ValueError(f"pytree has {len(extra)} leaves outside the parameter order, e.g. {extra[:3]}")
        return [flat[p] for p in self.paths]

    def layout(self, tree: PyTree) -> ParamLayout:
        """The :class:`ParamLayout` of ``tree`` (arrays or ``jax.ShapeDtypeStruct`` leaves)."""
        return ParamLayout(self.names, tuple(tuple(a.shape) for a in self.arrays(tree)))

    def groups(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(group names in first-appearance order, the group index of each parameter)."""
        names: dict[str, int] = {}
        idx = tuple(names.setdefault(self.group_fn(n), len(names)) for n in self.names)
        return tuple(names), idx


def tree_param_order(params: PyTree, group_fn: Callable[[str], str] = top_level_group) -> ParamOrder:
    """The generic order: ``jax.tree_util`` flatten order, names = dotted key paths."""
    paths = tuple(flat_params(params))
    return ParamOrder(tuple(".".join(map(str, p)) for p in paths), paths, group_fn)


def hf_param_order(config: Any, group_fn: Callable[[str], str] | None = None) -> ParamOrder:
    """HF ``model.parameters()`` order and names of a model of any family, from ``hf_io.hf_param_table``.

    ``config`` is a model config (``models.families``: Qwen2, Llama, Qwen3, ...); the order applies
    to the ``nnx.State`` from ``nnx.split(model, nnx.Param)`` and to its gradients. ``group_fn``
    defaults to the family's ``param_group``.
    """
    from behaviortrace_jax.models import families, hf_io

    table = hf_io.hf_param_table(config)
    group_fn = group_fn or families.family_of(config).param_group
    return ParamOrder(tuple(e[0] for e in table), tuple(tuple(e[1]) for e in table), group_fn,
                      scan_layers=bool(getattr(config, "scan_layers", False)))


def completion_loss(graphdef: Any) -> DecoderLoss:
    """The rollout-level loss of SPEC §3.2 for :class:`PerExampleSketcher`.

    Returns a ``fused.DecoderLoss``: ``loss(params, example)`` (batched: ``loss.per_example(params,
    batch, taps)`` -> [B], so the sketcher takes its fused path) with ``example = {"input_ids": int32[T],
    "attention_mask": int32[T] (1 = real token, left padding allowed), "loss_mask": float32[T]}``
    where ``loss_mask[t] = 1`` marks completion tokens t (predicted from position t - 1) that are not
    EOS; the loss is ``-sum(mask * logp) / sum(mask)`` (masked mean log-prob, no advantage, no 1/B).
    A rollout with no masked token gets loss 0 and a zero gradient (torch would give NaN).
    Host ``input_ids`` outside ``[0, vocab_size)`` raise a ValueError naming the id (traced ones pass).
    """
    from behaviortrace_jax.models import decoder

    def per_example(params: PyTree, batch: dict, taps: Any = None) -> jax.Array:
        fused_lib.check_batch_ids(batch, fused_lib.vocab_rows(params), "completion_loss: batch input_ids")
        return -decoder.masked_mean_logprob(graphdef, params, batch["input_ids"], batch["attention_mask"],
                                            batch["loss_mask"], taps=taps)

    return DecoderLoss(per_example)


class _LayerScan:
    """The layer-scan view of a decoder :class:`ParamOrder` (``scan_layers``): which parameters are
    the stacked layer leaves, and how to pull (pre, stacked blocks, post) arrays out of a gradient.

    Raises ValueError when the order's names/paths are not HF decoder layers (``model.layers.{i}.*``
    contiguous, same leaves in every layer, paths ``("model", "layers", i, *leaf)``).
    """

    def __init__(self, order: ParamOrder, layout: ParamLayout):
        from behaviortrace_jax.models import decoder

        self.slayout = StackedLayout.from_prefix(layout, ".".join(decoder.LAYERS_PATH) + ".")
        self.order = order
        n = len(decoder.LAYERS_PATH)
        self.leaf_paths = tuple(order.paths[k][n + 1:] for k in self.slayout.blocks[0])
        for i, blk in enumerate(self.slayout.blocks):
            for k, leaf in zip(blk, self.leaf_paths):
                if tuple(order.paths[k]) != decoder.LAYERS_PATH + (i,) + leaf:
                    raise ValueError(f"scan_layers: parameter {order.names[k]!r} has path {order.paths[k]}, "
                                     f"expected {decoder.LAYERS_PATH + (i,) + leaf}")

    def stacked_arrays(self, grads: Any) -> tuple[list, list, list]:
        """(pre, blocks, post) of a gradient with respect to ``decoder.StackedParams`` (any leading
        batch axes kept: blocks are [..., L, *shape])."""
        rest, layers = flat_params(grads.rest), flat_params(grads.layers)
        sl, paths = self.slayout, self.order.paths
        return ([rest[paths[k]] for k in sl.pre], [layers[p] for p in self.leaf_paths],
                [rest[paths[k]] for k in sl.post])

    def tree_arrays(self, grads: PyTree) -> tuple[list, list, list]:
        """(pre, blocks stacked [L, *shape], post) of an unstacked gradient pytree (one example)."""
        arrs = self.order.arrays(grads)
        sl = self.slayout
        blocks = [jnp.stack([arrs[b[j]] for b in sl.blocks]) for j in range(len(sl.leaf_names))]
        return [arrs[k] for k in sl.pre], blocks, [arrs[k] for k in sl.post]

    def square_norms(self, pre: list, blocks: list, post: list) -> jax.Array:
        """float32 [C, K]: squared L2 norm of each parameter's gradient, columns in layout order."""
        sl = self.slayout
        cols: list[Any] = [None] * len(sl.layout)
        sq = lambda a, keep: jnp.sum(jnp.square(a.astype(jnp.float32)).reshape(a.shape[:keep] + (-1,)), axis=keep)  # noqa: E731
        for k, a in zip(sl.pre + sl.post, pre + post):
            cols[k] = sq(a, 1)
        for j, a in enumerate(blocks):
            per_layer = sq(a, 2)  # [C, L]
            for i, blk in enumerate(sl.blocks):
                cols[blk[j]] = per_layer[:, i]
        return jnp.stack(cols, axis=1)


class PerExampleSketches(NamedTuple):
    """Output of :class:`PerExampleSketcher`: sketches float32[B, D], norms float32[B],
    group_norms float32[B, G] (columns = ``PerExampleSketcher.group_names``)."""

    sketches: jax.Array
    norms: jax.Array
    group_norms: jax.Array


def _batch_size(batch: PyTree) -> int:
    sizes = {x.shape[0] if getattr(x, "ndim", 0) else None for x in jax.tree.leaves(batch)}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"batch leaves must share one leading (example) axis; got sizes {sizes}")
    return sizes.pop()


class PerExampleSketcher:
    """Per-example CountSketches and exact gradient norms of ``loss`` over a batch (SPEC §3.2).

    Two paths, the same outputs (to float rounding):

    * **fused** (a ``fused.DecoderLoss`` such as :func:`completion_loss`, for a decoder of any
      registered family in HF order): ONE backward pass of the batched loss per chunk, in which
      each parameter use forms its per-example gradients from its saved input and incoming
      cotangent, hashes them into the sketches and drops them (``sketch/fused.py``); no example's
      whole gradient ever exists, and the same backward gives the (weighted) gradient sum of
      :meth:`sketch_and_sum`. This is ``vmap(grad)`` fused with the CountSketch one layer at a
      time inside a single batched backward instead of one backward per example.
    * **vmap(grad)** (any other ``loss(params, example)``): ``vmap(grad(loss))`` per chunk, each
      example's whole gradient sketched straight away.

    Args:
        loss_fn: pure ``loss(params, example) -> float scalar``; ``example`` is one element of the
            batch pytree (leading axis removed). A ``fused.DecoderLoss`` also gives its batched form.
        params: the parameters, or a pytree of ``jax.ShapeDtypeStruct`` with their shapes.
        dim: sketch width D (power of two; SPEC: 65536). seed: hash seed (SPEC: 0).
        chunk_size: examples per chunk (one fused backward, or one ``vmap(grad)``); peak memory
            ~ chunk_size x params for ``vmap(grad)``, ~ one batched backward of a chunk when fused.
        param_order: a :class:`ParamOrder`; default :func:`tree_param_order` (flatten order).
        use_tables: precompute device hash tables (4 bytes/parameter, held by the sketcher)
            instead of hashing inside the jitted function (see docs/records/benchmarks.md). With a mesh
            they are placed replicated on it (created on the first call). The fused path hashes on
            the fly (once per chunk for all its examples) and ignores this.
        mesh: optional ``jax.sharding.Mesh`` with a ``"data"`` axis: run per device under
            ``jax.shard_map`` (used when that axis has > 1 device and divides the batch; else the
            plain jitted loop). A ``"model"`` axis > 1 stays automatic (partially manual shard_map).
        scan_layers: None = ``param_order.scan_layers``. When on (a decoder order, ``model.scan_layers``),
            the parameters are stacked once per call (``decoder.stack_layers``, before any
            shard_map), ``loss_fn`` receives a ``decoder.StackedParams`` (it must hand the
            parameters to ``decoder.forward`` / ``forward_with_cache`` untouched), the per-example
            gradient comes out stacked [L, ...] and its layer leaves are sketched in a ``lax.scan``
            over the layers, hashing on the fly with traced per-layer offsets
            (``countsketch.sketch_batch_stacked``; fused: the scan's own backward, offsets looked up
            by the traced layer index): same sketches, one compiled layer, no tables.
        fused: None (default) = the fused path when ``loss_fn`` is a ``fused.DecoderLoss``; True
            requires it; False forces ``vmap(grad)``.
        tile_elements: fused path: per-example gradient values held at once per parameter use
            (the batch's rows of a large weight are formed in tiles of this many values).
        hash_family: the hash family (a ``hash_families.HashFamily``, config ``sketch.hash``):
            default splitmix64 (SPEC §3.1); a scatter-free one (``hash_families.BLOCK``) takes no
            hash tables.
        kernel: fused path: how matmul weight uses are sketched, "xla", or the Pallas kernel
            "pallas" (TPU) / "interpret" (``sketch/pallas_sketch.py``; block family only; config
            ``sketch.kernel``, resolved by ``stores.SketchOptions``).
    Raises:
        ValueError: bad dim/chunk_size; ``use_tables`` with a scatter-free ``hash_family``; a kernel
            other than "xla" without the block family;
            ``scan_layers`` with ``use_tables`` (``vmap(grad)`` path) or
            with an order that is not a decoder's; ``fused=True`` for a loss that is not a
            ``fused.DecoderLoss``; at call time, batch leaves without a common leading axis.

    ``__call__(params, batch)`` returns :class:`PerExampleSketches`; ``lower(params, batch)`` gives the
    ``jax.stages.Lowered`` of the jitted function (for cost / memory analysis).
    """

    def __init__(self, loss_fn: Callable[[PyTree, PyTree], jax.Array], params: PyTree, *,
                 dim: int = 65536, seed: int = 0, chunk_size: int = 4,
                 param_order: ParamOrder | None = None, use_tables: bool = False,
                 mesh: jax.sharding.Mesh | None = None, scan_layers: bool | None = None,
                 fused: bool | None = None, tile_elements: int = fused_lib.TILE_ELEMENTS,
                 hash_family: HashFamily = DEFAULT_HASH_FAMILY, kernel: str = "xla"):
        if int(chunk_size) != chunk_size or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        self.loss_fn, self.dim, self.seed, self.chunk_size = loss_fn, check_dim(dim), int(seed), int(chunk_size)
        self.hash_family = check_tables(hash_family, bool(use_tables))
        self.order = param_order if param_order is not None else tree_param_order(params)
        self.layout = self.order.layout(params)
        self.group_names, self._group_idx = self.order.groups()
        is_decoder_loss = isinstance(loss_fn, DecoderLoss)
        if fused and not is_decoder_loss:
            raise ValueError("PerExampleSketcher(fused=True) needs a fused.DecoderLoss (e.g. completion_loss), "
                             f"got {type(loss_fn).__name__}")
        self._plan = None
        if is_decoder_loss and fused is not False:
            self._plan = fused_lib.FusedPlan(self.order.paths, self.layout.offsets, self._group_idx,
                                             len(self.group_names), dim=self.dim, seed=self.seed,
                                             tile_elements=tile_elements, hash_family=self.hash_family,
                                             kernel=kernel)
        self.use_tables = bool(use_tables) and self._plan is None
        self.mesh = mesh if mesh is not None and dict(mesh.shape).get(DATA_AXIS, 1) > 1 else None
        if self._plan is not None and self._plan.kernel != "xla" and mesh is not None and any(
                n > 1 for ax, n in dict(mesh.shape).items() if ax != DATA_AXIS):
            # a Mosaic kernel is never partitioned automatically: with weights split over another mesh
            # axis (tensor parallel) the matmul uses take the XLA path (same family, same sketches)
            logging.warning("sketch.kernel=%r: the mesh %s splits the weights over a non-data axis; the Pallas "
                            "kernel runs only where every non-data axis has size 1: matmul uses take the XLA path",
                            self._plan.kernel, dict(mesh.shape))
            self._plan.kernel = "xla"
        scan = self.order.scan_layers if scan_layers is None else bool(scan_layers)
        if scan and self.use_tables:
            raise ValueError("PerExampleSketcher: scan_layers hashes inside the layer scan and takes no hash "
                             "tables; turn off use_tables (sketch.in_run_tables / targets.use_tables)")
        self._scan = _LayerScan(self.order, self.layout) if scan else None
        self._tables = None
        # the model's vocabulary (its embedding rows), for the host check of a batch's input_ids
        self.vocab_size = dict(zip(self.order.names, self.layout.shapes)).get("model.embed_tokens.weight", (None,))[0]
        self._jitted = programs.jit("per_example_sketcher", self._run, mesh=self.mesh)

    @property
    def fused(self) -> bool:
        """Whether this sketcher takes the fused one-backward path (see the class docstring)."""
        return self._plan is not None

    @property
    def tables(self) -> list[jax.Array] | None:
        """The device hash tables (``use_tables``), made on first use; replicated on ``mesh``."""
        if self.use_tables and self._tables is None:
            t = layout_tables(self.layout, self.dim, self.seed, self.hash_family)
            if self.mesh is not None:
                t = sharding.put(t, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
            self._tables = t
        return self._tables

    def abstract_tables(self) -> list[jax.ShapeDtypeStruct] | None:
        """``jax.ShapeDtypeStruct`` leaves of :attr:`tables` (replicated on ``mesh``), for AOT lowering."""
        if not self.use_tables:
            return None
        sh = None if self.mesh is None else jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return [jax.ShapeDtypeStruct(tuple(s), jnp.int32, sharding=sh) for s in self.layout.shapes]

    def __call__(self, params: PyTree, batch: PyTree) -> PerExampleSketches:
        """The sketches of ``batch`` (jitted). Host ``input_ids`` (numpy) of a decoder's batch are
        checked first: ValueError naming an id outside ``[0, vocab_size)`` (``tokenizer.check_token_ids``)."""
        fused_lib.check_batch_ids(batch, self.vocab_size, "PerExampleSketcher: batch input_ids")
        return self._jitted(params, batch, self.tables)

    def lower(self, params: PyTree, batch: PyTree, tables: Any = None) -> jax.stages.Lowered:
        """``jax.stages.Lowered`` of the jitted function; ``tables`` default: :meth:`abstract_tables`."""
        return self._jitted.lower(params, batch, tables if tables is not None else self.abstract_tables())

    def sketch(self, params: PyTree, batch: PyTree, tables: Any = None) -> PerExampleSketches:
        """The traceable body (no ``jax.jit`` of its own): for use inside another jitted function,
        e.g. the GRPO step, with ``tables`` passed in as that function's argument."""
        return self._run(params, batch, tables)

    def sketch_and_sum(self, params: PyTree, batch: PyTree, tables: Any = None, acc_dtype: Any = jnp.float32,
                       coefficients: jax.Array | None = None) -> tuple[PerExampleSketches, PyTree, jax.Array]:
        """Traceable, like :meth:`sketch`, and also returns the weighted SUM of the per-example
        gradients ``sum_i c_i grad loss_i`` (``coefficients`` c float [B]; None = all ones: the
        batch gradient of ``sum_i loss_i``) in ``acc_dtype`` (default float32; the structure of
        ``params``; padding excluded; summed over devices under a mesh) and the per-example losses
        float32[B]. The sketches and norms stay those of ``grad loss_i`` whatever c is. Fused path:
        the weight cotangents of the same backward that makes the sketches; ``vmap(grad)`` path:
        the per-example gradients added up. Either sums in another order than one batched
        backward's reduction, so it equals that gradient up to float rounding, not bit for bit.
        ``acc_dtype`` is the dtype of the sum across chunks (each chunk's contribution is formed in
        float32, then cast): bfloat16 halves its memory (at 1.54B, 2.9 instead of 5.75 GiB) at bf16
        rounding per added chunk (``vmap(grad)``: per example)."""
        return self._run(params, batch, tables, with_sum=True, acc_dtype=acc_dtype, coefficients=coefficients)

    @property
    def scan_layers(self) -> bool:
        """Whether the layer leaves are sketched in a scan over the layers (see the class docstring)."""
        return self._scan is not None

    def _chunk(self, params: PyTree, tables: Any, ex: PyTree) -> tuple[jax.Array, jax.Array]:
        grads = jax.vmap(jax.grad(self.loss_fn), in_axes=(None, 0))(params, ex)
        return self._sketch_norms(grads, tables)

    def _sketch_norms(self, grads: PyTree, tables: Any) -> tuple[jax.Array, jax.Array]:
        if self._scan is not None:
            pre, blocks, post = self._scan.stacked_arrays(grads)
            sk = sketch_batch_stacked(pre, blocks, post, self._scan.slayout, self.dim, self.seed,
                                      self.hash_family)
            return sk, self._scan.square_norms(pre, blocks, post)
        arrs = self.order.arrays(grads)
        sk = sketch_batch(arrs, self.layout, self.dim, self.seed, tables, self.hash_family)
        sq = jnp.stack([jnp.sum(jnp.square(a.astype(jnp.float32)).reshape(a.shape[0], -1), axis=1)
                        for a in arrs], axis=1)
        return sk, sq

    def _run(self, params: PyTree, batch: PyTree, tables: Any, with_sum: bool = False,
             acc_dtype: Any = jnp.float32, coefficients: jax.Array | None = None) -> Any:
        if self.use_tables and tables is None:
            raise ValueError("PerExampleSketcher(use_tables=True): pass the hash tables")
        b = _batch_size(batch)
        if coefficients is not None and tuple(jnp.shape(coefficients)) != (b,):
            raise ValueError(f"sketch_and_sum: coefficients of shape {jnp.shape(coefficients)}, expected ({b},)")
        mesh = self.mesh
        if self._scan is not None:  # stacked once per call, before any shard_map (a 1/n copy under FSDP)
            from behaviortrace_jax.models import decoder

            params = decoder.stack_layers(params)
        if mesh is not None and b % mesh.shape[DATA_AXIS] == 0:
            rep, data = jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec(DATA_AXIS)
            # the Pallas kernel needs every axis manual (the others have size 1 then: __init__)
            axes = set(mesh.axis_names) if self._plan is not None and self._plan.kernel != "xla" else {DATA_AXIS}
            local = jax.shard_map(lambda p, x, t, c: self._local(p, x, t, with_sum, DATA_AXIS, acc_dtype, c),
                                  mesh=mesh, in_specs=(rep, data, rep, data),
                                  out_specs=(data, rep, data) if with_sum else data,
                                  axis_names=axes, check_vma=False)
            return local(params, batch, tables, coefficients)
        return self._local(params, batch, tables, with_sum, None, acc_dtype, coefficients)

    def _local(self, params: PyTree, batch: PyTree, tables: Any, with_sum: bool = False,
               axis: str | None = None, acc_dtype: Any = jnp.float32, coefficients: jax.Array | None = None) -> Any:
        b = _batch_size(batch)
        c = min(self.chunk_size, b)
        n = -(-b // c)
        if n * c != b:  # pad by repeating the last example (its outputs are dropped below)
            take = jnp.minimum(jnp.arange(n * c), b - 1)
            batch = jax.tree.map(lambda x: x[take], batch)
        chunks = jax.tree.map(lambda x: x.reshape((n, c) + x.shape[1:]), batch)
        valid = (jnp.arange(n * c) < b).astype(jnp.float32)
        if coefficients is not None:
            valid = valid * jnp.pad(jnp.asarray(coefficients, jnp.float32), (0, n * c - b))
        weights = valid.reshape(n, c)
        if self._plan is not None:
            sk, norms, groups, gsum, vals = self._fused_chunks(params, chunks, weights, with_sum, acc_dtype, n)
        else:
            sk, norms, groups, gsum, vals = self._vmap_chunks(params, chunks, weights, tables, with_sum, acc_dtype)
        out = PerExampleSketches(sk.reshape(n * c, self.dim)[:b], norms.reshape(n * c)[:b],
                                 groups.reshape(n * c, -1)[:b])
        if not with_sum:
            return out
        if axis is not None:
            gsum = jax.lax.psum(gsum, axis)
        if self._scan is not None:  # back to the parameters' own structure
            from behaviortrace_jax.models import decoder

            gsum = decoder.unstack_layers(gsum)
        return out, gsum, vals.reshape(n * c)[:b].astype(jnp.float32)

    def _vmap_chunks(self, params: PyTree, chunks: PyTree, weights: jax.Array, tables: Any, with_sum: bool,
                     acc_dtype: Any) -> tuple:
        """``vmap(grad)`` per chunk: (sketches, norms, group norms, the weighted sum or None, losses or None)."""
        gsum = vals = None
        if not with_sum:
            sk, sq = jax.lax.map(lambda ex: self._chunk(params, tables, ex), chunks)
        else:
            def body(acc, xs):
                ex, v = xs
                vals, grads = jax.vmap(jax.value_and_grad(self.loss_fn), in_axes=(None, 0))(params, ex)
                sk, sq = self._sketch_norms(grads, tables)
                acc = jax.tree.map(lambda a, g: (a + jnp.tensordot(v, g.astype(jnp.float32), axes=1)).astype(a.dtype),
                                   acc, grads)
                return acc, (sk, sq, vals)

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, acc_dtype), params)
            gsum, (sk, sq, vals) = jax.lax.scan(body, zeros, (chunks, weights))
        sq = sq.reshape(-1, sq.shape[-1])
        groups = jnp.stack([sum(sq[:, k] for k, g in enumerate(self._group_idx) if g == j)
                            for j in range(len(self.group_names))], axis=1)
        return sk, jnp.sqrt(jnp.sum(sq, axis=1)), jnp.sqrt(groups), gsum, vals

    def _fused_chunks(self, params: PyTree, chunks: PyTree, weights: jax.Array, with_sum: bool, acc_dtype: Any,
                      n: int) -> tuple:
        """One fused backward per chunk (``fused.fused_grads``): (sketches, norms, group norms, the
        weighted sum or None, losses)."""
        run = lambda ex, w: fused_lib.fused_grads(self._plan, self.loss_fn, params, ex, w if with_sum else None)  # noqa: E731
        cast = lambda g: jax.tree.map(lambda x: x.astype(acc_dtype), g)  # noqa: E731
        if n == 1:  # the whole batch in one backward: no loop
            vals, grads, sk, sq = run(jax.tree.map(lambda x: x[0], chunks), weights[0])
            gsum, sk, sq, vals = (cast(grads) if with_sum else None), sk[None], sq[None], vals[None]
        elif not with_sum:
            vals, _, sk, sq = jax.lax.map(lambda xs: run(*xs), (chunks, weights))
            gsum = None
        else:
            def body(acc, xs):
                vals, grads, sk, sq = run(*xs)
                return jax.tree.map(lambda a, g: (a + g.astype(jnp.float32)).astype(a.dtype), acc, grads), (sk, sq, vals)

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, acc_dtype), params)
            gsum, (sk, sq, vals) = jax.lax.scan(body, zeros, (chunks, weights))
        return sk, jnp.sqrt(jnp.sum(sq, axis=-1)), jnp.sqrt(sq), gsum, vals


def sketch_vector(grads: PyTree | Sequence[jax.Array], order: ParamOrder | ParamLayout, dim: int = 65536,
                  seed: int = 0, tables: Sequence[jax.Array] | None = None,
                  hash_family: HashFamily = DEFAULT_HASH_FAMILY) -> jax.Array:
    """CountSketch float32[D] of ONE gradient (e.g. the clipped GRPO step gradient, SPEC §3.2); jittable.

    ``grads`` is a gradient pytree flattened by ``order`` (a :class:`ParamOrder`), or a list of
    arrays already in the order of ``order`` (a :class:`ParamLayout`). With ``order.scan_layers``
    (and no tables) the layer gradients are stacked and sketched in a scan over the layers
    (``countsketch.sketch_batch_stacked``; the same sketch). ``hash_family``: the hash family
    (``countsketch.sketch_tree``). Raises ValueError on a shape/length mismatch (naming the
    parameter) or tables with a scatter-free family, and KeyError on a missing path.
    """
    if isinstance(order, ParamOrder) and order.scan_layers and tables is None:
        layer_scan = _LayerScan(order, order.layout(grads))
        pre, blocks, post = layer_scan.tree_arrays(grads)
        one = lambda xs: [x[None] for x in xs]  # noqa: E731 - a batch of one
        return sketch_batch_stacked(one(pre), one(blocks), one(post), layer_scan.slayout, dim, seed,
                                    hash_family)[0]
    if isinstance(order, ParamOrder):
        arrs = order.arrays(grads)
        layout = ParamLayout(order.names, tuple(tuple(a.shape) for a in arrs))
    elif isinstance(grads, (list, tuple)):
        arrs, layout = list(grads), order
    else:
        raise ValueError("sketch_vector: pass a ParamOrder to flatten a gradient pytree, "
                         "or a list of arrays in ParamLayout order")
    return sketch_tree(arrs, layout, dim, seed, tables, hash_family)
