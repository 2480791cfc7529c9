"""The pipeline: imports every stage module (so each registers itself) and runs the configured stages.

Stages, in the order of a full run (each skips itself when its outputs are complete):

| stage | module | writes under the workdir |
|---|---|---|
| ``info`` | this file | nothing (prints the model, devices, mesh and a probe completion) |
| ``base`` | ``base_model.py`` | ``base/`` (tiny instruct model as an HF checkpoint) |
| ``sft`` | ``sft.py`` | ``sft/`` (train state after the warm-up, HF export, summary) |
| ``grpo`` | ``grpo.py`` | ``grpo/`` (rollout + ground-truth logs, checkpoints, registry, summary), ``sketches/`` |
| ``sketch`` | ``checkpoint_sketches.py`` | ``sketches/`` (targets and rollout sketches at checkpoints) |
| ``draws`` | ``draws.py`` | ``draws/`` (rollout-level rows of fresh groups, SPEC §5.6) |
| ``evaluate`` | ``run_evaluation.py`` | ``results_table.csv``, ``attribution_scores.json``, ``verdicts.json`` |
| ``report`` | ``run_evaluation.py`` | ``report.md``, ``figures/*.png`` |
| ``reproduce`` | ``reproduce.py`` | the paper's tables from its released files |
| ``sweep`` | ``sweep.py`` | ``seed{S}/`` runs, diagnostic draws, one aggregate report |
"""
from __future__ import annotations

import importlib
import os

import ml_collections

from behaviortrace_jax import stages
from behaviortrace_jax.stages import register_stage

_STAGE_MODULES = ("base_model", "sft", "grpo", "checkpoint_sketches", "draws", "run_evaluation", "reproduce",
                  "sweep")


def model_dir(config: ml_collections.ConfigDict, workdir: str) -> str:
    """The policy's starting HF checkpoint: ``config.model.hf_dir`` or, if empty, ``workdir/base``."""
    return config.model.hf_dir or os.path.join(workdir, "base")


@register_stage("info")
def info_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Loads model + tokenizer from ``config.model.hf_dir`` and prints what the harness sees."""
    import jax
    from flax import nnx

    from behaviortrace_jax import behavior, hf_io, qwen2, sampler, sharding, tokenizer

    hf_dir = model_dir(config, workdir)
    tok = tokenizer.load_tokenizer(hf_dir)
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.model)
    cfg = qwen2.Qwen2Config.from_hf_config(hf_dir, param_dtype=config.model.param_dtype,
                                           compute_dtype=config.model.compute_dtype)
    model = hf_io.load_hf_checkpoint(hf_dir, param_dtype=cfg.param_dtype, compute_dtype=cfg.compute_dtype,
                                     mesh=mesh)
    graphdef, params = nnx.split(model, nnx.Param)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    probe = behavior.load_probes(config.behavior.probes_path or None)[0]
    s = sampler.Sampler(graphdef, cfg, max_prompt_tokens=config.grpo.max_prompt_tokens,
                        max_new_tokens=config.get("info_max_new_tokens", 32),
                        eos_ids=tokenizer.eos_ids(tok), pad_id=tokenizer.pad_id(tok), mesh=mesh)
    out = s.sample_chat(params, tok, [(behavior.SYSTEM_PROMPT, probe.prompt)], jax.random.key(0))
    text = tok.decode(out.tokens[0, :out.lengths[0]], skip_special_tokens=True)
    lines = [
        f"checkpoint: {hf_dir}",
        f"parameters: {n_params:,} ({cfg.num_hidden_layers} layers, d {cfg.hidden_size}, vocab {cfg.vocab_size}, "
        f"tied={cfg.tie_word_embeddings}, {cfg.param_dtype})",
        f"devices: {jax.devices()}",
        f"mesh: {dict(mesh.shape)}",
        f"probe: {probe.prompt!r}",
        f"greedy completion: {text!r}",
    ]
    print("\n".join(lines))


def run(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Imports the stage modules and runs ``config.stages`` on ``workdir`` (created if needed)."""
    for name in _STAGE_MODULES:
        importlib.import_module(f"behaviortrace_jax.{name}")
    stages.parse_stages(config.stages)  # an unknown stage name fails before anything is written
    os.makedirs(workdir, exist_ok=True)
    stages.run_stages(config, workdir)
