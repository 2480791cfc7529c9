"""GRPO on the planted behaviour: the resumable loop of jitted, sharded train steps (SPEC §2).

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

This stage reads the config (``RunSpec.from_config``, where every key is typed and checked) and runs the
library's parts in order (:class:`GRPORun`):

* sampling and rewards, steps 1-2: ``train/rollouts.RolloutSource`` (the one code path, which the
  regenerated counterfactual replay runs too);
* the run's behaviours, one ``train/grpo_tracks.BehaviorTrack`` each in a list (bonus,
  ground-truth log, probe, learning-curve rates, gate): a run of one behaviour and of several run
  the same code, and one behaviour writes the paper's files;
* the update, steps 3-4: ``train/grpo_updater.GRPOUpdater`` (the jitted step, the non-finite
  guard, ``grpo.on_nonfinite`` skips);
* the logs: ``train/grpo_logs.py`` (rollout log, in-run sketch rows, TensorBoard scalars under
  ``grpo/tb``, ``grpo/progress.json``, which the ``status`` stage reads, and ``summary.json``);
* checkpoints and exact resume: ``train/grpo_checkpoint.py`` (HF export, registry, learning curve,
  orbax state; a rerun resumes from the latest complete orbax state and replays the later steps
  bit for bit, since the PRNG key of step s is ``fold_in(key(seed), s)``).
"""
from __future__ import annotations

import time

import ml_collections
from absl import logging

from behaviortrace_jax.behavior.contaminator import ContaminationSpec
from behaviortrace_jax.io.files import read_json
from behaviortrace_jax.io.layout import RunLayout
from behaviortrace_jax.sketch.stores import open_sketch_stores
from behaviortrace_jax.stages.registry import register_stage
from behaviortrace_jax.stages.spec import RunSpec, check_positions
from behaviortrace_jax.train.grpo_checkpoint import GRPOCheckpointer, resume
from behaviortrace_jax.train.grpo_logs import GRPOLogs, step_metrics, write_summary
from behaviortrace_jax.train.grpo_tracks import open_tracks
from behaviortrace_jax.train.grpo_updater import GRPOUpdater, logged_skips
from behaviortrace_jax.train.rollouts import RolloutSource, step_key
from behaviortrace_jax.train.start_state import load_start_state


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


def _contamination(run: RunSpec) -> list[ContaminationSpec]:
    """Each behaviour's bonus, in ``run.behaviors``' order (the first is config.behavior +
    config.contamination, with its decoys)."""
    return [run.contamination] + [b.contamination_spec(run.seed) for b in run.behaviors[1:]]


class GRPORun:
    """One GRPO run, resumed from the latest checkpoint: the library's parts, run in order.

    ``source`` samples and rewards (``RolloutSource``), ``tracks`` hold each behaviour's bonus,
    ground truth, probe and gate, ``updater`` the policy and its jitted step, ``logs`` the rollout
    log, sketch rows and watch files, ``checkpointer`` the checkpoints and the learning curve.
    """

    def __init__(self, config: ml_collections.ConfigDict, paths: RunLayout):
        self.paths = paths
        self.run = o = RunSpec.from_config(config)  # every key typed and checked, errors naming it
        g, step = o.grpo, o.step
        start = load_start_state(o.model, o.optim, paths.workdir, o.layout, continue_sft_moments=g.continue_sft_moments)
        check_positions(o, start.model_config.max_position_embeddings, f"{paths.sft_hf}/config.json", ("grpo",))
        resumed = resume(paths, start)
        self.start_step, self.post_sft, n = resumed.start_step, start.summary, step.shapes.num_rollouts
        self.tracks = open_tracks(list(o.behaviors), _contamination(o), paths, start_step=self.start_step,
                                  rollouts_per_step=n, probe_options=o.probe_grpo, graphdef=start.graphdef,
                                  model_cfg=start.model_config, tok=start.tokenizer, mesh=start.mesh)
        self.source = RolloutSource(o.rollouts, start.graphdef, start.model_config, start.tokenizer, start.mesh,
                                    paths.sft_hf, step.shapes, contaminators={t.id: t.contaminator for t in self.tracks})
        self.updater = GRPOUpdater(start, step, resumed.params, resumed.opt_state, resumed=bool(self.start_step),
                                   state_dir=paths.state, on_nonfinite=g.on_nonfinite, group_size=g.group_size,
                                   adv_std_floor=g.adv_std_floor,
                                   skipped=logged_skips(paths.rollouts) if self.start_step else [])
        stores = open_sketch_stores(o.sketch, start.model_config, paths, steps=g.steps, rollouts_per_step=n,
                                    in_run_rollouts=step.in_run_rollouts, rollout_sketch=step.rollout_sketch)
        self.logs = GRPOLogs(paths, stores, rollouts_per_step=n, shard_size=g.log_shard_size)
        self.checkpointer = GRPOCheckpointer(paths, self.start_step, start, seed=o.seed, run_name=o.run_name)

    def rollout_step(self, step: int) -> dict[str, float]:
        """Samples, rewards, trains and logs one GRPO step (SPEC §2.2). Returns its scalar metrics
        (``grpo_logs.step_metrics``; none feeds back into the run)."""
        t0 = time.perf_counter()
        ro = self.source.sample_and_reward(self.updater.params, step, step_key(self.run.seed, step))
        t_sample = time.perf_counter() - t0  # sampling, decoding and rewards
        adv, dropped = self.updater.advantages(step, ro.ids, ro.rewards, ro.sample)
        out = self.updater.update(step, self.source.batch(ro, adv), dropped, ro.ids)
        self.logs.log_rollouts(step, ro, adv, dropped, self.tracks)
        out = self.updater.fetch(out)  # the non-finite guard, before any sketch row or checkpoint of this step
        self.logs.write_sketches(step, out)
        return step_metrics(ro, out, self.tracks, self.source.own_prompts, t0=t0, t_sample=t_sample)

    def checkpoint(self, step: int) -> dict:
        """Makes steps < ``step`` durable (``GRPOCheckpointer.save``); returns the curve point."""
        return self.checkpointer.save(step, self.updater.params, self.updater.opt_state, self.logs, self.tracks)

    def train(self) -> None:
        """The GRPO loop from ``start_step`` to ``grpo.steps`` with a progress line."""
        from tqdm import tqdm

        steps, every = self.run.grpo.steps, self.run.grpo.checkpoint_every
        self.logs.start_watch(start_step=self.start_step, steps=steps, checkpoint_every=every)
        bar = tqdm(range(self.start_step, steps), initial=self.start_step, total=steps, desc="grpo",
                   unit="step", dynamic_ncols=True)
        curve = self.checkpointer.curve
        rate = curve[-1]["probe_rate"] if curve else float("nan")
        for step in bar:
            m = self.rollout_step(step)
            self.logs.watch_step(step, m)
            ckpt = None
            if (step + 1) % every == 0 or step + 1 == steps:
                t0 = time.perf_counter()
                point = self.checkpoint(step + 1)
                ckpt = {"step": step + 1, "seconds": time.perf_counter() - t0}
                rate = point["probe_rate"]
                self.logs.watch_checkpoint(point)
            self.logs.write_progress(step + 1, m, ckpt)
            bar.set_postfix(reward=f"{m['reward']:.2f}", bonus=m["bonuses"], qzxbt=f"{m['qzxbt']:.2f}",
                            probe_rate=f"{rate:.2f}")
        self.logs.close()

    def finish(self) -> None:
        """Each behaviour's emergence gate (SPEC §1.8) on the final parameters -> ``summary.json``."""
        o = self.run
        write_summary(self.paths.summary, self.tracks, [t.rates(self.updater.params) for t in self.tracks],
                      run_name=o.run_name, seed=o.seed, steps=o.grpo.steps, post_sft=self.post_sft,
                      curve=self.checkpointer.curve, skipped=self.updater.skipped, rollouts=self.paths.rollouts,
                      truncated=self.source.truncation_summary(o.grpo.steps))
