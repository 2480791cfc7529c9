"""Attribution specificity across behaviours: does behaviour A's target rank A's rollouts
above what behaviour B's target does?

For two behaviours A and B of one run, an estimator ``m`` and a population ``pop`` (a bool mask over
the rollout log), with ``GT_A`` A's ground-truth rollouts and ``k = |GT_A ∩ pop|``:

* ``P_A(T)`` = tie-aware P@k (``metrics.precision_at_k_fractional``) of ``m``'s scores computed
  with target ``T`` against ``GT_A``;
* the specificity ``Δ_{A|B} = P_A(t_A) - P_A(t_B)``: > 0 when A's target finds A's rollouts better
  than B's target does. Its chance level is 0 (a ranking that ignores the target scores the same
  with both; a random one is 0 in expectation), and the target-free magnitude control (norm-only)
  has Δ = 0 exactly;
* a 95 % cluster-bootstrap CI of Δ: resample the population's steps with replacement
  (``rng.integers(0, S, S)`` per resample, one ``default_rng(rng_seed)`` stream), recompute both
  precisions on the resampled rollouts with k = the resample's |GT_A| (resamples without GT_A are
  skipped), ``np.percentile([2.5, 97.5])``.

Rows (``formats.Row``, seed = the run's label):

* ``spec_p_<level>@<A>|t=<T>``: ``P_A(T)`` per method, chance |GT_A ∩ pop| / |pop|, ceiling 1.0
  for rollout-level scores (the step-block ceiling for step-level ones), n = |pop|;
* ``spec_delta_<level>@<A>-<B>``: Δ with [lo, hi], chance 0.0, ceiling = P_A's ceiling (its
  largest value, reached when B's target finds none of A's rollouts), n = |pop|.

Verdicts (``verdicts.Verdict``), per targeted method and ordered pair: "specific beyond its
magnitude control" passes iff the CI of Δ lies above 0 **and** ``P_A(t_A)`` exceeds the norm-only
control's P@k on the same population (a target that only ranks by gradient size cannot pass
either way); not-evaluable when the CI could not be formed.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from behaviortrace_jax.attribution import estimators, metrics
from behaviortrace_jax.attribution.formats import Row
from behaviortrace_jax.attribution.verdicts import Verdict, verdict

DELTA_PREFIX = "spec_delta_"
PREC_PREFIX = "spec_p_"


def precision(scores: np.ndarray, is_gt: np.ndarray) -> float:
    """Tie-aware P@|GT| of float [N] ``scores`` against bool [N] ``is_gt`` (NaN if no GT)."""
    k = int(np.sum(is_gt))
    return float("nan") if k == 0 else metrics.precision_at_k_fractional(scores, is_gt, k)


def specificity_delta(scores_own: np.ndarray, scores_other: np.ndarray, is_gt: np.ndarray) -> float:
    """``P@|GT|(scores_own) - P@|GT|(scores_other)`` against ``is_gt`` (float64; NaN without GT).

    Args:
        scores_own / scores_other: float [N], one method's scores with the own / the other target.
        is_gt: bool [N], the own behaviour's ground truth.
    Raises:
        ValueError: shapes differ or NaN scores (from ``metrics``).
    """
    a, b, g = np.asarray(scores_own, np.float64), np.asarray(scores_other, np.float64), np.asarray(is_gt, bool)
    if not a.shape == b.shape == g.shape:
        raise ValueError(f"specificity_delta: shapes differ: {a.shape}, {b.shape}, {g.shape}")
    return precision(a, g) - precision(b, g)


def bootstrap_delta(scores_own: np.ndarray, scores_other: np.ndarray, is_gt: np.ndarray, clusters: np.ndarray,
                    rng: np.random.Generator, nboot: int) -> tuple[float | None, float | None]:
    """95 % cluster-bootstrap CI of :func:`specificity_delta` (see the module docstring).

    Args:
        clusters: [N] cluster key per item (the GRPO step); resampled with replacement.
        rng: advanced in place (``nboot`` calls of ``rng.integers(0, S, S)``).
    Returns:
        ``(lo, hi)``, or ``(None, None)`` when ``nboot`` is 0 or no resample holds ground truth.
    """
    if nboot <= 0:
        return None, None
    keys, inverse = np.unique(np.asarray(clusters), return_inverse=True)
    members = [np.flatnonzero(inverse == j) for j in range(keys.size)]
    a, b, g = np.asarray(scores_own, np.float64), np.asarray(scores_other, np.float64), np.asarray(is_gt, bool)
    boots = []
    for _ in range(nboot):
        pick = rng.integers(0, keys.size, keys.size)
        idx = np.concatenate([members[j] for j in pick]) if pick.size else np.zeros(0, np.int64)
        if g[idx].any():
            boots.append(specificity_delta(a[idx], b[idx], g[idx]))
    if not boots:
        return None, None
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return float(lo), float(hi)


def specificity_rows(label: str, level: str, rollout_steps: np.ndarray, populations: Mapping[str, np.ndarray],
                     gt: Mapping[str, np.ndarray], scores: Mapping[str, Mapping[str, np.ndarray]], *,
                     nboot: int = 0, rng_seed: int = 0, ceiling: Mapping[str, float] | None = None) -> list[Row]:
    """The specificity rows of one run at one level ("step" or "rollout").

    Args:
        label: the seed label of the rows.
        level: "step" (scores from step sketches) or "rollout" (per-rollout in-run sketches).
        rollout_steps: int [N], the GRPO step of each logged rollout (bootstrap clusters).
        populations: {behaviour id: bool [N]} the population each behaviour's precision is read on.
        gt: {behaviour id: bool [N]} ground truth per behaviour.
        scores: {target behaviour id: {method: float [N]}}: every method's scores with that
            behaviour's target (the same methods, in the same order, for every target).
        nboot / rng_seed: bootstrap resamples and the seed of the one rng shared in row order.
        ceiling: {behaviour id: ceiling of P_A}; default 1.0.
    Returns:
        For each behaviour A (``gt`` order): the ``spec_p`` rows of every target, then for each
        other behaviour B the ``spec_delta`` rows; methods in ``scores`` order.
    Raises:
        ValueError: fewer than two behaviours, differing method lists, a population without GT.
    """
    ids = list(gt)
    if len(ids) < 2:
        raise ValueError(f"specificity needs >= 2 behaviours, got {ids}")
    methods = list(scores[ids[0]])
    for t in ids:
        if list(scores[t]) != methods:
            raise ValueError(f"specificity: target {t!r} has methods {list(scores[t])}, expected {methods}")
    steps = np.asarray(rollout_steps, np.int64)
    rng = np.random.default_rng(rng_seed)
    rows: list[Row] = []
    for a in ids:
        pop = np.asarray(populations[a], bool)
        g = np.asarray(gt[a], bool)[pop]
        k = int(g.sum())
        if k == 0:
            raise ValueError(f"specificity: no ground-truth rollout of behaviour {a!r} in its population")
        chance = metrics.base_rate(k, int(pop.sum()))
        ceil = (ceiling or {}).get(a, 1.0)
        for t in ids:
            for m in methods:
                rows.append(Row(label, f"{PREC_PREFIX}{level}@{a}|t={t}", m,
                                precision(np.asarray(scores[t][m], np.float64)[pop], g),
                                chance=chance, ceiling=ceil, n=int(pop.sum())))
        for b in ids:
            if b == a:
                continue
            for m in methods:
                own = np.asarray(scores[a][m], np.float64)[pop]
                other = np.asarray(scores[b][m], np.float64)[pop]
                lo, hi = bootstrap_delta(own, other, g, steps[pop], rng, nboot)
                rows.append(Row(label, f"{DELTA_PREFIX}{level}@{a}-{b}", m, specificity_delta(own, other, g),
                                lo, hi, chance=0.0, ceiling=ceil, n=int(pop.sum())))
    return rows


def _parse(table: str, prefix: str) -> tuple[str, str, str]:
    """``spec_delta_<level>@<A>-<B>`` -> (level, A, B); ``spec_p_<level>@<A>|t=<T>`` -> (level, A, T)."""
    level, rest = table[len(prefix):].split("@", 1)
    a, b = rest.split("|t=", 1) if prefix == PREC_PREFIX else rest.split("-", 1)
    return level, a, b


def specificity_verdicts(rows: Sequence[Row]) -> list[Verdict]:
    """Per (seed, level, ordered pair, targeted method): "specific beyond its magnitude control".

    Pass iff the Δ CI's lower end > 0 and ``P_A(t_A)`` > the norm-only control's P@|GT_A| on the
    same population; fail otherwise; not-evaluable without a CI. Target-free controls (role
    "control": norm-only, random) get no verdict: their Δ is 0 by construction.
    """
    prec = {(r.seed, r.table, r.method): r for r in rows if r.table.startswith(PREC_PREFIX)}
    out = []
    for r in rows:
        if not r.table.startswith(DELTA_PREFIX):
            continue
        est = estimators.ESTIMATORS.get(r.method)
        if est is not None and est.role == "control":
            continue
        level, a, b = _parse(r.table, DELTA_PREFIX)
        own = prec.get((r.seed, f"{PREC_PREFIX}{level}@{a}|t={a}", r.method))
        norm = prec.get((r.seed, f"{PREC_PREFIX}{level}@{a}|t={a}", estimators.STEP_NORM_CONTROL))
        item = f"specificity {level} {a} vs {b}: {r.method} (seed {r.seed})"
        if r.lo is None or own is None or norm is None:
            out.append(verdict(item, None, f"Δ {r.value:.4f}, no CI or no norm-only row",
                               rule=f"specificity {level} {a} vs {b}", subject=r.seed, method=r.method))
            continue
        ok = r.lo > 0 and own.value > norm.value
        out.append(verdict(item, ok, f"Δ = P_{a}(t_{a}) - P_{a}(t_{b}) = {r.value:.4f} [{r.lo:.4f}, {r.hi:.4f}] "
                                     f"(chance 0); P_{a}(t_{a}) {own.value:.4f} vs norm-only {norm.value:.4f} "
                                     f"(chance {own.chance:.4f})",
                           rule=f"specificity {level} {a} vs {b}", subject=r.seed, method=r.method))
    return out
