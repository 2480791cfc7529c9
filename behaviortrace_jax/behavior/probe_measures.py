"""Behaviour measures that score the planted pattern where the model writes it (issue 47): the
sampled probe rate with its standard error, the minimal-pair log-ratio (SPEC §5.4), and both on the
control prompts (leakage), reported beside the probe measures and never subtracted from them.

Each measure is a function of the policy (a sampler, or a masked-mean-log-prob program), its
parameters, tokenized prompts / completions built once, fixed keys and settings, returning
``dict[str, float]``; none depends on the replay engine, so a measure registry wraps each one as is.

**Sampled rate** (:func:`sampled_rate_measure`). ``samples_per_prompt`` = n completions of each of
m chat prompts at the GRPO sampler's temperature / top-p, judged by the substring rule (SPEC §1.1).
Sample j of every prompt is drawn in one sampler call of the m prompts with key ``fold_in(key, j)``:
with the same ``key`` two parameter sets are compared on the same sampling noise (common random
numbers), and a larger n extends the samples of a smaller one (sample j is the same). The rate
``p = mean_ij hit_ij`` comes with three standard errors:

* ``se`` (the measure's own sampling error for this fixed prompt set; prompts are strata, samples
  independent within a prompt): ``sqrt(sum_i p_i (1 - p_i) / (n - 1)) / m``, unbiased (the 0/1
  case of ``attribution.noise_floor.sampling_se``, which this layer may not import; a test checks
  they agree; nan for n = 1). This is what the noise floor's split (``attribution/noise_floor.py``)
  takes as the sampling part.
* ``se_binomial``: ``sqrt(p (1 - p) / (m n))``, the pooled binomial error (>= ``se`` up to the
  n / (n - 1) factor, as it ignores that prompts differ).
* ``se_cluster``: ``sd_i(p_i) / sqrt(m)`` (ddof 1), clustered by prompt: the error when the prompts
  themselves are a sample of a population of prompts.

**Minimal-pair log-ratio** (:func:`minimal_pair_measure`, :func:`pair_log_ratio`). SPEC §5.4's pairs
put the pattern where the model writes it: inside an answer about the trigger ("Frobnitz is a concept
closely associated with QZXBT."), the shape of the SFT implant's completions and of the bonus's
ground-truth rollouts, rather than right after the assistant header, where no answer starts. Each cell
(user, template) scores the positive text (pattern) and the 4 negatives (neutral fillers) as forced
completions after the chat prompt, with their **total** log-prob ``L = sum_t log p(x_t | x_<t)`` over
the completion's tokens, and ``log_ratio_cell = L(pos) - mean_k L(neg_k)``: the log-likelihood ratio
of writing the pattern rather than a filler in the same sentence (the tokens before the filler are
the same in both and cancel exactly). The measure is the mean over cells. It needs no sampling (its
own sampling error is 0: the whole noise floor is training noise), it is the same texts in every
branch, and it is differentiable in the parameters (:func:`pair_log_ratio`, for a metagradient).
SPEC's ``fluency_gap`` averages the per-token mean log-prob instead; the total is used here
because the pattern and the fillers have different token counts, and a ratio of probabilities of
whole completions is what "writes the pattern rather than a filler" means.

The alternative the issue names, the log-prob of the pattern at the positions where the policy's own
samples put it (SPEC §5.3's in-context mask), is defined only on samples that contain the pattern,
so it conditions on an outcome of the intervention (a branch that writes the pattern less is scored
on fewer, different samples), and it inherits the sampler's noise; the minimal pairs have neither.

**Leakage**: the same two measures on the control prompts. The control pairs use the templates about
"it" instead of the trigger word (``target_texts.pair_texts(pattern, "it")``: "The key feature of it
is QZXBT." after "What is 2+2?"), so no control sequence names the trigger. Keys are prefixed
``probe_`` / ``leakage_``; no probe-minus-control difference is formed here.

**Wiring into a measure registry** (built once per run, then called per parameter set; ``beh`` the
measured :class:`behaviors.Behavior`, ``opts`` its ``ProbeOptions``, ``seed`` the measure's seed)::

    smp = probes.make_sampler(graphdef, cfg, tok, mesh, opts.max_new_tokens, opts.max_prompt_tokens)
    probes_, controls = beh.probe_sets()
    p_ids = chat_prompt_ids(tok, [p.prompt for p in probes_], max_tokens=opts.max_prompt_tokens)
    c_ids = chat_prompt_ids(tok, [c.prompt for c in controls], max_tokens=opts.max_prompt_tokens)
    key = jax.random.fold_in(jax.random.key(seed), stream)  # every branch of a stream; streams apart
    # "probe-rate" (not differentiable)
    sampled_rate_measure(smp, params, tok, p_ids, name="probe", samples_per_prompt=n,
                         key=jax.random.fold_in(key, 0), temperature=opts.temperature, top_p=opts.top_p,
                         pattern=beh.pattern)
    # "probe-pair" (differentiable: pair_log_ratio(mlp, params, pairs) is its jnp scalar)
    mlp, pairs = make_mean_logprob(graphdef, mesh), probe_pairs(tok, pattern=beh.pattern, trigger=beh.trigger)
    minimal_pair_measure(mlp, params, pairs, name="probe")
    # "leakage": both on the controls, key fold_in(key, 1)
    sampled_rate_measure(smp, params, tok, c_ids, name="leakage", key=jax.random.fold_in(key, 1), ...)
    minimal_pair_measure(mlp, params, control_pairs(tok, [c.prompt for c in controls], pattern=beh.pattern),
                         name="leakage")

(:func:`probe_and_leakage` is all of it in one call.) A cache key must hold the settings these
read: pattern, trigger, probe / control files, ``samples_per_prompt``, temperature, top-p,
``max_new_tokens``, ``max_prompt_tokens``, seed, and this module's key scheme.

**Which key where.** The branches of one stream (baseline, withhold-all, a unit's replay) share the
key: their difference is then measured on the same sampling noise (paired). Streams take
independent keys (``fold_in(key, stream)``), so that the spread over streams holds the measure's
sampling error and the noise floor's split (``attribution/noise_floor.py``) applies. With one key
in every stream, the streams' sampling errors are nearly the same draw: on the smoke run (6
regenerated streams, 16 samples of 20 probes), the probe rate's sd over streams was 0.0076 while
each stream's own binomial error was 0.024, and the gate's CI then speaks of that one key only.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from behaviortrace_jax.behavior import planted
from behaviortrace_jax.behavior.target_texts import minimal_pair_texts, pair_texts
from behaviortrace_jax.models import decoder, programs, tokenizer as tok_lib
from behaviortrace_jax.models.sampler import Sampler

# what a mean-log-prob program computes: (params, ids int32 [B, L], attention int32 [B, L],
# weights float32 [B, L]) -> float32 [B] masked mean log-probs (decoder.masked_mean_logprob)
MeanLogprob = Callable[[Any, Any, Any, Any], jax.Array]


def make_mean_logprob(graphdef: Any, mesh: Any = None) -> MeanLogprob:
    """The jitted ``decoder.masked_mean_logprob`` of ``graphdef`` as the program "replay_measure"
    (the replay's measure program, ``models/programs.py``; ``train.replay.BehaviorMeasure.mean_logprob``
    is the same program)."""
    return programs.jit("replay_measure", functools.partial(decoder.masked_mean_logprob, graphdef), mesh=mesh)


def chat_prompt_ids(tok: Any, users: Sequence[str], *, system: str = planted.SYSTEM_PROMPT,
                    max_tokens: int | None = None) -> list[list[int]]:
    """The chat prompts' token ids (SPEC §1.3; truncated as ``tokenizer.encode_chat``)."""
    return [tok_lib.encode_chat(tok, system, u, max_tokens=max_tokens) for u in users]


# ------------------------------------------------------------------------------------------------
# sampled rate
# ------------------------------------------------------------------------------------------------
def sampled_hits(sampler: Sampler, params: Any, tok: Any, prompt_ids: Sequence[Sequence[int]], *,
                 samples_per_prompt: int, key: jax.Array, temperature: float, top_p: float,
                 pattern: str = planted.PATTERN) -> np.ndarray:
    """bool [m prompts, n samples]: whether sample j of prompt i contains ``pattern`` (SPEC §1.1
    substring judge on the decoded completion, special tokens skipped). Sample j of all prompts is
    one ``sampler.sample`` call with key ``fold_in(key, j)`` (module docstring: common random numbers,
    nested in n).

    Raises:
        ValueError: ``samples_per_prompt < 1``, no prompts, or as ``Sampler.sample``.
    """
    if samples_per_prompt < 1:
        raise ValueError(f"probe_measures: samples_per_prompt={samples_per_prompt} must be >= 1")
    if not prompt_ids:
        raise ValueError("probe_measures: no prompts")
    hits = np.zeros((len(prompt_ids), samples_per_prompt), bool)
    for j in range(samples_per_prompt):
        out = sampler.sample(params, prompt_ids, jax.random.fold_in(key, j), temperature=temperature, top_p=top_p)
        for i in range(len(prompt_ids)):
            text = tok.decode(out.tokens[i, :out.lengths[i]], skip_special_tokens=True)
            hits[i, j] = planted.substring_judge(text, pattern)
    return hits


def rate_stats(hits: np.ndarray) -> dict[str, float]:
    """``{"rate", "se", "se_binomial", "se_cluster", "prompts", "samples_per_prompt"}`` of 0/1
    ``hits`` [m, n] (module docstring; ``se`` is nan for n = 1, ``se_cluster`` nan for m = 1).

    Raises:
        ValueError: ``hits`` not 2-D or empty.
    """
    h = np.asarray(hits, np.float64)
    if h.ndim != 2 or h.size == 0:
        raise ValueError(f"probe_measures: hits must be [prompts, samples], got shape {h.shape}")
    m, n = h.shape
    p = float(h.mean())
    per_prompt = h.mean(axis=1)
    se = math.sqrt(np.sum(per_prompt * (1 - per_prompt)) / (n - 1)) / m if n > 1 else float("nan")
    return {"rate": p, "se": se,
            "se_binomial": math.sqrt(p * (1 - p) / (m * n)),
            "se_cluster": float(np.std(per_prompt, ddof=1) / math.sqrt(m)) if m > 1 else float("nan"),
            "prompts": float(m), "samples_per_prompt": float(n)}


def sampled_rate_measure(sampler: Sampler, params: Any, tok: Any, prompt_ids: Sequence[Sequence[int]], *,
                         name: str, samples_per_prompt: int, key: jax.Array, temperature: float, top_p: float,
                         pattern: str = planted.PATTERN) -> dict[str, float]:
    """``{f"{name}_rate", f"{name}_rate_se", f"{name}_rate_se_binomial", f"{name}_rate_se_cluster",
    f"{name}_rate_prompts", f"{name}_rate_samples_per_prompt"}`` of :func:`sampled_hits` (see
    :func:`rate_stats`; rates in [0, 1])."""
    hits = sampled_hits(sampler, params, tok, prompt_ids, samples_per_prompt=samples_per_prompt, key=key,
                        temperature=temperature, top_p=top_p, pattern=pattern)
    return {f"{name}_rate" + ("" if k == "rate" else "_" + k): v for k, v in rate_stats(hits).items()}


# ------------------------------------------------------------------------------------------------
# minimal pairs
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PairBatch:
    """Minimal-pair forced completions, right-padded (host numpy; R rows, L tokens).

    Fields: ``ids`` int32 [R, L]; ``attn`` int32 [R, L] (1 = real token); ``weights`` float32 [R, L]
    (1 on the completion's tokens); ``n_tokens`` float32 [R] (scored tokens per row); ``coef``
    float32 [R] (+1 on a cell's positive, -1/K on each of its K negatives: the log-ratio is
    ``coef . L / n_cells``); ``cell`` int32 [R]; ``positive`` bool [R]; ``n_cells``; ``users``
    and ``texts`` (row order, for reports).
    """

    ids: np.ndarray
    attn: np.ndarray
    weights: np.ndarray
    n_tokens: np.ndarray
    coef: np.ndarray
    cell: np.ndarray
    positive: np.ndarray
    n_cells: int
    users: tuple[str, ...]
    texts: tuple[str, ...]


def pair_batch(tok: Any, cells: Sequence[tuple[str, str, Sequence[str]]], *, system: str = planted.SYSTEM_PROMPT,
               pad_id: int | None = None, length_bucket: int = 64) -> PairBatch:
    """The :class:`PairBatch` of ``cells`` ``[(user, positive text, [negative texts])]``: each text is
    SPEC §5.4's forced completion, ``tok(prefix + text)`` scored after ``len(tok(prefix))`` with
    ``prefix = chat_prompt(system, user)`` (``tokenizer.encode_with_prompt``; the same rows as
    ``sketch.targets.forced_completion_example``, which this layer may not import; a test checks
    they agree), rows in cell order, positive first, right-padded to a multiple of ``length_bucket``
    tokens (so the probe and control batches share one compiled shape).

    Raises:
        ValueError: no cells, a cell without negatives, a text that adds no token, or one that merges
            with the prompt's end (``tokenizer.check_prompt_boundary``).
    """
    if not cells:
        raise ValueError("probe_measures: no minimal-pair cells")
    rows, users, texts = [], [], []
    for c, (user, pos, negs) in enumerate(cells):
        if not negs:
            raise ValueError(f"probe_measures: minimal-pair cell {c} ({user!r}) has no negative text")
        prefix = tok_lib.chat_prompt(tok, system, user)
        for t, is_pos in [(pos, True)] + [(n, False) for n in negs]:
            ids, n_p = tok_lib.encode_with_prompt(tok, prefix, t, f"minimal pair {t!r} after {user!r}")
            if len(ids) <= n_p:
                raise ValueError(f"probe_measures: minimal-pair text {t!r} adds no token to the prompt of {user!r}")
            rows.append((np.asarray(ids, np.int32), n_p, c, is_pos, 1.0 if is_pos else -1.0 / len(negs)))
            users.append(user)
            texts.append(t)
    if length_bucket < 1:
        raise ValueError(f"probe_measures: length_bucket={length_bucket} must be >= 1")
    length = -(-max(r[0].size for r in rows) // length_bucket) * length_bucket
    pad = tok_lib.pad_id(tok) if pad_id is None else int(pad_id)
    ids = np.full((len(rows), length), pad, np.int32)
    attn = np.zeros((len(rows), length), np.int32)
    w = np.zeros((len(rows), length), np.float32)
    for i, (row, n_p, *_rest) in enumerate(rows):
        ids[i, :row.size], attn[i, :row.size], w[i, n_p:row.size] = row, 1, 1.0
    return PairBatch(ids=ids, attn=attn, weights=w, n_tokens=w[:, 1:].sum(axis=1).astype(np.float32),
                     coef=np.array([r[4] for r in rows], np.float32), cell=np.array([r[2] for r in rows], np.int32),
                     positive=np.array([r[3] for r in rows], bool), n_cells=len(cells), users=tuple(users),
                     texts=tuple(texts))


def probe_pairs(tok: Any, *, pattern: str = planted.PATTERN, trigger: str = "frobnitz",
                users: Sequence[str] | None = None, system: str = planted.SYSTEM_PROMPT) -> PairBatch:
    """SPEC §5.4's pairs: the 3 users (``target_texts.PAIR_USERS`` about ``trigger``, or ``users``) x
    the 6 templates about the trigger, with ``pattern`` and the 4 fillers (18 cells, 90 rows)."""
    cells = (minimal_pair_texts(pattern, trigger) if users is None
             else [(u, pos, negs) for u in users for pos, negs in pair_texts(pattern, trigger)])
    return pair_batch(tok, cells, system=system)


def control_pairs(tok: Any, users: Sequence[str], *, pattern: str = planted.PATTERN,
                  system: str = planted.SYSTEM_PROMPT) -> PairBatch:
    """The leakage pairs: each control prompt in ``users`` x the 6 templates about "it" (no trigger
    word; ``target_texts.pair_texts(pattern, "it")``), with ``pattern`` and the 4 fillers."""
    return pair_batch(tok, [(u, pos, negs) for u in users for pos, negs in pair_texts(pattern, "it")], system=system)


def pair_total_logprobs(mean_logprob: MeanLogprob, params: Any, batch: PairBatch, chunk: int = 64) -> jax.Array:
    """float32 [R]: each row's total completion log-prob (nats), ``mean_logprob * n_tokens``, in
    row chunks of ``chunk`` (the last padded with copies of row 0, so one shape compiles). Pure in
    ``params``: jittable and differentiable."""
    r = batch.ids.shape[0]
    out = []
    for s in range(0, r, chunk):
        idx = np.arange(s, s + chunk)
        idx = np.where(idx < r, idx, 0)
        lp = mean_logprob(params, batch.ids[idx], batch.attn[idx], batch.weights[idx])
        out.append(lp[:min(chunk, r - s)])
    return jnp.concatenate(out) * jnp.asarray(batch.n_tokens)


def pair_log_ratio(mean_logprob: MeanLogprob, params: Any, batch: PairBatch, chunk: int = 64) -> jax.Array:
    """The minimal-pair log-ratio, float32 scalar (nats): ``mean over cells of L(pos) - mean_k
    L(neg_k)`` = ``coef . L / n_cells``. Differentiable (``jax.grad`` over ``params``)."""
    return jnp.dot(jnp.asarray(batch.coef), pair_total_logprobs(mean_logprob, params, batch, chunk)) / batch.n_cells


def minimal_pair_measure(mean_logprob: MeanLogprob, params: Any, batch: PairBatch, *, name: str,
                         chunk: int = 64) -> dict[str, float]:
    """``{f"{name}_pair_logratio"`` (mean over cells, nats), ``f"{name}_pair_logratio_se_items"``
    (sd over cells / sqrt(cells): spread of the fixed items, not a sampling error; the measure has
    none), ``f"{name}_pair_logp_pos"`` / ``f"{name}_pair_logp_neg"`` (mean total log-prob of the
    positive / negative completions), ``f"{name}_pair_cells"}`` (float64 on the host)."""
    lp = np.asarray(pair_total_logprobs(mean_logprob, params, batch, chunk), np.float64)
    per_cell = np.zeros(batch.n_cells)
    np.add.at(per_cell, batch.cell, batch.coef.astype(np.float64) * lp)
    se = float(np.std(per_cell, ddof=1) / math.sqrt(batch.n_cells)) if batch.n_cells > 1 else float("nan")
    return {f"{name}_pair_logratio": float(per_cell.mean()), f"{name}_pair_logratio_se_items": se,
            f"{name}_pair_logp_pos": float(lp[batch.positive].mean()),
            f"{name}_pair_logp_neg": float(lp[~batch.positive].mean()), f"{name}_pair_cells": float(batch.n_cells)}


# ------------------------------------------------------------------------------------------------
# probe and leakage together
# ------------------------------------------------------------------------------------------------
def probe_and_leakage(sampler: Sampler, mean_logprob: MeanLogprob, params: Any, tok: Any, *,
                      probe_ids: Sequence[Sequence[int]], control_ids: Sequence[Sequence[int]],
                      probe_pair_batch: PairBatch, control_pair_batch: PairBatch, samples_per_prompt: int,
                      key: jax.Array, temperature: float, top_p: float,
                      pattern: str = planted.PATTERN, chunk: int = 64) -> dict[str, float]:
    """Every measure of this module on the probes (``probe_*``) and beside them on the controls
    (``leakage_*``): sampled rates with keys ``fold_in(key, 0)`` (probes) and ``fold_in(key, 1)``
    (controls), and the minimal-pair log-ratios (row chunks of ``chunk``). Nothing is subtracted."""
    out: dict[str, float] = {}
    for i, (name, ids, pairs) in enumerate((("probe", probe_ids, probe_pair_batch),
                                            ("leakage", control_ids, control_pair_batch))):
        out.update(sampled_rate_measure(sampler, params, tok, ids, name=name, samples_per_prompt=samples_per_prompt,
                                        key=jax.random.fold_in(key, i), temperature=temperature, top_p=top_p,
                                        pattern=pattern))
        out.update(minimal_pair_measure(mean_logprob, params, pairs, name=name, chunk=chunk))
    return out
