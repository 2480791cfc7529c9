"""Past the paper's scale: the paper's run (configs/paper.py, SPEC §1-§5 unchanged) on a
Qwen2.5-32B-Instruct-shaped model (its published config.json: 64 layers, d 5120, MLP 27648, 40 query /
8 key-value heads of 128, vocab 152064, untied head; 32,763,876,352 parameters).

    # check that its GRPO step fits a v5p-32 slice (16 chips), on any CPU machine with the tpu extra:
    python main.py --config=configs/paper_32b.py --config.stages=compile --config.compile.target=tpu:v5p:2x2x4 \\
        --config.compile.stages=grpo --config.compile.programs=grpo_step --workdir=W
    # run it (weights from a local Hugging Face checkpoint):
    launch/tpu_pod.sh configs/paper_32b.py gs://bucket/runs/32b_seed0 --config.model.hf_dir=/path/to/Qwen2.5-32B-Instruct

The layout is configs/paper.py's (mesh chosen from the devices, FSDP, fused sketcher over all 16
rollouts of a step, scanned layers: one layer body compiled, whatever the depth). In bf16 the
parameters and both AdamW moments take 183 GiB, 11.45 GiB per chip of a v5p:2x2x4 slice (16 chips of
95 GiB); the GRPO step with in-run sketches needs 84.20 GiB per chip there (11.4 % spare; on 8 chips,
v5p:2x2x2, 106.28 GiB: over). docs/records/benchmarks.md, "Past the paper's scale: Qwen2.5-32B on v5p".
"""
from configs import paper


def get_config(seed: int = 0):
    c = paper.get_config(seed=seed)
    c.run_name = f"E2.1_rebuild__qwen-32b__grpo__seed{seed}__v3"
    c.compile.model = "qwen2p5_32b"  # Qwen2.5-32B-Instruct's shapes when model.hf_dir is unset.
    c.compile.target = "tpu:v5p:2x2x4"  # the slice it was compiled for (docs/records/benchmarks.md)
    return c
