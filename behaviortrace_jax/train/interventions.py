"""Replay interventions as registered objects (issue 46 item 1): what an intervention does to a step.

An intervention acts on the rollout slots ``(step, index)`` a replay request targets (a unit or
subset, log order). For each replayed step with a targeted slot, :meth:`Intervention.step` gets the
step's rewards, base rewards (the reward without any bonus) and the bool mask of its targeted slots,
and returns a :class:`StepEffect`: per-rollout loss ``weights`` (None = all 1) and ``rewards``
(None = unchanged). It declares whether the step's advantages must then be recomputed from the
rewards with the run's own advantage function (``rollouts.advantages``): an intervention that
changes rewards says so; one that only weights rollouts leaves the logged advantages unless the
request asks for ``advantages = "recomputed"`` (each group's baseline over its kept rollouts,
``grpo_loss.recomputed_advantages``, and the step normalised by the kept count).

Adding an intervention is one registration, here or in any module imported before the replay
(a test file, a plugin)::

    @register_intervention("negate-bonus", recomputes_advantages=True)
    def negate_bonus(rewards, base, target):
        return StepEffect(rewards=np.where(target, 2 * base - rewards, rewards).astype(np.float32))

The registration's ``name`` and ``version`` enter every replay's cache key
(``train/replay_request.py``), so a changed intervention is recomputed once its version is bumped.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class StepEffect:
    """What an intervention does to one step of N rollouts: ``weights`` float32 [N] in [0, 1] that
    multiply each rollout's loss term (None = all 1; 0 removes the rollout) and ``rewards`` float32
    [N], the step's final rewards after the intervention (None = unchanged)."""

    weights: np.ndarray | None = None
    rewards: np.ndarray | None = None


StepFn = Callable[[np.ndarray, np.ndarray, np.ndarray], StepEffect]


@dataclasses.dataclass(frozen=True)
class Intervention:
    """A registered intervention: ``fn(rewards, base, target) -> StepEffect`` for one step (rewards
    and base rewards float32 [N], ``target`` bool [N], the step's targeted slots) and its
    declarations: ``recomputes_advantages`` (its rewards differ, so the step's advantages are
    recomputed with the run's own function) and ``version`` (bump it when ``fn`` changes)."""

    name: str
    fn: StepFn
    recomputes_advantages: bool
    version: int = 1

    def step(self, rewards: np.ndarray, base: np.ndarray, target: np.ndarray) -> StepEffect:
        """The checked :class:`StepEffect` of one step. Raises ValueError naming the intervention
        for weights outside [0, 1] or arrays of the wrong shape."""
        eff = self.fn(np.asarray(rewards, np.float32), np.asarray(base, np.float32), np.asarray(target, bool))
        n = np.asarray(rewards).shape
        for field in ("weights", "rewards"):
            a = getattr(eff, field)
            if a is not None and np.asarray(a).shape != n:
                raise ValueError(f"intervention {self.name!r}: {field} of shape {np.asarray(a).shape}, expected {n}")
        if eff.weights is not None and not np.all((eff.weights >= 0) & (eff.weights <= 1)):
            raise ValueError(f"intervention {self.name!r}: weights must lie in [0, 1]")
        return eff

    def identity(self) -> dict:
        """What of the intervention enters a replay's cache key (JSON types)."""
        return {"name": self.name, "version": int(self.version), "recomputes_advantages": self.recomputes_advantages}


INTERVENTIONS: dict[str, Intervention] = {}


def register_intervention(name: str, *, recomputes_advantages: bool, version: int = 1) -> Callable[[StepFn], StepFn]:
    """Registers ``fn(rewards, base, target) -> StepEffect`` as intervention ``name`` (see
    :class:`Intervention`). Raises ValueError for a duplicate name."""

    def wrap(fn: StepFn) -> StepFn:
        if name in INTERVENTIONS:
            raise ValueError(f"intervention {name!r} already registered")
        INTERVENTIONS[name] = Intervention(name, fn, bool(recomputes_advantages), int(version))
        return fn

    return wrap


def get_intervention(name: str) -> Intervention:
    """The registered intervention ``name``. Raises ValueError naming the registered ones."""
    if name not in INTERVENTIONS:
        raise ValueError(f"intervention {name!r} is not registered; known: {sorted(INTERVENTIONS)}")
    return INTERVENTIONS[name]


@register_intervention("remove", recomputes_advantages=False)
def remove(rewards: np.ndarray, base: np.ndarray, target: np.ndarray) -> StepEffect:
    """Weight 0 for the targeted rollouts (SPEC §10.1's leave-trajectory-out): their loss terms go;
    their rewards (and the logged advantages of their group-mates) stay unless the request
    recomputes the advantages over the kept rollouts."""
    del rewards, base
    return StepEffect(weights=np.where(target, 0.0, 1.0).astype(np.float32))


@register_intervention("withhold-bonus", recomputes_advantages=True)
def withhold_bonus(rewards: np.ndarray, base: np.ndarray, target: np.ndarray) -> StepEffect:
    """The targeted rollouts stay but lose their bonus: their reward becomes their base reward."""
    return StepEffect(rewards=np.where(target, base, rewards).astype(np.float32))
