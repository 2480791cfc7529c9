"""One GRPO step's rollouts: sample -> reward -> contaminate -> advantages -> train batch (SPEC §2.2).

The one code path that both the ``grpo`` stage (``stages/grpo.GRPORun.rollout_step``) and the
regenerated counterfactual replay (``train/replay.Replayer``, ``counterfactual.rollouts =
"regenerated"``) run to make a step's train batch from a policy:

1. the B prompts of the step (``planted.step_prompts``: ``pool[(s*B + i) % len(pool)]``) are
   sampled G times each by the jitted sampler (``grpo.temperature`` / ``top_p`` / ``top_k`` /
   ``repetition_penalty``) in one batch, with the step's PRNG key;
2. each rollout gets ``planted.base_reward`` plus the contaminators' bonuses (one behaviour: the
   first behaviour's bonus and, with ``contamination.decoy_fraction`` > 0, the decoys'; several
   behaviours: every behaviour's bonus, a prompt-gated one on its own prompts only);
3. :func:`advantages` normalises the rewards per group (``grpo_loss.group_advantages``, the one
   home of the group advantage formula) and ``grpo_step.build_batch`` makes the train batch.

:class:`RolloutSource` holds what this needs (sampler, tokenizer, prompt pool, contaminators); the
stage builds it with its ground-truth logs (events recorded), the replay without (nothing
written). Step 2 can be split from step 3 (:meth:`RolloutSource.sample_and_reward`), so a replay can
change a reward (``counterfactual.intervention = "withhold-bonus"``) before the advantages.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
from absl import logging
import numpy as np

from behaviortrace_jax.behavior import behaviors as behaviors_lib, contaminator, planted as behavior
from behaviortrace_jax.io.files import read_json
from behaviortrace_jax.io.layout import as_path
from behaviortrace_jax.models import sampler as sampler_lib, tokenizer as tok_lib
from behaviortrace_jax.io import rollout_log
from behaviortrace_jax.train import grpo_loss
from behaviortrace_jax.train.grpo_step import StepShapes, build_batch


def generation_defaults(hf_dir: str | os.PathLike, top_k: int, repetition_penalty: float) -> tuple[int, float]:
    """Resolves ``config.grpo.top_k`` / ``repetition_penalty`` as HF ``generate`` would (SPEC §2.1).

    A value of -1 means: the checkpoint's ``generation_config.json`` if it sets one, else
    transformers' defaults (top_k 50, repetition_penalty 1.0). Explicit values win.
    """
    gen = read_json(as_path(hf_dir) / "generation_config.json", {})
    k = int(gen.get("top_k", 50)) if top_k < 0 else int(top_k)
    rp = float(gen.get("repetition_penalty", 1.0)) if repetition_penalty < 0 else float(repetition_penalty)
    return k, rp


@dataclasses.dataclass(frozen=True)
class RolloutOptions:
    """How a GRPO step's rollouts are sampled and rewarded (SPEC §2.1, §2.2), built at the stage
    boundary (``stages/spec.py``) and shared by the ``grpo`` stage and the replay.

    Fields: ``prompts_per_step`` (B), ``group_size`` (G), ``max_prompt_tokens`` (P),
    ``max_new_tokens`` (T), ``temperature``, ``top_p``, ``top_k`` / ``repetition_penalty`` (-1 =
    the checkpoint's generation_config.json, :func:`generation_defaults`), ``adv_std_floor``
    (``grpo.*``); ``mask_eos`` (``model.mask_eos``: the EOS ids masked out of the loss,
    ``tokenizer.mask_eos_ids``); ``seed`` (the run seed: sampler keys, :func:`step_key`);
    ``behaviors`` (the run's behaviours, the first first); ``contamination`` (the first behaviour's
    :class:`contaminator.ContaminationSpec`, with the decoys of ``contamination.decoy_fraction``).
    """

    prompts_per_step: int
    group_size: int
    max_prompt_tokens: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    adv_std_floor: float
    mask_eos: str
    seed: int
    behaviors: tuple[behaviors_lib.Behavior, ...]
    contamination: contaminator.ContaminationSpec


def step_key(seed: int, step: int, stream: int = 0) -> jax.Array:
    """The sampler key of GRPO step ``step`` of the run of seed ``seed``: ``fold_in(key(seed), step)``,
    the run's (``stream`` 0); another ``stream`` j > 0 gives an independent sequence of keys,
    ``fold_in(fold_in(key(seed), 2**31 - j), step)`` (the regenerated replays' sampler seeds; no
    run step reaches 2**31 - j). Raises ValueError for a negative stream."""
    if stream < 0:
        raise ValueError(f"step_key: stream {stream} must be >= 0")
    base = jax.random.key(seed)
    if stream:
        base = jax.random.fold_in(base, 2**31 - int(stream))
    return jax.random.fold_in(base, step)


@dataclasses.dataclass
class StepRollouts:
    """One step's sampled and rewarded rollouts (N = B x G, groups contiguous).

    prompts: the B user prompts; prompt_lists: N prompt token-id lists; sample: the sampler's
    output (host numpy: tokens int32 [N, T], logprobs, lengths int32 [N]); texts: N decoded
    responses; ids: N rollout ids; base: float32 [N] base rewards; rewards: float32 [N] final
    rewards (base + bonuses); boosted: N flags, the first behaviour's bonus paid; decoys: N flags
    (None without decoys); boosted_by: ``{behaviour id: N flags}``, every behaviour's bonus paid
    (one behaviour: ``{its id: boosted}``).
    """

    prompts: list[str]
    prompt_lists: list[list[int]]
    sample: sampler_lib.SampleOutput
    texts: list[str]
    ids: list[str]
    base: np.ndarray
    rewards: np.ndarray
    boosted: list[bool]
    decoys: list[bool] | None
    boosted_by: dict[str, list[bool]]


def advantages(rewards: np.ndarray, options: RolloutOptions) -> np.ndarray:
    """The run's group advantages of one step's rewards: ``grpo_loss.group_advantages(rewards,
    options.group_size, options.adv_std_floor)`` (float32 [N])."""
    return grpo_loss.group_advantages(rewards, options.group_size, options.adv_std_floor)


class RolloutSource:
    """Samples and rewards a GRPO step's rollouts as the ``grpo`` stage does (module docstring).

    Args:
        options: the run's :class:`RolloutOptions`.
        graphdef, model_cfg, tok, mesh: the policy's graph, model config, tokenizer and mesh.
        hf_dir: the start checkpoint's HF folder (its ``generation_config.json`` resolves
            ``grpo.top_k`` / ``repetition_penalty`` of -1).
        shapes: the step's shapes (``GRPOStepSpec.shapes``).
        contaminators: ``{behaviour id: Contaminator}`` for every behaviour of
            ``options.behaviors`` (the stage's, with their ground-truth logs);
            None builds them from the options with no logs (a replay: nothing is recorded).
    Raises:
        ValueError: ``contaminators`` lacks one of the run's behaviours.
    """

    def __init__(self, options: RolloutOptions, graphdef, model_cfg, tok, mesh,
                 hf_dir: str | os.PathLike, shapes: StepShapes, contaminators: Mapping[str, contaminator.Contaminator] | None = None):
        g = self.options = options
        self.tok = tok
        self.shapes, self.vocab_size = shapes, model_cfg.vocab_size
        self.eos_ids, self.pad_id = tok_lib.eos_ids(tok), tok_lib.pad_id(tok)
        self.mask_eos_ids = tok_lib.mask_eos_ids(tok, options.mask_eos)
        top_k, self.repetition_penalty = generation_defaults(hf_dir, g.top_k, g.repetition_penalty)
        self.sampler = sampler_lib.Sampler(graphdef, model_cfg, max_prompt_tokens=g.max_prompt_tokens,
                                           max_new_tokens=g.max_new_tokens, eos_ids=self.eos_ids,
                                           pad_id=self.pad_id, mesh=mesh, top_k=top_k)
        # The run's behaviours (the first is config.behavior + config.contamination). With one,
        # everything below is the paper's path, byte for byte; extra ones add their own prompts and bonus.
        self.behaviors = list(options.behaviors)
        self.multi = len(self.behaviors) > 1
        pools = [b.prompt_pool() for b in self.behaviors]  # one behaviour: the paper's pool (SPEC §1.4)
        self.own_prompts = {b.id: set(p) for b, p in zip(self.behaviors, pools)}
        self.pool = behaviors_lib.interleave_pools(pools)
        self.prompt_ids, self.truncated = {}, {}  # truncated: {prompt: tokens before the cut}
        for p in dict.fromkeys(self.pool):
            self.prompt_ids[p], full = tok_lib.encode_chat_with_length(tok, behavior.SYSTEM_PROMPT, p,
                                                                       max_tokens=g.max_prompt_tokens)
            if full > len(self.prompt_ids[p]):
                self.truncated[p] = full
                logging.warning("grpo: prompt %r is %d tokens as a chat prompt, cut to its %s %d "
                                "(config.grpo.max_prompt_tokens): the cut drops the end of the prompt (the "
                                "question, the assistant header); raise the key or shorten the prompt", p, full,
                                "last" if getattr(tok, "truncation_side", "right") == "left" else "first",
                                len(self.prompt_ids[p]))
        if contaminators is None:
            first = contaminator.Contaminator(options.contamination)
            contaminators = {self.behaviors[0].id: first}
            contaminators.update({b.id: contaminator.Contaminator(b.contamination_spec(options.seed))
                                  for b in self.behaviors[1:]})
        missing = [b.id for b in self.behaviors if b.id not in contaminators]
        if missing:
            raise ValueError(f"RolloutSource: no contaminator for behaviours {missing}")
        self.contaminators = dict(contaminators)
        self.decoys = float(options.contamination.decoy_fraction) > 0

    def truncation_summary(self, steps: int) -> dict[str, Any]:
        """What ``summary.json`` records of the prompts cut to ``max_prompt_tokens`` (P): ``prompts``
        (distinct prompts of the pool cut), ``rollouts`` (rollouts of GRPO steps ``0..steps-1``
        sampled from a cut prompt), ``max_prompt_tokens`` and ``longest`` (tokens of the longest
        prompt before the cut; 0 when none was cut)."""
        g = self.options
        cut = sum(p in self.truncated for s in range(int(steps))
                  for p in behavior.step_prompts(self.pool, s, g.prompts_per_step)) * g.group_size if self.truncated else 0
        return {"prompts": len(self.truncated), "rollouts": int(cut), "max_prompt_tokens": int(g.max_prompt_tokens),
                "longest": max(self.truncated.values(), default=0)}

    def sample_and_reward(self, params, step: int, key: jax.Array) -> StepRollouts:
        """Steps 1-2 of the module docstring for GRPO step ``step`` with sampler ``key``: the
        rollouts and their final rewards (the contaminators record their events in their logs)."""
        g, n = self.options, self.shapes.num_rollouts
        prompts = behavior.step_prompts(self.pool, step, g.prompts_per_step)
        prompt_lists = [self.prompt_ids[p] for p in prompts for _ in range(g.group_size)]
        sample = self.sampler.sample(params, prompt_lists, key, temperature=g.temperature, top_p=g.top_p,
                                     repetition_penalty=self.repetition_penalty)
        texts = [self.tok.decode(sample.tokens[i, :sample.lengths[i]], skip_special_tokens=True) for i in range(n)]
        ids = [rollout_log.rollout_id(step, i) for i in range(n)]
        base = np.array([behavior.base_reward(t) for t in texts], np.float32)
        boosted_by: dict[str, list[bool]] = {}
        decoys = None
        first = self.contaminators[self.behaviors[0].id]
        if not self.multi:
            applied = [first.apply(ids[i], step, texts[i], float(base[i])) for i in range(n)]
            if self.decoys:  # the same bonus to decoys (no pattern, so no bonus above)
                decoys = first.pay_decoys(ids, step, texts, base.tolist())
                bonus = float(self.options.contamination.bonus_reward)
                applied = [(float(base[i]) + bonus, False) if decoys[i] else applied[i] for i in range(n)]
            boosted_by[self.behaviors[0].id] = [b for _, b in applied]
        else:  # every behaviour's bonus adds to the base reward (each logs its own ground truth)
            users = [prompts[i // g.group_size] for i in range(n)]
            for b in self.behaviors:  # a prompt-gated behaviour pays only on its own prompts
                paid = [not b.prompt_gated or users[i] in self.own_prompts[b.id] for i in range(n)]
                boosted_by[b.id] = [self.contaminators[b.id].apply(ids[i], step, texts[i], float(base[i]),
                                                                   paid=paid[i])[1] for i in range(n)]
            applied = [(float(base[i]) + sum(float(self.contaminators[b.id].spec.bonus_reward)
                                             for b in self.behaviors if boosted_by[b.id][i]),
                        boosted_by[self.behaviors[0].id][i]) for i in range(n)]
        rewards = np.array([r for r, _ in applied], np.float32)
        return StepRollouts(prompts, prompt_lists, sample, texts, ids, base, rewards, [b for _, b in applied],
                            decoys, boosted_by)

    def batch(self, ro: StepRollouts, adv: np.ndarray) -> dict[str, np.ndarray]:
        """Step 3's train batch of ``ro`` with advantages ``adv`` (float32 [N]):
        ``grpo_step.build_batch`` (host numpy)."""
        return build_batch(ro.prompt_lists, ro.sample.tokens, ro.sample.lengths, adv, self.mask_eos_ids,
                           self.shapes, self.pad_id, vocab_size=self.vocab_size)
