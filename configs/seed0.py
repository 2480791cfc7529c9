"""Paper scale, seed 0: Qwen2.5-1.5B-Instruct, 200 SFT + 1,000 GRPO steps (SPEC §1-§5).

    python main.py --config=configs/seed0.py \
        --config.model.hf_dir=/path/to/Qwen2.5-1.5B-Instruct --workdir=runs/seed0

Every value is the paper's (configs/common.py cites each SPEC section); only the seed differs
between seed0/1/2. Expect 16,000 rollouts, 10 checkpoints, and sketches of D = 65,536. Hardware and
time: see README "Paper scale" (one 80-141 GB GPU; the figures there say which were measured).
"""
from configs import common


def get_config():
    c = common.get_config()
    c.seed = 0  # SPEC §2.1 / §10.2: sampling seed == contaminator seed == random-baseline seed.
    c.run_name = "E2.1_rebuild__qwen-1.5b__grpo__seed0__v3"  # SPEC §2.5 naming.
    return c
