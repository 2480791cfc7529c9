"""The noise floor of a behaviour measure over sampler streams, its minimum detectable effect, the
streams a confidence interval needs, and the detection verdict of an effect (issue 47; numpy/scipy).

A *stream* is one regenerated run of the same config with its own sampler keys
(``rollouts.step_key(seed, step, stream)``): the runs differ only by which rollouts were sampled,
i.e. by training noise. A measure (probe rate, minimal-pair log-ratio, margin, ...) evaluated on the
no-intervention baseline of ``n`` streams gives values ``y_1 .. y_n``.

* **Noise floor** ``sd = s(y)`` (sample sd, ddof = 1): how far two no-intervention runs differ.
* **Its split.** Each stream's value carries the measure's own sampling error (its standard error
  ``se_j``, e.g. the binomial error of a sampled rate; 0 for a teacher-forced log-prob) on top of
  the stream's true value. With independent errors, ``E[s^2] = tau^2 + mean_j se_j^2``, so the
  method-of-moments split of the one-way random-effects model (Searle, Casella & McCulloch 1992,
  *Variance Components*, §3.5) is ``sd_sampling^2 = mean_j se_j^2`` and
  ``sd_between^2 = max(s^2 - sd_sampling^2, 0)``: the training noise that only more streams average
  out, beside the sampling error that more samples per prompt shrink. When every stream measures
  with the same key (common random numbers), the errors are positively correlated, ``s^2`` holds
  less than ``mean se^2`` of them, and ``sd_between`` is then a lower bound (often 0: the smoke
  run's streams gave ``s`` = 0.0076 against ``se`` = 0.024 with one key). Measure each stream with
  its own key, shared by that stream's branches (``behavior/probe_measures.py``).
* **Designs** of a two-arm comparison ``delta = mean(baseline) - mean(intervened)`` over ``n``
  streams per arm (:data:`DESIGNS`):

  - ``"two-arm"``: independent streams per arm, each arm's sd ``sigma``:
    ``SE = sigma * sqrt(2 / n)``, ``df = 2n - 2`` (pooled two-sample t);
  - ``"paired"``: the arms share their streams (same sampler keys), ``sigma`` is the sd of the
    per-stream differences: ``SE = sigma / sqrt(n)``, ``df = n - 1`` (paired t);
  - ``"fixed-arm"``: the intervened arm is the same in every stream (withholding every bonus
    zeroes every advantage, so no sampled rollout moves its parameters): a one-sample t of the
    baseline against that value, ``SE = sigma / sqrt(n)``, ``df = n - 1``.

* **Minimum detectable effect** (two-sided level ``alpha``, power ``1 - beta``): the smallest
  ``delta`` whose t-test rejects with probability ``power``, from the noncentral t
  (``T ~ nct(df, delta / SE)``, power ``= P(T > t_c) + P(T < -t_c)``, ``t_c = t_{1-alpha/2, df}``;
  Cohen 1988, *Statistical Power Analysis*, ch. 2; statsmodels ``TTestIndPower`` / ``TTestPower``
  solve the same equation). The normal approximation is ``(z_{1-alpha/2} + z_{power}) * SE``.
* **Streams needed** for a CI half-width ``h``: the smallest ``n >= 2`` with
  ``t_{1-alpha/2, df(n)} * SE(n) <= h`` at the planning sd (normal approximation
  ``n = ceil((z_{1-alpha/2} * k * sigma / h)^2)``, ``k = sqrt(2)`` for two arms, 1 otherwise).
* **Verdict**: ``"detected"`` only if the ``1 - alpha`` CI of the effect excludes 0, otherwise
  ``"not detected"``, never "no effect": a CI that contains 0 does not show the effect is 0.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
from scipy import optimize, stats

ALPHA = 0.05
POWER = 0.8
DESIGNS = ("two-arm", "paired", "fixed-arm")
DETECTED, NOT_DETECTED = "detected", "not detected"


def _check(alpha: float, power: float | None = None, design: str | None = None) -> None:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"noise_floor: alpha={alpha} must lie in (0, 1)")
    if power is not None and not alpha / 2 < power < 1.0:
        raise ValueError(f"noise_floor: power={power} must lie in (alpha/2, 1)")
    if design is not None and design not in DESIGNS:
        raise ValueError(f"noise_floor: design={design!r}; expected one of {DESIGNS}")


def _as_values(values: Sequence[float], name: str, min_n: int = 2) -> np.ndarray:
    y = np.asarray(values, np.float64)
    if y.ndim != 1 or y.size < min_n:
        raise ValueError(f"noise_floor: {name} must be 1-D with >= {min_n} streams, got shape {y.shape}")
    if not np.all(np.isfinite(y)):
        raise ValueError(f"noise_floor: {name} holds non-finite values: {y.tolist()}")
    return y


def design_factor(design: str, n: int) -> tuple[float, int]:
    """``(k, df)`` of a design with ``n`` streams per arm: ``SE = k * sigma / sqrt(n)`` (module
    docstring); ``k = sqrt(2)``, ``df = 2n - 2`` for "two-arm", ``k = 1``, ``df = n - 1`` otherwise.

    Raises:
        ValueError: an unknown design or ``n < 2``.
    """
    _check(ALPHA, design=design)
    if n < 2:
        raise ValueError(f"noise_floor: n={n} streams per arm; a t interval needs >= 2")
    return (math.sqrt(2.0), 2 * n - 2) if design == "two-arm" else (1.0, n - 1)


def t_power(effect: float, se: float, df: float, alpha: float = ALPHA) -> float:
    """Power of the two-sided level-``alpha`` t-test of an effect ``effect`` with standard error
    ``se`` and ``df`` degrees of freedom: ``P(|T| > t_c)``, ``T ~ nct(df, effect / se)``."""
    _check(alpha)
    if se <= 0:
        raise ValueError(f"noise_floor: se={se} must be > 0")
    tc = stats.t.ppf(1 - alpha / 2, df)
    nc = effect / se
    # P(T < -t_c) for nc is P(T > t_c) for -nc (T(-nc) = -T(nc)); scipy's lower-tail cdf is nan far out
    return float(stats.nct.sf(tc, df, nc) + stats.nct.sf(tc, df, -nc))


def mde(sd: float, n: int, *, design: str = "two-arm", alpha: float = ALPHA, power: float = POWER,
        method: str = "t") -> float:
    """Minimum detectable effect of ``design`` with ``n`` streams per arm (module docstring).

    Args:
        sd: the planning sd (float, the measure's units): the noise floor of one arm ("two-arm",
            "fixed-arm") or the sd of the per-stream differences ("paired").
        n: streams per arm (>= 2).
        method: "t" (noncentral t, exact for normal stream values) or "normal" (z approximation).
    Returns:
        the effect (same units as ``sd``, >= 0) detected with probability ``power``; 0 if ``sd`` is 0.
    Raises:
        ValueError: a bad design, method, alpha, power, ``n < 2`` or a negative / non-finite ``sd``.
    """
    _check(alpha, power, design)
    if not (math.isfinite(sd) and sd >= 0):
        raise ValueError(f"noise_floor: sd={sd} must be finite and >= 0")
    k, df = design_factor(design, n)
    se = k * sd / math.sqrt(n)
    if se == 0:
        return 0.0
    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    if method == "normal":
        return float(z * se)
    if method != "t":
        raise ValueError(f"noise_floor: method={method!r}; expected 't' or 'normal'")
    # power rises with the effect; bracket the root from the normal value upward
    hi = z * se
    while t_power(hi, se, df, alpha) < power:
        hi *= 2.0
    return float(optimize.brentq(lambda d: t_power(d, se, df, alpha) - power, 0.0, hi, xtol=1e-12 * max(se, 1e-300)))


def streams_needed(sd: float, half_width: float, *, design: str = "two-arm", alpha: float = ALPHA,
                   method: str = "t", max_streams: int = 100_000) -> int:
    """Streams per arm for an expected ``1 - alpha`` CI half-width <= ``half_width`` at planning sd
    ``sd``: smallest ``n >= 2`` with ``t_{1-alpha/2, df(n)} * k * sd / sqrt(n) <= half_width``
    (``method="normal"``: ``ceil((z_{1-alpha/2} * k * sd / half_width)^2)``, at least 2).

    Raises:
        ValueError: a non-positive ``half_width``, negative ``sd``, bad design / method, or more than
            ``max_streams`` needed.
    """
    _check(alpha, design=design)
    if not half_width > 0 or not (math.isfinite(sd) and sd >= 0):
        raise ValueError(f"noise_floor: half_width={half_width} must be > 0 and sd={sd} finite >= 0")
    k = design_factor(design, 2)[0]
    z = stats.norm.ppf(1 - alpha / 2)
    n_normal = max(2, math.ceil((z * k * sd / half_width) ** 2))
    if method == "normal":
        return n_normal
    if method != "t":
        raise ValueError(f"noise_floor: method={method!r}; expected 't' or 'normal'")
    n = n_normal  # t_{q, df} > z_q: the t answer is never below the normal one
    while n <= max_streams:
        _, df = design_factor(design, n)
        if stats.t.ppf(1 - alpha / 2, df) * k * sd / math.sqrt(n) <= half_width:
            return n
        n += 1
    raise ValueError(f"noise_floor: more than {max_streams} streams needed for half-width {half_width} at sd {sd}")


def streams_for_mde(sd: float, effect: float, *, design: str = "two-arm", alpha: float = ALPHA,
                    power: float = POWER, max_streams: int = 100_000) -> int:
    """Smallest ``n >= 2`` streams per arm whose :func:`mde` (method "t") is <= ``effect``.

    Raises:
        ValueError: ``effect <= 0``, or more than ``max_streams`` needed.
    """
    if not effect > 0:
        raise ValueError(f"noise_floor: effect={effect} must be > 0")
    lo, hi = 2, 2
    while mde(sd, hi, design=design, alpha=alpha, power=power) > effect:
        lo, hi = hi, hi * 2
        if hi > max_streams:
            raise ValueError(f"noise_floor: more than {max_streams} streams needed for effect {effect} at sd {sd}")
    while lo < hi:  # mde decreases with n: bisect for the first n that reaches the effect
        mid = (lo + hi) // 2
        if mde(sd, mid, design=design, alpha=alpha, power=power) <= effect:
            hi = mid
        else:
            lo = mid + 1
    return lo


def sampling_se(samples: np.ndarray) -> float:
    """The sampling standard error of a measure that is the mean of per-prompt, per-sample values
    ``samples`` [m prompts, k samples] (e.g. 0/1 pattern hits): prompts are fixed strata, samples are
    independent draws within a prompt, so ``SE^2 = sum_i s_i^2 / k / m^2`` with ``s_i^2`` the
    within-prompt sample variance (ddof 1). For 0/1 hits, ``s_i^2 / k = p_i (1 - p_i) / (k - 1)``:
    the unbiased stratified binomial variance.

    Raises:
        ValueError: not 2-D, ``k < 2`` (no within-prompt variance), or non-finite values.
    """
    x = np.asarray(samples, np.float64)
    if x.ndim != 2 or x.shape[1] < 2 or x.shape[0] < 1:
        raise ValueError(f"noise_floor: samples must be [prompts, samples >= 2], got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("noise_floor: samples hold non-finite values")
    m, k = x.shape
    return float(math.sqrt(np.sum(np.var(x, axis=1, ddof=1)) / k / m ** 2))


@dataclasses.dataclass(frozen=True)
class NoiseFloor:
    """A measure's no-intervention spread over streams (module docstring).

    Fields (the measure's units): ``n_streams``; ``mean``; ``sd`` (ddof 1, the noise floor);
    ``sd_sampling`` (root mean square of the streams' own standard errors; nan when none were
    given); ``sd_between`` (``sqrt(max(sd^2 - sd_sampling^2, 0))``, training noise; nan when no
    standard errors were given); ``mde`` of ``design`` with ``n_streams`` per arm at ``alpha`` /
    ``power`` (planning sd = ``sd``).
    """

    n_streams: int
    mean: float
    sd: float
    sd_sampling: float
    sd_between: float
    mde: float
    design: str
    alpha: float
    power: float

    def as_dict(self) -> dict[str, float | int | str]:
        return dataclasses.asdict(self)


def noise_floor(values: Sequence[float], sampling_se: Sequence[float] | None = None, *, design: str = "two-arm",
                alpha: float = ALPHA, power: float = POWER) -> NoiseFloor:
    """The :class:`NoiseFloor` of a measure's baseline ``values`` float [n_streams] (one per sampler
    stream, no intervention), with each stream's own standard error ``sampling_se`` float
    [n_streams] (e.g. :func:`sampling_se` of its hits; zeros for a deterministic measure) if known.

    Raises:
        ValueError: fewer than 2 streams, non-finite values, or ``sampling_se`` of another length or
            negative.
    """
    y = _as_values(values, "baseline values")
    sd = float(np.std(y, ddof=1))
    s_samp = s_betw = float("nan")
    if sampling_se is not None:
        se = np.asarray(sampling_se, np.float64)
        if se.shape != y.shape or not np.all(np.isfinite(se)) or np.any(se < 0):
            raise ValueError(f"noise_floor: sampling_se must be {y.shape} finite values >= 0, got {se.tolist()}")
        s_samp = float(math.sqrt(np.mean(se ** 2)))
        s_betw = float(math.sqrt(max(sd ** 2 - s_samp ** 2, 0.0)))
    return NoiseFloor(n_streams=int(y.size), mean=float(y.mean()), sd=sd, sd_sampling=s_samp, sd_between=s_betw,
                      mde=mde(sd, int(y.size), design=design, alpha=alpha, power=power), design=design,
                      alpha=float(alpha), power=float(power))


@dataclasses.dataclass(frozen=True)
class Effect:
    """An effect estimate ``delta = mean(baseline) - mean(intervened)`` with its standard error
    ``se``, degrees of freedom ``df`` and ``1 - alpha`` CI ``[ci_low, ci_high]``; ``verdict`` is
    ``"detected"`` iff the CI excludes 0, else ``"not detected"``; ``design`` as :data:`DESIGNS`
    (how the SE was formed), ``n`` streams per arm."""

    delta: float
    se: float
    df: float
    ci_low: float
    ci_high: float
    alpha: float
    n: int
    design: str

    @property
    def verdict(self) -> str:
        return verdict(self.ci_low, self.ci_high)

    def as_dict(self) -> dict[str, float | int | str]:
        return dict(dataclasses.asdict(self), verdict=self.verdict)


def verdict(ci_low: float, ci_high: float) -> str:
    """``"detected"`` iff the interval ``[ci_low, ci_high]`` excludes 0, else ``"not detected"``
    (never "no effect": an interval that holds 0 does not show the effect is 0)."""
    if not ci_low <= ci_high:
        raise ValueError(f"noise_floor: CI [{ci_low}, {ci_high}] is not an interval")
    return DETECTED if ci_low > 0 or ci_high < 0 else NOT_DETECTED


def confidence_interval(estimate: float, se: float, df: float = math.inf, alpha: float = ALPHA) -> tuple[float, float]:
    """``estimate -/+ t_{1-alpha/2, df} * se`` (``df = inf``: the normal quantile)."""
    _check(alpha)
    if not se >= 0:
        raise ValueError(f"noise_floor: se={se} must be >= 0")
    q = stats.norm.ppf(1 - alpha / 2) if math.isinf(df) else stats.t.ppf(1 - alpha / 2, df)
    return float(estimate - q * se), float(estimate + q * se)


def estimate_effect(baseline: Sequence[float], intervened: Sequence[float], *, paired: bool = False,
                    intervened_se: float = 0.0, alpha: float = ALPHA) -> Effect:
    """The effect of withholding a cause, ``mean(baseline) - mean(intervened)``, over streams.

    * ``paired=True`` (the arms share their streams; equal lengths, stream order): one-sample t of the
      per-stream differences, ``df = n - 1``, design "paired".
    * otherwise Welch's t: ``SE^2 = s_b^2 / n_b + s_i^2 / n_i`` with Welch-Satterthwaite df. An
      intervened arm identical in every stream (``s_i = 0``, or one value) is design "fixed-arm": the
      one-sample t against that value, ``df = n_b - 1``. Its value is still one measurement: a
      sampled measure's own standard error ``intervened_se`` (e.g. the binomial error of its probe
      rate) adds ``intervened_se^2`` to ``SE^2``, with Satterthwaite's
      ``df = SE^4 / ((s_b^2 / n_b)^2 / (n_b - 1))`` (the known part's df is infinite). Monte-Carlo
      coverage of the 95 % CI: 0.95 at n_b = 5 and 8, 0.92-0.95 at n_b = 3; keeping
      ``df = n_b - 1`` instead would cover 0.98-1.00. (The CI can be narrower than the one that
      ignores ``intervened_se``, which undercovers.)
    * both arms without spread (``SE = 0``): the CI is the point ``[delta, delta]``.

    Raises:
        ValueError: fewer than 2 baseline streams, non-finite values, paired arms of unequal length,
            a negative ``intervened_se``, or one given for an arm with spread or a paired design (its
            spread already holds its sampling error).
    """
    _check(alpha)
    b = _as_values(baseline, "baseline values")
    v = _as_values(intervened, "intervened values", min_n=1 if not paired else 2)
    if not (math.isfinite(intervened_se) and intervened_se >= 0):
        raise ValueError(f"noise_floor: intervened_se={intervened_se} must be finite and >= 0")
    if paired:
        if v.shape != b.shape:
            raise ValueError(f"noise_floor: paired arms need equal stream counts, got {b.size} and {v.size}")
        if intervened_se:
            raise ValueError("noise_floor: intervened_se applies to a fixed intervened arm, not to paired arms")
        d = b - v
        delta, se, df, design = float(d.mean()), float(np.std(d, ddof=1) / math.sqrt(d.size)), d.size - 1, "paired"
    else:
        vb = float(np.var(b, ddof=1)) / b.size
        vi = float(np.var(v, ddof=1)) / v.size if v.size > 1 else 0.0
        if vi == 0.0:
            vi, design = intervened_se ** 2, "fixed-arm"
            df = b.size - 1 if vi == 0.0 else ((vb + vi) ** 2 / (vb ** 2 / (b.size - 1)) if vb > 0 else math.inf)
        elif intervened_se:
            raise ValueError("noise_floor: intervened_se applies to a fixed intervened arm; this arm has a spread")
        else:
            df = (vb + vi) ** 2 / (vb ** 2 / (b.size - 1) + vi ** 2 / (v.size - 1))
            design = "two-arm"
        delta, se = float(b.mean() - v.mean()), math.sqrt(vb + vi)
    lo, hi = confidence_interval(delta, se, df, alpha)
    return Effect(delta=delta, se=se, df=float(df), ci_low=lo, ci_high=hi, alpha=float(alpha), n=int(b.size),
                  design=design)
