"""KV-cache sampler for the policy (any model family): jitted prefill + ``lax.while_loop`` decode (SPEC §2.1, §2.2b).

The rollouts of a GRPO step are ``generate(do_sample, temperature 0.9, top_p 0.9, pad = EOS,
64 new tokens)`` on prompts truncated to 128 tokens (SPEC §2.1). Here:

* prompts are LEFT padded to the smallest *bucket* length (powers of two from 16 up to
  ``max_prompt_tokens``) so a run compiles once per bucket, not once per prompt length;
* ``prefill`` (one jit) writes the prompt into a fixed-size KV cache of ``P + max_new - 1`` slots
  and samples the first token; ``decode`` (a second jit, a ``lax.while_loop``) samples the rest,
  stopping early once every row has emitted an EOS;
* the logits pipeline follows transformers' ``generate``: repetition penalty (off by default), then
  for sampling ``logits / temperature``, top-k (off by default), top-p (keep the smallest set of
  tokens whose cumulative probability reaches ``top_p``, always keeping the top token); temperature
  0 is greedy (argmax after the repetition penalty, like ``do_sample=False``);
* ``logprobs`` are ``log_softmax`` of the RAW model logits (temperature 1, no filtering) at the
  sampled token: the policy log-probability pi_theta(token | prefix) that the GRPO loss recomputes
  (SPEC §2.2f), not the log-probability under the tempered / truncated sampling distribution.

Parameters are an argument of every call (never closed over), so the GRPO loop passes updated
parameters without recompiling. With a mesh, rows are sharded over the ``"data"`` axis and the
parameters keep whatever sharding they have (e.g. ``sharding.shard_params``).
"""
from __future__ import annotations

import collections
import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from behaviortrace_jax.models import decoder, programs, sharding as shd, tokenizer as tok_lib


@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """Sampled completions (host numpy arrays; B = number of prompts, N = ``max_new_tokens``).

    Attributes:
        tokens: [B, N] int32 generated ids; after a row's first EOS every slot is ``pad_id``.
        logprobs: [B, N] float32 ``log_softmax(raw logits)[token]`` (nats); 0 after the first EOS
            (the EOS itself keeps its log-prob).
        lengths: [B] int32 generated tokens up to and including the first EOS (N if none).
        prompt_tokens: [B, P] int32 the prompts LEFT padded with ``pad_id`` to the bucket length P.
        prompt_mask: [B, P] int32, 1 on real prompt tokens.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    prompt_tokens: np.ndarray
    prompt_mask: np.ndarray

    @property
    def completion_mask(self) -> np.ndarray:
        """[B, N] bool: True on generated tokens up to and including the first EOS."""
        return np.arange(self.tokens.shape[1])[None, :] < self.lengths[:, None]


def prompt_buckets(max_prompt_tokens: int, min_bucket: int = 16) -> tuple[int, ...]:
    """Padded prompt lengths: powers of two from ``min_bucket`` below ``max_prompt_tokens``, then it.

    E.g. 128 -> (16, 32, 64, 128); 100 -> (16, 32, 64, 100).
    """
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens={max_prompt_tokens} must be >= 1")
    out, b = [], min_bucket
    while b < max_prompt_tokens:
        out.append(b)
        b *= 2
    return tuple(out) + (max_prompt_tokens,)


def top_p_filter(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """transformers ``TopPLogitsWarper``: logits [B, V] -> [B, V] with dropped tokens at -inf.

    Sorted ascending, a token is dropped when the cumulative probability up to and including it is
    ``<= 1 - top_p``; the most likely token is always kept. Tokens tied with the least likely kept
    token are kept as well (HF breaks such ties by sort order).
    """
    s = jnp.sort(logits, axis=-1)
    cum = jnp.cumsum(jax.nn.softmax(s, axis=-1), axis=-1)
    n_drop = jnp.sum(cum[:, :-1] <= 1.0 - top_p, axis=-1)  # cum is monotone: a prefix is dropped
    threshold = jnp.take_along_axis(s, n_drop[:, None], axis=-1)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def process_logits(logits: jax.Array, seen: jax.Array, temperature: jax.Array, top_p: jax.Array,
                   repetition_penalty: jax.Array, top_k: int = 0) -> jax.Array:
    """The sampling distribution's logits, as transformers ``generate(do_sample=True)`` builds them.

    Args:
        logits: [B, V] float32 raw next-token logits.
        seen: [B, V] bool, tokens already in the row (prompt + generated) for the penalty.
        temperature: scalar > 0.
        top_p: scalar in (0, 1]; 1 disables the filter (skipped at run time, no sort).
        repetition_penalty: scalar > 0; 1 disables it (HF ``RepetitionPenaltyLogitsProcessor``:
            seen logits < 0 are multiplied by it, others divided).
        top_k: static int; 0 disables (HF ``TopKLogitsWarper``).

    Returns:
        [B, V] float32 logits with filtered tokens at -inf.
    """
    x = apply_repetition_penalty(logits, seen, repetition_penalty) / temperature
    if top_k:
        kth = jax.lax.top_k(x, top_k)[0][:, -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    return jax.lax.cond(top_p < 1.0, top_p_filter, lambda y, _: y, x, top_p)


def apply_repetition_penalty(logits: jax.Array, seen: jax.Array, penalty: jax.Array) -> jax.Array:
    """HF repetition penalty on [B, V] logits for the ``seen`` [B, V] bool tokens (1 = no-op)."""
    return jnp.where(seen, jnp.where(logits < 0, logits * penalty, logits / penalty), logits)


def _next_token(logits, key, seen, temperature, top_p, repetition_penalty, top_k):
    """(token [B] int32, raw-policy log-prob [B] float32): greedy when temperature <= 0."""
    def sample(_):
        x = process_logits(logits, seen, temperature, top_p, repetition_penalty, top_k)
        return jax.random.categorical(key, x, axis=-1).astype(jnp.int32)

    def greedy(_):
        return jnp.argmax(apply_repetition_penalty(logits, seen, repetition_penalty), -1).astype(jnp.int32)

    tok = jax.lax.cond(temperature > 0, sample, greedy, None)
    return tok, decoder.token_logprobs(logits[:, None, :], tok[:, None])[:, 0]


class Sampler:
    """Batched KV-cache generation for a policy of any family (SPEC §2.1 rollouts, §1.8 greedy gate).

    Args:
        model: a model of any family (``decoder.DecoderForCausalLM``; only its graph is kept) or the ``nnx.GraphDef`` of
            ``nnx.split(model, nnx.Param)``.
        config: the model's config (``families``).
        max_prompt_tokens: longest prompt (SPEC §2.1: 128); longer prompts raise.
        max_new_tokens: N, the generated tokens per row (SPEC §2.1: 64).
        eos_ids: token ids that end a row (e.g. ``<|im_end|>``, ``<|endoftext|>``); empty = rows
            never stop early (benchmarks).
        pad_id: id for left padding and for every slot after a row's EOS (SPEC §2.1: pad = EOS).
        mesh: a ``("data", "model")`` mesh; rows are sharded over ``"data"`` (the batch is padded
            to a multiple of its size). None: default device.
        buckets: padded prompt lengths; default :func:`prompt_buckets`.
        top_k: static top-k of the sampling distribution; 0 = off.

    Attributes:
        prefill, decode: the jitted programs ``sampler_prefill`` / ``sampler_decode``
            (``models/programs.py``): ``prefill(params, ids, mask, live, key, temperature, top_p,
            repetition_penalty)`` -> decode state; ``decode(params, state, key, temperature, top_p,
            repetition_penalty)`` -> (tokens, logprobs, lengths); the state is donated.
        trace_counts: ``Counter`` of how many times ``prefill`` / ``decode`` were traced
            (= compiled); one per (bucket, padded batch size) pair. Temperature, top-p, the
            repetition penalty, the PRNG key and the parameter values are traced arguments.

    Raises:
        ValueError: naming the argument for ids outside the vocabulary, ``max_new_tokens`` < 1,
            ``top_k`` < 0 or buckets that do not reach ``max_prompt_tokens``.
    """

    def __init__(self, model: decoder.DecoderForCausalLM | nnx.GraphDef, config: decoder.DecoderConfig, *,
                 max_prompt_tokens: int, max_new_tokens: int, eos_ids: int | Sequence[int],
                 pad_id: int, mesh: Mesh | None = None, buckets: Sequence[int] | None = None,
                 top_k: int = 0):
        self.graphdef = nnx.split(model, nnx.Param)[0] if isinstance(model, nnx.Module) else model
        self.config = config
        eos = [int(eos_ids)] if np.isscalar(eos_ids) else [int(e) for e in eos_ids]
        for name, ids in (("eos_ids", eos), ("pad_id", [pad_id])):
            bad = [i for i in ids if not 0 <= i < config.vocab_size]
            if bad:
                raise ValueError(f"{name}={bad} outside the vocabulary [0, {config.vocab_size})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        if top_k < 0:
            raise ValueError(f"top_k={top_k} must be >= 0")
        self.max_prompt_tokens, self.max_new_tokens = int(max_prompt_tokens), int(max_new_tokens)
        self.eos_ids, self.pad_id, self.mesh, self.top_k = tuple(eos), int(pad_id), mesh, int(top_k)
        self.buckets = tuple(sorted(buckets)) if buckets else prompt_buckets(self.max_prompt_tokens)
        if self.buckets[-1] < self.max_prompt_tokens:
            raise ValueError(f"buckets={self.buckets} do not reach max_prompt_tokens={self.max_prompt_tokens}")
        self.trace_counts: collections.Counter = collections.Counter()
        self.prefill = programs.jit("sampler_prefill", self._prefill_impl, mesh=mesh)
        # The cache (and the token buffers) are donated: without donation XLA must keep the
        # caller's cache alive and allocate a second full [layers x B x S x n_kv x head_dim] buffer
        # for the loop's result; donated, the while_loop updates the one buffer in place.
        self.decode = programs.jit("sampler_decode", self._decode_impl, mesh=mesh, donate_argnames=("state",))

    # -------------------------------------------------------------------------------- traced
    def _constrain(self, x: jax.Array, logical: tuple) -> jax.Array:
        return shd.with_constraint(x, logical, self.mesh) if self.mesh is not None else x

    def _prefill_impl(self, params, ids, mask, live, key, temperature, top_p, repetition_penalty):
        """ids/mask [B, P], live [B] (False = batch-padding row) -> decode state with the prompt
        in the cache and token 0 sampled; padding rows start done so they never delay the stop."""
        self.trace_counts["prefill"] += 1
        cfg, (b, p), n = self.config, ids.shape, self.max_new_tokens
        cache = decoder.init_cache(cfg, b, p + n - 1)
        cache = jax.tree.map(lambda c: self._constrain(c, ("batch", None, "heads", None)), cache)
        valid = jnp.concatenate([mask, jnp.zeros((b, n - 1), mask.dtype)], axis=1)
        pos = decoder.positions_from_mask(mask)
        if p > 1:  # all but the last prompt token: logits unused, so XLA drops the LM head
            _, cache = decoder.forward_with_cache(self.graphdef, params, ids[:, :-1], pos[:, :-1],
                                                valid, cache, jnp.int32(0))
        logits, cache = decoder.forward_with_cache(self.graphdef, params, ids[:, -1:], pos[:, -1:],
                                                 valid, cache, jnp.int32(p - 1))
        logits = self._constrain(logits[:, 0], ("batch", None))
        rows = jnp.arange(b)[:, None]
        seen = jnp.zeros((b, cfg.vocab_size), jnp.int32).at[rows, ids].add(mask.astype(jnp.int32)) > 0
        tok, lp = _next_token(logits, jax.random.fold_in(key, 0), seen, temperature, top_p,
                              repetition_penalty, self.top_k)
        is_eos = jnp.isin(tok, jnp.asarray(self.eos_ids, jnp.int32))
        return dict(
            i=jnp.int32(0), cache=cache, seen=seen.at[jnp.arange(b), tok].set(True),
            tokens=jnp.full((b, n), self.pad_id, jnp.int32).at[:, 0].set(tok),
            logprobs=jnp.zeros((b, n), jnp.float32).at[:, 0].set(lp),
            lengths=jnp.where(is_eos, 1, n).astype(jnp.int32), done=is_eos | ~live,
            prompt_len=jnp.sum(mask, axis=1, dtype=jnp.int32), valid=valid)

    def _decode_impl(self, params, state, key, temperature, top_p, repetition_penalty):
        """Runs ``while i < N-1 and not all done``: feed token i at slot P+i, sample token i+1."""
        self.trace_counts["decode"] += 1
        n, eos = self.max_new_tokens, jnp.asarray(self.eos_ids, jnp.int32)
        p = state["valid"].shape[1] - (n - 1)
        b = state["tokens"].shape[0]
        slot_ids = jnp.arange(n - 1, dtype=jnp.int32)[None, :]

        def cond(s):
            return (s["i"] < n - 1) & ~jnp.all(s["done"])

        def body(s):
            i = s["i"]
            tok_in = jax.lax.dynamic_slice_in_dim(s["tokens"], i, 1, axis=1)
            valid = s["valid"].at[:, p:].set((slot_ids <= i).astype(s["valid"].dtype))
            logits, cache = decoder.forward_with_cache(self.graphdef, params, tok_in,
                                                     (s["prompt_len"] + i)[:, None], valid,
                                                     s["cache"], p + i)
            logits = self._constrain(logits[:, 0], ("batch", None))
            tok, lp = _next_token(logits, jax.random.fold_in(key, i + 1), s["seen"], temperature,
                                  top_p, repetition_penalty, self.top_k)
            tok = jnp.where(s["done"], self.pad_id, tok)
            lp = jnp.where(s["done"], 0.0, lp)
            new_eos = ~s["done"] & jnp.isin(tok, eos)
            return dict(s, i=i + 1, cache=cache, seen=s["seen"].at[jnp.arange(b), tok].set(True),
                        tokens=jax.lax.dynamic_update_slice_in_dim(s["tokens"], tok[:, None], i + 1, 1),
                        logprobs=jax.lax.dynamic_update_slice_in_dim(s["logprobs"], lp[:, None], i + 1, 1),
                        lengths=jnp.where(new_eos, i + 2, s["lengths"]), done=s["done"] | new_eos)

        out = jax.lax.while_loop(cond, body, state)
        return out["tokens"], out["logprobs"], out["lengths"]

    # -------------------------------------------------------------------------------- host side
    def bucket_for(self, length: int) -> int:
        """The padded prompt length used for a prompt of ``length`` tokens.

        Raises:
            ValueError: when ``length`` is < 1 or > ``max_prompt_tokens``.
        """
        if not 1 <= length <= self.max_prompt_tokens:
            raise ValueError(f"prompt of {length} tokens; expected 1..{self.max_prompt_tokens} "
                             "(truncate prompts to max_prompt_tokens first)")
        return next(b for b in self.buckets if b >= length)

    def pad_prompts(self, prompt_token_lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """LEFT-pads prompts to one bucket length: ([B', P] int32 ids, [B', P] int32 mask).

        B' is B rounded up to a multiple of the mesh's data axis; extra rows hold one pad token.

        Raises:
            ValueError: for an empty batch, an empty or too long prompt, or ids outside the vocab.
        """
        if not prompt_token_lists:
            raise ValueError("no prompts given")
        lens = [len(x) for x in prompt_token_lists]
        p = self.bucket_for(max(lens))
        self.bucket_for(min(lens))  # raises on an empty prompt
        n_data = self.mesh.shape[shd.DATA] if self.mesh is not None else 1
        b = -(-len(lens) // n_data) * n_data
        ids = np.full((b, p), self.pad_id, np.int32)
        mask = np.zeros((b, p), np.int32)
        for r, toks in enumerate(prompt_token_lists):
            arr = np.asarray(toks, np.int64)
            if arr.ndim != 1:
                raise ValueError(f"prompt {r}: token ids must be a flat list, got shape {arr.shape}")
            tok_lib.check_token_ids(arr, self.config.vocab_size, f"Sampler: prompt {r}")
            ids[r, p - len(arr):], mask[r, p - len(arr):] = arr, 1
        mask[len(lens):, -1] = 1  # padding rows: a single pad token, so attention is well defined
        return ids, mask

    def sample(self, params: nnx.State, prompt_token_lists: Sequence[Sequence[int]], key: jax.Array,
               temperature: float = 0.0, top_p: float = 1.0,
               repetition_penalty: float = 1.0) -> SampleOutput:
        """Generates ``max_new_tokens`` per prompt (fewer when every row has hit EOS).

        Args:
            params: the policy parameters (``nnx.split(model, nnx.Param)[1]``); with a mesh they
                must live on its devices (e.g. ``sharding.shard_params(params, mesh)``).
            prompt_token_lists: B prompts of 1..``max_prompt_tokens`` token ids each.
            key: a JAX PRNG key; the same key, params and prompts give the same output.
            temperature: 0 = greedy; > 0 samples from ``softmax(logits / temperature)``.
            top_p: nucleus mass in (0, 1]; 1 = off.
            repetition_penalty: HF repetition penalty (> 0; 1 = off) over prompt + generated tokens.

        Returns:
            :class:`SampleOutput` with B rows (host numpy).

        Raises:
            ValueError: naming the argument for a bad prompt (see :meth:`pad_prompts`), a negative
                temperature, top_p outside (0, 1] or repetition_penalty <= 0.
        """
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p={top_p} must be in (0, 1]")
        if repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={repetition_penalty} must be > 0")
        ids, mask = self.pad_prompts(prompt_token_lists)
        dev_ids, dev_mask = ids, mask
        if self.mesh is not None:
            dev_ids, dev_mask = jax.device_put((ids, mask), shd.data_sharding(self.mesh))
        scalars = tuple(jnp.float32(v) for v in (temperature, top_p, repetition_penalty))
        live = np.arange(ids.shape[0]) < len(prompt_token_lists)
        if self.mesh is not None:
            live = jax.device_put(live, shd.data_sharding(self.mesh))
        state = self.prefill(params, dev_ids, dev_mask, live, key, *scalars)
        with warnings.catch_warnings():  # CPU cannot donate buffers; that is only a missed saving
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            tokens, logprobs, lengths = self.decode(params, state, key, *scalars)
        b = len(prompt_token_lists)
        tokens, logprobs, lengths = shd.to_host((tokens, logprobs, lengths))
        return SampleOutput(tokens=np.asarray(tokens[:b]), logprobs=np.asarray(logprobs[:b]),
                            lengths=np.asarray(lengths[:b]), prompt_tokens=ids[:b], prompt_mask=mask[:b])

    def sample_chat(self, params: nnx.State, tokenizer: Any, prompts: Sequence[tuple[str, str]],
                    key: jax.Array, temperature: float = 0.0, top_p: float = 1.0,
                    repetition_penalty: float = 1.0) -> SampleOutput:
        """:meth:`sample` on ``(system, user)`` pairs via ``tokenizer.encode_chat`` (SPEC §1.3).

        Each prompt is chat-formatted with the generation prompt, tokenized and truncated to
        ``max_prompt_tokens`` tokens on the tokenizer's ``truncation_side`` ("right" keeps the first
        tokens, as ``tokenizer(text, truncation=True, max_length=128)``; SPEC §2.2a).
        """
        from behaviortrace_jax.models import tokenizer as tok_lib

        lists = [tok_lib.encode_chat(tokenizer, s, u, max_tokens=self.max_prompt_tokens) for s, u in prompts]
        return self.sample(params, lists, key, temperature, top_p, repetition_penalty)
