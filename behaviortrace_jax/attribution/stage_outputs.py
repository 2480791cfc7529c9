"""Stages own their tables and report sections (issue 49 item 5).

A stage other than ``evaluate`` that adds rows to ``results_table.csv`` or a section to
``report.md`` registers where it keeps them (:func:`register_stage_outputs`): its own rows file and
its own section file, relative to the workdir. Then any stage order keeps them:

* :func:`publish_rows`: the stage writes its own rows file, and replaces in ``results_table.csv``
  only the (seed, table) pairs it owns (those of its old and new rows);
* ``evaluate`` rewrites ``results_table.csv`` from its rows plus :func:`rows_of_other_stages`;
* ``report`` renders every registered stage's section (:func:`report_sections`) through its own
  ``extra`` sections: no stage edits ``report.md`` after the fact.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from behaviortrace_jax.attribution import counterfactual_report, formats
from behaviortrace_jax.io.files import atomic_write_text
from behaviortrace_jax.io.layout import RunLayout


@dataclasses.dataclass(frozen=True)
class StageOutputs:
    """A stage's own ``rows`` file (results-table CSV) and report ``section`` file (markdown body),
    both relative to the workdir, and the section's ``heading``."""

    stage: str
    rows: str
    section: str
    heading: str


STAGE_OUTPUTS: dict[str, StageOutputs] = {}


def register_stage_outputs(stage: str, *, rows: str, section: str, heading: str) -> StageOutputs:
    """Registers ``stage``'s own rows and section files. Raises ValueError for a second registration."""
    if stage in STAGE_OUTPUTS:
        raise ValueError(f"stage {stage!r} already registered its outputs")
    STAGE_OUTPUTS[stage] = out = StageOutputs(stage, rows, section, heading)
    return out


def publish_rows(layout: RunLayout, stage: str, rows: Sequence[formats.Row]) -> None:
    """Writes ``stage``'s own rows file and replaces its (seed, table) pairs in ``results_table.csv``
    (old and new ones; every other row is kept, in order, and the stage's rows are appended)."""
    own = layout.workdir / STAGE_OUTPUTS[stage].rows
    old_own = formats.read_results_csv(own) if own.exists() else []
    owned = {(r.seed, r.table) for r in list(old_own) + list(rows)}
    formats.write_results_csv(own, list(rows))
    table = layout.results_table
    old = formats.read_results_csv(table) if table.exists() else []
    formats.write_results_csv(table, [r for r in old if (r.seed, r.table) not in owned] + list(rows))


def rows_of_other_stages(layout: RunLayout, exclude: Sequence[str] = ()) -> list[formats.Row]:
    """The rows every registered stage (but ``exclude``) keeps in its own rows file, in
    registration order (``evaluate`` appends them to its own)."""
    out: list[formats.Row] = []
    for name, o in STAGE_OUTPUTS.items():
        path = layout.workdir / o.rows
        if name not in exclude and path.exists():
            out += formats.read_results_csv(path)
    return out


def write_section(layout: RunLayout, stage: str, markdown: str) -> None:
    """Writes ``stage``'s report section body (atomically); the ``report`` stage renders it."""
    atomic_write_text(layout.workdir / STAGE_OUTPUTS[stage].section, markdown)


def report_sections(layout: RunLayout) -> list[tuple[str, str]]:
    """``(heading, markdown)`` of every registered stage's section file that exists."""
    out = []
    for o in STAGE_OUTPUTS.values():
        path = layout.workdir / o.section
        if path.exists():
            out.append((o.heading, path.read_text()))
    return out


register_stage_outputs("counterfactual", rows="counterfactual/results_rows.csv",
                       section="counterfactual/report_section.md",
                       heading=counterfactual_report.HEADING)
register_stage_outputs("cause", rows="cause/results_rows.csv", section="cause/report_section.md",
                       heading="The causal gate: did the planted cause act?")
