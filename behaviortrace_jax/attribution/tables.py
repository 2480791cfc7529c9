"""The evaluation's tables (SPEC §6): step-level, which-rollout and rollout-level rows.

Everything here takes plain arrays / dicts, so the pipeline can call it on its own sketch stores
and the ``reproduce`` job on the paper's released files:

* :func:`step_level_tables` -> the ``overall`` and ``early_nonzero`` rows (SPEC §6.6), on the
  populations of :func:`step_populations` (nonzero steps: :func:`nonzero_steps_from_norms`, §6.2);
* :func:`which_rollout_tables` -> the rollout-resolution tables (per-rollout in-run sketches, on
  :func:`which_rollout_population`: early_nonzero without zero-advantage rollouts);
  :func:`top_ranked` -> a method's top rollouts of a population (the report's top-blamed lists);
* :func:`rollout_level_tables` -> ``mp_raw``/``mp_residualized``/``mp_matched`` (+ ``_diag``) rows
  with cluster-bootstrap CIs (SPEC §6.7-§6.10);
* :func:`score_file_header` -> the statistics a score file's header carries (§7.1, §6.1, §6.2).

Rows are :class:`formats.Row`; the verdicts on them are in ``verdicts.py``.
"""
from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from behaviortrace_jax.attribution import estimators, metrics
from behaviortrace_jax.attribution.formats import Row, rollout_index, scores_in_log_order, validate_mp_rows

STEP_TABLES = ("overall", "early_nonzero")
PAPER_RAW = ("GAS_centered", "C1_plain", "norm_only", "fluency")  # SPEC §6.10 call order
PAPER_RESID = ("GAS_centered", "C1_plain", "norm_only")
MATCHED = ("GAS_centered", "C1_plain", "norm_only")


def nonzero_steps_from_norms(step_norms: Mapping[int, float]) -> list[int]:
    """SPEC §6.2: {s : |v_s| > 1e-6 · median(|v_s| > 0)}, sorted. Empty if every norm is 0."""
    norms = {int(s): float(v) for s, v in step_norms.items()}
    pos = [v for v in norms.values() if v > 0]
    if not pos:
        return []
    thr = 1e-6 * float(np.median(pos))
    return sorted(s for s, v in norms.items() if v > thr)


@dataclass(frozen=True)
class Population:
    """A step-level table's population: mask over the log, k = |GT ∩ pop|, chance and ceiling."""

    table: str
    mask: np.ndarray  # bool [N]
    k: int
    chance: float
    ceiling: float

    @property
    def n(self) -> int:
        return int(self.mask.sum())


def _gt_mask(gt_ids: Iterable[str], index: Mapping[str, int]) -> np.ndarray:
    m = np.zeros(len(index), bool)
    for g in gt_ids:
        if g not in index:
            raise ValueError(f"ground-truth id {g!r} is not in the rollout log (population of {len(index)})")
        m[index[g]] = True
    return m


def step_populations(rollout_ids: Sequence[str], rollout_steps, gt_ids: Iterable[str], *,
                     nonzero_steps: Iterable[int] | None = None,
                     step_norms: Mapping[int, float] | None = None,
                     early_cutoff: int = 200) -> dict[str, Population]:
    """The ``overall`` and ``early_nonzero`` populations with k, chance and ceiling (SPEC §6.6).

    overall = every rollout; early_nonzero = rollouts with step < early_cutoff whose step is
    nonzero (SPEC §6.2; from ``nonzero_steps`` or computed from ``step_norms``). The ceiling
    treats each step as an unsplittable block (SPEC §6.4).

    Raises:
        ValueError: GT id outside the log, no GT in a population, neither nonzero input given.
    """
    steps = np.asarray(rollout_steps, dtype=np.int64)
    if steps.shape != (len(rollout_ids),):
        raise ValueError(f"rollout_steps shape {steps.shape} != ({len(rollout_ids)},)")
    if nonzero_steps is None:
        if step_norms is None:
            raise ValueError("give nonzero_steps or step_norms")
        nonzero_steps = nonzero_steps_from_norms(step_norms)
    gt = _gt_mask(gt_ids, rollout_index(rollout_ids))
    masks = {"overall": np.ones(steps.size, bool),
             "early_nonzero": (steps < early_cutoff) & np.isin(steps, np.asarray(list(nonzero_steps), dtype=np.int64))}
    out = {}
    for table, mask in masks.items():
        k = int(gt[mask].sum())
        if k == 0:
            raise ValueError(f"no ground-truth rollout in the {table!r} population ({int(mask.sum())} rollouts)")
        out[table] = Population(table, mask, k, metrics.base_rate(k, int(mask.sum())),
                                metrics.precision_ceiling_fractional(steps[mask], gt[mask], k))
    return out


def step_level_tables(seed, rollout_ids: Sequence[str], rollout_steps, gt_ids: Iterable[str],
                      method_scores: Mapping[str, object], *, nonzero_steps: Iterable[int] | None = None,
                      step_norms: Mapping[int, float] | None = None, early_cutoff: int = 200,
                      tables: Sequence[str] = STEP_TABLES) -> list[Row]:
    """``overall`` and ``early_nonzero`` rows (SPEC §6.6): tie-aware P@|GT_pop| per method.

    Args:
        seed: label of the seed column.
        rollout_ids: [N] in log order; rollout_steps: int [N].
        gt_ids: ground-truth rollout ids (§6.1).
        method_scores: {method: scores} in the order the rows should appear; scores per
            :func:`scores_in_log_order` (step scores already expanded, ``-inf`` allowed).
        nonzero_steps / step_norms: which steps count as nonzero (§6.2).
        tables: subset of ("overall", "early_nonzero") to emit.
    Returns:
        rows ordered table-major, with chance, ceiling and n = |population|; lo/hi empty.
    Raises:
        ValueError: see :func:`step_populations` and :func:`scores_in_log_order`.
    """
    pops = step_populations(rollout_ids, rollout_steps, gt_ids, nonzero_steps=nonzero_steps,
                            step_norms=step_norms, early_cutoff=early_cutoff)
    index = rollout_index(rollout_ids)
    gt = _gt_mask(gt_ids, index)
    scores = {m: scores_in_log_order(m, s, rollout_ids, index) for m, s in method_scores.items()}
    rows = []
    for table in tables:
        if table not in pops:
            raise ValueError(f"unknown step table {table!r}; known: {STEP_TABLES}")
        p = pops[table]
        for m, s in scores.items():
            value = metrics.precision_at_k_fractional(s[p.mask], gt[p.mask], p.k)
            rows.append(Row(str(seed), table, m, value, chance=p.chance, ceiling=p.ceiling, n=p.n))
    return rows


def which_rollout_population(rollout_ids: Sequence[str], rollout_steps, gt_ids: Iterable[str], *,
                             advantages=None, nonzero_steps: Iterable[int] | None = None,
                             step_norms: Mapping[int, float] | None = None, early_cutoff: int = 200) -> Population:
    """The "which rollout" population W: the early_nonzero population E (SPEC §6.6) without the
    rollouts whose logged advantage is exactly 0 (zero-variance groups: their term of the loss is
    0, so they taught nothing), when ``advantages`` (float [N], log order) is given. k = |GT ∩ W|,
    chance = k / |W|, ceiling 1.0 (a per-rollout ranker may split steps).

    Raises:
        ValueError: as :func:`step_populations`; ``advantages`` of the wrong shape; no GT left in W.
    """
    pops = step_populations(rollout_ids, rollout_steps, gt_ids, nonzero_steps=nonzero_steps,
                            step_norms=step_norms, early_cutoff=early_cutoff)
    mask = pops["early_nonzero"].mask.copy()
    if advantages is not None:
        adv = np.asarray(advantages, dtype=np.float64)
        if adv.shape != mask.shape:
            raise ValueError(f"advantages shape {adv.shape} != ({mask.size},) rollouts")
        mask &= adv != 0
    gt = _gt_mask(gt_ids, rollout_index(rollout_ids))
    k = int(gt[mask].sum())
    if k == 0:
        raise ValueError(f"no ground-truth rollout with a nonzero advantage in the which_rollout population "
                         f"({int(mask.sum())} rollouts)")
    return Population("which_rollout", mask, k, metrics.base_rate(k, int(mask.sum())), 1.0)


def which_rollout_tables(seed, rollout_ids: Sequence[str], rollout_steps, gt_ids: Iterable[str],
                         method_scores: Mapping[str, object], *, nonzero_steps: Iterable[int] | None = None,
                         step_norms: Mapping[int, float] | None = None, early_cutoff: int = 200,
                         nboot: int = 0, rng_seed: int = 0, advantages=None) -> list[Row]:
    """"Which rollout" tables: scores from per-rollout in-run sketches, so a ranker may split steps.

    Population W (:func:`which_rollout_population`): the early_nonzero population E, minus the
    rollouts with A_i = 0 when ``advantages`` is given (how many were dropped: E's n minus W's n).

    * ``which_rollout``: P@|GT_W| on W; chance = |GT_W|/|W|; the ceiling is 1.0 (a perfect
      per-rollout ranker); n = |W|.
    * ``which_rollout_within_step``: within-step AUC (GT vs non-GT rollouts of the same step,
      pooled pairs, ties ½; SPEC §6.7 with steps as groups) on W, chance 0.5, ceiling 1.0,
      n = pairs; lo/hi from a cluster bootstrap over steps when ``nboot`` > 0, each method with
      its own stream (:func:`method_rng`), so a method's CI does not depend on which other methods
      are scored. Step-level scores get 0.5 here.
    """
    p = which_rollout_population(rollout_ids, rollout_steps, gt_ids, advantages=advantages,
                                 nonzero_steps=nonzero_steps, step_norms=step_norms, early_cutoff=early_cutoff)
    index = rollout_index(rollout_ids)
    gt = _gt_mask(gt_ids, index)
    steps = np.asarray(rollout_steps, dtype=np.int64)
    prec, auc = [], []
    for m, s in method_scores.items():
        s = scores_in_log_order(m, s, rollout_ids, index)
        prec.append(Row(str(seed), "which_rollout", m, metrics.precision_at_k_fractional(s[p.mask], gt[p.mask], p.k),
                        chance=p.chance, ceiling=1.0, n=p.n))
        gp = metrics.group_pairs(steps[p.mask], gt[p.mask], s[p.mask])
        lo = hi = None
        if nboot > 0 and gp.n_pairs:
            lo, hi = metrics.cluster_bootstrap(gp, method_rng(rng_seed, m), nboot)
        auc.append(Row(str(seed), "which_rollout_within_step", m, gp.auc, lo, hi, 0.5, 1.0, gp.n_pairs))
    return prec + auc


def method_rng(rng_seed: int, method: str) -> np.random.Generator:
    """The bootstrap stream of one method: ``default_rng([rng_seed, crc32(method)])``, the same
    whatever other methods a table scores, in any process."""
    return np.random.default_rng([int(rng_seed), zlib.crc32(method.encode())])


def top_ranked(scores, mask, k: int = 10) -> np.ndarray:
    """Indices (log order positions) of the ``k`` highest ``scores`` among ``mask``'s rollouts,
    best first; ties go to the earlier rollout. ``-inf`` scores rank last. int64 [min(k, |mask|)].

    Args:
        scores: float [N]; mask: bool [N] (the population, e.g. :func:`which_rollout_population`).
    """
    s = np.asarray(scores, dtype=np.float64)
    cand = np.flatnonzero(np.asarray(mask, dtype=bool))
    order = np.lexsort((cand, -s[cand]))
    return cand[order[:k]]


def _rollout_methods(rows: Sequence[Mapping]) -> list[tuple[str, str]]:
    """(method, column) pairs evaluated: the paper's four, then plug-ins present in the rows."""
    out = [(m, estimators.ESTIMATORS[m].column) for m in PAPER_RAW]
    for est in estimators.estimators("rollout"):
        if est.name not in PAPER_RAW and est.in_tables and est.column in rows[0]:
            out.append((est.name, est.column))
    return out


def rollout_level_tables(seed_label, rows: Sequence[Mapping], *, nboot: int = 600, rng_seed: int = 0,
                         suffix: str = "", delta: float = 0.10, matched: bool = True,
                         source: str = "rows") -> list[Row]:
    """Within-group AUC rows of one minimal-pair draw (SPEC §6.7-§6.10).

    Emits ``mp_raw{suffix}`` (GAS_centered, C1_plain, norm_only, fluency, then plug-in rollout
    estimators), ``mp_residualized{suffix}`` (the same minus fluency; residual map fitted once on
    all rows) and, when ``matched``, ``mp_matched{suffix}`` (pairs with |Δfluency| ≤ delta,
    GAS_centered/C1_plain/norm_only). n = pairs, lo/hi = 95 % cluster-bootstrap CI, chance/ceiling
    empty. One ``np.random.default_rng(rng_seed)`` is shared sequentially in SPEC §6.10's order
    (raw GAS, C1, norm, fluency, resid GAS, C1, norm), then plug-ins, then matched, so the paper's
    bounds are reproduced exactly with nboot = 600. A method with no pairs gets value NaN, no CI.

    Raises:
        ValueError: bad rows (see :func:`validate_mp_rows`), nboot ≤ 0.
    """
    if nboot <= 0:
        raise ValueError(f"nboot must be positive, got {nboot}")
    methods = _rollout_methods(rows) if rows else []
    validate_mp_rows(rows, [c for _, c in methods], source)
    groups = np.array([r["group"] for r in rows])
    pos = np.array([bool(r["has_qzxbt"]) for r in rows])
    fl = np.array([float(r["fluency"]) for r in rows])
    col = {m: np.array([float(r[c]) for r in rows]) for m, c in methods}
    rng = np.random.default_rng(rng_seed)
    label = str(seed_label)

    def row(table: str, method: str, gp: metrics.GroupPairs) -> Row:
        lo = hi = None
        if gp.n_pairs:
            lo, hi = metrics.cluster_bootstrap(gp, rng, nboot)
        return Row(label, table + suffix, method, gp.auc, lo, hi, n=gp.n_pairs)

    extras = [m for m, _ in methods if m not in PAPER_RAW]
    resid = {m: metrics.residualize_by_fluency(groups, fl, col[m]) for m in PAPER_RESID + tuple(extras)}
    raw_rows = [row("mp_raw", m, metrics.group_pairs(groups, pos, col[m])) for m in PAPER_RAW]
    res_rows = [row("mp_residualized", m, metrics.group_pairs(groups, pos, resid[m])) for m in PAPER_RESID]
    raw_rows += [row("mp_raw", m, metrics.group_pairs(groups, pos, col[m])) for m in extras]
    res_rows += [row("mp_residualized", m, metrics.group_pairs(groups, pos, resid[m])) for m in extras]
    out = raw_rows + res_rows
    if matched:
        out += [row("mp_matched", m, metrics.group_pairs(groups, pos, col[m], fluency=fl, matched=True, delta=delta))
                for m in MATCHED + tuple(extras)]
    return out


def score_file_header(run_name: str, seed: int, rollout_ids: Sequence[str], rollout_steps,
                      gt_ids: Iterable[str], step_norms: Mapping[int, float], *,
                      final_rewards=None, group_size: int = 4, early_cutoff: int = 200,
                      embedding: str = "countsketch") -> dict:
    """Header fields of the score file (§7.1, §6.1, §6.2), computed from the run.

    ``gt_unfindable_zero_var`` counts GT rollouts whose GRPO group (step, index-in-step //
    group_size) has final rewards with np.std == 0 (None without ``final_rewards``);
    ``gt_in_zero_step`` counts GT rollouts of steps not in nonzero_steps; ``late_early_norm_ratio``
    = mean(|v_s|, s ≥ cutoff)/mean(|v_s|, s < cutoff) (None if either side is empty).
    """
    steps = np.asarray(rollout_steps, dtype=np.int64)
    index = rollout_index(rollout_ids)
    gt = _gt_mask(gt_ids, index)
    nonzero = nonzero_steps_from_norms(step_norms)
    early = [float(v) for s, v in step_norms.items() if int(s) < early_cutoff]
    late = [float(v) for s, v in step_norms.items() if int(s) >= early_cutoff]
    ratio = float(np.mean(late) / np.mean(early)) if early and late and np.mean(early) > 0 else None
    unfindable = None
    if final_rewards is not None:
        rew = np.asarray(final_rewards, dtype=np.float64)
        if rew.shape != steps.shape:
            raise ValueError(f"final_rewards shape {rew.shape} != ({steps.size},)")
        pos_in_step = np.zeros(steps.size, np.int64)
        counters: dict[int, int] = {}
        for i, s in enumerate(steps.tolist()):
            pos_in_step[i] = counters.get(s, 0)
            counters[s] = pos_in_step[i] + 1
        keys = steps * 1_000_000 + pos_in_step // group_size
        unfindable = 0
        for key in np.unique(keys[gt]):
            members = keys == key
            if np.std(rew[members]) == 0:
                unfindable += int(gt[members].sum())
    return {"run_name": run_name, "seed": int(seed), "gt_size": int(gt.sum()), "n_rollouts": len(rollout_ids),
            "late_early_norm_ratio": ratio, "embedding": embedding, "gt_unfindable_zero_var": unfindable,
            "gt_in_zero_step": int((gt & ~np.isin(steps, nonzero)).sum()), "nonzero_steps": nonzero}


