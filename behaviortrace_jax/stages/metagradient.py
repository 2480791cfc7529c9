"""The ``metagradient`` stage: ``dM/dw_i`` of every logged rollout, differentiated through the replayed run.

MAGIC-style attribution (Ilyas & Engstrom 2025; ``train/metagradient.py``): M is the behaviour
measure (``BehaviorMeasure.logp_margin``, probe minus control) after m replayed GRPO steps, w_i
rollout i's loss weight, and ``dM/dw_i`` the exact first-order effect of up-weighting rollout i,
through the loss, the global-norm clip and AdamW of every update from the SFT start state to step
m. Measure steps: the counterfactual stage's, ``counterfactual.measure`` (the end of the
contamination window by default) and the checkpoint nearest ``draws.target_step``.

Writes (atomically; a mode whose file holds every measure step is not recomputed):

* ``metagradient/<mode>.json`` per mode of ``metagradient.advantages`` ("logged": advantages as
  logged; "recomputed": each group's baseline differentiated): ``rollout_ids``, per measure step
  ``value`` (M) and ``dM_dw`` (float [steps * N], log order, 0 from step m on), and the cost
  (``train.metagradient.ReverseStats``: seconds, states held, peak RSS).
* ``metagradient/scores.json``: the ``metagradient`` estimator's input (``attribution/scores.py``):
  ``dM/dw`` at ``counterfactual.measure``'s step in the mode the counterfactual replays use
  (``counterfactual.recompute_advantages``). Score = ``dM/dw_i`` = the predicted drop of M when
  rollout i is removed (first order: ``M(w = 1 - e_i) ~ M - dM/dw_i``), so, as for every
  estimator, a large score names a rollout whose removal lowers the behaviour.

Run it after ``grpo`` and before ``evaluate`` / ``counterfactual`` (configs/tiny_sweep.py does), so
those stages score it with the others.
"""
from __future__ import annotations

import ml_collections
from absl import logging

from behaviortrace_jax.io.files import read_json, write_json
from behaviortrace_jax.io.layout import RunLayout
from behaviortrace_jax.stages.registry import register_stage


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


def primary_mode(config: ml_collections.ConfigDict) -> str:
    """The mode the estimator scores: the counterfactual replays' (``counterfactual.recompute_advantages``)."""
    return "recomputed" if config.counterfactual.recompute_advantages else "logged"


@register_stage("metagradient")
def metagradient_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
    """``dM/dw`` of one finished run at the counterfactual measure steps (see the module docstring).

    Raises:
        ValueError: the primary mode (:func:`primary_mode`) is not in ``metagradient.advantages``.
    """
    from behaviortrace_jax.train import metagradient as MG, replay as R

    w = RunLayout(workdir)
    modes, primary = parse_modes(config.metagradient.advantages), primary_mode(config)
    if primary not in modes:
        raise ValueError(f"config.metagradient.advantages={config.metagradient.advantages!r} lacks {primary!r}, the "
                         "mode of the counterfactual replays (counterfactual.recompute_advantages)")
    at = R.measure_step(config)
    steps = sorted({R.target_checkpoint(config), at})
    rp = None
    for mode in modes:
        path = w.metagradient / f"{mode}.json"
        done = read_json(path, {})
        if all(str(s) in done.get("measures", {}) for s in steps):
            logging.info("metagradient: %s already computed (%s)", mode, path)
            continue
        rp = rp if rp is not None else R.Replayer(config, workdir, rates=False)
        run = MG.RunMetagradient(config, workdir, advantages=mode, replayer=rp)
        grads, values, stats = run.run(steps, checkpoint_every=int(config.metagradient.checkpoint_every))
        write_json(path, {"advantages": mode, "rollout_ids": rp.rollout_ids,
                          "measures": {str(m): {"value": values[m], "dM_dw": grads[m].tolist()} for m in steps},
                          "stats": stats.as_dict()})
        logging.info("metagradient: %s at steps %s in %.1f s wall / %.1f s CPU, %d states held (%.1f MB)", mode,
                     steps, stats.wall_s, stats.cpu_s, stats.max_states_held, stats.state_bytes / 1e6)
    rec = read_json(w.metagradient / f"{primary}.json")
    write_json(w.metagradient_scores, {"method": "metagradient", "advantages": primary, "measure_step": at,
                                       "rollout_ids": rec["rollout_ids"],
                                       "scores": rec["measures"][str(at)]["dM_dw"]})
