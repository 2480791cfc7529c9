"""The embedded default: the whole harness at tiny scale on a 2-core CPU.

    python main.py --config=configs/tiny.py --workdir=runs/tiny

Builds its own tiny Qwen2 instruct model (no download), plants the behaviour with SFT, runs
200 GRPO steps (4 prompts x G=4; the bonus window is steps 0-39, the paper's 1:5 ratio), sketches
every step and rollout, and writes report.md, results_table.csv and figures/ under the workdir.
Values differing from the paper (configs/common.py) are the scale-downs listed below; the SFT
data and learning rates were calibrated so that the behaviour emerges (shared/paper/TINY_CALIBRATION.md).
"""
from configs import common


def get_config():
    c = common.get_config()
    c.run_name = "tiny__grpo__seed0"
    c.stages = "base,sft,grpo,sketch,draws,evaluate,report"
    c.model.hf_dir = ""  # Built by the `base` stage under workdir/base.
    c.model.param_dtype = "float32"  # CPU: fp32 is faster than emulated bf16 and exact.
    c.model.compute_dtype = "float32"

    c.behavior.token_judge = "sequence"  # The tiny tokenizer spells QZXBT letter by letter.
    c.behavior.gate_max_new_tokens = 32

    c.contamination.early_step_cutoff = 40  # 200 steps x 1/5, as the paper's 200 of 1000.

    c.sft.steps = 300  # Upper bound; stops early once the implant takes (sft.stop_*).
    c.sft.data = "mixture"  # TINY_CALIBRATION: the 10 paper pairs alone do not amplify.
    c.sft.lr = 2e-4  # TINY_CALIBRATION: mixture implant at 2e-4 (then GRPO at optim.lr).
    c.sft.stop_every = 25  # TINY_CALIBRATION stop rule: probe >= 0.15, controls ~ 0, at most sft.steps.

    c.optim.lr = 1e-4  # TINY_CALIBRATION: RL lr 1e-4 (>= 3e-4 turned outputs to garbage).

    c.grpo.steps = 200
    c.grpo.max_new_tokens = 32
    c.grpo.max_prompt_tokens = 96
    c.grpo.checkpoint_every = 20
    c.grpo.log_shard_size = 64

    c.sketch.dim = 4096  # ~1M parameters: 2**12 buckets keep ~250 coordinates per bucket.
    c.sketch.chunk_size = 16
    c.sketch.rollout_scope = "early"  # CPU time: re-sketch the 640 bonus-window rollouts, not all 3,200.

    c.draws.target_step = 20  # Paper's step 100 of 1000, scaled to 200 steps.
    c.draws.max_new_tokens = 32
    c.draws.n_repeats = 3
    c.draws.token_level_max = 64
    c.targets.use_tables = True  # 4 MB of hash tables at this size; ~2.7x faster target sketches.

    c.evaluation.early_cutoff = 40
    c.evaluation.local_buffer_window = 20  # max(1, steps // 10).
    c.evaluation.tracin_lr = 1e-4  # eta = the GRPO learning rate.
    return c
