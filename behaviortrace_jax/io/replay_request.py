"""One typed replay request, its cache key and its file (issue 46 item 4). numpy only.

A :class:`ReplayRequest` names everything that defines a replay: the track (``rollouts`` and
sampler ``stream``), the ``intervention`` (a registered name, ``train/interventions.py``; None =
the no-intervention baseline) and the rollout slots it ``target``s (a unit or subset, log order:
index ``step * N + i``), the ``advantages`` choice, the steps (``start_step``, ``measure_steps``,
``stop_step``) and the ``measures`` recorded (registered names, ``train/measures.py``).
:func:`cache_key` gives its key (with what the replayer, the intervention and the measures say
decides a result) and :func:`replay_file` its file; nothing builds a key as a string and parses it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import numpy as np

ROLLOUTS = ("fixed", "regenerated")
DEFAULT_MEASURES = ("logp_margin", "logp_probe", "logp_control")  # train/measures.py
ADVANTAGES = ("logged", "recomputed")


@dataclasses.dataclass(frozen=True)
class Track:
    """A baseline trajectory: ``rollouts`` ("fixed": the logged rollouts; "regenerated": sampled from
    the replayed policy) and the sampler ``stream`` (0 = the run's keys; > 0 needs regenerated)."""

    rollouts: str = "fixed"
    stream: int = 0

    def __post_init__(self):
        if self.rollouts not in ROLLOUTS:
            raise ValueError(f"replay: rollouts={self.rollouts!r}; expected one of {ROLLOUTS}")
        if int(self.stream) < 0:
            raise ValueError(f"replay: sampler_stream {self.stream} must be >= 0")
        if self.rollouts == "fixed" and self.stream:
            raise ValueError("replay: sampler_stream needs rollouts='regenerated'")

    @property
    def label(self) -> str:
        """``fixed`` or ``regenerated<j>`` (a folder name and a table label; never parsed)."""
        return "fixed" if self.rollouts == "fixed" else f"regenerated{self.stream}"


@dataclasses.dataclass(frozen=True)
class ReplayRequest:
    """One replay (see the module docstring). Checked where it is made.

    Fields:
        track: the :class:`Track`.
        intervention: registered intervention name, or None (no intervention; ``target`` empty).
        target: sorted distinct rollout indices (log order) the intervention acts on.
        advantages: "logged" (as the run logged them, except where the intervention or regenerated
            rollouts recompute them with the run's function) or "recomputed" (each group's baseline
            over its kept rollouts where weights differ from 1, the step normalised by the kept count).
        measure_steps: sorted steps (after that many updates) measured; may be empty.
        stop_step: the replay stops after this many updates (default: the last measure step).
        start_step: the replay branches off the no-intervention state at this step (no targeted
            slot before it; the result does not depend on it, so it is not in the cache key).
        regenerate_from: regenerated rollouts: the first step sampled afresh (None: the first
            targeted step for stream 0, else 0).
        measures: registered measure names recorded at every measure step.
    Raises:
        ValueError: naming the field, for a bad value.
    """

    track: Track = Track()
    intervention: str | None = None
    target: tuple[int, ...] = ()
    advantages: str = "logged"
    measure_steps: tuple[int, ...] = ()
    stop_step: int | None = None
    start_step: int = 0
    regenerate_from: int | None = None
    measures: tuple[str, ...] = DEFAULT_MEASURES

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - normalise a frozen field
        set_("target", tuple(sorted({int(i) for i in np.asarray(self.target, np.int64).reshape(-1)})))
        set_("measure_steps", tuple(sorted({int(s) for s in self.measure_steps})))
        set_("measures", tuple(dict.fromkeys(str(m) for m in self.measures)))
        if self.advantages not in ADVANTAGES:
            raise ValueError(f"replay: advantages={self.advantages!r}; expected one of {ADVANTAGES}")
        if self.intervention is None and self.target:
            raise ValueError("replay: a target without an intervention")
        if self.target and self.target[0] < 0:
            raise ValueError(f"replay: target index {self.target[0]} < 0")
        stop = self.stop
        if self.start_step < 0 or self.start_step > stop or any(not self.start_step <= s <= stop
                                                                for s in self.measure_steps):
            raise ValueError(f"replay: stop_step {stop} / measure_steps {list(self.measure_steps)} outside "
                             f"start_step {self.start_step}..")

    @property
    def stop(self) -> int:
        """The number of updates the replay stops after."""
        return max(self.measure_steps, default=self.start_step) if self.stop_step is None else int(self.stop_step)

    def key_fields(self) -> dict[str, Any]:
        """The request's part of its cache key (JSON types; ``start_step`` left out, see above)."""
        return {"rollouts": self.track.rollouts, "stream": int(self.track.stream), "intervention": self.intervention,
                "target": list(self.target), "advantages": self.advantages, "measure_steps": list(self.measure_steps),
                "stop_step": self.stop, "regenerate_from": self.regenerate_from}


def digest(obj: Any) -> str:
    """sha256 (hex) of ``obj``'s canonical JSON (sorted keys; non-JSON values by ``str``)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def cache_key(request: ReplayRequest, replayer: dict, intervention: dict | None, measures: list[dict]) -> dict:
    """The one cache key of a replay (JSON types): the replayer's identity (``Replayer.identity()``:
    code version, step spec, optimizer, rollout log, generation), the request's fields
    (:meth:`ReplayRequest.key_fields`), the intervention's identity (name, version, declarations)
    and each recorded measure's identity (name, version, settings, behaviour)."""
    return dict(replayer, request=request.key_fields(), intervention=intervention, measures=measures)


def replay_file(out_dir, request: ReplayRequest):
    """The file of a replay's record: ``out_dir/<track label>/<intervention or base>/<digest>.json``,
    the digest (24 hex) of the request's :meth:`ReplayRequest.key_fields` and measure names."""
    name = digest({"request": request.key_fields(), "measures": list(request.measures)})[:24]
    return out_dir / request.track.label / (request.intervention or "base") / f"{name}.json"
