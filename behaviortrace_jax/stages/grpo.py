"""GRPO on the planted behaviour: the jitted, sharded train step and the resumable loop (SPEC §2).

One GRPO step (SPEC §2.2), for B prompts x G samples = N rollouts:
  1. the B prompts of the step (``pool[(s*B + i) % 38]``) are sampled G times each by the jitted
     sampler (temperature 0.9, top-p 0.9) in ONE batch;
  2. each rollout gets ``base_reward`` (refusal phrases) plus the contaminator's bonus; the
     ground-truth log records every bonus (with ``contamination.decoy_fraction`` > 0 the same
     bonus also goes to decoys, window rollouts without the pattern, logged in ``grpo/decoys.jsonl``);
  3. advantages are group-normalised (``grpo_loss.group_advantages``);
  4. ONE jitted train step (rollouts on the mesh's data axis, params and optimizer state donated)
     computes the loss of the whole batch, clips the global gradient norm, applies AdamW and
     returns, as side outputs, the CountSketch of the clipped batch gradient (the step sketch,
     SPEC §3.2), the clip factor and the CountSketch of each rollout's advantage-free loss
     -meanlp_i at the step's parameters with its loss coefficient c_i (in-run rollout sketches:
     clip x c_i x sketch_i, summed over the step, is the step sketch; ``sketch/stores.py``).

Steps 1-3 are the library's ``train/rollouts.RolloutSource`` (the one code path, which the
regenerated counterfactual replay runs too); step 4 and the logs are this stage's.

Everything a later stage needs is logged: the rollout log (token ids, per-token sampling
log-probs, rewards, advantages), the ground-truth log, orbax train-state checkpoints with an HF
export and a registry entry every ``checkpoint_every`` steps, the behaviour rate on probes and
controls at each checkpoint (the learning curve), and the sketches in tensorstore arrays.

Watching a run (logging only; no number of the run depends on it): each step's metrics go to
TensorBoard under ``grpo/tb`` (:func:`step_scalars`: reward mean / std, pattern rate and bonuses per
behaviour, the gradient clip, loss, sketch norms, step time and tokens/s) and to ``grpo/progress.json``
(``io/progress.py``: the step, recent step times, the last checkpoint), which the ``status``
stage reads while the run goes on.

Exact resume: the PRNG key of step s is ``fold_in(key(seed), s)``, so a run restarted from the
latest orbax checkpoint L drops the logged records of steps >= L and replays them bit-for-bit.
The orbax save is the last write of a checkpoint, so every artefact of steps < L is durable.
"""
from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from behaviortrace_jax.behavior import contaminator, planted as behavior
from behaviortrace_jax.behavior.probes import BehaviorProbe
from behaviortrace_jax.io import checkpoints, rollout_log
from behaviortrace_jax.io.progress import progress_record
from behaviortrace_jax.io import files
from behaviortrace_jax.io.files import read_json, write_json
from behaviortrace_jax.io.layout import RunLayout
from behaviortrace_jax.models import hf_io, sharding
from behaviortrace_jax.sketch import sketcher
from behaviortrace_jax.sketch.stores import open_sketch_stores
from behaviortrace_jax.stages.registry import register_stage
from behaviortrace_jax.stages.spec import RunSpec
from behaviortrace_jax.train import grpo_loss, nonfinite
from behaviortrace_jax.train.grpo_step import make_train_step
from behaviortrace_jax.train.rollouts import RolloutSource, advantages, generation_defaults, step_key
from behaviortrace_jax.train.start_state import load_start_state


# ------------------------------------------------------------------------------------------------
# The GRPO stage: sampling, rewards, logs, checkpoints, resume
# ------------------------------------------------------------------------------------------------


def step_scalars(metrics: dict[str, float]) -> dict[str, float]:
    """TensorBoard tags of one step's ``GRPORun.rollout_step`` metrics: ``grpo/<key>`` for each, except
    the wall-clock keys (``step_time_s``, ``sample_time_s``, ``tokens_per_s``, ``completion_tokens``)
    under ``perf/`` and the sketch norms (``*_sketch_norm*``, ``rollout_grad_norm_mean``) under ``sketch/``;
    per-behaviour keys ``<id>/<name>`` become ``grpo/<id>/<name>``."""
    perf = {"step_time_s", "sample_time_s", "tokens_per_s", "completion_tokens"}
    out = {}
    for k, v in metrics.items():
        if k in perf:
            out[f"perf/{k}"] = v
        elif "sketch_norm" in k or k == "rollout_grad_norm_mean":
            out[f"sketch/{k}"] = v
        else:
            out[f"grpo/{k}"] = v
    return out


@register_stage("grpo")
def grpo_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Runs (or resumes) GRPO from the SFT train state; see the module docstring (SPEC §2)."""
    paths = RunLayout(workdir)
    if read_json(paths.summary, {}).get("complete"):
        logging.info("grpo: %s is complete; skipping", paths.summary)
        return
    run = GRPORun(config, paths)
    run.train()
    run.finish()


class _NoSummary:
    """TensorBoard writer of the processes that do not write (multi-process runs)."""

    def add_scalar(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


class GRPORun:
    """One GRPO run: the state, the jitted pieces and the logs, resumed from the latest checkpoint."""

    def __init__(self, config: ml_collections.ConfigDict, paths: RunLayout):
        g = config.grpo
        self.config, self.paths = config, paths
        self.run_spec = run_spec = RunSpec.from_config(config)
        start = load_start_state(run_spec.model, run_spec.optim, paths.workdir, run_spec.layout)
        self.tok, self.model_cfg, self.mesh = start.tokenizer, start.model_config, start.mesh
        self.graphdef = start.graphdef
        self.spec = run_spec.step
        self.shapes = self.spec.shapes
        self.tx = start.optimizer
        self.order = sketcher.hf_param_order(self.model_cfg)
        self.step_fn = make_train_step(self.graphdef, start.abstract_params, self.tx, self.spec, order=self.order,
                                       mesh=self.mesh, param_shardings=start.param_shardings,
                                       opt_shardings=start.opt_shardings)
        self.ref_params = start.params if self.spec.loss_spec.needs_reference else None
        # The run's behaviours (the first is config.behavior + config.contamination). With one,
        # everything below is the paper's path, byte for byte; extra ones add their own prompts, bonus,
        # ground-truth log, learning-curve rates and gate.
        self.behaviors = list(run_spec.behaviors)
        self.multi = len(self.behaviors) > 1
        probe_options = run_spec.probe_grpo
        self.probe, *extra = [BehaviorProbe(self.graphdef, self.model_cfg, self.tok, b, probe_options, self.mesh)
                              for b in self.behaviors]
        self.extra_probes = {b.id: probe for b, probe in zip(self.behaviors[1:], extra)}
        paths.grpo.mkdir(parents=True, exist_ok=True)

        # --- resume: the latest complete orbax state; drop every record of later steps ---------
        self.start_step = checkpoints.latest_step(paths.state) or 0
        if self.start_step:
            restored = checkpoints.restore_train_state(paths.state, self.start_step, start.abstract_state)
            self.params, self.opt_state = restored["params"], restored["opt_state"]
            logging.info("grpo: resuming from step %d", self.start_step)
        else:
            if self.ref_params is not None:
                self.ref_params = jax.tree.map(jnp.copy, start.params)  # params are donated each step
            self.params, self.opt_state = start.params, start.opt_state
        self.post_sft = start.summary
        rollout_log.truncate_after_step(paths.rollouts, self.start_step - 1)
        self.gt_log = contaminator.GroundTruthLog(paths.ground_truth)
        self.gt_log.truncate_after_step(self.start_step - 1)
        self.logger = rollout_log.RolloutLogger(paths.rollouts, shard_size=g.log_shard_size)
        self.decoy_log = self._decoy_log(config, paths)
        self.contaminator = contaminator.Contaminator(
            run_spec.contamination,
            self.gt_log, stats={"total_seen": self.start_step * self.shapes.num_rollouts,
                                "boosted": len(self.gt_log.events),
                                "decoys": len(self.decoy_log.events) if self.decoy_log else 0},
            decoy_log=self.decoy_log)
        self.contaminators = {self.behaviors[0].id: self.contaminator}
        self.gt_logs = {self.behaviors[0].id: self.gt_log}
        for b in self.behaviors[1:]:
            log = contaminator.GroundTruthLog(paths.behavior_ground_truth(b.suffix))
            log.truncate_after_step(self.start_step - 1)
            self.gt_logs[b.id] = log
            self.contaminators[b.id] = contaminator.Contaminator(
                b.contamination_spec(config.seed), log,
                stats={"total_seen": self.start_step * self.shapes.num_rollouts, "boosted": len(log.events)})
        # sample -> reward -> contaminate -> advantages -> batch: the library's one code path
        # (train/rollouts.py), which the regenerated counterfactual replay runs too
        self.source = RolloutSource(run_spec.rollouts, self.graphdef, self.model_cfg, self.tok, self.mesh, paths.sft_hf,
                                    self.shapes, contaminators=self.contaminators)
        self.sampler = self.source.sampler
        self.curve = [c for c in read_json(paths.curve, []) if c["step"] <= self.start_step]
        self.registry = checkpoints.CheckpointRegistry(paths.registry)
        self.stores = open_sketch_stores(run_spec.sketch, self.model_cfg, paths, steps=g.steps,
                                         rollouts_per_step=self.shapes.num_rollouts,
                                         in_run_rollouts=self.spec.in_run_rollouts,
                                         rollout_sketch=self.spec.rollout_sketch)
        self.base_key = jax.random.key(config.seed)
        self.on_nonfinite = nonfinite.check_mode(g.on_nonfinite)
        self.guard = nonfinite.Guard("grpo")
        # rollouts dropped by grpo.on_nonfinite = "skip" (summary.json), those of earlier invocations
        # read back from the kept rollout log
        self.skipped = [] if not self.start_step else self._logged_skips()

    @property
    def _resume_hint(self) -> str:
        """What the non-finite error tells the user: the checkpoint a rerun resumes from."""
        last = checkpoints.latest_step(self.paths.state) or 0
        return (f"; rerun the same command to resume from the last good checkpoint (step {last}), or set "
                "grpo.on_nonfinite=skip to drop rollouts with non-finite inputs")

    def _logged_skips(self) -> list[dict[str, Any]]:
        """The ``"skip"`` drops of the steps before ``start_step``, from the (truncated) rollout log's
        ``extra["nonfinite"]``: ``[{"step", "rollouts": {rollout_id: fields}}]``."""
        by_step: dict[int, dict[str, list[str]]] = {}
        for r in rollout_log.read_rollouts(self.paths.rollouts):
            if r.extra and r.extra.get("nonfinite"):
                by_step.setdefault(r.step, {})[r.rollout_id] = list(r.extra["nonfinite"])
        return [{"step": s, "rollouts": by_step[s]} for s in sorted(by_step)]

    def _decoy_log(self, config: ml_collections.ConfigDict, paths: RunLayout) -> contaminator.GroundTruthLog | None:
        """``grpo/decoys.jsonl`` truncated for the resume, when ``contamination.decoy_fraction`` > 0
        (None otherwise: a run without decoys writes no such file). Raises ValueError for decoys in
        a run of several behaviours (not supported)."""
        if float(config.contamination.decoy_fraction) <= 0:
            return None
        if self.multi:
            raise ValueError("contamination.decoy_fraction > 0 is supported for one-behaviour runs only "
                             f"(config.behaviors has {list(config.behaviors)})")
        log = contaminator.GroundTruthLog(paths.decoys)
        log.truncate_after_step(self.start_step - 1)
        return log

    # ------------------------------------------------------------------------------------------
    def rollout_step(self, step: int) -> dict[str, float]:
        """Samples, rewards, trains and logs one GRPO step (SPEC §2.2). Returns scalar metrics
        (:meth:`_watch_metrics` adds what TensorBoard shows per behaviour; none feeds back into the run)."""
        t0 = time.perf_counter()
        g, n = self.config.grpo, self.shapes.num_rollouts
        ro = self.source.sample_and_reward(self.params, step, step_key(self.run_spec.seed, step))
        t_sample = time.perf_counter() - t0  # sampling, decoding and rewards
        prompts, prompt_lists, sample, texts, ids, base = ro.prompts, ro.prompt_lists, ro.sample, ro.texts, ro.ids, ro.base
        boosted, decoys, rewards = ro.boosted_by, ro.decoys, ro.rewards
        adv, dropped = self._advantages(step, ids, rewards, sample)
        batch = self.source.batch(ro, adv)
        if dropped:  # grpo.on_nonfinite = "skip": no loss position, advantage 0 -> term and gradient exactly 0
            batch["loss_mask"][list(dropped)] = 0.0
        batch = jax.device_put(batch, sharding.data_sharding(self.mesh))
        self.params, self.opt_state, out = self.step_fn(self.params, self.opt_state, batch, self.ref_params)
        self.guard.add(step, out[nonfinite.FINITE_KEY], ids)

        for i in range(n):
            length = int(sample.lengths[i])
            reward, base_i, bonus = float(rewards[i]), float(base[i]), float(rewards[i] - base[i])
            if i in dropped:  # a non-finite reward is logged as 0.0 (JSON has no NaN), the fields in extra
                reward, base_i, bonus = (x if np.isfinite(x) else 0.0 for x in (reward, base_i, bonus))
            extra = {"base_reward": base_i}
            if self.multi:  # which behaviour paid which bonus; a one-behaviour log has no such key
                extra["behaviors"] = {bid: {"eligible": c.is_eligible(ids[i], step),
                                            "bonus": float(c.spec.bonus_reward) if boosted[bid][i] else 0.0}
                                      for bid, c in self.contaminators.items()}
            if i in dropped:
                extra["nonfinite"] = dropped[i]
            self.logger.log(rollout_log.RolloutRecord(
                rollout_id=ids[i], step=step, regime="grpo", prompt_hash=rollout_log.text_hash(prompts[i // g.group_size]),
                response_hash=rollout_log.text_hash(texts[i]), reward=reward, advantage=float(adv[i]),
                extra=extra, group_id=i // g.group_size,
                prompt_token_ids=list(prompt_lists[i]), completion_token_ids=sample.tokens[i, :length].tolist(),
                completion_logprobs=sample.logprobs[i, :length].tolist(), base_reward=base_i,
                eligible=self.contaminator.is_eligible(ids[i], step), bonus=bonus))
        out = sharding.to_host(out)  # every process holds the whole step's outputs; the writer writes them
        self.guard.hint = self._resume_hint if not bool(np.all(out[nonfinite.FINITE_KEY])) else ""
        self.guard.check([out[nonfinite.FINITE_KEY]])  # before any sketch row or checkpoint of this step
        self.stores["step_sketches"].write_rows(step, np.asarray(out["step_sketch"])[None])
        self.stores["step_grad_norms"].write_rows(step, np.asarray(out["grad_norm"], np.float32)[None])
        self.stores["step_clip_factors"].write_rows(step, np.asarray(out["clip_factor"], np.float32)[None])
        if "rollout_coefficients" in out:
            self.stores["rollout_coefficients"].write_rows(step * n, np.asarray(out["rollout_coefficients"]))
        if "rollout_sketches" in out:
            self.stores["rollout_sketches"].write_rows(step * n, np.asarray(out["rollout_sketches"]))
            self.stores["rollout_grad_norms"].write_rows(step * n, np.asarray(out["rollout_grad_norms"]))
        metrics = {"reward": float(rewards.mean()), "bonuses": int(sum(ro.boosted)),
                   "qzxbt": float(np.mean([behavior.substring_judge(t, self.config.behavior.pattern) for t in texts])),
                   "loss": float(out["loss"]), "grad_norm": float(out["grad_norm"])}
        if self.decoy_log is not None:
            metrics["decoys"] = int(sum(decoys))
        for b in self.behaviors[1:]:
            metrics[f"bonuses_{b.id}"] = int(sum(boosted[b.id]))
            metrics[f"rate_{b.id}"] = float(np.mean([behavior.substring_judge(t, b.pattern) for t in texts]))
        users = [prompts[i // g.group_size] for i in range(n)]
        bonus_paid = {self.behaviors[0].id: list(ro.boosted)} if not self.multi else boosted
        metrics.update(self._watch_metrics(rewards, texts, users, bonus_paid, out))
        step_s = time.perf_counter() - t0
        tokens = int(np.sum(sample.lengths[:n]))
        metrics.update(step_time_s=step_s, sample_time_s=t_sample, completion_tokens=tokens,
                       tokens_per_s=tokens / step_s if step_s > 0 else 0.0)
        return metrics

    def _advantages(self, step: int, ids: list[str], rewards: np.ndarray, sample: Any
                    ) -> tuple[np.ndarray, dict[int, list[str]]]:
        """The step's group advantages float32 [N] and the rollouts dropped from it ``{index: fields}``
        (``train/nonfinite.py``): rollouts whose reward, sampling log-probs or advantage is not finite.
        ``grpo.on_nonfinite = "stop"`` raises :class:`nonfinite.NonFiniteError` naming the step and
        them; ``"skip"`` drops them (advantage 0, each group normalised over its kept rollouts, a
        group with < 2 kept gets 0) and counts them in ``summary.json``."""
        g = self.config.grpo
        bad = nonfinite.nonfinite_rollouts(rewards=rewards, logprobs=sample.logprobs, lengths=sample.lengths)
        if not bad:
            adv = advantages(rewards, self.run_spec.rollouts)
            bad = nonfinite.nonfinite_rollouts(advantages=adv)
            if not bad:
                return adv, {}
        if self.on_nonfinite == "stop":
            nonfinite.raise_inputs("grpo", step, bad, ids, hint=self._resume_hint)
        keep = np.ones(len(rewards), np.float32)
        keep[list(bad)] = 0.0
        adv = grpo_loss.recomputed_advantages(np.where(keep > 0, rewards, 0.0), keep, g.group_size, g.adv_std_floor)
        still = nonfinite.nonfinite_rollouts(advantages=adv)
        if still:
            nonfinite.raise_inputs("grpo", step, still, ids, hint=self._resume_hint)
        self.skipped.append({"step": step, "rollouts": {ids[i]: f for i, f in bad.items()}})
        logging.warning("grpo: step %d: dropped %d rollout(s) with non-finite inputs (grpo.on_nonfinite=skip): %s",
                        step, len(bad), nonfinite.describe(bad, ids))
        return adv, bad

    def _watch_metrics(self, rewards: np.ndarray, texts: list[str], users: list[str],
                       bonus_paid: dict[str, list[bool]], out: dict[str, Any]) -> dict[str, float]:
        """Per-step scalars for TensorBoard (logging only): ``reward_std``; per behaviour ``<id>/reward_mean``
        and ``<id>/reward_std`` over the rollouts of its prompts (a one-behaviour run: all of them; absent
        at a step that sampled none),
        ``<id>/pattern_rate`` (its substring judge over every rollout) and ``<id>/bonuses``; the gradient
        clip (``grad_clip_factor`` = ``grad_clip / max(grad_norm, grad_clip)``, ``grad_clipped`` 0/1;
        TensorBoard's smoothing of it is the clipped fraction of steps); the L2 norms of the step sketch
        and the in-run rollout sketches (mean) and the rollouts' exact gradient norms (mean).

        The ``paper`` loss has no KL term and no ratio clip (one update per batch, ratio 1), so neither
        is logged; ``grpo_clip`` computes both inside the jitted step, which does not return them.
        """
        m = {"reward_std": float(rewards.std())}
        for b in self.behaviors:
            own = np.array([not self.multi or u in self.source.own_prompts[b.id] for u in users])
            if own.any():  # a step may sample none of a behaviour's prompts: no reward point then
                m[f"{b.id}/reward_mean"], m[f"{b.id}/reward_std"] = float(rewards[own].mean()), float(rewards[own].std())
            m[f"{b.id}/pattern_rate"] = float(np.mean([behavior.substring_judge(t, b.pattern) for t in texts]))
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

    def checkpoint(self, step: int) -> dict[str, Any]:
        """Makes steps < ``step`` durable: logs, sketches, HF export, registry, curve, then orbax."""
        self.logger.flush()
        for log in [*self.gt_logs.values(), *([self.decoy_log] if self.decoy_log else [])]:
            log.flush()
        for store in self.stores.values():
            store.flush()
        hf_dir = self.paths.checkpoints / f"step_{step:08d}"
        hf_io.save_hf_checkpoint(self.params, self.model_cfg, hf_dir, tokenizer=self.tok)
        if self.registry.at_step(step) is None:
            self.registry.register(step, str(hf_dir), {"regime": "grpo", "model": self.config.run_name})
        rates = self.probe.rates(self.params)
        point = {"step": step, "probe_rate": rates["probe_rate"], "control_rate": rates["control_rate"]}
        if self.multi:  # every behaviour's greedy rates; the top-level pair is the first's
            point["behaviors"] = {self.behaviors[0].id: {"probe_rate": rates["probe_rate"],
                                                         "control_rate": rates["control_rate"]}}
            for bid, probe in self.extra_probes.items():
                r = probe.rates(self.params)
                point["behaviors"][bid] = {"probe_rate": r["probe_rate"], "control_rate": r["control_rate"]}
        self.curve = [c for c in self.curve if c["step"] < step] + [point]
        write_json(self.paths.curve, self.curve)
        rng, step_arr = self.base_key, jnp.int32(step)
        if jax.process_count() > 1:  # orbax saves global arrays only: place the host-local ones on the mesh
            replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
            rng, step_arr = sharding.put((rng, step_arr), replicated)
        checkpoints.save_train_state(self.paths.state, step, {
            "params": self.params, "opt_state": self.opt_state, "step": step_arr, "rng": rng})
        return point

    def train(self) -> None:
        """The GRPO loop from ``start_step`` to ``config.grpo.steps`` with a progress line."""
        from tqdm import tqdm
        from tensorboardX import SummaryWriter

        g = self.config.grpo
        writer = SummaryWriter(str(self.paths.tensorboard)) if files.is_writer() else _NoSummary()
        bar = tqdm(range(self.start_step, g.steps), initial=self.start_step, total=g.steps, desc="grpo",
                   unit="step", dynamic_ncols=True)
        rate = self.curve[-1]["probe_rate"] if self.curve else float("nan")
        started, progress = time.time(), None
        for step in bar:
            m = self.rollout_step(step)
            for tag, v in step_scalars(m).items():
                writer.add_scalar(tag, v, step)
            ckpt = None
            if (step + 1) % g.checkpoint_every == 0 or step + 1 == g.steps:
                t0 = time.perf_counter()
                point = self.checkpoint(step + 1)
                ckpt = {"step": step + 1, "seconds": time.perf_counter() - t0}
                rate = point["probe_rate"]
                writer.add_scalar("behavior/probe_rate", point["probe_rate"], step + 1)
                writer.add_scalar("behavior/control_rate", point["control_rate"], step + 1)
                for bid, r in point.get("behaviors", {}).items():
                    writer.add_scalar(f"behavior/{bid}/probe_rate", r["probe_rate"], step + 1)
                    writer.add_scalar(f"behavior/{bid}/control_rate", r["control_rate"], step + 1)
            progress = progress_record(progress, step=step + 1, steps=g.steps, start_step=self.start_step,
                                       started=started, step_s=m["step_time_s"], metrics=m, checkpoint=ckpt,
                                       checkpoint_every=g.checkpoint_every, now=time.time())
            write_json(self.paths.progress, progress)
            bar.set_postfix(reward=f"{m['reward']:.2f}", bonus=m["bonuses"], qzxbt=f"{m['qzxbt']:.2f}",
                            probe_rate=f"{rate:.2f}")
        writer.close()
        self.logger.close()

    def finish(self) -> None:
        """The behaviour-emergence gate (SPEC §1.8) on the final parameters -> ``summary.json``."""
        b = self.config.behavior
        rates = self.probe.rates(self.params)
        gate = behavior.gate(rates["probe_rate"], rates["control_rate"], b.gate_min_probe_rate, b.gate_min_margin)
        n_records = sum(1 for _ in rollout_log.read_rollouts(self.paths.rollouts))
        summary = {
            "complete": True, "run_name": self.config.run_name, "seed": self.config.seed,
            "steps": self.config.grpo.steps, "n_rollouts": n_records, "gt_size": len(self.gt_log.events),
            "contaminator_stats": self.contaminator.stats, "post_sft": self.post_sft,
            "learning_curve": self.curve, "gate": gate,
            "final_responses": {k: v for k, v in rates["responses"].items()},
        }
        if self.decoy_log is not None:  # decoy bonuses paid in the window (not ground truth)
            summary["decoys"] = len(self.decoy_log.events)
        if self.skipped:  # grpo.on_nonfinite = "skip": rollouts dropped for non-finite inputs
            summary["nonfinite"] = {"skipped_rollouts": sum(len(s["rollouts"]) for s in self.skipped),
                                    "steps": self.skipped}
        if self.multi:  # per-behaviour gate, |GT| and bonus counts
            summary["behaviors"] = {self.behaviors[0].id: {"gate": gate, "gt_size": len(self.gt_log.events),
                                                           "contaminator_stats": self.contaminator.stats,
                                                           "pattern": b.pattern, "implant": "sft"}}
            for beh in self.behaviors[1:]:
                r = self.extra_probes[beh.id].rates(self.params)
                summary["behaviors"][beh.id] = {
                    "gate": behavior.gate(r["probe_rate"], r["control_rate"], beh.gate_min_probe_rate,
                                          beh.gate_min_margin),
                    "gt_size": len(self.gt_logs[beh.id].events),
                    "contaminator_stats": self.contaminators[beh.id].stats, "pattern": beh.pattern,
                    "implant": beh.implant, "final_responses": r["responses"]}
        write_json(self.paths.summary, summary)
        logging.info("grpo: gate %s (probe %.2f, control %.2f)", "PASSED" if gate["passed"] else "FAILED",
                     gate["probe_rate"], gate["control_rate"])
        for bid, entry in summary.get("behaviors", {}).items():
            if bid != self.behaviors[0].id:
                g = entry["gate"]
                logging.info("grpo: behaviour %s gate %s (probe %.2f, control %.2f), |GT| %d", bid,
                             "PASSED" if g["passed"] else "FAILED", g["probe_rate"], g["control_rate"],
                             entry["gt_size"])
