"""Re-score the paper's released result files (SPEC §6.13) with no model and no accelerator.

Command (from the repo root; takes ~10 s on one CPU core):

    python main.py --config=configs/reproduce.py --config.reference_dir=../shared/reference --workdir=W

Reads every ``seedN/`` folder of ``reference_dir`` as released (run_header.json, ground_truth.jsonl,
c1dot_step_scores_0_199.tsv, minimal_pair_rows_ckpt{C}_gen{G}.json, token_level_cos_temp0.9.json,
optional attribution_scores.json) and ``rollout_seed01.json``. Writes into W:

* ``results_table.csv`` (paper schema, SPEC §7.6). Expected with shared/reference (seeds 0, 1):
  every step row's chance/ceiling/n (0.0943/0.5815/16000 and 0.4716/0.5815/3200 for seed 0;
  0.0936/0.5721/16000 and 0.4678/0.5721/3200 for seed 1); ``random`` 0.0868/0.4751 and
  0.0995/0.4756; ``local-buffer`` 0.0 and chance; ``C1-dot`` seed 0 early_nonzero 0.473; all
  ``mp_raw_diag``/``mp_residualized_diag`` rows with lo/hi equal to the paper's CSV (e.g. 0_gen100
  residualised GAS_centered 0.4459 [0.3881, 0.5]); extra ``mp_matched_diag`` rows; ``token_level``
  means vs_ctx 0.2296 / 0.1144.
* ``report.md``, ``verdicts.json`` (SPEC §6.11 rules, §8 checklist; e.g. C6 "GAS vs norm order
  stable" fails, token-level sign passes, "≥ 3 seeds" fails with two seeds released) and
  ``figures/`` (fig_steplevel, fig_early_lift, fig_c6_instability).
"""
import os
import pathlib

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
    c = common.get_config()
    c.stages = "reproduce"
    default_shared = pathlib.Path(__file__).resolve().parents[2] / "shared"
    shared = pathlib.Path(os.environ.get("BEHAVIORTRACE_SHARED", default_shared))
    c.reference_dir = str(shared / "reference")  # default: shared/reference beside the repo (SPEC §6.13)
    return c
