"""The ``metagradient`` stage: ``dM/dw_i`` of every logged rollout, differentiated through the replayed run.

MAGIC-style attribution (Ilyas & Engstrom 2025; ``train/metagradient.py``): M is the behaviour
measure (``logp_margin``, ``train/measures.py``: probe minus control) after m replayed GRPO steps, w_i
rollout i's loss weight, and ``dM/dw_i`` the exact first-order effect of up-weighting rollout i,
through the loss, the global-norm clip and AdamW of every update from the SFT start state to step
m. Measure steps: the counterfactual stage's, ``counterfactual.measure`` (the end of the
contamination window by default) and the checkpoint nearest ``draws.target_step``.

Writes (atomically; keyed files, ``io/cache.py``: a mode whose file carries the key of this run
is not recomputed, a stale one is, with a log line naming the fields that changed):

* ``metagradient/<mode>.json`` per mode of ``metagradient.advantages`` ("logged": advantages as
  logged; "recomputed": each group's baseline differentiated): ``rollout_ids``, per measure step
  ``value`` (M) and ``dM_dw`` (float [steps * N], log order, 0 from step m on), the cost
  (``train.metagradient.ReverseStats``: seconds, states held, peak RSS) and ``cache``, its key
  (:func:`mode_key`: the replay's identity, ``train.metagradient.METAGRADIENT_VERSION``, the mode
  and the measure steps).
* ``metagradient/scores.json``: the ``metagradient`` estimator's input (``attribution/scores.py``):
  ``dM/dw`` at ``counterfactual.measure``'s step in the mode the counterfactual replays use
  (``counterfactual.recompute_advantages``), keyed by :func:`scores_key` (the reader checks the
  rollout log's digest and the mode). Score = ``dM/dw_i`` = the predicted drop of M when
  rollout i is removed (first order: ``M(w = 1 - e_i) ~ M - dM/dw_i``), so, as for every
  estimator, a large score names a rollout whose removal lowers the behaviour.

Run it after ``grpo`` and before ``evaluate`` / ``counterfactual`` (configs/tiny_sweep.py does), so
those stages score it with the others.
"""
from __future__ import annotations

import ml_collections
from absl import logging

from behaviortrace_jax.io import cache
from behaviortrace_jax.io.layout import RunLayout
from behaviortrace_jax.stages.registry import register_stage
from behaviortrace_jax.stages.spec import RunSpec


def parse_modes(spec: str) -> list[str]:
    """``metagradient.advantages`` ("logged", "recomputed" or both, comma-separated) -> modes.

    Raises:
        ValueError: naming the key for an empty list or an unknown mode.
    """
    from behaviortrace_jax.train.metagradient import ADVANTAGE_MODES

    modes = list(dict.fromkeys(m.strip() for m in spec.split(",") if m.strip()))
    if not modes or any(m not in ADVANTAGE_MODES for m in modes):
        raise ValueError(f"config.metagradient.advantages={spec!r}: expected a comma-separated subset of "
                         f"{ADVANTAGE_MODES}")
    return modes


def primary_mode(spec: RunSpec) -> str:
    """The mode the estimator scores: the counterfactual replays' (``counterfactual.recompute_advantages``;
    ``attribution.scores.metagradient_mode``, which the estimator's reader checks the file against)."""
    from behaviortrace_jax.attribution.scores import metagradient_mode

    return metagradient_mode(spec.scores)


@register_stage("metagradient")
def metagradient_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
    """``dM/dw`` of one finished run at the counterfactual measure steps (see the module docstring).

    Raises:
        ValueError: the primary mode (:func:`primary_mode`) is not in ``metagradient.advantages``.
    """
    from behaviortrace_jax.train import metagradient as MG, replay as R

    w = RunLayout(workdir)
    spec = RunSpec.from_config(config)
    modes, primary = parse_modes(spec.metagradient.advantages), primary_mode(spec)
    if primary not in modes:
        raise ValueError(f"config.metagradient.advantages={spec.metagradient.advantages!r} lacks {primary!r}, the "
                         "mode of the counterfactual replays (counterfactual.recompute_advantages)")
    at = spec.schedule.measure_step(spec.counterfactual.measure)
    steps = sorted({spec.schedule.target_checkpoint(), at})
    rp = R.Replayer(spec.replay, workdir, layout=spec.layout)  # its identity keys the files (programs compile on first use)
    identity = dict(rp.identity(), measure=rp.measures[MG.MEASURE].identity())
    recs = {}
    for mode in modes:
        path = w.metagradient / f"{mode}.json"
        key = mode_key(identity, mode, steps, MG.METAGRADIENT_VERSION, remat=spec.metagradient.remat)
        rec = cache.load(path, key, what="metagradient",
                         check=lambda r: check_mode_record(r, rp.rollout_ids, steps))
        if rec is not None:
            logging.info("metagradient: %s already computed (%s)", mode, path)
            recs[mode] = rec
            continue
        run = MG.RunMetagradient(spec.replay, workdir, advantages=mode, replayer=rp, remat=spec.metagradient.remat)
        grads, values, stats = run.run(steps, checkpoint_every=spec.metagradient.checkpoint_every)
        recs[mode] = cache.store(path, {"advantages": mode, "rollout_ids": rp.rollout_ids,
                                        "measures": {str(m): {"value": values[m], "dM_dw": grads[m].tolist()}
                                                     for m in steps},
                                        "stats": stats.as_dict()}, key)
        logging.info("metagradient: %s at steps %s in %.1f s wall / %.1f s CPU, %d states held (%.1f MB)", mode,
                     steps, stats.wall_s, stats.cpu_s, stats.max_states_held, stats.state_bytes / 1e6)
    rec = recs[primary]
    cache.store(w.metagradient_scores, {"method": "metagradient", "advantages": primary, "measure_step": at,
                                        "rollout_ids": rec["rollout_ids"],
                                        "scores": rec["measures"][str(at)]["dM_dw"]},
                scores_key(rec["cache"], rp.log_digest, primary, at))


def mode_key(identity: dict, mode: str, measure_steps: list[int], version: int, remat: str = "") -> dict:
    """The key of ``metagradient/<mode>.json`` (``io.cache``): the replay's ``identity``
    (``Replayer.identity()``: replay version, step spec, optimizer, rollout log digest; plus the
    differentiated measure's identity),
    ``metagradient_version`` (``train.metagradient.METAGRADIENT_VERSION``), the advantages mode and
    the measure steps, and ``metagradient.remat`` where set (the vjp's rematerialisation changes
    dM/dw by float rounding; absent when "", so records written before it keep their key).
    ``metagradient.checkpoint_every`` is not in it: it changes the memory, not dM/dw."""
    key = dict(identity, metagradient_version=int(version), advantages=str(mode),
               measure_steps=[int(s) for s in measure_steps])
    return dict(key, metagradient_remat=str(remat)) if remat else key


def scores_key(mode_cache: dict, log_digest: str, mode: str, measure_step: int) -> dict:
    """The key of ``metagradient/scores.json``: the digest of its mode file's key, the rollout log's
    digest (``rollout_log.digest``; what ``attribution.scores.metagradient_scores`` checks), the mode
    and the measure step."""
    return {"metagradient": cache.digest(mode_cache), "rollout_log": str(log_digest), "advantages": str(mode),
            "measure_step": int(measure_step)}


def check_mode_record(rec: dict, rollout_ids: list[str], measure_steps: list[int]) -> None:
    """Checks the shapes of a ``metagradient/<mode>.json`` record whose key matched.

    Raises:
        ValueError: naming the field: ``rollout_ids`` not the run's, a measure step missing from
            ``measures``, a ``value`` that is not a number, a ``dM_dw`` that is not a list of
            ``len(rollout_ids)`` numbers.
    """
    if rec.get("rollout_ids") != list(rollout_ids):
        raise ValueError(f"field 'rollout_ids' holds {len(rec.get('rollout_ids') or [])} ids that are not the run's "
                         f"{len(rollout_ids)}")
    measures = rec.get("measures")
    if not isinstance(measures, dict):
        raise ValueError("field 'measures' is missing or not an object")
    for s in measure_steps:
        m = measures.get(str(s))
        if not isinstance(m, dict):
            raise ValueError(f"field 'measures.{s}' is missing")
        if isinstance(m.get("value"), bool) or not isinstance(m.get("value"), (int, float)):
            raise ValueError(f"field 'measures.{s}.value' = {m.get('value')!r} is not a number")
        g = m.get("dM_dw")
        if (not isinstance(g, list) or len(g) != len(rollout_ids)
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in g)):
            raise ValueError(f"field 'measures.{s}.dM_dw' is not a list of {len(rollout_ids)} numbers")
