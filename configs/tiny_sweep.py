"""Three tiny seeds, their pre-registered draws and the diagnostic draws, one aggregate report.

    python main.py --config=configs/tiny_sweep.py --workdir=runs/tiny_sweep

Builds one tiny base model, then runs configs/tiny.py's stages for seeds 0, 1, 2 under
runs/tiny_sweep/seed{S}/, adds the ckpt0/gen100 and ckpt1/gen101 draws (SPEC §10.2), and writes
runs/tiny_sweep/report.md in the shape of the paper's Tables 1-4 and Figures 1-2, stating which
verdicts change across seeds and draws, the metagradient of every rollout (``metagradient`` stage,
after ``grpo``) and the counterfactual replays of each seed. About three times the tiny
default's run time, plus the metagradient and counterfactual stages per seed.
"""
from configs import tiny


def get_config():
    c = tiny.get_config()
    c.run_name = "tiny__grpo__seed0"  # The sweep substitutes each seed.
    c.stages = "sweep"
    # dM/dw of every rollout through the replayed run, after grpo so that evaluate and counterfactual score it.
    c.sweep.stages = c.sweep.stages.replace("grpo,", "grpo,metagradient,")
    c.sweep.stages += ",counterfactual"  # Leave-top-k-out and LDS replays per seed (after report:
    # it appends its section to each seed's report.md; rows land in the aggregate results_table.csv).
    # Replay budget (~70 replays, ~25 CPU-min per seed on a 2-core CPU): the targeted estimators weighted and
    # advantage-free, the magnitude and reward-only controls and the metagradient, removed at k = |GT|;
    # LDS over 16 half-subsets and at drop fractions 5 % and 10 % (12 subsets each).
    cf = c.counterfactual
    cf.methods = ("C1-dot,C1-dot:direction,C1-cosine,TRAK,TRAK:direction,TracInCP,TracInCP:direction,norm-only,"
                  "abs-advantage,advantage,reward,metagradient")
    cf.k_fractions, cf.random_seeds = "1.0", 3
    cf.lds_subsets, cf.lds_fractions, cf.lds_small_subsets = 16, "0.05,0.1,0.5", 12
    return c
