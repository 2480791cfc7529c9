"""Every step-level estimator's per-rollout scores of a finished run, read from its sketch stores.

One reader for the stages that score rollouts (``evaluate`` for its tables and release,
``counterfactual`` for its leave-top-k-out and LDS replays), so a newly registered estimator
(``estimators``) reaches both with no other change. It opens the stores with the jax-free
``io.sketch_store`` and the log with ``io.rollout_log``.

Every call also hands the estimators the training log's ``advantages``, ``rewards`` and
``completion_lengths`` and the stage's ``pattern_matches`` (log order), so the reward-only, text and
length controls score next to the gradient methods. With the in-run rollout
sketches (``per_rollout``) each sketch-reading estimator is scored twice (``sketch/stores.py``):
on the *weighted* sketches ``clip_s * c_i * g_i`` (the rollout's contribution to its update;
the registered names) and on the advantage-free *direction* sketches ``g_i`` (names +
``estimators.DIRECTION``; only when the loss declares rollout coefficients).
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import numpy as np

from behaviortrace_jax.attribution import estimators
from behaviortrace_jax.attribution.verdicts import EvalOptions
from behaviortrace_jax.io import cache, rollout_log, sketch_store
from behaviortrace_jax.io.files import read_json
from behaviortrace_jax.io.layout import RunLayout


# What makes two sketch arrays comparable (sketch/stores.py ``sketch_metadata``): the same hash, the
# same D, the same parameter order (a dot product of sketches of two hashes is noise).
SKETCH_IDENTITY = ("hash_family", "seed", "dim", "param_fingerprint")


@dataclasses.dataclass(frozen=True)
class ScoreOptions:
    """What scoring a run reads from its config, built at the stage boundary (``stages/spec.py``,
    ``RunSpec.scores``): ``evaluation`` (the estimators' settings, :class:`verdicts.EvalOptions`),
    the run's CountSketch ``sketch_dim`` / ``sketch_seed`` (``sketch.dim`` / ``sketch.seed``) and
    ``run_seed`` (``seed``), ``rollouts_per_step`` (N = ``grpo.prompts_per_step`` x
    ``grpo.group_size``), ``steps`` (``grpo.steps``), ``recompute_advantages``
    (``counterfactual.recompute_advantages``: the metagradient scores' advantages mode) and
    ``hash_family`` (``sketch.hash`` resolved, ``hash_families.HashFamily``; None = not checked)."""

    evaluation: EvalOptions
    sketch_dim: int
    sketch_seed: int
    run_seed: int
    rollouts_per_step: int
    steps: int
    recompute_advantages: bool = False
    hash_family: Any = None


def read_complete(path: pathlib.Path, options: ScoreOptions | None = None) -> sketch_store.SketchStore:
    """Opens an existing sketch store and checks that every row was written and, with ``options``,
    that a sketch store's metadata is the config's CountSketch (``hash_family`` = ``sketch.hash``'s,
    ``dim`` = ``sketch.dim``, ``seed`` = ``sketch.seed``, ``run_seed`` = ``seed``, where the store
    records them).

    Raises:
        FileNotFoundError / ValueError: naming the store when it is absent or incomplete, or the
            metadata key that differs from the config (and both values).
    """
    if not (path / "metadata.json").exists():
        raise FileNotFoundError(f"{path}: sketch store not found; run the `grpo` and `sketch` stages first")
    store = sketch_store.SketchStore.open(path)
    if options is not None:
        if options.hash_family is not None and "hash_family" in store.metadata:
            options.hash_family.check_store_metadata(store.metadata, f"{path}/metadata.json")
        want = {"dim": int(options.sketch_dim), "seed": int(options.sketch_seed), "run_seed": int(options.run_seed)}
        for key, value in want.items():
            if key in store.metadata and store.metadata[key] != value:
                raise ValueError(f"{path}/metadata.json: metadata key {key!r} is {store.metadata[key]!r}, but the "
                                 f"config's is {value!r} (config.{'seed' if key == 'run_seed' else 'sketch.' + key})")
    missing = store.missing_rows()
    if missing.size:
        raise ValueError(f"{path}: {missing.size} rows were never written (first: {missing[:5].tolist()})")
    return store


def check_same_sketch(a: sketch_store.SketchStore, b: sketch_store.SketchStore) -> None:
    """Checks that two sketch stores scored against each other (sketches and a target) were made
    with one CountSketch: equal :data:`SKETCH_IDENTITY` keys where both record them.

    Raises:
        ValueError: naming both stores' metadata files, the key and both values.
    """
    for key in SKETCH_IDENTITY:
        if key in a.metadata and key in b.metadata and a.metadata[key] != b.metadata[key]:
            raise ValueError(f"{a.path}/metadata.json and {b.path}/metadata.json: metadata key {key!r} differs "
                             f"({a.metadata[key]!r} vs {b.metadata[key]!r}); sketches of two CountSketches cannot "
                             "be compared, rerun the stage that wrote the wrong one")


@dataclasses.dataclass(frozen=True)
class RolloutSketches:
    """The in-run rollout sketches of a run, both ways (``sketch/stores.py``), rows in log order.

    weighted: float32 [N, D] ``clip_s * c_i * g_i``, rollout i's contribution to its step's
        update (TracIn's training-side gradient); sums over a step to the step sketch.
    direction: float32 [N, D] ``g_i``, the sketch of the advantage-free -meanlp_i; None when the
        loss has no rollout coefficients (``kind == "term"``).
    kind: the store's ``rollout_sketch`` metadata.
    """

    weighted: np.ndarray
    direction: np.ndarray | None
    kind: str
    store: sketch_store.SketchStore | None = None  # the rollout_sketches store (its metadata)


def read_rollout_sketches(options: ScoreOptions, paths: RunLayout) -> RolloutSketches:
    """Reads the in-run rollout sketches with their coefficients and step clip factors.

    Raises:
        FileNotFoundError / ValueError: a store is absent or incomplete, or the rollout store has no
            ``rollout_sketch`` metadata (written before rollout sketches were advantage-free; the
            grpo stage must be rerun).
    """
    store = read_complete(paths.sketch_store("rollout_sketches"), options)
    kind = store.metadata.get("rollout_sketch")
    if kind not in sketch_store.ROLLOUT_SKETCH_KINDS:
        raise ValueError(f"{store.path}: metadata 'rollout_sketch' is {kind!r}, expected one of "
                         f"{sketch_store.ROLLOUT_SKETCH_KINDS}; the store predates advantage-free rollout sketches, "
                         "rerun the `grpo` stage")
    sk = store.read()
    scale = rollout_scales(options, paths, sk.shape[0], coefficients=kind == sketch_store.ROLLOUT_DIRECTION)
    if scale is None:
        raise FileNotFoundError(f"{paths.sketch_store('rollout_coefficients')}: not found, but {store.path} holds "
                                "direction sketches; rerun the `grpo` stage")
    weighted = (sk * scale[:, None]).astype(np.float32)
    return RolloutSketches(weighted, sk if kind == sketch_store.ROLLOUT_DIRECTION else None, kind, store)


def rollout_scales(options: ScoreOptions, paths: RunLayout, n_rows: int, *,
                   coefficients: bool = True) -> np.ndarray | None:
    """float32 [n_rows]: ``clip_s * c_i`` of the first ``n_rows`` rollouts of the log (row i of
    step i // N), what turns the sketch of rollout i's advantage-free -meanlp_i into its
    contribution to the update. ``coefficients=False``: ``clip_s`` alone (for term sketches).
    None when the run logged no ``rollout_coefficients`` (its loss declares none).

    Raises:
        FileNotFoundError / ValueError: ``step_clip_factors`` absent or incomplete.
    """
    n = options.rollouts_per_step
    scale = read_complete(paths.sketch_store("step_clip_factors")).read()[np.arange(n_rows) // n]
    if coefficients:
        path = paths.sketch_store("rollout_coefficients")
        if not (path / "metadata.json").exists():
            return None
        scale = scale * read_complete(path).read()[:n_rows]
    return scale.astype(np.float32)


def training_log_inputs(records: list, rollout_ids: list[str]) -> dict[str, np.ndarray]:
    """``{"advantages", "rewards"}`` float64 [N] and ``"completion_lengths"`` int64 [N] (the logged
    completion's token count, EOS included) of the rollout log ``records``, in the order of
    ``rollout_ids``: the reward-only and length controls' inputs (``attribution.estimators``). The
    text control's ``pattern_matches`` needs the tokenizer and the behaviour's judge, so the stages
    compute it (``behavior.contaminator.pattern_matches``).

    Raises:
        ValueError: the records are not the rollouts ``rollout_ids`` in that order.
    """
    ids = [r.rollout_id for r in records]
    if ids != list(rollout_ids):
        raise ValueError(f"rollout log holds {len(ids)} records that are not the {len(rollout_ids)} scored rollouts "
                         "in log order")
    return {"advantages": np.array([float(r.advantage) for r in records]),
            "rewards": np.array([float(r.reward) for r in records]),
            "completion_lengths": np.array([len(r.completion_token_ids) for r in records], np.int64)}


def step_method_scores(options: ScoreOptions, paths: RunLayout, rollout_ids: list[str],
                       rollout_steps: np.ndarray, *, pattern_matches: np.ndarray, per_rollout: bool = False,
                       step_sketches: np.ndarray | None = None, records: list | None = None) -> dict[str, np.ndarray]:
    """Every step-level estimator's per-rollout scores (log order), SPEC §4, with the reward-only,
    text and length controls of the training log.

    With ``per_rollout`` the in-run rollout sketches replace the step sketches (the "which rollout"
    scores, weighted and direction, :func:`rollout_method_scores`). Targets: the final checkpoint's
    continuation target (C1, TRAK, local-buffer) and one per checkpoint (TracInCP).
    ``pattern_matches`` (bool [N], log order): whether each logged completion contains the first
    behaviour's pattern by the contaminator's judge (``behavior.contaminator.pattern_matches``), the
    text control's input. ``step_sketches`` (float32 [steps, D]) and ``records`` (the rollout log)
    save re-reading them when the caller already holds them.
    """
    records = list(rollout_log.read_rollouts(paths.rollouts)) if records is None else records
    log = dict(training_log_inputs(records, rollout_ids), pattern_matches=np.asarray(pattern_matches),
               metagradient=metagradient_scores(paths, rollout_ids, metagradient_mode(options)))
    target_path = paths.sketch_store("targets_continuation")
    if per_rollout:
        rs = read_rollout_sketches(options, paths)
        return rollout_method_scores(options, target_path, rs, rollout_ids, rollout_steps, like=rs.store, **log)
    store = None if step_sketches is not None else read_complete(paths.sketch_store("step_sketches"), options)
    sketches = step_sketches if store is None else store.read()
    return target_store_scores(options, target_path, sketches, rollout_ids, rollout_steps, like=store, **log)


def rollout_method_scores(options: ScoreOptions, target_path: pathlib.Path, sketches: RolloutSketches,
                          rollout_ids: list[str], rollout_steps: np.ndarray, *, advantages=None,
                          rewards=None, like: sketch_store.SketchStore | None = None, **inputs) -> dict[str, np.ndarray]:
    """The "which rollout" scores (``estimators.score_rollout_sketches``): every step-level estimator
    on the weighted rollout sketches (registered names; the reward-only, text and length controls
    (``inputs``: ``pattern_matches``, ``completion_lengths``) and ``norm/|A|``
    included), then every sketch-reading one on the direction sketches (names +
    ``estimators.DIRECTION``) when present, with the targets of ``target_path`` (checked against
    the sketches' store ``like``, :func:`check_same_sketch`, when given)."""
    return estimators.score_rollout_sketches(sketches.weighted, sketches.direction, rollout_ids, rollout_steps,
                                             advantages=advantages, rewards=rewards,
                                             **inputs, **estimator_options(options, target_path, like))


def metagradient_mode(options: ScoreOptions) -> str:
    """The advantages mode the ``metagradient`` estimator scores: the counterfactual replays'
    (``counterfactual.recompute_advantages``: "recomputed", else "logged")."""
    return "recomputed" if options.recompute_advantages else "logged"


def metagradient_scores(paths: RunLayout, rollout_ids: list[str], mode: str | None = None) -> np.ndarray | None:
    """The ``metagradient`` stage's ``dM/dw_i`` (float64 [N], log order) for the estimator of that
    name, or None when the stage has not run (the estimator is then skipped). The file is keyed
    (``io/cache.py``, written by ``stages/metagradient.py``): its key must hold the digest of the
    run's rollout log (``rollout_log.digest``) and, when ``mode`` is given, that advantages mode.

    Raises:
        ValueError: naming the file and the field: no ``cache`` key (a file not written by the
            stage), a key of another rollout log or mode, rollout ids that are not
            ``rollout_ids``, ``scores`` not a list of ``len(rollout_ids)`` finite-or-NaN numbers.
    """
    path = paths.metagradient_scores
    if not path.exists():
        return None
    rec = read_json(path)
    key = rec.get(cache.CACHE_FIELD) if isinstance(rec, dict) else None
    if not isinstance(key, dict):
        raise ValueError(f"{path}: no {cache.CACHE_FIELD!r} key (not written by the `metagradient` stage, or by an "
                         "older version); rerun the `metagradient` stage")
    log = rollout_log.digest(paths.rollouts)
    if key.get("rollout_log") != log:
        raise ValueError(f"{path}: field 'cache.rollout_log' is the digest of another rollout log than "
                         f"{paths.rollouts}; rerun the `metagradient` stage")
    if mode is not None and key.get("advantages") != mode:
        raise ValueError(f"{path}: field 'cache.advantages' = {key.get('advantages')!r}, but the config's mode is "
                         f"{mode!r} (counterfactual.recompute_advantages); rerun the `metagradient` stage")
    if rec.get("rollout_ids") != list(rollout_ids):
        raise ValueError(f"{path}: {len(rec.get('rollout_ids') or [])} rollout ids that are not the run's "
                         f"{len(rollout_ids)}; rerun the `metagradient` stage")
    scores = rec.get("scores")
    if (not isinstance(scores, list) or len(scores) != len(rollout_ids)
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in scores)):
        raise ValueError(f"{path}: field 'scores' is not a list of {len(rollout_ids)} numbers")
    return np.asarray(scores, np.float64)


def estimator_options(options: ScoreOptions, target_path: pathlib.Path,
                      like: sketch_store.SketchStore | None = None) -> dict:
    """The estimators' targets and options: ``target`` (the last checkpoint's continuation target),
    ``targets_by_checkpoint`` (TracInCP), ``lr``, ``damping``, ``seed``, ``window``, ``current_step``.
    ``like``: the store of the sketches scored against the targets (:func:`check_same_sketch`).

    Raises:
        FileNotFoundError / ValueError: the target store is absent or incomplete, or not of the
            config's / ``like``'s CountSketch (names it and the key).
    """
    ev = options.evaluation
    t_store = read_complete(target_path, options)
    if like is not None:
        check_same_sketch(like, t_store)
    targets = t_store.read()
    by_ckpt = {int(s): targets[i] for i, s in enumerate(t_store.metadata["checkpoint_steps"])}
    return dict(target=targets[-1], targets_by_checkpoint=by_ckpt, lr=ev.tracin_lr, damping=ev.trak_damping,
                seed=int(options.run_seed), window=ev.local_buffer_window, current_step=int(options.steps))


def target_store_scores(options: ScoreOptions, target_path: pathlib.Path, sketches: np.ndarray,
                        rollout_ids: list[str], rollout_steps: np.ndarray, *, per_rollout: bool = False,
                        advantages=None, rewards=None, like: sketch_store.SketchStore | None = None,
                        **inputs) -> dict[str, np.ndarray]:
    """:func:`step_method_scores` with the targets of ``target_path`` (another behaviour's
    ``targets_continuation_<id>.zarr``) and sketches the caller has read: float32
    [steps, D] step sketches, or [N, D] per-rollout sketches with ``per_rollout``.
    ``advantages`` / ``rewards`` (float [N], log order) feed the reward-only controls; ``inputs``:
    more estimator inputs by name (``pattern_matches`` / ``completion_lengths`` for the text and
    length controls, ``metagradient``; None = absent, its estimator is skipped).

    Raises:
        FileNotFoundError / ValueError: the target store is absent or incomplete (names it).
    """
    steps = np.asarray(rollout_steps) if per_rollout else np.arange(sketches.shape[0])
    return estimators.score_step_methods(sketches, steps, rollout_ids, rollout_steps, per_rollout_sketches=per_rollout,
                                         advantages=advantages, rewards=rewards, **inputs,
                                         **estimator_options(options, target_path, like))
