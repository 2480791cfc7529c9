#!/usr/bin/env python3
"""The calibration table of the planted cause: one row per (setting, measure) from finished runs'
``cause`` stages (``cause/gate.json``), the setting named by the config values in which its GRPO
run differs from the first run given.

    python tools/cause_calibration.py --run carried=runs/cal_A --run fresh=runs/cal_B [--markdown]

Columns (the measure's units; ``attribution/causal_gate.py``, ``attribution/noise_floor.py``):
``setting``, ``changed`` (the differing ``grpo/grpo.settings.json`` keys), ``measure_step``,
``streams``, ``measure``, ``baseline`` (mean over streams), ``delta`` (baseline - withheld, paired
by stream) with its CI, ``floor_sd`` (the baseline's sd over streams) split into ``sampling`` and
``between`` (training noise), ``mde``, ``delta_over_sd`` and ``status``; ``control_rate`` is the
mean sampled control rate of the baseline (the leakage measure's ``leakage_rate``); ``meets`` says
whether the probe measure's Δ >= ``--min-sd`` floor sd (5 by default) with the control rate <=
``--max-control`` (0.1): the criterion the tiny default is calibrated to.

Raises SystemExit naming the workdir whose ``cause/gate.json`` or settings file is missing.
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from behaviortrace_jax.io.files import read_json  # noqa: E402
from behaviortrace_jax.io.layout import RunLayout  # noqa: E402

PROBE_OUTPUTS = ("probe_rate", "probe_pair_logratio")
CONTROL_OUTPUT = "leakage_rate"


def load(workdir: pathlib.Path) -> tuple[dict, dict]:
    """(gate.json, the grpo stage's recorded fingerprint) of ``workdir``."""
    gate, settings = RunLayout(workdir).cause_gate, workdir / "grpo" / "grpo.settings.json"
    for p in (gate, settings):
        if not p.exists():
            raise SystemExit(f"{p}: missing; run the grpo and cause stages into {workdir} first")
    fp = read_json(settings)
    return read_json(gate), fp.get("cache", fp)  # stages/fingerprint.py: {"stage", "cache": {key: value}}


def rows(runs: list[tuple[str, pathlib.Path]], *, min_sd: float = 5.0, max_control: float = 0.1) -> list[dict]:
    """One dict per (run, gated measure), in the order given (module docstring for the columns)."""
    loaded = [(name, *load(w)) for name, w in runs]
    ref = loaded[0][2]
    out = []
    for name, gate, fp in loaded:
        changed = ", ".join(f"{k}={fp.get(k)}" for k in sorted(set(fp) | set(ref))
                            if fp.get(k) != ref.get(k) and not k.startswith("upstream")) or "(reference)"
        control = gate["values"]["baseline"].get(CONTROL_OUTPUT)
        control_rate = sum(control) / len(control) if control else math.nan
        probe = {v["measure"]: v for v in gate["verdicts"]}
        primary = probe.get(gate["primary"], {})
        meets = (primary.get("delta_over_sd", -math.inf) >= min_sd and primary.get("status") == "acted"
                 and control_rate <= max_control)
        for v in gate["verdicts"]:
            out.append({"setting": name, "changed": changed, "measure_step": gate["measure_step"],
                        "streams": gate["streams"], "samples": gate.get("samples_per_prompt"),
                        "measure": v["measure"], "baseline": v["floor_mean"], "delta": v["effect_delta"],
                        "ci_low": v["effect_ci_low"], "ci_high": v["effect_ci_high"], "floor_sd": v["floor_sd"],
                        "sampling": v["floor_sd_sampling"], "between": v["floor_sd_between"], "mde": v["mde"],
                        "delta_over_sd": v["delta_over_sd"], "status": v["status"], "control_rate": control_rate,
                        "meets": meets if v["measure"] == gate["primary"] else ""})
    return out


def markdown(table: list[dict]) -> str:
    """The rows as a GitHub table (4 significant digits)."""
    cols = ["setting", "measure", "baseline", "delta", "ci", "floor_sd", "sampling", "between", "mde",
            "delta_over_sd", "status", "control_rate", "meets"]
    fmt = lambda x: f"{x:.4g}" if isinstance(x, float) else str(x)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in table:
        r = dict(r, ci=f"[{r['ci_low']:.3g}, {r['ci_high']:.3g}]")
        lines.append("| " + " | ".join(fmt(r[c]) for c in cols) + " |")
    settings = dict.fromkeys((r["setting"], r["changed"], r["measure_step"], r["streams"], r["samples"]) for r in table)
    lines += ["", "Settings (GRPO config values differing from the first; measure step, streams, samples per prompt):", ""]
    lines += [f"- {s}: {c}; step {m}, {n} streams, {k} samples" for s, c, m, n, k in settings]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", required=True, help="NAME=WORKDIR (repeat; the first is the reference)")
    ap.add_argument("--min-sd", type=float, default=5.0, help="the criterion's Δ in noise-floor sd of the primary measure")
    ap.add_argument("--max-control", type=float, default=0.1, help="the criterion's largest mean sampled control rate")
    args = ap.parse_args(argv)
    runs = []
    for r in args.run:
        if "=" not in r:
            raise SystemExit(f"--run {r!r}: expected NAME=WORKDIR")
        name, w = r.split("=", 1)
        runs.append((name, pathlib.Path(w)))
    print(markdown(rows(runs, min_sd=args.min_sd, max_control=args.max_control)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
