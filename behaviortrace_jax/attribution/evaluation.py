"""Evaluation tables, decision rules, checklist verdicts and the result files (SPEC §6, §7, §8).

Everything here takes plain arrays / dicts, so the pipeline can call it on its own sketch store and
the ``reproduce`` job on the paper's released files:

* :func:`step_level_tables` -> the ``overall`` and ``early_nonzero`` rows (SPEC §6.6);
* :func:`which_rollout_tables` -> the new rollout-resolution tables (per-rollout in-run sketches,
  on :func:`which_rollout_population`: early_nonzero without zero-advantage rollouts);
  :func:`top_ranked` -> a method's top rollouts of a population (the report's top-blamed lists);
* :func:`rollout_level_tables` -> ``mp_raw``/``mp_residualized``/``mp_matched`` (+ ``_diag``) rows
  with cluster-bootstrap CIs (SPEC §6.7-§6.10);
* :func:`decision_rules` and :func:`checklist` -> verdicts ``{item, verdict, evidence}`` with
  verdict ∈ {pass, fail, not-evaluable} (SPEC §6.11, §8; plus the which-rollout rule: beat
  norm-only and the reward-only |A_i| ranker);
* writers (atomic) for ``results_table.csv`` (§7.6) and ``attribution_scores.json`` (§7.1), and
  readers for the paper's ``attribution_scores.json``, ``ground_truth.jsonl``, minimal-pair rows.

A :class:`Row` is one CSV line: ``seed,table,method,value,lo,hi,chance,ceiling,n``.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from behaviortrace_jax.attribution import estimators, metrics
from behaviortrace_jax.io.files import atomic_write_text, iter_jsonl, read_json
from behaviortrace_jax.io.layout import as_path

CSV_COLUMNS = ("seed", "table", "method", "value", "lo", "hi", "chance", "ceiling", "n")
STEP_TABLES = ("overall", "early_nonzero")
PAPER_RAW = ("GAS_centered", "C1_plain", "norm_only", "fluency")  # SPEC §6.10 call order
PAPER_RESID = ("GAS_centered", "C1_plain", "norm_only")
MATCHED = ("GAS_centered", "C1_plain", "norm_only")
ROW_FIELDS = ("group", "has_qzxbt", "fluency")
SCORE_FILE_KEYS = ("run_name", "seed", "gt_size", "n_rollouts", "late_early_norm_ratio", "embedding",
                   "gt_unfindable_zero_var", "gt_in_zero_step", "nonzero_steps")


@dataclass(frozen=True)
class Row:
    """One results-table row (SPEC §7.6). ``seed`` is a label ("0", "0_gen100"); None = empty."""

    seed: str
    table: str
    method: str
    value: float
    lo: float | None = None
    hi: float | None = None
    chance: float | None = None
    ceiling: float | None = None
    n: int | None = None


# --------------------------------------------------------------------------------------------
# small I/O helpers (atomic writes: files.py)
# --------------------------------------------------------------------------------------------
def _fmt(x) -> str:
    if x is None:
        return ""
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return str(int(x))
    return str(round(float(x), 4))


def format_results_csv(rows: Iterable[Row]) -> str:
    """CSV text in the paper's schema: header, ``round(x, 4)`` then ``str``, empty cells for None,
    ``\\n`` line ends (SPEC §7.6)."""
    lines = [",".join(CSV_COLUMNS)]
    for r in rows:
        lines.append(",".join([str(r.seed), r.table, r.method] + [_fmt(getattr(r, c)) for c in CSV_COLUMNS[3:]]))
    return "\n".join(lines) + "\n"


def write_results_csv(path: str | os.PathLike, rows: Sequence[Row]) -> None:
    """Writes ``results_table.csv`` atomically (SPEC §7.6)."""
    atomic_write_text(path, format_results_csv(rows))


def read_results_csv(path: str | os.PathLike) -> list[Row]:
    """Reads a results table (ours or the paper's) into rows; empty cells -> None."""
    out = []
    # = open(path, newline="", encoding="utf-8"); epath.Path.open takes no ``newline``
    with io.StringIO(as_path(path).read_bytes().decode("utf-8"), newline="") as f:
        for d in csv.DictReader(f):
            if tuple(d) != CSV_COLUMNS:
                raise ValueError(f"{path}: columns {tuple(d)} != {CSV_COLUMNS}")
            num = {c: (float(d[c]) if d[c] != "" else None) for c in ("value", "lo", "hi", "chance", "ceiling")}
            out.append(Row(d["seed"], d["table"], d["method"], n=int(d["n"]) if d["n"] else None, **num))
    return out


def read_ground_truth(path: str | os.PathLike) -> list[dict]:
    """Events of ``ground_truth.jsonl`` (SPEC §6.1, §7.2); blank lines ignored.

    Raises:
        ValueError: invalid JSON, a missing ``rollout_id``/``step`` key, or a duplicate id
            (naming the file and line).
    """
    events, seen = [], set()
    for lineno, ev in iter_jsonl(path):
        if "rollout_id" not in ev or "step" not in ev:
            raise ValueError(f"{path}:{lineno}: missing rollout_id/step in {ev}")
        if ev["rollout_id"] in seen:
            raise ValueError(f"{path}:{lineno}: duplicate rollout_id {ev['rollout_id']!r}")
        seen.add(ev["rollout_id"])
        events.append(ev)
    return events


def paper_rollout_ids(n_rollouts: int, per_step: int = 16) -> tuple[list[str], np.ndarray]:
    """Ids ``grpo_{step:06d}_{index:03d}`` in log order and their steps (SPEC §2.3, §7.1)."""
    if n_rollouts <= 0 or n_rollouts % per_step:
        raise ValueError(f"n_rollouts={n_rollouts} is not a positive multiple of {per_step}")
    steps = np.repeat(np.arange(n_rollouts // per_step), per_step)
    return [f"grpo_{s:06d}_{i:03d}" for s in range(n_rollouts // per_step) for i in range(per_step)], steps


# --------------------------------------------------------------------------------------------
# step level (SPEC §6.2-§6.6)
# --------------------------------------------------------------------------------------------
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


def _ids_index(rollout_ids: Sequence[str]) -> dict[str, int]:
    index = {r: i for i, r in enumerate(rollout_ids)}
    if len(index) != len(rollout_ids):
        raise ValueError("rollout_ids contains duplicates")
    return index


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
    gt = _gt_mask(gt_ids, _ids_index(rollout_ids))
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


def scores_in_log_order(method: str, scores, rollout_ids: Sequence[str],
                        index: Mapping[str, int] | None = None) -> np.ndarray:
    """A method's scores as float64 [N] in log order.

    Accepts an array [N] (already in log order), a mapping {rollout_id: score}, or a list of
    ``[rollout_id, score]`` pairs (the score-file format, §7.1).

    Raises:
        ValueError: wrong length, unknown or missing rollout ids, NaN scores (naming the method).
    """
    index = index or _ids_index(rollout_ids)
    if isinstance(scores, Mapping) or (isinstance(scores, list) and scores and isinstance(scores[0], (list, tuple))):
        pairs = scores.items() if isinstance(scores, Mapping) else scores
        out = np.full(len(rollout_ids), np.nan)
        seen = np.zeros(len(rollout_ids), bool)
        for rid, s in pairs:
            if rid not in index:
                raise ValueError(f"method {method!r}: unknown rollout id {rid!r}")
            out[index[rid]] = float(s)
            seen[index[rid]] = True
        if not seen.all():
            raise ValueError(f"method {method!r}: no score for rollout {rollout_ids[int(np.flatnonzero(~seen)[0])]!r}")
    else:
        out = np.asarray(scores, dtype=np.float64)
        if out.shape != (len(rollout_ids),):
            raise ValueError(f"method {method!r}: scores shape {out.shape} != ({len(rollout_ids)},)")
    if np.isnan(out).any():
        first = rollout_ids[int(np.flatnonzero(np.isnan(out))[0])]
        raise ValueError(f"method {method!r}: NaN score for rollout {first!r}")
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
    index = _ids_index(rollout_ids)
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
    gt = _gt_mask(gt_ids, _ids_index(rollout_ids))
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
      n = pairs; lo/hi from a cluster bootstrap over steps when ``nboot`` > 0 (one
      ``default_rng(rng_seed)`` shared across methods in order). Step-level scores get 0.5 here.
    """
    p = which_rollout_population(rollout_ids, rollout_steps, gt_ids, advantages=advantages,
                                 nonzero_steps=nonzero_steps, step_norms=step_norms, early_cutoff=early_cutoff)
    index = _ids_index(rollout_ids)
    gt = _gt_mask(gt_ids, index)
    steps = np.asarray(rollout_steps, dtype=np.int64)
    rng = np.random.default_rng(rng_seed)
    prec, auc = [], []
    for m, s in method_scores.items():
        s = scores_in_log_order(m, s, rollout_ids, index)
        prec.append(Row(str(seed), "which_rollout", m, metrics.precision_at_k_fractional(s[p.mask], gt[p.mask], p.k),
                        chance=p.chance, ceiling=1.0, n=p.n))
        gp = metrics.group_pairs(steps[p.mask], gt[p.mask], s[p.mask])
        lo = hi = None
        if nboot > 0 and gp.n_pairs:
            lo, hi = metrics.cluster_bootstrap(gp, rng, nboot)
        auc.append(Row(str(seed), "which_rollout_within_step", m, gp.auc, lo, hi, 0.5, 1.0, gp.n_pairs))
    return prec + auc


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


# --------------------------------------------------------------------------------------------
# rollout level (SPEC §6.7-§6.10)
# --------------------------------------------------------------------------------------------
def validate_mp_rows(rows: Sequence[Mapping], columns: Iterable[str], source: str = "rows") -> None:
    """Checks minimal-pair rows (§7.3): non-empty, every row has group/has_qzxbt/fluency and the
    score ``columns``, numeric and not NaN. Raises ValueError naming the row and key."""
    if not rows:
        raise ValueError(f"{source}: no rows (empty group list)")
    need = list(ROW_FIELDS) + [c for c in columns if c not in ROW_FIELDS]
    for i, r in enumerate(rows):
        for key in need:
            if key not in r:
                raise ValueError(f"{source}: row {i} has no key {key!r}")
            v = r[key]
            if key == "has_qzxbt":
                if not isinstance(v, (bool, np.bool_)):
                    raise ValueError(f"{source}: row {i} has_qzxbt={v!r} is not a bool")
            elif (not isinstance(v, (int, float, np.number)) or isinstance(v, bool)
                  or (key != "group" and math.isnan(v))):
                raise ValueError(f"{source}: row {i} {key}={v!r} is not a finite number")


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


def read_mp_rows(path: str | os.PathLike) -> tuple[dict, list[dict]]:
    """Reads ``minimal_pair_rows_ckpt{C}_gen{G}.json`` (§7.3) -> (header without rows, rows).

    Raises:
        ValueError: not an object with ``rows``, or ``n`` != len(rows).
    """
    d = read_json(path)
    if not isinstance(d, dict) or not isinstance(d.get("rows"), list):
        raise ValueError(f"{path}: expected an object with a 'rows' list")
    rows = d.pop("rows")
    if "n" in d and d["n"] != len(rows):
        raise ValueError(f"{path}: n={d['n']} but {len(rows)} rows")
    return d, rows


# --------------------------------------------------------------------------------------------
# attribution_scores.json (SPEC §7.1)
# --------------------------------------------------------------------------------------------
@dataclass
class ScoreFile:
    """Contents of an ``attribution_scores.json``: header, ids/steps in log order, scores [N]."""

    header: dict
    rollout_ids: list[str]
    rollout_steps: np.ndarray
    method_scores: dict[str, np.ndarray]


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
    index = _ids_index(rollout_ids)
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


def write_attribution_scores(path: str | os.PathLike, header: Mapping, rollout_ids: Sequence[str],
                             rollout_steps, method_scores: Mapping[str, object]) -> None:
    """Writes ``attribution_scores.json`` in the paper's format (§7.1), atomically.

    One line by ``json.dump`` with default separators; keys ``run_name … nonzero_steps`` (from
    ``header``, in §7.1 order), ``rollout_steps`` {id: step} in log order, ``methods`` {method:
    [[id, score], …] in log order}; ``-inf`` is written as ``-Infinity``.

    Raises:
        ValueError: a missing header key, NaN scores, length mismatch.
    """
    missing = [k for k in SCORE_FILE_KEYS if k not in header]
    if missing:
        raise ValueError(f"score-file header lacks {missing}")
    steps = np.asarray(rollout_steps, dtype=np.int64)
    if steps.shape != (len(rollout_ids),):
        raise ValueError(f"rollout_steps shape {steps.shape} != ({len(rollout_ids)},)")
    index = _ids_index(rollout_ids)
    methods = {m: scores_in_log_order(m, s, rollout_ids, index) for m, s in method_scores.items()}
    obj = {k: header[k] for k in SCORE_FILE_KEYS}
    obj["rollout_steps"] = dict(zip(rollout_ids, steps.tolist()))
    obj["methods"] = {m: [[r, float(x)] for r, x in zip(rollout_ids, s.tolist())] for m, s in methods.items()}
    atomic_write_text(path, json.dumps(obj))


def read_attribution_scores(path: str | os.PathLike) -> ScoreFile:
    """Reads an ``attribution_scores.json`` (the paper's harness's or ours; §7.1).

    Raises:
        ValueError: missing keys, unknown/missing rollout ids or NaN in a method (naming it).
    """
    d = read_json(path)
    for key in ("rollout_steps", "methods"):
        if key not in d:
            raise ValueError(f"{path}: missing key {key!r}")
    ids = list(d["rollout_steps"])
    steps = np.array([int(d["rollout_steps"][r]) for r in ids], dtype=np.int64)
    index = _ids_index(ids)
    methods = {}
    for m, pairs in d["methods"].items():
        try:
            methods[m] = scores_in_log_order(m, pairs, ids, index)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    header = {k: v for k, v in d.items() if k not in ("rollout_steps", "methods")}
    return ScoreFile(header, ids, steps, methods)


# --------------------------------------------------------------------------------------------
# decision rules (SPEC §6.11) and checklist (SPEC §8)
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    """One decision rule or checklist item, evaluated.

    ``item`` is the human text (``rule`` with its ``subject`` and ``method`` filled in), ``status``
    is "pass", "fail" or "not-evaluable". ``rule`` / ``subject`` / ``method`` say what was checked
    where, for code that groups verdicts (``stages/sweep.py``): e.g. rule "rollout rule", subject
    "0_gen100_diag" (a seed or draw label; "" when the item is global), method "GAS_centered".
    verdicts.json holds :meth:`to_dict` (item, verdict, evidence).
    """

    item: str
    status: str
    evidence: str
    rule: str = ""
    subject: str = ""
    method: str = ""

    def to_dict(self) -> dict[str, str]:
        """The verdicts.json form: ``{"item", "verdict", "evidence"}``."""
        return {"item": self.item, "verdict": self.status, "evidence": self.evidence}

    @classmethod
    def from_dict(cls, d: Mapping[str, str]) -> "Verdict":
        """Reads :meth:`to_dict`'s form back (``rule`` = ``item``; subject and method are not stored)."""
        return cls(d["item"], d["verdict"], d["evidence"], rule=d["item"])

    @property
    def family(self) -> str:
        """``rule`` plus `` [method]`` when per method: verdicts of one family differ only in subject."""
        return f"{self.rule} [{self.method}]" if self.method else self.rule


def verdict(item: str, ok: bool | None, evidence: str, *, rule: str = "", subject: str = "",
            method: str = "") -> Verdict:
    """A :class:`Verdict`: status pass / fail, or not-evaluable when ``ok`` is None."""
    return Verdict(item, "not-evaluable" if ok is None else ("pass" if ok else "fail"), evidence,
                   rule=rule or item, subject=subject, method=method)


def verdicts_json(rules: Sequence[Verdict], checklist: Sequence[Verdict]) -> dict:
    """The content of verdicts.json."""
    return {"decision_rules": [v.to_dict() for v in rules], "checklist": [v.to_dict() for v in checklist]}


def _index(rows: Iterable[Row]) -> dict[tuple[str, str, str], Row]:
    return {(r.seed, r.table, r.method): r for r in rows}


def _role(method: str) -> str | None:
    """The registered role of ``method`` (of its base estimator for a ``:direction`` variant)."""
    est = estimators.ESTIMATORS.get(estimators.base_method(method))
    return est.role if est else None


def _same_kind(control: str, method: str) -> str:
    """The control of ``method``'s sketch kind: ``control`` + ``:direction`` for a direction variant."""
    return control + estimators.DIRECTION if estimators.is_direction(method) else control


def _draws(rows: Iterable[Row]) -> list[tuple[str, str]]:
    """(seed label, suffix) of every rollout-level draw with a residualised table, in row order."""
    out = []
    for r in rows:
        if r.table.startswith("mp_residualized") and (r.seed, r.table[len("mp_residualized"):]) not in out:
            out.append((r.seed, r.table[len("mp_residualized"):]))
    return out


def _f(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"


def decision_rules(rows: Sequence[Row], *, step_margin: float = 0.10, max_ci_width: float = 0.15,
                   min_matched_pairs: int = 100, token_sign_min: float = 0.05,
                   fluency_band: tuple[float, float] = (0.35, 0.65)) -> list[Verdict]:
    """The pre-registered decision rules (SPEC §6.11) evaluated on ``rows``.

    * step rule per seed: best primary estimator (C1-dot, C1-cosine, TRAK, plug-ins) minus
      norm-only > step_margin in ``early_nonzero`` (the evidence also compares it with the
      reward-only step controls, which the rule does not require it to beat);
    * which-rollout rule per seed and sketch kind (weighted; direction when present): the best
      primary estimator's ``which_rollout`` P@|GT| minus max(norm-only of the same kind,
      abs-advantage) > step_margin: an estimator "finds which rollout" only if it beats the
      magnitude control and the reward-only |A_i| ranker (the evidence names what the signed
      advantage and the reward reach);
    * rollout rule per draw and primary rollout estimator: residualised CI lo > 0.5, point >
      norm_only's residualised point, CI width ≤ max_ci_width, matched AUC > 0.5 when it has
      ≥ min_matched_pairs pairs;
    * beats fluency per draw and method: CI lo > 0.5 and AUC > raw fluency AUC;
    * fluency confound: raw fluency AUC inside ``fluency_band``;
    * C5: some raw gradient AUC (GAS, C1_plain, norm_only) ≥ raw fluency AUC;
    * C6 stability: GAS_centered vs norm_only residualised order is the same in every draw;
    * token-level sign per seed: mean vs_ctx > token_sign_min.
    """
    idx = _index(rows)
    out = _step_rules(rows, idx, step_margin) + _which_rollout_rules(rows, idx, step_margin)
    draws = _draws(rows)
    for seed, sfx in draws:
        flu = idx.get((seed, "mp_raw" + sfx, "fluency"))
        prim = [r for r in rows
                if r.seed == seed and r.table == "mp_residualized" + sfx and _role(r.method) == "primary"]
        for r in prim:
            res_norm = idx.get((seed, "mp_residualized" + sfx, _same_kind(estimators.ROLLOUT_NORM_CONTROL, r.method)))
            tag = f"({seed}{sfx}, {r.method})"
            kw = dict(subject=f"{seed}{sfx}", method=r.method)
            if r.lo is None or res_norm is None or math.isnan(r.value):
                out.append(verdict(f"rollout rule {tag}", None, "needs a residualised CI and norm_only",
                                   rule="rollout rule", **kw))
            else:
                width = r.hi - r.lo
                m = idx.get((seed, "mp_matched" + sfx, r.method))
                checks = [f"lo {_f(r.lo)} > 0.5: {r.lo > 0.5}",
                          f"AUC {_f(r.value)} > norm_only {_f(res_norm.value)}: {r.value > res_norm.value}",
                          f"width {width:.4f} ≤ {max_ci_width}: {width <= max_ci_width}"
                          + ("" if width <= max_ci_width else " (inconclusive; one re-run allowed)")]
                ok = r.lo > 0.5 and r.value > res_norm.value and width <= max_ci_width
                if m is not None and m.n is not None and m.n >= min_matched_pairs:
                    checks.append(f"matched {_f(m.value)} > 0.5 ({m.n} pairs): {m.value > 0.5}")
                    ok = ok and m.value > 0.5
                else:
                    checks.append(f"matched AUC does not count ({m.n if m else 0} < {min_matched_pairs} pairs)")
                out.append(verdict(f"rollout rule {tag}", ok, "; ".join(checks), rule="rollout rule", **kw))
            if flu is not None and r.lo is not None:
                out.append(verdict(f"beats fluency {tag}", r.lo > 0.5 and r.value > flu.value,
                                   f"lo {_f(r.lo)}, AUC {_f(r.value)} vs raw fluency {_f(flu.value)}",
                                   rule="beats fluency", **kw))
        if flu is not None:
            lo_b, hi_b = fluency_band
            inside = lo_b <= flu.value <= hi_b
            out.append(verdict(f"fluency confound absent ({seed}{sfx})", inside,
                               f"raw fluency AUC {_f(flu.value)} {'inside' if inside else 'outside'} [{lo_b}, {hi_b}]",
                               rule="fluency confound absent", subject=f"{seed}{sfx}"))
            raw = [idx.get((seed, "mp_raw" + sfx, m)) for m in ("GAS_centered", "C1_plain", "norm_only")]
            raw = [x for x in raw if x is not None]
            if raw:
                best = max(raw, key=lambda x: x.value)
                out.append(verdict(f"C5: a raw gradient AUC ≥ raw fluency ({seed}{sfx})", best.value >= flu.value,
                                   f"max raw gradient {best.method} {_f(best.value)} vs fluency {_f(flu.value)}",
                                   rule="C5: a raw gradient AUC ≥ raw fluency", subject=f"{seed}{sfx}"))
    order = []
    for seed, sfx in draws:
        gas = idx.get((seed, "mp_residualized" + sfx, "GAS_centered"))
        norm = idx.get((seed, "mp_residualized" + sfx, estimators.ROLLOUT_NORM_CONTROL))
        if gas is not None and norm is not None:
            order.append((f"{seed}{sfx}", gas.value > norm.value, gas.value, norm.value))
    if len(order) >= 2:
        stable = len({o[1] for o in order}) == 1
        out.append(verdict("C6: GAS_centered vs norm_only order stable across draws", stable,
                           "; ".join(f"{d}: GAS {_f(g)} {'>' if b else '≤'} norm {_f(n)}" for d, b, g, n in order)))
    else:
        out.append(verdict("C6: GAS_centered vs norm_only order stable across draws", None,
                           f"needs ≥ 2 draws with residualised rows, have {len(order)}"))
    for r in rows:
        if r.table.startswith("token_level") and r.method == "vs_ctx":
            out.append(verdict(f"token-level sign ok (seed {r.seed}, {r.table})", r.value > token_sign_min,
                               f"mean vs_ctx {_f(r.value)} vs {token_sign_min} (n={r.n})",
                               rule="token-level sign ok", subject=f"seed {r.seed}", method=r.table))
    return out


def _step_rules(rows: Sequence[Row], idx: Mapping[tuple[str, str, str], Row], margin: float) -> list[Verdict]:
    """The step rule of every seed with ``early_nonzero`` rows (see :func:`decision_rules`)."""
    out = []
    for seed in dict.fromkeys(r.seed for r in rows if r.table == "early_nonzero"):
        prim = [r for r in rows if r.seed == seed and r.table == "early_nonzero" and _role(r.method) == "primary"]
        norm = idx.get((seed, "early_nonzero", estimators.STEP_NORM_CONTROL))
        item = f"step rule (seed {seed}): best targeted P@|GT| − norm-only > {margin}"
        kw = dict(rule=f"step rule: best targeted P@|GT| − norm-only > {margin}", subject=f"seed {seed}")
        if not prim or norm is None:
            have = [r.method for r in rows if r.seed == seed and r.table == "early_nonzero"]
            out.append(verdict(item, None, f"needs a primary method and norm-only in early_nonzero; have {have}", **kw))
            continue
        best = max(prim, key=lambda r: r.value)
        gap = best.value - norm.value
        controls = [idx[(seed, "early_nonzero", m)] for m in estimators.REWARD_ONLY_STEP_CONTROLS
                    if (seed, "early_nonzero", m) in idx]
        note = ("; reward-only step controls (not part of the rule): "
                + ", ".join(f"{c.method} {_f(c.value)} (best targeted {best.value - c.value:+.4f})" for c in controls)
                if controls else "")
        out.append(verdict(item, gap > margin, f"best {best.method} {_f(best.value)} − norm-only "
                                               f"{_f(norm.value)} = {gap:+.4f}{note}", **kw))
    return out


def _which_rollout_rules(rows: Sequence[Row], idx: Mapping[tuple[str, str, str], Row],
                         margin: float) -> list[Verdict]:
    """The which-rollout rule of every seed with ``which_rollout`` rows, per sketch kind (weighted,
    and direction when its rows are present; see :func:`decision_rules`)."""
    out = []
    rule = f"which-rollout rule: best targeted P@|GT| − max(norm-only, |A|) > {margin}"
    for seed in dict.fromkeys(r.seed for r in rows if r.table == "which_rollout"):
        sel = [r for r in rows if r.seed == seed and r.table == "which_rollout"]
        for kind in ("weighted", "direction"):
            direction = kind == "direction"
            prim = [r for r in sel if _role(r.method) == "primary" and estimators.is_direction(r.method) == direction]
            if direction and not prim:
                continue
            norm_name = estimators.STEP_NORM_CONTROL + (estimators.DIRECTION if direction else "")
            norm, absa = idx.get((seed, "which_rollout", norm_name)), idx.get((seed, "which_rollout",
                                                                              estimators.ABS_ADVANTAGE_CONTROL))
            item = f"which-rollout rule (seed {seed}, {kind}): best targeted P@|GT| − max(norm-only, |A|) > {margin}"
            kw = dict(rule=rule, subject=f"seed {seed}", method=kind)
            if not prim or norm is None or absa is None:
                out.append(verdict(item, None, f"needs a primary method, {norm_name} and "
                                               f"{estimators.ABS_ADVANTAGE_CONTROL} in which_rollout; have "
                                               f"{[r.method for r in sel]}", **kw))
                continue
            best = max(prim, key=lambda r: r.value)
            gap = best.value - max(norm.value, absa.value)
            log = [idx[(seed, "which_rollout", m)] for m in ("advantage", "reward")
                   if (seed, "which_rollout", m) in idx]
            note = ("; the training log alone: " + ", ".join(f"{r.method} {_f(r.value)}" for r in log)
                    + f" (ceiling 1.0, chance {_f(best.chance)})") if log else ""
            out.append(verdict(item, gap > margin, f"best {best.method} {_f(best.value)} − max({norm_name} "
                                                   f"{_f(norm.value)}, {absa.method} {_f(absa.value)}) = "
                                                   f"{gap:+.4f}{note}", **kw))
    return out


def checklist(rows: Sequence[Row], *, gt_sizes: Mapping[str, int] | None = None,
              gt_in_zero_step: Mapping[str, int] | None = None, row_files: Sequence[str] | None = None,
              preregistered: Mapping[str, float] | None = None, max_ci_width: float = 0.15,
              min_matched_pairs: int = 100, token_sign_min: float = 0.05) -> list[Verdict]:
    """The SPEC §8 evaluation checklist as machine-checked verdicts (12 items, in order).

    Args:
        rows: every row of the evaluation (step, which-rollout, rollout-level, token-level).
        gt_sizes: {seed: |GT|}; gt_in_zero_step: {seed: count} (score-file header fields).
        row_files: names of the per-rollout files saved (rows files, score files).
        preregistered: the decision thresholds fixed in the config before the run.
    Returns:
        list of {item, verdict, evidence}; an item with no evidence in the inputs is not-evaluable.
    """
    step_rows = [r for r in rows if r.table in STEP_TABLES]
    roll_rows = [r for r in rows if r.table.startswith("mp_")]
    valid_roll = [r for r in roll_rows if not math.isnan(r.value) and (r.n or 0) > 0]
    draws = _draws(rows)
    has = {(r.seed, r.table, r.method) for r in rows}
    out = []

    item = "1 known ground truth"
    out.append(verdict(item, all(v > 0 for v in gt_sizes.values()),
                       ", ".join(f"seed {s}: |GT| = {v}" for s, v in gt_sizes.items()))
               if gt_sizes else verdict(item, None, "no ground-truth sizes given"))

    item = "2 faithful embedding (every GT step has a nonzero sketch)"
    out.append(verdict(item, all(v == 0 for v in gt_in_zero_step.values()),
                       ", ".join(f"seed {s}: {v} GT rollouts in zero-sketch steps" for s, v in gt_in_zero_step.items()))
               if gt_in_zero_step else verdict(item, None, "no sketch norms given"))

    with_ctrl, without = [], []
    which_rows = [r for r in rows if r.table == "which_rollout"]
    targeted = dict.fromkeys((r.seed, r.table, estimators.is_direction(r.method))
                             for r in step_rows + roll_rows + which_rows if _role(r.method) == "primary")
    for seed, table, direction in targeted:
        ctrl = estimators.ROLLOUT_NORM_CONTROL if table.startswith("mp_") else estimators.STEP_NORM_CONTROL
        need = [ctrl + (estimators.DIRECTION if direction else "")]
        if table == "which_rollout":  # at rollout resolution the reward-only |A_i| ranker is a control too
            need.append(estimators.ABS_ADVANTAGE_CONTROL)
        name = f"{seed}/{table}" + (estimators.DIRECTION if direction else "")
        (with_ctrl if all((seed, table, c) in has for c in need) else without).append(name)
    out.append(verdict("3 gradient-magnitude control reported next to every targeted method",
                       not without if (with_ctrl or without) else None,
                       f"with norm control{' (and |A| in which_rollout)' if which_rows else ''}: "
                       f"{with_ctrl or 'none'}; without: {without or 'none'}"))

    seeds_overall = sorted({r.seed for r in step_rows if r.table == "overall"})
    seeds_early = sorted({r.seed for r in step_rows if r.table == "early_nonzero"})
    out.append(verdict("4 nonzero early-window table reported (and overall separately)",
                       bool(seeds_early) and set(seeds_overall) <= set(seeds_early) if step_rows else None,
                       f"overall seeds {seeds_overall}, early_nonzero seeds {seeds_early}"))

    item = "5 tie-aware P@|GT| with chance, ceiling and headroom"
    if step_rows:
        ok = all(r.chance is not None and r.ceiling is not None and r.ceiling > r.chance for r in step_rows)
        heads = {(r.seed, r.table): r.ceiling - r.chance for r in step_rows
                 if r.chance is not None and r.ceiling is not None}
        out.append(verdict(item, ok, "; ".join(f"{s}/{t}: headroom {h:.4f}" for (s, t), h in heads.items())))
    else:
        out.append(verdict(item, None, "no step-level rows"))

    item = "6 fluency baseline, residualised and matched AUC"
    parts, ok = [], True
    for seed, sfx in draws:
        raw = (seed, "mp_raw" + sfx, "fluency") in has
        pairs = [r.n or 0 for r in rows if r.seed == seed and r.table == "mp_matched" + sfx]
        ok = ok and raw and bool(pairs)
        note = "no" if not pairs else f"{max(pairs)} pairs" + ("" if max(pairs) >= min_matched_pairs
                                                                else f" (< {min_matched_pairs}, does not count)")
        parts.append(f"{seed}{sfx}: fluency raw {'yes' if raw else 'no'}, residualised yes, matched {note}")
    out.append(verdict(item, ok if draws else None, "; ".join(parts) or "no rollout-level draws"))

    gas = [r for r in roll_rows if r.method == "GAS_centered"]
    out.append(verdict("7 within-group (same prompt draw) comparison, group-centred gradients",
                       bool(gas) and len(valid_roll) > 0 if roll_rows else None,
                       ", ".join(f"{r.seed}/{r.table}: {r.n} within-group pairs" for r in gas)
                       or "no GAS_centered rows"))

    train_seeds = sorted({r.seed for r in step_rows} | {s for s, _ in draws if "_gen" not in s})
    diag = sorted({s for s, _ in draws if "_gen" in s})
    out.append(verdict("8 ≥ 3 training seeds and swapped ckpt/gen diagnostic draws",
                       len(train_seeds) >= 3 and len(diag) >= 1 if (train_seeds or diag) else None,
                       f"training seeds {train_seeds}; diagnostic draws {diag}"))

    item = "9 cluster-bootstrap CIs with widths reported"
    if roll_rows:
        with_ci = [r for r in valid_roll if r.lo is not None]
        wide = [f"{r.seed}/{r.table}/{r.method} {r.hi - r.lo:.3f}" for r in with_ci if r.hi - r.lo > max_ci_width]
        out.append(verdict(item, len(with_ci) == len(valid_roll),
                           f"{len(with_ci)}/{len(valid_roll)} rows with CIs; "
                           f"wider than {max_ci_width}: {wide or 'none'}"))
    else:
        out.append(verdict(item, None, "no rollout-level rows"))

    tok = [r for r in rows if r.table.startswith("token_level") and r.method == "vs_ctx"]
    out.append(verdict(f"10 token-level sign check (mean vs_ctx > {token_sign_min})",
                       all(r.value > token_sign_min for r in tok) if tok else None,
                       ", ".join(f"seed {r.seed}: {_f(r.value)}" for r in tok) or "no token-level rows"))

    item = "11 per-rollout rows saved with seeds in file names"
    if row_files is None:
        out.append(verdict(item, None, "no file list given"))
    else:
        names = [os.path.basename(f) for f in row_files]
        found = [m for m in map(re.compile(r"minimal_pair_rows_ckpt(\d+)_gen(\d+)\.json$").match, names) if m]
        labels = {f"{m.group(1)}_gen{m.group(2)}" if m.group(1) != m.group(2) else m.group(1) for m in found}
        missing = sorted({s for s, _ in draws} - labels)
        out.append(verdict(item, not missing and bool(names),
                           f"files {names}; draws without a rows file: {missing or 'none'}"))

    keys = ("step_margin", "max_ci_width", "min_matched_pairs")
    out.append(verdict("12 decision rules pre-registered (thresholds fixed in the config)",
                       all(k in preregistered for k in keys) if preregistered is not None else None,
                       ", ".join(f"{k} = {preregistered.get(k, 'MISSING')}" for k in keys)
                       if preregistered is not None else "none given"))
    return out
