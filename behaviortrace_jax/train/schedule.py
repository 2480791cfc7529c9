"""The run's step schedule: how long GRPO runs, where it saves checkpoints, which checkpoint the
draws target and where the contamination window ends (SPEC §2.1, §1.6, §5.6).

:class:`StepSchedule` is built once at the stage boundary (``stages/spec.py``) and read by the
replay, the causal replays and the stages that pick a checkpoint.
"""
from __future__ import annotations

import dataclasses

MEASURES = ("window", "target", "end")  # counterfactual.measure


@dataclasses.dataclass(frozen=True)
class StepSchedule:
    """The GRPO run's steps and checkpoints.

    Fields: ``steps`` (GRPO steps, ``grpo.steps``), ``checkpoint_every`` (``grpo.checkpoint_every``),
    ``target_step`` (``draws.target_step``: the draws' checkpoint is the one nearest it),
    ``early_step_cutoff`` (the first behaviour's bonus window 0..cutoff-1,
    ``contamination.early_step_cutoff``), ``window_end`` (the end of every behaviour's bonus window:
    ``behaviors.window_end``; the cutoff with one behaviour).

    Raises:
        ValueError: naming ``grpo.steps`` / ``grpo.checkpoint_every`` when either is < 1.
    """

    steps: int
    checkpoint_every: int
    target_step: int
    early_step_cutoff: int
    window_end: int

    def __post_init__(self):
        for key, v in (("grpo.steps", self.steps), ("grpo.checkpoint_every", self.checkpoint_every)):
            if v < 1:
                raise ValueError(f"config.{key}: must be > 0, got {v}")

    def checkpoint_steps(self) -> list[int]:
        """The steps at which the ``grpo`` stage saves a checkpoint (every ``checkpoint_every`` and the end)."""
        every = self.checkpoint_every
        return sorted({s for s in range(every, self.steps + 1, every)} | {self.steps})

    def target_checkpoint(self) -> int:
        """The checkpoint nearest ``target_step`` (ties: the earlier one; SPEC §5.6)."""
        return min(self.checkpoint_steps(), key=lambda s: (abs(s - self.target_step), s))

    def measure_step(self, measure: str) -> int:
        """The step whose behaviour the counterfactual tables report (``counterfactual.measure``):
        "window" = the end of the contamination window (``early_step_cutoff``, capped at the run's
        length), "target" = :meth:`target_checkpoint`, "end" = the run's end, or a step number
        1..steps (e.g. "80": after the window's momentum has decayed).

        Raises:
            ValueError: naming ``counterfactual.measure`` for another value.
        """
        if measure == "window":
            return self.window_steps()
        if measure == "target":
            return self.target_checkpoint()
        if measure == "end":
            return self.steps
        if str(measure).isdigit() and 1 <= int(measure) <= self.steps:
            return int(measure)
        raise ValueError(f"counterfactual.measure: {measure!r}; expected 'window', 'target', 'end' or a step in "
                         f"1..{self.steps}")

    def window_steps(self) -> int:
        """The steps of the first behaviour's window that the run reached: ``min(early_step_cutoff, steps)``."""
        return min(int(self.early_step_cutoff), self.steps)
