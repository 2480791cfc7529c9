#!/usr/bin/env python3
"""Renders the generated block of README.md's "Results" section from the runs' own outputs saved
with the records (``results_table.csv`` files, or a stage's ``results_rows.csv``, under
``docs/records/``), so the README's tables cannot drift from what the runs wrote.

    python tools/readme_results.py           # rewrites the block between the markers of README.md
    python tools/readme_results.py --check   # exit 1 naming the file if the block is not current

The block lies between ``<!-- results:begin -->`` and ``<!-- results:end -->``; text outside it is
hand-written and left alone. A campaign is one entry of :data:`CAMPAIGNS`: its saved file (in the
results-table schema, SPEC §7.6, ``docs/reference/results-table.md``), its dated record and the kind
of table it feeds. Every kind is one subsection of the block; its columns are the seeds of its
campaigns, in the order of :data:`CAMPAIGNS`, and its caption names each source file and links each
record. A kind with no campaign renders nothing. tests/repo/test_readme_results.py checks the block is
current.

Kinds:

* ``which_rollout``: the which-rollout, within-step, step-level and fresh-draw rows of a run's
  ``results_table.csv`` (tables ``which_rollout``, ``which_rollout_within_step``, ``early_nonzero``,
  ``mp_raw``), one column per seed; the rows are :data:`WHICH_ROLLOUT_ROWS`.
* ``causal_gate``: the ``cause`` stage's gate (``cause/results_rows.csv``, tables
  ``causal_gate[<output>]``, written by ``attribution/causal_gate.py`` ``gate_rows``), one row per
  (measure, seed): Δ and its CI, the noise floor sd, the MDE, Δ / sd, the status and the streams.
"""
from __future__ import annotations

import argparse
import dataclasses
import decimal
import math
import pathlib
import re
import sys
from typing import Callable, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from behaviortrace_jax.attribution import formats  # noqa: E402  (after the path above)

README = REPO / "README.md"
BEGIN = "<!-- results:begin: written by tools/readme_results.py from the runs' saved outputs; edit CAMPAIGNS there -->"
END = "<!-- results:end -->"


@dataclasses.dataclass(frozen=True)
class Campaign:
    """One measurement campaign whose saved output feeds a README table.

    Fields: ``label`` (the column heading's prefix, e.g. "default"); ``source`` (the saved file,
    relative to the repository: a ``results_table.csv`` or a stage's ``results_rows.csv``);
    ``record`` (its dated record under ``docs/records/``); ``kind`` (a key of :data:`KINDS`);
    ``seeds`` (the seed labels to show, in order; empty = every seed of the file's rows of that
    kind, in file order); ``note`` (a sentence for the caption, e.g. what was not saved);
    ``measures`` (``causal_gate`` only: the measure outputs shown, in file order; empty = all).
    """

    label: str
    source: str
    record: str
    kind: str
    seeds: tuple[str, ...] = ()
    note: str = ""
    measures: tuple[str, ...] = ()


# ------------------------------------------------------------------------------------------------
# The campaigns: adding one is one entry here, then `python tools/readme_results.py`. Save the run's
# output beside its record first, in a folder named as the record: docs/records/<campaign>/
# results_table.csv, or for the causal gate the `cause` stage's cause/results_rows.csv copied to
# docs/records/<campaign>/cause_rows.csv (its causal_gate[<output>] rows, one seed label per run):
#     Campaign("tiny causal", "docs/records/2026-12-08-causal-gate-three-seeds/cause_rows.csv",
#              "docs/records/2026-12-08-causal-gate-three-seeds.md", "causal_gate"),
# ------------------------------------------------------------------------------------------------
CAMPAIGNS: tuple[Campaign, ...] = (
    Campaign("default", "docs/records/2026-12-07-causal-gate-window-60-three-seeds/cause_rows.csv",
             "docs/records/2026-12-07-causal-gate-window-60-three-seeds.md", "causal_gate",
             measures=("probe_rate", "leakage_rate", "logp_margin")),
    Campaign("default", "docs/records/2026-12-07-recalibrated-default-three-seeds/results_table.csv",
             "docs/records/2026-12-07-recalibrated-default-three-seeds.md", "which_rollout"),
    Campaign("pre-calibration default", "docs/records/tiny_sweep/results_table.csv",
             "docs/records/2026-12-04-tiny-sweep-and-decoys-three-seeds.md", "which_rollout",
             note="seeds 1 and 2 of the default were not saved: their numbers are in the record"),
    Campaign("pre-calibration decoys", "docs/records/tiny_decoys/results_table.csv",
             "docs/records/2026-12-04-tiny-sweep-and-decoys-three-seeds.md", "which_rollout"),
)


# ------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------
Table = dict[tuple[str, str, str], formats.Row]  # (seed, table, method) -> row


def read_rows(campaign: Campaign, repo: pathlib.Path = REPO) -> Table:
    """The rows of a campaign's saved file keyed by (seed, table, method).

    Raises:
        FileNotFoundError: the source file does not exist (naming it and the campaign).
        ValueError: the file is not in the results-table schema, or a (seed, table, method) repeats.
    """
    path = repo / campaign.source
    if not path.is_file():
        raise FileNotFoundError(f"tools/readme_results.py: campaign {campaign.label!r}: {campaign.source} does not exist")
    out: Table = {}
    for r in formats.read_results_csv(path):
        key = (r.seed, r.table, r.method)
        if key in out:
            raise ValueError(f"{campaign.source}: row seed={r.seed} table={r.table} method={r.method} appears twice")
        out[key] = r
    return out


def _seeds(campaign: Campaign, rows: Table, tables: Sequence[str]) -> list[str]:
    """The campaign's seeds, or every seed with a row in one of ``tables`` (file order)."""
    found = list(dict.fromkeys(s for s, t, _ in rows if any(t == x or t.startswith(x + "[") for x in tables)))
    if not campaign.seeds:
        return found
    missing = [s for s in campaign.seeds if s not in found]
    if missing:
        raise ValueError(f"{campaign.source}: seeds {missing} of campaign {campaign.label!r} have no rows of {list(tables)}")
    return list(campaign.seeds)


# ------------------------------------------------------------------------------------------------
# which_rollout
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Cell:
    """One number of a table row: ``field`` of the row (table, method) of a seed, the largest over
    ``methods`` when several are named ("best of"); ``digits`` after the point (0 = an integer);
    ``wrap`` a format with one ``{}``."""

    table: str
    methods: tuple[str, ...]
    field: str = "value"
    digits: int = 3
    wrap: str = "{}"

    def render(self, rows: Table, seed: str) -> str | None:
        vals = [getattr(rows[(seed, self.table, m)], self.field) for m in self.methods if (seed, self.table, m) in rows]
        vals = [v for v in vals if v is not None]
        if not vals:
            return None
        return self.wrap.format(_fixed(max(vals), self.digits))


def _fixed(x: float, digits: int) -> str:
    """``x`` with ``digits`` decimals, halves rounded up as a person rounds the CSV's 4-decimal
    value (0.3125 -> 0.313, where ``f"{x:.3f}"`` gives 0.312); ``digits`` 0 = an integer."""
    q = decimal.Decimal(1).scaleb(-digits)
    return str(decimal.Decimal(repr(float(x))).quantize(q, rounding=decimal.ROUND_HALF_UP))


def _c(table: str, *methods: str, **kw) -> Cell:
    return Cell(table, methods, **kw)


DIRECTIONS = ("C1-dot:direction", "C1-cosine:direction", "TRAK:direction", "TracInCP:direction")
# (label, cells joined by " / "; a row whose cells are all missing for every column is left out)
WHICH_ROLLOUT_ROWS: tuple[tuple[str, tuple[Cell, ...]], ...] = (
    ("which-rollout population, chance", (_c("which_rollout", "random", field="n", digits=0, wrap="{},"),
                                          _c("which_rollout", "random", field="chance"))),
    ("advantage / reward (the log alone)", (_c("which_rollout", "advantage"), _c("which_rollout", "reward"))),
    ("abs-advantage (\\|A\\|)", (_c("which_rollout", "abs-advantage"),)),
    *((f"{m} (weighted / direction)", (_c("which_rollout", m), _c("which_rollout", f"{m}:direction")))
      for m in ("norm-only", "C1-dot", "TracInCP", "TRAK")),
    ("metagradient", (_c("which_rollout", "metagradient"),)),
    ("within-step AUC: advantage / \\|A\\| / norm-only / best direction estimator",
     tuple(_c("which_rollout_within_step", *m, digits=2) for m in (("advantage",), ("abs-advantage",), ("norm-only",),
                                                                  DIRECTIONS))),
    ("early_nonzero (step level): norm-only / best of C1, TRAK / step-reward-std (ceiling in parentheses)",
     (_c("early_nonzero", "norm-only"), _c("early_nonzero", "C1-dot", "C1-cosine", "TRAK"),
      _c("early_nonzero", "step-reward-std"), _c("early_nonzero", "step-reward-std", field="ceiling", wrap="({})"))),
    ("rollout level (fresh draws), AUC: GAS_centered / fluency", (_c("mp_raw", "GAS_centered", digits=2),
                                                                  _c("mp_raw", "fluency", digits=2))),
)


def _join(cells: list[str | None]) -> str:
    """Cells joined by " / " ("-" for a missing one); a "(...)" cell follows its neighbour with a
    space and an "x," cell with a space."""
    out = ""
    for i, c in enumerate(cells):
        c = "-" if c is None else c
        if i:
            out += " " if (c.startswith("(") or out.endswith(",")) else " / "
        out += c
    return out


def render_which_rollout(columns: list[tuple[Campaign, Table, str]]) -> list[str]:
    """The which-rollout table: one column per (campaign, seed), one row per :data:`WHICH_ROLLOUT_ROWS`."""
    head = "| | " + " | ".join(f"{c.label}, seed {s}" for c, _, s in columns) + " |"
    lines = [head, "|---" * (len(columns) + 1) + "|"]
    for label, cells in WHICH_ROLLOUT_ROWS:
        rendered = [[cell.render(rows, seed) for cell in cells] for _, rows, seed in columns]
        if all(x is None for col in rendered for x in col):
            continue
        lines.append(f"| {label} | " + " | ".join(_join(col) for col in rendered) + " |")
    return lines


# ------------------------------------------------------------------------------------------------
# causal_gate
# ------------------------------------------------------------------------------------------------
GATE_STATUS = {1.0: "acted", 0.0: "not detected", -1.0: "reversed"}  # causal_gate.gate_rows' "acted" codes
GATE = re.compile(r"^causal_gate\[(.+)\]$")


def _g(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4g}"


def render_causal_gate(columns: list[tuple[Campaign, Table, str]]) -> list[str]:
    """The gate table: one row per (campaign, seed, measure) of the ``causal_gate[<measure>]`` rows.

    Raises:
        ValueError: a gate table lacks one of its five rows, or has an unknown "acted" code.
    """
    lines = ["| run | measure | Δ [95 % CI] | noise floor sd | MDE | Δ / sd | status | streams |",
             "|---|---|---|---|---|---|---|---|"]
    for campaign, rows, seed in columns:
        for table in dict.fromkeys(t for s, t, _ in rows if s == seed and GATE.match(t)
                                   and (not campaign.measures or GATE.match(t).group(1) in campaign.measures)):
            need = ("delta", "baseline-sd", "mde", "delta-over-sd", "acted")
            missing = [m for m in need if (seed, table, m) not in rows]
            if missing:
                raise ValueError(f"{campaign.source}: seed {seed} table {table} lacks the rows {missing}")
            d, sd, mde, ratio, acted = (rows[(seed, table, m)] for m in need)
            if acted.value not in GATE_STATUS:
                raise ValueError(f"{campaign.source}: seed {seed} table {table}: acted = {acted.value}, not one of {sorted(GATE_STATUS)}")
            measure = GATE.match(table).group(1) + (" (primary)" if acted.ceiling == 1.0 else "")
            lines.append(f"| {campaign.label}, seed {seed} | {measure} | {_g(d.value)} [{_g(d.lo)}, {_g(d.hi)}] | "
                         f"{_g(sd.value)} | {_g(mde.value)} | {_g(ratio.value)} | {GATE_STATUS[acted.value]} | {d.n} |")
    return lines


# ------------------------------------------------------------------------------------------------
# The block
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Kind:
    """A subsection of the block: its heading, the tables whose seeds make its columns, its
    renderer (columns -> markdown table lines) and a sentence said above the table."""

    heading: str
    tables: tuple[str, ...]
    render: Callable[[list[tuple[Campaign, Table, str]]], list[str]]
    intro: str


KINDS: dict[str, Kind] = {
    "causal_gate": Kind(
        "The causal gate (replays)", ("causal_gate",), render_causal_gate,
        "The `cause` stage withholds every bonus of the window and measures each output against its noise "
        "floor; a CI that holds 0 is \"not detected\", not an effect of 0 "
        "([docs/concepts/noise-floors.md](docs/concepts/noise-floors.md))."),
    "which_rollout": Kind(
        "Which rollout, from the sketches and from the reward log",
        ("which_rollout", "which_rollout_within_step", "early_nonzero", "mp_raw"), render_which_rollout,
        "Rows are P@|GT| of the which-rollout table unless said otherwise; `advantage`, `reward`, "
        "`abs-advantage` read only the log."),
}


def _caption(campaigns: list[Campaign]) -> str:
    """The sentence that names each source file (with its campaign's note) and links each record."""
    sources = ", ".join(f"`{c.source}` ({c.label}" + (f"; {c.note}" if c.note else "") + ")" for c in campaigns)
    records = list(dict.fromkeys(c.record for c in campaigns))
    links = ", ".join(f"[{'its record' if len(records) == 1 else pathlib.PurePath(r).stem}]({r})" for r in records)
    return f"Rendered from {sources}; machine, command and commit: {links}."


def render_block(campaigns: Sequence[Campaign] = CAMPAIGNS, repo: pathlib.Path = REPO) -> str:
    """The generated block, markers included: one subsection per kind that has campaigns, in the
    order of :data:`KINDS`.

    Raises:
        ValueError: a campaign names an unknown kind, or its file lacks what its kind needs.
    """
    unknown = [c.kind for c in campaigns if c.kind not in KINDS]
    if unknown:
        raise ValueError(f"tools/readme_results.py: unknown kinds {unknown}; known: {sorted(KINDS)}")
    lines = [BEGIN]
    for name, kind in KINDS.items():
        mine = [c for c in campaigns if c.kind == name]
        if not mine:
            continue
        columns = []
        for c in mine:
            rows = read_rows(c, repo)
            columns += [(c, rows, s) for s in _seeds(c, rows, kind.tables)]
        if not columns:
            raise ValueError(f"tools/readme_results.py: no seed of {[c.source for c in mine]} has rows of {list(kind.tables)}")
        lines += ["", f"### {kind.heading}", "", kind.intro + " " + _caption(mine), "", *kind.render(columns)]
    lines += ["", END]
    return "\n".join(lines)


def rewrite(text: str, block: str) -> str:
    """``text`` with its block (markers included) replaced by ``block``.

    Raises:
        ValueError: the markers are missing, repeated or out of order (naming README.md).
    """
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"README.md must hold the line {BEGIN!r} once, then {END!r} once")
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + block + text[stop:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md's results block is not current")
    args = parser.parse_args(argv)
    text = README.read_text()
    new = rewrite(text, render_block())
    if args.check:
        if new != text:
            print("README.md's results block is not current: run python tools/readme_results.py", file=sys.stderr)
            return 1
        return 0
    tmp = README.with_suffix(".md.tmp")
    tmp.write_text(new)
    tmp.replace(README)  # atomic: a reader sees the old file or the new one
    print(f"wrote README.md's results block ({len(new.splitlines())} lines in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
