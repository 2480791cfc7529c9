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

import hashlib
import importlib
import os
from pathlib import Path

import ml_collections

from behaviortrace_jax import files, stages
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


def resolve_config_paths(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of ``config`` whose path keys (names ending in ``_dir`` or ``_path``, any depth) are
    absolute, with ``~`` expanded (:func:`files.resolve_path`); ``""`` keeps meaning "the default".

    Raises:
        TypeError: naming the key, if a path key holds something other than a string.
    """
    out = config.copy_and_resolve_references()

    def walk(node: ml_collections.ConfigDict, prefix: str) -> None:
        for key in list(node.keys()):
            value = node[key]
            if isinstance(value, ml_collections.ConfigDict):
                walk(value, f"{prefix}{key}.")
            elif key.endswith(("_dir", "_path")):
                if not isinstance(value, str):
                    raise TypeError(f"config.{prefix}{key} is a path key but holds {value!r}")
                node[key] = files.resolve_path(value)

    with out.unlocked():
        walk(out, "")
    return out


def run_digest(config: ml_collections.ConfigDict, workdir: str) -> dict[str, str]:
    """sha256 of a run's key outputs, to compare runs across machines (README "Reproducibility").

    Returns:
        ``{"base_weights": hex, "results_table.csv": hex}`` for whichever exist: the starting
        model's ``*.safetensors`` files (hashed in name order as one stream of digests) and
        ``workdir/results_table.csv``.
    """
    out = {}
    weights = sorted(Path(model_dir(config, workdir)).glob("*.safetensors"))
    if weights:
        out["base_weights"] = (files.sha256_file(weights[0]) if len(weights) == 1 else
                               hashlib.sha256("".join(files.sha256_file(w) for w in weights).encode()).hexdigest())
    table = Path(workdir) / "results_table.csv"
    if table.is_file():
        out["results_table.csv"] = files.sha256_file(table)
    return out


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, str]:
    """Imports the stage modules and runs ``config.stages`` on ``workdir`` (created if needed).

    ``workdir`` and every path key of ``config`` may be relative (to the current directory) or
    start with ``~``. Prints and returns :func:`run_digest` at the end.

    Raises:
        ValueError: if ``config.stages`` names an unknown stage (before anything is written).
    """
    for name in _STAGE_MODULES:
        importlib.import_module(f"behaviortrace_jax.{name}")
    stages.parse_stages(config.stages)  # an unknown stage name fails before anything is written
    config, workdir = resolve_config_paths(config), files.resolve_path(workdir)
    os.makedirs(workdir, exist_ok=True)
    stages.run_stages(config, workdir)
    digest = run_digest(config, workdir)
    for name, hexdigest in digest.items():
        print(f"digest {name}: sha256 {hexdigest}")
    return digest
