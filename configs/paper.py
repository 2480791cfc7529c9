"""Paper scale (SPEC §1-§5): Qwen2.5-1.5B-Instruct, 200 SFT + 1,000 GRPO steps, one training seed.

`configs/seed{0,1,2}.py` call this with their seed; every hyperparameter is configs/common.py's
(each commented with its SPEC section). Run, for example:

    python main.py --config=configs/seed0.py \\
        --config.model.hf_dir=/path/to/Qwen2.5-1.5B-Instruct --workdir=runs/seed0
    # or, with the model in the Hugging Face cache (`hf download Qwen/Qwen2.5-1.5B-Instruct`):
    python main.py --config=configs/seed0.py --config.model.hf_id=Qwen/Qwen2.5-1.5B-Instruct --workdir=runs/seed0
    # check that every program fits a TPU slice, on any CPU machine with the tpu extra (nothing is allocated):
    python main.py --config=configs/seed0.py --config.stages=compile --config.compile.target=tpu:v5e:2x4 --workdir=W

Expect 16,000 rollouts, 10 checkpoints and sketches of D = 65,536. Hardware and time: docs/records/results.md,
"Paper scale: what was measured". The layout below is chosen from the attached devices, so one config runs on one
GPU, a GPU node or a TPU slice; only the layout differs from configs/common.py, so the results are
the SPEC's up to float summation order.
"""
from configs import common


def get_config(seed: int = 0):
    c = common.get_config()
    c.seed = seed  # SPEC §2.1 / §10.2: sampling seed == contaminator seed == random-baseline seed.
    c.run_name = f"E2.1_rebuild__qwen-1.5b__grpo__seed{seed}__v3"  # SPEC §2.5 naming.
    # The compile stage needs no weights: without this it would fall back to the tiny base preset
    # when model.hf_dir is unset.
    c.compile.model = "qwen2p5_1p5b"  # SPEC §2.1's model, Qwen2.5-1.5B-Instruct's shapes.
    # Layout. Tensor-parallel pairs whenever the devices pair up (data 4 x model 2 on v5e:2x4, 8 x 2 on
    # 16 GPUs, 1 x 1 on one GPU): the in-run sketcher's shard_map is manual over "data" only, so a
    # pair halves each chip's gathered parameters and gradient sum (docs/records/benchmarks.md, "Compile stage").
    c.mesh.data, c.mesh.model = -1, -1
    # FSDP: parameters and AdamW moments split over "data", gathered per use by GSPMD (replicated they
    # take 8.6 GiB of a v5e chip's 16 before any activation); a no-op on one device.
    c.mesh.fsdp = True
    # The fused per-example sketcher (sketch/fused.py): each rollout's gradient is formed one parameter
    # use at a time inside ONE batched backward and hashed at once, never whole, so all of a device's
    # rollouts go in one chunk (16 = every rollout of a step). Its backward's weight cotangent is the
    # update (GRPOStepSpec.update_from_sketcher). (Fused is the common default; set here so the layout reads whole.)
    c.sketch.fused = True
    c.sketch.chunk_size = 16
    # The decoder layers as one lax.scan (model.scan_layers): XLA compiles one layer body instead of 28
    # (the GRPO step with in-run sketches: 120 CPU-s instead of > 6.6 CPU-min on XLA:TPU), and the
    # sketches hash on the fly inside that scan, so no int32 hash tables (5.75 GiB at 1.54B).
    c.model.scan_layers = True
    c.sketch.in_run_tables = False
    c.targets.use_tables = False
    # The metagradient's vjp (reverse over the GRPO step's own backward) rematerialises each decoder layer,
    # keeping only its input: 15.10 GiB per v5e chip instead of 20.92 GiB of temps alone (docs/records/benchmarks.md,
    # "The metagradient's vjp on a v5e:2x4"); the same dM/dw to float rounding (tests/train/test_metagradient.py).
    c.metagradient.remat = "nothing_saveable"
    return c
