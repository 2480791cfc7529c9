"""The run's sketch arrays: the metadata every sketch array carries and the in-run stores (SPEC §3.2).

The in-run stores of the ``grpo`` stage (rollout row = ``step * N + index``, log order):

* ``step_sketches`` [steps, D] (CountSketch of the clipped step gradient), ``step_grad_norms``
  [steps] (its pre-clip global norm) and ``step_clip_factors`` [steps] (``grad_clip / max(norm,
  grad_clip)``, the scale the clip applied);
* ``rollout_coefficients`` [steps*N]: c_i of a loss whose term is ``c_i * (-meanlp_i)``
  (``grpo_loss.Loss.rollout_coefficients``; the paper loss: A_i / (G*B)); absent for other losses;
* with ``sketch.in_run_rollouts``, ``rollout_sketches`` [steps*N, D] and ``rollout_grad_norms``
  [steps*N]: metadata ``rollout_sketch`` says what they sketch (``io.sketch_store``): :data:`ROLLOUT_DIRECTION` (the
  gradient of the advantage-free rollout loss -meanlp_i at the step's weights, when the loss
  declares coefficients) or :data:`~behaviortrace_jax.io.sketch_store.ROLLOUT_TERM` (the gradient of the rollout's term of the loss,
  pre-clip). Either way ``step_clip_factors[s] * c_i * rollout_sketches[i]`` (c_i = 1 for a term
  sketch) is rollout i's contribution to step s's update; they sum over the step to
  ``step_sketches[s]`` (CountSketch is linear; float rounding aside).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Sequence


from behaviortrace_jax.io import sketch_store
from behaviortrace_jax.io.files import read_json
from behaviortrace_jax.io.layout import RunLayout, as_path
# the kinds of rollout sketch, defined with the store format so the attribution layer reads them too
from behaviortrace_jax.io.sketch_store import ROLLOUT_DIRECTION, ROLLOUT_SKETCH_KINDS
from behaviortrace_jax.models import decoder, hf_io
from behaviortrace_jax.sketch import hash_families


@dataclasses.dataclass(frozen=True)
class SketchOptions:
    """The CountSketch every sketch array of a run is made with (SPEC §3.1), and the run it
    belongs to: what :func:`sketch_metadata` records, so arrays made otherwise never mix. Built at
    the stage boundary (``stages/spec.py``, ``RunSpec.sketch``).

    Fields:
        dim (int): the sketch width D (``sketch.dim``; SPEC §3.1: 65,536).
        seed (int): the CountSketch hash seed (``sketch.seed``; SPEC §3.1: 0).
        run_seed (int): the run's seed (``config.seed``).
        hash_family (HashFamily): the hash family (``sketch.hash``, resolved by
            ``hash_families.choose_sketch``: "auto" per backend); the metadata records its
            versioned name (``HashFamily.store_metadata``).
        kernel (str): how the fused sketcher sketches matmul weight uses (``sketch.kernel``, resolved
            with the family): "xla", or the Pallas kernel "pallas" / "interpret"
            (``sketch/pallas_sketch.py``); the metadata records it as ``sketch_kernel`` unless "xla".
    """

    dim: int
    seed: int
    run_seed: int
    hash_family: hash_families.HashFamily = hash_families.DEFAULT_HASH_FAMILY
    kernel: str = "xla"


def sketch_metadata(options: SketchOptions, model_cfg: decoder.DecoderConfig, kind: str) -> dict:
    """Metadata every sketch array carries (sketch_store raises when a reopened store differs):
    ``kind``, the hash family's (``HashFamily.store_metadata``), ``options``' seed / dim / run seed,
    the model's parameter-order and model fingerprints, and the dtype; ``sketch_kernel`` where the
    Pallas kernel made them (absent for the XLA path, as in stores written before the key existed)."""
    kernel = {} if options.kernel == "xla" else {"sketch_kernel": options.kernel}
    return {"kind": kind, **options.hash_family.store_metadata(), **kernel, "seed": options.seed,
            "dim": options.dim, "param_fingerprint": hf_io.param_order_fingerprint(model_cfg),
            "model_fingerprint": hf_io.model_fingerprint(model_cfg), "dtype": "float32",
            "run_seed": options.run_seed}


def open_store(options: SketchOptions, path: str | os.PathLike, shape: Sequence[int], chunk_rows: int,
               metadata: dict) -> sketch_store.SketchStore:
    """``sketch_store.SketchStore.open_or_create(path, shape, chunk_rows, metadata)`` of a sketch
    array made with ``options``. A store that exists with another hash family is refused first,
    naming both families (``HashFamily.check_store_metadata``); the store then checks every other
    metadata key itself.

    Raises:
        ValueError: a store of another hash family; any other metadata key, shape or chunking that
            differs (``sketch_store``).
    """
    meta_path = as_path(path) / "metadata.json"
    if meta_path.exists():
        options.hash_family.check_store_metadata(read_json(meta_path), str(meta_path))
    return sketch_store.SketchStore.open_or_create(path, shape, chunk_rows, metadata)


def read_store(options: SketchOptions, path: str | os.PathLike) -> sketch_store.SketchStore:
    """``sketch_store.SketchStore.open(path)`` of a store read as sketches made with ``options``.

    Raises:
        FileNotFoundError: no completed store at ``path``. ValueError: the store was written with
            another hash family, naming both (``HashFamily.check_store_metadata``).
    """
    store = sketch_store.SketchStore.open(path)
    options.hash_family.check_store_metadata(store.metadata, f"{store.path}/metadata.json")
    return store


def open_sketch_stores(options: SketchOptions, model_cfg: decoder.DecoderConfig, paths: RunLayout, *, steps: int,
                       rollouts_per_step: int, in_run_rollouts: bool,
                       rollout_sketch: str = ROLLOUT_DIRECTION) -> dict[str, sketch_store.SketchStore]:
    """The in-run sketch arrays of the module docstring, of ``options.dim`` columns.

    Args:
        options: the run's CountSketch (:class:`SketchOptions`).
        model_cfg: the model sketched (its fingerprints go into the metadata).
        paths: the run's layout (``sketches/<name>.zarr``).
        steps: the run's GRPO steps; rollouts_per_step: N = B x G rollouts per step.
        in_run_rollouts: also open the per-rollout sketches and grad norms (``sketch.in_run_rollouts``).
        rollout_sketch: what the step's rollout sketches are (``GRPOStepSpec.rollout_sketch``):
            :data:`ROLLOUT_DIRECTION` also opens ``rollout_coefficients``.
    Raises:
        ValueError: an unknown ``rollout_sketch``; a reopened store of another kind (sketch_store).
    """
    if rollout_sketch not in ROLLOUT_SKETCH_KINDS:
        raise ValueError(f"rollout_sketch={rollout_sketch!r}; expected one of {ROLLOUT_SKETCH_KINDS}")
    steps, n, d = int(steps), int(rollouts_per_step), options.dim
    specs = {"step_sketches": (steps, d), "step_grad_norms": (steps,), "step_clip_factors": (steps,)}
    if in_run_rollouts:  # opened first: a run resumed with another kind fails before creating any
        specs.update(rollout_sketches=(steps * n, d), rollout_grad_norms=(steps * n,))
    if rollout_sketch == ROLLOUT_DIRECTION:
        specs["rollout_coefficients"] = (steps * n,)
    extra = {"rollout_sketches": {"rollout_sketch": rollout_sketch}}
    return {name: open_store(
                options, paths.sketch_store(name), shape, chunk_rows=n if shape[0] == steps * n else 1,
                metadata=dict(sketch_metadata(options, model_cfg, name), **extra.get(name, {})))
            for name, shape in specs.items()}
