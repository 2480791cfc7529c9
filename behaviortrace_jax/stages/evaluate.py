"""The ``evaluate`` stage of a run: every estimator, table and verdict (SPEC §4, §6-§8).

``evaluate`` scores every step-level estimator on the in-run step sketches against the
continuation targets of the ``sketch`` stage, then writes the run's results in the paper's release
format under ``workdir/release/seed{S}/`` (``run_header.json``, ``ground_truth.jsonl``,
``attribution_scores.json`` and the draws' rows and token-level files,
named by ``io.layout``) and evaluates that folder with the very code that reproduces the
paper's tables (``reproduce.reproduce``): one evaluation path for the paper's files and ours.
It adds the "which rollout" tables (per-rollout in-run sketches, where the rollouts of a step
do not tie) and re-checks the decision rules and the checklist on all rows. Outputs:
``results_table.csv``, ``attribution_scores.json``, ``verdicts.json``.

``stages/report.py`` turns those into ``report.md`` and ``figures/*.png``.

Other stages' tables (``attribution/stage_outputs.py``): ``evaluate`` keeps the rows that another
stage owns (the ``counterfactual`` and ``cause`` stages') when it rewrites ``results_table.csv``.
"""
from __future__ import annotations

import dataclasses
import pathlib

import ml_collections
import numpy as np
from absl import logging

from behaviortrace_jax.attribution import estimators, formats, metrics, release as reproduce, specificity, tables
from behaviortrace_jax.attribution import stage_outputs
from behaviortrace_jax.attribution.release import evaluate_verdicts
from behaviortrace_jax.attribution.scores import (read_complete, read_rollout_sketches, rollout_method_scores,
                                                  rollout_scales, step_method_scores, target_store_scores,
                                                  training_log_inputs)
from behaviortrace_jax.attribution.verdicts import verdicts_json
from behaviortrace_jax.behavior import behaviors as behaviors_lib, contaminator, planted as behavior
from behaviortrace_jax.io import files, rollout_log, sketch_store
from behaviortrace_jax.io.files import write_json
from behaviortrace_jax.io.layout import RunLayout, parse_rows_filename, parse_token_level_filename
from behaviortrace_jax.models import tokenizer as tok_lib
from behaviortrace_jax.stages.registry import register_stage
from behaviortrace_jax.stages.spec import RunSpec


def read_records(spec: RunSpec, paths: RunLayout) -> list[rollout_log.RolloutRecord]:
    """The rollout log of a complete run (log order). Raises ValueError on a wrong record count."""
    records = list(rollout_log.read_rollouts(paths.rollouts))
    n_expected = spec.grpo.steps * spec.step.shapes.num_rollouts
    if len(records) != n_expected:
        raise ValueError(f"{paths.rollouts}: {len(records)} rollout records, expected {n_expected}")
    return records


def completion_texts(paths: RunLayout, records: list) -> list[str]:
    """The logged completions as the ``grpo`` stage judged them, decoded with the run's tokenizer
    (``behavior.contaminator.logged_texts``, checked against each record's ``response_hash``)."""
    return contaminator.logged_texts(tok_lib.load_tokenizer(paths.sft_hf), records)


def write_release(spec: RunSpec, paths: RunLayout, release: pathlib.Path,
                  records: list | None = None, texts: list[str] | None = None) -> dict:
    """Writes ``release/seed{S}/`` in the paper's format (SPEC §7); returns the score-file header.
    Its score file holds every step-level estimator and the reward-only, text and length controls
    (``texts``: :func:`completion_texts` of ``records``, read when None)."""
    records = read_records(spec, paths) if records is None else records
    texts = completion_texts(paths, records) if texts is None else texts
    ids = [r.rollout_id for r in records]
    steps = np.array([r.step for r in records], np.int64)
    gt_ids = [e["rollout_id"] for e in formats.read_ground_truth(paths.ground_truth)]
    step_sk = read_complete(paths.sketch_store("step_sketches")).read()
    matches = contaminator.pattern_matches(texts, spec.first_behavior.pattern)
    scores = step_method_scores(spec.scores, paths, ids, steps, pattern_matches=matches, step_sketches=step_sk,
                                records=records)
    step_norms = {s: float(v) for s, v in enumerate(np.linalg.norm(step_sk.astype(np.float64), axis=1))}
    header = tables.score_file_header(spec.run_name, spec.seed, ids, steps, gt_ids, step_norms,
                                      final_rewards=np.array([r.reward for r in records]),
                                      group_size=spec.grpo.group_size, early_cutoff=spec.evaluation.early_cutoff)
    _write_release_folder(spec, release / f"seed{spec.seed}", header, ids, steps, scores,
                          paths.ground_truth, paths.draws)
    return header


def _write_release_folder(spec: RunSpec, out: pathlib.Path, header: dict, ids: list[str],
                          steps: np.ndarray, scores: dict[str, np.ndarray], ground_truth: pathlib.Path,
                          draws: pathlib.Path, extra_header: dict | None = None) -> None:
    """One release folder ``out`` in the paper's format (SPEC §7), rebuilt from scratch (derived
    files only): ``attribution_scores.json``, ``run_header.json`` (+ ``extra_header``), a copy of
    ``ground_truth`` and of the draws' minimal-pair / token files found in ``draws``."""
    files.remove_tree(out)
    out.mkdir(parents=True, exist_ok=True)
    formats.write_attribution_scores(out / "attribution_scores.json", header, ids, steps, scores)
    n_per_step = spec.step.shapes.num_rollouts
    run_header = {k: header[k] for k in formats.SCORE_FILE_KEYS}
    run_header["rollout_id_format"] = (f"{rollout_log.ROLLOUT_ID_FORMAT}  ({n_per_step} rollouts per step, "
                                       f"steps 0..{spec.grpo.steps - 1}, log order = step then index)")
    run_header.update(extra_header or {})
    write_json(out / "run_header.json", run_header)
    files.copy_file(ground_truth, out / "ground_truth.jsonl")
    if draws.exists():
        for f in sorted(draws.glob("*.json")):  # the pre-registered and diagnostic draws' files
            if parse_rows_filename(f.name) or parse_token_level_filename(f.name):
                files.copy_file(f, out / f.name)


@register_stage("evaluate")
def evaluate_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Scores, tables and verdicts of one run (see the module docstring)."""
    spec = RunSpec.from_config(config)
    paths = RunLayout(workdir)
    ev = spec.evaluation
    release = paths.release
    records = read_records(spec, paths)
    texts = completion_texts(paths, records)
    write_release(spec, paths, release, records, texts)
    n_per_step = spec.step.shapes.num_rollouts
    rep = reproduce.reproduce(release, nboot=ev.nboot, early_cutoff=ev.early_cutoff, delta=ev.fluency_match_delta,
                              step_margin=ev.step_margin, max_ci_width=ev.max_ci_width,
                              min_matched_pairs=ev.min_matched_pairs, rollouts_per_step=n_per_step)
    rows = list(rep.rows)
    if spec.step.in_run_rollouts:
        sd = next(s for s in rep.seeds if s.label == str(spec.seed))
        matches = contaminator.pattern_matches(texts, spec.first_behavior.pattern)
        scores = step_method_scores(spec.scores, paths, sd.rollout_ids, sd.rollout_steps, pattern_matches=matches,
                                    per_rollout=True, records=records)
        adv = np.array([r.advantage for r in records], np.float64)
        kw = dict(advantages=adv, nonzero_steps=sd.header["nonzero_steps"], early_cutoff=ev.early_cutoff)
        rows += tables.which_rollout_tables(sd.label, sd.rollout_ids, sd.rollout_steps, sd.gt_ids, scores,
                                            nboot=ev.nboot, rng_seed=spec.seed, **kw)
        pop = tables.which_rollout_population(sd.rollout_ids, sd.rollout_steps, sd.gt_ids, **kw)
        write_json(paths.which_rollout_top, top_blamed(spec, paths, records, scores, pop, set(sd.gt_ids)))
    rows += training_rollout_tables(spec, paths, spec.first_behavior, nboot=ev.nboot)
    rules, check = evaluate_verdicts(rows, rep, spec.evaluation)
    verdicts = verdicts_json(rules, check)
    if spec.multi:  # every other behaviour's tables, and specificity
        more, per_behavior = behavior_results(spec, paths, texts)
        rows += more
        verdicts.update(per_behavior)
    rows += stage_outputs.rows_of_other_stages(paths, exclude=("evaluate",))  # their tables stay (issue 49 item 5)
    formats.write_results_csv(paths.results_table, rows)
    write_json(paths.verdicts, verdicts)
    files.copy_file(paths.release_seed(spec.seed) / "attribution_scores.json", paths.attribution_scores)
    logging.info("evaluate: %d rows -> %s", len(rows), paths.results_table)


def training_rollout_tables(spec: RunSpec, paths: RunLayout, beh: behaviors_lib.Behavior, *,
                            nboot: int) -> list[formats.Row]:
    """Rollout-level AUC tables of behaviour ``beh`` on the ORIGINAL training rollouts of its bonus
    window (steps < :meth:`Behavior.window_end`).

    Uses the sketches of the ``sketch`` stage at each re-sketched checkpoint C (g_i: the gradient of
    the advantage-free -meanlp_i at C): within each GRPO group (same step and prompt), ground-truth
    (bonus) rollouts are the positives; the target is the continuation target at C. Tables
    ``mp_raw_train_ckpt{C}`` etc., in the layout of SPEC §6.7-§6.10 (GAS_centered = cos(g - group
    mean, t), C1_plain, norm_only, fluency; bootstrap rng = seed), twice: on the weighted sketches
    ``clip_s * c_i * g_i`` (the logged coefficients and clip factors, ``attribution.scores.rollout_scales``;
    the methods' own names; absent when the run logged no coefficients) and on g_i (method names
    + ``:direction``; fluency once).
    Empty when no checkpoint was re-sketched. Positives are ``beh``'s ground truth
    (``grpo/ground_truth{suffix}.jsonl``), targets its continuation targets
    (``RunLayout.behavior_targets``).
    """
    path = paths.sketch_store("checkpoint_rollout_sketches")
    if not (path / "metadata.json").exists():
        return []
    store = sketch_store.SketchStore.open(path)
    scale = rollout_scales(spec.scores, paths, store.shape[1])  # clip_s * c_i: the weighted variant
    fluency = sketch_store.SketchStore.open(paths.sketch_store("checkpoint_rollout_fluency"))
    t_store = sketch_store.SketchStore.open(paths.behavior_targets(beh.suffix))
    t_steps = [int(s) for s in t_store.metadata["checkpoint_steps"]]
    records = list(rollout_log.read_rollouts(paths.rollouts))[:store.shape[1]]
    gt = {e["rollout_id"] for e in formats.read_ground_truth(paths.behavior_ground_truth(beh.suffix))}
    window = spec.window_end(beh)
    early = np.array([r.step < window for r in records])
    groups = np.array([r.step * spec.grpo.prompts_per_step + r.group_id for r in records])[early]
    positive = np.array([r.rollout_id in gt for r in records])[early]
    rows = []
    for c, step in enumerate(store.metadata["checkpoint_steps"]):
        if store.missing_rows(lead=(c,)).size:
            raise ValueError(f"{path}: checkpoint {step} is incomplete; rerun the `sketch` stage")
        target = t_store.read(rows=[t_steps.index(int(step))])[0]
        sk = store.read(lead=(c,))[early]
        fl = fluency.read(lead=(c,))[early, 0]
        kinds = ([("", sk * scale[early][:, None])] if scale is not None else []) + [(estimators.DIRECTION, sk)]
        for kind, x in kinds:
            mp_rows = estimators.score_rollout_rows(x, groups, positive, {"mp": target, "mp_bal": target}, fluency=fl)
            t = tables.rollout_level_tables(str(spec.seed), mp_rows, nboot=nboot, rng_seed=spec.seed,
                                            suffix=f"_train_ckpt{int(step)}", source=str(path))
            rows += [dataclasses.replace(r, method=r.method + kind) for r in t if not (kind and r.method == "fluency")]
    return rows


TEXT_CHARS = 160  # characters of prompt / completion text kept in which_rollout_top.json


def user_prompt_text(tok, prompt_ids: list[int]) -> str:
    """The user turn of a logged chat prompt (token ids of ``tokenizer.encode_chat``): the decoded
    prompt with the chat template around ``behavior.SYSTEM_PROMPT`` and the user text cut off; the
    whole decoded prompt (special tokens skipped) when it does not have that shape (e.g. truncated)."""
    text = tok.decode(prompt_ids, skip_special_tokens=False)
    head, sep, tail = tok_lib.chat_prompt(tok, behavior.SYSTEM_PROMPT, "\x00").partition("\x00")
    if sep and text.startswith(head) and text.endswith(tail) and len(text) >= len(head) + len(tail):
        return text[len(head):len(text) - len(tail)]
    return tok.decode(prompt_ids, skip_special_tokens=True)


def top_blamed(spec: RunSpec, paths: RunLayout, records: list, scores: dict[str, np.ndarray],
               pop: tables.Population, gt_ids: set[str]) -> dict:
    """What each method blames: for the |A| control and every sketch-reading estimator (weighted and
    ``:direction``), its ``evaluation.top_blamed`` highest-scored rollouts of the which-rollout population
    ``pop`` (``tables.top_ranked``), each with step, prompt and completion text (decoded with
    the run's tokenizer, cut at :data:`TEXT_CHARS`), reward, advantage, score and whether it is
    ground truth. The content of ``which_rollout_top.json`` (read by the report stage)."""
    tok = tok_lib.load_tokenizer(paths.sft_hf)
    est = lambda m: estimators.ESTIMATORS.get(estimators.base_method(m))  # noqa: E731
    methods = [estimators.ABS_ADVANTAGE_CONTROL] + [m for m in scores if est(m) and estimators.reads_sketches(est(m))]
    prompts: dict[tuple[int, ...], str] = {}

    def entry(i: int, score: float) -> dict:
        r = records[i]
        key = tuple(r.prompt_token_ids)
        if key not in prompts:
            prompts[key] = user_prompt_text(tok, r.prompt_token_ids)[:TEXT_CHARS]
        return {"rollout_id": r.rollout_id, "step": r.step, "prompt": prompts[key],
                "completion": tok.decode(r.completion_token_ids, skip_special_tokens=True)[:TEXT_CHARS],
                "reward": r.reward, "advantage": r.advantage, "score": score, "ground_truth": r.rollout_id in gt_ids}

    k = spec.evaluation.top_blamed
    top = {m: [entry(int(i), float(scores[m][i])) for i in tables.top_ranked(scores[m], pop.mask, k)]
           for m in methods if m in scores}
    return {"seed": spec.seed, "population": {"n": pop.n, "gt": pop.k, "chance": pop.chance},
            "methods": top}


# ------------------------------------------------------------------------------------------------
# several behaviours (behavior/behaviors.py)
# ------------------------------------------------------------------------------------------------
def _suffixed(rows: list[formats.Row], table_suffix: str) -> list[formats.Row]:
    return [dataclasses.replace(r, table=r.table + table_suffix) for r in rows]


def write_behavior_release(spec: RunSpec, paths: RunLayout, beh: behaviors_lib.Behavior,
                           records: list, step_sketches: np.ndarray, scores: dict[str, np.ndarray]) -> pathlib.Path:
    """``release/<id>/seed{S}/`` for another behaviour, in the paper's release format (as
    :func:`write_release`): its ground truth, its targets' score file, its draws' rows files.
    Readable alone by the paper's tools (``reproduce(release/<id>)``). Returns the folder."""
    ids = [r.rollout_id for r in records]
    steps = np.array([r.step for r in records], np.int64)
    gt_path = paths.behavior_ground_truth(beh.suffix)
    gt_ids = [e["rollout_id"] for e in formats.read_ground_truth(gt_path)]
    step_norms = {s: float(v) for s, v in enumerate(np.linalg.norm(step_sketches.astype(np.float64), axis=1))}
    header = tables.score_file_header(f"{spec.run_name}__{beh.id}", spec.seed, ids, steps, gt_ids,
                                      step_norms, final_rewards=np.array([r.reward for r in records]),
                                      group_size=spec.grpo.group_size, early_cutoff=spec.early_cutoff(beh))
    out = paths.behavior_release(beh.id, spec.seed)
    behavior = {"id": beh.id, "trigger": beh.trigger, "pattern": beh.pattern, "implant": beh.implant,
                "bonus_reward": beh.bonus_reward, "fraction": beh.fraction,
                "early_step_cutoff": beh.early_step_cutoff, "window_start": beh.window_start,
                "prompt_gated": beh.prompt_gated, "hash_stream": beh.stream}
    _write_release_folder(spec, out, header, ids, steps, scores, gt_path, paths.draws / beh.id,
                          extra_header={"behavior": behavior})
    return out


def behavior_results(spec: RunSpec, paths: RunLayout,
                     texts: list[str] | None = None) -> tuple[list[formats.Row], dict]:
    """Every other behaviour's tables and the specificity tables of a multi-behaviour run.

    For each behaviour B after the first: its release folder (:func:`write_behavior_release`), the
    tables ``reproduce`` computes from it, its which-rollout and training-rollout tables, all with
    table names suffixed ``@<id>``, and its decision rules / checklist; each behaviour's text control
    judges ``texts`` (:func:`completion_texts` of the log, read when None) by its own pattern. Then
    the specificity rows
    (``attribution.specificity``) at step level (step sketches, each behaviour's early_nonzero
    population) and, with in-run rollout sketches, at rollout level, and their verdicts.

    Returns:
        (rows, {"behaviors": {id: verdicts.json dict}, "specificity": [verdict dicts]}).
    """
    behs = list(spec.behaviors)
    records = list(rollout_log.read_rollouts(paths.rollouts))
    ids = [r.rollout_id for r in records]
    steps = np.array([r.step for r in records], np.int64)
    log = training_log_inputs(records, ids)
    texts = completion_texts(paths, records) if texts is None else texts
    step_sk = read_complete(paths.sketch_store("step_sketches")).read()
    roll_sk = read_rollout_sketches(spec.scores, paths) if spec.step.in_run_rollouts else None
    step_norms = {s: float(v) for s, v in enumerate(np.linalg.norm(step_sk.astype(np.float64), axis=1))}
    nonzero = np.isin(steps, np.asarray(tables.nonzero_steps_from_norms(step_norms), np.int64))
    rows: list[formats.Row] = []
    out: dict = {"behaviors": {}}
    gt, pops, step_scores, roll_scores, ceilings = {}, {}, {}, {}, {}
    for beh in behs:
        target_path = paths.behavior_targets(beh.suffix)
        gt_ids = {e["rollout_id"] for e in formats.read_ground_truth(paths.behavior_ground_truth(beh.suffix))}
        gt[beh.id] = np.array([i in gt_ids for i in ids])
        pops[beh.id] = (steps < spec.early_cutoff(beh)) & nonzero
        b_log = dict(log, pattern_matches=contaminator.pattern_matches(texts, beh.pattern))
        step_scores[beh.id] = target_store_scores(spec.scores, target_path, step_sk, ids, steps, **b_log)
        if roll_sk is not None:
            roll_scores[beh.id] = rollout_method_scores(spec.scores, target_path, roll_sk, ids, steps, **b_log)
        if gt[beh.id][pops[beh.id]].any():
            p = pops[beh.id]
            ceilings[beh.id] = metrics.precision_ceiling_fractional(steps[p], gt[beh.id][p],
                                                                               int(gt[beh.id][p].sum()))
        if beh.first:
            continue
        write_behavior_release(spec, paths, beh, records, step_sk, step_scores[beh.id])
        b_rows, out["behaviors"][beh.id] = _behavior_tables(spec, paths, beh, gt_ids, ids, steps,
                                                            roll_scores.get(beh.id), advantages=log["advantages"])
        rows += b_rows
    usable = [b.id for b in behs if gt[b.id][pops[b.id]].any()]
    spec_rows: list[formats.Row] = []
    if len(usable) >= 2:
        spec_rows = _specificity_rows(spec, steps, {k: pops[k] for k in usable}, {k: gt[k] for k in usable},
                                      step_scores, roll_scores if roll_sk is not None else None, ceilings)
    else:
        logging.warning("evaluate: specificity needs ground truth of >= 2 behaviours in their windows; have %s", usable)
    out["specificity"] = [v.to_dict() for v in specificity.specificity_verdicts(spec_rows)]
    return rows + spec_rows, out


def _behavior_tables(spec: RunSpec, paths: RunLayout, beh: behaviors_lib.Behavior,
                     gt_ids: set[str], ids: list[str], steps: np.ndarray,
                     roll_scores: dict[str, np.ndarray] | None, *, advantages: np.ndarray
                     ) -> tuple[list[formats.Row], dict]:
    """Another behaviour's tables (names suffixed ``@<id>``) from its release folder, which-rollout
    (``roll_scores``: its rollout-sketch scores of the log's ``ids`` / ``steps``; None without in-run
    rollout sketches) and training-rollout tables, and its verdicts.json dict (with ``gt_size``)."""
    ev = spec.evaluation
    if not gt_ids:
        logging.warning("evaluate: behaviour %s has no ground truth (no bonus was paid); no tables", beh.id)
        return [], {"decision_rules": [], "checklist": [], "gt_size": 0}
    rep = reproduce.reproduce(paths.release / beh.id, nboot=ev.nboot, early_cutoff=spec.early_cutoff(beh),
                              delta=ev.fluency_match_delta, step_margin=ev.step_margin,
                              max_ci_width=ev.max_ci_width, min_matched_pairs=ev.min_matched_pairs,
                              rollouts_per_step=spec.step.shapes.num_rollouts)
    b_rows = list(rep.rows)
    if roll_scores is not None:
        sd = rep.seeds[0]
        b_rows += tables.which_rollout_tables(sd.label, ids, steps, sorted(gt_ids), roll_scores,
                                              nonzero_steps=sd.header["nonzero_steps"],
                                              early_cutoff=spec.early_cutoff(beh), nboot=ev.nboot,
                                              rng_seed=spec.seed, advantages=advantages)
    b_rows += training_rollout_tables(spec, paths, beh, nboot=ev.nboot)
    b_rules, b_check = evaluate_verdicts(b_rows, rep, spec.evaluation)
    return _suffixed(b_rows, beh.table_suffix), dict(verdicts_json(b_rules, b_check), gt_size=len(gt_ids))


def _specificity_rows(spec: RunSpec, steps: np.ndarray, pops: dict[str, np.ndarray],
                      gt: dict[str, np.ndarray], step_scores: dict, roll_scores: dict | None,
                      ceilings: dict[str, float]) -> list[formats.Row]:
    """The specificity rows (``attribution.specificity``) of the behaviours of ``pops`` / ``gt`` (those
    with ground truth in their window), at step level and, given ``roll_scores``, at rollout level."""
    ev, label = spec.evaluation, str(spec.seed)

    def scored(d: dict) -> dict:
        """One method's scores under two targets: the weighted sketch methods with norm-only and random
        (the controls that read the training log, ``estimators.log_control`` and ``norm/|A|``, and the
        direction variants, are left out)."""
        return {k: {m: x for m, x in d[k].items() if not estimators.is_direction(m) and not estimators.log_control(m)
                    and not {"advantages", "rewards"} & set(estimators.ESTIMATORS[m].params)} for k in pops}

    rows = specificity.specificity_rows(label, "step", steps, pops, gt, scored(step_scores), nboot=ev.nboot,
                                        rng_seed=spec.seed, ceiling={k: ceilings[k] for k in pops})
    if roll_scores is not None:
        rows += specificity.specificity_rows(label, "rollout", steps, pops, gt, scored(roll_scores),
                                             nboot=ev.nboot, rng_seed=spec.seed)
    return rows
