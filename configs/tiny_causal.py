"""Causal truth over three tiny seeds: what replays say taught the behaviour (issue 31).

    python main.py --config=configs/tiny_causal.py --workdir=runs/tiny_causal

The tiny default (configs/tiny.py) for seeds 0, 1, 2 under one shared base model
(``runs/tiny_causal/seed{S}/``), with the ``cause`` stage (the causal gate: did withholding every
bonus, with regenerated rollouts, lower the probe measures?) and the ``metagradient`` stage after ``grpo`` and the
``counterfactual`` stage run for its causal ground truth only (``counterfactual.causal = "only"``):
single-step replays of the contamination window, both interventions (remove, withhold-bonus), with
the logged rollouts; with rollouts regenerated from the replayed policy over two sampler streams,
the label's check (withhold every ground-truth bonus, every bonus). The aggregate ``results_table.csv`` holds every seed's ``causal_*`` rows beside the label
tables (which-rollout, with the log, text and length controls). docs/concepts/replays.md gives the
design, the cost and the measured tables.

Seeds can run as separate processes on one workdir once ``base/`` is complete (each seed's stages
skip finished work; the last command aggregates):

    python main.py --config=configs/tiny_causal.py --config.sweep.seeds=1 --workdir=runs/tiny_causal
"""
from configs import tiny_sweep


def get_config():
    c = tiny_sweep.get_config()
    c.sweep.diagnostic_draws = ""  # Not needed for causal truth; the tiny_sweep config makes them.
    # The causal gate after grpo (stages/cause.py, in configs/tiny.py's stages) writes its rows beside the causal tables.
    cf = c.counterfactual
    cf.causal = "only"  # The causal replays alone; the leave-top-k-out/LDS replays are configs/tiny_sweep.py's.
    cf.rollouts = "regenerated"  # Fixed and regenerated tracks (stream 0 = the run's keys, stream 1 resampled).
    cf.causal_streams = 2
    # Regenerated tracks: the label's check only (withhold every GT bonus / every bonus, two streams). Every unit's
    # regenerated branches (causal_regenerated = "units") cost ~1,640 sampled steps per stream, ~3 h per seed on
    # a shared 2-core CPU (measured: docs/concepts/replays.md); the fixed track's unit branches run in ~17 min.
    cf.causal_regenerated = "label"
    # Every replay records every configured measure (train/measures.py). The greedy and sampled rates cost a
    # decode per replay (4 x 40 sampled completions for `sampled`), ~10x a log-prob measure, over ~1,700 replays:
    # the causal replays record the three log-prob measures alone, as they did before measures were registered.
    cf.rates, cf.sampled = False, 0
    return c
