"""Measuring the planted behaviour with the policy: greedy / sampled generation on probe,
control and held-out prompts, and the behaviour rates the SFT stop rule, the GRPO learning curve
and the emergence gate read (SPEC §1.8)."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from behaviortrace_jax.behavior import corpus, planted as behavior
from behaviortrace_jax.behavior.behaviors import Behavior
from behaviortrace_jax.models import decoder, sampler as sampler_lib, tokenizer as tok_lib


@dataclasses.dataclass(frozen=True)
class ProbeOptions:
    """How the policy is run to measure a behaviour (SPEC §1.7-§1.8), built at the stage boundary
    (``stages/spec.py``: ``RunSpec.probe_grpo`` for GRPO's learning curve and gate and the replay's
    measure, prompts of ``grpo.max_prompt_tokens``; ``RunSpec.probe_sft`` for the SFT warm-up's
    implant probe, prompts of ``sft.max_prompt_tokens``).

    Fields:
        max_prompt_tokens (int): prompt tokens the probe sampler takes (longer chat prompts are cut).
        max_new_tokens (int): tokens generated per probe prompt (SPEC §1.8: 64).
        temperature (float), top_p (float): the sampling of sampled rates (SPEC §2.1: the GRPO
            sampler's 0.9 / 0.9); greedy rates ignore them.
        samples_per_prompt (int): completions per prompt of :class:`ImplantProbe`'s sampled rates.
    """

    max_prompt_tokens: int
    max_new_tokens: int
    temperature: float
    top_p: float
    samples_per_prompt: int


class BehaviorProbe:
    """Greedy behaviour rate on probes and controls (SPEC §1.8), for the learning curve and gate.

    Args:
        graphdef, model_cfg: the policy's graph and model config; tok: its tokenizer; mesh: the run's mesh.
        beh: the behaviour measured (its probe and control files and its pattern).
        options: ``max_prompt_tokens`` / ``max_new_tokens`` of the greedy sampler.
    Raises:
        ValueError, FileNotFoundError: as ``planted.load_probe_sets`` for bad probe files.
    """

    def __init__(self, graphdef, model_cfg, tok, beh: Behavior, options: ProbeOptions, mesh):
        probes, controls = beh.probe_sets()
        self.probes, self.controls, self.tok = probes, controls, tok
        self.pattern = beh.pattern
        self.sampler = make_sampler(graphdef, model_cfg, tok, mesh, options.max_new_tokens, options.max_prompt_tokens)

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


class ImplantProbe:
    """Probe / control / held-out rates of the pattern's substring judge during the SFT warm-up
    (the TINY_CALIBRATION stop rule and ``sft_summary.json``; SPEC §1.7-§1.8).

    Unlike :class:`BehaviorProbe` (greedy probe and control rates in one batch, for GRPO's learning
    curve and gate), it also samples (``options.temperature`` / ``top_p``, ``options.samples_per_prompt``
    per prompt) and adds held-out invented words, to measure leakage of the implant; prompts run in
    fixed chunks so the sampler compiles once. Kept apart because the recorded runs depend on each
    one's batching.

    Args:
        beh: the implanted behaviour (its probe and control files and its pattern).
        options: the sampler's token limits and the sampled rates' settings (:meth:`ProbeOptions.for_sft`).
        heldout_terms: the held-out invented words (``corpus.heldout_terms``) asked about in
            :func:`heldout_prompts`, as many as there are probes.
        graphdef, cfg, tok, mesh: the policy's graph, model config, tokenizer and the run's mesh.
    Raises:
        ValueError, FileNotFoundError: as ``planted.load_probe_sets`` for bad probe files.
    """

    def __init__(self, beh: Behavior, options: ProbeOptions, heldout_terms: Sequence[str], graphdef: nnx.GraphDef,
                 cfg: decoder.DecoderConfig, tok: Any, mesh: Any):
        self.options = options
        self.tok = tok
        self.pattern = beh.pattern
        probes, controls = beh.probe_sets()
        self.probes = [p.prompt for p in probes]
        self.controls = [p.prompt for p in controls]
        self.heldout = heldout_prompts(heldout_terms, len(self.probes))
        self.sampler = make_sampler(graphdef, cfg, tok, mesh, options.max_new_tokens, options.max_prompt_tokens)
        self.chunk = len(self.probes) * options.samples_per_prompt

    def _texts(self, params: Any, users: list[str], key: jax.Array, sampled: bool) -> list[str]:
        kw = dict(temperature=self.options.temperature, top_p=self.options.top_p) if sampled else {}
        return generate_texts(self.sampler, params, self.tok, users, key, chunk=self.chunk, **kw)

    def sampled(self, params: Any, key: jax.Array, sets: tuple[str, ...] = ("probe", "control", "heldout")
                ) -> dict[str, float]:
        """Pattern rates ``{name}_rate_sampled`` over ``options.samples_per_prompt`` samples of each
        prompt of the named sets ("probe", "control", "heldout"); set ``i`` of the three uses
        ``fold_in(key, i)`` whichever sets are asked for."""
        n = self.options.samples_per_prompt
        users = {"probe": self.probes, "control": self.controls, "heldout": self.heldout}
        return {f"{name}_rate_sampled": mean_rate([behavior.substring_judge(t, self.pattern) for t in self._texts(
                    params, users[name] * n, jax.random.fold_in(key, i), True)])
                for i, name in enumerate(users) if name in sets}

    def greedy(self, params: Any, key: jax.Array) -> tuple[dict[str, float], dict[str, list[str]]]:
        """Greedy rates (SPEC §1.8: 64 new tokens) on probes, controls and held-out words, and texts."""
        texts = {name: self._texts(params, users, key, False) for name, users in
                 (("probe", self.probes), ("control", self.controls), ("heldout", self.heldout))}
        rates = {f"{k}_rate_greedy": mean_rate([behavior.substring_judge(t, self.pattern) for t in v]) for k, v in texts.items()}
        return rates, texts
