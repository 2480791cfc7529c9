"""The jitted, sharded GRPO train step (SPEC §2.2 step 4) and the batch it consumes.

``build_batch`` lays out one step's N = B x G rollouts as fixed-shape arrays (prompt left-padded,
completion right-padded, the loss mask up to and including the first EOS); ``make_train_step``
returns ONE jitted function that computes the loss of the whole batch, clips the global gradient
norm, applies the optimizer and returns, as side outputs, the CountSketch of the clipped batch
gradient (the step sketch, SPEC §3.2) and the CountSketch of each rollout's own loss term (in-run
rollout sketches). The resumable loop that drives it is ``stages/grpo.py``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from behaviortrace_jax.models import decoder, sharding
from behaviortrace_jax.sketch import sketcher
from behaviortrace_jax.train import grpo_loss


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
                pad_id: int) -> dict[str, np.ndarray]:
    """Assembles the fixed-shape train batch of N rollouts.

    Args:
        prompt_ids: N token lists (each <= P; left-padded here).
        completions: int [N, T] sampled completion tokens (pad after EOS).
        lengths: int [N] number of generated tokens (incl. the EOS, if any).
        advantages: float32 [N].
        eos_ids: ids masked out of the loss (SPEC §2.2 f), ``tokenizer.mask_eos_ids(tok,
            config.model.mask_eos)``, the same ids ``targets.response_examples`` masks.

    Returns:
        dict of numpy arrays: ``input_ids`` int32 [N, P+T], ``attention_mask`` int32 [N, P+T],
        ``loss_mask`` float32 [N, T], ``advantages`` float32 [N].

    Raises:
        ValueError: a prompt longer than P or mismatched shapes.
    """
    n, p, t = shapes.num_rollouts, shapes.prompt_len, shapes.completion_len
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
                        attention_mask: jax.Array, prompt_len: int) -> jax.Array:
    """Log-probs float32 [N, T] of the completion tokens ``input_ids[:, P:]`` (SPEC §2.2 f).

    The logits at positions ``P-1 .. P+T-2`` predict the completion tokens.
    """
    positions = decoder.positions_from_mask(attention_mask)
    logits = decoder.forward(graphdef, params, input_ids, positions, attention_mask)
    return decoder.token_logprobs(logits[:, prompt_len - 1:-1], input_ids[:, prompt_len:])


def make_train_step(graphdef: nnx.GraphDef, abstract_params: Any, tx: optax.GradientTransformation,
                    shapes: StepShapes, *, loss_name: str, loss_cfg: grpo_loss.LossConfig,
                    grad_clip: float, order: sketcher.ParamOrder | None, sketch_dim: int,
                    sketch_seed: int, in_run_rollouts: bool, chunk_size: int,
                    mesh: jax.sharding.Mesh, param_shardings: Any, opt_shardings: Any,
                    inner_iterations: int = 1, weighted: bool = False, use_tables: bool = False,
                    one_backward: bool = False, sum_dtype: str = "float32"):
    """Builds the jitted GRPO train step: one call per GRPO step, the whole batch at once.

    ``step(params, opt_state, batch, ref_params) -> (params, opt_state, out)``:

    * ``batch``: the arrays of :func:`build_batch`, sharded on the mesh's data axis (rollouts);
    * ``ref_params``: the initial policy (grpo_clip's KL term; ignored by ``paper``);
    * ``out``: float32 ``loss`` and ``grad_norm`` (pre-clip global L2 norm); when ``order`` (a
      ``sketcher.hf_param_order``) is given, ``step_sketch [D]`` = CountSketch of the clipped
      batch gradient (SPEC §3.2, step 4) and, with ``in_run_rollouts``, ``rollout_sketches [N, D]``
      and ``rollout_grad_norms [N]`` = the sketch and exact norm of each rollout's own loss term at
      the step's parameters (they sum to the pre-clip batch gradient's sketch).

    Params and optimizer state are donated; in/out shardings are explicit. With
    ``inner_iterations`` > 1 (grpo_clip's mu) the sketches are of the first, on-policy iteration.
    With ``weighted`` (counterfactual replay, ``train/replay.py``) the batch also holds ``weights``
    float32 [N] and the loss is ``sum_i weights_i * term_i``; the default builds today's program.

    On a mesh whose ``"data"`` axis has > 1 device the in-run rollout sketches run per device under
    ``jax.shard_map`` (``sketcher.PerExampleSketcher(mesh=)``; what makes the step compile at 1.5B).
    With ``use_tables`` (``sketch.in_run_tables``) the CountSketch hash tables (int32, 4 bytes per
    parameter, replicated) are an extra argument of the jitted step instead of being hashed inside
    it; the returned callable then passes the sketcher's device tables itself (``step(params,
    opt_state, batch, ref_params)`` as before) and its ``lower(...)`` takes abstract ones.

    ``one_backward`` (``grpo.one_backward``; one iteration, unweighted, in-run rollout sketches on):
    the update uses the sum of the per-rollout gradients the in-run sketcher computes anyway
    (``PerExampleSketcher.sketch_and_sum``) instead of a second, batched backward - the same
    gradient up to float summation order (not bit-identical, so off by default). The step sketch is
    then ``scale * sum_i rollout_sketches[i]`` (CountSketch is linear, so this is the sketch of the
    clipped summed gradient up to float32 summation order; SPEC §3.2, §10.6), not a second
    CountSketch of a full gradient copy. ``sum_dtype`` (``grpo.sum_dtype``: "float32" or "bfloat16")
    is the dtype of that sum's accumulator (``sketch_and_sum(acc_dtype=)``): each rollout's gradient
    is added in it; the update is cast to the parameters' dtype either way.

    Raises:
        ValueError: ``one_backward`` without in-run sketches / with several iterations or weights,
            or an unknown ``sum_dtype``.
    """
    if sum_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"grpo.sum_dtype={sum_dtype!r}: expected 'float32' or 'bfloat16'")
    loss_fn = grpo_loss.get_loss(loss_name)
    prompt_len = shapes.prompt_len

    def lp_fn(params, ids, attn):
        return completion_logprobs(graphdef, params, ids, attn, prompt_len)

    def inputs(lp, old_lp, ref_lp, mask, adv):
        return grpo_loss.LossInputs(lp, old_lp, ref_lp, mask, adv, shapes.num_prompts, shapes.group_size)

    def rollout_term(p, ex):
        """One rollout's own term of the step loss (``ex`` has no batch axis)."""
        lp = lp_fn(p, ex["input_ids"][None], ex["attention_mask"][None])
        li = inputs(lp, ex["old_lp"][None], ex["ref_lp"][None], ex["loss_mask"][None], ex["advantages"][None])
        return loss_fn(li, loss_cfg)[0]

    rollout_sketcher = None
    if order is not None and in_run_rollouts:
        rollout_sketcher = sketcher.PerExampleSketcher(rollout_term, abstract_params, dim=sketch_dim,
                                                       seed=sketch_seed, chunk_size=chunk_size, param_order=order,
                                                       use_tables=use_tables, mesh=mesh)
    tables_arg = rollout_sketcher is not None and use_tables
    if one_backward and (rollout_sketcher is None or inner_iterations != 1 or weighted):
        raise ValueError("one_backward needs in-run rollout sketches, inner_iterations=1 and no weights")

    def step(params, opt_state, batch, ref_params, tables=None):
        ids, attn, mask, adv = batch["input_ids"], batch["attention_mask"], batch["loss_mask"], batch["advantages"]
        old_lp = jax.lax.stop_gradient(lp_fn(params, ids, attn))
        if loss_name == "grpo_clip":
            ref_lp = jax.lax.stop_gradient(lp_fn(ref_params, ids, attn))
        else:
            ref_lp = jnp.zeros_like(old_lp)

        def total_loss(p):
            terms = loss_fn(inputs(lp_fn(p, ids, attn), old_lp, ref_lp, mask, adv), loss_cfg)
            return jnp.sum(terms * batch["weights"] if weighted else terms)

        out = {}
        start_params = params
        res = None
        if one_backward:  # the per-rollout gradients, summed, are the batch gradient
            res, gsum, terms = rollout_sketcher.sketch_and_sum(params, dict(batch, old_lp=old_lp, ref_lp=ref_lp),
                                                               tables, acc_dtype=jnp.dtype(sum_dtype))
            summed = (jnp.sum(terms), jax.tree.map(lambda g, p: g.astype(p.dtype), gsum, params))
        for it in range(inner_iterations):
            loss, grads = summed if one_backward else jax.value_and_grad(total_loss)(params)
            if it == 0:
                out["loss"], out["grad_norm"] = loss, optax.tree.norm(grads)
                if order is not None:  # the gradient the optimizer applies: optax clip_by_global_norm
                    scale = grad_clip / jnp.maximum(out["grad_norm"], grad_clip)
                    if one_backward:  # CountSketch is linear: sketch(scale * sum_i g_i) = scale * sum_i sketch(g_i)
                        out["step_sketch"] = jnp.sum(res.sketches, axis=0) * scale
                    else:
                        out["step_sketch"] = sketcher.sketch_vector(grads, order, sketch_dim, sketch_seed) * scale
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        if rollout_sketcher is not None:
            rb = dict(batch, old_lp=old_lp, ref_lp=ref_lp)
            if res is not None:
                pass
            elif rollout_sketcher.mesh is None and not tables_arg:
                res = rollout_sketcher(start_params, rb)  # one device: the program as it always was
            else:
                res = rollout_sketcher.sketch(start_params, rb, tables)
            out["rollout_sketches"], out["rollout_grad_norms"] = res.sketches, res.norms
        return params, opt_state, out

    rep, data = sharding.replicated(mesh), sharding.data_sharding(mesh)
    batch_sh = {k: data for k in ("input_ids", "attention_mask", "loss_mask", "advantages")}
    if weighted:
        batch_sh["weights"] = data
    out_sh = {"loss": rep, "grad_norm": rep}
    if order is not None:
        out_sh["step_sketch"] = rep
        if in_run_rollouts:
            out_sh.update(rollout_sketches=data, rollout_grad_norms=data)
    ref_sh = param_shardings if loss_name == "grpo_clip" else None  # ref_params is None otherwise
    if not tables_arg:
        return jax.jit(step, in_shardings=(param_shardings, opt_shardings, batch_sh, ref_sh),
                       out_shardings=(param_shardings, opt_shardings, out_sh), donate_argnums=(0, 1))
    table_sh = table_shardings(order, param_shardings, mesh, len(rollout_sketcher.layout.shapes))
    jitted = jax.jit(step, in_shardings=(param_shardings, opt_shardings, batch_sh, ref_sh, table_sh),
                     out_shardings=(param_shardings, opt_shardings, out_sh), donate_argnums=(0, 1))
    return _StepWithTables(jitted, rollout_sketcher, table_sh)


def table_shardings(order: sketcher.ParamOrder, param_shardings: Any, mesh: jax.sharding.Mesh,
                    n_tables: int) -> list[jax.sharding.NamedSharding]:
    """Shardings of the CountSketch hash tables (int32, one per parameter, its shape) as a step argument:
    each table split like its parameter over every mesh axis but ``"data"`` (so over ``"model"``;
    the in-run sketcher's ``shard_map`` is manual over ``"data"`` only and takes the tables whole
    there) and replicated over ``"data"``. On a mesh with ``model`` = 1 every table is replicated, as
    before. Replicated where the parameter shardings do not line up with ``n_tables`` tables."""
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
