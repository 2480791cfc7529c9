"""The evaluation's verdicts: the pre-registered decision rules (SPEC §6.11) and the checklist
(SPEC §8), each item ``{item, verdict, evidence}`` with verdict ∈ {pass, fail, not-evaluable}.

* :func:`decision_rules`: the step rule, the which-rollout rule (beat norm-only and every control
  that reads the training log alone: |A_i|, the reward, the text and length controls), the rollout
  rule, fluency, C5, C6 and the token-level sign;
* :func:`answered_by_log`: the tables where such a log control reaches
  ``estimators.ANSWERED_FRACTION`` (0.95) of the ceiling, "answered by the log" (the verdicts'
  evidence, the report and the console say so);
* :func:`checklist`: the 12 items of SPEC §8;
* :class:`Verdict` and :func:`verdicts_json`, the content of verdicts.json.

Both read :class:`formats.Row` lists (``tables.py``'s tables), the paper's or ours.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from behaviortrace_jax.attribution import estimators
from behaviortrace_jax.attribution.formats import Row
from behaviortrace_jax.attribution.tables import STEP_TABLES
from behaviortrace_jax.io.layout import parse_rows_filename


@dataclass(frozen=True)
class EvalOptions:
    """The evaluation's pre-registered settings (``config.evaluation``; SPEC §4, §6), built at the
    stage boundary (``stages/spec.py``, ``RunSpec.evaluation``).

    Fields: ``early_cutoff`` (SPEC §6.6 EARLY_CUTOFF, steps), ``trak_damping`` (SPEC §4),
    ``tracin_lr`` (SPEC §4 eta), ``local_buffer_window`` (steps), ``nboot`` (bootstrap resamples,
    SPEC §6.10), ``fluency_match_delta`` / ``min_matched_pairs`` (SPEC §6.9), ``step_margin`` /
    ``max_ci_width`` (the decision rules' thresholds, SPEC §6.11), ``top_blamed`` (the report's
    top-blamed rollouts per method).
    """

    early_cutoff: int = 200
    trak_damping: float = 0.1
    tracin_lr: float = 5e-6
    local_buffer_window: int = 100
    nboot: int = 600
    fluency_match_delta: float = 0.10
    min_matched_pairs: int = 100
    step_margin: float = 0.10
    top_blamed: int = 10
    max_ci_width: float = 0.15


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


def answered_by_log(rows: Iterable[Row], fraction: float = estimators.ANSWERED_FRACTION
                    ) -> dict[tuple[str, str], list[Row]]:
    """The tables "answered by the log": {(seed, table): the rows of log controls
    (``estimators.log_control``: advantage, abs-advantage, reward, step-sum-abs-advantage,
    step-reward-std, pattern-match, length, step-sum-pattern-match, step-sum-length, plug-ins) whose
    value reaches ``fraction`` x their ceiling}, best first, for the tables where some do; a row
    without a ceiling, or with a ceiling <= 0, never does. There the label the table scores is
    recovered from the training log alone (rewards, advantages, the completion's text or length),
    so a targeted method's value there says little about attribution (docs/concepts/replays.md)."""
    out: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        if (estimators.log_control(r.method) and r.ceiling is not None and r.ceiling > 0
                and not math.isnan(r.value) and r.value >= fraction * r.ceiling):
            out.setdefault((r.seed, r.table), []).append(r)
    return {k: sorted(v, key=lambda r: -r.value / r.ceiling) for k, v in out.items()}


def answered_note(hits: Sequence[Row] | None, fraction: float = estimators.ANSWERED_FRACTION) -> str:
    """The evidence note of a table :func:`answered_by_log` names ("" when ``hits`` is empty), every
    hit best first: ``"; answered by the log: pattern-match 1.0000, reward 0.9600 ≥ 0.95 × ceiling 1.0000"``."""
    if not hits:
        return ""
    names = ", ".join(f"{r.method} {_f(r.value)}" for r in hits)
    return f"; answered by the log: {names} ≥ {fraction:g} × ceiling {_f(hits[0].ceiling)}"


def decision_rules(rows: Sequence[Row], *, step_margin: float = 0.10, max_ci_width: float = 0.15,
                   min_matched_pairs: int = 100, token_sign_min: float = 0.05,
                   fluency_band: tuple[float, float] = (0.35, 0.65)) -> list[Verdict]:
    """The pre-registered decision rules (SPEC §6.11) evaluated on ``rows``.

    * step rule per seed: best primary estimator (C1-dot, C1-cosine, TRAK, plug-ins) minus
      norm-only > step_margin in ``early_nonzero`` (the evidence also compares it with the
      reward-only and text/length step controls, which the rule does not require it to beat);
    * which-rollout rule per seed and sketch kind (weighted; direction when present): the best
      primary estimator's ``which_rollout`` P@|GT| minus max(norm-only of the same kind, every log
      control present: abs-advantage (required), advantage, reward, the reward-only step controls,
      pattern-match, length and their step sums) > step_margin: an estimator "finds which rollout"
      only if it beats the magnitude control and everything the training log alone reveals (the
      evidence shows norm-only, abs-advantage and the best control);
    * both rules' evidence ends with "answered by the log" where :func:`answered_by_log` names their
      table;
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
        out += _draw_rules(rows, idx, seed, sfx, max_ci_width=max_ci_width, min_matched_pairs=min_matched_pairs,
                           fluency_band=fluency_band)
    out.append(_stability_rule(idx, draws))
    for r in rows:
        if r.table.startswith("token_level") and r.method == "vs_ctx":
            out.append(verdict(f"token-level sign ok (seed {r.seed}, {r.table})", r.value > token_sign_min,
                               f"mean vs_ctx {_f(r.value)} vs {token_sign_min} (n={r.n})",
                               rule="token-level sign ok", subject=f"seed {r.seed}", method=r.table))
    return out


def _rollout_rule(r: Row, idx: Mapping[tuple[str, str, str], Row], sfx: str, *, max_ci_width: float,
                  min_matched_pairs: int) -> Verdict:
    """The rollout rule of one residualised primary row ``r`` of draw ``(r.seed, sfx)`` (see
    :func:`decision_rules`)."""
    seed = r.seed
    res_norm = idx.get((seed, "mp_residualized" + sfx, _same_kind(estimators.ROLLOUT_NORM_CONTROL, r.method)))
    item, kw = f"rollout rule ({seed}{sfx}, {r.method})", dict(rule="rollout rule", subject=f"{seed}{sfx}",
                                                               method=r.method)
    if r.lo is None or res_norm is None or math.isnan(r.value):
        return verdict(item, None, "needs a residualised CI and norm_only", **kw)
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
    return verdict(item, ok, "; ".join(checks), **kw)


def _draw_rules(rows: Sequence[Row], idx: Mapping[tuple[str, str, str], Row], seed: str, sfx: str, *,
                max_ci_width: float, min_matched_pairs: int, fluency_band: tuple[float, float]) -> list[Verdict]:
    """The rollout rule and "beats fluency" of every primary method of draw ``(seed, sfx)``, then its
    fluency-confound and C5 verdicts (see :func:`decision_rules`)."""
    out = []
    flu = idx.get((seed, "mp_raw" + sfx, "fluency"))
    prim = [r for r in rows if r.seed == seed and r.table == "mp_residualized" + sfx and _role(r.method) == "primary"]
    for r in prim:
        out.append(_rollout_rule(r, idx, sfx, max_ci_width=max_ci_width, min_matched_pairs=min_matched_pairs))
        if flu is not None and r.lo is not None:
            out.append(verdict(f"beats fluency ({seed}{sfx}, {r.method})", r.lo > 0.5 and r.value > flu.value,
                               f"lo {_f(r.lo)}, AUC {_f(r.value)} vs raw fluency {_f(flu.value)}",
                               rule="beats fluency", subject=f"{seed}{sfx}", method=r.method))
    if flu is None:
        return out
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
    return out


def _stability_rule(idx: Mapping[tuple[str, str, str], Row], draws: Sequence[tuple[str, str]]) -> Verdict:
    """C6: GAS_centered vs norm_only residualised order is the same in every draw (≥ 2 needed)."""
    item = "C6: GAS_centered vs norm_only order stable across draws"
    order = []
    for seed, sfx in draws:
        gas = idx.get((seed, "mp_residualized" + sfx, "GAS_centered"))
        norm = idx.get((seed, "mp_residualized" + sfx, estimators.ROLLOUT_NORM_CONTROL))
        if gas is not None and norm is not None:
            order.append((f"{seed}{sfx}", gas.value > norm.value, gas.value, norm.value))
    if len(order) < 2:
        return verdict(item, None, f"needs ≥ 2 draws with residualised rows, have {len(order)}")
    return verdict(item, len({o[1] for o in order}) == 1,
                   "; ".join(f"{d}: GAS {_f(g)} {'>' if b else '≤'} norm {_f(n)}" for d, b, g, n in order))


def _step_rules(rows: Sequence[Row], idx: Mapping[tuple[str, str, str], Row], margin: float) -> list[Verdict]:
    """The step rule of every seed with ``early_nonzero`` rows (see :func:`decision_rules`)."""
    out, answered = [], answered_by_log(rows)
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
        controls = [idx[(seed, "early_nonzero", m)]
                    for m in estimators.REWARD_ONLY_STEP_CONTROLS + estimators.TEXT_STEP_CONTROLS
                    if (seed, "early_nonzero", m) in idx]
        note = ("; log step controls (not part of the rule): "
                + ", ".join(f"{c.method} {_f(c.value)} (best targeted {best.value - c.value:+.4f})" for c in controls)
                if controls else "")
        note += answered_note(answered.get((seed, "early_nonzero")))
        out.append(verdict(item, gap > margin, f"best {best.method} {_f(best.value)} − norm-only "
                                               f"{_f(norm.value)} = {gap:+.4f}{note}", **kw))
    return out


def _which_rollout_rules(rows: Sequence[Row], idx: Mapping[tuple[str, str, str], Row],
                         margin: float) -> list[Verdict]:
    """The which-rollout rule of every seed with ``which_rollout`` rows, per sketch kind (weighted,
    and direction when its rows are present; see :func:`decision_rules`)."""
    out, answered = [], answered_by_log(rows)
    rule = f"which-rollout rule: best targeted P@|GT| − max(norm-only, log controls) > {margin}"
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
            item = (f"which-rollout rule (seed {seed}, {kind}): best targeted P@|GT| − max(norm-only, log controls) "
                    f"> {margin}")
            kw = dict(rule=rule, subject=f"seed {seed}", method=kind)
            if not prim or norm is None or absa is None:
                out.append(verdict(item, None, f"needs a primary method, {norm_name} and "
                                               f"{estimators.ABS_ADVANTAGE_CONTROL} in which_rollout; have "
                                               f"{[r.method for r in sel]}", **kw))
                continue
            best = max(prim, key=lambda r: r.value)
            log = [r for r in sel if estimators.log_control(r.method)]  # abs-advantage among them
            top = max([norm] + log, key=lambda r: r.value)
            gap = best.value - top.value
            tops = " = ".join(r.method for r in [norm] + log if r.value == top.value)  # ties named together
            note = f" (ceiling 1.0, chance {_f(best.chance)}; best control {tops})"
            if gap <= margin:
                note += f"; no targeted estimator beats {tops} by the margin"
            note += answered_note(answered.get((seed, "which_rollout")))
            shown = [norm, absa] + ([top] if top.method not in (norm.method, absa.method) else [])
            controls = ", ".join(f"{r.method} {_f(r.value)}" for r in shown)
            out.append(verdict(item, gap > margin, f"best {best.method} {_f(best.value)} − max({controls}; "
                                                   f"over norm-only and {len(log)} log controls) = {gap:+.4f}{note}",
                               **kw))
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
    out = _ground_truth_items(gt_sizes, gt_in_zero_step)
    out.append(_control_item(rows, step_rows, roll_rows))
    out += _step_table_items(step_rows)
    out += _rollout_table_items(rows, roll_rows, valid_roll, draws, min_matched_pairs)
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
    out.append(_rows_files_item(row_files, draws))
    keys = ("step_margin", "max_ci_width", "min_matched_pairs")
    out.append(verdict("12 decision rules pre-registered (thresholds fixed in the config)",
                       all(k in preregistered for k in keys) if preregistered is not None else None,
                       ", ".join(f"{k} = {preregistered.get(k, 'MISSING')}" for k in keys)
                       if preregistered is not None else "none given"))
    return out


def _ground_truth_items(gt_sizes: Mapping[str, int] | None, gt_in_zero_step: Mapping[str, int] | None) -> list[Verdict]:
    """Checklist items 1 (known ground truth) and 2 (faithful embedding)."""
    item = "1 known ground truth"
    out = [verdict(item, all(v > 0 for v in gt_sizes.values()),
                   ", ".join(f"seed {s}: |GT| = {v}" for s, v in gt_sizes.items()))
           if gt_sizes else verdict(item, None, "no ground-truth sizes given")]
    item = "2 faithful embedding (every GT step has a nonzero sketch)"
    out.append(verdict(item, all(v == 0 for v in gt_in_zero_step.values()),
                       ", ".join(f"seed {s}: {v} GT rollouts in zero-sketch steps" for s, v in gt_in_zero_step.items()))
               if gt_in_zero_step else verdict(item, None, "no sketch norms given"))
    return out


def _control_item(rows: Sequence[Row], step_rows: Sequence[Row], roll_rows: Sequence[Row]) -> Verdict:
    """Checklist item 3: a norm control (and |A| in which_rollout) next to every targeted method."""
    has = {(r.seed, r.table, r.method) for r in rows}
    with_ctrl, without = [], []
    which_rows = [r for r in rows if r.table == "which_rollout"]
    targeted = dict.fromkeys((r.seed, r.table, estimators.is_direction(r.method))
                             for r in list(step_rows) + list(roll_rows) + which_rows if _role(r.method) == "primary")
    for seed, table, direction in targeted:
        ctrl = estimators.ROLLOUT_NORM_CONTROL if table.startswith("mp_") else estimators.STEP_NORM_CONTROL
        need = [ctrl + (estimators.DIRECTION if direction else "")]
        if table == "which_rollout":  # at rollout resolution the reward-only |A_i| ranker is a control too
            need.append(estimators.ABS_ADVANTAGE_CONTROL)
        name = f"{seed}/{table}" + (estimators.DIRECTION if direction else "")
        (with_ctrl if all((seed, table, c) in has for c in need) else without).append(name)
    return verdict("3 gradient-magnitude control reported next to every targeted method",
                   not without if (with_ctrl or without) else None,
                   f"with norm control{' (and |A| in which_rollout)' if which_rows else ''}: "
                   f"{with_ctrl or 'none'}; without: {without or 'none'}")


def _step_table_items(step_rows: Sequence[Row]) -> list[Verdict]:
    """Checklist items 4 (early-window and overall tables) and 5 (chance, ceiling and headroom)."""
    seeds_overall = sorted({r.seed for r in step_rows if r.table == "overall"})
    seeds_early = sorted({r.seed for r in step_rows if r.table == "early_nonzero"})
    out = [verdict("4 nonzero early-window table reported (and overall separately)",
                   bool(seeds_early) and set(seeds_overall) <= set(seeds_early) if step_rows else None,
                   f"overall seeds {seeds_overall}, early_nonzero seeds {seeds_early}")]
    item = "5 tie-aware P@|GT| with chance, ceiling and headroom"
    if not step_rows:
        return out + [verdict(item, None, "no step-level rows")]
    ok = all(r.chance is not None and r.ceiling is not None and r.ceiling > r.chance for r in step_rows)
    heads = {(r.seed, r.table): r.ceiling - r.chance for r in step_rows
             if r.chance is not None and r.ceiling is not None}
    return out + [verdict(item, ok, "; ".join(f"{s}/{t}: headroom {h:.4f}" for (s, t), h in heads.items()))]


def _rollout_table_items(rows: Sequence[Row], roll_rows: Sequence[Row], valid_roll: Sequence[Row],
                         draws: Sequence[tuple[str, str]], min_matched_pairs: int) -> list[Verdict]:
    """Checklist items 6 (fluency baseline, residualised and matched AUC) and 7 (within-group)."""
    has = {(r.seed, r.table, r.method) for r in rows}
    parts, ok = [], True
    for seed, sfx in draws:
        raw = (seed, "mp_raw" + sfx, "fluency") in has
        pairs = [r.n or 0 for r in rows if r.seed == seed and r.table == "mp_matched" + sfx]
        ok = ok and raw and bool(pairs)
        note = "no" if not pairs else f"{max(pairs)} pairs" + ("" if max(pairs) >= min_matched_pairs
                                                                else f" (< {min_matched_pairs}, does not count)")
        parts.append(f"{seed}{sfx}: fluency raw {'yes' if raw else 'no'}, residualised yes, matched {note}")
    out = [verdict("6 fluency baseline, residualised and matched AUC", ok if draws else None,
                   "; ".join(parts) or "no rollout-level draws")]
    gas = [r for r in roll_rows if r.method == "GAS_centered"]
    out.append(verdict("7 within-group (same prompt draw) comparison, group-centred gradients",
                       bool(gas) and len(valid_roll) > 0 if roll_rows else None,
                       ", ".join(f"{r.seed}/{r.table}: {r.n} within-group pairs" for r in gas)
                       or "no GAS_centered rows"))
    return out


def _rows_files_item(row_files: Sequence[str] | None, draws: Sequence[tuple[str, str]]) -> Verdict:
    """Checklist item 11: every draw has its rows file (``io.layout.parse_rows_filename``)."""
    item = "11 per-rollout rows saved with seeds in file names"
    if row_files is None:
        return verdict(item, None, "no file list given")
    names = [os.path.basename(f) for f in row_files]
    found = [p for p in map(parse_rows_filename, names) if p is not None]
    labels = {f"{c}_gen{g}" if c != g else str(c) for c, g in found}
    missing = sorted({s for s, _ in draws} - labels)
    return verdict(item, not missing and bool(names), f"files {names}; draws without a rows file: {missing or 'none'}")
