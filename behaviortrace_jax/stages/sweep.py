"""The ``sweep`` stage: several training seeds, their draws and diagnostic draws, one aggregate report.

SPEC §10.2: three training seeds (0, 1, 2); each seed's pre-registered rollout-level draw uses
CKPT_SEED = GEN_SEED = seed; the diagnostic draws re-sample the seed-0 and seed-1 checkpoints with
generation seeds 100 and 101 to separate checkpoint variance from sample variance.

Layout under the workdir: ``base/`` (one tiny base model shared by every seed, when
``config.model.hf_dir`` is empty), ``seed{S}/`` (a full run of ``config.sweep.stages`` each), and
the aggregate ``release/seed{S}/`` (each run's files in the paper's release format, diagnostic
draws included), ``results_table.csv``, ``verdicts.json``, ``report.md`` and ``figures/``. The
aggregate is computed by ``reproduce.reproduce`` over ``release/``, the same code that
reproduces the paper's tables, so the paper's Tables 1-4 and Figures 1-2 come out in its shape.
"""
from __future__ import annotations

import json
import re

import ml_collections
from absl import logging
from etils import epath

from behaviortrace_jax.attribution import causal as causal_tables, formats, release as reproduce, report, verdicts
from behaviortrace_jax.attribution.release import evaluate_verdicts, learning_curve
from behaviortrace_jax.io.layout import RunLayout, as_path
from behaviortrace_jax.io import files
from behaviortrace_jax.io.files import read_json, write_json
from behaviortrace_jax.stages import fingerprint, registry as stages, spec as spec_lib
from behaviortrace_jax.stages.registry import register_stage
from behaviortrace_jax.stages.spec import RunSpec


def parse_seeds(spec: str) -> list[int]:
    """"0,1,2" -> [0, 1, 2]. Raises ValueError naming ``config.sweep.seeds`` on bad input."""
    try:
        seeds = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"config.sweep.seeds={spec!r}: expected comma-separated integers") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"config.sweep.seeds={spec!r}: expected distinct seeds")
    return seeds


def parse_diagnostic_draws(spec: str, seeds: list[int]) -> list[tuple[int, int]]:
    """"0:100,1:101" -> [(0, 100), (1, 101)] as (ckpt_seed, gen_seed) (SPEC §10.2).

    Raises:
        ValueError: naming ``config.sweep.diagnostic_draws`` for a malformed pair or a checkpoint
            seed that is not swept.
    """
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = re.fullmatch(r"(\d+):(\d+)", part)
        if not m or int(m.group(1)) not in seeds:
            raise ValueError(f"config.sweep.diagnostic_draws: {part!r} must be CKPT:GEN with CKPT in {seeds}")
        out.append((int(m.group(1)), int(m.group(2))))
    return out


def instability_section(rules: list[verdicts.Verdict]) -> str:
    """States plainly which verdicts change across seeds and draws (the paper's C6 instability):
    the verdicts of one family (rule, and method when per method) compared across subjects."""
    families: dict[str, list[tuple[str, str]]] = {}
    for v in rules:
        if v.subject:  # a global verdict (C6 itself) has no seed/draw to compare across
            families.setdefault(v.family, []).append((v.subject, v.status))
    lines = []
    for name, outcomes in families.items():
        kinds = {o for _, o in outcomes if o != "not-evaluable"}
        if len(outcomes) < 2:
            continue
        state = "**CHANGES**" if len(kinds) > 1 else "stable"
        lines.append(f"* {name}: {state} - " + ", ".join(f"{t}: {o}" for t, o in outcomes))
    changed = sum("**CHANGES**" in line for line in lines)
    head = (f"{changed} of {len(lines)} verdicts that were evaluated on more than one seed or draw change "
            "between seeds/draws." if lines else "No verdict was evaluated on more than one seed or draw.")
    return head + "\n\n" + "\n".join(lines)


@register_stage("sweep")
def sweep_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Runs every seed (resumable: each seed's stages skip finished work) and aggregates them."""
    w = as_path(workdir)
    top = RunLayout(w)
    spec = RunSpec.from_config(config)
    seeds = parse_seeds(spec.sweep.seeds)
    diag = parse_diagnostic_draws(spec.sweep.diagnostic_draws, seeds)
    base_dir = str(top.base)
    if not spec.hf_dir:
        stages.STAGES["base"](config, str(w))
        summaries = {}
    for seed in seeds:
        cfg, run_dir = spec_lib.seed_config(config, seed, base_dir), w / f"seed{seed}"
        logging.info("sweep: seed %d -> %s", seed, run_dir)
        names = stages.parse_stages(RunSpec.from_config(cfg).stages)
        pre = names[:names.index("evaluate")] if "evaluate" in names else names
        # the seed's recorded stage fingerprints against its config, as pipeline.run does for a run
        fingerprint.check_workdir(cfg, run_dir, names)  # config.on_changed_config decides
        for name in pre:
            with fingerprint.recording(cfg, run_dir, name):
                stages.STAGES[name](cfg, str(run_dir))
        for ckpt, gen in diag:  # diagnostic draws land in the run's draws/ before it is evaluated
            if ckpt == seed:
                stages.STAGES["draws"](spec_lib.draw_config(cfg, ckpt, gen), str(run_dir))
        for name in names[len(pre):]:
            with fingerprint.recording(cfg, run_dir, name):
                stages.STAGES[name](cfg, str(run_dir))
        run = RunLayout(run_dir)
        files.copy_tree(run.release_seed(seed), top.release_seed(seed))  # the writer only; local or gs://
        summaries[seed] = read_json(run.summary)
    aggregate(config, w, summaries)


def aggregate(config: ml_collections.ConfigDict, w: epath.Path, summaries: dict[int, dict]) -> None:
    """The aggregate tables, verdicts and report over ``w/release`` (Tables 1-4, Figures 1-2)."""
    spec = RunSpec.from_config(config)
    ev, top = spec.evaluation, RunLayout(w)
    n_per_step = spec.step.shapes.num_rollouts
    rep = reproduce.reproduce(top.release, nboot=ev.nboot, early_cutoff=ev.early_cutoff,
                              delta=ev.fluency_match_delta, step_margin=ev.step_margin,
                              max_ci_width=ev.max_ci_width, min_matched_pairs=ev.min_matched_pairs,
                              rollouts_per_step=n_per_step)
    rows = list(rep.rows)
    for seed in summaries:  # the which-rollout (and counterfactual / causal, when that stage ran) rows of each run
        run_rows = formats.read_results_csv(RunLayout(w / f"seed{seed}").results_table)
        rows += [r for r in run_rows if r.table.startswith(("which_rollout", "counterfactual_topk", "lds", "causal"))]
    rules, check = evaluate_verdicts(rows, rep, spec.evaluation)
    formats.write_results_csv(top.results_table, rows)
    write_json(top.verdicts, verdicts.verdicts_json(rules, check))
    figs = report.make_figures(rows, top.figures, learning_curve=learning_curve(summaries[min(summaries)]))
    gates = "\n".join(
        f"* seed {s}: gate {'PASSED' if m['gate']['passed'] else 'FAILED'} (probe {m['gate']['probe_rate']:.2f}, "
        f"control {m['gate']['control_rate']:.2f}); |GT| = {m['gt_size']}"
        + (f"; decoys = {m['decoys']}" if "decoys" in m else "") + "; post-SFT "
        + json.dumps({k: v for k, v in m.get("post_sft", {}).items() if "rate" in k})
        for s, m in summaries.items())
    intro = (f"Sweep over seeds {sorted(summaries)} (`{spec.run_name}` family), with the diagnostic draws "
             f"`{spec.sweep.diagnostic_draws}` (ckpt:gen). Each seed's own report is in `seed{{S}}/report.md`.\n\n"
             + gates)
    extra = [("Instability across seeds and draws (C6)", instability_section(rules))]
    causal = causal_tables.seed_summary_lines(rows)
    if causal:  # the counterfactual stage's causal ground truth, when it ran (configs/tiny_causal.py)
        extra.append(("Causal ground truth over seeds (single-unit replays)", "\n".join(causal)))
    report.write_report(top.report, rows, title="BehaviorTrace-JAX: seeds and draws", intro=intro, rules=rules,
                        checklist=check, figures=figs, extra=extra)
    logging.info("sweep: aggregate report %s", top.report)
