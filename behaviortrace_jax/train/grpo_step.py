"""The jitted, sharded GRPO train step (SPEC §2.2 step 4) and the batch it consumes.

``build_batch`` lays out one step's N = B x G rollouts as fixed-shape arrays (prompt left-padded,
completion right-padded, the loss mask up to and including the first EOS); ``make_train_step``
returns ONE jitted function that computes the loss of the whole batch, clips the global gradient
norm, applies the optimizer and returns, as side outputs, the CountSketch of the clipped batch
gradient (the step sketch, SPEC §3.2), its clip factor and the CountSketch of each rollout's
advantage-free loss -meanlp_i with its loss coefficient c_i (in-run rollout sketches: clip x c_i x
sketch_i is the rollout's share of the update). The resumable loop that drives it is ``stages/grpo.py``.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from behaviortrace_jax.io import sketch_store
from behaviortrace_jax.models import decoder, programs, sharding, tokenizer as tok_lib
from behaviortrace_jax.sketch import hash_families, sketcher
from behaviortrace_jax.train import grpo_loss, nonfinite, train_state


# ------------------------------------------------------------------------------------------------
# The train step
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """Static shapes of a GRPO step: B prompts, G samples, P prompt slots, T completion slots."""

    num_prompts: int
    group_size: int
    prompt_len: int
    completion_len: int

    @property
    def num_rollouts(self) -> int:
        return self.num_prompts * self.group_size


def build_batch(prompt_ids: list[list[int]], completions: np.ndarray, lengths: np.ndarray,
                advantages: np.ndarray, eos_ids: tuple[int, ...], shapes: StepShapes,
                pad_id: int, *, vocab_size: int) -> dict[str, np.ndarray]:
    """Assembles the fixed-shape train batch of N rollouts.

    Args:
        prompt_ids: N token lists (each <= P; left-padded here).
        completions: int [N, T] sampled completion tokens (pad after EOS).
        lengths: int [N] number of generated tokens (incl. the EOS, if any).
        advantages: float32 [N].
        eos_ids: ids masked out of the loss (SPEC §2.2 f), ``tokenizer.mask_eos_ids(tok,
            config.model.mask_eos)``, the same ids ``targets.response_examples`` masks.
        vocab_size: the model's vocabulary; every prompt id, completion id and ``pad_id`` must lie
            in ``[0, vocab_size)`` (``tokenizer.check_token_ids``).

    Returns:
        dict of numpy arrays: ``input_ids`` int32 [N, P+T], ``attention_mask`` int32 [N, P+T],
        ``loss_mask`` float32 [N, T], ``advantages`` float32 [N].

    Raises:
        ValueError: a prompt longer than P, mismatched shapes, or a token id outside the vocabulary
            (naming the id, the rollout and the vocab size).
    """
    n, p, t = shapes.num_rollouts, shapes.prompt_len, shapes.completion_len
    tok_lib.check_token_ids([pad_id], vocab_size, "build_batch: pad_id")
    for i, prompt in enumerate(prompt_ids):
        tok_lib.check_token_ids(prompt, vocab_size, f"build_batch: prompt_ids of rollout {i}")
    tok_lib.check_token_ids(completions, vocab_size, "build_batch: completions [rollout, token]")
    if len(prompt_ids) != n or completions.shape != (n, t) or advantages.shape != (n,):
        raise ValueError(f"batch shapes: {len(prompt_ids)} prompts, completions {completions.shape}, "
                         f"advantages {advantages.shape}; expected N={n}, T={t}")
    ids = np.full((n, p + t), pad_id, np.int32)
    attn = np.zeros((n, p + t), np.int32)
    for i, prompt in enumerate(prompt_ids):
        if len(prompt) > p:
            raise ValueError(f"prompt of {len(prompt)} tokens exceeds max_prompt_tokens={p}")
        ids[i, p - len(prompt):p] = prompt
        attn[i, p - len(prompt):p] = 1
    ids[:, p:] = completions
    in_len = np.arange(t)[None, :] < lengths[:, None]
    attn[:, p:] = 1  # the model attends to the whole completion (pad = EOS, as the paper's forward)
    not_eos = ~np.isin(completions, np.asarray(eos_ids))
    loss_mask = (in_len & not_eos).astype(np.float32)
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask,
            "advantages": advantages.astype(np.float32)}


def completion_logprobs(graphdef: nnx.GraphDef, params: Any, input_ids: jax.Array,
                        attention_mask: jax.Array, prompt_len: int, taps: Any = None) -> jax.Array:
    """Log-probs float32 [N, T] of the completion tokens ``input_ids[:, P:]`` (SPEC §2.2 f).

    The logits at positions ``P-1 .. P+T-2`` predict the completion tokens. ``taps``: as
    ``decoder.forward`` (the fused per-example sketcher's).
    """
    positions = decoder.positions_from_mask(attention_mask)
    logits = decoder.forward(graphdef, params, input_ids, positions, attention_mask, taps=taps)
    return decoder.token_logprobs(logits[:, prompt_len - 1:-1], input_ids[:, prompt_len:])


@dataclasses.dataclass(frozen=True)
class GRPOStepSpec:
    """Everything that decides what one GRPO train step computes (SPEC §2.2 step 4, §3.2), built from
    the config once at the stage boundary (``stages/spec.py``, ``RunSpec.step``) and shared by the
    ``grpo`` stage, the replay (``train/replay.py``) and the ``compile`` stage, so the three build
    the same program.

    Fields: ``shapes``; ``loss`` (a ``grpo_loss`` registry name) and ``loss_cfg``; ``grad_clip``
    (optax global-norm clip, ``optim.grad_clip``); ``inner_iterations`` (``grpo.inner_iterations``,
    1 unless the loss declares ``multi_iteration``); the CountSketch ``sketch_dim`` / ``sketch_seed`` /
    ``sketch_hash`` / ``sketch_kernel`` (the ``hash_families.HashFamily`` and the matmul-use kernel
    chosen from ``sketch.hash`` / ``sketch.kernel`` for the backend, ``hash_families.choose_sketch``);
    ``in_run_rollouts`` (per-rollout sketches as side outputs), ``chunk_size`` (rollouts per
    sketcher chunk), ``use_tables`` (hash tables as a step argument); ``fused`` (``sketch.fused``:
    the in-run sketches come from the fused per-example sketcher, ``sketch/fused.py``, whose one
    backward also gives the update; see :attr:`update_from_sketcher`).

    Raises:
        KeyError: an unregistered loss. ValueError: ``inner_iterations`` < 1 or > 1 for a loss
            without ``multi_iteration``.
    """

    shapes: StepShapes
    loss: str
    loss_cfg: grpo_loss.LossConfig
    grad_clip: float
    inner_iterations: int = 1
    sketch_dim: int = 65536
    sketch_seed: int = 0
    sketch_hash: hash_families.HashFamily = hash_families.DEFAULT_HASH_FAMILY
    sketch_kernel: str = "xla"
    in_run_rollouts: bool = True
    chunk_size: int = 4
    use_tables: bool = False
    fused: bool = True

    def __post_init__(self):
        loss = grpo_loss.get_loss(self.loss)
        if self.inner_iterations < 1 or (self.inner_iterations > 1 and not loss.multi_iteration):
            raise ValueError(f"grpo.inner_iterations={self.inner_iterations}: loss {self.loss!r} takes exactly 1")

    @property
    def loss_spec(self) -> grpo_loss.Loss:
        """The registered :class:`grpo_loss.Loss` (function and declarations)."""
        return grpo_loss.get_loss(self.loss)

    @property
    def rollout_sketch(self) -> str:
        """What the in-run rollout sketches are (``io.sketch_store``): ``"direction"`` (of the
        advantage-free -meanlp_i) when the loss declares ``rollout_coefficients``, else ``"term"``."""
        direction = self.loss_spec.rollout_coefficients is not None
        return sketch_store.ROLLOUT_DIRECTION if direction else sketch_store.ROLLOUT_TERM

    @property
    def update_from_sketcher(self) -> bool:
        """The one place that picks how the step gets its (first iteration's) gradient: True (``fused``,
        in-run sketches and a loss that declares ``one_backward``, e.g. ``paper``) = the weight
        cotangent of the fused sketcher's one backward (``PerExampleSketcher.sketch_and_sum``), so
        one pass gives the update and the in-run sketches; False = a batched ``value_and_grad`` of
        the step loss (and, with in-run sketches, a second, per-rollout pass: ``vmap(grad)``
        unless ``fused``)."""
        return self.fused and self.in_run_rollouts and self.loss_spec.one_backward


def make_train_step(graphdef: nnx.GraphDef, abstract_params: Any, tx: optax.GradientTransformation,
                    spec: GRPOStepSpec, *, order: sketcher.ParamOrder | None, mesh: jax.sharding.Mesh,
                    param_shardings: Any, opt_shardings: Any, weighted: bool = False):
    """Builds the jitted GRPO train step of ``spec``: one call per GRPO step, the whole batch at once.

    ``step(params, opt_state, batch, ref_params) -> (params, opt_state, out)``:

    * ``batch``: the arrays of :func:`build_batch`, sharded on the mesh's data axis (rollouts); with
      ``weighted`` (counterfactual replay) also ``weights`` float32 [N], and each rollout's term is
      multiplied by its weight (``sum_i w_i * term_i``);
    * ``ref_params``: the initial policy when the loss ``needs_reference`` (a KL term), else None;
    * ``out``: float32 ``loss`` and ``grad_norm`` (pre-clip global L2 norm), bool ``finite``
      (``nonfinite.step_finite``: loss, gradient norm and updated parameters all finite, one
      reduction fused into the step; the host reads it with the metrics); when ``order`` (a
      ``sketcher.hf_param_order``) is given also ``step_sketch [D]``, ``clip_factor`` and
      ``rollout_coefficients [N]`` (:func:`_first_iteration_outputs`) and, with
      ``spec.in_run_rollouts``, ``rollout_sketches [N, D]`` and ``rollout_grad_norms [N]``: the
      sketch and exact norm at the step's parameters of each rollout's :func:`rollout_losses`, so
      that for a loss with coefficients ``clip_factor * c_i * rollout_sketches[i]`` is the rollout's
      contribution to the update and these sum over the rollouts to ``step_sketch`` (SPEC §3.2).
      ``order=None`` (the replay) builds the update alone, except under
      ``spec.update_from_sketcher``, whose update IS the per-rollout sketcher's gradient sum
      (:func:`_summed_update`; the sketches are then computed and returned anyway).

    Params and optimizer state are donated; in/out shardings are explicit (:func:`_step_shardings`).
    With ``inner_iterations`` > 1 the sketches are of the first, on-policy iteration. On a mesh
    whose ``"data"`` axis has > 1 device the in-run rollout sketches run per device under
    ``jax.shard_map`` (``sketcher.PerExampleSketcher(mesh=)``; what makes the step compile at 1.5B).
    With ``spec.use_tables`` the CountSketch hash tables are an extra argument of the jitted step
    (:class:`_StepWithTables`), passed by the returned callable itself.

    Raises:
        ValueError: ``spec.update_from_sketcher`` with ``order=None``.
    """
    step, rollout_sketcher = train_step_function(graphdef, abstract_params, tx, spec, order=order, mesh=mesh,
                                                 weighted=weighted)
    batch_sh, out_sh = _step_shardings(spec, order, rollout_sketcher is not None, mesh, weighted)
    ref_sh = param_shardings if spec.loss_spec.needs_reference else None  # ref_params is None otherwise
    in_sh, out_shs = (param_shardings, opt_shardings, batch_sh, ref_sh), (param_shardings, opt_shardings, out_sh)
    if rollout_sketcher is None or not rollout_sketcher.use_tables:
        return programs.jit("grpo_step", step, mesh=mesh, in_shardings=in_sh, out_shardings=out_shs, donate_argnums=(0, 1))
    table_sh = table_shardings(order, param_shardings, mesh, len(rollout_sketcher.layout.shapes))
    jitted = programs.jit("grpo_step", step, mesh=mesh, in_shardings=(*in_sh, table_sh), out_shardings=out_shs,
                          donate_argnums=(0, 1))
    return _StepWithTables(jitted, rollout_sketcher, table_sh)


def make_zero_gradient_step(tx: optax.GradientTransformation, spec: GRPOStepSpec, *, mesh: jax.sharding.Mesh,
                            param_shardings: Any, opt_shardings: Any):
    """The exact shortcut of a step whose gradient is zero (issue 46 item 5): no forward, no backward.

    ``step(params, opt_state) -> (params, opt_state, out)`` applies the run's optimizer ``tx``
    (global-norm clip + AdamW, :func:`optimizer_iterations`, ``spec.inner_iterations`` times) to
    all-zero gradients: AdamW's moments decay and weight decay still acts, exactly as in the full
    step. ``out``: float32 ``loss`` = 0, ``grad_norm`` = 0 and bool ``finite`` (the updated
    parameters). Only valid for a step whose every per-rollout weight times advantage is 0 under a
    loss that declares ``zero_at_zero_advantage`` (``grpo_loss.Loss``); the caller checks
    (:func:`zero_gradient_step_applies`). The full step's gradient is then exactly zero, so the
    result is the full step's bit for bit (``tests/train/test_replay.py``). Params and optimizer state
    are donated, with the same shardings as :func:`make_train_step`'s.
    """

    def step(params, opt_state):
        zeros = jax.tree.map(jnp.zeros_like, params)
        loss = jnp.zeros((), jnp.float32)
        params, opt_state, out = optimizer_iterations(
            tx, spec.inner_iterations, params, opt_state, lambda it, p: (loss, zeros),
            lambda loss_value, grads: {"loss": loss_value, "grad_norm": optax.tree.norm(grads)})
        out[nonfinite.FINITE_KEY] = nonfinite.step_finite(out["loss"], out["grad_norm"], params)
        return params, opt_state, out

    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    out_sh = {"loss": rep, "grad_norm": rep, nonfinite.FINITE_KEY: rep}
    return programs.jit("grpo_zero_step", step, mesh=mesh, in_shardings=(param_shardings, opt_shardings),
                        out_shardings=(param_shardings, opt_shardings, out_sh), donate_argnums=(0, 1))


def zero_gradient_step_applies(spec: GRPOStepSpec, advantages: np.ndarray, weights: np.ndarray | None = None) -> bool:
    """Whether a step's gradient is exactly zero: the loss declares ``zero_at_zero_advantage`` under
    ``spec.loss_cfg`` and every ``advantages[i] * weights[i]`` (float32 [N]; weights default 1) is 0."""
    if not spec.loss_spec.zero_gradient_at_zero_advantage(spec.loss_cfg):
        return False
    a = np.asarray(advantages, np.float32)
    if weights is not None:
        a = a * np.asarray(weights, np.float32)
    return bool(np.all(a == 0))


def train_step_function(graphdef: nnx.GraphDef, abstract_params: Any, tx: optax.GradientTransformation,
                        spec: GRPOStepSpec, *, order: sketcher.ParamOrder | None, mesh: jax.sharding.Mesh,
                        weighted: bool = False) -> tuple[Callable, sketcher.PerExampleSketcher | None]:
    """The pure (unjitted) GRPO step that :func:`make_train_step` jits, and its rollout sketcher.

    ``step(params, opt_state, batch, ref_params, tables=None) -> (params, opt_state, out)`` as
    documented there; the sketcher is None where the step needs none. The metagradient
    (``train/metagradient.py``) jits the same function, undonated, for its forward.

    Raises:
        ValueError: ``spec.update_from_sketcher`` with ``order=None``.
    """
    rollout_sketcher = _make_rollout_sketcher(graphdef, abstract_params, spec, order, mesh, weighted)
    terms = functools.partial(step_terms, graphdef, spec, weighted)

    def step(params, opt_state, batch, ref_params, tables=None):
        rb = with_policy_logprobs(graphdef, spec, params, batch, ref_params)
        coef = _rollout_coefficients(spec, rb, weighted)
        res = summed = None
        if spec.update_from_sketcher:
            res, summed = _summed_update(rollout_sketcher, spec, params, rb, tables, coef)
        def value_and_grad(it, p):
            if it == 0 and summed is not None:
                return summed
            return jax.value_and_grad(lambda q: jnp.sum(terms(q, rb)))(p)

        start_params = params
        params, opt_state, out = optimizer_iterations(
            tx, spec.inner_iterations, params, opt_state, value_and_grad,
            lambda loss_value, grads: _first_iteration_outputs(spec, order, loss_value, grads, coef, res))
        if rollout_sketcher is not None:
            res = res if res is not None else _in_run_sketches(rollout_sketcher, start_params, rb, tables)
            out["rollout_sketches"], out["rollout_grad_norms"] = res.sketches, res.norms
        out[nonfinite.FINITE_KEY] = nonfinite.step_finite(out["loss"], out["grad_norm"], params)
        return params, opt_state, out

    return step, rollout_sketcher


def optimizer_iterations(tx: optax.GradientTransformation, iterations: int, params: Any, opt_state: Any,
                         value_and_grad: Callable[[int, Any], tuple[jax.Array, Any]],
                         first_outputs: Callable[[jax.Array, Any], dict]) -> tuple[Any, Any, dict]:
    """The GRPO step's body (SPEC §2.2 step 4): ``iterations`` times (``grpo.inner_iterations``; PPO's
    mu) the loss and gradient ``value_and_grad(iteration, params)`` at the current parameters, then
    ``tx`` (the run's optax chain: global-norm clip + AdamW) applied. Returns ``(params, opt_state,
    first_outputs(loss, grads))`` of the first iteration. The one home of the update loop: the run's
    step (:func:`train_step_function`) and the metagradient's batched weighted step
    (``train.metagradient.make_weighted_step``) both run it."""
    out: dict = {}
    for it in range(iterations):
        loss_value, grads = value_and_grad(it, params)
        if it == 0:
            out = first_outputs(loss_value, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, opt_state, out


def _loss_inputs(spec: GRPOStepSpec, lp: jax.Array, old_lp: jax.Array, ref_lp: jax.Array, mask: jax.Array,
                adv: jax.Array) -> grpo_loss.LossInputs:
    """The loss's inputs for the step's B x G rollouts: log-probs float32 [N, T] (current, old,
    reference), the loss mask float32 [N, T] and the advantages float32 [N]."""
    return grpo_loss.LossInputs(lp, old_lp, ref_lp, mask, adv, spec.shapes.num_prompts, spec.shapes.group_size)


def step_terms(graphdef: nnx.GraphDef, spec: GRPOStepSpec, weighted: bool, params: Any, rb: dict,
               taps: Any = None) -> jax.Array:
    """Each rollout's own term of the step loss, float32 [N]; the step loss is their sum (SPEC §2.2).

    ``rb``: a :func:`build_batch` batch with ``old_lp`` / ``ref_lp`` (:func:`with_policy_logprobs`);
    with ``weighted`` each term is multiplied by ``rb["weights"]``. ``taps``: as ``decoder.forward``.
    """
    lp = completion_logprobs(graphdef, params, rb["input_ids"], rb["attention_mask"], spec.shapes.prompt_len,
                             taps=taps)
    inputs = _loss_inputs(spec, lp, rb["old_lp"], rb["ref_lp"], rb["loss_mask"], rb["advantages"])
    terms = spec.loss_spec(inputs, spec.loss_cfg)
    return terms * rb["weights"] if weighted else terms


def rollout_losses(graphdef: nnx.GraphDef, spec: GRPOStepSpec, weighted: bool, params: Any, rb: dict,
                   taps: Any = None) -> jax.Array:
    """What the in-run sketcher differentiates per rollout, float32 [N]: SPEC §3.2's rollout loss
    -meanlp_i (the advantage-free direction) when the loss declares ``rollout_coefficients`` (its
    term is then c_i times it), else the rollout's own :func:`step_terms` (pre-clip)."""
    if spec.loss_spec.rollout_coefficients is None:
        return step_terms(graphdef, spec, weighted, params, rb, taps)
    lp = completion_logprobs(graphdef, params, rb["input_ids"], rb["attention_mask"], spec.shapes.prompt_len,
                             taps=taps)
    return -grpo_loss.masked_mean(lp, rb["loss_mask"])


def _make_rollout_sketcher(graphdef: nnx.GraphDef, abstract_params: Any, spec: GRPOStepSpec,
                          order: sketcher.ParamOrder | None, mesh: jax.sharding.Mesh,
                          weighted: bool) -> sketcher.PerExampleSketcher | None:
    """The step's per-rollout sketcher of :func:`rollout_losses` (``spec``'s dim, seed, chunk, hash
    tables, fused path; per device on ``mesh``), or None where the step needs none: no ``order`` or
    no in-run sketches, and the update from a batched backward.

    Raises:
        ValueError: ``spec.update_from_sketcher`` without a sketch ``order``.
    """
    if not ((order is not None and spec.in_run_rollouts) or spec.update_from_sketcher):
        return None
    if order is None:
        raise ValueError("sketch.fused: the update is the fused per-rollout sketcher's weight cotangent; "
                         "pass the sketch order (sketcher.hf_param_order)")
    loss = sketcher.DecoderLoss(functools.partial(rollout_losses, graphdef, spec, weighted))
    return sketcher.PerExampleSketcher(loss, abstract_params, dim=spec.sketch_dim, seed=spec.sketch_seed,
                                       chunk_size=spec.chunk_size, param_order=order, use_tables=spec.use_tables,
                                       mesh=mesh, fused=spec.fused, hash_family=spec.sketch_hash,
                                       kernel=spec.sketch_kernel)


def with_policy_logprobs(graphdef: nnx.GraphDef, spec: GRPOStepSpec, params: Any, batch: dict,
                         ref_params: Any, *, constant_old: bool = True) -> dict:
    """``batch`` plus ``old_lp`` (the completion log-probs at the step's own ``params``) and
    ``ref_lp`` (at ``ref_params``), float32 [N, T], both held constant (``stop_gradient``); zeros
    where the loss declares no need for them (``needs_old_logprobs`` / ``needs_reference``).
    ``constant_old=False`` (the metagradient's differentiated step) leaves ``old_lp`` a function of
    ``params``: its dependence on earlier weights is part of the metagradient."""
    loss, ids, attn, p = spec.loss_spec, batch["input_ids"], batch["attention_mask"], spec.shapes.prompt_len
    if loss.needs_old_logprobs and not constant_old:
        old_lp = completion_logprobs(graphdef, params, ids, attn, p)
    elif loss.needs_old_logprobs:
        old_lp = jax.lax.stop_gradient(completion_logprobs(graphdef, params, ids, attn, p))
    else:
        old_lp = jnp.zeros(batch["loss_mask"].shape)
    if loss.needs_reference:
        ref_lp = jax.lax.stop_gradient(completion_logprobs(graphdef, ref_params, ids, attn, p))
    else:
        ref_lp = jnp.zeros_like(old_lp)
    return dict(batch, old_lp=old_lp, ref_lp=ref_lp)


def _rollout_coefficients(spec: GRPOStepSpec, rb: dict, weighted: bool) -> jax.Array | None:
    """The loss's rollout coefficients c_i, float32 [N] (term_i = c_i * (-meanlp_i)), times the
    weights when ``weighted``; None for a loss that declares none. Parameter-free: the logged
    advantages (and B, G) decide them."""
    coefficients = spec.loss_spec.rollout_coefficients
    if coefficients is None:
        return None
    inputs = _loss_inputs(spec, rb["old_lp"], rb["old_lp"], rb["ref_lp"], rb["loss_mask"], rb["advantages"])
    coef = coefficients(inputs, spec.loss_cfg).astype(jnp.float32)
    return coef * rb["weights"] if weighted else coef


def _summed_update(rollout_sketcher: sketcher.PerExampleSketcher, spec: GRPOStepSpec, params: Any, rb: dict,
                  tables: Any, coef: jax.Array | None) -> tuple[sketcher.PerExampleSketches, tuple[jax.Array, Any]]:
    """``(in-run sketches, (loss, gradient))`` from one per-rollout pass (``spec.update_from_sketcher``).

    The gradient is the weight cotangent of the fused sketcher's backward of ``sum_i c_i l_i``
    (``PerExampleSketcher.sketch_and_sum`` with the coefficients c_i; float32 across chunks), cast
    to the parameters' dtypes: the batched backward's gradient up to float summation order. The
    loss is ``sum_i c_i * value_i`` (``sum_i value_i`` for a loss without coefficients).
    """
    res, gsum, vals = rollout_sketcher.sketch_and_sum(params, rb, tables, coefficients=coef)
    loss_value = jnp.sum(vals if coef is None else coef * vals)
    return res, (loss_value, jax.tree.map(lambda g, p: g.astype(p.dtype), gsum, params))


def _first_iteration_outputs(spec: GRPOStepSpec, order: sketcher.ParamOrder | None, loss_value: jax.Array,
                            grads: Any, coef: jax.Array | None,
                            res: sketcher.PerExampleSketches | None) -> dict[str, jax.Array]:
    """The step's outputs from its first iteration's loss and gradient.

    ``loss`` and ``grad_norm`` (pre-clip global L2 norm, float32); with a sketch ``order`` also
    ``clip_factor`` = ``grad_clip / max(grad_norm, grad_clip)`` (``train_state.clip_factor``: the
    scale optax's global-norm clip applies), the loss's ``rollout_coefficients`` (if it declares
    them) and ``step_sketch [D]``, the CountSketch of the clipped gradient (SPEC §3.2, step 4). Under
    ``spec.update_from_sketcher`` that is ``clip_factor * sum_i c_i res.sketches[i]`` (CountSketch
    is linear), else the sketch of ``grads``.
    """
    out = {"loss": loss_value, "grad_norm": optax.tree.norm(grads)}
    if order is None:
        return out
    scale = train_state.clip_factor(out["grad_norm"], spec.grad_clip)
    out["clip_factor"] = scale
    if coef is not None:
        out["rollout_coefficients"] = coef
    if spec.update_from_sketcher:  # sketch(s * sum_i c_i g_i) = s * sum_i c_i sketch(g_i)
        rs = res.sketches if coef is None else coef[:, None] * res.sketches
        out["step_sketch"] = jnp.sum(rs, axis=0) * scale
    else:
        out["step_sketch"] = sketcher.sketch_vector(grads, order, spec.sketch_dim, spec.sketch_seed,
                                                    hash_family=spec.sketch_hash) * scale
    return out


def _in_run_sketches(rollout_sketcher: sketcher.PerExampleSketcher, params: Any, rb: dict,
                    tables: Any) -> sketcher.PerExampleSketches:
    """The in-run rollout sketches and norms at ``params`` (the step's start), from the sketcher's own
    jitted call where it can (no mesh, tables inside), else traced inline with the ``tables`` argument."""
    if rollout_sketcher.mesh is None and not rollout_sketcher.use_tables:
        return rollout_sketcher(params, rb)
    return rollout_sketcher.sketch(params, rb, tables)


def _step_shardings(spec: GRPOStepSpec, order: sketcher.ParamOrder | None, in_run: bool, mesh: jax.sharding.Mesh,
                   weighted: bool) -> tuple[dict, dict]:
    """(batch shardings, ``out`` shardings) of the step: per-rollout arrays on the mesh's data axis,
    scalars and the step sketch replicated. ``in_run``: the step returns rollout sketches."""
    rep, data = sharding.replicated(mesh), sharding.data_sharding(mesh)
    batch_sh = {k: data for k in ("input_ids", "attention_mask", "loss_mask", "advantages")}
    if weighted:
        batch_sh["weights"] = data
    out_sh = {"loss": rep, "grad_norm": rep, nonfinite.FINITE_KEY: rep}
    if order is not None:
        out_sh.update(step_sketch=rep, clip_factor=rep)
        if spec.loss_spec.rollout_coefficients is not None:
            out_sh["rollout_coefficients"] = data
    if in_run:
        out_sh.update(rollout_sketches=data, rollout_grad_norms=data)
    return batch_sh, out_sh


def table_shardings(order: sketcher.ParamOrder, param_shardings: Any, mesh: jax.sharding.Mesh,
                    n_tables: int) -> list[jax.sharding.NamedSharding]:
    """Shardings of the CountSketch hash tables (int32, one per parameter, its shape) as a step argument:
    each table split like its parameter over every mesh axis but ``"data"`` (so over ``"model"``;
    the in-run sketcher's ``shard_map`` is manual over ``"data"`` only and takes the tables whole
    there) and replicated over ``"data"``. On a mesh with ``model`` = 1 every table is replicated;
    so is every table where the parameter shardings do not line up with ``n_tables`` tables."""
    rep = sharding.replicated(mesh)
    try:
        shs = order.arrays(param_shardings)
    except (KeyError, ValueError):
        return [rep] * n_tables
    if len(shs) != n_tables:
        return [rep] * n_tables

    def drop_data(part):
        if part is None or part == sharding.DATA:
            return None
        if isinstance(part, tuple):
            kept = tuple(a for a in part if a != sharding.DATA)
            return kept[0] if len(kept) == 1 else (kept or None)
        return part

    return [jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*(drop_data(a) for a in sh.spec)))
            if isinstance(sh, jax.sharding.NamedSharding) else rep for sh in shs]


class _StepWithTables:
    """The jitted step with hash tables as its last argument (placed by :func:`table_shardings`),
    called like the plain step."""

    def __init__(self, jitted, rollout_sketcher: sketcher.PerExampleSketcher, table_sh: list):
        self.jitted, self.sketcher, self.table_sh = jitted, rollout_sketcher, table_sh
        self._tables = None

    def __call__(self, params, opt_state, batch, ref_params):
        if self._tables is None:
            self._tables = sharding.put(list(self.sketcher.tables), self.table_sh)
        return self.jitted(params, opt_state, batch, ref_params, self._tables)

    def abstract_tables(self) -> list[jax.ShapeDtypeStruct]:
        """``jax.ShapeDtypeStruct`` of each hash table with its step sharding (AOT lowering)."""
        return [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
                for a, sh in zip(self.sketcher.abstract_tables(), self.table_sh)]

    def lower(self, params, opt_state, batch, ref_params, tables=None):
        return self.jitted.lower(params, opt_state, batch, ref_params,
                                 tables if tables is not None else self.abstract_tables())
