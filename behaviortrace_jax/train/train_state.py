"""The train state shared by the LM trainer, the SFT warm-up and GRPO: params, AdamW state, step, RNG.

* :func:`make_optimizer`: global-norm clipping, then AdamW with torch's defaults (``eps_root`` only
  in the ``differentiable=True`` optimizer of the metagradient's vjp; SPEC §1.7, §2.1:
  ``clip_grad_norm_(1.0)`` then ``torch.optim.AdamW(lr)``; betas, eps and weight decay from
  ``config.optim``). The learning rate is ALWAYS a schedule (a constant one by default), so every
  optimizer built here has the same state tree whatever its learning rate: the SFT warm-up's
  state restores into GRPO's optimizer and its Adam moments and bias-correction count carry over,
  as the paper's single torch optimizer object does (SPEC §1.7).
* :class:`TrainState`: ``params`` (``nnx.State`` from ``nnx.split(model, nnx.Param)``),
  ``opt_state``, ``step`` (int32 scalar: optimizer updates applied so far) and ``rng`` (a typed PRNG
  key), a pytree that ``jax.jit`` can donate.
* :func:`save` / :func:`restore`: orbax checkpoints through ``checkpoints.save_train_state`` /
  ``restore_train_state`` under ``directory/<step>/``.
* :func:`perturb_last_bit`: a test-only switch (``BEHAVIORTRACE_PERTURB_BASE_WEIGHT``, off unless
  set) that flips the last bit of one initial base-model weight, so a test can show that the
  determinism check of tests/pipeline/test_readme_command.py fails when a run does not repeat.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from behaviortrace_jax.io import checkpoints
from behaviortrace_jax.models import sharding

Schedule = Callable[[jax.Array], jax.Array]


def make_schedule(lr: float, steps: int = 0, warmup_steps: int = 0, end_lr_fraction: float = 1.0) -> Schedule:
    """Learning rate as a function of the update count (optax schedule).

    Constant ``lr`` when ``warmup_steps == 0`` and ``end_lr_fraction == 1`` (SPEC §1.7, §2.1: constant,
    no warm-up). Otherwise a linear warm-up from 0 to ``lr`` over ``warmup_steps`` updates, then a
    cosine decay to ``lr * end_lr_fraction`` at update ``steps`` (TINY_CALIBRATION base model:
    30 warm-up steps, cosine to 10%).

    Raises:
        ValueError: naming the value for ``lr <= 0``, negative ``warmup_steps``, ``end_lr_fraction``
            outside [0, 1], or ``steps <= warmup_steps`` for a decaying schedule.
    """
    if not lr > 0:
        raise ValueError(f"learning rate must be > 0, got {lr}")
    if warmup_steps < 0 or not 0.0 <= end_lr_fraction <= 1.0:
        raise ValueError(f"need warmup_steps >= 0 and end_lr_fraction in [0, 1], got {warmup_steps}, "
                         f"{end_lr_fraction}")
    if warmup_steps == 0 and end_lr_fraction == 1.0:
        return optax.constant_schedule(lr)
    if steps <= warmup_steps:
        raise ValueError(f"schedule: steps={steps} must exceed warmup_steps={warmup_steps}")
    return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=lr, warmup_steps=warmup_steps,
                                              decay_steps=steps, end_value=lr * end_lr_fraction)


def differentiable_clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm(max_norm)`` whose vjp is finite at a zero gradient.

    The forward IS optax's update (same values bit for bit). Its vjp is written out: identity where
    the global norm ``n = |g|`` is below ``max_norm`` (the forward returns ``g``), else
    ``(c / n) * (ct - g <g, ct> / n^2)``. ``jax.vjp`` of optax's own update returns NaN at
    ``g = 0`` (``sqrt'(0)`` and the unselected ``g / n`` branch), and a GRPO step whose advantages
    are all 0 has exactly that gradient (the metagradient, ``train/metagradient.py``, runs through
    such steps).
    """
    clip = optax.clip_by_global_norm(max_norm)

    @jax.custom_vjp
    def apply(updates):
        return clip.update(updates, optax.EmptyState())[0]

    def fwd(updates):
        return apply(updates), updates

    def bwd(updates, ct):
        norm = optax.tree.norm(updates)
        clipped = jnp.logical_not(norm < max_norm)
        safe = jnp.where(clipped, norm, 1.0)
        dot = sum(jnp.vdot(g, c) for g, c in zip(jax.tree.leaves(updates), jax.tree.leaves(ct)))
        return (jax.tree.map(lambda g, c: jnp.where(clipped, (max_norm / safe) * (c - g * (dot / safe ** 2)), c)
                             .astype(c.dtype), updates, ct),)

    apply.defvjp(fwd, bwd)
    return optax.GradientTransformation(optax.init_empty_state, lambda u, state, params=None: (apply(u), state))


# Adam's eps_root in the differentiable optimizer (the metagradient's vjp): sqrt(nu + eps_root). The
# derivative of sqrt at nu = 0 is infinite, and an Adam second moment is exactly 0 for every parameter
# that never got a gradient (an untied head's or embedding's unused rows): its cotangent is then
# 0 * inf = NaN, and the whole metagradient NaN. 1e-30 makes sqrt' finite (5e14) and changes
# nu + eps_root only where nu < ~1e-23 (float32 spacing), far below any second moment of a used
# parameter; with mu = 0 there the cotangent is exactly 0.
DIFFERENTIABLE_EPS_ROOT = 1e-30


@dataclasses.dataclass(frozen=True)
class OptimOptions:
    """The optimizer of SFT and GRPO (``config.optim``; SPEC §1.7, §2.1), built at the stage
    boundary (``stages/spec.py``).

    Fields: ``lr`` (float > 0, the constant learning rate), ``b1`` / ``b2`` (Adam betas in [0, 1)),
    ``eps`` (Adam epsilon), ``weight_decay`` (decoupled, on every parameter), ``grad_clip`` (global
    L2 norm; <= 0 disables clipping). Defaults: torch.optim.AdamW's, with the paper's lr and clip.

    Raises:
        ValueError: naming the key (``config.optim.<key>``) for a beta outside [0, 1), an ``lr`` or
            ``eps`` that is not > 0, a ``weight_decay`` < 0, or a value that is not finite (torch's
            AdamW refuses the same; ``stages/spec.py`` checks them up front too).
    """

    lr: float = 5e-6
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float = 1.0

    def __post_init__(self):
        for key in ("b1", "b2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"config.optim.{key}={getattr(self, key)} must be in [0, 1)")
        for key, ok, what in (("lr", lambda v: v > 0, "> 0"), ("eps", lambda v: v > 0, "> 0"),
                              ("weight_decay", lambda v: v >= 0, ">= 0"), ("grad_clip", lambda v: True, "finite")):
            value = getattr(self, key)
            if not (math.isfinite(value) and ok(value)):
                raise ValueError(f"config.optim.{key}={value} must be {what}" + (
                    "" if key == "grad_clip" else " and finite"))


def make_optimizer(options: OptimOptions, schedule: Schedule | float | None = None, *,
                   differentiable: bool = False) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW (decoupled weight decay on every parameter, like torch).

    Args:
        options: :class:`OptimOptions` (``config.optim``: ``lr``, ``b1``, ``b2``, ``eps``,
            ``weight_decay``, ``grad_clip``; SPEC §1.7, §2.1). ``grad_clip <= 0`` disables clipping.
        schedule: the learning rate: an optax schedule (e.g. :func:`make_schedule`), a float
            (constant), or None for the constant ``options.lr``.
        differentiable: for differentiating through the optimizer (the metagradient's vjp): clip
            with :func:`differentiable_clip_by_global_norm` (same updates, a vjp that is finite at
            a zero gradient) and give Adam ``eps_root = DIFFERENTIABLE_EPS_ROOT`` (a finite
            derivative where a second moment is exactly 0). The run's own optimizer
            (``differentiable=False``: every stage's update, and the metagradient's forward, which
            is the run's step program) has ``eps_root = 0``, optax's and torch's update bit for bit;
            only the vjp's linearisation sees ``eps_root``.

    Returns:
        ``optax.chain(clip_by_global_norm, adamw)``; its state tree does not depend on ``schedule``
        nor on ``differentiable``.

    Raises:
        ValueError: for a learning rate <= 0 (``make_schedule``).
    """
    if schedule is None or isinstance(schedule, (int, float)):
        schedule = make_schedule(float(options.lr if schedule is None else schedule))
    clip_fn = differentiable_clip_by_global_norm if differentiable else optax.clip_by_global_norm
    clip = clip_fn(options.grad_clip) if options.grad_clip > 0 else optax.identity()
    eps_root = DIFFERENTIABLE_EPS_ROOT if differentiable else 0.0
    return optax.chain(clip, optax.adamw(schedule, b1=options.b1, b2=options.b2, eps=options.eps,
                                         eps_root=eps_root, weight_decay=options.weight_decay))


def clip_factor(grad_norm: jax.Array, grad_clip: float) -> jax.Array:
    """The factor :func:`make_optimizer`'s clipping multiplies the gradient by (SPEC §2.1, §3.2:
    the step sketch is of the clipped gradient): ``grad_clip / max(grad_norm, grad_clip)``
    (``optax.clip_by_global_norm``), and exactly 1 when ``grad_clip <= 0`` (no clipping).
    ``grad_norm``: float32 scalar, the pre-clip global L2 norm."""
    if grad_clip <= 0:
        return jnp.ones_like(grad_norm)
    return grad_clip / jnp.maximum(grad_norm, grad_clip)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a resumable trainer needs (a pytree; every leaf is a ``jax.Array``).

    Attributes:
        params: ``nnx.State`` of the model parameters (HF layout, ``config.model.param_dtype``).
        opt_state: the ``make_optimizer`` state (clip state, Adam count/mu/nu, schedule count).
        step: int32 scalar, optimizer updates applied so far.
        rng: typed PRNG key (``jax.random.key``) for stochastic parts of a stage.
    """

    params: Any
    opt_state: Any
    step: jax.Array
    rng: jax.Array

    def as_dict(self) -> dict[str, Any]:
        """``{"params", "opt_state", "step", "rng"}`` (the tree that is checkpointed)."""
        return {"params": self.params, "opt_state": self.opt_state, "step": self.step, "rng": self.rng}

    def replace(self, **kw: Any) -> "TrainState":
        return dataclasses.replace(self, **kw)


def init_train_state(params: Any, optimizer: optax.GradientTransformation, rng: jax.Array | int = 0,
                     shardings: TrainState | None = None) -> TrainState:
    """A fresh state at step 0: ``optimizer.init(params)`` (zero moments) and ``rng``.

    Args:
        params: the parameter ``nnx.State``.
        optimizer: from :func:`make_optimizer`.
        rng: a typed key or an int seed (``jax.random.key(rng)``).
        shardings: optional :func:`train_state_shardings`; the state is placed there (the moments
            then follow the parameter shardings).
    """
    key = jax.random.key(rng) if isinstance(rng, int) else rng
    init = jax.jit(optimizer.init, out_shardings=None if shardings is None else shardings.opt_state)
    state = TrainState(params=params, opt_state=init(params), step=jnp.zeros((), jnp.int32), rng=key)
    return state if shardings is None else sharding.put(state, shardings)


PERTURB_ENV = "BEHAVIORTRACE_PERTURB_BASE_WEIGHT"


def perturbation_setting(environ: Any = os.environ) -> str:
    """``$BEHAVIORTRACE_PERTURB_BASE_WEIGHT``: ``""`` (unset: off, the default), ``"random"`` or a
    flat element index (digits). The one place the variable is read (the ``base`` stage's
    fingerprint and its weight initialisation both ask here).

    Raises:
        ValueError: naming the variable, for any other value.
    """
    value = str(environ.get(PERTURB_ENV, "")).strip()
    if value and value != "random" and not value.isdigit():
        raise ValueError(f"{PERTURB_ENV}={value!r}: expected 'random' or an element index (it is a test switch; "
                         "unset it for a normal run)")
    return value


def perturb_last_bit(params: Any, setting: str, entropy: int | None = None) -> tuple[Any, str]:
    """``params`` with the lowest bit of ONE element flipped (one unit in the last place): a run that
    should repeat bit for bit, made not to (tests/pipeline/test_readme_command.py).

    Args:
        params: a pytree of float arrays (the base model's initial ``nnx.State``).
        setting: ``"random"``: the element is drawn from ``entropy`` (default: the clock and
            ``os.urandom``), so two runs perturb different elements; digits: that index into the
            leaves' elements in tree order, flattened C-order (a repeatable perturbation).
        entropy: the random draw's seed, for tests.
    Returns:
        (the new params, each leaf keeping its sharding; a description
        ``"<leaf path>[<index>] <old> -> <new>"``).
    Raises:
        ValueError: for another ``setting``, an index past the last element, or no float leaves.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    floats = [i for i, (_, x) in enumerate(leaves) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]
    sizes = np.array([int(np.prod(leaves[i][1].shape)) for i in floats], np.int64)
    if not floats or sizes.sum() == 0:
        raise ValueError("perturb_last_bit: params hold no float elements")
    if setting == "random":
        seed = entropy if entropy is not None else time.time_ns() ^ int.from_bytes(os.urandom(8), "little")
        flat = int(np.random.default_rng(seed).integers(sizes.sum()))
    elif setting.isdigit():
        flat = int(setting)
        if flat >= sizes.sum():
            raise ValueError(f"{PERTURB_ENV}={setting}: the params hold {int(sizes.sum())} float elements")
    else:
        raise ValueError(f"{PERTURB_ENV}={setting!r}: expected 'random' or an element index")
    pick = int(np.searchsorted(np.cumsum(sizes), flat, side="right"))
    leaf_i, index = floats[pick], flat - int(np.concatenate([[0], np.cumsum(sizes)])[pick])
    path, leaf = leaves[leaf_i]
    host = np.array(jax.device_get(leaf))
    bits = host.reshape(-1).view(np.dtype(f"u{host.dtype.itemsize}"))
    old = host.reshape(-1)[index].item()
    bits[index] ^= 1
    new_leaf = jax.device_put(host, leaf.sharding) if hasattr(leaf, "sharding") else jnp.asarray(host)
    out = [x for _, x in leaves]
    out[leaf_i] = new_leaf
    what = f"{jax.tree_util.keystr(path)}[{index}] {old!r} -> {host.reshape(-1)[index].item()!r}"
    return jax.tree_util.tree_unflatten(treedef, out), what


def opt_state_shardings(optimizer: optax.GradientTransformation, param_shardings: Any, mesh: Mesh,
                        abstract_params: Any) -> Any:
    """Shardings of ``optimizer.init(params)``: Adam moments like their parameter, counts replicated.

    Args:
        param_shardings: the ``sharding.param_shardings`` tree (same structure as the params).
        abstract_params: params or ``jax.ShapeDtypeStruct`` leaves (for ``jax.eval_shape``).
    """
    abstract = jax.eval_shape(optimizer.init, abstract_params)
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(optimizer, lambda _, s: s, abstract, param_shardings,
                                 transform_non_params=lambda _: replicated)


def train_state_shardings(optimizer: optax.GradientTransformation, param_shardings: Any, mesh: Mesh,
                          abstract_params: Any) -> TrainState:
    """A :class:`TrainState` of shardings (params as given, moments alike, step and rng replicated)."""
    replicated = NamedSharding(mesh, P())
    return TrainState(params=param_shardings,
                      opt_state=opt_state_shardings(optimizer, param_shardings, mesh, abstract_params),
                      step=replicated, rng=replicated)


def abstract_train_state(abstract_params: Any, optimizer: optax.GradientTransformation,
                         shardings: TrainState | None = None) -> TrainState:
    """The state's ``jax.ShapeDtypeStruct`` tree (with ``shardings`` when given), for :func:`restore`."""
    abstract = jax.eval_shape(lambda p: init_train_state(p, optimizer, 0), abstract_params)
    if shardings is None:
        return abstract
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def save(directory: str | os.PathLike, state: TrainState, max_to_keep: int | None = None) -> int:
    """Saves ``state`` as the orbax checkpoint ``directory/<state.step>`` (atomic); returns the step.

    Raises:
        ValueError: when that step is already saved (``checkpoints.save_train_state``).
    """
    step = int(jax.device_get(state.step))
    checkpoints.save_train_state(directory, step, state.as_dict(), max_to_keep=max_to_keep)
    return step


def restore(directory: str | os.PathLike, abstract_state: TrainState, step: int | None = None) -> TrainState:
    """Restores ``directory/<step>`` (None: the latest) into the structure / shardings of
    ``abstract_state`` (e.g. :func:`abstract_train_state`).

    Raises:
        FileNotFoundError: no complete checkpoint there.
        ValueError: the checkpoint holds a different model or optimizer (names the keys).
    """
    d = checkpoints.restore_train_state(directory, step, abstract_state.as_dict())
    return TrainState(params=d["params"], opt_state=d["opt_state"], step=d["step"], rng=d["rng"])
