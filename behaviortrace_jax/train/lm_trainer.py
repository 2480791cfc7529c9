"""Causal-LM trainer: next-token cross-entropy on completion tokens, AdamW, clipping, a schedule.

Serves the tiny base model (``stages/base.py``, TINY_CALIBRATION) and the SFT warm-up
(``stages/sft.py``, SPEC §1.7). The pieces:

* :func:`encode_chat_examples`: ``(system, user, assistant)`` -> token ids + ``prompt_len``.
  SPEC §1.7: sequence = ``chat_prompt(system, user) + assistant`` tokenized as ONE string, no EOS
  appended, truncated to ``max_total_tokens``; ``prompt_len`` = token length of the chat prompt
  alone (truncated to ``max_prompt_tokens``); the loss covers positions ``>= prompt_len`` only
  (labels -100 before). ``append_eos=True`` adds ``tokenizer.eos_token`` (``<|im_end|>``) after
  the answer: the tiny base corpus uses it so the model learns to stop.
* :func:`pack_examples`: fixed, padded shapes (no recompiles). Every row of a dataset of chats with
  one system prompt starts with the same tokens; that common *prefix* (capped below the shortest
  prompt, so it holds no loss target) is stored once and, in the train step, run through the model
  once with batch 1; its KV cache is broadcast to the B rows, which then run only their own
  tokens. Loss and gradient are those of the full sequences (causal attention: prefix positions
  never see row-specific tokens); on CPU this halves the work of the base model (about 45 of ~90
  tokens are the system prompt).
* Length buckets (optional): rows of similar length are batched together (:func:`grouped_batches`)
  and each batch is cut to the smallest of a few widths, so the step compiles once per width;
  for the tiny corpus (real rows of 15..51 tokens after the prefix) this saves about a third.
* :class:`LMTrainer`: ONE jitted step (forward, backward, clip, AdamW) with the train state
  donated, batch rows on the mesh's ``"data"`` axis, parameters in their given shardings; the loss
  is fetched from the device only every ``log_every`` steps (no per-step host sync), with each
  step's ``finite`` flag (``train/nonfinite.py``): a non-finite step raises before the state is returned.

Loss = ``sum(CE * target) / sum(target)`` over the batch (token mean, as transformers' loss with
labels -100; for batch 1 it is SPEC §1.7's mean over the completion tokens).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from behaviortrace_jax.models import decoder, programs, sharding as shd, tokenizer as tok_lib
from behaviortrace_jax.train import nonfinite
from behaviortrace_jax.train.train_state import TrainState

# ------------------------------------------------------------------------------------------------
# Encoding and packing
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EncodedExample:
    """One training sequence: ``tokens`` int32 [n] and the number of leading prompt tokens.

    Loss targets are ``tokens[prompt_len:]`` (predicted from the position before each).
    """

    tokens: np.ndarray
    prompt_len: int


def encode_chat_examples(tokenizer: Any, examples: Sequence[tuple[str, str, str]], *, append_eos: bool,
                         max_prompt_tokens: int | None = None, max_total_tokens: int | None = None
                         ) -> list[EncodedExample]:
    """Tokenizes ``(system, user, assistant)`` triples as SPEC §1.7 does (batched, fast tokenizer).

    Args:
        tokenizer: a transformers tokenizer with a chat template (``tokenizer.load_tokenizer``).
        examples: the chats.
        append_eos: append ``tokenizer.eos_token`` to the answer (tiny base corpus: True; SPEC §1.7
            SFT: False).
        max_prompt_tokens: cap on ``prompt_len`` (SPEC §1.7: 128); None = no cap.
        max_total_tokens: the sequence is cut to its first ``max_total_tokens`` tokens (SPEC §1.7:
            128 + 64); None = no cut.

    Returns:
        One :class:`EncodedExample` per chat, in order.

    Raises:
        ValueError: for an empty list, ``append_eos`` without an ``eos_token``, a chat whose
            answer leaves no completion token after truncation, or whose answer merges with the
            prompt's end when tokenised together (``tokenizer.check_prompt_boundary``; names its index).
    """
    if not examples:
        raise ValueError("encode_chat_examples: no examples")
    eos = ""
    if append_eos:
        eos = getattr(tokenizer, "eos_token", None) or ""
        if not eos:
            raise ValueError("append_eos=True but the tokenizer has no eos_token")
    unique = sorted({(s, u) for s, u, _ in examples})  # corpora repeat questions: template each once
    text = {su: tok_lib.chat_prompt(tokenizer, *su) for su in unique}
    prompt_ids = dict(zip(unique, tokenizer([text[su] for su in unique], add_special_tokens=False)["input_ids"]))
    n_prompt = {su: len(ids) for su, ids in prompt_ids.items()}
    full = [text[(s, u)] + a + eos for s, u, a in examples]
    distinct = list(dict.fromkeys(full))  # corpora repeat whole chats too: tokenize each text once
    ids_of = dict(zip(distinct, tokenizer(distinct, add_special_tokens=False)["input_ids"]))
    out = []
    for i, ((s, u, _), fi) in enumerate(zip(examples, map(ids_of.__getitem__, full))):
        tok_lib.check_prompt_boundary(prompt_ids[(s, u)], fi, f"encode_chat_examples: example {i}")
        plen = n_prompt[(s, u)] if max_prompt_tokens is None else min(n_prompt[(s, u)], max_prompt_tokens)
        toks = np.asarray(fi if max_total_tokens is None else fi[:max_total_tokens], np.int32)
        if len(toks) <= plen:
            raise ValueError(f"example {i}: no completion token left (prompt {plen} tokens, sequence "
                             f"{len(toks)} tokens; max_total_tokens={max_total_tokens})")
        out.append(EncodedExample(toks, plen))
    return out


@dataclasses.dataclass(frozen=True)
class PackedData:
    """A dataset in fixed shapes: a shared prefix plus right-padded per-row tokens.

    Attributes:
        prefix: int32 [Pf] tokens every sequence starts with (may be empty).
        tokens: int32 [N, L] the rest of each sequence, right padded with ``pad_id``.
        mask: int32 [N, L] 1 on real tokens.
        targets: float32 [N, L] 1 where the token is a loss target (a completion token).
        n_truncated: sequences cut to ``seq_len``.
        buckets: allowed batch widths (ascending, the last = L): a batch is cut to the smallest one
            that holds its longest row, so the step compiles once per bucket. () = always L.
    """

    prefix: np.ndarray
    tokens: np.ndarray
    mask: np.ndarray
    targets: np.ndarray
    n_truncated: int = 0
    buckets: tuple[int, ...] = ()

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        """Full padded sequence length Pf + L."""
        return len(self.prefix) + self.tokens.shape[1]

    @property
    def lengths(self) -> np.ndarray:
        """int [N]: real tokens per row (after the prefix)."""
        return self.mask.sum(axis=1)

    def batch(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Rows ``idx`` as ``{"tokens", "mask", "targets"}`` numpy arrays [len(idx), W], W the
        smallest bucket holding the longest of these rows (L without buckets)."""
        width = self.tokens.shape[1]
        if self.buckets:
            longest = int(self.mask[idx].sum(axis=1).max())
            width = next(b for b in self.buckets if b >= longest)
        return {"tokens": self.tokens[idx, :width], "mask": self.mask[idx, :width],
                "targets": self.targets[idx, :width]}


def pack_examples(examples: Sequence[EncodedExample], seq_len: int | None, pad_id: int,
                  share_prefix: bool = True, n_buckets: int = 1, vocab_size: int | None = None) -> PackedData:
    """Pads (or cuts) every sequence to ``seq_len`` and splits off the common prefix.

    Args:
        examples: from :func:`encode_chat_examples`.
        seq_len: total padded length; None = the longest sequence. Longer sequences are cut.
        pad_id: the padding id (never attended to by real tokens, never a target).
        share_prefix: split off the longest prefix common to all rows, capped at
            ``min(prompt_len) - 1`` so that every target is in the per-row part; False = empty prefix.
        n_buckets: batch widths: the ``k / n_buckets`` quantiles of the row lengths rounded up to a
            multiple of 8 (the last = L); 1 = one fixed width. Use with :func:`grouped_batches`.
        vocab_size: the model's vocabulary; when given, every token id and ``pad_id`` must lie in
            ``[0, vocab_size)``.

    Raises:
        ValueError: for no examples, ``seq_len < 2``, ``n_buckets < 1``, a sequence whose targets
            are all cut, or (with ``vocab_size``) a token id outside the vocabulary, naming it.
    """
    if not examples:
        raise ValueError("pack_examples: no examples")
    if n_buckets < 1:
        raise ValueError(f"pack_examples: n_buckets={n_buckets} must be >= 1")
    if vocab_size is not None:
        tok_lib.check_token_ids([pad_id], vocab_size, "pack_examples: pad_id")
        for i, e in enumerate(examples):
            tok_lib.check_token_ids(e.tokens, vocab_size, f"pack_examples: example {i}")
    longest = max(len(e.tokens) for e in examples)
    seq_len = longest if seq_len is None else int(seq_len)
    if seq_len < 2:
        raise ValueError(f"pack_examples: seq_len={seq_len} must be >= 2")
    n = len(examples)
    tokens = np.full((n, seq_len), pad_id, np.int32)
    mask = np.zeros((n, seq_len), np.int32)
    targets = np.zeros((n, seq_len), np.float32)
    for i, e in enumerate(examples):
        k = min(len(e.tokens), seq_len)
        if k <= e.prompt_len:
            raise ValueError(f"example {i}: seq_len={seq_len} cuts every completion token "
                             f"(prompt_len {e.prompt_len})")
        tokens[i, :k], mask[i, :k], targets[i, e.prompt_len:k] = e.tokens[:k], 1, 1.0
    n_cut = sum(len(e.tokens) > seq_len for e in examples)
    pf = 0
    if share_prefix:
        same = np.cumprod(tokens == tokens[0:1], axis=1).sum(axis=1).min()
        pf = int(max(0, min(same, min(e.prompt_len for e in examples) - 1, seq_len - 2)))
    width = seq_len - pf
    buckets: tuple[int, ...] = ()
    if n_buckets > 1:
        q = np.quantile(mask[:, pf:].sum(axis=1), np.arange(1, n_buckets) / n_buckets)
        buckets = tuple(sorted({min(width, max(2, int(-(-x // 8) * 8))) for x in q} | {width}))
    return PackedData(prefix=tokens[0, :pf].copy(), tokens=tokens[:, pf:], mask=mask[:, pf:],
                      targets=targets[:, pf:], n_truncated=int(n_cut), buckets=buckets)


def grouped_batches(lengths: np.ndarray, batch_size: int, seed: int, group: int = 16) -> Callable[[int], np.ndarray]:
    """Step -> row indices of similar length (for :attr:`PackedData.buckets`), deterministic in ``seed``.

    Each epoch (``default_rng([seed, epoch])``) permutes the rows, cuts the permutation into chunks
    of ``group * batch_size`` rows, sorts each chunk by length (stable), cuts it into batches and
    shuffles the batch order; ``len // batch_size`` batches per epoch (the remainder waits for the
    next epoch's permutation). Every batch holds ``batch_size`` distinct rows.
    """
    lengths = np.asarray(lengths)
    n = len(lengths)
    if n < batch_size or batch_size < 1:
        raise ValueError(f"grouped_batches: need 1 <= batch_size <= rows, got {batch_size}, {n}")
    per_epoch = n // batch_size

    @functools.lru_cache(maxsize=2)
    def epoch_batches(epoch: int) -> np.ndarray:
        rng = np.random.default_rng([seed, epoch])
        perm = rng.permutation(n)[:per_epoch * batch_size]
        chunks = [perm[i:i + group * batch_size] for i in range(0, len(perm), group * batch_size)]
        batches = np.concatenate([c[np.argsort(lengths[c], kind="stable")] for c in chunks]).reshape(-1, batch_size)
        return batches[rng.permutation(len(batches))]

    return lambda step: epoch_batches(step // per_epoch)[step % per_epoch]


def shuffled_batches(n: int, batch_size: int, seed: int) -> Callable[[int], np.ndarray]:
    """Step -> row indices: a stream of epoch permutations (``default_rng([seed, epoch])``), cut
    into consecutive batches; a batch may straddle two epochs. Deterministic in ``seed``."""
    if n < 1 or batch_size < 1:
        raise ValueError(f"shuffled_batches: need n >= 1 and batch_size >= 1, got {n}, {batch_size}")

    @functools.lru_cache(maxsize=4)
    def perm(epoch: int) -> np.ndarray:
        return np.random.default_rng([seed, epoch]).permutation(n)

    def indices(step: int) -> np.ndarray:
        pos = step * batch_size + np.arange(batch_size)
        return np.asarray([perm(int(p // n))[p % n] for p in pos], np.int64)

    return indices


def cyclic_batches(n: int, batch_size: int) -> Callable[[int], np.ndarray]:
    """Step -> row indices ``(step * batch_size + i) % n`` (SPEC §1.7: ``sft_step % 10``, batch 1)."""
    if n < 1 or batch_size < 1:
        raise ValueError(f"cyclic_batches: need n >= 1 and batch_size >= 1, got {n}, {batch_size}")
    return lambda step: (step * batch_size + np.arange(batch_size)) % n


# ------------------------------------------------------------------------------------------------
# Loss and the jitted step
# ------------------------------------------------------------------------------------------------


def sequence_logits(graphdef: nnx.GraphDef, config: decoder.DecoderConfig, params: Any, prefix: jax.Array,
                    tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """Logits float32 [B, L, V] of the per-row tokens of ``prefix + tokens[b]`` (right padded).

    With a non-empty ``prefix`` [Pf] the prefix runs once (batch 1) into a KV cache that is
    broadcast to the B rows; ``logits[:, t]`` predicts ``tokens[:, t + 1]``.
    """
    b, length = tokens.shape
    pf = prefix.shape[0]
    if pf == 0:
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
        return decoder.forward(graphdef, params, tokens, positions, mask)
    total = pf + length
    cache = decoder.init_cache(config, 1, total)
    valid1 = (jnp.arange(total) < pf).astype(jnp.int32)[None]
    _, cache = decoder.forward_with_cache(graphdef, params, prefix[None], jnp.arange(pf, dtype=jnp.int32)[None],
                                        valid1, cache, jnp.int32(0))
    cache = jax.tree.map(lambda c: jnp.broadcast_to(c, (b,) + c.shape[1:]), cache)
    valid = jnp.concatenate([jnp.ones((b, pf), mask.dtype), mask], axis=1)
    positions = jnp.broadcast_to(pf + jnp.arange(length, dtype=jnp.int32), (b, length))
    logits, _ = decoder.forward_with_cache(graphdef, params, tokens, positions, valid, cache, jnp.int32(pf))
    return logits


@jax.custom_vjp
def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """``logsumexp(logits) - logits[label]``: float32 [...] from logits [..., V] and int labels [...].

    The same value as ``-token_logprobs``; the custom backward ``(softmax - onehot) * g`` is one
    elementwise pass over the logits (XLA's own gradient of a gather scatters into a zeroed buffer,
    which on CPU costs more than the LM head's matmul).
    """
    return _ce_fwd(logits, labels)[0]


def _label_hits(logits, labels):
    """bool [..., V]: position == label (all False for a label outside [0, V))."""
    return jnp.arange(logits.shape[-1], dtype=jnp.int32) == labels[..., None].astype(jnp.int32)


def _ce_fwd(logits, labels):
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    # The label's logit through the same one-hot as the backward, so the two agree for every label
    # (an out-of-range label picks 0 here and in the gradient; the packers reject such ids on the host).
    picked = jnp.sum(jnp.where(_label_hits(logits, labels), logits, 0.0), axis=-1)
    return lse - picked, (logits, lse, labels)


def _ce_bwd(res, g):
    logits, lse, labels = res
    hit = _label_hits(logits, labels)
    dlogits = (jnp.exp(logits - lse[..., None]) - hit.astype(logits.dtype)) * g[..., None]
    return dlogits, None


softmax_cross_entropy.defvjp(_ce_fwd, _ce_bwd)


def lm_loss(graphdef: nnx.GraphDef, config: decoder.DecoderConfig, params: Any, prefix: jax.Array,
            batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(mean next-token CE over the targets of the batch, number of targets), both float32 scalars.

    ``batch``: ``tokens`` int32 [B, L], ``mask`` int32 [B, L], ``targets`` float32 [B, L] (see
    :class:`PackedData`). A batch without targets has loss 0.
    """
    tokens = batch["tokens"]
    logits = sequence_logits(graphdef, config, params, prefix, tokens, batch["mask"])
    # position t predicts token t + 1; the last position predicts nothing (weight 0). Shifting the
    # labels instead of slicing the logits avoids copying [B, L, V] (and padding its gradient).
    labels = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    w = jnp.concatenate([batch["targets"][:, 1:], jnp.zeros_like(batch["targets"][:, :1])], axis=1)
    n = jnp.sum(w)
    return jnp.sum(softmax_cross_entropy(logits, labels) * w) / jnp.maximum(n, 1.0), n


class LMTrainer:
    """Jitted, sharded causal-LM training of a decoder (any model family) on a :class:`PackedData` dataset.

    Args:
        graphdef: ``nnx.split(model, nnx.Param)[0]`` (split once).
        config: the model's config (``families``).
        optimizer: ``train_state.make_optimizer(...)``.
        prefix: the dataset's shared prefix (``PackedData.prefix``, int32 [Pf]); fixed per trainer.
        mesh: a ``("data", "model")`` mesh (the run's: ``sharding.Layout.mesh``); None = default device.
        state_shardings: ``train_state.train_state_shardings`` (required with a mesh): the step's
            output shardings, so donated buffers are reused and nothing recompiles.

    Attributes:
        step_program: the jitted ``lm_step`` (``models/programs.py``): ``(state, prefix, batch) ->
            (state, metrics)``, the state donated; ``loss_program``: the jitted ``lm_loss``,
            ``(params, prefix, batch) -> (loss, n_targets)``.
        trace_count: times the step was traced: one per batch width (``PackedData.buckets``).
    """

    def __init__(self, graphdef: nnx.GraphDef, config: decoder.DecoderConfig, optimizer: optax.GradientTransformation,
                 prefix: np.ndarray, *, mesh: Mesh | None = None, state_shardings: TrainState | None = None):
        if mesh is not None and state_shardings is None:
            raise ValueError("LMTrainer: a mesh needs state_shardings (train_state.train_state_shardings)")
        self.graphdef, self.config, self.optimizer, self.mesh = graphdef, config, optimizer, mesh
        self.trace_count = 0
        self._replicated = NamedSharding(mesh, P()) if mesh is not None else None
        tok_lib.check_token_ids(prefix, self.config.vocab_size, "LMTrainer: prefix")
        self._host_prefix, self._prefix = np.asarray(prefix, np.int32), None
        out_sh = None if mesh is None else (state_shardings, self._replicated)
        self.step_program = programs.jit("lm_step", self._step_impl, mesh=mesh, donate_argnums=0, out_shardings=out_sh)
        self.loss_program = programs.jit("lm_loss", functools.partial(lm_loss, graphdef, config), mesh=mesh)

    @property
    def prefix(self) -> jax.Array:
        """The shared prefix on the devices (replicated on the mesh), placed at its first use, so
        that a trainer built for a compile-only mesh (the ``compile`` stage) places nothing."""
        if self._prefix is None:
            self._prefix = self._put(self._host_prefix, self._replicated)
        return self._prefix

    @staticmethod
    def _put(x: Any, sharding: Any) -> Any:
        return jax.device_put(x, sharding) if sharding is not None else jnp.asarray(x)

    def _step_impl(self, state: TrainState, prefix: jax.Array, batch: dict[str, jax.Array]
                   ) -> tuple[TrainState, dict[str, jax.Array]]:
        self.trace_count += 1
        (loss, n), grads = jax.value_and_grad(
            lambda p: lm_loss(self.graphdef, self.config, p, prefix, batch), has_aux=True)(state.params)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "targets": n}
        metrics[nonfinite.FINITE_KEY] = nonfinite.step_finite(loss, metrics["grad_norm"], params)
        return state.replace(params=params, opt_state=opt_state, step=state.step + 1), metrics

    def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Moves a host batch to the devices: rows over ``"data"`` (replicated when B does not
        divide the data axis, e.g. SPEC §1.7's batch 1). Host ``tokens`` outside
        ``[0, vocab_size)`` raise a ValueError naming the id (``tokenizer.check_token_ids``)."""
        if "tokens" in batch:
            tok_lib.check_token_ids(batch["tokens"], self.config.vocab_size, "LMTrainer: batch tokens")
        if self.mesh is None:
            return jax.device_put(batch)
        b = next(iter(batch.values())).shape[0]
        sh = shd.data_sharding(self.mesh) if b % self.mesh.shape[shd.DATA] == 0 else self._replicated
        return jax.device_put(batch, sh)

    def step(self, state: TrainState, batch: dict[str, np.ndarray]) -> tuple[TrainState, dict[str, jax.Array]]:
        """One update on a host batch (``PackedData.batch``); ``state`` is donated (do not reuse it).

        Returns the new state and device scalars ``loss`` (before the update), ``grad_norm``
        (pre-clip global L2 norm), ``targets`` (tokens in the loss) and ``finite``
        (``nonfinite.step_finite``: loss, gradient norm and new parameters finite). Nothing is synced.
        """
        return self.step_program(state, self.prefix, self.put_batch(batch))

    def loss(self, params: Any, batch: dict[str, np.ndarray]) -> float:
        """The loss of ``params`` on a host batch (no update; synchronous)."""
        return float(self.loss_program(params, self.prefix, self.put_batch(batch))[0])

    def fit(self, state: TrainState, data: PackedData, batch_indices: Callable[[int], np.ndarray], num_steps: int,
            *, log_every: int = 50, callback: Callable[[int, TrainState], bool] | None = None,
            callback_every: int = 0, desc: str = "train", lr_schedule: Callable | None = None
            ) -> tuple[TrainState, list[dict[str, float]]]:
        """Runs updates ``state.step .. num_steps - 1`` (resumes from the state's step).

        Args:
            data: the packed dataset (its prefix must equal the trainer's).
            batch_indices: step -> row indices (:func:`shuffled_batches`, :func:`grouped_batches`,
                :func:`cyclic_batches`).
            num_steps: the total number of updates.
            log_every: fetch the losses and log a progress line every this many steps (and at the end).
            callback: ``callback(steps_done, state) -> stop`` called every ``callback_every`` updates
                (e.g. SFT's stop rule); returning True ends training after that update.
            lr_schedule: optional, only to log the learning rate.

        Returns:
            (the final state, history: one dict per logged interval with ``step`` (updates done),
            ``loss`` (mean over the interval), ``grad_norm`` (mean), ``lr``, ``tokens_per_s``).

        Raises:
            ValueError: when the data's prefix differs from the trainer's.
            nonfinite.NonFiniteError: a step whose loss, gradient norm or new parameters are not
                finite (naming the step and its batch rows), found when the losses are fetched
                (every ``log_every`` steps and at the end: no extra sync), so before the caller
                saves the returned state.
        """
        if not np.array_equal(np.asarray(data.prefix), np.asarray(jax.device_get(self.prefix))):
            raise ValueError("LMTrainer.fit: the dataset's shared prefix differs from the trainer's")
        start = int(jax.device_get(state.step))
        history: list[dict[str, float]] = []
        pending: list[dict[str, jax.Array]] = []
        guard = nonfinite.Guard(desc, "; the state was not returned, so nothing was saved from it")
        t_last = time.perf_counter()
        tokens_since = 0
        for s in range(start, num_steps):
            batch = data.batch(batch_indices(s))
            tokens_since += int(batch["mask"].sum()) + len(data.prefix) * len(batch["mask"])
            state, metrics = self.step(state, batch)
            pending.append(metrics)
            guard.add(s, metrics[nonfinite.FINITE_KEY], [f"row {int(i)}" for i in batch_indices(s)])
            done = s + 1
            stop = bool(callback is not None and callback_every > 0 and done % callback_every == 0
                        and callback(done, state))
            if done % max(1, log_every) == 0 or done == num_steps or stop:
                fetched = jax.device_get(pending)
                guard.check([m[nonfinite.FINITE_KEY] for m in fetched])
                now = time.perf_counter()
                rate = tokens_since / max(now - t_last, 1e-9)
                per_step = (now - t_last) / max(len(fetched), 1)  # the last interval (compile in the first)
                rec = {"step": done, "loss": float(np.mean([m["loss"] for m in fetched])),
                       "grad_norm": float(np.mean([m["grad_norm"] for m in fetched])),
                       "lr": float(lr_schedule(done - 1)) if lr_schedule is not None else float("nan"),
                       "tokens_per_s": float(rate)}
                history.append(rec)
                logging.info("%s step %d/%d loss %.4f grad_norm %.3f lr %.2e | %.0f tok/s, %.3f s/step, ETA %.0f s",
                             desc, done, num_steps, rec["loss"], rec["grad_norm"], rec["lr"], rate, per_step,
                             per_step * (num_steps - done))
                pending, tokens_since, t_last = [], 0, now
            if stop:
                logging.info("%s: stop rule met after %d updates", desc, done)
                break
        return state, history
