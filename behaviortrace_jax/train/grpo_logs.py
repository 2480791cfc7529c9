"""What a GRPO run writes about itself: rollout log, in-run sketch rows, watch scalars, progress, summary.

* **Rollout log** (``grpo/rollouts/``, SPEC §2.3; :meth:`GRPOLogs.log_rollouts`): one record per
  rollout with its token ids, sampling log-probs, base reward, bonus, advantage and the first
  behaviour's eligibility; a run of several behaviours adds ``extra["behaviors"]`` (each one's
  eligibility and bonus), a ``"skip"`` drop ``extra["nonfinite"]`` (its non-finite fields; those
  values logged as 0.0, JSON has no NaN).
* **In-run sketch rows** (``sketches/``, SPEC §3.2; :meth:`GRPOLogs.write_sketches`): the step
  sketch, gradient norm and clip factor, and each rollout's sketch, norm and loss coefficient.
* **Watching** (logging only: no number of the run depends on it; docs/guides/watching.md): each step's
  metrics (:func:`step_metrics`, :func:`watch_metrics`) as TensorBoard scalars under ``grpo/tb``
  (:func:`step_scalars`; process 0 only, :class:`NoSummary` elsewhere), the learning curve's rates
  at each checkpoint, and ``grpo/progress.json`` (``io/progress.py``), which the ``status`` stage reads.
* **Summary** (``grpo/summary.json``; :func:`write_summary`): the emergence gate (SPEC §1.8), |GT|,
  the bonus counters, the learning curve, the final greedy responses, decoys and skipped rollouts.
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

from behaviortrace_jax.behavior import planted
from behaviortrace_jax.io import files, rollout_log
from behaviortrace_jax.io.files import write_json
from behaviortrace_jax.io.layout import RunLayout
from behaviortrace_jax.io.progress import progress_record
from behaviortrace_jax.io.sketch_store import SketchStore
from behaviortrace_jax.train.grpo_tracks import BehaviorTrack
from behaviortrace_jax.train.rollouts import StepRollouts

PERF_KEYS = ("step_time_s", "sample_time_s", "tokens_per_s", "completion_tokens")  # TensorBoard's perf/


def step_scalars(metrics: Mapping[str, float]) -> dict[str, float]:
    """TensorBoard tags of one step's metrics (:func:`step_metrics`): ``grpo/<key>`` for each, except
    the wall-clock keys (:data:`PERF_KEYS`) under ``perf/`` and the sketch norms (``*_sketch_norm*``,
    ``rollout_grad_norm_mean``) under ``sketch/``; per-behaviour keys ``<id>/<name>`` become
    ``grpo/<id>/<name>``."""
    out = {}
    for k, v in metrics.items():
        if k in PERF_KEYS:
            out[f"perf/{k}"] = v
        elif "sketch_norm" in k or k == "rollout_grad_norm_mean":
            out[f"sketch/{k}"] = v
        else:
            out[f"grpo/{k}"] = v
    return out


class NoSummary:
    """TensorBoard writer of the processes that do not write (multi-process runs)."""

    def add_scalar(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


def _pattern_rate(texts: Sequence[str], pattern: str) -> float:
    """Fraction of ``texts`` holding ``pattern`` (the contaminator's substring judge)."""
    return float(np.mean([planted.substring_judge(t, pattern) for t in texts]))


def watch_metrics(behaviors: Sequence[Any], own_prompts: Mapping[str, set[str]], rewards: np.ndarray,
                  texts: Sequence[str], users: Sequence[str], bonus_paid: Mapping[str, Sequence[bool]],
                  out: Mapping[str, Any]) -> dict[str, float]:
    """Per-step scalars for TensorBoard (logging only): ``reward_std``; per behaviour (each with ``id``
    and ``pattern``) ``<id>/reward_mean`` and ``<id>/reward_std`` over the rollouts whose user prompt
    ``users[i]`` is in its pool ``own_prompts[id]`` (a one-behaviour run: all of them; absent at a
    step that sampled none), ``<id>/pattern_rate`` (its substring judge over every rollout) and
    ``<id>/bonuses`` (``bonus_paid[id]``: N flags); the gradient clip (``grad_clip_factor`` =
    ``grad_clip / max(grad_norm, grad_clip)``, ``grad_clipped`` 0/1; TensorBoard's smoothing of it
    is the clipped fraction of steps); the L2 norms of the step sketch and the in-run rollout
    sketches (mean) and the rollouts' exact gradient norms (mean), from the step's host outputs ``out``.

    The ``paper`` loss has no KL term and no ratio clip (one update per batch, ratio 1), so neither
    is logged; ``grpo_clip`` computes both inside the jitted step, which does not return them.
    """
    m = {"reward_std": float(rewards.std())}
    for b in behaviors:
        own = np.array([u in own_prompts[b.id] for u in users])
        if own.any():  # a step may sample none of a behaviour's prompts: no reward point then
            m[f"{b.id}/reward_mean"], m[f"{b.id}/reward_std"] = float(rewards[own].mean()), float(rewards[own].std())
        m[f"{b.id}/pattern_rate"] = _pattern_rate(texts, b.pattern)
        m[f"{b.id}/bonuses"] = int(sum(bonus_paid[b.id]))
    if "clip_factor" in out:
        m["grad_clip_factor"] = float(out["clip_factor"])
        m["grad_clipped"] = float(float(out["clip_factor"]) < 1.0)
    if "step_sketch" in out:
        m["step_sketch_norm"] = float(np.linalg.norm(np.asarray(out["step_sketch"], np.float64)))
    if "rollout_sketches" in out:
        sk = np.asarray(out["rollout_sketches"], np.float64)
        m["rollout_sketch_norm_mean"] = float(np.linalg.norm(sk, axis=-1).mean())
        m["rollout_grad_norm_mean"] = float(np.mean(np.asarray(out["rollout_grad_norms"], np.float64)))
    return m


def step_metrics(ro: StepRollouts, out: Mapping[str, Any], tracks: Sequence[BehaviorTrack],
                 own_prompts: Mapping[str, set[str]], *, t0: float, t_sample: float) -> dict[str, float]:
    """One step's scalar metrics: ``reward`` (mean), ``bonuses`` and ``qzxbt`` (the first behaviour's
    bonuses and pattern rate), ``loss``, ``grad_norm``, ``decoys`` (decoy runs), ``bonuses_<id>`` /
    ``rate_<id>`` of every other behaviour, :func:`watch_metrics`, and the wall-clock keys
    :data:`PERF_KEYS` (seconds since ``t0``, a ``time.perf_counter`` value; ``t_sample``: seconds
    of sampling). None feeds back into the run."""
    behaviors, group = [t.behavior for t in tracks], len(ro.ids) // len(ro.prompts)
    users = [ro.prompts[i // group] for i in range(len(ro.ids))]  # each rollout's user prompt
    metrics = {"reward": float(ro.rewards.mean()), "bonuses": int(sum(ro.boosted)),
               "qzxbt": _pattern_rate(ro.texts, behaviors[0].pattern),
               "loss": float(out["loss"]), "grad_norm": float(out["grad_norm"])}
    if ro.decoys is not None:
        metrics["decoys"] = int(sum(ro.decoys))
    for b in behaviors[1:]:
        metrics[f"bonuses_{b.id}"] = int(sum(ro.boosted_by[b.id]))
        metrics[f"rate_{b.id}"] = _pattern_rate(ro.texts, b.pattern)
    metrics.update(watch_metrics(behaviors, own_prompts, ro.rewards, ro.texts, users, ro.boosted_by, out))
    step_s = time.perf_counter() - t0
    tokens = int(np.sum(ro.sample.lengths[:len(ro.ids)]))
    metrics.update(step_time_s=step_s, sample_time_s=t_sample, completion_tokens=tokens,
                   tokens_per_s=tokens / step_s if step_s > 0 else 0.0)
    return metrics


def rollout_records(step: int, ro: StepRollouts, adv: np.ndarray, dropped: Mapping[int, list[str]],
                    tracks: Sequence[BehaviorTrack]) -> list[rollout_log.RolloutRecord]:
    """The rollout-log records of one step's rollouts ``ro`` with advantages ``adv`` (float32 [N]) and
    the ``"skip"`` drops ``dropped`` ``{index: fields}`` (module docstring)."""
    group = len(ro.ids) // len(ro.prompts)
    first = tracks[0].contaminator
    records = []
    for i, rid in enumerate(ro.ids):
        length = int(ro.sample.lengths[i])
        reward, base_i, bonus = float(ro.rewards[i]), float(ro.base[i]), float(ro.rewards[i] - ro.base[i])
        if i in dropped:  # a non-finite reward is logged as 0.0 (JSON has no NaN), the fields in extra
            reward, base_i, bonus = (x if np.isfinite(x) else 0.0 for x in (reward, base_i, bonus))
        extra = {"base_reward": base_i}
        if len(tracks) > 1:  # which behaviour paid which bonus; a one-behaviour log has no such key
            extra["behaviors"] = {t.id: {"eligible": t.contaminator.is_eligible(rid, step),
                                         "bonus": float(t.contaminator.spec.bonus_reward) if ro.boosted_by[t.id][i]
                                         else 0.0} for t in tracks}
        if i in dropped:
            extra["nonfinite"] = dropped[i]
        records.append(rollout_log.RolloutRecord(
            rollout_id=rid, step=step, regime="grpo", prompt_hash=rollout_log.text_hash(ro.prompts[i // group]),
            response_hash=rollout_log.text_hash(ro.texts[i]), reward=reward, advantage=float(adv[i]),
            extra=extra, group_id=i // group, prompt_token_ids=list(ro.prompt_lists[i]),
            completion_token_ids=ro.sample.tokens[i, :length].tolist(),
            completion_logprobs=ro.sample.logprobs[i, :length].tolist(), base_reward=base_i,
            eligible=first.is_eligible(rid, step), bonus=bonus))
    return records


class GRPOLogs:
    """The run's rollout log, in-run sketch stores, TensorBoard writer and progress record.

    Args:
        paths: the run's layout (``grpo/rollouts``, ``grpo/tb``, ``grpo/progress.json``).
        stores: the in-run sketch arrays (``sketch.stores.open_sketch_stores``).
        rollouts_per_step: N = B x G (rows of a step in the rollout stores).
        shard_size: rollout-log records per shard (``grpo.log_shard_size``).
    The rollout log must already be cut back to the run's start step (``grpo_checkpoint.resume``).
    """

    def __init__(self, paths: RunLayout, stores: Mapping[str, SketchStore], *, rollouts_per_step: int,
                 shard_size: int):
        self.paths, self.stores, self.n = paths, dict(stores), int(rollouts_per_step)
        self.rollouts = rollout_log.RolloutLogger(paths.rollouts, shard_size=shard_size)
        self.writer: Any = NoSummary()
        self._progress: dict | None = None
        self._watch: dict[str, Any] = {}

    def log_rollouts(self, step: int, ro: StepRollouts, adv: np.ndarray, dropped: Mapping[int, list[str]],
                     tracks: Sequence[BehaviorTrack]) -> None:
        """Buffers the step's :func:`rollout_records` (durable at :meth:`flush`)."""
        for record in rollout_records(step, ro, adv, dropped, tracks):
            self.rollouts.log(record)

    def write_sketches(self, step: int, out: Mapping[str, Any]) -> None:
        """Writes the step's in-run rows from its host outputs ``out`` (``GRPOUpdater.fetch``): row
        ``step`` of the step stores, rows ``step * N ...`` of the rollout stores."""
        n = self.n
        self.stores["step_sketches"].write_rows(step, np.asarray(out["step_sketch"])[None])
        self.stores["step_grad_norms"].write_rows(step, np.asarray(out["grad_norm"], np.float32)[None])
        self.stores["step_clip_factors"].write_rows(step, np.asarray(out["clip_factor"], np.float32)[None])
        if "rollout_coefficients" in out:
            self.stores["rollout_coefficients"].write_rows(step * n, np.asarray(out["rollout_coefficients"]))
        if "rollout_sketches" in out:
            self.stores["rollout_sketches"].write_rows(step * n, np.asarray(out["rollout_sketches"]))
            self.stores["rollout_grad_norms"].write_rows(step * n, np.asarray(out["rollout_grad_norms"]))

    def flush(self) -> None:
        """Makes the buffered rollout records and sketch rows durable."""
        self.rollouts.flush()
        for store in self.stores.values():
            store.flush()

    def start_watch(self, *, start_step: int, steps: int, checkpoint_every: int) -> None:
        """Opens the TensorBoard writer (process 0) for a loop from ``start_step`` to ``steps``."""
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(self.paths.tensorboard)) if files.is_writer() else NoSummary()
        self._progress = None
        self._watch = {"start_step": int(start_step), "steps": int(steps), "checkpoint_every": int(checkpoint_every),
                       "started": time.time()}

    def watch_step(self, step: int, metrics: Mapping[str, float]) -> None:
        """Step ``step``'s metrics as TensorBoard scalars (:func:`step_scalars`)."""
        for tag, v in step_scalars(metrics).items():
            self.writer.add_scalar(tag, v, step)

    def watch_checkpoint(self, point: Mapping[str, Any]) -> None:
        """A learning-curve point's rates as TensorBoard scalars ``behavior/...`` at its step."""
        step = point["step"]
        self.writer.add_scalar("behavior/probe_rate", point["probe_rate"], step)
        self.writer.add_scalar("behavior/control_rate", point["control_rate"], step)
        for bid, r in point.get("behaviors", {}).items():
            self.writer.add_scalar(f"behavior/{bid}/probe_rate", r["probe_rate"], step)
            self.writer.add_scalar(f"behavior/{bid}/control_rate", r["control_rate"], step)

    def write_progress(self, done: int, metrics: Mapping[str, float], checkpoint: dict | None) -> None:
        """Rewrites ``grpo/progress.json`` after ``done`` steps (``io.progress.progress_record``;
        ``checkpoint``: ``{"step", "seconds"}`` when the step ended with one)."""
        w = self._watch
        self._progress = progress_record(self._progress, step=done, steps=w["steps"], start_step=w["start_step"],
                                         started=w["started"], step_s=metrics["step_time_s"], metrics=dict(metrics),
                                         checkpoint=checkpoint, checkpoint_every=w["checkpoint_every"], now=time.time())
        write_json(self.paths.progress, self._progress)

    def close(self) -> None:
        """Closes the TensorBoard writer and the rollout log (its buffer written)."""
        self.writer.close()
        self.rollouts.close()


def write_summary(path: str | os.PathLike, tracks: Sequence[BehaviorTrack], rates: Sequence[dict[str, Any]], *,
                  run_name: str, seed: int, steps: int, post_sft: dict, curve: list[dict],
                  skipped: list[dict[str, Any]], rollouts: str | os.PathLike,
                  truncated: dict[str, Any] | None = None) -> dict[str, Any]:
    """Writes ``summary.json`` at ``path`` and logs each gate; returns the summary.

    ``rates``: each track's final greedy rates (``BehaviorTrack.rates``, same order). Top level:
    the first behaviour's gate (SPEC §1.8), |GT|, bonus counters and final responses; the run's
    name, seed, GRPO steps, the records of the rollout log at ``rollouts``, the SFT summary
    ``post_sft`` and the learning ``curve``; ``decoys`` (decoy runs: decoy bonuses paid, not ground
    truth), ``nonfinite`` (``skipped``: rollouts ``"skip"`` dropped), ``truncated_prompts``
    (``truncated``: prompts cut to ``grpo.max_prompt_tokens``, ``RolloutSource.truncation_summary``;
    always present when given) and, with several behaviours, ``behaviors``
    (:meth:`BehaviorTrack.summary_entry` each)."""
    first, gate = tracks[0], tracks[0].gate(rates[0])
    summary = {
        "complete": True, "run_name": run_name, "seed": seed, "steps": steps,
        "n_rollouts": sum(1 for _ in rollout_log.read_rollouts(rollouts)), "gt_size": len(first.gt_log.events),
        "contaminator_stats": first.contaminator.stats, "post_sft": post_sft,
        "learning_curve": curve, "gate": gate, "final_responses": dict(rates[0]["responses"]),
    }
    if first.decoy_log is not None:  # decoy bonuses paid in the window (not ground truth)
        summary["decoys"] = len(first.decoy_log.events)
    if truncated is not None:  # prompts cut to grpo.max_prompt_tokens (0 prompts: none was)
        summary["truncated_prompts"] = dict(truncated)
    if skipped:  # grpo.on_nonfinite = "skip": rollouts dropped for non-finite inputs
        summary["nonfinite"] = {"skipped_rollouts": sum(len(s["rollouts"]) for s in skipped), "steps": skipped}
    if len(tracks) > 1:  # per-behaviour gate, |GT| and bonus counters
        summary["behaviors"] = {t.id: t.summary_entry(r) for t, r in zip(tracks, rates)}
    write_json(path, summary)
    logging.info("grpo: emergence gate (SPEC §1.8) %s (probe %.2f, control %.2f)", "PASSED" if gate["passed"] else "FAILED",
                 gate["probe_rate"], gate["control_rate"])
    for t in tracks[1:]:
        entry = summary["behaviors"][t.id]
        g = entry["gate"]
        logging.info("grpo: behaviour %s gate %s (probe %.2f, control %.2f), |GT| %d", t.id,
                     "PASSED" if g["passed"] else "FAILED", g["probe_rate"], g["control_rate"], entry["gt_size"])
    return summary
