"""The run's sketch arrays: the metadata every sketch array carries and the in-run stores."""
from __future__ import annotations

import ml_collections

from behaviortrace_jax.io import sketch_store
from behaviortrace_jax.io.layout import RunLayout
from behaviortrace_jax.models import decoder, hf_io
from behaviortrace_jax.sketch import countsketch


def sketch_metadata(config: ml_collections.ConfigDict, model_cfg: decoder.DecoderConfig, kind: str) -> dict:
    """Metadata every sketch array carries (sketch_store raises when a reopened store differs)."""
    return {"kind": kind, "hash_family": countsketch.HASH_FAMILY, "seed": int(config.sketch.seed),
            "dim": int(config.sketch.dim), "param_fingerprint": hf_io.param_order_fingerprint(model_cfg),
            "model_fingerprint": hf_io.model_fingerprint(model_cfg), "dtype": "float32",
            "run_seed": int(config.seed)}


def open_sketch_stores(config: ml_collections.ConfigDict, model_cfg: decoder.DecoderConfig,
                       paths: RunLayout) -> dict[str, sketch_store.SketchStore]:
    """The in-run sketch arrays: step sketches [steps, D], step grad norms [steps], rollout sketches
    [steps*N, D] and rollout grad norms [steps*N] (rollout row = step * N + index)."""
    steps, n, d = config.grpo.steps, config.grpo.prompts_per_step * config.grpo.group_size, config.sketch.dim
    specs = {"step_sketches": (steps, d), "step_grad_norms": (steps,)}
    if config.sketch.in_run_rollouts:
        specs.update(rollout_sketches=(steps * n, d), rollout_grad_norms=(steps * n,))
    return {name: sketch_store.SketchStore.open_or_create(
                paths.sketch_store(name), shape, chunk_rows=n if shape[0] == steps * n else 1,
                metadata=sketch_metadata(config, model_cfg, name))
            for name, shape in specs.items()}
