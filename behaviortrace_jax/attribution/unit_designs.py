"""Causal units sized by power: how precisely each replay design estimates every unit's effect for
a given replay budget, and the finest units a measure's noise floor lets a budget resolve.

A *unit* is a set of window rollout slots an intervention acts on (a step, a block of steps, a
group, a prompt kind). With ``U`` units, a measure whose no-intervention value has noise floor
``sigma`` over regenerated sampler streams (``attribution/noise_floor.py``; sampling error and
training noise together), and ``B`` replays (each a regenerated run to the measure step, the same
cost whatever it withholds), the designs of ``attribution/replay_plans.py`` give per-unit standard
errors (:data:`DESIGNS`):

* ``"single-unit"``: one baseline and one replay per unit in each of ``r = floor(B / (U + 1))``
  streams; a unit's effect is the mean over streams of baseline - unit replay:
  ``SE = sigma * sqrt(2 / r)`` (independent arms: a regenerated run diverges from its stream's
  baseline after the first changed step; common keys only make it smaller), ``df = r - 1``.
* ``"random-subset"`` (datamodels): ``B`` replays, each on its own stream, each unit withheld with
  probability 1/2, every unit's effect fitted at once by least squares with an intercept
  (``replay_estimators.least_squares``): for a balanced design ``SE ~= 2 * sigma / sqrt(B)``
  (the contrast of the ``B/2`` replays with the unit in against the ``B/2`` without it),
  ``df = B - U - 1``.
* ``"factorial"``: the two-level fractional factorial (``replay_estimators.fractional_factorial``,
  ``R = 2^ceil(log2(U + 1))`` runs, orthogonal ±1 columns) repeated ``floor(B / R)`` times:
  ``SE = 2 * sigma / sqrt(reps * R)`` exactly (main effect = difference of the two half means),
  ``df = reps * R - U - 1``.

The subset designs estimate every unit from all ``B`` replays, so at equal budget their variance is
about ``(U + 1) / 2`` times smaller than the single-unit design's. The price is additivity: a unit's
effect is assumed the same whichever other units are withheld; the fit's residuals and a held-out
prediction test it (``replay_plans.Datamodels``). The minimum detectable effect per unit is
``(t_{1-alpha/2, df} + t_{power, df}) * SE`` (normal-approximation form with t quantiles; Cohen
1988 ch. 2). :func:`finest_units` is the largest ``U`` whose per-unit share of an effect
``delta`` (``delta / U``: the effect spread evenly, a planning assumption) is at least that MDE.
"""
from __future__ import annotations

import dataclasses
import math

from scipy import stats

from behaviortrace_jax.attribution.noise_floor import ALPHA, POWER

DESIGNS = ("single-unit", "random-subset", "factorial")


@dataclasses.dataclass(frozen=True)
class DesignPower:
    """One design's precision for ``units`` units with a budget of ``replays`` replays.

    Fields: ``design``; ``units``; ``replays`` used (<= the budget: whole streams or replicates);
    ``cpu_hours`` (``replays * seconds_per_replay / 3600``); ``se`` per unit and ``df`` (the
    measure's units); ``half_width`` of the two-sided ``1 - alpha`` CI of a unit's effect;
    ``mde`` per unit at ``power``; ``feasible`` (False when the budget cannot fit the design: fewer
    than 2 streams, or fewer replays than ``U + 2`` for a least-squares fit; then se, df, half_width
    and mde are nan)."""

    design: str
    units: int
    replays: int
    cpu_hours: float
    se: float
    df: float
    half_width: float
    mde: float
    feasible: bool

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check(sigma: float, units: int, replays: int, seconds_per_replay: float, design: str) -> None:
    if design not in DESIGNS:
        raise ValueError(f"unit_designs: design={design!r}; expected one of {DESIGNS}")
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"unit_designs: sigma={sigma} must be finite and >= 0")
    if units < 1 or replays < 1:
        raise ValueError(f"unit_designs: units={units} and replays={replays} must be >= 1")
    if not (math.isfinite(seconds_per_replay) and seconds_per_replay > 0):
        raise ValueError(f"unit_designs: seconds_per_replay={seconds_per_replay} must be > 0")


def factorial_runs(units: int) -> int:
    """Runs of one replicate of the fractional factorial: the smallest power of 2 above ``units``."""
    r = 1
    while r <= units:
        r *= 2
    return r


def design_power(design: str, sigma: float, units: int, replays: int, *, seconds_per_replay: float = 1.0,
                 alpha: float = ALPHA, power: float = POWER) -> DesignPower:
    """The :class:`DesignPower` of ``design`` (module docstring) for ``units`` units, a budget of
    ``replays`` replays, a measure with noise floor ``sigma`` (its units) and ``seconds_per_replay``
    (wall or CPU seconds of one regenerated replay to the measure step).

    Raises:
        ValueError: an unknown design, a negative or non-finite ``sigma``, ``units`` or ``replays``
            < 1, or ``seconds_per_replay`` <= 0.
    """
    _check(sigma, units, replays, seconds_per_replay, design)
    if design == "single-unit":
        r = replays // (units + 1)
        used, df = r * (units + 1), r - 1
        se = sigma * math.sqrt(2.0 / r) if r >= 2 else math.nan
    elif design == "random-subset":
        used, df = replays, replays - units - 1
        se = 2.0 * sigma / math.sqrt(replays) if df >= 1 else math.nan
    else:
        runs = factorial_runs(units)
        reps = replays // runs
        used, df = reps * runs, reps * runs - units - 1
        se = 2.0 * sigma / math.sqrt(used) if reps >= 1 and df >= 1 else math.nan
    feasible = math.isfinite(se)
    if feasible:
        tc = stats.t.ppf(1 - alpha / 2, df)
        half, m = tc * se, (tc + stats.t.ppf(power, df)) * se
    else:
        half = m = math.nan
        df = math.nan
    return DesignPower(design, units, int(used), used * seconds_per_replay / 3600.0, float(se), float(df),
                       float(half), float(m), feasible)


def compare_designs(sigma: float, units: int, replays: int, *, seconds_per_replay: float = 1.0,
                    alpha: float = ALPHA, power: float = POWER) -> list[DesignPower]:
    """:func:`design_power` of every design in :data:`DESIGNS` at the same budget."""
    return [design_power(d, sigma, units, replays, seconds_per_replay=seconds_per_replay, alpha=alpha, power=power)
            for d in DESIGNS]


def finest_units(design: str, sigma: float, delta: float, replays: int, *, alpha: float = ALPHA,
                 power: float = POWER, max_units: int = 4096) -> int:
    """The largest ``U`` (1..``max_units``) whose even share of the total effect ``delta`` (``delta /
    U``) is at least the per-unit MDE of ``design`` with ``replays`` replays; 0 when even one unit
    is not detectable. Raises ValueError as :func:`design_power`, or for ``delta`` <= 0."""
    if not (math.isfinite(delta) and delta > 0):
        raise ValueError(f"unit_designs: delta={delta} must be > 0")
    best = 0
    for u in range(1, max_units + 1):
        p = design_power(design, sigma, u, replays, alpha=alpha, power=power)
        if not p.feasible:
            break
        if delta / u >= p.mde:
            best = u
        elif best:
            break
    return best
