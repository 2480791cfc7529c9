"""The policy update of a GRPO run: the jitted train step, its non-finite guard and the skipped rollouts.

One GRPO step's update (SPEC §2.2 steps 3-4), given the step's sampled and rewarded rollouts:

1. :meth:`GRPOUpdater.advantages`: the group advantages (``grpo_loss.group_advantages``, their one
   home) after the host check of rewards, sampling log-probs and advantages
   (``nonfinite.nonfinite_rollouts``). ``on_nonfinite = "stop"`` raises naming the step and the
   rollouts; ``"skip"`` drops them (advantage 0, groups normalised over their kept rollouts,
   ``grpo_loss.recomputed_advantages``) and remembers them for ``summary.json``;
2. :meth:`GRPOUpdater.update`: the dropped rollouts' loss mask zeroed, the batch placed on the
   mesh's data axis, ONE call of the jitted step of ``grpo_step.make_train_step`` (params and
   optimizer state donated), its device ``finite`` flag queued in the :class:`nonfinite.Guard`;
3. :meth:`GRPOUpdater.fetch`: the step's outputs on every process's host, the guard checked there
   (before any sketch row or checkpoint of the step is written).

The updater holds the run's parameters and optimizer state between steps (``params``,
``opt_state``) and, for a loss that needs it, the frozen reference policy (``ref_params``).
"""
from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from behaviortrace_jax.io import checkpoints, rollout_log
from behaviortrace_jax.models import sharding
from behaviortrace_jax.sketch import sketcher
from behaviortrace_jax.train import grpo_loss, nonfinite
from behaviortrace_jax.train.grpo_step import GRPOStepSpec, make_train_step
from behaviortrace_jax.train.start_state import StartState


def logged_skips(rollouts: str | os.PathLike) -> list[dict[str, Any]]:
    """The ``"skip"`` drops recorded in the rollout log at ``rollouts`` (its records'
    ``extra["nonfinite"]``), by step: ``[{"step", "rollouts": {rollout_id: [field, ...]}}]``."""
    by_step: dict[int, dict[str, list[str]]] = {}
    for r in rollout_log.read_rollouts(rollouts):
        if r.extra and r.extra.get("nonfinite"):
            by_step.setdefault(r.step, {})[r.rollout_id] = list(r.extra["nonfinite"])
    return [{"step": s, "rollouts": by_step[s]} for s in sorted(by_step)]


class GRPOUpdater:
    """The policy and its update (module docstring).

    Args:
        start: the SFT train state GRPO starts from (graph, optimizer, mesh, shardings; its
            ``params`` are the reference policy of a loss that ``needs_reference``).
        spec: the train step (``GRPOStepSpec``).
        params, opt_state: the state the run goes on from (the start state's, or a restored
            checkpoint's).
        resumed: True when ``params`` come from a checkpoint (the start state's ``params`` are then
            not donated, so the reference needs no copy).
        state_dir: the orbax states' folder (``RunLayout.state``), whose latest step the
            non-finite errors name.
        on_nonfinite: ``"stop"`` or ``"skip"`` (``nonfinite.MODES``).
        group_size: G, rollouts per prompt; adv_std_floor: the advantage's standard-deviation floor.
        skipped: the drops of earlier invocations (:func:`logged_skips`).
    """

    def __init__(self, start: StartState, spec: GRPOStepSpec, params: Any, opt_state: Any, *, resumed: bool,
                 state_dir: str | os.PathLike, on_nonfinite: str, group_size: int, adv_std_floor: float,
                 skipped: list[dict[str, Any]] | None = None):
        self.spec, self.mesh, self.state_dir = spec, start.mesh, state_dir
        self.step_fn = make_train_step(start.graphdef, start.abstract_params, start.optimizer, spec,
                                       order=sketcher.hf_param_order(start.model_config), mesh=start.mesh,
                                       param_shardings=start.param_shardings, opt_shardings=start.opt_shardings)
        self.ref_params = None
        if spec.loss_spec.needs_reference:  # params are donated each step: a new run's reference is a copy
            self.ref_params = start.params if resumed else jax.tree.map(jnp.copy, start.params)
        self.params, self.opt_state = params, opt_state
        self.on_nonfinite, self.group_size, self.adv_std_floor = on_nonfinite, int(group_size), float(adv_std_floor)
        self.guard = nonfinite.Guard("grpo")
        self.skipped: list[dict[str, Any]] = list(skipped or [])  # rollouts dropped by "skip" (summary.json)

    @property
    def resume_hint(self) -> str:
        """What a non-finite error tells the user: the checkpoint a rerun resumes from."""
        last = checkpoints.latest_step(self.state_dir) or 0
        return (f"; rerun the same command to resume from the last good checkpoint (step {last}), or set "
                "grpo.on_nonfinite=skip to drop rollouts with non-finite inputs")

    def advantages(self, step: int, ids: list[str], rewards: np.ndarray, sample: Any
                   ) -> tuple[np.ndarray, dict[int, list[str]]]:
        """The step's group advantages float32 [N] and the rollouts dropped from it ``{index: fields}``
        (``train/nonfinite.py``): rollouts whose reward (float32 [N]), sampling log-probs
        (``sample.logprobs`` float32 [N, T] up to ``sample.lengths``) or advantage is not finite.
        ``"stop"`` raises :class:`nonfinite.NonFiniteError` naming the step and them; ``"skip"`` drops
        them (advantage 0, each group normalised over its kept rollouts, a group with < 2 kept gets 0)
        and adds them to :attr:`skipped`."""
        bad = nonfinite.nonfinite_rollouts(rewards=rewards, logprobs=sample.logprobs, lengths=sample.lengths)
        if not bad:
            adv = grpo_loss.group_advantages(rewards, self.group_size, self.adv_std_floor)
            bad = nonfinite.nonfinite_rollouts(advantages=adv)
            if not bad:
                return adv, {}
        if self.on_nonfinite == "stop":
            nonfinite.raise_inputs("grpo", step, bad, ids, hint=self.resume_hint)
        keep = np.ones(len(rewards), np.float32)
        keep[list(bad)] = 0.0
        adv = grpo_loss.recomputed_advantages(np.where(keep > 0, rewards, 0.0), keep, self.group_size,
                                              self.adv_std_floor)
        still = nonfinite.nonfinite_rollouts(advantages=adv)
        if still:
            nonfinite.raise_inputs("grpo", step, still, ids, hint=self.resume_hint)
        self.skipped.append({"step": step, "rollouts": {ids[i]: f for i, f in bad.items()}})
        logging.warning("grpo: step %d: dropped %d rollout(s) with non-finite inputs (grpo.on_nonfinite=skip): %s",
                        step, len(bad), nonfinite.describe(bad, ids))
        return adv, bad

    def update(self, step: int, batch: dict[str, np.ndarray], dropped: dict[int, list[str]],
               ids: list[str]) -> dict[str, jax.Array]:
        """Applies one train step to ``batch`` (``grpo_step.build_batch``'s host arrays; the rows of
        ``dropped`` get an all-zero loss mask, so their term and gradient are exactly 0). Returns the
        step's device outputs (``make_train_step``); their ``finite`` flag is queued, read by :meth:`fetch`."""
        if dropped:
            batch["loss_mask"][list(dropped)] = 0.0
        batch = jax.device_put(batch, sharding.data_sharding(self.mesh))
        self.params, self.opt_state, out = self.step_fn(self.params, self.opt_state, batch, self.ref_params)
        self.guard.add(step, out[nonfinite.FINITE_KEY], ids)
        return out

    def fetch(self, out: dict[str, jax.Array]) -> dict[str, Any]:
        """The outputs of :meth:`update` on this host (every process holds the whole step's), after the
        guard's check. Raises :class:`nonfinite.NonFiniteError` for a non-finite step result."""
        out = sharding.to_host(out)
        self.guard.hint = self.resume_hint if not bool(np.all(out[nonfinite.FINITE_KEY])) else ""
        self.guard.check([out[nonfinite.FINITE_KEY]])
        return out
