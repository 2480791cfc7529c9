"""The measured causal ground truth's tables (numpy only): estimators and controls scored against
what single-unit replays measure (issue 31 item 3; ``train/causal.py`` runs the replays).

A *unit* is a set of rollout slots (log order): one step of the contamination window (the
default, ``counterfactual.causal_units = "steps"``) or one GRPO group of it (``"groups"``). Its
measured effect under an intervention and a rollout mode is ``Δ_u = M(no intervention) -
M(unit intervened)`` (the behaviour's log-prob margin at the counterfactual measure step; positive
= the unit taught the behaviour), one value per sampler stream (regenerated rollouts; fixed
rollouts have one). Tables (``formats.Row``; ``<iv>`` = ``remove`` / ``withhold-bonus``, ``<ro>`` =
``fixed`` / ``regenerated``):

* ``causal_effect_<iv>_<ro>``: per unit (``method`` = unit name), ``value`` = mean Δ over
  streams, ``lo``/``hi`` = its 95 % t-interval over streams (None with one stream), ``n`` = streams.
* ``causal_spearman_<iv>_<ro>``: per method, ``value`` = Spearman(unit score, mean Δ) over the
  units (``metrics.lds_correlation``: 0 for constant input), ``lo``/``hi`` = 95 % percentile
  bootstrap over units, ``chance`` 0, ``ceiling`` 1, ``n`` = units.
* ``causal_p@k_<iv>_<ro>``: per method, ``value`` = tie-aware P@k (``metrics.
  precision_at_k_fractional``) of its top-k units among the top-k causal units (largest mean Δ;
  ties of Δ by unit order), ``chance`` = k / units, ``ceiling`` 1, ``n`` = k.
* ``causal_label_<ro>``: how far the label (the logged ground truth) agrees with causal truth:
  ``withhold-all-gt`` / ``withhold-all-bonuses`` (Δ of withholding every ground-truth bonus / every
  bonus of the window at once, mean over streams with the t-interval), and per intervention
  ``gt-unit-rank:<iv>`` (the mean percentile rank, 1 = top, of the units holding ground truth among
  all units by Δ; ``chance`` = a random unit set's expectation, the mean percentile of all
  units, ``(U + 1) / 2U``; ``n`` = units holding ground truth).

* ``causal_noise_floor_<ro>`` (rollout modes measured over >= 2 sampler streams): the noise floor
  of the measure (``attribution/noise_floor.py``). ``baseline-sd``: ``value`` = the
  no-intervention baseline's sd over streams (ddof 1), ``chance`` = its mean, ``n`` = streams;
  ``mde``: ``value`` = the minimum detectable effect (two-sided 95 %, power 80 %) of a two-arm
  comparison with that many streams per arm at that sd (``noise_floor.mde``; the conservative
  planning value: a unit's branches share the baseline's keys up to the unit's step), ``n`` =
  streams.
* ``causal_detected_<iv>_<ro>`` (the same modes): per unit (``method`` = unit name), ``value`` = 1
  when its 95 % t-interval over streams (``causal_effect_*``'s ``lo``/``hi``) excludes 0
  ("detected"), 0 when it holds 0 ("not detected": never an effect of 0), ``lo``/``hi`` that
  interval, ``chance`` = the mean Δ in units of the baseline's noise-floor sd (None when that sd
  is 0), ``n`` = streams.
* ``causal_metagradient_remove_<ro>`` (when the ``metagradient`` estimator is scored): how far its
  linearisation holds. For its top-k units and k random other units (``default_rng(seed)``):
  ``method`` = ``top<i>:<unit>`` / ``random<i>:<unit>``, ``value`` = the exact single-unit replay's
  measured Δ (mean over streams, ``lo``/``hi`` its t-interval), ``chance`` = the metagradient's
  first-order prediction of that Δ (the sum of dM/dw_i over the unit: removing the unit's
  rollouts drops M by that much to first order), ``n`` = streams. Only the remove intervention:
  the metagradient differentiates the rollouts' weights, not their rewards.

A unit's score is the sum of its rollouts' scores (finite ones; a step-level method's score is its
step's, the same for every rollout, so a step unit sums N copies: the ranking is the step's); the
pseudo-method ``ground-truth`` scores a unit by its count of ground-truth rollouts (the label's own
ranking).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import scipy.stats

from behaviortrace_jax.attribution import formats, metrics as M, noise_floor as NF

LABEL = "ground-truth"  # the pseudo-method: a unit's count of ground-truth rollouts
METAGRADIENT = "metagradient"  # the estimator whose first-order predictions get their own table


def is_table(table: str) -> bool:
    """Whether ``table`` is one of this module's (names beginning with ``causal``)."""
    return table.startswith("causal")


def unit_scores(scores: np.ndarray, units: Sequence[np.ndarray]) -> np.ndarray:
    """float64 [U]: the sum of ``scores`` (float [num_rollouts], log order) over each unit's rollout
    indices; non-finite scores count 0."""
    s = np.asarray(scores, np.float64)
    s = np.where(np.isfinite(s), s, 0.0)
    return np.array([float(np.sum(s[np.asarray(u, np.int64)])) for u in units], np.float64)


def mean_ci(values: np.ndarray) -> tuple[float, float | None, float | None]:
    """Mean of ``values`` (1-D, >= 1) and its two-sided 95 % Student-t interval (None for one value)."""
    v = np.asarray(values, np.float64)
    if v.ndim != 1 or v.size == 0:
        raise ValueError(f"mean_ci: need a non-empty 1-D array, got shape {v.shape}")
    m = float(v.mean())
    if v.size < 2:
        return m, None, None
    half = float(scipy.stats.t.ppf(0.975, v.size - 1) * v.std(ddof=1) / np.sqrt(v.size))
    return m, m - half, m + half


def spearman_ci(pred: np.ndarray, measured: np.ndarray, *, nboot: int, seed: int) -> tuple[float, float, float]:
    """Spearman of ``pred`` vs ``measured`` (1-D, same length >= 2) and a 95 % percentile bootstrap
    interval over items (``nboot`` resamples, ``default_rng(seed)``)."""
    p, a = np.asarray(pred, np.float64), np.asarray(measured, np.float64)
    rho = M.lds_correlation(p, a)
    rng = np.random.default_rng(seed)
    boots = [M.lds_correlation(p[i], a[i]) for i in (rng.integers(0, p.size, p.size) for _ in range(nboot))]
    lo, hi = np.percentile(boots, [2.5, 97.5]) if boots else (np.nan, np.nan)
    return rho, float(lo), float(hi)


def top_units(effects: np.ndarray, k: int) -> np.ndarray:
    """bool [U]: the ``k`` units of largest effect (ties: earlier unit first)."""
    e = np.asarray(effects, np.float64)
    order = np.lexsort((np.arange(e.size), -e))
    out = np.zeros(e.size, bool)
    out[order[:k]] = True
    return out


def percentile_ranks(effects: np.ndarray) -> np.ndarray:
    """float64 [U]: each unit's percentile rank by effect, 1 = the largest, 1/U = the smallest
    (ties share their mean rank)."""
    e = np.asarray(effects, np.float64)
    return scipy.stats.rankdata(e, method="average") / e.size


def method_rows(seed: str, table_suffix: str, effects: np.ndarray, unit_method_scores: Mapping[str, np.ndarray],
                *, k: int, nboot: int, rng_seed: int) -> list[formats.Row]:
    """The ``causal_spearman_<suffix>`` and ``causal_p@k_<suffix>`` rows of every method.

    Args:
        effects: float [U] the units' mean measured effects.
        unit_method_scores: ``{method: float [U]}`` unit scores (:func:`unit_scores`).
        k: the P@k's k (1 <= k <= U).
    Raises:
        ValueError: fewer than 2 units, or k outside 1..U.
    """
    e = np.asarray(effects, np.float64)
    if e.size < 2 or not 1 <= k <= e.size:
        raise ValueError(f"causal tables need >= 2 units and 1 <= k <= units; got {e.size} units, k = {k}")
    top = top_units(e, k)
    rows = []
    for name, s in unit_method_scores.items():
        rho, lo, hi = spearman_ci(s, e, nboot=nboot, seed=rng_seed)
        rows.append(formats.Row(seed, f"causal_spearman_{table_suffix}", name, rho, lo, hi, 0.0, 1.0, int(e.size)))
        p = M.precision_at_k_fractional(np.asarray(s, np.float64), top, k)
        rows.append(formats.Row(seed, f"causal_p@k_{table_suffix}", name, p, None, None, k / e.size, 1.0, k))
    return rows


def effect_rows(seed: str, table_suffix: str, names: Sequence[str], effects: np.ndarray) -> list[formats.Row]:
    """``causal_effect_<suffix>``: one row per unit; ``effects`` float [streams, U]."""
    e = np.asarray(effects, np.float64)
    rows = []
    for j, name in enumerate(names):
        m, lo, hi = mean_ci(e[:, j])
        rows.append(formats.Row(seed, f"causal_effect_{table_suffix}", name, m, lo, hi, None, None, int(e.shape[0])))
    return rows


def noise_floor_rows(seed: str, rollouts: str, baselines: np.ndarray) -> list[formats.Row]:
    """``causal_noise_floor_<rollouts>`` rows ``baseline-sd`` and ``mde`` of the no-intervention
    baseline's values float [streams >= 2] (module docstring). Raises ValueError for < 2 streams
    or non-finite values (``noise_floor.noise_floor``)."""
    f = NF.noise_floor(np.asarray(baselines, np.float64), design="two-arm")
    table = f"causal_noise_floor_{rollouts}"
    return [formats.Row(seed, table, "baseline-sd", f.sd, None, None, f.mean, None, f.n_streams),
            formats.Row(seed, table, "mde", f.mde, None, None, None, None, f.n_streams)]


def detected_rows(seed: str, table_suffix: str, names: Sequence[str], effects: np.ndarray,
                  floor_sd: float) -> list[formats.Row]:
    """``causal_detected_<suffix>``: per unit, 1 = its t-interval over streams excludes 0, 0 = "not
    detected" (module docstring); ``effects`` float [streams >= 2, U]; ``floor_sd`` the baseline's
    sd over streams."""
    e = np.asarray(effects, np.float64)
    rows = []
    for j, name in enumerate(names):
        m, lo, hi = mean_ci(e[:, j])
        hit = NF.verdict(lo, hi) == NF.DETECTED
        rows.append(formats.Row(seed, f"causal_detected_{table_suffix}", name, 1.0 if hit else 0.0, lo, hi,
                                m / floor_sd if floor_sd > 0 else None, None, int(e.shape[0])))
    return rows


def gt_rank_row(seed: str, rollouts: str, intervention: str, effects: np.ndarray,
                gt_counts: np.ndarray) -> formats.Row | None:
    """``causal_label_<rollouts>`` row ``gt-unit-rank:<intervention>``: the mean percentile rank of
    the units holding ground truth (``gt_counts > 0``) by mean effect; ``chance`` = the mean
    percentile of all units (a random set's expectation); None when no unit holds ground truth."""
    held = np.asarray(gt_counts) > 0
    if not held.any():
        return None
    r = percentile_ranks(effects)
    return formats.Row(seed, f"causal_label_{rollouts}", f"gt-unit-rank:{intervention}", float(r[held].mean()),
                       None, None, float(r.mean()), 1.0, int(held.sum()))


def label_delta_row(seed: str, rollouts: str, name: str, deltas: np.ndarray) -> formats.Row:
    """``causal_label_<rollouts>`` row ``name`` (e.g. ``withhold-all-gt``): mean Δ over streams with
    its t-interval, ``n`` = streams."""
    m, lo, hi = mean_ci(np.asarray(deltas, np.float64))
    return formats.Row(seed, f"causal_label_{rollouts}", name, m, lo, hi, None, None, int(np.size(deltas)))


def metagradient_rows(seed: str, rollouts: str, names: Sequence[str], predicted: np.ndarray, effects: np.ndarray,
                      *, k: int, rng_seed: int) -> list[formats.Row]:
    """``causal_metagradient_remove_<rollouts>`` rows (module docstring): ``predicted`` float [U] the
    metagradient's unit scores, ``effects`` float [streams, U] the measured removal Δs."""
    pred, e = np.asarray(predicted, np.float64), np.asarray(effects, np.float64)
    top = np.flatnonzero(top_units(pred, k))
    top = top[np.argsort(-pred[top], kind="stable")]
    rest = np.setdiff1d(np.arange(pred.size), top)
    rnd = np.random.default_rng(rng_seed).choice(rest, min(k, rest.size), replace=False) if rest.size else rest
    rows = []
    for tag, picks in (("top", top), ("random", rnd)):
        for i, u in enumerate(picks):
            m, lo, hi = mean_ci(e[:, u])
            rows.append(formats.Row(seed, f"causal_metagradient_remove_{rollouts}", f"{tag}{i + 1}:{names[u]}", m, lo, hi,
                                    float(pred[u]), None, int(e.shape[0])))
    return rows


def tables(seed: str, *, unit_names: Sequence[str], unit_rollouts: Sequence[np.ndarray],
           effects: Mapping[tuple[str, str], np.ndarray], label_deltas: Mapping[tuple[str, str], np.ndarray],
           scores: Mapping[str, np.ndarray], is_gt: np.ndarray, k_fraction: float, nboot: int,
           rng_seed: int = 0, baselines: Mapping[str, np.ndarray] | None = None) -> list[formats.Row]:
    """Every ``causal_*`` row of one run (module docstring).

    Args:
        unit_names / unit_rollouts: the U units and their rollout indices (log order).
        effects: ``{(intervention, rollouts): float [streams, U]}`` measured Δs.
        label_deltas: ``{(rollouts, "withhold-all-gt" | "withhold-all-bonuses"): float [streams]}``.
        scores: ``{method: float [num_rollouts]}`` per-rollout scores (log order).
        is_gt: bool [num_rollouts], the logged ground truth.
        k_fraction: P@k's k = ``max(1, round(k_fraction * U))``.
        baselines: ``{rollouts: float [streams]}`` the no-intervention baseline's values per stream;
            a mode with >= 2 streams gets its ``causal_noise_floor_*`` and ``causal_detected_*`` rows.
    Raises:
        ValueError: fewer than 2 units, or ``k_fraction`` outside (0, 1].
    """
    if not 0.0 < k_fraction <= 1.0:
        raise ValueError(f"counterfactual.causal_k={k_fraction}: must lie in (0, 1]")
    gt = np.asarray(is_gt, bool)
    gt_counts = np.array([int(gt[np.asarray(u, np.int64)].sum()) for u in unit_rollouts])
    per_unit = {LABEL: gt_counts.astype(np.float64)}
    per_unit.update({m: unit_scores(s, unit_rollouts) for m, s in scores.items()})
    k = max(1, int(round(k_fraction * len(unit_names))))
    rows: list[formats.Row] = []
    floors = {ro: np.asarray(b, np.float64) for ro, b in (baselines or {}).items() if np.size(b) >= 2}
    for (iv, ro), e in sorted(effects.items()):
        suffix = f"{iv}_{ro}"
        rows += effect_rows(seed, suffix, unit_names, e)
        if ro in floors and np.shape(e)[0] >= 2:
            rows += detected_rows(seed, suffix, unit_names, e, float(np.std(floors[ro], ddof=1)))
        mean = np.asarray(e, np.float64).mean(axis=0)
        rows += method_rows(seed, suffix, mean, per_unit, k=k, nboot=nboot, rng_seed=rng_seed)
        if iv == "remove" and METAGRADIENT in per_unit:
            rows += metagradient_rows(seed, ro, unit_names, per_unit[METAGRADIENT], e, k=k, rng_seed=rng_seed)
    for ro in sorted({ro for _, ro in effects} | {ro for ro, _ in label_deltas}):
        for (r, name), d in sorted(label_deltas.items()):
            if r == ro:
                rows.append(label_delta_row(seed, ro, name, d))
        for (iv, r), e in sorted(effects.items()):
            if r == ro:
                row = gt_rank_row(seed, ro, iv, np.asarray(e, np.float64).mean(axis=0), gt_counts)
                if row is not None:
                    rows.append(row)
        if ro in floors:
            rows += noise_floor_rows(seed, ro, floors[ro])
    return rows


def report_lines(rows: Sequence[formats.Row]) -> list[str]:
    """Markdown lines for report.md: per intervention and rollout mode, every method's Spearman
    (CI) and P@k against the measured unit effects, then the label's rows; [] without causal rows."""
    sp = [r for r in rows if r.table.startswith("causal_spearman_")]
    if not sp:
        return []
    pk = {(r.table[len("causal_p@k_"):], r.method): r for r in rows if r.table.startswith("causal_p@k_")}
    lines = ["", "### Causal ground truth (single-unit replays)", "",
             "Δ_u = behaviour margin without intervention minus with unit u intervened (remove: weight 0; "
             "withhold-bonus: its bonus withheld, advantages recomputed), at the measure step; fixed = the logged "
             "rollouts, regenerated = sampled from the replayed policy (CI over sampler streams in "
             "`causal_effect_*`). Spearman of each method's unit score vs Δ (95 % bootstrap CI over units), "
             "P@k of its top-k units among the top-k causal units.", "",
             "| seed | intervention / rollouts | method | Spearman | 95% CI | P@k | chance | k |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sp:
        suffix = r.table[len("causal_spearman_"):]
        p = pk.get((suffix, r.method))
        lines.append(f"| {r.seed} | {suffix} | {r.method} | {r.value:.3f} | [{r.lo:.3f}, {r.hi:.3f}] | "
                     f"{'' if p is None else f'{p.value:.3f}'} | {'' if p is None else f'{p.chance:.3f}'} | "
                     f"{'' if p is None else p.n} |")
    label = [r for r in rows if r.table.startswith("causal_label_")]
    if label:
        lines += ["", "| seed | rollouts | label check | value | 95% CI | chance | n |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r.seed} | {r.table[len('causal_label_'):]} | {r.method} | {r.value:.4f} | "
                  f"{'' if r.lo is None else f'[{r.lo:.4f}, {r.hi:.4f}]'} | "
                  f"{'' if r.chance is None else f'{r.chance:.3f}'} | {r.n} |" for r in label]
    return lines


def _ci(r: formats.Row, fmt: str) -> str:
    return "" if r.lo is None or r.hi is None else f" [{r.lo:{fmt}}, {r.hi:{fmt}}]"


def seed_summary_lines(rows: Sequence[formats.Row], methods: Sequence[str] = ()) -> list[str]:
    """Markdown tables over seeds (the ``sweep`` stage's aggregate report; issue 31 item 5).

    Per intervention and rollout mode: one row per method, one column per seed with its Spearman
    against the measured unit effects (95 % bootstrap CI over units), the mean Spearman over
    seeds, and the mean P@k with its chance. Then the label's checks (``causal_label_*``), one
    column per seed. ``methods`` orders and filters the method rows ("" keeps every method, in the
    order first seen). Returns [] without ``causal_spearman_*`` rows.
    """
    sp = [r for r in rows if r.table.startswith("causal_spearman_")]
    if not sp:
        return []
    seeds = sorted({r.seed for r in sp}, key=str)
    pk = {(r.table[len("causal_p@k_"):], r.method, r.seed): r for r in rows if r.table.startswith("causal_p@k_")}
    by = {(r.table[len("causal_spearman_"):], r.method, r.seed): r for r in sp}
    suffixes = list(dict.fromkeys(r.table[len("causal_spearman_"):] for r in sp))
    names = list(methods) or list(dict.fromkeys(r.method for r in sp))
    head = "| method | " + " | ".join(f"seed {s}: Spearman [95% CI]" for s in seeds) + " | mean | mean P@k (chance) |"
    lines: list[str] = []
    units = {r.table[len("causal_spearman_"):]: r.n for r in sp}
    for suffix in suffixes:
        lines += ["", f"**{suffix.replace('_', ', ')}** (units: {units[suffix]})", "",
                  head, "|---" * (len(seeds) + 3) + "|"]
        for m in names:
            got = [by.get((suffix, m, s)) for s in seeds]
            if not any(got):
                continue
            cells = ["" if r is None else f"{r.value:.2f}{_ci(r, '.2f')}" for r in got]
            mean = np.mean([r.value for r in got if r is not None])
            ps = [pk[(suffix, m, s)] for s in seeds if (suffix, m, s) in pk]
            p = f"{np.mean([r.value for r in ps]):.2f} ({np.mean([r.chance for r in ps]):.2f})" if ps else ""
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {mean:.2f} | {p} |")
    label = [r for r in rows if r.table.startswith("causal_label_")]
    if label:
        lab = {(r.table[len("causal_label_"):], r.method, r.seed): r for r in label}
        checks = list(dict.fromkeys((r.table[len("causal_label_"):], r.method) for r in label))
        lines += ["", "**The label against the replays** (Δ of withholding every ground-truth bonus / every bonus, "
                  "CI over streams; gt-unit-rank: mean percentile of the units holding ground truth, 1 = most causal, "
                  "chance in brackets)", "",
                  "| rollouts | check | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---" * (len(seeds) + 2) + "|"]
        for ro, m in checks:
            cells = []
            for s in seeds:
                r = lab.get((ro, m, s))
                cells.append("" if r is None else f"{r.value:.3f}" + (f" ({r.chance:.3f})" if r.chance is not None
                                                                     else _ci(r, ".3f")))
            lines.append(f"| {ro} | {m} | " + " | ".join(cells) + " |")
    return lines
