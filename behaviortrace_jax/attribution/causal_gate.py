"""The causal gate (issue 47): did the planted cause act? numpy/scipy only.

The paper's gate (SPEC §1.8) checks that the behaviour exists. This one checks that the bonus caused
it: a measure of the behaviour on the no-intervention baseline over ``n`` regenerated sampler
streams, against the same measure with every bonus withheld (``withheld``), over the same streams
(``paired``) or, since withholding every bonus zeroes every advantage, one run that is the same in
every stream (the "fixed-arm" design of ``attribution/noise_floor.py``). The effect is
``delta = mean(baseline) - mean(withheld)`` with its ``1 - alpha`` t interval
(:func:`noise_floor.estimate_effect`):

* "acted": the CI excludes 0 and ``delta`` has the expected sign (the bonus raises a probe measure);
* "not detected": the CI holds 0 (never "no effect");
* "reversed": the CI excludes 0 with the other sign.

A run whose planted cause did not act still has a ground truth (the bonus log), but its attribution
tables then score methods against a label, not a cause: :data:`LABEL_NOT_CAUSE` says so.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np

from behaviortrace_jax.attribution import formats, noise_floor as nf

ACTED, NOT_DETECTED, REVERSED = "acted", "not detected", "reversed"
LABEL_NOT_CAUSE = ("The planted cause did not act in this run: its attribution tables score the methods against a "
                   "label (the bonus log), not against a cause.")
NOT_MEASURED = ("Causal gate: not measured (the `cause` stage did not run; add it after `grpo` in config.stages): "
                "this run's attribution tables score the methods against a label (the bonus log), not a measured cause.")


def summary_line(gate: dict | None) -> str:
    """The report's one-line gate summary from ``cause/gate.json`` (``stages/cause.py``; None: the
    stage did not run, :data:`NOT_MEASURED`): the primary measure's console line, and
    :data:`LABEL_NOT_CAUSE` when it did not act."""
    if not gate:
        return NOT_MEASURED
    line = f"Causal gate ({gate['primary']}, step {gate['measure_step']}): {gate['lines'][0]}"
    return line if gate["acted"] else f"{line} {LABEL_NOT_CAUSE}"


@dataclasses.dataclass(frozen=True)
class GateVerdict:
    """One measure's gate (module docstring).

    Fields: ``measure`` (its name); ``status`` ("acted" / "not detected" / "reversed");
    ``effect`` (:class:`noise_floor.Effect`: delta, se, df, CI, design, streams); ``floor``
    (:class:`noise_floor.NoiseFloor` of the baseline: the noise floor sd and its split);
    ``mde`` (minimum detectable effect of the effect's design with its streams, at ``floor.power``;
    planning sd: for "fixed-arm" ``sqrt(sd^2 + n withheld_se^2)`` (so that ``sd / sqrt(n)`` is the
    effect's SE at df n - 1, a slight overstatement of the MDE when ``withheld_se`` > 0), the pooled
    sd of both arms for "two-arm", the sd of the per-stream differences for "paired");
    ``delta_over_sd`` (delta in noise-floor sd; inf when the floor is 0 and delta is not).
    """

    measure: str
    status: str
    effect: nf.Effect
    floor: nf.NoiseFloor
    mde: float
    delta_over_sd: float

    @property
    def acted(self) -> bool:
        return self.status == ACTED

    @property
    def line(self) -> str:
        """The console / report line: "the planted cause acted: Δ = …, CI […], n streams, noise
        floor sd …, MDE …" or "the planted cause did not act (not detected): …"."""
        head = {ACTED: "the planted cause acted", NOT_DETECTED: "the planted cause did not act (not detected)",
                REVERSED: "the planted cause did not act as planted (reversed: detected with the other sign)"}[self.status]
        return self._with_effect(head)

    @property
    def secondary_line(self) -> str:
        """The line of a measure beside the primary one, which alone decides whether the cause acted:
        "also <measure>: detected / not detected (the CI holds 0) / reversed (...): Δ = …"."""
        head = {ACTED: "detected", NOT_DETECTED: "not detected (the CI holds 0)",
                REVERSED: "reversed (detected with the other sign)"}[self.status]
        return self._with_effect(f"also {self.measure}: {head}")

    def _with_effect(self, head: str) -> str:
        e = self.effect
        return (f"{head}: Δ = {e.delta:.4g}, CI [{e.ci_low:.4g}, {e.ci_high:.4g}], {e.n} streams, "
                f"noise floor sd {self.floor.sd:.4g}, MDE {self.mde:.4g} "
                f"({self.measure}; {e.design} design, {1 - e.alpha:.0%} CI, power {self.floor.power:.0%}; "
                f"Δ = {self.delta_over_sd:.3g} sd)")

    def as_dict(self) -> dict[str, float | int | str]:
        out = {"measure": self.measure, "status": self.status, "acted": self.acted, "mde": self.mde,
               "delta_over_sd": self.delta_over_sd, "line": self.line}
        out.update({f"effect_{k}": v for k, v in self.effect.as_dict().items()})
        out.update({f"floor_{k}": v for k, v in self.floor.as_dict().items()})
        return out


def causal_gate(measure: str, baseline: Sequence[float], withheld: Sequence[float], *,
                sampling_se: Sequence[float] | None = None, withheld_se: float = 0.0, paired: bool = False,
                expected_sign: int = 1, alpha: float = nf.ALPHA, power: float = nf.POWER) -> GateVerdict:
    """The gate of one measure.

    Args:
        measure: its name (e.g. "probe_rate").
        baseline: float [n >= 2], the measure on the no-intervention baseline of each stream.
        withheld: float [n] (with ``paired``: stream order as ``baseline``) or [1] (one run, the same
            in every stream), the measure with every bonus withheld.
        sampling_se: float [n], each baseline stream's own standard error (for the floor's split;
            e.g. ``probe_rate_se`` of ``behavior.probe_measures``); None if unknown.
        withheld_se: the one withheld run's own standard error (a fixed arm measured once; 0 for a
            deterministic measure), added to the effect's variance (``noise_floor.estimate_effect``).
            Only for a withheld run measured with a key independent of the baseline streams' keys;
            measured with each stream's own key, pass its per-stream values with ``paired=True``.
        paired: the arms share their streams (paired t of the differences).
        expected_sign: +1 (the bonus raises the measure), -1, or 0 (either sign counts as acting).
        alpha, power: two-sided level of the CI and the MDE's power.

    Raises:
        ValueError: as :func:`noise_floor.estimate_effect` / :func:`noise_floor.noise_floor`, or an
            ``expected_sign`` outside {-1, 0, 1}.
    """
    if expected_sign not in (-1, 0, 1):
        raise ValueError(f"causal_gate({measure!r}): expected_sign={expected_sign} must be -1, 0 or 1")
    eff = nf.estimate_effect(baseline, withheld, paired=paired, intervened_se=withheld_se, alpha=alpha)
    b, w = np.asarray(baseline, np.float64), np.asarray(withheld, np.float64)
    floor = nf.noise_floor(b, sampling_se, design=eff.design, alpha=alpha, power=power)
    if eff.design == "paired":
        sd_plan = float(np.std(b - w, ddof=1))
    elif eff.design == "two-arm":
        sd_plan = math.sqrt((np.var(b, ddof=1) + np.var(w, ddof=1)) / 2)
    else:  # fixed arm: the baseline's sd, plus the withheld run's own error spread over the n streams
        sd_plan = math.sqrt(floor.sd ** 2 + eff.n * withheld_se ** 2)
    mde = nf.mde(sd_plan, eff.n, design=eff.design, alpha=alpha, power=power)
    if eff.verdict == nf.NOT_DETECTED:
        status = NOT_DETECTED
    else:
        status = ACTED if expected_sign == 0 or np.sign(eff.delta) == expected_sign else REVERSED
    ratio = eff.delta / floor.sd if floor.sd > 0 else (0.0 if eff.delta == 0 else math.copysign(math.inf, eff.delta))
    return GateVerdict(measure=measure, status=status, effect=eff, floor=floor, mde=mde, delta_over_sd=float(ratio))


@dataclasses.dataclass(frozen=True)
class GateReport:
    """The run's gate: ``verdicts`` (one per measure, in order) and the ``primary`` measure whose
    verdict decides ``acted``."""

    verdicts: tuple[GateVerdict, ...]
    primary: str

    def __post_init__(self) -> None:
        names = [v.measure for v in self.verdicts]
        if self.primary not in names:
            raise ValueError(f"causal gate: primary measure {self.primary!r} is not among the measures {names}")
        if len(set(names)) != len(names):
            raise ValueError(f"causal gate: measures named twice in {names}")

    @property
    def acted(self) -> bool:
        return next(v for v in self.verdicts if v.measure == self.primary).acted

    def lines(self) -> list[str]:
        """The primary measure's line first (:attr:`Verdict.line`), the others after it
        (:attr:`Verdict.secondary_line`), then :data:`LABEL_NOT_CAUSE` when the primary did not act."""
        out = [v.line for v in self.verdicts if v.measure == self.primary]
        out += [v.secondary_line for v in self.verdicts if v.measure != self.primary]
        return out if self.acted else out + [LABEL_NOT_CAUSE]


def gate_measures(baseline: Mapping[str, Sequence[float]], withheld: Mapping[str, Sequence[float]], *,
                  primary: str, sampling_se: Mapping[str, Sequence[float]] | None = None,
                  withheld_se: Mapping[str, float] | None = None, paired: bool = False,
                  expected_signs: Mapping[str, int] | None = None, alpha: float = nf.ALPHA,
                  power: float = nf.POWER) -> GateReport:
    """The :class:`GateReport` of every measure in ``baseline`` ``{measure: float [n streams]}``
    against ``withheld`` ``{measure: float [n] or [1]}`` (:func:`causal_gate` per measure, in
    ``baseline``'s order), decided by ``primary``. ``sampling_se``: ``{measure: float [n]}`` and
    ``withheld_se``: ``{measure: float}`` for the measures that have one (default 0);
    ``expected_signs``: ``{measure: -1 / 0 / 1}`` (default 1).

    Raises:
        ValueError: a measure of ``baseline`` missing from ``withheld``, or as :func:`causal_gate`
            and :class:`GateReport`.
    """
    missing = [m for m in baseline if m not in withheld]
    if missing:
        raise ValueError(f"causal gate: measures {missing} have baseline values but no withheld values")
    se, wse, signs = sampling_se or {}, withheld_se or {}, expected_signs or {}
    return GateReport(tuple(causal_gate(m, baseline[m], withheld[m], sampling_se=se.get(m),
                                        withheld_se=wse.get(m, 0.0), paired=paired,
                                        expected_sign=signs.get(m, 1), alpha=alpha, power=power)
                            for m in baseline), primary)


def gate_rows(seed: str, report: GateReport) -> list[formats.Row]:
    """The results-table rows of a gate, one table ``causal_gate[<output>]`` per measure output:
    ``delta`` (``value`` = Δ = baseline - withheld, ``lo``/``hi`` its CI, ``n`` = streams),
    ``baseline-sd`` (the noise floor: the baseline's sd over streams; ``chance`` = its mean),
    ``mde`` (minimum detectable effect of the effect's design with its streams), ``delta-over-sd``
    (Δ in noise-floor sd) and ``acted`` (1 = acted, 0 = not detected, -1 = reversed; ``ceiling`` 1
    for the primary measure, else None)."""
    rows = []
    code = {ACTED: 1.0, NOT_DETECTED: 0.0, REVERSED: -1.0}
    for v in report.verdicts:
        t, e, f = f"causal_gate[{v.measure}]", v.effect, v.floor
        ratio = v.delta_over_sd if math.isfinite(v.delta_over_sd) else None
        rows += [formats.Row(seed, t, "delta", e.delta, e.ci_low, e.ci_high, None, None, e.n),
                 formats.Row(seed, t, "baseline-sd", f.sd, None, None, f.mean, None, f.n_streams),
                 formats.Row(seed, t, "mde", v.mde, None, None, None, None, e.n),
                 formats.Row(seed, t, "delta-over-sd", ratio if ratio is not None else float("nan"), None, None,
                             None, None, e.n),
                 formats.Row(seed, t, "acted", code[v.status], None, None, None,
                             1.0 if v.measure == report.primary else None, e.n)]
    return rows


def report_section(report: GateReport, *, step: int, streams: int) -> str:
    """The report's markdown section of a gate: its console lines, then one table row per measure."""
    lines = [f"Withholding every bonus of the window against the no-intervention baseline, rollouts regenerated "
             f"from the replayed policy, {streams} sampler streams (the arms of a stream share its sampling keys: "
             f"paired), measured at step {step}. Δ = baseline - withheld; a CI that holds 0 is \"not detected\", "
             "not an effect of 0.", ""]
    lines += [f"- {ln}" for ln in report.lines()]
    lines += ["", "| measure | status | Δ | 95% CI | noise floor sd | MDE | Δ / sd | streams |",
              "|---|---|---|---|---|---|---|---|"]
    for v in report.verdicts:
        e = v.effect
        lines.append(f"| {v.measure}{' (primary)' if v.measure == report.primary else ''} | {v.status} | "
                     f"{e.delta:.4g} | [{e.ci_low:.4g}, {e.ci_high:.4g}] | {v.floor.sd:.4g} | {v.mde:.4g} | "
                     f"{v.delta_over_sd:.3g} | {e.n} |")
    return "\n".join(lines) + "\n"
