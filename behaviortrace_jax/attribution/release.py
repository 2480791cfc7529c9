"""The release format: the paper's numbers from its released per-seed files (SPEC §6.13), and ours.

Reads, as they are, every ``seedN/`` folder under ``reference_dir``:

* ``run_header.json`` (gt_size, n_rollouts, nonzero_steps, seed) and ``ground_truth.jsonl``;
* ``attribution_scores.json`` if present (the paper's score file or one of ours): every method's
  ``overall`` and ``early_nonzero`` row;
* otherwise the rows computable without gradient scores: ``random`` (numpy ``default_rng(seed)``
  shuffle) and ``local-buffer`` (finite only on the window steps; its precision does not depend on
  the finite values when no GT rollout lies in the window, which is checked), plus ``C1-dot`` for
  every table whose steps ``c1dot_step_scores_*.tsv`` covers;
* ``minimal_pair_rows_ckpt{C}_gen{G}.json`` -> ``mp_raw``/``mp_residualized``/``mp_matched``
  (``_diag`` and label ``{C}_gen{G}`` when C != G; rng = default_rng(G), SPEC §6.10);
* ``token_level_cos_temp{T}.json`` -> ``token_level`` rows (means of vs_cont, vs_ctx, cos_full);
* ``rollout_seed01.json`` (run-notebook numbers) -> ``*_notebook`` rows used by the verdicts and
  the report, not written to the CSV (they are read, not computed).

``write_outputs`` writes ``results_table.csv`` (computed rows), ``report.md``, ``verdicts.json`` and figures into
the workdir (the ``reproduce`` stage, ``stages/reproduce.py``). Everything is computed before anything is written.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import numpy as np
from absl import logging
from etils import epath

from behaviortrace_jax.attribution import estimators, formats, report, tables
from behaviortrace_jax.attribution.verdicts import EvalOptions, Verdict, checklist, decision_rules, verdicts_json
from behaviortrace_jax.io.files import read_json, write_json
from behaviortrace_jax.io.layout import (ROWS_GLOB, TOKEN_LEVEL_GLOB, as_path, parse_rows_filename,
                                         parse_token_level_filename)

ROLLOUTS_PER_STEP = 16  # SPEC §2.1: 4 prompts x 4 generations per GRPO step.
NOTEBOOK_NAMES = {"GAS_centered": "GAS_centered", "plain_cosine": "C1_plain", "norm_only": "norm_only"}


@dataclass
class SeedData:
    """What one ``seedN/`` folder holds, parsed and checked."""

    label: str
    header: dict
    rollout_ids: list[str]
    rollout_steps: np.ndarray
    gt_ids: list[str]
    files: list[str] = field(default_factory=list)


@dataclass
class Reproduction:
    """Everything the ``reproduce`` job computes (nothing written yet)."""

    rows: list[formats.Row]  # computed rows, CSV order
    notebook_rows: list[formats.Row]  # read from rollout_seed01.json
    populations: dict[tuple[str, str], tables.Population]  # (seed, table) -> chance/ceiling/n
    rules: list[dict]
    checklist: list[dict]
    seeds: list[SeedData]


def seed_dirs(reference_dir: str | os.PathLike) -> list[epath.Path]:
    """``seedN`` folders under ``reference_dir`` sorted by N. Raises if there are none."""
    ref = as_path(reference_dir)
    if not ref.is_dir():
        raise ValueError(f"reference_dir {str(ref)!r} is not a directory")
    dirs = sorted((p for p in ref.iterdir() if p.is_dir() and re.fullmatch(r"seed\d+", p.name)),
                  key=lambda p: int(p.name[4:]))
    if not dirs:
        raise ValueError(f"no seedN folders in {ref}")
    return dirs


def load_seed(d: epath.Path, per_step: int = ROLLOUTS_PER_STEP) -> SeedData:
    """Parses ``run_header.json`` + ``ground_truth.jsonl`` of one seed folder.

    Raises:
        ValueError: missing files, a header seed that disagrees with the folder name, a GT count
            that disagrees with ``gt_size``, GT ids outside the id layout.
    """
    hp, gp = d / "run_header.json", d / "ground_truth.jsonl"
    for p in (hp, gp):
        if not p.is_file():
            raise ValueError(f"{d}: missing {p.name}")
    header = read_json(hp)
    seed = int(d.name[4:])
    if int(header.get("seed", seed)) != seed:
        raise ValueError(f"{hp}: seed {header['seed']} != folder {d.name}")
    ids, steps = formats.paper_rollout_ids(int(header["n_rollouts"]), per_step)
    gt = [e["rollout_id"] for e in formats.read_ground_truth(gp)]
    if "gt_size" in header and len(gt) != int(header["gt_size"]):
        raise ValueError(f"{gp}: {len(gt)} events but gt_size = {header['gt_size']} in {hp.name}")
    known = set(ids)
    bad = [g for g in gt if g not in known]
    if bad:
        raise ValueError(f"{gp}: ground-truth id {bad[0]!r} is outside the rollout log ({len(ids)} ids)")
    return SeedData(str(seed), header, ids, steps, gt, [hp.name, gp.name])


def read_step_score_tsv(path: epath.Path) -> dict[int, float]:
    """``step<TAB>score`` lines with a header -> {step: score}. Raises on duplicates/bad lines."""
    out = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if lineno == 1 or not line.strip():
            continue
        parts = line.split("\t")
        try:
            step, score = int(parts[0]), float(parts[1])
        except (ValueError, IndexError):
            raise ValueError(f"{path}:{lineno}: expected 'step<TAB>score', got {line!r}") from None
        if step in out:
            raise ValueError(f"{path}:{lineno}: duplicate step {step}")
        out[step] = score
    return out


def _step_rows(sd: SeedData, d: epath.Path, early_cutoff: int) -> tuple[list[formats.Row], dict]:
    nonzero = sd.header["nonzero_steps"]
    pops = tables.step_populations(sd.rollout_ids, sd.rollout_steps, sd.gt_ids, nonzero_steps=nonzero,
                                   early_cutoff=early_cutoff)
    kw = dict(nonzero_steps=nonzero, early_cutoff=early_cutoff)
    score_file = d / "attribution_scores.json"
    if score_file.is_file():
        sf = formats.read_attribution_scores(score_file)
        if sf.rollout_ids != sd.rollout_ids:
            raise ValueError(f"{score_file}: rollout ids differ from the header's id layout")
        sd.files.append(score_file.name)
        return tables.step_level_tables(sd.label, sd.rollout_ids, sd.rollout_steps, sd.gt_ids, sf.method_scores, **kw), pops
    rows: list[formats.Row] = []
    # C1-dot from released per-step scores, for tables whose steps they cover.
    for tsv in sorted(d.glob("c1dot_step_scores_*.tsv")):
        step_scores = read_step_score_tsv(tsv)
        sd.files.append(tsv.name)
        covered = [t for t, p in pops.items() if set(np.unique(sd.rollout_steps[p.mask]).tolist()) <= set(step_scores)]
        if covered:
            scores = estimators.expand_to_rollouts(list(step_scores.values()), list(step_scores), sd.rollout_steps)
            rows += tables.step_level_tables(sd.label, sd.rollout_ids, sd.rollout_steps, sd.gt_ids, {"C1-dot": scores},
                                             tables=covered, **kw)
    # random: exact shuffle.
    rows += tables.step_level_tables(sd.label, sd.rollout_ids, sd.rollout_steps, sd.gt_ids,
                                     {"random": estimators.random_scores(sd.rollout_ids, int(sd.label))}, **kw)
    # local-buffer: finite only on the window steps (notebook: current = #steps, window = #steps//10).
    n_steps = int(sd.rollout_steps.max()) + 1
    window = estimators.local_buffer_steps(np.arange(n_steps), n_steps, max(1, n_steps // 10))
    in_window = np.isin(sd.rollout_steps, window)
    gt_idx = {r: i for i, r in enumerate(sd.rollout_ids)}
    if not any(in_window[gt_idx[g]] for g in sd.gt_ids):
        # No GT in the window: every finite cosine earns 0 credit, so any finite stand-in is exact.
        lb = np.where(in_window, 0.0, -np.inf)
        rows += tables.step_level_tables(sd.label, sd.rollout_ids, sd.rollout_steps, sd.gt_ids, {"local-buffer": lb}, **kw)
    else:
        logging.warning("seed %s: GT inside the local-buffer window; its rows need the real scores", sd.label)
    return rows, pops


def _order_step_rows(rows: list[formats.Row]) -> list[formats.Row]:
    order = {e.name: i for i, e in enumerate(estimators.estimators("step"))}
    return sorted(rows, key=lambda r: (tables.STEP_TABLES.index(r.table), order.get(r.method, len(order))))


def token_level_rows(label: str, path: epath.Path) -> list[formats.Row]:
    """Means of the §7.4 lists -> rows ``token_level`` (temperature 0.9) or ``token_level_temp{T}``."""
    temp = parse_token_level_filename(path.name)
    if temp is None:
        raise ValueError(f"{path}: not a token-level file name (token_level_cos_temp{{T}}.json)")
    d = read_json(path)
    table = "token_level" if temp == "0.9" else f"token_level_temp{temp}"
    out = []
    for key in ("vs_cont", "vs_ctx", "cos_full"):
        vals = np.asarray(d.get(key, []), dtype=np.float64)
        if vals.ndim != 1 or vals.size == 0 or np.isnan(vals).any():
            raise ValueError(f"{path}: {key!r} must be a non-empty list of numbers")
        out.append(formats.Row(label, table, key, float(vals.mean()), n=int(vals.size)))
    return out


def notebook_rows(path: epath.Path) -> list[formats.Row]:
    """rollout_seed01.json (§7.5) -> rows tables ``mp_residualized_notebook``,
    ``mp_matched_notebook`` and ``mp_raw_notebook`` (fluency), values [pt, lo, hi]."""
    d = read_json(path)
    out = []
    for key, block in d.items():
        m = re.fullmatch(r"seed(\d+)", key)
        if not m:
            continue
        seed = m.group(1)
        for part, table, n_key in (("residualized", "mp_residualized_notebook", "within_group_pairs"),
                                   ("matched", "mp_matched_notebook", "pairs")):
            for name, method in NOTEBOOK_NAMES.items():
                pt, lo, hi = block[part][name]
                out.append(formats.Row(seed, table, method, pt, lo, hi, n=block[part].get(n_key)))
        pt, lo, hi = block["fluency_raw_auc"]
        n = block["residualized"].get("within_group_pairs")
        out.append(formats.Row(seed, "mp_raw_notebook", "fluency", pt, lo, hi, n=n))
    return out


def reproduce(reference_dir: str | os.PathLike, *, nboot: int = 600, early_cutoff: int = 200,
              delta: float = 0.10, step_margin: float = 0.10, max_ci_width: float = 0.15,
              min_matched_pairs: int = 100, rollouts_per_step: int = ROLLOUTS_PER_STEP) -> Reproduction:
    """Computes every row the released files allow (see the module docstring); writes nothing.

    Raises:
        ValueError: a missing/ill-formed file, naming it.
    """
    step_rows, mp_rows, tok_rows, seeds = [], [], [], []
    pops: dict[tuple[str, str], tables.Population] = {}
    for d in seed_dirs(reference_dir):
        sd = load_seed(d, rollouts_per_step)
        seeds.append(sd)
        rows, p = _step_rows(sd, d, early_cutoff)
        step_rows += _order_step_rows(rows)
        pops.update({(sd.label, t): x for t, x in p.items()})
        for f in sorted(d.glob(ROWS_GLOB)):
            seeds_of = parse_rows_filename(f.name)
            if seeds_of is None:
                raise ValueError(f"{f}: not a rows file name (minimal_pair_rows_ckpt{{C}}_gen{{G}}.json)")
            ckpt, gen = seeds_of
            head, rows_ = formats.read_mp_rows(f)
            if int(head.get("ckpt_seed", ckpt)) != ckpt or int(head.get("gen_seed", gen)) != gen:
                raise ValueError(f"{f}: ckpt_seed/gen_seed {head.get('ckpt_seed')}/{head.get('gen_seed')} "
                                 f"disagree with the file name")
            diag = ckpt != gen
            label, suffix = (f"{ckpt}_gen{gen}", "_diag") if diag else (str(ckpt), "")
            mp_rows.append(tables.rollout_level_tables(label, rows_, nboot=nboot, rng_seed=gen, suffix=suffix,
                                                       delta=delta, source=str(f)))
            sd.files.append(f.name)
        for f in sorted(d.glob(TOKEN_LEVEL_GLOB)):
            tok_rows += token_level_rows(sd.label, f)
            sd.files.append(f.name)
    # paper CSV order: step rows, then main-draw rollout tables, then diagnostic draws
    main = [r for rs in mp_rows for r in rs if not r.table.endswith("_diag")]
    diag = [r for rs in mp_rows for r in rs if r.table.endswith("_diag")]
    rows = step_rows + main + diag + tok_rows
    nb_path = as_path(reference_dir) / "rollout_seed01.json"
    nb = notebook_rows(nb_path) if nb_path.is_file() else []
    rules, check = verdicts(rows + nb, seeds, step_margin=step_margin, max_ci_width=max_ci_width,
                            min_matched_pairs=min_matched_pairs)
    return Reproduction(rows, nb, pops, rules, check, seeds)


def verdicts(rows: list[formats.Row], seeds: list[SeedData], *, step_margin: float, max_ci_width: float,
             min_matched_pairs: int) -> tuple[list[Verdict], list[Verdict]]:
    """SPEC §6.11 decision rules and the SPEC §8 checklist of ``rows`` for these seed folders, with
    the pre-registered thresholds (the checklist records them). Returns (rules, checklist)."""
    rules = decision_rules(rows, step_margin=step_margin, max_ci_width=max_ci_width,
                           min_matched_pairs=min_matched_pairs)
    check = checklist(rows, gt_sizes={s.label: len(s.gt_ids) for s in seeds},
                      gt_in_zero_step={s.label: int(s.header["gt_in_zero_step"]) for s in seeds
                                         if "gt_in_zero_step" in s.header},
                      row_files=[f for s in seeds for f in s.files],
                      preregistered=dict(step_margin=step_margin, max_ci_width=max_ci_width,
                                           min_matched_pairs=min_matched_pairs),
                      max_ci_width=max_ci_width, min_matched_pairs=min_matched_pairs)
    return rules, check


def write_outputs(rep: Reproduction, workdir: str | os.PathLike, reference_dir: str | os.PathLike) -> None:
    """Writes results_table.csv, verdicts.json, figures/ and report.md into ``workdir``."""
    w = as_path(workdir)
    figs = report.make_figures(rep.rows + rep.notebook_rows, w / "figures")
    formats.write_results_csv(w / "results_table.csv", rep.rows)
    write_json(w / "verdicts.json", verdicts_json(rep.rules, rep.checklist))
    lines = []
    for sd in rep.seeds:
        methods = list(dict.fromkeys(r.method for r in rep.rows if r.seed == sd.label and r.table in tables.STEP_TABLES))
        lines.append(f"* seed {sd.label}: " + ", ".join(f"`{f}`" for f in sd.files)
                     + f"; step-level methods computable: {', '.join(methods) or 'none'}")
    intro = (f"Re-scored from the paper's released files in `{reference_dir}` (SPEC §6.13).\n\n"
             + "\n".join(lines) + "\n\n"
             "Computed rows are in `results_table.csv`. The other step-level methods need per-rollout score "
             "files (`attribution_scores.json`), which a seed folder may add. `*_notebook` rows are read from "
             "`rollout_seed01.json` (run-notebook CIs, not recomputable) and feed the verdicts only.")
    report.write_report(w / "report.md", rep.rows + rep.notebook_rows,
                   title="BehaviorTrace: reproduction of the paper's tables", intro=intro, rules=rep.rules,
                   checklist=rep.checklist, figures=figs)


def evaluate_verdicts(rows: list[formats.Row], rep: Reproduction,
                      ev: EvalOptions) -> tuple[list[Verdict], list[Verdict]]:
    """SPEC §6.11 decision rules and the SPEC §8 checklist on ``rows`` (pre-registered thresholds
    of ``ev``, ``config.evaluation``: ``RunSpec.evaluation``)."""
    return verdicts(rows, rep.seeds, step_margin=ev.step_margin, max_ci_width=ev.max_ci_width,
                    min_matched_pairs=ev.min_matched_pairs)


def learning_curve(summary: dict) -> list[tuple[float, float, float]]:
    """(step, probe rate, control rate) points of a GRPO ``summary.json`` (empty without a curve)."""
    return [(c["step"], c["probe_rate"], c["control_rate"]) for c in summary.get("learning_curve", [])]


def behavior_dirs(reference_dir: str | os.PathLike) -> list[tuple[str, os.PathLike]]:
    """Other behaviours' release folders under ``reference_dir``: every sub-folder
    ``<id>/`` that holds ``seedN/`` folders, as ``(id, folder)`` sorted by id. Each is a release in
    the paper's format on its own (``reproduce(folder)``); the paper's own release has none."""
    ref = as_path(reference_dir)
    out = []
    for p in sorted(ref.iterdir(), key=lambda q: q.name) if ref.is_dir() else []:
        if p.is_dir() and not re.fullmatch(r"seed\d+", p.name) and any(
                q.is_dir() and re.fullmatch(r"seed\d+", q.name) for q in p.iterdir()):
            out.append((p.name, p))
    return out


def reproduce_behaviors(reference_dir: str | os.PathLike, **kwargs) -> list[formats.Row]:
    """The rows of every other behaviour's release folder (:func:`behavior_dirs`), computed by
    :func:`reproduce` with ``kwargs`` and with table names suffixed ``@<id>``; [] when there are none.
    A behaviour whose ``run_header.json`` names its bonus window (``behavior.early_step_cutoff``, as
    the evaluate stage writes) is read with that ``early_cutoff``."""
    rows = []
    for bid, d in behavior_dirs(reference_dir):
        kw = dict(kwargs)
        cutoff = read_json(seed_dirs(d)[0] / "run_header.json", {}).get("behavior", {}).get("early_step_cutoff")
        if cutoff:
            kw["early_cutoff"] = int(cutoff)
        rows += [formats.Row(r.seed, f"{r.table}@{bid}", r.method, r.value, r.lo, r.hi, r.chance, r.ceiling, r.n)
                 for r in reproduce(d, **kw).rows]
    return rows
