"""Metagradients of the behaviour through the replayed GRPO run: ``dM/dw_i`` for every logged rollout.

MAGIC (Ilyas & Engstrom 2025, "MAGIC: Near-Optimal Data Attribution for Deep Learning") makes
training deterministic and differentiates a measured output with respect to per-example data
weights through the whole training run. The replay here is deterministic (``train/replay.py``: the
logged rollouts, the run's own step, bit for bit at w = 1), the loss has per-rollout weights, and
the behaviour measure is continuous, so the same construction applies to online RL:

* ``w_i``: rollout i's loss weight, log order ``step * N + i`` (1 in the run; the step loss is
  ``sum_i w_i * term_i``, the ``weighted`` program of the replay).
* ``M``: the registered measure ``logp_margin`` (``train/measures.py``, ``differentiable``; teacher-forced mean log-prob of the pattern continuation,
  probe minus control) of the parameters after ``m`` replayed steps.
* ``dM/dw_i`` is differentiated through every update from the SFT start state to step ``m``: the
  loss, optax's global-norm clipping and AdamW (both moments, bias correction, decoupled weight
  decay, the schedule count) - the run's optimizer (``train_state.make_optimizer`` of the run's
  ``config.optim``) built with ``differentiable=True``: a clip whose vjp is finite at a zero
  gradient and Adam's ``eps_root`` (``train_state.DIFFERENTIABLE_EPS_ROOT``), without which a
  parameter that never gets a gradient (second moment exactly 0: an untied head's or embedding's
  unused rows) makes the metagradient NaN (``sqrt'(0) = inf``). ``eps_root`` is in the vjp only:
  the forward steps with the run's own optimizer (``eps_root = 0``), so the states it visits, and
  the point each vjp linearises at, are the run's checkpoints bit for bit.

Reverse mode over steps (REPLAY-style): the state ``(params, opt_state)`` after step t is
``F_t(state_t, w_t)``; the cotangent of ``M`` is pulled back through ``jax.vjp`` of one step at a
time, from step ``m - 1`` down to 0, each step's weight cotangent being ``dM/dw_t``. The states a
step's vjp needs are recomputed from checkpoints held every ``k`` steps (``checkpoint_every``;
default ``ceil(sqrt(m))``): at most ``ceil(m / k) + k`` states are held at once (reported), and the
forward is run twice (once to place the checkpoints, once per segment in the reverse sweep).

Advantages (``advantages=``):

* ``"logged"`` (default, as the replay): the logged advantages are constants.
* ``"recomputed"``: each group's baseline depends on the weights, the differentiable analogue of
  ``replay.recompute_advantages``. :func:`weighted_group_advantages` normalises a group with
  frequency weights (weighted mean, weighted unbiased variance ``sum w (r - mu)^2 / (sum w - 1)``):
  at ``w in {0, 1}`` it is the plain normalisation over the kept rollouts, at ``w = 1`` the logged
  one. The step uses ``A = A_logged + (A(w) - A(1))``, so at ``w = 1`` its value is exactly the
  logged advantage (the two normalisations are one vmapped computation, so ``A(w) - A(1)`` is 0
  bit for bit) and its derivative is ``dA(w)/dw``.

Which program: the forward is the run's own. A run whose update is the fused sketcher's weight
cotangent (``GRPOStepSpec.update_from_sketcher``: ``sketch.fused``, the default, with the paper
loss) is stepped by the run's own pure step function (``grpo_step.train_step_function``, weighted),
so the states are the run's bit for bit; the vjp is taken of the batched ``value_and_grad`` step
(:func:`make_weighted_step`), the same function of (params, opt_state, w) up to float summation
order, because the fused backward's custom vjps are not differentiated a second time. A run with
the batched backward (``sketch.fused=False``) uses that one step for both.

Limits (documented in docs/concepts/replays.md): the metagradient is the first-order effect of
down-weighting the logged rollouts of *this* trajectory (off-policy after a change, like the
replay).
"""
from __future__ import annotations

import dataclasses
import math
import resource
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from behaviortrace_jax.models import decoder, programs, sharding
from behaviortrace_jax.sketch import sketcher
from behaviortrace_jax.train import grpo_step, nonfinite, train_state
from behaviortrace_jax.train.grpo_loss import weighted_group_advantages  # noqa: F401 - re-exported (its home: grpo_loss)

ADVANTAGE_MODES = ("logged", "recomputed")
# Version of what a metagradient computes: bump it when a change to this module (the step, its vjp,
# the reverse sweep, the advantages) changes dM/dw, so that cached ``metagradient/<mode>.json``
# files are recomputed (the stage's cache key, stages/metagradient.py).
METAGRADIENT_VERSION = 1
MEASURE = "logp_margin"  # the differentiated measure M (a registered measure, train/measures.py)
PureStep = Callable[[Any, Any, Mapping[str, jax.Array], jax.Array, Any], tuple[Any, Any, dict]]


# ------------------------------------------------------------------------------------------------
# The differentiable pieces: the weighted GRPO step and its advantages
# ------------------------------------------------------------------------------------------------
def make_weighted_step(graphdef: Any, tx: optax.GradientTransformation, spec: grpo_step.GRPOStepSpec, *,
                       advantages: str = "logged", std_floor: float = 0.0) -> PureStep:
    """The GRPO update of ``spec`` as a pure function of the per-rollout weights (SPEC §2.2 step 4).

    ``step(params, opt_state, batch, weights, ref_params) -> (params, opt_state, out)``: the loss
    ``sum_i weights_i * term_i`` of the registered loss (``spec.loss``), ``jax.value_and_grad``,
    then ``tx`` (the run's optax chain: global-norm clip + AdamW), ``spec.inner_iterations`` times,
    as :func:`grpo_step.make_train_step` computes its update (without the sketch side outputs): the
    run's own pieces, ``grpo_step.with_policy_logprobs``, ``grpo_step.step_terms`` (weighted) and the
    update loop ``grpo_step.optimizer_iterations``.
    ``out`` holds float32 ``loss`` and ``grad_norm`` of the first iteration and the bool ``finite``
    (``nonfinite.step_finite``), as the run's step returns them: XLA fuses the forward by what the program outputs, and only with these outputs
    does the jitted step round exactly as the run's (tests/train/test_metagradient.py).

    ``batch``: :func:`grpo_step.build_batch` arrays, plus ``rewards`` float32 [N] when
    ``advantages="recomputed"``. The old log-probs of a ratio loss are a function of the step's
    input parameters here (the run stops their gradient inside the step, where they are constants
    of the update; their dependence on earlier weights is part of the metagradient).

    Raises:
        ValueError: an unknown ``advantages`` mode.
    """
    _check_advantages(advantages)

    def step(params, opt_state, batch, weights, ref_params):
        adv = _step_advantages(batch, weights, advantages, spec.shapes.group_size, std_floor)
        b = {k: batch[k] for k in ("input_ids", "attention_mask", "loss_mask")}
        rb = grpo_step.with_policy_logprobs(graphdef, spec, params, dict(b, advantages=adv, weights=weights),
                                            ref_params, constant_old=False)

        def total_loss(p):  # the run's loss terms (grpo_step.step_terms), weighted
            return jnp.sum(grpo_step.step_terms(graphdef, spec, True, p, rb))

        params, opt_state, out = grpo_step.optimizer_iterations(
            tx, spec.inner_iterations, params, opt_state, lambda it, p: jax.value_and_grad(total_loss)(p),
            lambda value, grads: {"loss": value, "grad_norm": optax.tree.norm(grads)})
        out[nonfinite.FINITE_KEY] = nonfinite.step_finite(out["loss"], out["grad_norm"], params)
        return params, opt_state, out

    return step


def _check_advantages(advantages: str) -> None:
    """Raises ValueError naming ``metagradient.advantages`` for a mode not in :data:`ADVANTAGE_MODES`."""
    if advantages not in ADVANTAGE_MODES:
        raise ValueError(f"metagradient.advantages: {advantages!r}; expected one of {ADVANTAGE_MODES}")


def _step_advantages(batch: Mapping[str, jax.Array], weights: jax.Array, advantages: str, group_size: int,
                     std_floor: float) -> jax.Array:
    """The step's advantages float32 [N]: the logged ones, or (``"recomputed"``) the logged value
    plus ``A(w) - A(1)`` (exactly the logged value at w = 1, with the weighted baseline's derivative)."""
    adv = batch["advantages"]
    if advantages == "recomputed":
        both = jax.vmap(weighted_group_advantages, (None, 0, None, None))(
            batch["rewards"], jnp.stack([weights, jnp.ones_like(weights)]), group_size, std_floor)
        adv = adv + (both[0] - both[1]).astype(adv.dtype)
    return adv


def make_run_forward(graphdef: Any, abstract_params: Any, tx: optax.GradientTransformation,
                     spec: grpo_step.GRPOStepSpec, order: Any, mesh: jax.sharding.Mesh, *,
                     advantages: str = "logged", std_floor: float = 0.0) -> PureStep:
    """The run's own weighted step (``grpo_step.train_step_function(weighted=True)``: for a fused
    run, the fused sketcher's one backward gives the update) as a :data:`PureStep` of the weights,
    for :class:`MetaStep`'s forward. Same signature and ``out`` (``loss``, ``grad_norm``) as
    :func:`make_weighted_step`; ``order``: ``sketcher.hf_param_order`` of the model.

    Raises:
        ValueError: an unknown ``advantages`` mode.
    """
    _check_advantages(advantages)
    run_step, _ = grpo_step.train_step_function(graphdef, abstract_params, tx, spec, order=order, mesh=mesh,
                                                weighted=True)

    def step(params, opt_state, batch, weights, ref_params):
        adv = _step_advantages(batch, weights, advantages, spec.shapes.group_size, std_floor)
        b = {k: batch[k] for k in ("input_ids", "attention_mask", "loss_mask")}
        params, opt_state, out = run_step(params, opt_state, dict(b, advantages=adv, weights=weights), ref_params)
        keep = ("loss", "grad_norm", nonfinite.FINITE_KEY)
        return params, opt_state, {k: out[k] for k in keep}

    return step


# ------------------------------------------------------------------------------------------------
# One step forward and its vjp, jitted
# ------------------------------------------------------------------------------------------------
def _inexact(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def opt_float_leaves(opt_state: Any) -> list:
    """The floating-point leaves of an optimizer state (Adam moments), in tree order: what carries a
    cotangent (integer leaves - step counts - carry none)."""
    return [x for x in jax.tree.leaves(opt_state) if _inexact(x)]


class MetaStep:
    """``forward`` and ``backward`` of one pure step, each jitted once.

    * ``forward(params, opt_state, batch, weights, aux) -> (params, opt_state, out)`` (``out``: the
      step's side outputs, a dict of scalars; they carry no cotangent);
    * ``backward(params, opt_state, batch, weights, aux, ct_params, ct_opt) -> (ct_params, ct_opt,
      ct_weights)``: the vjp of ``(params, opt_state)`` of the step at its inputs; ``ct_opt`` (in
      and out) is a list over :func:`opt_float_leaves`, ``ct_weights`` has the weights' shape.

    ``forward``: an optional other :data:`PureStep` for ``forward`` (the run's own program, e.g.
    :func:`make_run_forward`), equal to ``step`` up to float summation order; the vjp is always
    ``step``'s. ``shardings``: optional ``(params, opt_state, batch, weights, aux, out)`` shardings (the run's
    mesh; ``opt_state`` then names the optimizer state's structure, arrays or
    ``jax.ShapeDtypeStruct``), so that the forward is the same partitioned program as the run's
    step; without, jit's defaults. Nothing is donated: the reverse sweep keeps the states it
    checkpoints.
    """

    def __init__(self, step: PureStep, shardings: tuple | None = None, opt_state: Any = None,
                 forward: PureStep | None = None):
        self.step = step
        fwd = step if forward is None else forward

        def backward(params, opt_state, batch, weights, aux, ct_params, ct_opt):
            leaves, treedef = jax.tree.flatten(opt_state)
            idx = [i for i, x in enumerate(leaves) if _inexact(x)]

            def f(p, floats, w):
                full = list(leaves)
                for i, x in zip(idx, floats):
                    full[i] = x
                p2, o2, _ = step(p, jax.tree.unflatten(treedef, full), batch, w, aux)
                return p2, opt_float_leaves(o2)

            _, vjp = jax.vjp(f, params, [leaves[i] for i in idx], weights)
            return vjp((ct_params, list(ct_opt)))

        if shardings is None:
            self.forward = programs.jit("metagradient_step", fwd)
            self.backward = programs.jit("metagradient_step_vjp", backward)
            return
        if opt_state is None:
            raise ValueError("MetaStep: shardings need the optimizer state's structure (opt_state=)")
        p_sh, o_sh, b_sh, w_sh, a_sh, out_sh = shardings
        fl_sh = [s for s, x in zip(jax.tree.leaves(o_sh), jax.tree.leaves(opt_state)) if _inexact(x)]
        mesh = next((s.mesh for s in jax.tree.leaves(p_sh) if isinstance(s, jax.sharding.NamedSharding)), None)
        self.forward = programs.jit("metagradient_step", fwd, mesh=mesh, in_shardings=(p_sh, o_sh, b_sh, w_sh, a_sh),
                                    out_shardings=(p_sh, o_sh, out_sh))
        self.backward = programs.jit("metagradient_step_vjp", backward, mesh=mesh,
                                     in_shardings=(p_sh, o_sh, b_sh, w_sh, a_sh, p_sh, fl_sh),
                                     out_shardings=(p_sh, fl_sh, w_sh))


def build_meta_step(optim: train_state.OptimOptions, std_floor: float, graphdef: Any, abstract_params: Any,
                    model_config: Any,
                    spec: grpo_step.GRPOStepSpec, mesh: jax.sharding.Mesh, shardings: tuple, opt_state: Any, *,
                    advantages: str, remat: str = "") -> MetaStep:
    """The :class:`MetaStep` the ``metagradient`` stage runs, built once for both its users
    (:class:`RunMetagradient` and the compile stage's ``metagradient_step`` rows, so the compiled
    program is the one that runs): the vjp of :func:`make_weighted_step` with the run's optimizer
    made differentiable (``optim``), forward :func:`make_run_forward` where the run's update
    is the fused sketcher's (``spec.update_from_sketcher``), else that same step. The vjp's model
    rematerialises each decoder layer with the policy ``remat`` (``metagradient.remat``; "" = none; a
    name of ``models.decoder.REMAT_POLICIES``): the same values to float rounding, in less memory
    (docs/records/benchmarks.md, "The metagradient's vjp on a v5e:2x4"); the forward is never rematerialised.

    Args:
        optim: the run's :class:`train_state.OptimOptions`; std_floor: its ``grpo.adv_std_floor``. graphdef / abstract_params /
            model_config: the policy's. spec: the run's step. mesh: the run's.
        shardings / opt_state: as :class:`MetaStep`'s (``opt_state``: arrays or ShapeDtypeStructs).
        advantages: "logged" or "recomputed".
    Raises:
        ValueError: an unknown ``advantages`` mode, or a ``metagradient.remat`` that names no policy.
    """
    _check_advantages(advantages)
    remat = str(remat)
    try:
        vjp_graphdef = decoder.with_remat(graphdef, abstract_params, remat) if remat else graphdef
    except ValueError as e:
        raise ValueError(f"metagradient.remat={remat!r}: {e}") from None
    # The vjp differentiates the run's optimizer (same hyper-parameters and state tree) with a clip
    # whose vjp is finite at a zero gradient (a step whose advantages are all 0) and Adam's eps_root
    # (a finite derivative where a second moment is exactly 0: an untied model's unused rows). The
    # forward steps with the run's own optimizer (eps_root = 0), so its states are the run's.
    tx = train_state.make_optimizer(optim, differentiable=True)
    run_tx = train_state.make_optimizer(optim)
    floor = float(std_floor)
    step = make_weighted_step(vjp_graphdef, tx, spec, advantages=advantages, std_floor=floor)
    if spec.update_from_sketcher:  # the run's update is the fused backward's: step with that program
        forward = make_run_forward(graphdef, abstract_params, run_tx, spec, sketcher.hf_param_order(model_config),
                                   mesh, advantages=advantages, std_floor=floor)
    else:  # the run's batched step, with the run's optimizer
        forward = make_weighted_step(graphdef, run_tx, spec, advantages=advantages, std_floor=floor)
    return MetaStep(step, shardings, opt_state=opt_state, forward=forward)


# ------------------------------------------------------------------------------------------------
# Reverse mode over the steps, with recomputation from checkpoints
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Metagradient:
    """``dM/dw`` at one measure step: ``value`` = M (float, from the jitted measure), ``dw`` float64
    [m, N] (row t = step t's rollouts; steps >= m do not affect M and are not listed)."""

    step: int
    value: float
    dw: np.ndarray


@dataclasses.dataclass
class ReverseStats:
    """What the reverse sweep cost: seconds (wall, process CPU), forward / backward step calls,
    the most states held at once and their bytes, ``checkpoint_every`` and the peak RSS (bytes)."""

    wall_s: float
    cpu_s: float
    forward_steps: int
    backward_steps: int
    max_states_held: int
    state_bytes: int
    checkpoint_every: int
    peak_rss_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _tree_bytes(tree: Any) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def default_checkpoint_every(steps: int) -> int:
    """``ceil(sqrt(steps))``: the checkpoint spacing that minimises the states held, ``ceil(m/k) + k``."""
    return max(1, math.ceil(math.sqrt(max(steps, 1))))


def reverse_metagradients(meta: MetaStep, params: Any, opt_state: Any, batches: Sequence[Any],
                          weights: Sequence[Any], measure: Callable[[Any], tuple[Any, Any]],
                          measure_steps: Sequence[int], *, aux: Any = None, checkpoint_every: int = 0,
                          on_forward: Callable[[int, Any, Any], None] | None = None
                          ) -> tuple[dict[int, Metagradient], ReverseStats]:
    """``dM/dw`` at each of ``measure_steps`` by reverse mode over the steps (module docstring).

    Args:
        meta: the jitted step (:class:`MetaStep`).
        params, opt_state: the state before step 0 (not modified; not donated).
        batches, weights: per step ``t`` the batch and the weights (device arrays, placed as
            ``meta``'s shardings expect); ``len >= max(measure_steps)``.
        measure: ``params -> (M, dM/dparams)`` (e.g. ``jax.jit(jax.value_and_grad(f))``).
        measure_steps: steps m >= 1 (after m updates).
        aux: the step's extra argument (the reference parameters of a KL loss, else None).
        checkpoint_every: k, states held every k steps (0 = :func:`default_checkpoint_every`).
        on_forward: optional ``fn(step_done, params, opt_state)`` after each step of the first
            forward (tests compare it with the run's checkpoints).

    Returns:
        ``({m: Metagradient}, ReverseStats)``.

    Raises:
        ValueError: a measure step outside ``1..len(batches)``.
    """
    steps = sorted({int(m) for m in measure_steps})
    stop = steps[-1] if steps else 0
    if not steps or steps[0] < 1 or stop > min(len(batches), len(weights)):
        raise ValueError(f"metagradient: measure steps {steps} outside 1..{min(len(batches), len(weights))}")
    k = int(checkpoint_every) or default_checkpoint_every(stop)
    t0, c0 = time.perf_counter(), time.process_time()
    state_bytes = _tree_bytes(params) + _tree_bytes(opt_float_leaves(opt_state))
    ckpts, grads, n_fwd, n_bwd = {0: (params, opt_state)}, {}, 0, 0
    state = (params, opt_state)
    for t in range(stop):  # forward: checkpoints every k steps, the measure's gradient at each m
        state = meta.forward(*state, batches[t], weights[t], aux)[:2]
        n_fwd += 1
        if on_forward is not None:
            on_forward(t + 1, *state)
        if (t + 1) % k == 0 and t + 1 < stop:
            ckpts[t + 1] = state
        if t + 1 in steps:
            grads[t + 1] = measure(state[0])
    held = len(ckpts) + 1
    out = {}
    for m in steps:
        value, ct_p = grads[m]
        ct_o = [jnp.zeros_like(x) for x in opt_float_leaves(opt_state)]
        dw = [None] * m
        for a in reversed(range(0, m, k)):
            seg = [ckpts[a]]
            for t in range(a, min(a + k, m) - 1):  # recompute the segment's states
                seg.append(meta.forward(*seg[-1], batches[t], weights[t], aux)[:2])
                n_fwd += 1
            held = max(held, len(ckpts) + len(seg) + 1)
            for t in reversed(range(a, min(a + k, m))):
                ct_p, ct_o, ct_w = meta.backward(*seg.pop(), batches[t], weights[t], aux, ct_p, ct_o)
                dw[t] = ct_w
                n_bwd += 1
        rows = np.asarray(sharding.to_host(jnp.stack(dw)), np.float64)
        out[m] = Metagradient(m, float(value), rows)
    stats = ReverseStats(time.perf_counter() - t0, time.process_time() - c0, n_fwd, n_bwd, held,
                         held * state_bytes, k, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return out, stats


# ------------------------------------------------------------------------------------------------
# A finished run's metagradient
# ------------------------------------------------------------------------------------------------
class RunMetagradient:
    """``dM/dw`` of one finished run (built once, then :meth:`run` per measure-step set).

    Reuses the replay (:class:`replay.Replayer`: the SFT start state, every step's batch from the
    rollout log, the behaviour measure) and the run's own :class:`grpo_step.GRPOStepSpec` and
    optimizer; the step is :func:`make_weighted_step` jitted on the run's mesh with the run step's
    shardings (so at ``w = 1`` its forward is the run's trajectory, tests/train/test_metagradient.py).

    Args:
        options: the run's ``replay.ReplayOptions`` (``RunSpec.replay``). workdir: the run directory.
        advantages: "logged" or "recomputed" (module docstring).
        replayer: an existing :class:`replay.Replayer` of the run (built with ``rates=False`` on
            ``layout`` if None).
        layout: the run's ``sharding.Layout`` (needed without ``replayer``).
        remat: the vjp's rematerialisation policy per decoder layer (``metagradient.remat``;
            :func:`build_meta_step`).
    Raises:
        ValueError: an unknown ``advantages`` mode or ``remat`` policy, or neither ``replayer`` nor ``layout``; see
            :class:`replay.Replayer`.
    """

    def __init__(self, options, workdir, *, advantages: str = "logged", replayer: Any = None,
                 layout: sharding.Layout | None = None, remat: str = ""):
        from behaviortrace_jax.train import replay as R

        if replayer is None and layout is None:
            raise ValueError("RunMetagradient: give replayer= (a replay.Replayer of the run) or layout= (the run's "
                             "sharding.Layout)")
        self.rp = rp = replayer if replayer is not None else R.Replayer(options, workdir, layout=layout)
        self.advantages, start = advantages, rp.start
        data = rp.data_sharding
        self.batch_keys = ("input_ids", "attention_mask", "loss_mask", "advantages") + (
            ("rewards",) if advantages == "recomputed" else ())
        self.ref_params = start.params if rp.spec.loss_spec.needs_reference else None
        ref_sh = start.param_shardings if self.ref_params is not None else None
        self.meta = build_meta_step(rp.options.optim, rp.options.rollouts.adv_std_floor, start.graphdef,
                                    start.abstract_params, start.model_config, rp.spec,
                                    start.mesh, (start.param_shardings, start.opt_shardings,
                                                 {k: data for k in self.batch_keys}, data, ref_sh,
                                                 sharding.replicated(start.mesh)), start.opt_state,
                                    advantages=advantages, remat=remat)
        self.measure = measure = rp.measures[MEASURE]  # a registered measure that declares ``differentiable``
        if not measure.differentiable:
            raise ValueError(f"metagradient: measure {MEASURE!r} is not differentiable")
        self.measure_grad = programs.jit("replay_measure_grad", jax.value_and_grad(measure.scalar))
        self.n = rp.shapes.num_rollouts

    def batches(self, stop: int) -> list[dict[str, jax.Array]]:
        """Steps ``0 .. stop - 1``'s batches on the mesh (logged advantages; rewards when recomputed)."""
        out = []
        for d in self.rp.data[:stop]:
            b = dict(d.batch, rewards=d.rewards)
            out.append(jax.device_put({k: b[k] for k in self.batch_keys}, self.rp.data_sharding))
        return out

    def _weights(self, weights: np.ndarray | None, stop: int) -> list[jax.Array]:
        w = np.ones(self.rp.num_rollouts, np.float32) if weights is None else np.asarray(weights, np.float32)
        if w.shape != (self.rp.num_rollouts,):
            raise ValueError(f"metagradient: weights of shape {w.shape}, expected ({self.rp.num_rollouts},)")
        return [jax.device_put(w[t * self.n:(t + 1) * self.n], self.rp.data_sharding) for t in range(stop)]

    def run(self, measure_steps: Sequence[int], *, weights: np.ndarray | None = None, checkpoint_every: int = 0,
            on_forward: Callable[[int, Any, Any], None] | None = None
            ) -> tuple[dict[int, np.ndarray], dict[int, float], ReverseStats]:
        """``dM/dw`` at each measure step, at ``weights`` (default all 1, the run).

        Returns:
            ``({m: float64 [steps * N] dM/dw in log order, 0 for steps >= m}, {m: M},``
            :class:`ReverseStats`).
        Raises:
            FloatingPointError: a non-finite metagradient (names the measure step and how many).
        """
        stop = max(int(m) for m in measure_steps)
        start = self.rp.start
        params, opt = (jax.tree.map(jnp.copy, x) for x in (start.params, start.opt_state))
        res, stats = reverse_metagradients(self.meta, params, opt, self.batches(stop), self._weights(weights, stop),
                                           self.measure_grad, measure_steps, aux=self.ref_params,
                                           checkpoint_every=checkpoint_every, on_forward=on_forward)
        grads, values = {}, {}
        for m, r in res.items():
            full = np.zeros(self.rp.num_rollouts, np.float64)
            full[:m * self.n] = r.dw.reshape(-1)
            bad = int(np.sum(~np.isfinite(full)))
            if bad:
                raise FloatingPointError(f"metagradient at step {m}: {bad} non-finite dM/dw (an Adam second "
                                         "moment of exactly 0 makes sqrt's derivative infinite)")
            grads[m], values[m] = full, r.value
        return grads, values, stats

    def replay_margin(self, weights: np.ndarray | None, stop: int) -> float:
        """M after ``stop`` forward steps of the metagradient's own step at ``weights`` (any real
        values, e.g. ``1 +- eps`` for a finite-difference check; the replay takes [0, 1] only),
        measured as the replay measures it (``train/measures.py`` ``logp_margin``: float64 mean over prompts)."""
        start = self.rp.start
        state = tuple(jax.tree.map(jnp.copy, x) for x in (start.params, start.opt_state))
        for b, w in zip(self.batches(stop), self._weights(weights, stop)):
            state = self.meta.forward(*state, b, w, self.ref_params)[:2]
        return float(self.rp.measures.measure(state[0], (MEASURE,))[MEASURE])
