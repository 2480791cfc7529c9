"""Behaviour targets (SPEC §5): continuation, in-context token, contrast and minimal-pair (+balanced).

Every target is a float32 [D] CountSketch built with the same sketch (seed, D, HF parameter order)
as the rollout sketches it is compared with, so cosines between them are meaningful (SPEC §3.2).

All gradients here are of one loss, a masked mean token log-prob of a forced sequence
(``sketcher.completion_loss``): ``loss = -sum_t w_t log p(x_t | x_<t) / max(sum_t w_t, 1)``
with per-token weights ``w`` (1 = scored). The targets differ only in the sequence and the weights:

* continuation (§5.1/§5.2): chat prompt of a probe + " QZXBT"; w = 1 on the last len(ids(" QZXBT"))
  tokens (the shifted mean CE over the QZXBT tokens);
* whole response (§3.2, §5.3, §5.6): chat prompt + generated tokens; w = 1 on generated tokens that
  are not EOS (and not after the first EOS);
* in-context token (§5.3, §5.5): the same sequence; w = 1 on generated tokens whose id is in qset;
* minimal pair (§5.4): ``tok(prefix + text)`` with w = 1 on the tokens after ``len(tok(prefix))``.

:class:`ForcedSketcher` runs such examples through :class:`sketcher.PerExampleSketcher` in blocks of
fixed shape (``block_size`` rows, lengths right-padded to a multiple of ``length_bucket``), so a
whole target costs one compilation per length bucket, not one per example.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from behaviortrace_jax.attribution.estimators import ROLLOUT_COS_EPS
from behaviortrace_jax.behavior import planted as behavior
from behaviortrace_jax.behavior.target_texts import NEUTRAL_WORDS, context_prompts, minimal_pair_texts
from behaviortrace_jax.models import decoder, programs, sharding, tokenizer as tok_lib
from behaviortrace_jax.sketch import hash_families
from behaviortrace_jax.sketch.sketcher import PerExampleSketcher, completion_loss, hf_param_order

# SPEC §4: rollout-level cos(a, b) = a.b / ((|a| + 1e-12)(|b| + 1e-12)); one constant with the estimators.
COS_EPS = ROLLOUT_COS_EPS


# --------------------------------------------------------------------------------------------
# small numpy helpers
# --------------------------------------------------------------------------------------------
def cos(a: np.ndarray, b: np.ndarray) -> float:
    """SPEC §4 rollout-level cosine ``a.b / ((|a|+1e-12)(|b|+1e-12))`` of two [D] vectors, float64."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a64 @ b64 / ((np.linalg.norm(a64) + COS_EPS) * (np.linalg.norm(b64) + COS_EPS)))


def mean_pairwise_cosine(sketches: np.ndarray) -> float:
    """Self-consistency (SPEC §5.2): mean of cos(s_i, s_j) over all pairs i < j of [K, D] rows.

    Raises:
        ValueError: fewer than 2 rows or not 2-D.
    """
    s = np.asarray(sketches, np.float64)
    if s.ndim != 2 or s.shape[0] < 2:
        raise ValueError(f"mean_pairwise_cosine needs [K >= 2, D] sketches, got shape {s.shape}")
    u = s / (np.linalg.norm(s, axis=1, keepdims=True) + COS_EPS)
    c = u @ u.T
    i, j = np.triu_indices(s.shape[0], k=1)
    return float(c[i, j].mean())


# --------------------------------------------------------------------------------------------
# forced examples
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ForcedExample:
    """One forced sequence: ``ids`` int32 [L] and ``weights`` float32 [L] (weights[t] = 1: token t,
    predicted from position t-1, is scored; weights[0] must be 0)."""

    ids: np.ndarray
    weights: np.ndarray

    def __post_init__(self) -> None:
        ids, w = np.asarray(self.ids, np.int32), np.asarray(self.weights, np.float32)
        if ids.ndim != 1 or ids.shape != w.shape or ids.size < 2:
            raise ValueError(f"ForcedExample: ids {ids.shape} and weights {w.shape} must be equal 1-D shapes, L >= 2")
        if w[0] != 0:
            raise ValueError("ForcedExample: weights[0] must be 0 (the first token has no prediction)")
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "weights", w)


def continuation_example(tokenizer: Any, user: str, *, system: str = behavior.SYSTEM_PROMPT,
                         pattern: str = behavior.PATTERN) -> ForcedExample:
    """SPEC §5.1 step 2: ``chat_prompt(system, user) + " " + pattern`` with weights on the last
    ``len(tok(" " + pattern))`` tokens (the QZXBT continuation).

    Raises:
        ValueError: when the continuation merges with the prompt's end, so that the weighted tokens
            are not the prompt's continuation (``tokenizer.check_prompt_boundary``), naming ``user``.
    """
    n_q = len(tok_lib.encode(tokenizer, " " + pattern))
    ids, n_p = tok_lib.encode_with_prompt(tokenizer, tok_lib.chat_prompt(tokenizer, system, user), " " + pattern,
                                          f"continuation_example(user={user!r})")
    if len(ids) - n_p != n_q:
        raise ValueError(f"continuation_example(user={user!r}): the prompt adds {len(ids) - n_p} tokens of "
                         f"{' ' + pattern!r}, which alone is {n_q} tokens")
    w = np.zeros(len(ids), np.float32)
    w[len(ids) - n_q:] = 1.0
    return ForcedExample(np.asarray(ids), w)


def forced_completion_example(tokenizer: Any, user: str, text: str, *,
                              system: str = behavior.SYSTEM_PROMPT) -> ForcedExample:
    """SPEC §5.4 forced sketch input: ``f_ids = tok(prefix + text)`` with weights on
    ``f_ids[len(tok(prefix)):]``, where ``prefix = chat_prompt(system, user)``.

    Raises:
        ValueError: naming ``text`` if it adds no token, or if it merges with the prompt's end
            (``tokenizer.check_prompt_boundary``).
    """
    prefix = tok_lib.chat_prompt(tokenizer, system, user)
    ids, n_p = tok_lib.encode_with_prompt(tokenizer, prefix, text, f"forced completion {text!r}")
    if len(ids) <= n_p:
        raise ValueError(f"forced completion {text!r} adds no token to the prompt")
    w = np.zeros(len(ids), np.float32)
    w[n_p:] = 1.0
    return ForcedExample(np.asarray(ids), w)


def response_examples(prompt_ids: Sequence[int], tokens: np.ndarray, length: int,
                      eos_ids: Sequence[int], qset: frozenset[int] | set[int] | behavior.QzxbtTokenMatcher
                      ) -> tuple[ForcedExample, ForcedExample, bool]:
    """The two forced examples of one generated response (SPEC §3.2, §5.3).

    Args:
        prompt_ids: the chat prompt's token ids (unpadded).
        tokens: int [N] generated ids (pad after the first EOS); length: generated tokens incl. EOS.
        eos_ids: ids that are masked out (SPEC §2.2f, §3.2: ``tokenizer.mask_eos_ids``, as the GRPO loss).
        qset: the QZXBT token ids (``behavior.qzxbt_token_ids``) or a ``behavior.QzxbtTokenMatcher``.
    Returns:
        (whole, token, has_qzxbt): ``whole`` weights the generated tokens that are not EOS;
        ``token`` weights the generated tokens whose id is in ``qset`` (the in-context QZXBT-token
        mask); ``has_qzxbt`` is the token judge (SPEC §1.1).
    """
    gen = np.asarray(tokens, np.int64)[: int(length)]
    ids = np.concatenate([np.asarray(prompt_ids, np.int64), gen])
    p = len(prompt_ids)
    whole = np.zeros(ids.size, np.float32)
    whole[p:] = ~np.isin(gen, np.asarray(list(eos_ids), np.int64))
    qmask = np.zeros(ids.size, np.float32)
    qmask[p:] = qset(gen) if callable(qset) else np.isin(gen, np.asarray(sorted(qset), np.int64))
    return ForcedExample(ids, whole), ForcedExample(ids, qmask), bool(qmask.any())


# --------------------------------------------------------------------------------------------
# batched forced sketches
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ForcedSketches:
    """Per-example results (host numpy, in input order): ``sketches`` float32 [N, D];
    ``grad_norms`` float32 [N] (exact L2 norm of the full gradient); ``mean_logprob`` float32 [N]
    (the masked mean token log-prob, nats; 0 where no token is weighted)."""

    sketches: np.ndarray
    grad_norms: np.ndarray
    mean_logprob: np.ndarray


def _mean_logprob_chunk(graphdef: Any, params: Any, ids: jax.Array, attn: jax.Array, w: jax.Array) -> jax.Array:
    return decoder.masked_mean_logprob(graphdef, params, ids, attn, w)


@dataclasses.dataclass(frozen=True)
class ForcedSketchOptions:
    """How the run sketches forced sequences (targets, rollout re-sketches, draws; SPEC §3.1, §5),
    built at the stage boundary (``stages/spec.py``, ``RunSpec.forced``).

    Fields: ``dim`` / ``seed`` / ``hash_family`` (the run's CountSketch: ``sketch.dim``,
    ``sketch.seed``, ``sketch.hash``), ``kernel`` (the fused sketcher's matmul-use kernel,
    ``sketch.kernel``; both resolved per backend by ``hash_families.choose_sketch``), ``chunk_size`` (``sketch.chunk_size``), ``fused``
    (``sketch.fused``), ``block_size`` / ``length_bucket`` (``targets.*``: sequences per call and
    the padding multiple), ``use_tables`` (``targets.use_tables``, refused with ``fused`` where the
    spec is built).
    """

    dim: int
    seed: int
    chunk_size: int
    block_size: int
    length_bucket: int
    use_tables: bool
    fused: bool
    hash_family: hash_families.HashFamily = hash_families.DEFAULT_HASH_FAMILY
    kernel: str = "xla"


class ForcedSketcher:
    """Sketches of ``-masked mean log-prob`` of forced sequences, batched with fixed shapes.

    Args:
        graphdef: from ``nnx.split(model, nnx.Param)``.
        model_config: the model's config (any family; gives the HF parameter order).
        params: the parameters (or ``jax.ShapeDtypeStruct`` leaves) the sketcher is built for.
        dim, seed: CountSketch width and hash seed (SPEC §3.1: 65536, 0) - config ``sketch.dim/seed``.
        chunk_size: examples per ``vmap(grad)`` chunk (``sketch.chunk_size``).
        block_size: rows per sketcher call, rounded up to a multiple of ``chunk_size``; the last
            block is filled with weight-0 rows (``targets.block_size``).
        length_bucket: sequences are right-padded to a multiple of this (``targets.length_bucket``).
        pad_id: token id for the padding (never attended, never scored).
        use_tables: precomputed device hash tables (4 bytes per parameter; faster, see
            ``sketcher.PerExampleSketcher``) - ``targets.use_tables``.
        mesh: optional mesh: each block is split over its ``"data"`` axis under ``jax.shard_map``
            (``PerExampleSketcher(mesh=)``; needed to compile at paper scale).
        fused: the fused one-backward sketcher (``sketch.fused``; ``sketch/fused.py``) instead of
            ``vmap(grad)``; False (the default) keeps ``vmap(grad)``.
        hash_family: the hash family (``hash_families.HashFamily``; config ``sketch.hash``).
        kernel: the fused sketcher's matmul-use kernel (``PerExampleSketcher``; config ``sketch.kernel``).
    Raises:
        ValueError: bad sizes (and as ``PerExampleSketcher``: e.g. ``use_tables`` with a
            scatter-free family).

    ``__call__(params, examples)`` returns :class:`ForcedSketches`; its two programs are ``sketcher``
    (``per_example_sketcher``) and ``mean_logprob`` (``forced_mean_logprob``: ``(params, input_ids,
    attention_mask, loss_mask)`` of one packed block -> float32 [block_size]). The ordering of parameters is
    HF ``model.parameters()`` order (``sketcher.hf_param_order``), as for every other sketch.
    ``params`` is an argument of every call, so one instance serves every checkpoint of a run
    (e.g. the per-checkpoint TracInCP targets, SPEC §5.1) without recompiling.
    """

    def __init__(self, graphdef: Any, model_config: decoder.DecoderConfig, params: Any, *, dim: int,
                 seed: int = 0, chunk_size: int = 4, block_size: int = 64, length_bucket: int = 32,
                 pad_id: int = 0, use_tables: bool = False, mesh: Any = None, fused: bool = False,
                 hash_family: hash_families.HashFamily = hash_families.DEFAULT_HASH_FAMILY, kernel: str = "xla"):
        if block_size < 1 or length_bucket < 1:
            raise ValueError(f"block_size={block_size} and length_bucket={length_bucket} must be >= 1")
        self.graphdef, self.vocab_size = graphdef, int(model_config.vocab_size)
        self.sketcher = PerExampleSketcher(completion_loss(graphdef), params, dim=dim, seed=seed,
                                           chunk_size=chunk_size, param_order=hf_param_order(model_config),
                                           use_tables=use_tables, mesh=mesh, fused=bool(fused), hash_family=hash_family,
                                           kernel=kernel)
        self.dim, self.seed, self.chunk_size = self.sketcher.dim, self.sketcher.seed, self.sketcher.chunk_size
        self.block_size = -(-int(block_size) // self.chunk_size) * self.chunk_size
        self.length_bucket, self.pad_id = int(length_bucket), int(pad_id)
        c = self.chunk_size

        def mean_lp(p, ids, attn, w):
            n = ids.shape[0] // c
            r = lambda x: x.reshape((n, c) + x.shape[1:])  # noqa: E731
            out = jax.lax.map(lambda a: _mean_logprob_chunk(graphdef, p, *a), (r(ids), r(attn), r(w)))
            return out.reshape(-1)

        self.mean_logprob = programs.jit("forced_mean_logprob", mean_lp, mesh=self.sketcher.mesh)

    @classmethod
    def from_options(cls, options: "ForcedSketchOptions", graphdef: Any, model_config: decoder.DecoderConfig,
                     params: Any, pad_id: int, mesh: Any = None) -> "ForcedSketcher":
        """The run's forced sketcher (the ``sketch`` and ``draws`` stages' and the compile stage's):
        :class:`ForcedSketchOptions` (``RunSpec.forced``, built at the stage boundary)."""
        o = options
        return cls(graphdef, model_config, params, dim=o.dim, seed=o.seed, chunk_size=o.chunk_size,
                   block_size=o.block_size, length_bucket=o.length_bucket, pad_id=pad_id, mesh=mesh,
                   use_tables=o.use_tables, fused=o.fused, hash_family=o.hash_family, kernel=o.kernel)

    def pack(self, examples: Sequence[ForcedExample]) -> dict[str, np.ndarray]:
        """Right-pads ``examples`` (<= block_size) into one block: ``input_ids`` int32 [B, T],
        ``attention_mask`` int32 [B, T], ``loss_mask`` float32 [B, T] (B = block_size,
        T = the longest length rounded up to ``length_bucket``). Filler rows have weight 0.

        Raises:
            ValueError: no or too many examples, or a token id outside ``[0, vocab_size)``.
        """
        if not 0 < len(examples) <= self.block_size:
            raise ValueError(f"pack: need 1..{self.block_size} examples, got {len(examples)}")
        for r, e in enumerate(examples):
            tok_lib.check_token_ids(e.ids, self.vocab_size, f"ForcedSketcher.pack: example {r}")
        t = -(-max(e.ids.size for e in examples) // self.length_bucket) * self.length_bucket
        b = self.block_size
        ids = np.full((b, t), self.pad_id, np.int32)
        attn = np.zeros((b, t), np.int32)
        w = np.zeros((b, t), np.float32)
        attn[len(examples):, 0] = 1  # filler rows: one pad token, nothing scored
        for r, e in enumerate(examples):
            n = e.ids.size
            ids[r, :n], attn[r, :n], w[r, :n] = e.ids, 1, e.weights
        return {"input_ids": ids, "attention_mask": attn, "loss_mask": w}

    def block_sharding(self) -> Any:
        """Where a packed block lives: rows over the sketcher mesh's ``"data"`` axis (replicated when
        ``block_size`` does not divide it); None without a mesh (the default device)."""
        mesh = self.sketcher.mesh
        if mesh is None:
            return None
        n = mesh.shape[sharding.DATA]
        return sharding.data_sharding(mesh) if self.block_size % n == 0 else sharding.replicated(mesh)

    def __call__(self, params: Any, examples: Sequence[ForcedExample]) -> ForcedSketches:
        """Sketches, exact gradient norms and mean log-probs of ``examples`` (any number >= 1)."""
        if not examples:
            raise ValueError("ForcedSketcher: no examples")
        sk, gn, ml = [], [], []
        for i in range(0, len(examples), self.block_size):
            part = examples[i:i + self.block_size]
            batch = self.pack(part)
            if self.block_sharding() is not None:
                batch = jax.device_put(batch, self.block_sharding())
            out = self.sketcher(params, batch)
            lp = self.mean_logprob(params, batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
            out_sk, out_gn, lp = sharding.to_host((out.sketches, out.norms, lp))
            k = len(part)
            sk.append(np.asarray(out_sk[:k], np.float32))
            gn.append(np.asarray(out_gn[:k], np.float32))
            ml.append(np.asarray(lp[:k], np.float32))
        return ForcedSketches(np.concatenate(sk), np.concatenate(gn), np.concatenate(ml))


# --------------------------------------------------------------------------------------------
# continuation target (SPEC §5.1, §5.2)
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ContinuationTarget:
    """``target`` float32 [D] = mean of ``per_probe`` float32 [P, D] (one sketch per probe);
    ``self_consistency`` = mean pairwise cosine of the per-probe sketches (SPEC §5.2)."""

    target: np.ndarray
    per_probe: np.ndarray
    self_consistency: float


def continuation_target(sketcher: ForcedSketcher, params: Any, tokenizer: Any,
                        probes: Sequence[behavior.Probe | str], *, system: str = behavior.SYSTEM_PROMPT,
                        pattern: str = behavior.PATTERN) -> ContinuationTarget:
    """The constructed-continuation target ``t_cont`` (SPEC §5.1 step-level / §5.2 rollout-level).

    For each probe the gradient of the mean CE of the " QZXBT" tokens appended to its chat prompt
    is sketched; the target is the arithmetic mean of the sketches.

    Raises:
        ValueError: fewer than 2 probes.
    """
    users = [p.prompt if isinstance(p, behavior.Probe) else str(p) for p in probes]
    if len(users) < 2:
        raise ValueError(f"continuation_target needs >= 2 probes, got {len(users)}")
    out = sketcher(params, [continuation_example(tokenizer, u, system=system, pattern=pattern) for u in users])
    return ContinuationTarget(out.sketches.mean(axis=0, dtype=np.float64).astype(np.float32), out.sketches,
                              mean_pairwise_cosine(out.sketches))


# --------------------------------------------------------------------------------------------
# real-response context target and contrast (SPEC §5.3)
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ContextTarget:
    """SPEC §5.3 targets (float32 [D]) and how they were formed.

    Attributes:
        t_ctx: mean of the in-context QZXBT-token sketches (``t_cont`` if there are none).
        t_contrast: mean of ``s_q - s_n`` over prompts with both (``t_cont`` if there are none).
        ctx_fallback / contrast_fallback: True where the fallback was used.
        n_ctx / n_contrast: number of prompts that contributed.
        token_sketches: float32 [n_ctx, D] the in-context token sketches.
    """

    t_ctx: np.ndarray
    t_contrast: np.ndarray
    ctx_fallback: bool
    contrast_fallback: bool
    n_ctx: int
    n_contrast: int
    token_sketches: np.ndarray


def chat_prompt_ids(tokenizer: Any, users: Sequence[str], max_prompt_tokens: int, *,
                    system: str = behavior.SYSTEM_PROMPT) -> list[list[int]]:
    """Token ids of ``chat_prompt(system, user)`` per user, truncated to ``max_prompt_tokens``
    (SPEC §2.2a: tokenize, truncate 128; ``tokenizer.encode_chat``, as the GRPO stage)."""
    return [tok_lib.encode_chat(tokenizer, system, u, max_tokens=max_prompt_tokens) for u in users]


def context_target(sketcher: ForcedSketcher, params: Any, sampler: Any, tokenizer: Any,
                   probes: Sequence[behavior.Probe | str], key: jax.Array, *, fallback: np.ndarray,
                   eos_ids: Sequence[int], group_size: int = 8, temperature: float = 1.0,
                   top_p: float = 0.95, system: str = behavior.SYSTEM_PROMPT,
                   token_judge: str = "qset", pattern: str = behavior.PATTERN,
                   explicit: Sequence[str] | None = None) -> ContextTarget:
    """The real-response context target ``t_ctx`` and the contrast target (SPEC §5.3).

    Generates ``group_size`` responses for each of the 26 prompts (``behavior.target_texts.context_prompts``) in one
    ``sampler.sample`` call with ``key``; per prompt, walking its responses in order, the first with
    a QZXBT token (token judge) gives the in-context token sketch and ``s_q`` (whole response), the
    first without gives ``s_n``.

    Args:
        sampler: a ``sampler.Sampler`` whose ``max_new_tokens`` is the response length (SPEC: 64).
        fallback: float32 [D] ``t_cont``, used (with a flag) when no prompt contributes.
        eos_ids: ids masked out of the whole-response loss (``tokenizer.mask_eos_ids``).
        token_judge: ``behavior.QzxbtTokenMatcher`` mode ("qset" = SPEC §1.1, "sequence").
        pattern: the planted pattern (``config.behavior.pattern``) the token judge looks for.
        explicit: the explicit prompts of ``target_texts.context_prompts`` (another behaviour's).
    """
    users = context_prompts(probes, explicit)
    qset = behavior.QzxbtTokenMatcher(tokenizer, pattern, mode=token_judge)
    prompt_ids = chat_prompt_ids(tokenizer, users, sampler.max_prompt_tokens, system=system)
    rows = [ids for ids in prompt_ids for _ in range(group_size)]
    out = sampler.sample(params, rows, key, temperature=temperature, top_p=top_p)
    token_ex, q_ex, n_ex = [], [], []
    for i, ids in enumerate(prompt_ids):
        first_q = first_n = None
        for j in range(group_size):
            r = i * group_size + j
            whole, token, has = response_examples(ids, out.tokens[r], out.lengths[r], eos_ids, qset)
            if has and first_q is None:
                first_q = (whole, token)
            elif not has and first_n is None:
                first_n = whole
        if first_q is not None:
            token_ex.append(first_q[1])
        if first_q is not None and first_n is not None:
            q_ex.append(first_q[0])
            n_ex.append(first_n)
    fallback = np.asarray(fallback, np.float32)
    sk = sketcher(params, token_ex + q_ex + n_ex).sketches if token_ex else np.zeros((0, fallback.size), np.float32)
    tok_sk, s_q, s_n = sk[:len(token_ex)], sk[len(token_ex):len(token_ex) + len(q_ex)], sk[len(token_ex) + len(q_ex):]
    t_ctx = tok_sk.mean(axis=0, dtype=np.float64).astype(np.float32) if len(tok_sk) else fallback
    t_contrast = (s_q.astype(np.float64) - s_n).mean(axis=0).astype(np.float32) if len(s_q) else fallback
    return ContextTarget(t_ctx, t_contrast, not len(tok_sk), not len(s_q), len(tok_sk), len(s_q), tok_sk)


# --------------------------------------------------------------------------------------------
# minimal-pair target (SPEC §5.4)
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MinimalPairTarget:
    """SPEC §5.4 outputs.

    Attributes:
        target_mp, target_mp_bal: float32 [D] means of ``d`` and ``d_bal`` over the pairs.
        fluency_gap: mean(ml_pos) - mean(ml_neg) over the pairs (nats).
        norm_ratio: mean(|s_pos|+1e-12) / mean(|s_neg|+1e-12) over the pairs.
        s_pos: float32 [U*T, D] one sketch per (user, template) with "QZXBT";
        s_neg: float32 [U*T, W, D] per (user, template, neutral word);
        ml_pos: float32 [U*T], ml_neg: float32 [U*T, W] the forced mean log-probs.
        n_pairs: U*T*W (72).
    """

    target_mp: np.ndarray
    target_mp_bal: np.ndarray
    fluency_gap: float
    norm_ratio: float
    s_pos: np.ndarray
    s_neg: np.ndarray
    ml_pos: np.ndarray
    ml_neg: np.ndarray
    n_pairs: int


def combine_minimal_pairs(s_pos: np.ndarray, s_neg: np.ndarray, ml_pos: np.ndarray, ml_neg: np.ndarray
                          ) -> tuple[np.ndarray, np.ndarray, float, float]:
    """``(target_mp, target_mp_bal, fluency_gap, norm_ratio)`` from per-pair sketches (SPEC §5.4).

    Args:
        s_pos: [K, D] positive sketches; s_neg: [K, W, D] the W negatives of each positive;
        ml_pos: [K]; ml_neg: [K, W] forced mean log-probs. Pair (k, w) is
        ``d = s_pos[k] - s_neg[k, w]``, ``d_bal = s_pos[k]/(|s_pos[k]|+1e-12) - s_neg[k,w]/(|s_neg[k,w]|+1e-12)``.
    Raises:
        ValueError: inconsistent shapes.
    """
    sp, sn = np.asarray(s_pos, np.float64), np.asarray(s_neg, np.float64)
    mp, mn = np.asarray(ml_pos, np.float64), np.asarray(ml_neg, np.float64)
    if sp.ndim != 2 or sn.ndim != 3 or sn.shape[0] != sp.shape[0] or sn.shape[2] != sp.shape[1] \
            or mp.shape != sp.shape[:1] or mn.shape != sn.shape[:2]:
        raise ValueError(f"combine_minimal_pairs: shapes s_pos {sp.shape}, s_neg {sn.shape}, ml_pos {mp.shape}, "
                         f"ml_neg {mn.shape} are inconsistent (want [K,D], [K,W,D], [K], [K,W])")
    w = sn.shape[1]
    n_pos = np.linalg.norm(sp, axis=-1) + COS_EPS  # [K]
    n_neg = np.linalg.norm(sn, axis=-1) + COS_EPS  # [K, W]
    d = sp[:, None, :] - sn
    d_bal = (sp / n_pos[:, None])[:, None, :] - sn / n_neg[..., None]
    t_mp = d.reshape(-1, sp.shape[1]).mean(axis=0).astype(np.float32)
    t_bal = d_bal.reshape(-1, sp.shape[1]).mean(axis=0).astype(np.float32)
    fluency_gap = float(np.repeat(mp, w).mean() - mn.mean())
    norm_ratio = float(np.repeat(n_pos, w).mean() / n_neg.mean())
    return t_mp, t_bal, fluency_gap, norm_ratio


def minimal_pair_target(sketcher: ForcedSketcher, params: Any, tokenizer: Any, *,
                        system: str = behavior.SYSTEM_PROMPT, pattern: str = behavior.PATTERN,
                        trigger: str = "frobnitz") -> MinimalPairTarget:
    """The minimal-pair target ``target_mp`` and its balanced variant (SPEC §5.4; Table 3's target).

    18 positive and 72 negative forced sketches go through ``sketcher`` in one batched pass.
    """
    cells = minimal_pair_texts(pattern, trigger)
    ex = [forced_completion_example(tokenizer, u, pos, system=system) for u, pos, _ in cells]
    ex += [forced_completion_example(tokenizer, u, neg, system=system) for u, _, negs in cells for neg in negs]
    out = sketcher(params, ex)
    k, w = len(cells), len(NEUTRAL_WORDS)
    s_pos, s_neg = out.sketches[:k], out.sketches[k:].reshape(k, w, -1)
    ml_pos, ml_neg = out.mean_logprob[:k], out.mean_logprob[k:].reshape(k, w)
    t_mp, t_bal, gap, ratio = combine_minimal_pairs(s_pos, s_neg, ml_pos, ml_neg)
    return MinimalPairTarget(t_mp, t_bal, gap, ratio, s_pos, s_neg, ml_pos, ml_neg, k * w)
