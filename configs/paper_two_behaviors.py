"""Paper scale with a second behaviour planted by RL alone, one training seed.

    python main.py --config=configs/paper_two_behaviors.py \\
        --config.model.hf_dir=/path/to/Qwen2.5-1.5B-Instruct --workdir=runs/two_seed0

configs/paper.py (SPEC §1-§5, the frobnitz -> QZXBT implant and bonus, unchanged) plus
`config.behaviors.plonkwit`: prompts about the invented word "plonkwit" (the 20 SPEC §1.2 probe
forms, third_party/behaviortrace/probes_plonkwit.jsonl; provenance in its README) earn a bonus of
8.0 when the answer contains "glows", for half of the rollouts (its own BLAKE2b stream) of GRPO
steps 0-199, with no SFT implant. The GRPO prompt pool interleaves the two behaviours' pools.
The marker and its bonus are the tiny world's (configs/tiny_two_behaviors.py, calibrated on CPU,
docs/guides/two-behaviors.md); at this scale the base model's chance rate of "glows" on the plonkwit
probes has not been measured (the `base` stage, which measures it, does not run on a downloaded
checkpoint): measure it first (e.g. `--config.stages=info` prints probe completions), and raise
the window or bonus if it is near 0. `--config.stages=compile` compiles every program of this
config for `compile.target` (tests/pipeline/test_two_behaviors.py compiles it at tiny shapes).
"""
from configs import paper, tiny_two_behaviors


def get_config(seed: int = 0):
    c = paper.get_config(seed)
    c.run_name = f"E2.1_rebuild__qwen-1.5b__grpo__two_behaviors__seed{seed}"
    b = tiny_two_behaviors.second_behavior()
    b.token_judge = "qset"  # SPEC §1.1's rule (the Qwen tokenizer does not spell words letter by letter)
    b.early_step_cutoff = c.contamination.early_step_cutoff  # the paper's window, steps 0-199 of 1,000
    c.behaviors[tiny_two_behaviors.ID] = b
    return c
