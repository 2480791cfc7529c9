"""The ``info`` stage: prints the model, devices, mesh and a probe completion (writes nothing)."""
from __future__ import annotations

import ml_collections

from behaviortrace_jax.stages.registry import register_stage


@register_stage("info")
def info_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Loads model + tokenizer from ``config.model.hf_dir`` and prints what the harness sees."""
    import jax

    from behaviortrace_jax.behavior import planted as behavior
    from behaviortrace_jax.models import sampler, tokenizer
    from behaviortrace_jax.models.loader import load_policy
    from behaviortrace_jax.stages.spec import RunSpec
    from behaviortrace_jax.io.layout import RunLayout

    spec = RunSpec.from_config(config)
    hf_dir = RunLayout(workdir).model_dir(spec.hf_dir)
    policy = load_policy(hf_dir, spec.layout, spec.model)
    mesh = policy.mesh
    tok, cfg, graphdef, params = policy.tokenizer, policy.model_config, policy.graphdef, policy.params
    n_params = sum(x.size for x in jax.tree.leaves(params))
    probe = behavior.load_probes(spec.first_behavior.probes_path or None)[0]
    s = sampler.Sampler(graphdef, cfg, max_prompt_tokens=spec.grpo.max_prompt_tokens,
                        max_new_tokens=spec.info.max_new_tokens,
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
