"""Paper scale (SPEC §1-§5): Qwen2.5-1.5B-Instruct, 200 SFT + 1,000 GRPO steps, one training seed.

`configs/seed{0,1,2}.py` call this with their seed; every value is configs/common.py's (each
commented with its SPEC section). Run, for example:

    python main.py --config=configs/seed0.py \\
        --config.model.hf_dir=/path/to/Qwen2.5-1.5B-Instruct --workdir=runs/seed0

Expect 16,000 rollouts, 10 checkpoints and sketches of D = 65,536. Hardware and time: README,
"Paper scale".
"""
from configs import common


def get_config(seed: int = 0):
    c = common.get_config()
    c.seed = seed  # SPEC §2.1 / §10.2: sampling seed == contaminator seed == random-baseline seed.
    c.run_name = f"E2.1_rebuild__qwen-1.5b__grpo__seed{seed}__v3"  # SPEC §2.5 naming.
    # The compile stage needs no weights: without this it would fall back to the tiny base preset
    # when model.hf_dir is unset. This config's layout is the single-accelerator one (replicated);
    # a TPU slice's is configs/paper_tpu.py (README "Paper scale").
    c.compile.model = "qwen2p5_1p5b"  # SPEC §2.1's model, Qwen2.5-1.5B-Instruct's shapes.
    return c
