"""Every step-level estimator's per-rollout scores of a finished run, read from its sketch stores.

One reader for the stages that score rollouts (``evaluate`` for its tables and release,
``counterfactual`` for its leave-top-k-out and LDS replays), so a newly registered estimator
(``attribution.estimators``) reaches both with no other change. It sits in the sketch layer, not in
``attribution/``, because it opens tensorstore sketch stores (``attribution`` imports only
``io.files`` / ``io.layout``; tests/test_layers.py).
"""
from __future__ import annotations

import pathlib

import ml_collections
import numpy as np

from behaviortrace_jax.attribution import estimators
from behaviortrace_jax.io import sketch_store
from behaviortrace_jax.io.files import read_json
from behaviortrace_jax.io.layout import RunLayout


def read_complete(path: pathlib.Path) -> sketch_store.SketchStore:
    """Opens an existing sketch store and checks that every row was written.

    Raises:
        FileNotFoundError / ValueError: naming the store when it is absent or incomplete.
    """
    if not (path / "metadata.json").exists():
        raise FileNotFoundError(f"{path}: sketch store not found; run the `grpo` and `sketch` stages first")
    store = sketch_store.SketchStore.open(path)
    missing = store.missing_rows()
    if missing.size:
        raise ValueError(f"{path}: {missing.size} rows were never written (first: {missing[:5].tolist()})")
    return store


def step_method_scores(config: ml_collections.ConfigDict, paths: RunLayout, rollout_ids: list[str],
                       rollout_steps: np.ndarray, *, per_rollout: bool = False,
                       step_sketches: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Every step-level estimator's per-rollout scores (log order), SPEC §4.

    With ``per_rollout`` the in-run rollout sketches replace the step sketches (the "which rollout"
    scores). Targets: the final checkpoint's continuation target (C1, TRAK, local-buffer) and one
    per checkpoint (TracInCP). ``step_sketches`` (float32 [steps, D]) saves re-reading
    ``step_sketches.zarr`` when the caller already holds it.
    """
    if per_rollout:
        sketches = read_complete(paths.sketch_store("rollout_sketches")).read()
    else:
        sketches = (step_sketches if step_sketches is not None
                    else read_complete(paths.sketch_store("step_sketches")).read())
    return target_store_scores(config, paths.sketch_store("targets_continuation"), sketches, rollout_ids,
                               rollout_steps, per_rollout=per_rollout,
                               metagradient=metagradient_scores(paths, rollout_ids))


def metagradient_scores(paths: RunLayout, rollout_ids: list[str]) -> np.ndarray | None:
    """The ``metagradient`` stage's ``dM/dw_i`` (float64 [N], log order) for the estimator of that
    name, or None when the stage has not run (the estimator is then skipped).

    Raises:
        ValueError: naming the file when its rollout ids are not ``rollout_ids``.
    """
    path = paths.metagradient_scores
    if not path.exists():
        return None
    rec = read_json(path)
    if rec["rollout_ids"] != list(rollout_ids):
        raise ValueError(f"{path}: {len(rec['rollout_ids'])} rollout ids that are not the run's "
                         f"{len(rollout_ids)}; rerun the `metagradient` stage")
    return np.asarray(rec["scores"], np.float64)


def target_store_scores(config: ml_collections.ConfigDict, target_path: pathlib.Path, sketches: np.ndarray,
                        rollout_ids: list[str], rollout_steps: np.ndarray, *,
                        per_rollout: bool = False, **inputs) -> dict[str, np.ndarray]:
    """:func:`step_method_scores` with the targets of ``target_path`` (another behaviour's
    ``targets_continuation_<id>.zarr``, issue 16) and sketches the caller has read: float32
    [steps, D] step sketches, or [N, D] in-run rollout sketches with ``per_rollout``. ``inputs``:
    more estimator inputs by name (``metagradient``; None = absent, its estimator is skipped).

    Raises:
        FileNotFoundError / ValueError: the target store is absent or incomplete (names it).
    """
    ev = config.evaluation
    t_store = read_complete(target_path)
    targets = t_store.read()
    by_ckpt = {int(s): targets[i] for i, s in enumerate(t_store.metadata["checkpoint_steps"])}
    steps = np.asarray(rollout_steps) if per_rollout else np.arange(sketches.shape[0])
    return estimators.score_step_methods(
        sketches, steps, rollout_ids, rollout_steps, target=targets[-1], per_rollout_sketches=per_rollout,
        targets_by_checkpoint=by_ckpt, lr=ev.tracin_lr, damping=ev.trak_damping, seed=int(config.seed),
        window=ev.local_buffer_window, current_step=int(config.grpo.steps), **inputs)
