"""A GRPO run's checkpoints and its exact resume (SPEC §2.4).

**Checkpoint** (:meth:`GRPOCheckpointer.save`, every ``grpo.checkpoint_every`` steps and at the
last): makes every artefact of the steps before it durable, in this order: the rollout log and the
in-run sketch rows, each behaviour's ground-truth (and decoy) log, the HF export
``grpo/checkpoints/step_<s>``, its registry entry (``grpo/registry.json``), the learning-curve point
(each behaviour's greedy rates, ``grpo/learning_curve.json``), then the orbax train state
``grpo/state`` (params, optimizer state, step, the run's base PRNG key). The orbax save is the last
write, so a complete orbax step L means every artefact of the steps < L is on disk.

**Resume** (:func:`resume`): the PRNG key of step s is ``fold_in(key(seed), s)``, so a run
restarted from the latest complete orbax state L drops every logged record of the steps >= L (the
rollout log here; the ground-truth logs in ``grpo_tracks.open_tracks``; the curve points after L in
:class:`GRPOCheckpointer`) and replays those steps bit for bit.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from behaviortrace_jax.io import checkpoints, rollout_log
from behaviortrace_jax.io.files import read_json, write_json
from behaviortrace_jax.io.layout import RunLayout
from behaviortrace_jax.models import hf_io, sharding
from behaviortrace_jax.train.grpo_logs import GRPOLogs
from behaviortrace_jax.train.grpo_tracks import BehaviorTrack, curve_point
from behaviortrace_jax.train.start_state import StartState


@dataclasses.dataclass
class Resumed:
    """Where a GRPO run goes on from: ``start_step`` (0 for a new run) and the ``params`` /
    ``opt_state`` of that step (the start state's for a new run, the orbax state's otherwise)."""

    start_step: int
    params: Any
    opt_state: Any


def resume(paths: RunLayout, start: StartState) -> Resumed:
    """The latest complete orbax state under ``paths.state`` restored onto ``start``'s shardings (or
    ``start`` itself when there is none), with the rollout log cut back to the steps before it.
    Creates ``grpo/``. Raises as ``checkpoints.restore_train_state`` for an unreadable state."""
    paths.grpo.mkdir(parents=True, exist_ok=True)
    start_step = checkpoints.latest_step(paths.state) or 0
    if start_step:
        restored = checkpoints.restore_train_state(paths.state, start_step, start.abstract_state)
        params, opt_state = restored["params"], restored["opt_state"]
        logging.info("grpo: resuming from step %d", start_step)
    else:
        params, opt_state = start.params, start.opt_state
    rollout_log.truncate_after_step(paths.rollouts, start_step - 1)
    return Resumed(start_step, params, opt_state)


class GRPOCheckpointer:
    """Writes a GRPO run's checkpoints (module docstring) and holds its learning curve.

    Args:
        paths: the run's layout.
        start_step: where this invocation starts; the curve keeps the saved points up to it.
        start: the start state (model config, tokenizer and mesh of the HF export and the orbax save).
        seed: the run's seed (the base PRNG key saved with the state); run_name: the registry's ``model``.
    """

    def __init__(self, paths: RunLayout, start_step: int, start: StartState, *, seed: int, run_name: str):
        self.paths, self.run_name = paths, run_name
        self.model_cfg, self.tok, self.mesh = start.model_config, start.tokenizer, start.mesh
        self.registry = checkpoints.CheckpointRegistry(paths.registry)
        self.curve: list[dict[str, Any]] = [c for c in read_json(paths.curve, []) if c["step"] <= start_step]
        self.base_key = jax.random.key(seed)

    def save(self, step: int, params: Any, opt_state: Any, logs: GRPOLogs, tracks: Sequence[BehaviorTrack]
             ) -> dict[str, Any]:
        """Makes steps < ``step`` durable with ``params`` / ``opt_state`` (the state after step
        ``step - 1``); returns the learning-curve point (``grpo_tracks.curve_point``)."""
        logs.flush()
        for track in tracks:
            track.flush()
        hf_dir = self.paths.checkpoints / f"step_{step:08d}"
        hf_io.save_hf_checkpoint(params, self.model_cfg, hf_dir, tokenizer=self.tok)
        if self.registry.at_step(step) is None:
            self.registry.register(step, str(hf_dir), {"regime": "grpo", "model": self.run_name})
        point = curve_point(tracks, params, step)
        self.curve = [c for c in self.curve if c["step"] < step] + [point]
        write_json(self.paths.curve, self.curve)
        rng, step_arr = self.base_key, jnp.int32(step)
        if jax.process_count() > 1:  # orbax saves global arrays only: place the host-local ones on the mesh
            replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
            rng, step_arr = sharding.put((rng, step_arr), replicated)
        checkpoints.save_train_state(self.paths.state, step, {
            "params": params, "opt_state": opt_state, "step": step_arr, "rng": rng})
        return point
