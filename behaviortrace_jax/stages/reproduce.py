"""The ``reproduce`` stage: the paper's tables from its released per-seed files (SPEC §6.13),
computed by :mod:`behaviortrace_jax.attribution.release`."""
from __future__ import annotations

import ml_collections
from absl import logging

from behaviortrace_jax.attribution.release import reproduce, reproduce_behaviors, write_outputs
from behaviortrace_jax.stages.registry import register_stage
from behaviortrace_jax.stages.spec import RunSpec


def _reference_dir(spec: RunSpec) -> str:
    ref = spec.reference_dir
    if not ref:
        raise ValueError("set --config.reference_dir (the paper's released files, e.g. ../shared/reference)")
    return ref


@register_stage("reproduce")
def reproduce_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Stage ``reproduce``: recomputes the paper's tables from ``config.reference_dir`` into
    ``workdir`` (results_table.csv, report.md, verdicts.json, figures/). It takes seconds, so it
    always recomputes; outputs are replaced atomically."""
    spec = RunSpec.from_config(config)
    ref = _reference_dir(spec)
    ev = spec.evaluation
    kw = dict(nboot=ev.nboot, early_cutoff=ev.early_cutoff, delta=ev.fluency_match_delta,
              step_margin=ev.step_margin, max_ci_width=ev.max_ci_width, min_matched_pairs=ev.min_matched_pairs)
    rep = reproduce(ref, **kw)
    rep.rows += reproduce_behaviors(ref, **kw)  # other behaviours' folders <id>/seedN, rows <table>@<id>
    write_outputs(rep, workdir, ref)
    logging.info("reproduce: %d rows from %d seed folders -> %s/results_table.csv",
                 len(rep.rows), len(rep.seeds), workdir)
