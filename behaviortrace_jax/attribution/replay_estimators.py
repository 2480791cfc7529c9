"""Estimators of unit effects from replayed designs (numpy only), one per replay plan
(``attribution/replay_plans.py``): the effect of intervening on unit u, Δ_u = M(no intervention) -
M(u intervened) (positive: the unit taught the behaviour).

* :func:`difference`: single-unit branches, ``Δ_u = baseline - replay_u`` (exact per unit).
* :func:`least_squares`: a datamodels fit over random subsets, ``baseline - replay_r ≈ b0 + X_r β``
  with ``X_r[u] = 1`` when unit u is intervened in replay r (``numpy.linalg.lstsq``, minimum norm);
  β_u estimates Δ_u under additivity; :func:`least_squares_fit` adds each β_u's t interval and the
  fit's leave-one-out predictive R² (the additivity check on held-out replays) and two F tests:
  :func:`equal_effects_test` (can the units' effects be told apart at all? if not, no ranking of
  them can score a method) and :func:`interaction_test` (do pairwise interactions add to the fit?).
* :func:`factorial_contrast`: a two-level (fractional) factorial with ±1 levels, the main effect
  ``β_u = mean(Δ | u intervened) - mean(Δ | not)``; :func:`fractional_factorial` builds the
  design (the columns of a Sylvester Hadamard matrix: resolution III, each main effect orthogonal
  to every other, aliased only with interactions).
"""
from __future__ import annotations

import dataclasses

import numpy as np
from scipy import stats


def difference(baseline: float, replays: np.ndarray) -> np.ndarray:
    """float64 [U]: ``baseline - replays`` (``replays`` float [U], one single-unit replay each)."""
    return float(baseline) - np.asarray(replays, np.float64)


def least_squares(baseline: float, design: np.ndarray, replays: np.ndarray) -> np.ndarray:
    """float64 [U]: β of ``baseline - replays ≈ b0 + design @ β`` (``design`` 0/1 [R, U], replays
    float [R]); the minimum-norm least-squares solution. Raises ValueError for mismatched shapes."""
    x = np.asarray(design, np.float64)
    y = float(baseline) - np.asarray(replays, np.float64)
    if x.ndim != 2 or y.shape != (x.shape[0],):
        raise ValueError(f"least_squares: design {x.shape} and replays {y.shape} do not match")
    a = np.concatenate([np.ones((x.shape[0], 1)), x], axis=1)
    beta = np.linalg.lstsq(a, y, rcond=None)[0]
    return beta[1:]


@dataclasses.dataclass(frozen=True)
class LeastSquaresFit:
    """:func:`least_squares_fit`'s result: ``beta``, ``se``, ``ci_low``, ``ci_high`` float64 [U] (the
    measure's units; nan when the fit has no residual degrees of freedom), ``df`` (R - rank of the
    design with its intercept), ``loo_r2`` (1 - PRESS / total sum of squares of Δ: how well the
    additive fit predicts each replay left out of it; nan without residual df), ``equal_effects_p``
    (:func:`equal_effects_test`) and ``interaction_p`` (:func:`interaction_test`), nan where the
    design cannot test them."""

    beta: np.ndarray
    se: np.ndarray
    ci_low: np.ndarray
    ci_high: np.ndarray
    df: int
    loo_r2: float
    equal_effects_p: float = float("nan")
    interaction_p: float = float("nan")


def least_squares_fit(baseline: float, design: np.ndarray, replays: np.ndarray, *, alpha: float = 0.05) -> LeastSquaresFit:
    """The :func:`least_squares` fit of ``baseline - replays ≈ b0 + design @ β`` (``design`` 0/1 [R, U],
    ``replays`` float [R]) with ordinary least-squares standard errors (``s² (AᵀA)⁻¹``, A = [1, X]),
    two-sided ``1 - alpha`` t intervals and the leave-one-out predictive R² (PRESS residuals
    ``e_r / (1 - h_rr)``; Allen 1974). Raises ValueError for mismatched shapes."""
    x = np.asarray(design, np.float64)
    y = float(baseline) - np.asarray(replays, np.float64)
    if x.ndim != 2 or y.shape != (x.shape[0],):
        raise ValueError(f"least_squares_fit: design {x.shape} and replays {y.shape} do not match")
    a = np.concatenate([np.ones((x.shape[0], 1)), x], axis=1)
    coef, _, rank, _ = np.linalg.lstsq(a, y, rcond=None)
    df = int(x.shape[0] - rank)
    nan = np.full(x.shape[1], np.nan)
    if df < 1 or rank < a.shape[1]:
        return LeastSquaresFit(coef[1:], nan, nan, nan, df, float("nan"))
    resid = y - a @ coef
    ata_inv = np.linalg.inv(a.T @ a)
    se = np.sqrt(np.diag(ata_inv)[1:] * float(resid @ resid) / df)
    t = stats.t.ppf(1 - alpha / 2, df)
    h = np.einsum("ij,jk,ik->i", a, ata_inv, a)  # leverages
    press = float(np.sum((resid / (1 - h)) ** 2))
    total = float(np.sum((y - y.mean()) ** 2))
    return LeastSquaresFit(coef[1:], se, coef[1:] - t * se, coef[1:] + t * se, df,
                           1 - press / total if total > 0 else float("nan"),
                           equal_effects_test(x, y), interaction_test(x, y))


def _rss(a: np.ndarray, y: np.ndarray) -> tuple[float, int]:
    """(residual sum of squares, rank) of the least-squares fit of y on the columns of a."""
    coef, _, rank, _ = np.linalg.lstsq(a, y, rcond=None)
    r = y - a @ coef
    return float(r @ r), int(rank)


def nested_f_test(small: np.ndarray, big: np.ndarray, y: np.ndarray) -> float:
    """p-value of the F test of the linear model ``big`` (columns [R, p1]) against the nested
    ``small`` ([R, p0], its columns in big's span): F = ((RSS0 - RSS1) / (rank1 - rank0)) /
    (RSS1 / (R - rank1)), upper tail of F(rank1 - rank0, R - rank1). nan when big adds no rank or
    leaves no residual degrees of freedom."""
    y = np.asarray(y, np.float64)
    rss0, r0 = _rss(np.asarray(small, np.float64), y)
    rss1, r1 = _rss(np.asarray(big, np.float64), y)
    d1, d2 = r1 - r0, y.shape[0] - r1
    if d1 < 1 or d2 < 1:
        return float("nan")
    tiny = 1e-12 * max(float(np.sum((y - y.mean()) ** 2)), np.finfo(np.float64).tiny)
    if rss1 <= tiny:  # an exact fit: the big model explains everything the small one leaves, if anything
        return 0.0 if rss0 > tiny else 1.0
    return float(stats.f.sf(max(rss0 - rss1, 0.0) / d1 / (rss1 / d2), d1, d2))


def equal_effects_test(design: np.ndarray, delta: np.ndarray) -> float:
    """p-value that every unit has the same effect: ``Δ ≈ b0 + design @ β`` (``design`` 0/1 [R, U],
    ``delta`` float [R]) against ``Δ ≈ b0 + γ · (units intervened)`` (:func:`nested_f_test`). A large
    p means the design cannot tell the units apart: a Spearman of any method against their
    estimated effects then ranks noise. nan for fewer than 2 units or no residual df."""
    x = np.asarray(design, np.float64)
    one = np.ones((x.shape[0], 1))
    return nested_f_test(np.concatenate([one, x.sum(1, keepdims=True)], 1), np.concatenate([one, x], 1), delta)


def interaction_test(design: np.ndarray, delta: np.ndarray) -> float:
    """p-value that the units' effects add: the additive fit ``Δ ≈ b0 + design @ β`` against the
    same with every pairwise product ``design[:, u] * design[:, v]`` (u < v; :func:`nested_f_test`).
    A small p means interactions matter (the datamodels additivity assumption fails). nan when the
    design has too few replays for the pairwise terms."""
    x = np.asarray(design, np.float64)
    one = np.ones((x.shape[0], 1))
    pairs = [x[:, u] * x[:, v] for u in range(x.shape[1]) for v in range(u + 1, x.shape[1])]
    if not pairs:
        return float("nan")
    additive = np.concatenate([one, x], 1)
    return nested_f_test(additive, np.concatenate([additive, np.stack(pairs, 1)], 1), delta)


def fractional_factorial(units: int) -> np.ndarray:
    """A two-level design int8 [R, U] of ±1 (+1: unit intervened), R = the smallest power of 2 above
    ``units``: columns 1..U of the Sylvester Hadamard matrix of order R (column 0, all +1, left out),
    so every column is balanced and any two are orthogonal. Raises ValueError for ``units < 1``."""
    if units < 1:
        raise ValueError(f"fractional_factorial: units={units} must be >= 1")
    r = 1
    while r <= units:
        r *= 2
    h = np.ones((1, 1), np.int8)
    while h.shape[0] < r:
        h = np.block([[h, h], [h, -h]]).astype(np.int8)
    return h[:, 1:units + 1]


def factorial_contrast(baseline: float, design: np.ndarray, replays: np.ndarray) -> np.ndarray:
    """float64 [U]: each unit's main effect on Δ = ``baseline - replays`` in a ±1 ``design`` [R, U]:
    ``mean(Δ | +1) - mean(Δ | -1)`` (= ``2/R * design.T @ Δ`` for a balanced design)."""
    x = np.asarray(design, np.float64)
    d = float(baseline) - np.asarray(replays, np.float64)
    return np.array([d[x[:, u] > 0].mean() - d[x[:, u] < 0].mean() for u in range(x.shape[1])], np.float64)
