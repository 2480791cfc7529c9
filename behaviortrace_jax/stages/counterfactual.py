"""The ``counterfactual`` stage: leave-top-k-out and LDS by counterfactual GRPO replay.

Does removing the rollouts an estimator names remove the behaviour? For every registered
step-level estimator (scores from the in-run per-rollout sketches when the run has them, else
from the step sketches, where a step's rollouts tie), for the ground truth itself (``oracle``)
and for random k-subsets (``counterfactual.random_seeds`` seeds), the top-k rollouts of the
contamination window (steps < ``contamination.early_step_cutoff``) are removed, the run is
replayed (:mod:`train.replay`: logged rollouts, same step, weight 0 for removed rollouts; off-policy
after the first change) and the behaviour measured. ``k`` in ``counterfactual.k_fractions`` x |GT|.

Behaviour = teacher-forced log-prob margin of the pattern continuation (probe - control,
``replay.BehaviorMeasure``) at ``counterfactual.measure`` ("window", the default: the end of the
contamination window, where the replay stops; "target": the checkpoint nearest ``draws.target_step``;
"end": the end of the run, ~5x the replay time at tiny scale). Each replay also records the
behaviour at the target checkpoint, the greedy and (``counterfactual.sampled``) sampled rates.
Δ = behaviour(no removal) - behaviour(removal): positive when the behaviour decreased.

Rows appended to ``results_table.csv`` (earlier rows of these tables for this seed are replaced):

* ``counterfactual_topk``: ``method`` = estimator name, ``oracle`` or ``random``; ``value`` = Δ;
  ``n`` = k; ``chance`` = the random subsets' mean Δ at that k; ``ceiling`` = the oracle's Δ
  (ratio to oracle = value / ceiling); for ``random``, ``lo``/``hi`` = mean ∓ sd over seeds.
* ``lds``: for every scored estimator (not only ``counterfactual.methods``, which picks whose
  top-k are replayed), M = ``counterfactual.lds_subsets`` random half-subsets of the window replayed;
  ``value`` = Spearman(predicted, measured behaviour), predicted = the sum of the estimator's
  scores over the kept rollouts; ``lo``/``hi`` = bootstrap CI over subsets; ``n`` = M.
* ``lds_drop<f>`` (e.g. ``lds_drop0.05``): the same with ``counterfactual.lds_small_subsets``
  random subsets of ``round(f x |window|)`` rollouts removed, for each fraction f != 0.5 of
  ``counterfactual.lds_fractions`` (a first-order estimator is most informative at small f).

* ``counterfactual_topk_recomputed`` (``counterfactual.topk_recomputed``, on by default): the same
  leave-top-k-out replays (oracle, estimators, random subsets) with each group's advantages
  recomputed over its kept rollouts (``replay.recomputed_advantages``), so that a removed bonus
  rollout no longer sets its group-mates' baselines; same columns. By default the replays keep the
  logged advantages (``counterfactual.recompute_advantages`` = False; True recomputes them for
  ``counterfactual_topk`` and ``lds`` too, and the recomputed table is then not written twice).

Interventions and rollouts (``train/replay.py``): ``counterfactual.intervention`` = "remove" (weight
0) or "withhold-bonus" (the rollout stays, its bonus is withheld, its step's advantages recomputed);
``counterfactual.rollouts`` = "fixed" (the logged rollouts) or "regenerated" (sampled from the
replayed policy after the first intervened step, with the run's sampler, reward and contaminator).

The causal ground truth (``counterfactual.causal`` = "on" (default) / "only" / "off"): single-unit
replays of the window's steps (or groups) for both interventions, fixed and (with
``rollouts = "regenerated"``) regenerated rollouts over ``counterfactual.causal_streams`` sampler
streams (``train/causal.py``), and the ``causal_*`` tables scoring every method against them
(``attribution/causal.py``); files under ``counterfactual/causal/``.

Resumable per replay: each replay's result is one JSON file under ``counterfactual/replays/``,
written atomically; a killed stage reruns only the missing ones, and the tables are rebuilt from
the files, so the rerun's table is bit-identical. Each file records its cache key
(:func:`cache_key`: removed rollouts, measured steps, advantages, and the replay's
``Replayer.identity``: code version, step spec, optimizer, rollout log, measure settings); a file
whose key differs from the one the stage asks for is stale and is replayed again (logged).
"""
from __future__ import annotations

import dataclasses
import io
import urllib.parse

import ml_collections
import numpy as np
from absl import logging
from etils import epath

from behaviortrace_jax.attribution import causal as causal_tables, estimators, formats, metrics as M, verdicts
from behaviortrace_jax.attribution.scores import step_method_scores
from behaviortrace_jax.behavior import contaminator
from behaviortrace_jax.io import rollout_log
from behaviortrace_jax.io.cache import stale_fields  # the one rule of every keyed cache (io/cache.py)
from behaviortrace_jax.io.files import atomic_write_text, read_json, write_json
from behaviortrace_jax.io.layout import RunLayout
from behaviortrace_jax.models import tokenizer as tok_lib
from behaviortrace_jax.stages.registry import register_stage
from behaviortrace_jax.stages.spec import RunSpec

TABLES = ("counterfactual_topk", "counterfactual_topk_recomputed", "lds")
LDS_DROP = "lds_drop"  # table prefix of the LDS at a drop fraction other than 0.5
SECTION_MARK = "<!-- counterfactual -->"
RECOMPUTED = "__recomputed"  # key suffix of the leave-top-k-out replays with recomputed advantages
CAUSAL = ("on", "off", "only")  # counterfactual.causal: the causal ground truth too, not, or alone


def is_table(table: str) -> bool:
    """Whether ``table`` is one this stage writes (``counterfactual_topk``, ``lds``, ``lds_drop<f>``,
    ``causal_*``)."""
    return table in TABLES or table.startswith(LDS_DROP) or causal_tables.is_table(table)


# ------------------------------------------------------------------------------------------------
# Pure helpers (numpy; tested on toy problems)
# ------------------------------------------------------------------------------------------------
def top_k(scores: np.ndarray, candidates: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` highest ``scores`` among ``candidates`` (ties: lower index first)."""
    cand = np.asarray(candidates, np.int64)
    s = np.asarray(scores, np.float64)[cand]
    order = np.lexsort((cand, -s))
    return np.sort(cand[order[:k]])


def replayed_methods(scores: dict[str, np.ndarray], methods: str) -> dict[str, np.ndarray]:
    """The estimators whose rankings are replayed: ``counterfactual.methods`` ("" = every one scored,
    else a comma list of method names, e.g. ``"C1-dot,C1-dot:direction,abs-advantage"``), always
    without ``random`` (the random subsets replace it). Raises ValueError naming unknown methods."""
    names = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = sorted(set(names) - set(scores))
    if unknown:
        raise ValueError(f"counterfactual.methods: {unknown} are not scored methods; scored: {sorted(scores)}")
    keep = names or [m for m in scores if m != "random"]
    return {m: scores[m] for m in keep if m != "random"}


def removal_weights(n: int, removed: np.ndarray) -> np.ndarray:
    """float32 [n] ones with 0 at ``removed``."""
    w = np.ones(n, np.float32)
    w[np.asarray(removed, np.int64)] = 0.0
    return w


def half_subsets(candidates: np.ndarray, m: int, seed: int) -> list[np.ndarray]:
    """``m`` random subsets of ``candidates`` of size ``len // 2`` each (the REMOVED halves), sorted."""
    rng = np.random.default_rng(seed)
    cand = np.asarray(candidates, np.int64)
    return [np.sort(rng.choice(cand, cand.size // 2, replace=False)) for _ in range(m)]


def lds_fractions(spec: str) -> list[float]:
    """``counterfactual.lds_fractions`` ("0.01,0.05,0.1,0.5") -> sorted distinct fractions in (0, 1).

    Raises:
        ValueError: naming the key for a value that is not a number in (0, 1).
    """
    try:
        out = sorted({float(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"config.counterfactual.lds_fractions={spec!r}: expected comma-separated numbers") from None
    if any(not 0.0 < f < 1.0 for f in out):
        raise ValueError(f"config.counterfactual.lds_fractions={spec!r}: fractions must lie in (0, 1)")
    return out


def drop_subsets(candidates: np.ndarray, fraction: float, m: int, seed: int) -> list[np.ndarray]:
    """``m`` random subsets of ``max(1, round(fraction * len))`` ``candidates`` each (the REMOVED
    rollouts), sorted; one stream per (seed, subset size)."""
    cand = np.asarray(candidates, np.int64)
    k = max(1, int(round(fraction * cand.size)))
    rng = np.random.default_rng([int(seed), k])
    return [np.sort(rng.choice(cand, k, replace=False)) for _ in range(m)]


def lds_table(key: str) -> str | None:
    """The LDS table of a replay key: ``lds000`` -> ``lds`` (half-subsets), ``lds_drop0.05_003`` ->
    ``lds_drop0.05``; None for a key that is not an LDS subset."""
    if key.startswith(LDS_DROP):
        return key.rsplit("_", 1)[0]
    return "lds" if key.startswith("lds") and key[3:].isdigit() else None


def predicted_effect(scores: np.ndarray, candidates: np.ndarray, removed: np.ndarray) -> float:
    """Sum of ``scores`` over the kept candidates (candidates not in ``removed``); -inf/nan count 0."""
    s = np.asarray(scores, np.float64)
    kept = np.setdiff1d(np.asarray(candidates, np.int64), np.asarray(removed, np.int64))
    v = s[kept]
    return float(np.sum(np.where(np.isfinite(v), v, 0.0)))


def lds(predicted: np.ndarray, measured: np.ndarray, *, nboot: int, seed: int) -> tuple[float, float, float]:
    """Spearman LDS of predicted vs measured behaviour and a percentile bootstrap 95% CI over subsets."""
    p, a = np.asarray(predicted, np.float64), np.asarray(measured, np.float64)
    rho = M.lds_correlation(p, a)
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(nboot):
        i = rng.integers(0, p.size, p.size)
        boots.append(M.lds_correlation(p[i], a[i]))
    lo, hi = np.percentile(boots, [2.5, 97.5]) if boots else (np.nan, np.nan)
    return rho, float(lo), float(hi)


# ------------------------------------------------------------------------------------------------
# The stage
# ------------------------------------------------------------------------------------------------
def plan(config: ml_collections.ConfigDict, rollout_ids: list[str], rollout_steps: np.ndarray, gt_ids: list[str],
         scores: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every replay of the stage: ``{key: removed rollout indices}`` (key "full" removes nothing)."""
    cf = config.counterfactual
    window = np.flatnonzero(rollout_steps < config.contamination.early_step_cutoff)
    index = {r: i for i, r in enumerate(rollout_ids)}
    gt = np.array(sorted(index[g] for g in gt_ids if g in index), np.int64)
    gt = gt[rollout_steps[gt] < config.contamination.early_step_cutoff]
    ks = sorted({max(1, int(round(f * gt.size))) for f in (float(x) for x in cf.k_fractions.split(","))}) if gt.size else []
    out: dict[str, np.ndarray] = {"full": np.zeros(0, np.int64)}
    for k in ks:
        out[f"oracle__k{k}"] = gt[:k] if k < gt.size else gt  # GT is unranked: the first k in log order
        for name, s in scores.items():
            out[f"{name}__k{k}"] = top_k(s, window, k)
        for seed in range(int(cf.random_seeds)):
            rng = np.random.default_rng([int(config.seed), seed, k])
            out[f"random{seed}__k{k}"] = np.sort(rng.choice(window, k, replace=False))
    for f in lds_fractions(cf.lds_fractions):
        if f == 0.5:  # the half-subsets of table ``lds`` (their keys and draws unchanged)
            for j, sub in enumerate(half_subsets(window, int(cf.lds_subsets), int(config.seed))):
                out[f"lds{j:03d}"] = sub
            continue
        for j, sub in enumerate(drop_subsets(window, f, int(cf.lds_small_subsets), int(config.seed))):
            out[f"{LDS_DROP}{f:g}_{j:03d}"] = sub
    return out


def replay_jobs(config: ml_collections.ConfigDict, removed: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, bool]]:
    """Every replay to run: ``{key: (removed indices, recompute_advantages)}``. The keys of
    :func:`plan` with ``counterfactual.recompute_advantages``, plus, with
    ``counterfactual.topk_recomputed`` (and logged advantages above), each leave-top-k-out key
    (``*__k<k>``) again as ``<key>__recomputed`` with recomputed advantages. Under
    ``counterfactual.intervention = "withhold-bonus"`` the advantages are always recomputed (with the
    run's own function), so there is neither choice nor second copy."""
    cf = config.counterfactual
    rec = bool(cf.recompute_advantages) and cf.intervention == "remove"
    jobs = {key: (rem, rec) for key, rem in removed.items()}
    if bool(cf.topk_recomputed) and not rec and cf.intervention == "remove":
        jobs.update({key + RECOMPUTED: (rem, True) for key, rem in removed.items() if "__k" in key})
    return jobs


def cache_key(identity: dict, removed: np.ndarray, measure_steps: list[int], measure_step: int,
              recompute: bool, intervention: str = "remove", rollouts: str = "fixed") -> dict:
    """The cache key of one replay: ``identity`` (``Replayer.identity()``) plus the intervened
    rollout indices (``removed``: removed, or their bonus withheld), the measured steps, the step
    the tables read, the advantages choice, the intervention and the rollouts (JSON types)."""
    return dict(identity, removed=[int(i) for i in removed], measure_steps=[int(s) for s in measure_steps],
                measure_step=int(measure_step), recompute_advantages=bool(recompute), intervention=intervention,
                rollouts=rollouts)


def recomputed_rows(seed: str, results: dict[str, dict], removed: dict[str, np.ndarray],
                    scores: dict[str, np.ndarray], window: np.ndarray, *, nboot: int) -> list[formats.Row]:
    """The ``counterfactual_topk_recomputed`` rows: :func:`tables` over the ``*__recomputed``
    replays (against the same unremoved ``full`` replay); empty when there are none."""
    rec = {k[:-len(RECOMPUTED)]: v for k, v in results.items() if k.endswith(RECOMPUTED)}
    if not rec:
        return []
    rows = tables(seed, {"full": results["full"], **rec}, removed, scores, window, nboot=nboot)
    return [dataclasses.replace(r, table="counterfactual_topk_recomputed") for r in rows
            if r.table == "counterfactual_topk"]


def tables(seed: str, results: dict[str, dict], removed: dict[str, np.ndarray], scores: dict[str, np.ndarray],
           window: np.ndarray, *, nboot: int) -> list[formats.Row]:
    """The ``counterfactual_topk``, ``lds`` and ``lds_drop<f>`` rows from the replay results (see
    the module docstring)."""
    base = results["full"]["value"]
    drop = {k: base - r["value"] for k, r in results.items()}
    rows: list[formats.Row] = []
    ks = sorted({int(k.split("__k")[1]) for k in results if "__k" in k})
    for k in ks:
        rnd = np.array([drop[key] for key in drop if key.startswith("random") and key.endswith(f"__k{k}")])
        oracle = drop.get(f"oracle__k{k}")
        chance = float(rnd.mean()) if rnd.size else None
        for name in ["oracle", *scores]:
            if f"{name}__k{k}" in drop:
                rows.append(formats.Row(seed, "counterfactual_topk", name, drop[f"{name}__k{k}"], chance=chance,
                                        ceiling=oracle, n=k))
        if rnd.size:
            sd = float(rnd.std(ddof=1)) if rnd.size > 1 else 0.0
            rows.append(formats.Row(seed, "counterfactual_topk", "random", chance, chance - sd, chance + sd, chance,
                                    oracle, k))
    groups: dict[str, list[str]] = {}
    for key in sorted(results):
        if lds_table(key) is not None:
            groups.setdefault(lds_table(key), []).append(key)
    for table in sorted(groups, key=lambda t: (t != "lds", t)):
        subsets = groups[table]
        if len(subsets) < 2:
            continue
        measured = np.array([results[k]["value"] for k in subsets])
        for name, s in scores.items():
            if not M.lds_evaluable(s, window):  # no score in the window: NaN, not a tie's 0 (metrics.lds_evaluable)
                rows.append(formats.Row(seed, table, name, float("nan"), None, None, 0.0, 1.0, len(subsets)))
                continue
            pred = np.array([predicted_effect(s, window, removed[k]) for k in subsets])
            rho, lo, hi = lds(pred, measured, nboot=nboot, seed=int(seed.split("_")[0]) if seed[:1].isdigit() else 0)
            rows.append(formats.Row(seed, table, name, rho, lo, hi, 0.0, 1.0, len(subsets)))
    return rows


def report_section(rows: list[formats.Row], figure: str | None, step: int | None = None,
                   advantages: str = "logged", more_figures: tuple[str, ...] = ()) -> str:
    """Markdown section for report.md; ``advantages``: those of the ``counterfactual_topk`` replays
    ("logged" or "recomputed", ``counterfactual.recompute_advantages``); ``more_figures``: further
    figure links (the recomputed-advantages plot)."""
    lines = [SECTION_MARK, "## Counterfactual replay (leave-top-k-out, LDS)", "",
             "Δ = behaviour (pattern log-prob margin, probe - control"
             + (f", after {step} replayed steps" if step is not None else "")
             + ") of the replay without removal minus with "
             "the top-k window rollouts removed; positive = the behaviour decreased. Replay is off-policy after the "
             "first removal (logged rollouts). Advantages: \"logged\" = as the run logged them (a removed bonus "
             "rollout still sets its group-mates' baselines), \"recomputed\" = each group's baseline recomputed "
             "over its kept rollouts.", "",
             "| seed | advantages | method | k | Δ | Δ / oracle Δ | random mean |", "|---|---|---|---|---|---|---|"]
    for table, adv in (("counterfactual_topk", advantages), ("counterfactual_topk_recomputed", "recomputed")):
        for r in (r for r in rows if r.table == table):
            ratio = "" if not r.ceiling else f"{r.value / r.ceiling:.3f}"
            lines.append(f"| {r.seed} | {adv} | {r.method} | {r.n} | {r.value:.4f} | {ratio} | "
                         f"{'' if r.chance is None else f'{r.chance:.4f}'} |")
    for (seed, table), hits in verdicts.answered_by_log(rows).items():
        lines += ["", f"**Answered by the log** (seed {seed}, `{table}`): "
                  + ", ".join(f"`{r.method}` at k = {r.n} reaches {r.value / r.ceiling:.3f} of the oracle's Δ" for r in hits)
                  + f" (≥ {estimators.ANSWERED_FRACTION:g}): a control that reads the training log alone removes the "
                  "behaviour about as well as removing the ground truth does."]
    lds_rows = [r for r in rows if r.table == "lds" or r.table.startswith(LDS_DROP)]
    if lds_rows:
        lines += ["", "LDS: Spearman of the predicted effect (sum of an estimator's scores over the kept window "
                  "rollouts) vs the replayed behaviour, over M random subsets of the given drop fraction; "
                  "`metagradient` is not a sketch method (dM/dw differentiated through the replayed run).", "",
                  "| seed | method | drop fraction | LDS (Spearman) | 95% CI | M |", "|---|---|---|---|---|---|"]
        lines += [f"| {r.seed} | {r.method} | {0.5 if r.table == 'lds' else r.table[len(LDS_DROP):]} | "
                  + (f"{r.value:.3f} | [{r.lo:.3f}, {r.hi:.3f}] |" if np.isfinite(r.value) else
                     "not evaluable (no score in the window) | |") + f" {r.n} |" for r in lds_rows]
    lines += causal_tables.report_lines(rows)
    if figure:
        lines += ["", f"![counterfactual]({figure})"]
    lines += [f"![counterfactual]({f})" for f in more_figures]
    return "\n".join(lines) + "\n"


def plot(rows: list[formats.Row], path: epath.Path, table: str = "counterfactual_topk") -> epath.Path | None:
    """Δbehaviour vs k per method, the oracle, and the random mean ± sd band (rows of ``table``)."""
    topk = [r for r in rows if r.table == table]
    if not topk:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in dict.fromkeys(r.method for r in topk):
        rs = sorted((r for r in topk if r.method == m), key=lambda r: r.n)
        ks, v = [r.n for r in rs], [r.value for r in rs]
        if m == "random":
            ax.fill_between(ks, [r.lo for r in rs], [r.hi for r in rs], color="grey", alpha=0.3, label="random ± sd")
        ax.plot(ks, v, marker="o", label=m, color="black" if m == "oracle" else None,
                linestyle="--" if m in ("oracle", "random") else "-")
    ax.set_xlabel("k (window rollouts removed)")
    ax.set_ylabel("Δ behaviour (log-prob margin drop)")
    ax.set_title(table, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write_text(path, buf.getvalue())  # the writer process only; local or gs://
    return path


def replay_path(out_dir: epath.Path, key: str) -> epath.Path:
    """``out_dir/<key>.json`` with the key percent-encoded (``urllib.parse.quote``), so a method
    name such as ``norm/|A|`` or ``C1-dot:direction`` names one file in ``out_dir`` (plain keys
    keep their names)."""
    return out_dir / f"{urllib.parse.quote(key, safe='-_.')}.json"


def measure_step(config: ml_collections.ConfigDict) -> int:
    """The step whose behaviour the tables report (``counterfactual.measure``): "window" = the end of
    the contamination window (``contamination.early_step_cutoff``, capped at the run's length; the
    replay stops there), "target" = the checkpoint nearest ``draws.target_step``, "end" = the run's end."""
    return RunSpec.from_config(config).schedule.measure_step(config.counterfactual.measure)


def method_scores(config: ml_collections.ConfigDict, paths: RunLayout, rollout_ids: list[str],
                  steps: np.ndarray) -> dict[str, np.ndarray]:
    """Every step-level estimator's per-rollout scores {method: float64 [N], log order}, as the
    ``evaluate`` stage scores them (``attribution.scores.step_method_scores``: in-run rollout sketches
    when the run has them, else step sketches), the reward-only, text and length controls included;
    the text control judges the logged completions as the grpo stage did (the first behaviour's
    pattern, ``behavior.contaminator.pattern_matches``)."""
    records = list(rollout_log.read_rollouts(paths.rollouts))
    texts = contaminator.logged_texts(tok_lib.load_tokenizer(paths.sft_hf), records)
    matches = contaminator.pattern_matches(texts, RunSpec.from_config(config).first_behavior.pattern)
    return step_method_scores(RunSpec.from_config(config).scores, paths, rollout_ids, steps, pattern_matches=matches,
                              per_rollout=bool(config.sketch.in_run_rollouts), records=records)


@register_stage("counterfactual")
def counterfactual_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Leave-top-k-out and LDS replays of one finished run (see the module docstring)."""
    from behaviortrace_jax.train import causal as TC, replay as R

    w = RunLayout(workdir)
    out_dir = w.counterfactual_replays
    out_dir.mkdir(parents=True, exist_ok=True)
    cf = config.counterfactual
    for key, value, allowed in (("causal", cf.causal, CAUSAL), ("intervention", cf.intervention, R.INTERVENTIONS),
                                ("rollouts", cf.rollouts, R.ROLLOUTS),
                                ("causal_regenerated", cf.causal_regenerated, TC.REGENERATED)):
        if value not in allowed:
            raise ValueError(f"config.counterfactual.{key}={value!r}; expected one of {allowed}")
    spec = RunSpec.from_config(config)
    rp = R.Replayer(spec.replay, workdir, layout=spec.layout, rates=bool(cf.rates), sampled=int(cf.sampled))
    steps = np.array([rollout_log.parse_rollout_id(r)[0] for r in rp.rollout_ids], np.int64)
    gt_ids = [e["rollout_id"] for e in formats.read_ground_truth(rp.paths.ground_truth)]
    # Every step-level estimator, as the evaluate stage scores them; ``random`` is left out below
    # (the random subsets replace it).
    scores = method_scores(config, rp.paths, rp.rollout_ids, steps)
    # The top-k replays follow ``counterfactual.methods``; the LDS needs no replays of its own (its
    # random subsets are shared), so every scored estimator gets LDS rows.
    removed = plan(config, rp.rollout_ids, steps, gt_ids, replayed_methods(scores, config.counterfactual.methods))
    scores = replayed_methods(scores, "")
    at = measure_step(config)
    window = np.flatnonzero(steps < config.contamination.early_step_cutoff)
    seed, nboot = str(int(config.seed)), int(config.evaluation.nboot)
    rows: list[formats.Row] = []
    if cf.causal != "only":
        jobs = replay_jobs(config, removed)
        run_replays(rp, jobs, out_dir, measure_steps=sorted({spec.schedule.target_checkpoint(), at}), at=at,
                    intervention=cf.intervention, rollouts=cf.rollouts)
        results = {k: read_json(replay_path(out_dir, k)) for k in jobs}
        main = {k: v for k, v in results.items() if not k.endswith(RECOMPUTED)}
        rows += tables(seed, main, removed, scores, window, nboot=nboot)
        rows += recomputed_rows(seed, results, removed, scores, window, nboot=nboot)
    if cf.causal != "off":
        rows += causal_rows(config, rp, w, scores, gt_ids, at, seed=seed, nboot=nboot)
    write_outputs(config, w, rows, at)


def causal_rows(config: ml_collections.ConfigDict, rp, w: RunLayout, scores: dict[str, np.ndarray],
                gt_ids: list[str], at: int, *, seed: str, nboot: int) -> list[formats.Row]:
    """The measured causal ground truth (``train/causal.py`` replays, ``attribution/causal.py``
    tables): every scored method against single-unit replays, both interventions, fixed rollouts
    and (``counterfactual.rollouts = "regenerated"``) regenerated ones over
    ``counterfactual.causal_streams`` sampler streams."""
    from behaviortrace_jax.train import causal as TC

    cf = config.counterfactual
    units = TC.causal_units(rp.schedule, rp.options.rollouts.group_size, rp.shapes.num_rollouts, cf.causal_units)
    index = {r: i for i, r in enumerate(rp.rollout_ids)}
    gt = np.array(sorted(index[g] for g in gt_ids if g in index), np.int64)
    results = TC.run_causal(rp, w.counterfactual / "causal", units=units, gt=gt, at=at, rollouts=cf.rollouts,
                            streams=int(cf.causal_streams), recompute=bool(cf.recompute_advantages),
                            regenerated=cf.causal_regenerated)
    is_gt = np.zeros(rp.num_rollouts, bool)
    is_gt[gt] = True
    return causal_tables.tables(seed, unit_names=units.names, unit_rollouts=units.rollouts,
                                effects=TC.effects(results, units, cf.rollouts, int(cf.causal_streams), cf.causal_regenerated),
                                label_deltas=TC.label_deltas(results, cf.rollouts, int(cf.causal_streams)),
                                scores=scores, is_gt=is_gt, k_fraction=float(cf.causal_k), nboot=nboot,
                                rng_seed=int(config.seed))


def run_replays(rp, jobs: dict[str, tuple[np.ndarray, bool]], out_dir: epath.Path, *, measure_steps: list[int],
                at: int, intervention: str = "remove", rollouts: str = "fixed") -> None:
    """Replays every job whose ``<key>.json`` is missing or stale (:func:`stale_fields`, logged)
    and writes it atomically: ``{"key", "removed", "value" (logp margin at step ``at``), "behavior"
    ({step: measure}), "seconds_per_step", "cache"`` (its :func:`cache_key`)``}``. ``intervention``:
    "remove" (weight 0) or "withhold-bonus" (the rollouts' bonuses withheld); ``rollouts``: "fixed"
    or "regenerated" (``replay.Replayer.run``)."""
    identity = rp.identity()
    for i, (key, (rem, recompute)) in enumerate(jobs.items()):
        path = replay_path(out_dir, key)
        want = cache_key(identity, rem, measure_steps, at, recompute, intervention, rollouts)
        stale = stale_fields(read_json(path) if path.exists() else None, want)
        if stale == []:
            continue
        if stale:
            logging.info("counterfactual: %s is stale (differs in %s); replaying it again", path.name, ", ".join(stale))
        kw = {} if rollouts == "fixed" else {"rollouts": rollouts}
        if intervention == "withhold-bonus":
            kw["withhold"] = rem
        else:
            kw.update(weights=removal_weights(rp.num_rollouts, rem), recompute_advantages=recompute)
        res = rp.run(measure_steps=measure_steps, **kw)
        beh = {str(s): v for s, v in res["behavior"].items()}
        write_json(path, {"key": key, "removed": rem.tolist(), "value": beh[str(at)]["logp_margin"],
                          "behavior": beh, "seconds_per_step": res["seconds_per_step"], "cache": want})
        logging.info("counterfactual: %d/%d %s -> %.4f (%.3f s/step)", i + 1, len(jobs), key,
                     beh[str(at)]["logp_margin"], res["seconds_per_step"])


def write_outputs(config: ml_collections.ConfigDict, w: RunLayout, rows: list[formats.Row], at: int) -> None:
    """This seed's rows into ``results_table.csv`` (replacing its earlier rows of :data:`TABLES`),
    the figures, ``counterfactual/report_section.md`` and that section of ``report.md``."""
    table = w.results_table
    old = formats.read_results_csv(table) if table.exists() else []
    keep = [r for r in old if not (is_table(r.table) and r.seed == str(int(config.seed)))]
    formats.write_results_csv(table, keep + rows)
    fig = plot(rows, w.figures / "counterfactual_topk.png")
    fig_rec = plot(rows, w.figures / "counterfactual_topk_recomputed.png", table="counterfactual_topk_recomputed")
    section = report_section(rows, "figures/counterfactual_topk.png" if fig else None, step=at,
                             advantages="recomputed" if config.counterfactual.recompute_advantages else "logged",
                             more_figures=("figures/counterfactual_topk_recomputed.png",) if fig_rec else ())
    atomic_write_text(w.counterfactual / "report_section.md", section)
    report = w.report
    text = report.read_text() if report.exists() else ""
    if SECTION_MARK in text:
        text = text[:text.index(SECTION_MARK)]
    atomic_write_text(report, text.rstrip("\n") + ("\n\n" if text else "") + section)
