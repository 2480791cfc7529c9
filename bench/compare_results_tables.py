"""Compares one run's results_table.csv with a reference run's, against the spread between seeds.

For every (table, method) row of the which-rollout tables it prints the value of ``--run`` and of
``--ref`` (the same seed, e.g. the same training run with another ``sketch.hash``), their
difference, and the range (max - min) of the values over the ``--seeds`` runs (the seed-to-seed
noise), flagging a row whose |difference| exceeds that range. It reads the CSVs the ``evaluate``
stage writes (``attribution/formats.read_results_csv``); nothing is recomputed.

    python bench/compare_results_tables.py --run runs/block_seed0 --ref /work/runs/tiny_sweep/seed0 \\
        --seeds /work/runs/tiny_sweep/seed0,/work/runs/tiny_sweep/seed1,/work/runs/tiny_sweep_s2/seed2
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from behaviortrace_jax.attribution import formats  # noqa: E402
from behaviortrace_jax.io.layout import RunLayout  # noqa: E402

TABLES = ("which_rollout", "which_rollout_within_step", "early_nonzero", "overall")


def values(run: str) -> dict[tuple[str, str], float]:
    """{(table, method): value} of a run's which-rollout tables (its own seed's rows)."""
    rows = formats.read_results_csv(RunLayout(run).results_table)
    return {(r.table, r.method): float(r.value) for r in rows
            if r.table in TABLES and r.value is not None and "_" not in str(r.seed)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--ref", required=True)
    ap.add_argument("--seeds", required=True, help="comma-separated runs of the other seeds (ref's included)")
    args = ap.parse_args()
    run, ref = values(args.run), values(args.ref)
    seeds = [values(s) for s in args.seeds.split(",")]
    print("| table | method | run | ref | run - ref | seed range | |diff| > range |")
    print("|---|---|---|---|---|---|---|")
    n_out = n = 0
    for key in sorted(set(run) & set(ref), key=lambda k: (TABLES.index(k[0]), k[1])):
        vals = [s[key] for s in seeds if key in s]
        spread = max(vals) - min(vals) if len(vals) > 1 else float("nan")
        diff = run[key] - ref[key]
        out = abs(diff) > spread
        n, n_out = n + 1, n_out + int(out)
        print(f"| {key[0]} | {key[1]} | {run[key]:.4f} | {ref[key]:.4f} | {diff:+.4f} | {spread:.4f} | "
              f"{'yes' if out else ''} |")
    print(f"\n{n_out} of {n} rows differ by more than the seed range; "
          f"{sum(abs(run[k] - ref[k]) > 0 for k in set(run) & set(ref))} differ at all")


if __name__ == "__main__":
    main()
