#!/usr/bin/env python3
"""Which causal units and which replay design a run's noise floor affords (units sized by power).

    python tools/unit_designs.py --workdir runs/tiny --budget-min 60 [--units 4,8,20,40,160]

Reads the run's causal gate (``cause/gate.json``: the primary measure's noise floor sd and its
effect Δ of withholding every bonus) and the wall seconds of its regenerated baseline replays
(``cause/replays/*/base/*.json``), then prints, for each unit count and each design of
``attribution/unit_designs.py``, the replays the budget buys, the per-unit standard error, CI
half-width and minimum detectable effect, and the unit effect Δ / U would have if the bonus's
effect spread evenly over the units (a planning assumption, not a measurement), and the finest
units each design resolves.

Raises SystemExit naming a missing file.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from behaviortrace_jax.attribution import unit_designs  # noqa: E402
from behaviortrace_jax.io.files import read_json  # noqa: E402
from behaviortrace_jax.io.layout import RunLayout  # noqa: E402


def gate_inputs(workdir: pathlib.Path) -> tuple[str, float, float, float]:
    """(primary measure, its floor sd, its Δ, median seconds of a baseline replay) of ``workdir``."""
    run = RunLayout(workdir)
    gate_path = run.cause_gate
    if not gate_path.exists():
        raise SystemExit(f"{gate_path}: missing; run the cause stage into {workdir} first")
    gate = read_json(gate_path)
    v = next(v for v in gate["verdicts"] if v["measure"] == gate["primary"])
    secs = [read_json(p)["seconds"] for p in sorted(run.cause.glob("replays/*/base/*.json"))]
    if not secs:
        raise SystemExit(f"{run.cause / 'replays'}: no baseline replay files")
    return gate["primary"], float(v["floor_sd"]), float(v["effect_delta"]), float(statistics.median(secs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True, type=pathlib.Path, help="a finished run with a cause stage")
    ap.add_argument("--budget-min", type=float, default=60.0, help="wall minutes of replays per seed")
    ap.add_argument("--units", default="4,8,20,40,160", help="unit counts to compare (window: 40 steps, 160 groups)")
    args = ap.parse_args(argv)
    measure, sigma, delta, secs = gate_inputs(args.workdir)
    budget = max(1, int(args.budget_min * 60 // secs))
    print(f"{measure}: noise floor sd {sigma:.4g}, Δ(withhold every bonus) {delta:.4g}, {secs:.1f} s per replay "
          f"-> {budget} replays in {args.budget_min:g} min\n")
    print("| units | design | replays | hours | se per unit | CI half-width | MDE per unit | Δ / U | detectable |")
    print("|---|---|---|---|---|---|---|---|---|")
    for u in (int(x) for x in args.units.split(",")):
        for p in unit_designs.compare_designs(sigma, u, budget, seconds_per_replay=secs):
            ok = "infeasible" if not p.feasible else ("yes" if delta / u >= p.mde else "no")
            print(f"| {u} | {p.design} | {p.replays} | {p.cpu_hours:.2f} | {p.se:.3g} | {p.half_width:.3g} | "
                  f"{p.mde:.3g} | {delta / u:.3g} | {ok} |")
    print()
    for d in unit_designs.DESIGNS:
        print(f"finest units, {d}: {unit_designs.finest_units(d, sigma, delta, budget)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
