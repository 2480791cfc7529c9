"""Measuring the planted behaviour with the policy: greedy / sampled generation on probe,
control and held-out prompts, and the behaviour rates the SFT stop rule, the GRPO learning curve
and the emergence gate read (SPEC §1.8)."""
from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from behaviortrace_jax.behavior import corpus, planted as behavior
from behaviortrace_jax.models import decoder, sampler as sampler_lib, tokenizer as tok_lib


class BehaviorProbe:
    """Greedy behaviour rate on probes and controls (SPEC §1.8), for the learning curve and gate."""

    def __init__(self, graphdef, model_cfg, tok, config, mesh):
        probes, controls = behavior.load_probe_sets(config.behavior.probes_path or None,
                                                     config.behavior.controls_path or None)
        self.probes, self.controls, self.tok = probes, controls, tok
        self.pattern = config.behavior.pattern
        self.sampler = sampler_lib.Sampler(
            graphdef, model_cfg, max_prompt_tokens=config.grpo.max_prompt_tokens,
            max_new_tokens=config.behavior.gate_max_new_tokens, eos_ids=tok_lib.eos_ids(tok),
            pad_id=tok_lib.pad_id(tok), mesh=mesh)

    def rates(self, params) -> dict[str, Any]:
        """``{"probe_rate", "control_rate", "responses": {id: text}}`` with greedy decoding."""
        items = self.probes + self.controls
        out = self.sampler.sample_chat(params, self.tok, [(behavior.SYSTEM_PROMPT, p.prompt) for p in items],
                                       jax.random.key(0), temperature=0.0)
        texts = {p.id: self.tok.decode(out.tokens[i, :out.lengths[i]], skip_special_tokens=True)
                 for i, p in enumerate(items)}
        return {"probe_rate": behavior.behavior_rate(texts, self.probes, self.pattern),
                "control_rate": behavior.behavior_rate(texts, self.controls, self.pattern),
                "responses": texts}


def make_sampler(graphdef: nnx.GraphDef, cfg: decoder.DecoderConfig, tok: Any, mesh: Any,
                 max_new_tokens: int, max_prompt_tokens: int = 128) -> sampler_lib.Sampler:
    """A :class:`sampler.Sampler` with the tokenizer's EOS / pad ids (SPEC §2.1: pad = EOS)."""
    return sampler_lib.Sampler(graphdef, cfg, max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens,
                               eos_ids=tok_lib.eos_ids(tok), pad_id=tok_lib.pad_id(tok), mesh=mesh)


def generate_texts(smp: sampler_lib.Sampler, params: Any, tok: Any, users: Sequence[str], key: jax.Array, *,
                   temperature: float = 0.0, top_p: float = 1.0, system: str = behavior.SYSTEM_PROMPT,
                   chunk: int = 80) -> list[str]:
    """Completions (decoded, special tokens skipped) of ``[system, user]`` chat prompts.

    Prompts run in chunks of exactly ``chunk`` rows (the last one padded with copies of its first
    prompt), so the sampler compiles once per prompt bucket. Chunk ``i`` uses ``fold_in(key, i)``;
    ``temperature`` 0 is greedy.
    """
    ids = [tok_lib.encode_chat(tok, system, u, max_tokens=smp.max_prompt_tokens) for u in users]
    texts: list[str] = []
    for i in range(0, len(ids), chunk):
        part = ids[i:i + chunk]
        n = len(part)
        out = smp.sample(params, part + [part[0]] * (chunk - n), jax.random.fold_in(key, i // chunk),
                         temperature=temperature, top_p=top_p)
        texts += [tok.decode(out.tokens[r, :out.lengths[r]], skip_special_tokens=True).strip() for r in range(n)]
    return texts


def heldout_prompts(terms: Sequence[str], n: int) -> list[str]:
    """``n`` probe-form questions (SPEC §1.2 forms) about the held-out invented ``terms``: term
    ``i % len(terms)`` in form ``(i // len(terms) + i) % 20``, so every term and form is used."""
    forms = corpus.PROBE_FORMS
    return [forms[(i // len(terms) + i) % len(forms)].format(term=terms[i % len(terms)]) for i in range(n)]


def mean_rate(flags: Sequence[bool]) -> float:
    return float(np.mean(flags)) if len(flags) else float("nan")
