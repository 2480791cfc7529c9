"""Paper scale on a TPU slice (issue 12 item 3): configs/paper.py plus a layout for v5e:2x4 (FSDP,
shard_map sketches, chunk 1, hash tables). NOT yet proven to fit: at 28 layers the compile stage
measured 17.87 GiB of temporaries per chip for the GRPO step with in-run sketches, over v5e's 16
(docs/benchmarks.md, "Compile stage"); run the compile stage before booking a slice.

    # check on any CPU machine with the tpu extra (nothing is allocated):
    python main.py --config=configs/paper_tpu.py --config.stages=compile --workdir=W
    # run on the slice (the same layout):
    launch/tpu_pod.sh configs/paper_tpu.py gs://bucket/runs/seed0 --config.model.hf_dir=...

Only the layout differs from the paper config; every hyperparameter (SPEC) is unchanged, so the
results are the paper config's up to float summation order.
"""
from configs import paper


def get_config(seed: int = 0):
    c = paper.get_config(seed=seed)
    # data 4 x model 2 on v5e:2x4 (16 rollouts = 4 per data shard): the in-run sketcher's shard_map is
    # manual over "data" only, so each chip holds half of the gathered parameters, of each per-rollout
    # gradient, of the gradient sum and (train/grpo_step.table_shardings) of the hash tables. Measured
    # at 2 layers (docs/benchmarks.md): arguments 0.84 GiB/chip vs 1.45 with data 8 x model 1.
    c.mesh.data = -1  # the rest of the chips (4 on v5e:2x4, 8 chips)
    c.mesh.model = 2
    # FSDP: parameters and AdamW moments split over "data" (1/8 per chip), gathered per use by GSPMD;
    # replicated they take 8.6 GiB of v5e's 16 before any activation.
    c.mesh.fsdp = True
    # One per-example gradient at a time inside each chip's shard_map (2 rollouts per chip): a chunk
    # of c holds c full gradients (2.9 GiB each at 1.54B in bf16).
    c.sketch.chunk_size = 1
    # Hash tables (int32, 4 B/parameter, replicated: 5.75 GiB at 1.54B) as inputs instead of hashing
    # inside the jitted programs: TPU code generation of on-the-fly hash fusions grows with the
    # parameter count (../shared/notes/AOT_FINDINGS.md).
    c.sketch.in_run_tables = True
    c.targets.use_tables = True
    # One backward per GRPO step (issue 12 items 3-4): the update is the sum of the per-rollout
    # gradients the in-run sketcher computes anyway, and the step sketch is the clip factor times the
    # sum of the rollout sketches (CountSketch is linear) - no batched backward, no second full-gradient
    # copy. Same update up to float summation order (tests/test_grpo.py), hence off in configs/paper.py.
    c.grpo.one_backward = True
    c.compile.target = "tpu:v5e:2x4"
    c.compile.model = "qwen2p5_1p5b"
    # The GRPO step FLOP ratio is analytic (stages/compile.configured_flop_ratio): no need to also
    # compile the step without in-run sketches (a program this config never runs).
    c.compile.both_sketch_variants = False
    return c
