"""The ``sketch`` stage: behaviour targets and training-rollout sketches at saved checkpoints.

Inputs: the GRPO run's checkpoint registry (``grpo/registry.json``, SPEC §2.4) and rollout log.
Outputs under ``workdir/sketches/`` (tensorstore arrays with metadata, see sketch_store.py):

* ``targets_continuation.zarr`` float32 [C, D]: the constructed-continuation target (SPEC §5.1) at
  every registered checkpoint, in registry order (its metadata lists ``checkpoint_steps``). The
  last row is the final-checkpoint target of C1-dot / C1-cosine / TRAK / local-buffer; all rows
  are TracInCP's per-checkpoint targets (SPEC §4).
* ``targets.json``: per checkpoint, the target's self-consistency (SPEC §5.2) and norm.
* ``checkpoint_rollout_sketches.zarr`` float32 [C', R, D], ``checkpoint_rollout_fluency.zarr`` and
  ``checkpoint_rollout_norms.zarr`` [C', R, 1]: the sketch, masked mean log-prob (fluency) and exact
  gradient norm of ``-(masked mean log-prob)`` of every logged training rollout at the checkpoints
  named by ``config.sketch.rollout_checkpoints`` (SPEC §3.2, rollout level; the loss has no
  advantage and no 1/B); ``config.sketch.rollout_scope`` = "early" keeps the rollouts of the bonus
  window (a prefix of the log), "all" every rollout.

Resumable: finished target rows and rollout blocks are skipped (``SketchStore.missing_rows``).
"""
from __future__ import annotations

from typing import Any

import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from behaviortrace_jax.behavior import behaviors as behaviors_lib
from behaviortrace_jax.io import checkpoints, rollout_log
from behaviortrace_jax.io.files import read_json, write_json
from behaviortrace_jax.io.layout import RunLayout
from behaviortrace_jax.models import decoder, tokenizer as tok_lib
from behaviortrace_jax.sketch import targets
from behaviortrace_jax.sketch.stores import open_store, sketch_metadata
from behaviortrace_jax.models.loader import load_policy, policy_config
from behaviortrace_jax.stages.registry import register_stage
from behaviortrace_jax.stages.spec import RunSpec


def select_rollout_checkpoints(spec: str, steps: list[int], target_step: int) -> list[int]:
    """Which checkpoints get training-rollout sketches.

    ``spec``: "" (none), "all", "nearest" (the checkpoint nearest ``target_step``, SPEC §5.6's rule
    ``min |step - target|``), or comma-separated steps.

    Raises:
        ValueError: naming a requested step that is not a registered checkpoint.
    """
    spec = spec.strip()
    if not spec:
        return []
    if spec == "all":
        return list(steps)
    if spec == "nearest":
        return [min(steps, key=lambda s: (abs(s - target_step), s))]
    wanted = [int(s) for s in spec.split(",") if s.strip()]
    missing = [s for s in wanted if s not in steps]
    if missing:
        raise ValueError(f"config.sketch.rollout_checkpoints names {missing}, not in the registry {steps}")
    return wanted


class CheckpointLoader:
    """Loads registered HF checkpoint exports as ``nnx.State`` params for one fixed graph, on the
    run's mesh in the run's parameter layout (``RunSpec.layout``: FSDP when ``mesh.fsdp``), where
    the sketchers run (as in the ``draws`` stage and the compile stage); ``spec``: the run's
    :class:`~behaviortrace_jax.stages.spec.RunSpec`."""

    def __init__(self, spec: RunSpec, first_dir: str):
        self.spec = spec
        self.layout = self.spec.layout
        self.mesh = self.layout.mesh()
        self.tokenizer = tok_lib.load_tokenizer(first_dir)
        self.options = self.spec.model
        self.model_config = policy_config(first_dir, self.options)
        self.graphdef, self.abstract = nnx.split(decoder.abstract_model(self.model_config), nnx.Param)

    def params(self, hf_dir: str) -> Any:
        """The parameters of ``hf_dir`` on the mesh; raises (hf_io) if it holds a different model."""
        return load_policy(hf_dir, self.layout, self.options, tokenizer=False).params


@register_stage("sketch")
def sketch_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Targets at every checkpoint and training-rollout sketches at the selected checkpoints."""
    paths = RunLayout(workdir)
    entries = checkpoints.CheckpointRegistry(paths.registry).list()
    if not entries:
        raise FileNotFoundError(f"{paths.registry}: no checkpoints registered; run the `grpo` stage first")
    steps = [e.step for e in entries]
    spec = RunSpec.from_config(config)
    loader = CheckpointLoader(spec, entries[0].path)
    tok, cfg = loader.tokenizer, loader.model_config
    forced = targets.ForcedSketcher.from_options(loader.spec.forced, loader.graphdef, cfg, loader.abstract,
                                                 tok_lib.pad_id(tok), mesh=loader.mesh)

    for beh in loader.spec.behaviors:  # each behaviour's targets
        continuation_targets(spec, paths, loader, forced, entries, beh)

    chosen = select_rollout_checkpoints(spec.sketch_keys.rollout_checkpoints, steps, spec.draws.target_step)
    if chosen:
        sketch_training_rollouts(spec, paths, loader, forced, [entries[steps.index(s)] for s in chosen])


def continuation_targets(spec: RunSpec, paths: RunLayout, loader: CheckpointLoader,
                         forced: targets.ForcedSketcher, entries: list[checkpoints.CheckpointEntry],
                         beh: behaviors_lib.Behavior) -> None:
    """The continuation targets of ``beh`` (its probes, its pattern; SPEC §5.1) at every checkpoint:
    ``targets_continuation.zarr`` float32 [C, D] and ``targets.json`` for the first behaviour,
    ``targets_continuation_<id>.zarr`` and ``targets_<id>.json`` (metadata ``behavior`` = its id)
    for another."""
    steps = [e.step for e in entries]
    options = loader.spec.sketch
    meta = dict(sketch_metadata(options, loader.model_config, "targets_continuation"),
                checkpoint_steps=steps, **({} if beh.first else {"behavior": beh.id}))
    t_store = open_store(options, paths.behavior_targets(beh.suffix), (len(steps), spec.sketch.dim), 1, meta)
    stats_path = paths.behavior_target_stats(beh.suffix)
    stats = {int(k): v for k, v in read_json(stats_path, {}).items()}
    probes = beh.probe_sets()[0]
    for k in t_store.missing_rows():
        e = entries[int(k)]
        ct = targets.continuation_target(forced, loader.params(e.path), loader.tokenizer, probes, pattern=beh.pattern)
        t_store.write_rows(int(k), ct.target[None])
        t_store.flush()
        stats[e.step] = {"self_consistency": ct.self_consistency, "norm": float(np.linalg.norm(ct.target))}
        write_json(stats_path, {str(s): stats[s] for s in sorted(stats)})
        logging.info("sketch: behaviour %s continuation target at step %d (self-consistency %.3f)", beh.id, e.step,
                     ct.self_consistency)


def sketch_training_rollouts(spec: RunSpec, paths: RunLayout, loader: CheckpointLoader,
                             forced: targets.ForcedSketcher, entries: list[checkpoints.CheckpointEntry]) -> None:
    """Sketches ``-(masked mean log-prob)`` of every logged rollout at each of ``entries``."""
    records = list(rollout_log.read_rollouts(paths.rollouts))
    if spec.sketch_keys.rollout_scope == "early":  # the log is step-major: the early window is a prefix
        records = [rec for rec in records if rec.step < spec.schedule.window_end]
    elif spec.sketch_keys.rollout_scope != "all":
        raise ValueError(f"config.sketch.rollout_scope={spec.sketch_keys.rollout_scope!r}; expected 'early' or 'all'")
    r, d = len(records), spec.sketch.dim
    eos = tok_lib.mask_eos_ids(loader.tokenizer, loader.spec.rollouts.mask_eos)  # as the GRPO loss mask
    options = loader.spec.sketch
    meta = dict(sketch_metadata(options, loader.model_config, "checkpoint_rollout_sketches"),
                checkpoint_steps=[e.step for e in entries], n_rollouts=r)
    block = forced.block_size
    stores = {
        "sketches": open_store(options, paths.sketch_store("checkpoint_rollout_sketches"), (len(entries), r, d),
                               block, meta),
        "fluency": open_store(options, paths.sketch_store("checkpoint_rollout_fluency"), (len(entries), r, 1),
                              block, meta),
        "norms": open_store(options, paths.sketch_store("checkpoint_rollout_norms"), (len(entries), r, 1),
                            block, meta),
    }
    qset = frozenset()
    for c, e in enumerate(entries):
        missing = set().union(*(st.missing_rows(lead=(c,)).tolist() for st in stores.values()))
        if not missing:
            continue
        params = loader.params(e.path)
        for start in range(0, r, block):
            rows = range(start, min(start + block, r))
            if not missing.intersection(rows):
                continue
            examples = []
            for i in rows:
                rec = records[i]
                toks = np.asarray(rec.completion_token_ids, np.int64)
                whole, _, _ = targets.response_examples(rec.prompt_token_ids, toks, toks.size, eos, qset)
                examples.append(whole)
            out = forced(params, examples)
            stores["fluency"].write_rows(start, out.mean_logprob[:, None], lead=(c,))
            stores["norms"].write_rows(start, out.grad_norms[:, None], lead=(c,))
            stores["sketches"].write_rows(start, out.sketches, lead=(c,))
        for s in stores.values():
            s.flush()
        logging.info("sketch: %d training rollouts at checkpoint %d", r, e.step)
