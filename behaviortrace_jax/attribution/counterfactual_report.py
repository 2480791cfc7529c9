"""The counterfactual stage's report section and figures: markdown from its rows (the leave-top-k-out
and LDS tables, ``attribution/counterfactual_tables.py``, and the causal tables,
``attribution/causal.py``), handed to the ``report`` stage as a section (``attribution/stage_outputs.py``),
and the Δbehaviour-vs-k figure (matplotlib)."""
from __future__ import annotations

import io

import numpy as np
from etils import epath

from behaviortrace_jax.attribution import causal as causal_tables, counterfactual_tables as T, estimators, formats, verdicts
from behaviortrace_jax.io.files import atomic_write_text

HEADING = "Counterfactual replay (leave-top-k-out, LDS)"

def report_section(rows: list[formats.Row], figure: str | None, step: int | None = None,
                   advantages: str = "logged", more_figures: tuple[str, ...] = (), measures: tuple[str, ...] = ()) -> str:
    """The body of report.md's section :data:`HEADING` (the ``report`` stage adds it); ``advantages``: those of the ``counterfactual_topk`` replays
    ("logged" or "recomputed", ``counterfactual.recompute_advantages``); ``more_figures``: further
    figure links (the recomputed-advantages plot); ``measures``: the measures every replay recorded."""
    lines = ["Measure of the tables without a `[measure]` suffix: `logp_margin`"
             + (f"; every replay recorded {', '.join(f'`{m}`' for m in measures)} "
                "(`counterfactual/replays/`, `counterfactual/causal/`)." if measures else "."), "",
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
    lds_rows = [r for r in rows if r.table == "lds" or r.table.startswith(T.LDS_DROP)]
    if lds_rows:
        lines += ["", "LDS: Spearman of the predicted effect (sum of an estimator's scores over the kept window "
                  "rollouts) vs the replayed behaviour, over M random subsets of the given drop fraction; "
                  "`metagradient` is not a sketch method (dM/dw differentiated through the replayed run).", "",
                  "| seed | method | drop fraction | LDS (Spearman) | 95% CI | M |", "|---|---|---|---|---|---|"]
        lines += [f"| {r.seed} | {r.method} | {0.5 if r.table == 'lds' else r.table[len(T.LDS_DROP):]} | "
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
