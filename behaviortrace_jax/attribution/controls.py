"""The target-free controls read from the training log (SPEC §4, §6; ``estimators.py``'s docstring):
the reward-only controls (advantage, abs-advantage, reward, step-sum-abs-advantage,
step-reward-std), the text and length controls (pattern-match, length, step-sum-pattern-match,
step-sum-length) and the magnitude control with the advantage divided out (``norm/|A|``), each
registered by name with ``role="control"``, ``per="rollout"``.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

# registered after the step-level estimators: the registration order is the tables' column order
from behaviortrace_jax.attribution import step_estimators  # noqa: F401
from behaviortrace_jax.attribution.estimator_registry import (ABS_ADVANTAGE_CONTROL, LENGTH_CONTROL, TEXT_CONTROL,
                                                             check_sketches, check_steps, register_estimator)

# --------------------------------------------------------------------------------------------
# reward-only controls (module docstring): the training log alone, no target, no gradient
# --------------------------------------------------------------------------------------------
def _log_values(values, name: str) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"{name} must be 1-D [N] in log order, got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} contain non-finite values (first at index {int(np.flatnonzero(~np.isfinite(x))[0])})")
    return x


def _per_step(values: np.ndarray, rollout_steps, reduce: Callable[[np.ndarray], float]) -> np.ndarray:
    """``reduce`` of ``values`` over each step's rollouts, given back to every rollout of the step."""
    s = check_steps(rollout_steps, values.size)
    keys, inverse = np.unique(s, return_inverse=True)
    per = np.array([reduce(values[inverse == j]) for j in range(keys.size)], dtype=np.float64)
    return per[inverse]


@register_estimator("advantage", level="step", role="control", per="rollout")
def advantage_control(advantages) -> np.ndarray:
    """A_i, the logged GRPO group advantage (reward-only control). float64 [N], log order."""
    return _log_values(advantages, "advantages")


@register_estimator(ABS_ADVANTAGE_CONTROL, level="step", role="control", per="rollout")
def abs_advantage_control(advantages) -> np.ndarray:
    """|A_i| (reward-only control): how far a rollout's reward is from its group's. float64 [N]."""
    return np.abs(_log_values(advantages, "advantages"))


@register_estimator("reward", level="step", role="control", per="rollout")
def reward_control(rewards) -> np.ndarray:
    """r_i, the logged final reward, bonus included (reward-only control). float64 [N]."""
    return _log_values(rewards, "rewards")


@register_estimator("step-sum-abs-advantage", level="step", role="control", per="rollout")
def step_sum_abs_advantage(advantages, rollout_steps) -> np.ndarray:
    """Σ |A_j| over the rollouts j of rollout i's step (reward-only step control). float64 [N]."""
    return _per_step(np.abs(_log_values(advantages, "advantages")), rollout_steps, np.sum)


@register_estimator("step-reward-std", level="step", role="control", per="rollout")
def step_reward_std(rewards, rollout_steps) -> np.ndarray:
    """np.std (ddof 0) of the rewards of rollout i's step (reward-only step control). float64 [N]."""
    return _per_step(_log_values(rewards, "rewards"), rollout_steps, np.std)


# --------------------------------------------------------------------------------------------
# text and length controls (module docstring): the logged completion alone, no target, no gradient
# --------------------------------------------------------------------------------------------
def _matches(pattern_matches) -> np.ndarray:
    x = np.asarray(pattern_matches)
    if x.ndim != 1:
        raise ValueError(f"pattern_matches must be 1-D [N] in log order, got shape {x.shape}")
    if x.dtype != bool and not np.isin(x, (0, 1)).all():
        raise ValueError("pattern_matches must be booleans (or 0/1), got values "
                         f"{np.unique(x[~np.isin(x, (0, 1))])[:5].tolist()}")
    return x.astype(np.float64)


def _lengths(completion_lengths) -> np.ndarray:
    x = _log_values(completion_lengths, "completion_lengths")
    if (x < 0).any() or (x != np.round(x)).any():
        raise ValueError(f"completion_lengths must be token counts >= 0, first bad at index "
                         f"{int(np.flatnonzero((x < 0) | (x != np.round(x)))[0])}")
    return x


@register_estimator(TEXT_CONTROL, level="step", role="control", per="rollout")
def pattern_match_control(pattern_matches) -> np.ndarray:
    """1.0 where the decoded completion contains the behaviour's pattern (the contaminator's judge,
    computed by the stage), else 0.0 (text control). float64 [N], log order.

    Raises:
        ValueError: not 1-D, or values other than booleans / 0 / 1.
    """
    return _matches(pattern_matches)


@register_estimator(LENGTH_CONTROL, level="step", role="control", per="rollout")
def length_control(completion_lengths) -> np.ndarray:
    """The logged completion's token count, EOS included (length control). float64 [N], log order.

    Raises:
        ValueError: not 1-D, non-finite, negative or fractional counts.
    """
    return _lengths(completion_lengths)


@register_estimator("step-sum-pattern-match", level="step", role="control", per="rollout")
def step_sum_pattern_match(pattern_matches, rollout_steps) -> np.ndarray:
    """How many of rollout i's step's completions contain the pattern (text step control). float64 [N]."""
    return _per_step(_matches(pattern_matches), rollout_steps, np.sum)


@register_estimator("step-sum-length", level="step", role="control", per="rollout")
def step_sum_length(completion_lengths, rollout_steps) -> np.ndarray:
    """The completion tokens of rollout i's step, summed (length step control). float64 [N]."""
    return _per_step(_lengths(completion_lengths), rollout_steps, np.sum)


@register_estimator("norm/|A|", level="step", role="control", per="rollout")
def norm_over_abs_advantage(rollout_sketches, advantages) -> np.ndarray:
    """|v_i|₂ / |A_i| on per-rollout sketches, 0 where A_i = 0: the magnitude control with the
    advantage divided out (for weighted sketches clip_s |c_i| |g_i| / |A_i|). float64 [N].

    Raises:
        ValueError: ``advantages`` not [N] for sketches [N, D].
    """
    v, _ = check_sketches(rollout_sketches)
    a = np.abs(_log_values(advantages, "advantages"))
    if a.shape != (v.shape[0],):
        raise ValueError(f"advantages shape {a.shape} != ({v.shape[0]},) rollout sketches")
    norms = np.linalg.norm(v.astype(np.float64), axis=1)
    return np.divide(norms, a, out=np.zeros_like(norms), where=a > 0)
