"""Estimators of unit effects from replayed designs (numpy only), one per replay plan
(``attribution/replay_plans.py``): the effect of intervening on unit u, Δ_u = M(no intervention) -
M(u intervened) (positive: the unit taught the behaviour).

* :func:`difference`: single-unit branches, ``Δ_u = baseline - replay_u`` (exact per unit).
* :func:`least_squares`: a datamodels fit over random subsets, ``baseline - replay_r ≈ b0 + X_r β``
  with ``X_r[u] = 1`` when unit u is intervened in replay r (``numpy.linalg.lstsq``, minimum norm);
  β_u estimates Δ_u under additivity; :func:`least_squares_fit` adds each β_u's t interval and the
  fit's leave-one-out predictive R² (the additivity check on held-out replays).
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
    additive fit predicts each replay left out of it; nan without residual df)."""

    beta: np.ndarray
    se: np.ndarray
    ci_low: np.ndarray
    ci_high: np.ndarray
    df: int
    loo_r2: float


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
    cov = np.linalg.inv(a.T @ a) * float(resid @ resid) / df
    se = np.sqrt(np.diag(cov)[1:])
    t = stats.t.ppf(1 - alpha / 2, df)
    h = np.einsum("ij,jk,ik->i", a, np.linalg.inv(a.T @ a), a)
    press = float(np.sum((resid / (1 - h)) ** 2))
    total = float(np.sum((y - y.mean()) ** 2))
    return LeastSquaresFit(coef[1:], se, coef[1:] - t * se, coef[1:] + t * se, df,
                           1 - press / total if total > 0 else float("nan"))


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
