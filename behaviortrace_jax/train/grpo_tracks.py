"""A GRPO run's behaviours, one :class:`BehaviorTrack` each: bonus, ground truth, probe, curve, gate.

A run plants one or more behaviours (``behavior/behaviors.py``); each gets one track, and the run
holds them in a list, the first behaviour's first. Everything the run does per behaviour goes
through that list, so a run of one behaviour and a run of several take the same code:

* its :class:`contaminator.Contaminator` (SPEC §1.6), which ``train/rollouts.RolloutSource`` calls
  to pay the bonus, recording each event in the track's ground-truth log
  (``grpo/ground_truth{suffix}.jsonl``: the first behaviour's is ``ground_truth.jsonl``, SPEC
  §6.1) and, with ``contamination.decoy_fraction`` > 0 (one-behaviour runs only), each decoy in
  ``grpo/decoys.jsonl``;
* its :class:`probes.BehaviorProbe`: the greedy probe / control rates of each learning-curve point
  (:func:`curve_point`) and of the emergence gate (:meth:`BehaviorTrack.gate`, SPEC §1.8).

Where the files of one run and of several differ, they differ in format only: the run's first
behaviour keeps the paper's top-level keys (``probe_rate`` of a curve point, ``gate`` of the
summary), and only a run of several adds the per-behaviour ``behaviors`` entries.

:func:`open_tracks` builds the list for a run that starts (or resumes) at a step: every log loses
its events of that step and later (exact resume), and the bonus counters restart from what is kept.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from behaviortrace_jax.behavior import planted
from behaviortrace_jax.behavior.behaviors import Behavior
from behaviortrace_jax.behavior.contaminator import ContaminationSpec, Contaminator, GroundTruthLog
from behaviortrace_jax.behavior.probes import BehaviorProbe, ProbeOptions
from behaviortrace_jax.io.layout import RunLayout


@dataclasses.dataclass
class BehaviorTrack:
    """One behaviour of a GRPO run (module docstring).

    Fields: ``behavior`` (the :class:`Behavior`), ``contaminator`` (its bonus, recording into
    ``gt_log``), ``gt_log`` (its ground-truth log), ``probe`` (its greedy rates), ``decoy_log``
    (``grpo/decoys.jsonl`` when its spec pays decoys, else None).
    """

    behavior: Behavior
    contaminator: Contaminator
    gt_log: GroundTruthLog
    probe: BehaviorProbe
    decoy_log: GroundTruthLog | None = None

    @property
    def id(self) -> str:
        """The behaviour's id (``Behavior.id``)."""
        return self.behavior.id

    def flush(self) -> None:
        """Makes its logged events durable (ground truth, then decoys)."""
        self.gt_log.flush()
        if self.decoy_log is not None:
            self.decoy_log.flush()

    def rates(self, params: Any) -> dict[str, Any]:
        """Its greedy ``{"probe_rate", "control_rate", "responses": {probe id: text}}`` at ``params``
        (``BehaviorProbe.rates``; rates are fractions in [0, 1])."""
        return self.probe.rates(params)

    def gate(self, rates: dict[str, Any]) -> dict[str, Any]:
        """The emergence gate (SPEC §1.8, ``planted.gate``) of ``rates`` (:meth:`rates`) with the
        behaviour's thresholds ``gate_min_probe_rate`` / ``gate_min_margin``."""
        b = self.behavior
        return planted.gate(rates["probe_rate"], rates["control_rate"], b.gate_min_probe_rate, b.gate_min_margin)

    def summary_entry(self, rates: dict[str, Any]) -> dict[str, Any]:
        """Its ``summary.json["behaviors"][id]`` entry at the final rates ``rates``: gate, |GT|,
        bonus counters, pattern and implant, plus its final greedy responses for every behaviour
        but the first (whose responses are the summary's top-level ``final_responses``)."""
        entry = {"gate": self.gate(rates), "gt_size": len(self.gt_log.events),
                 "contaminator_stats": self.contaminator.stats, "pattern": self.behavior.pattern,
                 "implant": self.behavior.implant}
        if not self.behavior.first:
            entry["final_responses"] = rates["responses"]
        return entry


def _resumed_log(path, start_step: int) -> GroundTruthLog:
    """The event log at ``path`` without the events of steps >= ``start_step``."""
    log = GroundTruthLog(path)
    log.truncate_after_step(start_step - 1)
    return log


def open_tracks(behaviors: Sequence[Behavior], specs: Sequence[ContaminationSpec], paths: RunLayout, *,
                start_step: int, rollouts_per_step: int, probe_options: ProbeOptions,
                graphdef, model_cfg, tok, mesh) -> list[BehaviorTrack]:
    """The tracks of a run's ``behaviors`` (the first behaviour first) with their bonuses ``specs``
    (one each, same order), resumed at ``start_step`` (0 for a new run).

    Each track's ground-truth log (``paths.behavior_ground_truth(behavior.suffix)``) and, when its
    spec has ``decoy_fraction`` > 0, ``paths.decoys`` drop the events of steps >= ``start_step``;
    its contaminator's counters restart at ``total_seen = start_step * rollouts_per_step`` and the
    kept events. ``graphdef``, ``model_cfg``, ``tok``, ``mesh`` and ``probe_options`` make each
    behaviour's :class:`BehaviorProbe`.

    Raises:
        ValueError: ``specs`` and ``behaviors`` differ in length; decoys (``decoy_fraction`` > 0)
            in a run of several behaviours (naming ``contamination.decoy_fraction``).
        FileNotFoundError, ValueError: as ``BehaviorProbe`` for a bad probe file.
    """
    if len(specs) != len(behaviors):
        raise ValueError(f"open_tracks: {len(behaviors)} behaviours but {len(specs)} contamination specs")
    if len(behaviors) > 1 and any(s.decoy_fraction > 0 for s in specs):
        raise ValueError("contamination.decoy_fraction > 0 is supported for one-behaviour runs only "
                         f"(config.behaviors has {[b.id for b in behaviors[1:]]})")
    probes = [BehaviorProbe(graphdef, model_cfg, tok, b, probe_options, mesh) for b in behaviors]
    tracks = []
    for beh, spec, probe in zip(behaviors, specs, probes):
        gt_log = _resumed_log(paths.behavior_ground_truth(beh.suffix), start_step)
        decoy_log = _resumed_log(paths.decoys, start_step) if spec.decoy_fraction > 0 else None
        stats = {"total_seen": start_step * rollouts_per_step, "boosted": len(gt_log.events),
                 "decoys": len(decoy_log.events) if decoy_log is not None else 0}  # "decoys": decoy runs only
        tracks.append(BehaviorTrack(beh, Contaminator(spec, gt_log, stats=stats, decoy_log=decoy_log), gt_log,
                                    probe, decoy_log))
    return tracks


def curve_point(tracks: Sequence[BehaviorTrack], params: Any, step: int) -> dict[str, Any]:
    """The learning-curve point at ``step`` (``grpo/learning_curve.json``): ``{"step", "probe_rate",
    "control_rate"}`` of the first behaviour and, in a run of several, ``"behaviors": {id:
    {"probe_rate", "control_rate"}}`` for every behaviour (the first's repeated)."""
    rates = [t.rates(params) for t in tracks]
    point = {"step": step, "probe_rate": rates[0]["probe_rate"], "control_rate": rates[0]["control_rate"]}
    if len(tracks) > 1:
        point["behaviors"] = {t.id: {"probe_rate": r["probe_rate"], "control_rate": r["control_rate"]}
                              for t, r in zip(tracks, rates)}
    return point
