"""GRPO advantages and the policy-loss registry (SPEC §2.1, §2.2).

The one home of the group advantages: :func:`group_advantages` (the run's), :func:`recomputed_advantages`
(over the kept rollouts of a step: the counterfactual replay, the "skip" of non-finite rollouts) and
:func:`weighted_group_advantages` (differentiable in per-rollout weights: the metagradient).

Every registered loss returns **per-rollout terms** ``[N]`` whose sum is the step's loss. That
makes the in-run per-rollout sketch (the gradient of one term) add up exactly to the step's
pre-clip batch gradient, whatever loss is chosen.

Losses:
* ``paper`` (default; SPEC §2.2): ``term_i = -A_i * meanlp_i / (G * B)``, where ``meanlp_i`` is the
  masked mean completion log-prob (``sum(lp * mask) / (sum(mask) + 1e-8)``) and the sum over a
  group of G terms is the paper's ``-mean_j(A_j * meanlp_j) / B``. No KL, no ratio clipping, one
  on-policy update per batch.
* ``grpo_clip`` (DeepSeekMath GRPO, Shao et al. 2024, eq. 3): per token
  ``-(min(r * A, clip(r, 1 - eps, 1 + eps) * A) - beta * KL_k3)`` with ``r = exp(lp - lp_old)`` and
  the k3 estimator ``KL = exp(lp_ref - lp) - (lp_ref - lp) - 1`` against the initial policy;
  masked mean per rollout, mean over the N rollouts (``term_i = seq_i / N``). Defaults
  ``eps = 0.2`` (PPO, Schulman et al. 2017), ``beta = 0.04`` (DeepSeekMath; also the unused value
  in the paper's ``regimes/grpo.yaml``, SPEC §10.3), ``mu = 1``. Unscored positions are masked
  before ``exp`` (finite value and gradient for any finite input there).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


def group_advantages(rewards: np.ndarray, group_size: int, std_floor: float = 0.0) -> np.ndarray:
    """Group-normalised advantages ``(r - mean) / (max(std, floor) + 1e-8)`` (SPEC §2.1), and
    exactly 0 for every rollout of a group whose rewards are all equal.

    The float32 mean of equal non-dyadic rewards (0.1, 0.3, 1/3, ...) can be 1 ulp off, leaving a
    std of ~1e-8 that the 1e-8 eps does not dominate: the plain formula gives such groups
    advantages of about +-0.7 from rounding noise alone. Groups with ``max == min`` are therefore
    set to 0 explicitly. For the paper's rewards ({-2, 0, 6, 8}, dyadic) the plain formula already
    gives exactly 0 there, so every paper-config advantage is bit-identical to the plain formula.

    Args:
        rewards: float [N] final rewards (cast to float32), groups contiguous (``N = B * G``).
        group_size: G.
        std_floor: ``adv_std_floor`` (paper 0.0).

    Returns:
        float32 [N]. The std is the unbiased (n - 1) sample std, as torch's default.

    Raises:
        ValueError: if N is not a multiple of G, G < 2, or a reward is not finite.
    """
    r = np.asarray(rewards, np.float32)
    if group_size < 2 or r.ndim != 1 or r.size % group_size:
        raise ValueError(f"rewards of shape {r.shape} do not split into groups of {group_size} (G >= 2)")
    if not np.all(np.isfinite(r)):
        raise ValueError(f"rewards contain non-finite values: {r}")
    g = r.reshape(-1, group_size)
    std = g.std(axis=1, ddof=1, keepdims=True)
    adv = (g - g.mean(axis=1, keepdims=True)) / (np.maximum(std, np.float32(std_floor)) + np.float32(1e-8))
    adv = np.where(g.max(axis=1, keepdims=True) == g.min(axis=1, keepdims=True), np.float32(0.0), adv)
    return adv.reshape(-1).astype(np.float32)


def recomputed_advantages(rewards: np.ndarray, weights: np.ndarray, group_size: int, std_floor: float) -> np.ndarray:
    """Group advantages of one step over the kept rollouts only (``weights > 0``); removed rollouts
    and groups with fewer than 2 kept rollouts get 0. With every weight > 0 this equals
    :func:`group_advantages` (whose formula it applies to each group's kept rewards). The counterfactual
    replay's recomputed advantages (``train/replay.py``, which re-exports it) and the grpo stage's
    "skip" of non-finite rollouts.

    Args:
        rewards: float [N] (cast to float32), groups contiguous. weights: float [N], >= 0.
        group_size: G. std_floor: ``grpo.adv_std_floor``.
    Returns:
        float32 [N].
    """
    r = np.asarray(rewards, np.float32).reshape(-1, group_size)
    keep = np.asarray(weights).reshape(-1, group_size) > 0
    out = np.zeros_like(r)
    for g in range(r.shape[0]):
        k = keep[g]
        if k.sum() >= 2:
            out[g, k] = group_advantages(r[g, k], int(k.sum()), std_floor)
    return out.reshape(-1)


def weighted_group_advantages(rewards: jax.Array, weights: jax.Array, group_size: int,
                              std_floor: float = 0.0) -> jax.Array:
    """Group advantages with per-rollout frequency weights, differentiable in ``weights`` (SPEC §2.1).

    ``mu = sum w r / sum w``, ``var = sum w (r - mu)^2 / (sum w - 1)``,
    ``A = (r - mu) / (max(sqrt(var), floor) + 1e-8)``; 0 for every rollout of a group whose rewards
    are all equal (as :func:`group_advantages`, which this equals at ``w = 1`` up to
    float32 rounding, and :func:`recomputed_advantages` at ``w in {0, 1}`` on the kept
    rollouts of a group with >= 2 of them).

    A jnp formula of its own, not :func:`group_advantages` applied to the kept rewards: it must be
    differentiable in the weights (the metagradient's ``"recomputed"`` advantages,
    ``train/metagradient.py``, which re-exports it), so its mean and variance are weighted sums.

    Args:
        rewards: float32 [N], groups contiguous (N = B * G). weights: float [N], >= 0.
    Returns:
        float [N] (the weights' dtype).
    """
    r = rewards.astype(weights.dtype).reshape(-1, group_size)
    w = weights.reshape(-1, group_size)
    sw = jnp.sum(w, axis=1, keepdims=True)
    mu = jnp.sum(w * r, axis=1, keepdims=True) / sw
    var = jnp.sum(w * (r - mu) ** 2, axis=1, keepdims=True) / (sw - 1.0)
    flat = jnp.max(r, axis=1, keepdims=True) == jnp.min(r, axis=1, keepdims=True)
    std = jnp.sqrt(jnp.where(flat | (var <= 0), 1.0, var))  # no sqrt'(0) = inf in the derivative
    adv = (r - mu) / (jnp.maximum(std, std_floor) + 1e-8)
    return jnp.where(flat, 0.0, adv).reshape(-1)


@dataclasses.dataclass(frozen=True)
class LossInputs:
    """What a loss sees for N rollouts with T completion positions (all jnp arrays).

    logprobs: float32 [N, T] log-probs of the completion tokens under the current parameters.
    old_logprobs: float32 [N, T] the same under the parameters that sampled them (stop-gradient).
    ref_logprobs: float32 [N, T] under the initial policy (grpo_clip's KL), or zeros.
    mask: float32 [N, T] 1 for scored tokens (completion tokens != EOS; SPEC §2.2 f).
    advantages: float32 [N].
    num_prompts: B, group_size: G (Python ints).
    """

    logprobs: jax.Array
    old_logprobs: jax.Array
    ref_logprobs: jax.Array
    mask: jax.Array
    advantages: jax.Array
    num_prompts: int
    group_size: int


LossFn = Callable[[LossInputs, "LossConfig"], jax.Array]


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Loss hyper-parameters (config.grpo): ``clip_eps``, ``kl_beta`` (read by losses that use them)."""

    clip_eps: float = 0.2
    kl_beta: float = 0.04


@dataclasses.dataclass(frozen=True)
class Loss:
    """A registered GRPO loss and what the train step must give it.

    ``fn(inputs, cfg) -> per-rollout terms float32 [N]`` (their sum is the step's loss). The
    declarations tell the step (``train/grpo_step.py``), the replay and the compile stage what to
    compute, so no code outside this registry compares loss names:

    * ``needs_reference``: ``LossInputs.ref_logprobs`` holds the log-probs under the initial policy
      (a KL term); the step then takes the reference parameters as an argument (else zeros / None).
    * ``needs_old_logprobs``: ``old_logprobs`` holds the sampling policy's log-probs (an importance
      ratio; stop-gradient of the step's own forward), else zeros.
    * ``multi_iteration``: the loss may take ``grpo.inner_iterations`` > 1 updates per batch (PPO's
      mu); a loss without it runs exactly one.
    * ``one_backward``: the per-rollout terms may be differentiated one rollout at a time and summed
      as the update, so the fused sketcher's backward gives the (first iteration's) update and the
      in-run sketches at once (``GRPOStepSpec.update_from_sketcher``, ``sketch.fused``).
    * ``rollout_coefficients``: for a loss whose term is a parameter-free multiple of SPEC §3.2's
      rollout loss, ``term_i = c_i * (-masked_mean(logprobs_i))``, the function
      ``(inputs, cfg) -> c float32 [N]`` (``paper``: ``A_i / (G * B)``). Then one advantage-free
      gradient per rollout (of ``-meanlp_i``) gives both its direction and, times ``c_i``, its
      contribution to the update. None for a loss without that form (``grpo_clip``).
    * ``zero_at_zero_advantage``: ``(cfg) -> bool``, whether every term has exactly zero gradient
      when every advantage is 0 (then a replayed step with all-zero advantages, or weights times
      advantages, skips its forward and backward and applies the optimizer to zero gradients,
      bit for bit the full step: ``train/replay.py``). ``paper``: always (``A_i * meanlp_i``);
      ``grpo_clip``: only with ``kl_beta = 0`` (its KL to the reference policy does not vanish at
      A = 0). None (the default): never, so an unregistered claim is never assumed.
    """

    name: str
    fn: LossFn
    needs_reference: bool = False
    needs_old_logprobs: bool = False
    multi_iteration: bool = False
    one_backward: bool = True
    rollout_coefficients: Callable[[LossInputs, LossConfig], jax.Array] | None = None
    zero_at_zero_advantage: Callable[[LossConfig], bool] | None = None

    def zero_gradient_at_zero_advantage(self, cfg: LossConfig) -> bool:
        """Whether, under ``cfg``, a step whose every advantage is 0 has exactly zero gradient
        (see :attr:`zero_at_zero_advantage`)."""
        return self.zero_at_zero_advantage is not None and bool(self.zero_at_zero_advantage(cfg))

    def __call__(self, inp: LossInputs, cfg: LossConfig) -> jax.Array:
        return self.fn(inp, cfg)


LOSSES: dict[str, Loss] = {}


def register_loss(name: str, *, needs_reference: bool = False, needs_old_logprobs: bool = False,
                  multi_iteration: bool = False, one_backward: bool = True,
                  rollout_coefficients: Callable[[LossInputs, LossConfig], jax.Array] | None = None,
                  zero_at_zero_advantage: Callable[[LossConfig], bool] | None = None
                  ) -> Callable[[LossFn], LossFn]:
    """Registers ``fn(inputs: LossInputs, cfg: LossConfig) -> per-rollout terms [N]`` as loss
    ``name`` with its declarations (see :class:`Loss`). Raises ValueError for a duplicate name."""

    def wrap(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} already registered")
        LOSSES[name] = Loss(name, fn, needs_reference=needs_reference, needs_old_logprobs=needs_old_logprobs,
                            multi_iteration=multi_iteration, one_backward=one_backward,
                            rollout_coefficients=rollout_coefficients,
                            zero_at_zero_advantage=zero_at_zero_advantage)
        return fn

    return wrap


def get_loss(name: str) -> Loss:
    """Looks up a registered loss (callable like its function). Raises KeyError naming the known losses."""
    if name not in LOSSES:
        raise KeyError(f"config.grpo.loss={name!r} is not a registered loss; known: {sorted(LOSSES)}")
    return LOSSES[name]


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """``sum(x * mask, -1) / (sum(mask, -1) + 1e-8)`` (SPEC §2.2 f): [N, T] -> [N]."""
    return jnp.sum(x * mask, axis=-1) / (jnp.sum(mask, axis=-1) + 1e-8)


def paper_coefficients(inp: LossInputs, cfg: LossConfig) -> jax.Array:
    """``c_i = A_i / (G * B)``: the paper loss's term is ``c_i * (-meanlp_i)`` (SPEC §2.2 g); float32 [N]."""
    del cfg
    return inp.advantages / (inp.group_size * inp.num_prompts)


@register_loss("paper", rollout_coefficients=paper_coefficients, zero_at_zero_advantage=lambda cfg: True)
def paper_loss(inp: LossInputs, cfg: LossConfig) -> jax.Array:
    """SPEC §2.2 g: ``term_i = -A_i * meanlp_i / (G * B)``; float32 [N]."""
    del cfg
    meanlp = masked_mean(inp.logprobs, inp.mask)
    return -inp.advantages * meanlp / (inp.group_size * inp.num_prompts)


@register_loss("grpo_clip", needs_reference=True, needs_old_logprobs=True, multi_iteration=True,
               zero_at_zero_advantage=lambda cfg: cfg.kl_beta == 0)
def grpo_clip_loss(inp: LossInputs, cfg: LossConfig) -> jax.Array:
    """DeepSeekMath GRPO: clipped ratio + k3 KL to the initial policy; float32 [N] terms, each
    divided by the batch size ``G * B`` (not by the rows passed in: the step evaluates one rollout's
    term at a time for its in-run sketch, and the terms must add up to the batch loss).

    Both exponents (the ratio's ``lp - lp_old`` and the k3 estimator's ``lp_ref - lp``) are replaced
    by 0 at unscored positions (``mask == 0``) BEFORE ``exp`` (``jnp.where``, so neither the value
    nor the gradient sees them): a padding position with a log-ratio above ~88 would give
    ``exp = inf`` and ``inf * 0 = NaN`` in the masked mean and its gradient. Scored positions are
    unchanged bit for bit."""
    scored = inp.mask > 0  # mask before exp: a padding log-ratio of +100 must not become inf (inf * 0 = NaN)
    ratio = jnp.exp(jnp.where(scored, inp.logprobs - inp.old_logprobs, 0.0))
    adv = inp.advantages[:, None]
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv)
    log_r = jnp.where(scored, inp.ref_logprobs - inp.logprobs, 0.0)
    kl = jnp.exp(log_r) - log_r - 1.0
    per_token = -(surrogate - cfg.kl_beta * kl)
    return masked_mean(per_token, inp.mask) / (inp.group_size * inp.num_prompts)
