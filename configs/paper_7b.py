"""Past the paper's scale: the paper's run (configs/paper.py, SPEC §1-§5 unchanged) on a
Qwen2.5-7B-Instruct-shaped model (the published config.json: 28 layers, d 3584, untied head).

    # check that every program fits a v6e slice, on any CPU machine with the tpu extra:
    python main.py --config=configs/paper_7b.py --config.stages=compile --config.compile.target=tpu:v6e:2x4 --workdir=W
    # run it (weights from a local Hugging Face checkpoint):
    launch/tpu_pod.sh configs/paper_7b.py gs://bucket/runs/7b_seed0 --config.model.hf_dir=/path/to/Qwen2.5-7B-Instruct

The layout is configs/paper.py's (mesh chosen from the devices, FSDP, fused sketcher, scanned
layers). Per-chip memory of its programs: docs/records/benchmarks.md, "Past the paper's scale".
"""
from configs import paper


def get_config(seed: int = 0):
    c = paper.get_config(seed=seed)
    c.run_name = f"E2.1_rebuild__qwen-7b__grpo__seed{seed}__v3"
    c.compile.model = "qwen2p5_7b"  # Qwen2.5-7B-Instruct's shapes when model.hf_dir is unset.
    return c
