"""The ``counterfactual`` stage: replay plans of one finished run, their tables and report section.

Does intervening on the rollouts an estimator names remove the behaviour? The stage builds the
run's :class:`replay.Replayer`, makes a :class:`replay_plans.PlanContext` (every step-level
estimator's scores, the ground truth, the window, the measure step), and runs each plan
(``attribution/replay_plans.py``):

* ``leave-top-k-out`` (unless ``counterfactual.causal = "only"``): for the ground truth
  (``oracle``), each replayed estimator (``counterfactual.methods``) and random k-subsets
  (``counterfactual.random_seeds``) the top-k window rollouts (k in ``counterfactual.k_fractions`` x
  |GT|) get ``counterfactual.intervention``; and the LDS subsets (``counterfactual.lds_fractions``).
  Tables ``counterfactual_topk`` (``value`` = Δ, ``chance`` = the random mean, ``ceiling`` = the
  oracle's Δ), ``counterfactual_topk_recomputed`` (the same with recomputed advantages,
  ``counterfactual.topk_recomputed``), ``lds`` and ``lds_drop<f>`` (Spearman of the predicted
  effect, the sum of an estimator's scores over the kept rollouts, vs the replayed behaviour);
* ``single-unit`` (unless ``counterfactual.causal = "off"``): the measured causal ground truth,
  ``causal_*`` tables (``attribution/causal.py``);
* the extra plans of ``counterfactual.plans`` (``datamodels``, ``factorial``, or a registered one).

Δ = behaviour(no intervention) - behaviour(intervened), read at ``counterfactual.measure``
("window": the end of the contamination window; "target": the checkpoint nearest
``draws.target_step``; "end": the run's end, cheap with the exact shortcut of zero-gradient
steps). Every replay records every configured measure (``train/measures.py``: the log-prob
margin and its halves, ``counterfactual.rates``' greedy rates, ``counterfactual.sampled``'s sampled
rates, and ``counterfactual.measures``); the tables are made of ``counterfactual.table_measures``.

Each plan logs its replayed-step cost before running. Resumable per replay
(``train/replay_runner.py``: one atomic JSON file per request under ``counterfactual/replays/``
or, for the single-unit plan, ``counterfactual/causal/``, holding its cache key; stale files are
replayed again, logged); the tables are rebuilt from the files, so a rerun's table is identical.

Outputs (issue 49 item 5, ``attribution/stage_outputs.py``): the stage's own rows
(``counterfactual/results_rows.csv``), merged into ``results_table.csv`` replacing only its own
(seed, table) pairs; its report section (``counterfactual/report_section.md``), which the
``report`` stage renders; figures under ``figures/``. If ``report.md`` already exists, the report
stage is run again so that it carries the section.
"""
from __future__ import annotations

import ml_collections
import numpy as np
from absl import logging

from behaviortrace_jax.attribution import counterfactual_report, counterfactual_tables as T, formats, replay_plans
from behaviortrace_jax.attribution import stage_outputs
from behaviortrace_jax.attribution.counterfactual_tables import lds_fractions
from behaviortrace_jax.attribution.scores import step_method_scores
from behaviortrace_jax.behavior import contaminator
from behaviortrace_jax.io import rollout_log
from behaviortrace_jax.io.layout import RunLayout
from behaviortrace_jax.models import tokenizer as tok_lib
from behaviortrace_jax.stages.registry import load_stages, register_stage
from behaviortrace_jax.stages.spec import RunSpec

CAUSAL = ("on", "off", "only")  # counterfactual.causal: the causal ground truth too, not, or alone


def measure_step(spec: RunSpec) -> int:
    """The step whose behaviour the tables report (``counterfactual.measure``): "window" = the end of
    the contamination window (capped at the run's length), "target" = the checkpoint nearest
    ``draws.target_step``, "end" = the run's end."""
    return spec.schedule.measure_step(spec.counterfactual.measure)


def method_scores(spec: RunSpec, paths: RunLayout, rollout_ids: list[str],
                  steps: np.ndarray) -> dict[str, np.ndarray]:
    """Every step-level estimator's per-rollout scores {method: float64 [N], log order}, as the
    ``evaluate`` stage scores them (``attribution.scores.step_method_scores``: in-run rollout sketches
    when the run has them, else step sketches), the reward-only, text and length controls included;
    the text control judges the logged completions as the grpo stage did (the first behaviour's
    pattern, ``behavior.contaminator.pattern_matches``)."""
    records = list(rollout_log.read_rollouts(paths.rollouts))
    texts = contaminator.logged_texts(tok_lib.load_tokenizer(paths.sft_hf), records)
    matches = contaminator.pattern_matches(texts, spec.first_behavior.pattern)
    return step_method_scores(spec.scores, paths, rollout_ids, steps, pattern_matches=matches,
                              per_rollout=spec.step.in_run_rollouts, records=records)


def split(value: str) -> list[str]:
    """A comma list of names, stripped, empty ones dropped."""
    return [s.strip() for s in str(value).split(",") if s.strip()]


def recorded_measures(cf) -> tuple[tuple[str, ...], dict]:
    """``(measure names, settings)`` every replay records: ``logp_margin``, ``logp_probe``,
    ``logp_control``, ``greedy_rate`` (``counterfactual.rates``), ``sampled_rate``
    (``counterfactual.sampled`` > 0 completions per prompt) and ``counterfactual.measures``; the
    sampled measures among these (``sampled_rate``, ``probe-rate``, ``leakage``) take
    ``counterfactual.sampled`` completions per prompt when it is > 0."""
    names = ["logp_margin", "logp_probe", "logp_control"] + (["greedy_rate"] if cf.rates else [])
    names += ["sampled_rate"] if cf.sampled else []
    names = list(dict.fromkeys(names + split(cf.measures)))
    settings = {n: {"samples": int(cf.sampled)} for n in ("sampled_rate", "probe-rate", "leakage")
                if cf.sampled and n in names}
    return tuple(names), settings


def stage_plans(cf) -> list[str]:
    """The plans the stage runs: ``leave-top-k-out`` (unless ``counterfactual.causal = "only"`` or
    ``counterfactual.topk`` is False) and ``single-unit`` as ``counterfactual.causal`` says, then
    ``counterfactual.plans``. Raises ValueError naming the key for a bad value or no plan at all."""
    if cf.causal not in CAUSAL:
        raise ValueError(f"config.counterfactual.causal={cf.causal!r}; expected one of {CAUSAL}")
    names = (["leave-top-k-out"] if cf.causal != "only" and cf.topk else []) + (
        ["single-unit"] if cf.causal != "off" else [])
    if not names and not split(cf.plans):
        raise ValueError("config.counterfactual: no replay plan (causal='off', topk=False and plans='')")
    return list(dict.fromkeys(names + split(cf.plans)))


def check_options(cf) -> None:
    """The stage's option values, refused by key before any replay. Raises ValueError."""
    from behaviortrace_jax.train import measures
    from behaviortrace_jax.train import interventions

    for key, value, allowed in (("rollouts", cf.rollouts, ("fixed", "regenerated")),
                                ("plan_rollouts", cf.plan_rollouts, ("fixed", "regenerated")),
                                ("causal_units", cf.causal_units, replay_plans.UNITS),
                                ("causal_regenerated", cf.causal_regenerated, replay_plans.REGENERATED)):
        if value not in allowed:
            raise ValueError(f"config.counterfactual.{key}={value!r}; expected one of {allowed}")
    for key, names, known in (("intervention", [cf.intervention], interventions.INTERVENTIONS),
                              ("causal_interventions", split(cf.causal_interventions), interventions.INTERVENTIONS),
                              ("measures", split(cf.measures), measures.MEASURES),
                              ("plans", split(cf.plans), replay_plans.PLANS)):
        bad = [n for n in names if n not in known]
        if bad:
            raise ValueError(f"config.counterfactual.{key}: {bad} not registered; known: {sorted(known)}")
    lds_fractions(cf.lds_fractions)
    if not split(cf.table_measures):
        raise ValueError("config.counterfactual.table_measures: empty; name at least one measure output")


@register_stage("counterfactual")
def counterfactual_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Replay plans of one finished run, their tables and report section (see the module docstring)."""
    from behaviortrace_jax.train import replay as R, replay_runner

    w = RunLayout(workdir)
    spec = RunSpec.from_config(config)
    cf = spec.counterfactual
    check_options(cf)
    plans = [replay_plans.get_plan(n) for n in stage_plans(cf)]
    names, settings = recorded_measures(cf)
    rp = R.Replayer(spec.replay, workdir, layout=spec.layout, measures=names, measure_settings=settings)
    steps = np.array([rollout_log.parse_rollout_id(r)[0] for r in rp.rollout_ids], np.int64)
    index = {r: i for i, r in enumerate(rp.rollout_ids)}
    gt_ids = [e["rollout_id"] for e in formats.read_ground_truth(rp.paths.ground_truth)]
    gt = np.array(sorted(index[g] for g in gt_ids if g in index), np.int64)
    # every step-level estimator, as the evaluate stage scores them; ``random`` is left out (the
    # random subsets replace it); the top-k replays follow ``counterfactual.methods``
    scores = method_scores(spec, rp.paths, rp.rollout_ids, steps)
    replayed = T.replayed_methods(scores, cf.methods)
    ctx = replay_plans.PlanContext(
        seed=spec.seed, steps=steps, n_per_step=rp.shapes.num_rollouts, group_size=spec.rollouts.group_size,
        cutoff=spec.schedule.early_step_cutoff, at=measure_step(spec),
        target_step=spec.schedule.target_checkpoint(), gt=gt, scores=T.replayed_methods(scores, ""),
        replayed=replayed, measures=names, table_measures=tuple(split(cf.table_measures)), cf=cf,
        nboot=spec.evaluation.nboot)
    rows: list[formats.Row] = []
    for plan in plans:
        replays = plan.replays(ctx)
        logging.info("counterfactual: plan %s: %d replays, %d replayed steps", plan.name,
                     len(set(r.request for r in replays)), replay_plans.plan_cost(replays))
        out_dir = w.counterfactual / "causal" if plan.name == "single-unit" else w.counterfactual_replays
        results = replay_runner.run_requests(rp, [r.request for r in replays], out_dir, name=plan.name)
        rows += plan.rows(ctx, replays, lambda item, out: replay_runner.value(results[item.request], ctx.at, out))
    write_outputs(config, w, rows, ctx.at, names)


def write_outputs(config: ml_collections.ConfigDict, w: RunLayout, rows: list[formats.Row], at: int,
                  measures: tuple[str, ...]) -> None:
    """The stage's own rows (merged into ``results_table.csv``, ``stage_outputs.publish_rows``), its
    figures and report section; the report re-rendered by the ``report`` stage where it exists."""
    stage_outputs.publish_rows(w, "counterfactual", rows)
    fig = counterfactual_report.plot(rows, w.figures / "counterfactual_topk.png")
    fig_rec = counterfactual_report.plot(rows, w.figures / "counterfactual_topk_recomputed.png",
                                         table="counterfactual_topk_recomputed")
    section = counterfactual_report.report_section(
        rows, "figures/counterfactual_topk.png" if fig else None, step=at,
        advantages="recomputed" if RunSpec.from_config(config).counterfactual.recompute_advantages else "logged",
        more_figures=("figures/counterfactual_topk_recomputed.png",) if fig_rec else (), measures=measures)
    stage_outputs.write_section(w, "counterfactual", section)
    if w.report.exists() and w.verdicts.exists():  # the report stage renders the section, not an edit of report.md
        load_stages()["report"](config, str(w.workdir))  # through the registry: a stage imports no other stage
