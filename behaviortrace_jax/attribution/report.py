"""``report.md`` and matplotlib figures from evaluation rows (SPEC §10.5).

Every function takes :class:`~behaviortrace_jax.attribution.formats.Row` lists, so the same code renders
one run, the multi-seed aggregate, or the paper's released numbers (``reproduce``). Figures use
the Agg backend and are written atomically; a figure whose rows are absent is skipped.
"""
from __future__ import annotations

import io
import math
import os
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from etils import epath  # noqa: E402

from behaviortrace_jax.attribution import estimators, metrics  # noqa: E402
from behaviortrace_jax.attribution.formats import Row  # noqa: E402
from behaviortrace_jax.attribution.tables import STEP_TABLES  # noqa: E402
from behaviortrace_jax.attribution.verdicts import Verdict, answered_by_log  # noqa: E402
from behaviortrace_jax.io.files import atomic_write_text  # noqa: E402
from behaviortrace_jax.io.layout import as_path  # noqa: E402

HOW_TO_READ = """\
* **P@|GT|** (step level): tie-aware fractional precision at k = |ground truth| of the population.
  All rollouts of a step share the step's sketch, so they tie; a tied block at the cut-off earns
  credit in proportion (SPEC §6.3).
* **chance** = |GT|/N, what a random ranking earns. **ceiling** = the best P@|GT| of any ranker that
  cannot split a step (steps ordered by ground-truth density, SPEC §6.4). **headroom** = ceiling −
  chance: the whole range a step-level method can move in. **lift** = value/chance; **%ceil** =
  value/ceiling; **Δchance** = value − chance.
* `overall` ranks all rollouts, where zero-gradient steps hand the magnitude control a free win
  (the "cliff"); `early_nonzero` (PRIMARY) keeps rollouts of nonzero steps in the contamination
  window (SPEC §6.6).
* `which_rollout`: scores from per-rollout in-run sketches, so steps can be split: ceiling 1.0; the
  population is early_nonzero without the rollouts whose advantage is 0 (zero-variance groups, which
  taught nothing). `which_rollout_within_step`: AUC of GT vs non-GT rollouts of the same step
  (chance 0.5). A method's plain name scores the *weighted* rollout sketch clip_s x c_i x g_i (its
  real share of the update; c_i = A_i/(G·B) for the paper loss), `:direction` the advantage-free
  g_i = ∇(−mean log-prob_i) (SPEC §3.2's rollout loss); `norm/|A|` = |weighted sketch| / |A_i|.
* Reward-only controls read only the training log (no target, no gradient): `advantage` (A_i),
  `abs-advantage` (|A_i|), `reward`, and per step `step-sum-abs-advantage`, `step-reward-std`. The
  bonus defines the ground truth, so `reward` and `advantage` sit at (or near) the ceiling by
  construction; rollout-level rankers are not bound by the step-level ceiling either.
* Text and length controls read only the logged completion: `pattern-match` (1 if the decoded
  response contains the pattern, by the contaminator's judge; the ground truth is "eligible and
  matching", so it holds every ground-truth rollout among its ties), `length` (completion tokens),
  and per step `step-sum-pattern-match`, `step-sum-length`. An estimator "finds which rollout" only
  if it beats norm-only and every one of these log controls (reward-only, text, length) by the step
  margin.
* **answered by the log**: a table where some log control reaches ≥ 0.95 of the ceiling (of the
  oracle's Δ in `counterfactual_topk`). There the label is recovered from the training log alone,
  so a targeted method's value there says little about attribution (docs/concepts/replays.md).
* `metagradient` (when the `metagradient` stage ran) is a different kind of method: not a score on
  sketches but dM/dw_i, the behaviour measure differentiated through the replayed GRPO run
  (MAGIC-style; it needs the run's start state and rollout log); a step's score is the sum of its
  rollouts'. It is a `baseline` (outside the pre-registered rules).
* Rollout level: within-group AUC over (positive, negative) pairs of the same prompt draw, ties ½,
  pairs pooled (n = pairs). `mp_residualized` removes one pooled within-group fluency slope;
  `mp_matched` keeps pairs with |Δfluency| ≤ 0.10 (counts only with ≥ 100 pairs). [lo, hi] = 95 %
  cluster bootstrap over groups (SPEC §6.7-§6.10). `_diag` = swapped checkpoint/generation seeds.
* Verdicts: `pass` / `fail` / `not-evaluable` (the inputs lack the evidence), SPEC §6.11 and §8.
"""


# --------------------------------------------------------------------------------------------
# markdown
# --------------------------------------------------------------------------------------------
def _f(x, nd: int = 4) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _ci(r: Row) -> str:
    return f"{_f(r.value)} [{_f(r.lo)}, {_f(r.hi)}]" if r.lo is not None else _f(r.value)


def _cell(c) -> str:
    """A markdown table cell: ``|`` escaped, line breaks shown as ``↵``."""
    return str(c).replace("|", "\\|").replace("\r\n", "↵").replace("\n", "↵")


def _md_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(map(_cell, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def step_section(rows: Sequence[Row], tables: Sequence[str] = STEP_TABLES) -> str:
    """Markdown tables of the step-level rows (or those of ``tables``), one per (seed, table); a table
    that ``verdicts.answered_by_log`` names is marked "answered by the log" with its best control."""
    parts = []
    answered = answered_by_log(r for r in rows if r.table in tables)
    keys = list(dict.fromkeys((r.seed, r.table) for r in rows if r.table in tables))
    for seed, table in keys:
        sel = [r for r in rows if r.seed == seed and r.table == table]
        ch, ce = sel[0].chance, sel[0].ceiling
        head = f"**seed {seed}, `{table}`** — chance {_f(ch)}, ceiling {_f(ce)}"
        if ch is not None and ce is not None:
            head += f", headroom {_f(metrics.headroom(ce, ch))}"
        head += f", n = {sel[0].n}"
        hits = answered.get((seed, table))
        if hits:
            head += (" — **answered by the log**: " + ", ".join(f"`{r.method}` {_f(r.value)}" for r in hits)
                     + f" ≥ {estimators.ANSWERED_FRACTION:g} × ceiling")
        body = []
        for r in sel:
            lift = _f(metrics.lift(r.value, ch), 3) if ch else ""
            pct = _f(metrics.fraction_of_ceiling(r.value, ce), 3) if ce else ""
            body.append([r.method, _ci(r), _f(r.value - ch) if ch is not None else "", lift, pct, r.n])
        parts.append(head + "\n\n" + _md_table(["method", "value", "Δchance", "lift", "%ceil", "n"], body))
    return "\n\n".join(parts)


def rollout_section(rows: Sequence[Row]) -> str:
    """One markdown table per draw: raw, residualised and matched AUC with CIs and pair counts."""
    parts = []
    draws = list(dict.fromkeys((r.seed, r.table[len("mp_raw"):]) for r in rows if r.table.startswith("mp_raw")))
    draws += [d for d in dict.fromkeys((r.seed, r.table[len("mp_residualized"):]) for r in rows
                                       if r.table.startswith("mp_residualized")) if d not in draws]
    for seed, sfx in draws:
        sel = {(r.table, r.method): r for r in rows if r.seed == seed}
        methods = list(dict.fromkeys(r.method for r in rows if r.seed == seed and r.table in
                                     ("mp_raw" + sfx, "mp_residualized" + sfx, "mp_matched" + sfx)))
        body = []
        for m in methods:
            cells = []
            for t in ("mp_raw", "mp_residualized", "mp_matched"):
                r = sel.get((t + sfx, m))
                pairs = f" ({r.n} pairs)" if r is not None and t == "mp_matched" and r.n is not None else ""
                cells.append("" if r is None else _ci(r) + pairs)
            n = next((sel[(t + sfx, m)].n for t in ("mp_raw", "mp_residualized") if (t + sfx, m) in sel), "")
            body.append([m] + cells + [n])
        parts.append(f"**draw {seed}{sfx}**\n\n" + _md_table(["method", "raw AUC", "residualised AUC",
                                                                "matched AUC", "n pairs"], body))
    return "\n\n".join(parts)


WHICH_TABLES = ("which_rollout", "which_rollout_within_step")


def _best(rows: Sequence[Row], direction: bool) -> Row | None:
    """The best targeted (role primary) row of one (seed, table), weighted or ``:direction``."""
    prim = [r for r in rows if estimators.is_direction(r.method) == direction
            and getattr(estimators.ESTIMATORS.get(estimators.base_method(r.method)), "role", None) == "primary"]
    return max(prim, key=lambda r: r.value) if prim else None


def training_log_section(rows: Sequence[Row]) -> str:
    """Per seed, what the training log alone reveals next to the gradient methods: the which-rollout
    population (how many zero-advantage rollouts it drops), what ``advantage``, ``reward``,
    ``abs-advantage`` and the text and length controls reach there and what the log step controls
    reach in ``early_nonzero``."""
    parts = []
    for seed in dict.fromkeys(r.seed for r in rows if r.table == "which_rollout"):
        w = {r.method: r for r in rows if r.seed == seed and r.table == "which_rollout"}
        auc = {r.method: r for r in rows if r.seed == seed and r.table == "which_rollout_within_step"}
        e = {r.method: r for r in rows if r.seed == seed and r.table == "early_nonzero"}
        if not {"advantage", "reward", estimators.ABS_ADVANTAGE_CONTROL} <= set(w):
            continue
        any_w, any_e = next(iter(w.values())), next(iter(e.values()), None)
        k = round(any_w.chance * any_w.n)
        pop = f"{any_w.n} rollouts with A_i ≠ 0, |GT| = {k}, chance {_f(any_w.chance)}"
        if any_e is not None:
            pop += (f"; {any_e.n - any_w.n} rollouts of zero-variance groups dropped from the early_nonzero "
                    f"population, {round(any_e.chance * any_e.n) - k} of them ground truth")
        a = w[estimators.ABS_ADVANTAGE_CONTROL]
        text = (f"**What the training log alone reveals (seed {seed}).** The which-rollout population: {pop}. "
                f"Ranked by the signed advantage these rollouts reach P@|GT| = {_f(w['advantage'].value)}, by the "
                f"reward {_f(w['reward'].value)} (ceiling 1.0): the bonus defines the ground truth, so the log "
                "already shows which rollouts earned it, and this benchmark asks whether gradient methods "
                f"recover what the log already shows. |A_i| alone reaches {_f(a.value)}"
                + (f" (within-step AUC {_f(auc[a.method].value)})" if a.method in auc else "") + ".")
        text_ctl = [w[m] for m in estimators.TEXT_ROLLOUT_CONTROLS if m in w]
        if text_ctl:
            text += (" The completion alone (no reward): " + ", ".join(f"`{r.method}` {_f(r.value)}" for r in text_ctl)
                     + " (pattern-match: the response contains the pattern, by the contaminator's judge).")
        best = [(kind, b) for kind, b in (("weighted", _best(list(w.values()), False)),
                                          ("direction", _best(list(w.values()), True))) if b is not None]
        if best:
            text += " The best targeted method reaches " + " and ".join(
                f"{_f(b.value)} on {kind} sketches (`{b.method}`)" for kind, b in best)
            norm = w.get(estimators.STEP_NORM_CONTROL)
            text += f"; norm-only {_f(norm.value)}." if norm else "."
        steps = [e[m] for m in estimators.REWARD_ONLY_STEP_CONTROLS + estimators.TEXT_STEP_CONTROLS if m in e]
        if steps:
            b = _best(list(e.values()), False)
            text += (f" At step level (`early_nonzero`, ceiling {_f(steps[0].ceiling)}): "
                     + ", ".join(f"`{r.method}` {_f(r.value)}" for r in steps)
                     + (f"; the best targeted method (`{b.method}`) {_f(b.value)}." if b else "."))
        parts.append(text)
    return "\n\n".join(parts)


def _short(text: str, n: int) -> str:
    """``text`` on one line (line breaks as ``↵``, runs of spaces as one), cut to ``n`` characters."""
    text = " ".join(str(text).replace("\r\n", "↵").replace("\n", "↵").split())
    return text if len(text) <= n else text[:n - 1] + "…"


def top_blamed_section(top: dict | None, prompt_chars: int = 48, completion_chars: int = 72) -> str:
    """What each method blames (``which_rollout_top.json`` of the evaluate stage): per method its
    top rollouts of the which-rollout population with step, prompt, completion (shortened),
    reward, advantage and whether it is ground truth. "" without data."""
    if not top or not top.get("methods"):
        return ""
    pop = top.get("population", {})
    parts = [f"**Top-blamed rollouts (seed {top.get('seed')})**: each method's highest-scored rollouts of the "
             f"which-rollout population (n = {pop.get('n')}, |GT| = {pop.get('gt')}, so a random pick is ground "
             f"truth with probability {_f(pop.get('chance'), 3)}). GT = earned the bonus."]
    for method, entries in top["methods"].items():
        hits = sum(bool(x["ground_truth"]) for x in entries)
        body = [[i + 1, x["step"], _short(x["prompt"], prompt_chars), _short(x["completion"], completion_chars),
                 _f(x["reward"], 2), _f(x["advantage"], 3), "**GT**" if x["ground_truth"] else ""]
                for i, x in enumerate(entries)]
        parts.append(f"`{method}`: {hits} of {len(entries)} ground truth\n\n"
                     + _md_table(["#", "step", "prompt", "completion", "reward", "A", "GT"], body))
    return "\n\n".join(parts)


def which_rollout_section(rows: Sequence[Row], top: dict | None = None) -> str:
    """The "which rollout" section: what the training log alone reveals, the top-blamed rollouts
    (``top``), then the which_rollout and which_rollout_within_step tables. "" without those rows."""
    tables = step_section(rows, WHICH_TABLES)
    if not tables:
        return ""
    return "\n\n".join(x for x in (training_log_section(rows), top_blamed_section(top), tables) if x)


def other_section(rows: Sequence[Row]) -> str:
    """Generic table of the remaining rows (token-level means and any custom table), with an
    "answered by the log" column (the log controls reaching ≥ 0.95 of their row's ceiling)."""
    rest = [r for r in rows if not (r.table in STEP_TABLES or r.table.startswith(("which_rollout", "mp_")))]
    if not rest:
        return ""
    hits = {id(r) for v in answered_by_log(rest).values() for r in v}
    return _md_table(["seed", "table", "method", "value", "n", "answered by the log"],
                     [[r.seed, r.table, r.method, _ci(r), r.n, "**yes**" if id(r) in hits else ""] for r in rest])


HEADLINE_RULES = ("step rule (", "which-rollout rule (")


def headline_lines(decision_rules: Sequence[Verdict]) -> list[str]:
    """The console's closing lines of a run (``pipeline.run``, before the digests): every step-rule
    and which-rollout-rule verdict (SPEC §6.11 and its which-rollout analogue) with its evidence,
    which names the best targeted method, norm-only and the log controls (|A_i|, the reward, the
    text and length controls), and ends with "answered by the log" where their table is."""
    return [f"verdict {v.status}: {v.item} -- {v.evidence}" for v in decision_rules
            if v.item.startswith(HEADLINE_RULES)]


def verdict_section(verdicts: Sequence[Verdict]) -> str:
    """Markdown table of verdicts plus a pass/fail/not-evaluable count."""
    if not verdicts:
        return "_no verdicts_"
    counts = {k: sum(v.status == k for v in verdicts) for k in ("pass", "fail", "not-evaluable")}
    body = [[v.item, f"**{v.status}**", v.evidence] for v in verdicts]
    return (", ".join(f"{n} {k}" for k, n in counts.items()) + "\n\n"
            + _md_table(["item", "verdict", "evidence"], body))


def render_report(rows: Sequence[Row], *, title: str = "BehaviorTrace-JAX evaluation", intro: str = "",
                  rules: Sequence[Verdict] = (), checklist: Sequence[Verdict] = (),
                  figures: Sequence[str | os.PathLike] = (), extra: Sequence[tuple[str, str]] = (),
                  base_dir: str | os.PathLike | None = None, top_blamed: dict | None = None) -> str:
    """The text of ``report.md``: intro, how to read, tables, verdicts, figures, extra sections.

    Args:
        rows: evaluation rows; rules / checklist: :class:`verdicts.Verdict` lists; figures: image paths (linked
            relative to ``base_dir``); extra: (heading, markdown) sections appended at the end;
            top_blamed: ``which_rollout_top.json`` (:func:`top_blamed_section`), shown at the top of
            the which-rollout section.
    """
    out = [f"# {title}", intro.strip(), "## How to read\n\n" + HOW_TO_READ.strip()]
    for heading, body in (("Step-level tables", step_section(rows)),
                          ("Which rollout", which_rollout_section(rows, top_blamed)),
                          ("Rollout-level tables", rollout_section(rows)), ("Other rows", other_section(rows))):
        if body:
            out.append(f"## {heading}\n\n{body}")
    if rules:
        out.append("## Pre-registered decision rules (SPEC §6.11)\n\n" + verdict_section(rules))
    if checklist:
        out.append("## Evaluation checklist (SPEC §8)\n\n" + verdict_section(checklist))
    if figures:
        links = [os.path.relpath(f, base_dir) if base_dir else str(f) for f in figures]
        out.append("## Figures\n\n" + "\n".join(f"![{os.path.splitext(os.path.basename(x))[0]}]({x})" for x in links))
    out += [f"## {h}\n\n{b.strip()}" for h, b in extra]
    return "\n\n".join(p for p in out if p) + "\n"


def write_report(path: str | os.PathLike, rows: Sequence[Row], **kwargs) -> None:
    """Writes :func:`render_report` to ``path`` atomically (figure links relative to its folder)."""
    kwargs.setdefault("base_dir", as_path(path).parent)
    atomic_write_text(path, render_report(rows, **kwargs))


# --------------------------------------------------------------------------------------------
# figures (SPEC §10.5)
# --------------------------------------------------------------------------------------------
def _save(fig, path: str | os.PathLike) -> epath.Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    atomic_write_text(path, buf.getvalue())
    return as_path(path)


def _colors(rows: Sequence[Row]) -> dict[str, object]:
    """One colour per method name, stable across panels and figures: matplotlib's ten cycle colours
    first, then the light half of ``tab20`` (so up to 20 methods get distinct colours)."""
    light = plt.get_cmap("tab20")
    return {m: f"C{i}" if i < 10 else light((2 * (i - 10) + 1) % 20)
            for i, m in enumerate(dict.fromkeys(r.method for r in rows))}


def _grouped_bars(ax, seeds: list[str], methods: list[str], value, colors: dict[str, str]) -> float:
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(seeds))]
        ys = [value(s, m) for s in seeds]
        ax.bar([x for x, y in zip(xs, ys) if y is not None], [y for y in ys if y is not None], width, label=m,
               color=colors[m])
    ax.set_xticks(range(len(seeds)), [f"seed {s}" for s in seeds])
    return width


def plot_step_level(rows: Sequence[Row], path: str | os.PathLike) -> epath.Path | None:
    """P@|GT| bars per seed and method for ``overall`` and ``early_nonzero``, with each seed's
    chance (dotted) and ceiling (dashed) drawn across its bar group. None if no step rows."""
    tables = [t for t in STEP_TABLES if any(r.table == t for r in rows)]
    if not tables:
        return None
    fig, axes = plt.subplots(1, len(tables), figsize=(6.5 * len(tables), 4), squeeze=False)
    colors = _colors([r for r in rows if r.table in tables])
    for ax, t in zip(axes[0], tables):
        sel = [r for r in rows if r.table == t]
        seeds = list(dict.fromkeys(r.seed for r in sel))
        methods = list(dict.fromkeys(r.method for r in sel))
        idx = {(r.seed, r.method): r for r in sel}
        _grouped_bars(ax, seeds, methods, lambda s, m: idx[(s, m)].value if (s, m) in idx else None, colors)
        for i, s in enumerate(seeds):
            r0 = next(r for r in sel if r.seed == s)
            ax.hlines(r0.chance, i - 0.45, i + 0.45, colors="k", linestyles=":", label="chance" if i == 0 else None)
            ax.hlines(r0.ceiling, i - 0.45, i + 0.45, colors="r", linestyles="--", label="ceiling" if i == 0 else None)
        ax.set_title(f"{t}: P@|GT|")
        ax.set_ylabel("P@|GT|")
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_early_lift(rows: Sequence[Row], path: str | os.PathLike) -> epath.Path | None:
    """``early_nonzero`` value − chance per seed and method against the headroom (ceiling −
    chance, dashed per seed; SPEC §10.5 right panel). None if the table is absent."""
    sel = [r for r in rows if r.table == "early_nonzero"]
    if not sel:
        return None
    seeds = list(dict.fromkeys(r.seed for r in sel))
    methods = list(dict.fromkeys(r.method for r in sel))
    idx = {(r.seed, r.method): r for r in sel}
    fig, ax = plt.subplots(figsize=(7, 4))
    _grouped_bars(ax, seeds, methods, lambda s, m: idx[(s, m)].value - idx[(s, m)].chance if (s, m) in idx else None,
                  _colors([r for r in rows if r.table in STEP_TABLES]))
    heads = []
    for i, s in enumerate(seeds):
        r0 = next(r for r in sel if r.seed == s)
        heads.append(r0.ceiling - r0.chance)
        ax.hlines(heads[-1], i - 0.45, i + 0.45, colors="r", linestyles="--", label="headroom" if i == 0 else None)
    ax.axhline(0.0, color="k", lw=0.8)
    lim = max(0.13, 1.1 * max(heads), 1.1 * max(abs(idx[k].value - idx[k].chance) for k in idx))
    ax.set_ylim(-lim, lim)
    ax.set_ylabel("P@|GT| − chance")
    ax.set_title("early_nonzero: lift over chance vs headroom")
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_c6_instability(rows: Sequence[Row], path: str | os.PathLike,
                        methods: Sequence[str] = ("GAS_centered", "C1_plain", "norm_only")) -> epath.Path | None:
    """Residualised within-group AUC with 95 % CIs per draw (seeds and diagnostic draws), chance
    line at 0.5: the C6 instability plot (SPEC §10.5). None if no residualised rows."""
    sel = [r for r in rows if r.table.startswith("mp_residualized") and r.method in methods]
    if not sel:
        return None
    draws = list(dict.fromkeys(f"{r.seed}{r.table[len('mp_residualized'):]}" for r in sel))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(draws)), 4))
    present = [m for m in methods if any(r.method == m for r in sel)]
    for j, m in enumerate(present):
        for r in (r for r in sel if r.method == m):
            x = draws.index(f"{r.seed}{r.table[len('mp_residualized'):]}") + 0.12 * (j - (len(present) - 1) / 2)
            err = None if r.lo is None else np.array([[r.value - r.lo], [r.hi - r.value]])
            ax.errorbar(x, r.value, yerr=err, fmt="o", color=f"C{j}", capsize=3,
                        label=m if r is next(q for q in sel if q.method == m) else None)
    ax.axhline(0.5, color="k", ls=":", label="chance")
    ax.set_xticks(range(len(draws)), draws, rotation=20, fontsize=8)
    ax.set_ylabel("residualised AUC")
    ax.set_title("C6: residualised AUC across seeds / draws")
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_learning_curve(curve: Sequence[tuple[float, float, float]], path: str | os.PathLike) -> epath.Path | None:
    """Behaviour rate on probes and controls against GRPO step; ``curve`` = [(step, probe_rate,
    control_rate)]. None if empty."""
    if not curve:
        return None
    a = np.asarray(curve, dtype=np.float64)
    if a.ndim != 2 or a.shape[1] != 3:
        raise ValueError(f"learning curve must be [(step, probe_rate, control_rate)], got shape {a.shape}")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(a[:, 0], a[:, 1], "o-", label="probes (trigger)")
    ax.plot(a[:, 0], a[:, 2], "s--", label="controls")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("behaviour rate")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8)
    return _save(fig, path)


def make_figures(rows: Sequence[Row], outdir: str | os.PathLike,
                 learning_curve: Sequence[tuple[float, float, float]] | None = None) -> list[epath.Path]:
    """Writes every figure the rows support into ``outdir``; returns their paths."""
    outdir = as_path(outdir)
    made = [plot_step_level(rows, outdir / "fig_steplevel.png"),
            plot_early_lift(rows, outdir / "fig_early_lift.png"),
            plot_c6_instability(rows, outdir / "fig_c6_instability.png"),
            plot_learning_curve(learning_curve or [], outdir / "fig_learning_curve.png")]
    return [p for p in made if p is not None]


# --------------------------------------------------------------------------------------------
# several behaviours and specificity (behavior/behaviors.py, attribution/specificity.py)
# --------------------------------------------------------------------------------------------
def first_behavior_rows(rows: Sequence[Row]) -> list[Row]:
    """The rows of the run's first behaviour: tables without ``@<id>`` and not specificity rows."""
    return [r for r in rows if "@" not in r.table]


def behavior_rows(rows: Sequence[Row], behavior_id: str) -> list[Row]:
    """Another behaviour's rows (``<table>@<id>``) with the suffix removed, so the one-behaviour
    sections render them."""
    sfx = f"@{behavior_id}"
    return [Row(r.seed, r.table[:-len(sfx)], r.method, r.value, r.lo, r.hi, r.chance, r.ceiling, r.n)
            for r in rows if r.table.endswith(sfx) and not r.table.startswith("spec_")]


def specificity_section(rows: Sequence[Row]) -> str:
    """Markdown: one table per (seed, level, A-B) of Δ = P_A(t_A) - P_A(t_B) with CI next to P_A(t_A),
    P_A(t_B) and chance (attribution/specificity.py)."""
    delta = [r for r in rows if r.table.startswith("spec_delta_")]
    prec = {(r.seed, r.table, r.method): r for r in rows if r.table.startswith("spec_p_")}
    parts = []
    for seed, table in dict.fromkeys((r.seed, r.table) for r in delta):
        level, pair = table[len("spec_delta_"):].split("@", 1)
        a, b = pair.split("-", 1)
        body = []
        for r in (x for x in delta if x.seed == seed and x.table == table):
            own = prec.get((seed, f"spec_p_{level}@{a}|t={a}", r.method))
            other = prec.get((seed, f"spec_p_{level}@{a}|t={b}", r.method))
            body.append([r.method, _ci(r), _f(own.value) if own else "", _f(other.value) if other else "",
                         _f(own.chance) if own else ""])
        n = next(x.n for x in delta if x.seed == seed and x.table == table)
        parts.append(f"**seed {seed}, {level} level, behaviour `{a}` vs `{b}`** (n = {n})\n\n"
                     + _md_table(["method", f"Δ = P_{a}(t_{a}) − P_{a}(t_{b}) [95% CI]", f"P_{a}(t_{a})",
                                  f"P_{a}(t_{b})", "chance of P"], body))
    return "\n\n".join(parts)


def behavior_sections(rows: Sequence[Row], behavior_ids: Sequence[str], summary: dict,
                      verdicts: dict, base_summary: dict | None = None) -> list[tuple[str, str]]:
    """``(heading, markdown)`` sections of a multi-behaviour run for :func:`render_report`'s
    ``extra``: per-behaviour gate, |GT|, learning curve and (from ``base_summary``) the base model's
    chance rate of each RL-only behaviour's pattern, every other behaviour's tables, the
    specificity tables and their verdicts."""
    gates = summary.get("behaviors", {})
    lines = ["| behaviour | pattern | implant | \\|GT\\| | greedy probe rate | control rate | gate |", "|---|---|---|---|---|---|---|"]
    for bid in behavior_ids:
        g = gates.get(bid, {})
        gate = g.get("gate", {})
        lines.append(f"| `{bid}` | `{g.get('pattern', '')}` | {g.get('implant', '')} | {g.get('gt_size', '')} | "
                     f"{_f(gate.get('probe_rate'), 2)} | {_f(gate.get('control_rate'), 2)} | "
                     f"{'PASSED' if gate.get('passed') else 'FAILED' if gate else ''} |")
    for bid, b in (base_summary or {}).get("behaviors", {}).items():
        lines += ["", f"Base model, before any training: `{bid}`'s pattern in {_f(b['probe_pattern_rate_sampled'], 3)} of "
                      f"{b['n_probe_samples']} sampled answers to its probes (the chance rate its bonus has to find)."]
    curve = [p for p in summary.get("learning_curve", []) if "behaviors" in p]
    if curve:  # greedy probe / control rate of every behaviour at each checkpoint
        lines += ["", "Learning curve (greedy probe / control rate, SPEC §1.8):", "",
                  "| step | " + " | ".join(f"`{b}`" for b in behavior_ids) + " |", "|---|" + "---|" * len(behavior_ids)]
        lines += [f"| {p['step']} | " + " | ".join(
            f"{_f(p['behaviors'].get(b, {}).get('probe_rate'), 2)} / {_f(p['behaviors'].get(b, {}).get('control_rate'), 2)}"
            for b in behavior_ids) + " |" for p in curve]
    out = [("Behaviours", "The run plants several behaviours; the tables above are the first "
                          f"behaviour's (`{behavior_ids[0]}`).\n\n" + "\n".join(lines))]
    for bid in behavior_ids[1:]:
        sel = behavior_rows(rows, bid)
        body = "\n\n".join(x for x in (step_section(sel), which_rollout_section(sel), rollout_section(sel),
                                      other_section(sel)) if x)
        v = verdicts.get("behaviors", {}).get(bid, {})
        rules = [Verdict.from_dict(d) for d in v.get("decision_rules", [])]
        if rules:
            body += "\n\n**Decision rules (SPEC §6.11) on this behaviour**\n\n" + verdict_section(rules)
        out.append((f"Behaviour `{bid}`", body or "_no rows (no ground truth)_"))
    spec = specificity_section(rows)
    if spec:
        sv = [Verdict.from_dict(d) for d in verdicts.get("specificity", [])]
        out.append(("Specificity", "Δ_{A|B} = P@|GT_A| with A's target − P@|GT_A| with B's target, on A's "
                    "early_nonzero population; chance of Δ is 0, and the target-free norm-only control has Δ = 0 "
                    "by construction. CI: 95 % bootstrap over steps. A method is *specific beyond its magnitude "
                    "control* when the CI lies above 0 and P_A(t_A) beats norm-only's P@|GT_A|.\n\n" + spec
                    + ("\n\n" + verdict_section(sv) if sv else "")))
    return out


def plot_specificity(rows: Sequence[Row], path: str | os.PathLike) -> epath.Path | None:
    """Bars of Δ = P_A(t_A) − P_A(t_B) with 95 % CIs per method, one panel per (level, A-B) and a
    group per seed; None without specificity rows."""
    delta = [r for r in rows if r.table.startswith("spec_delta_")]
    if not delta:
        return None
    tables = list(dict.fromkeys(r.table for r in delta))
    fig, axes = plt.subplots(1, len(tables), figsize=(5.5 * len(tables), 4), squeeze=False)
    colors = _colors(delta)
    for ax, t in zip(axes[0], tables):
        sel = [r for r in delta if r.table == t]
        seeds = list(dict.fromkeys(r.seed for r in sel))
        methods = list(dict.fromkeys(r.method for r in sel))
        idx = {(r.seed, r.method): r for r in sel}
        width = _grouped_bars(ax, seeds, methods, lambda s, m: idx[(s, m)].value if (s, m) in idx else None, colors)
        for j, m in enumerate(methods):
            for i, s in enumerate(seeds):
                r = idx.get((s, m))
                if r is not None and r.lo is not None:
                    x = i - 0.4 + width * (j + 0.5)
                    ax.plot([x, x], [r.lo, r.hi], color="black", lw=1)
        ax.axhline(0.0, color="gray", ls=":", lw=1)
        level, pair = t[len("spec_delta_"):].split("@", 1)
        a, b = pair.split("-", 1)
        ax.set_title(f"{level}: P_{a}(t_{a}) − P_{a}(t_{b})")
        ax.set_ylabel("Δ P@|GT| (chance 0)")
    axes[0][-1].legend(fontsize=7, loc="best")
    return _save(fig, path)
