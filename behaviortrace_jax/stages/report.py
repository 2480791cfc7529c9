"""The ``report`` stage: ``report.md`` and ``figures/*.png`` from ``results_table.csv``,
``verdicts.json`` and the GRPO summary (the learning curve, the gate, the decoys), written by the
``evaluate`` stage (``stages/evaluate.py``) and the stages that own tables of their own.

Other stages' sections (``attribution/stage_outputs.py``): the report renders the sections of the
stages that own rows (the ``counterfactual`` and ``cause`` stages'); their rows appear there, not
under "Other rows".
"""
from __future__ import annotations

import json

import ml_collections
from absl import logging

from behaviortrace_jax.attribution import causal_gate, formats, report, stage_outputs
from behaviortrace_jax.attribution.release import learning_curve
from behaviortrace_jax.attribution.verdicts import Verdict
from behaviortrace_jax.io.files import read_json
from behaviortrace_jax.io.layout import RunLayout
from behaviortrace_jax.stages.registry import register_stage
from behaviortrace_jax.stages.spec import RunSpec


def run_intro(spec: RunSpec, summary: dict) -> str:
    """The report's opening: what ran, that its numbers are one machine's (the same words on every
    CPU, so report.md repeats wherever the numbers do), how the behaviour was planted, and whether
    the gate passed."""
    gate = summary.get("gate", {})
    post = summary.get("post_sft", {})
    lines = [f"Run `{spec.run_name}` (seed {spec.seed}): {summary.get('steps')} GRPO steps, "
             f"{summary.get('n_rollouts')} rollouts, |GT| = {summary.get('gt_size')} bonus events in the early "
             f"window (steps < {spec.first_behavior.early_step_cutoff}).",
             "",
             "One run's numbers depend on the CPU type and CPU count it ran on (`run_info.json` names them; "
             "docs/reproducibility.md): expect other values on another machine, and read conclusions over "
             "seeds (`configs/tiny_sweep.py`), not from one run.",
             ""]
    if post:
        lines.append(f"After the SFT warm-up: {json.dumps({k: v for k, v in post.items() if 'rate' in k})}.")
    if gate:
        lines.append(f"Behaviour-emergence gate (SPEC §1.8): probe rate {gate['probe_rate']:.2f}, control rate "
                     f"{gate['control_rate']:.2f} -> **{'PASSED' if gate['passed'] else 'FAILED'}**"
                     + ("" if gate["passed"] else f" ({'; '.join(gate.get('reasons', []))})") + ".")
    return "\n".join(lines)


def decoy_section(spec: RunSpec, paths: RunLayout) -> str:
    """The report's decoy paragraph ("" for a run without ``grpo/decoys.jsonl``, i.e.
    ``contamination.decoy_fraction`` = 0): how many window rollouts without the pattern were paid
    the bonus, next to |GT|, and the cap ``|GT| / (|GT| + |decoys|)`` of a ranker that reads the
    reward log alone (reward, advantage), over the bonus window (steps < ``evaluation.early_cutoff``)
    and, when the release header names the nonzero steps, over the which-rollout population
    (early_nonzero). The cap is "near": rewards also differ by the base reward, advantages by group."""
    if not paths.decoys.exists():
        return ""
    cutoff = int(spec.evaluation.early_cutoff)
    decoys = [e for e in formats.read_ground_truth(paths.decoys) if int(e["step"]) < cutoff]
    gt = [e for e in formats.read_ground_truth(paths.ground_truth) if int(e["step"]) < cutoff]

    def cap(g: int, d: int) -> str:
        return f"{g / (g + d):.3f}" if g + d else "n/a"

    lines = [f"**Decoys** (`contamination.decoy_fraction` = {spec.contamination.decoy_fraction:g}): "
             f"{len(decoys)} rollouts without the pattern were paid the same bonus in the window (steps < {cutoff}; "
             f"`grpo/decoys.jsonl`, not ground truth), next to |GT| = {len(gt)}. A ranker that reads the reward log "
             f"alone (reward, advantage) is capped near |GT| / (|GT| + |decoys|) = **{cap(len(gt), len(decoys))}** "
             "there, where the which-rollout tables' ceiling is 1.0; what an estimator reaches above that cap is "
             "what attribution adds to the training log."]
    header = read_json(paths.release_seed(spec.seed) / "run_header.json", {})
    if "nonzero_steps" in header:
        nz = {int(s) for s in header["nonzero_steps"]}
        g, d = sum(int(e["step"]) in nz for e in gt), sum(int(e["step"]) in nz for e in decoys)
        lines.append(f"Over the which-rollout population (early_nonzero steps): |GT| = {g}, decoys = {d}, "
                     f"cap {cap(g, d)}.")
    return " ".join(lines)


@register_stage("report")
def report_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
    """``report.md`` and ``figures/*.png`` from results_table.csv, verdicts.json and the GRPO summary."""
    w = RunLayout(workdir)
    spec = RunSpec.from_config(config)
    owned = {(r.seed, r.table) for r in stage_outputs.rows_of_other_stages(w)}  # shown in their stages' sections
    rows = [r for r in formats.read_results_csv(w.results_table) if (r.seed, r.table) not in owned]
    verdicts = read_json(w.verdicts)
    summary = read_json(w.summary)
    extra = []
    if spec.multi:  # the first behaviour's tables, then the others'
        all_rows = rows
        rows = report.first_behavior_rows(all_rows)
    figs = report.make_figures(rows, w.figures, learning_curve=learning_curve(summary))
    if spec.multi:
        ids = [b.id for b in spec.behaviors]
        base = read_json(w.base / "base_summary.json", {}) if not spec.hf_dir else {}
        extra = report.behavior_sections(all_rows, ids, summary, verdicts, base)
        fig = report.plot_specificity(all_rows, w.figures / "specificity.png")
        figs += [fig] if fig is not None else []
    top = read_json(w.which_rollout_top) if w.which_rollout_top.exists() else None
    gate = read_json(w.cause_gate, None)
    gate_line = causal_gate.summary_line(gate)
    if gate is None:  # the cause stage prints its own lines when it runs
        print(gate_line, flush=True)
    report.write_report(w.report, rows, title=f"BehaviorTrace-JAX: {spec.run_name}",
                   intro="\n\n".join(p for p in (run_intro(spec, summary), gate_line, decoy_section(spec, w)) if p),
                   top_blamed=top,
                   rules=[Verdict.from_dict(v) for v in verdicts["decision_rules"]],
                   checklist=[Verdict.from_dict(v) for v in verdicts["checklist"]], figures=figs,
                   extra=list(extra) + stage_outputs.report_sections(w))  # other stages' own sections
    logging.info("report: %s", w.report)
