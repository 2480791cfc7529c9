"""The replay's value types (``train/replay.py`` re-exports them): what a replay of a run needs from
its config (:class:`ReplayOptions`), a replay's state (:class:`ReplayState`) and result
(:class:`ReplayResult`), the kept-count normalisation of recomputed advantages
(:func:`kept_count_weights`) and the step spec's digest (:func:`step_spec_digest`)."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from behaviortrace_jax.behavior.probes import ProbeOptions
from behaviortrace_jax.io import replay_request
from behaviortrace_jax.io.replay_request import ReplayRequest
from behaviortrace_jax.models.loader import ModelOptions
from behaviortrace_jax.train import grpo_step, rollouts as rollouts_lib, train_state
from behaviortrace_jax.train.schedule import StepSchedule

_digest = replay_request.digest


def step_spec_digest(spec: grpo_step.GRPOStepSpec) -> str:
    """sha256 of every field of a :class:`grpo_step.GRPOStepSpec` (shapes and loss config included):
    two specs with one digest build the same train step. The hash family enters by its name (the
    config's ``sketch.hash``), as it did when the field was that string, so earlier replay caches
    keep their key."""
    return _digest(dict(dataclasses.asdict(spec), sketch_hash=spec.sketch_hash.name))


@dataclasses.dataclass(frozen=True)
class ReplayOptions:
    """What a replay of a run needs from its config, built at the stage boundary (``stages/spec.py``
    ``RunSpec.replay``): the policy's ``model`` options, the ``optim`` it continues, the GRPO
    ``step`` (one spec, so a replay is the run), the ``rollouts`` it samples and rewards (a
    regenerated replay; their ``behaviors[0]`` is the behaviour measured), the measure's ``probe``
    options, the run's ``schedule`` and whether GRPO continued the SFT warm-up's AdamW state
    (``continue_sft_moments``, ``config.grpo.continue_sft_moments``)."""

    model: ModelOptions
    optim: train_state.OptimOptions
    step: grpo_step.GRPOStepSpec
    rollouts: rollouts_lib.RolloutOptions
    probe: ProbeOptions
    schedule: StepSchedule
    continue_sft_moments: bool = True


@dataclasses.dataclass
class ReplayResult:
    """What :meth:`Replayer.run` returns: the ``request``, ``measures`` ``{step: {output: float}}``
    (every requested measure at every measure step), ``seconds`` (wall time of the replay, measures
    included), ``seconds_per_step`` (of the updates alone), ``regenerated_bonuses`` (bonuses paid to
    regenerated rollouts, after any withheld), ``zero_gradient_steps`` (steps that took the exact
    shortcut) and ``state``, the :class:`ReplayState` after ``request.stop`` updates."""

    request: ReplayRequest
    measures: dict[int, dict[str, float]]
    seconds: float
    seconds_per_step: float
    regenerated_bonuses: int
    zero_gradient_steps: int
    state: "ReplayState | None"

    def value(self, step: int, output: str) -> float:
        """The float ``output`` measured at ``step``. Raises KeyError naming both when absent."""
        try:
            return self.measures[int(step)][output]
        except KeyError:
            raise KeyError(f"replay: no {output!r} measured at step {step}; measured: "
                           f"{ {k: sorted(v) for k, v in self.measures.items()} }") from None

    def record(self) -> dict[str, Any]:
        """The JSON record of the result (no state): measures keyed by str(step), timings, counts."""
        return {"measures": {str(k): v for k, v in self.measures.items()}, "seconds": self.seconds,
                "seconds_per_step": self.seconds_per_step, "regenerated_bonuses": self.regenerated_bonuses,
                "zero_gradient_steps": self.zero_gradient_steps}


@dataclasses.dataclass
class ReplayState:
    """A replay's state after ``step`` updates: params and optimizer state (device pytrees; a
    replay started from it donates them, so pass copies to start several)."""

    step: int
    params: Any
    opt_state: Any


def kept_count_weights(weights: np.ndarray) -> np.ndarray:
    """One step's weights normalised by the kept count: ``w * N / sum(w)`` (float32 [N]); all-zero
    weights stay 0. With recomputed advantages the weighted step is then the loss of the kept
    rollouts as a batch of their own (its mean over them), not divided by the fixed ``G * B``."""
    w = np.asarray(weights, np.float32)
    total = float(np.sum(w, dtype=np.float64))
    return w if total <= 0 else (w * np.float32(w.size / total)).astype(np.float32)
