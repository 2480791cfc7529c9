"""Paper scale on a TPU slice: configs/paper.py plus a layout for v5e:2x4 (FSDP,
mesh data 4 x model 2, shard_map sketches, layers scanned, the fused per-example sketcher at chunk 16:
one backward per GRPO step gives the update and every rollout's sketch). Compile figures per program, per chip, in docs/benchmarks.md ("Compile
stage"); run the compile stage before booking a slice.

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
    # gradient and of the gradient sum (docs/benchmarks.md, "Compile stage").
    c.mesh.data = -1  # the rest of the chips (4 on v5e:2x4, 8 chips)
    c.mesh.model = 2
    # FSDP: parameters and AdamW moments split over "data" (1/8 per chip), gathered per use by GSPMD;
    # replicated they take 8.6 GiB of v5e's 16 before any activation.
    c.mesh.fsdp = True
    # The fused per-example sketcher (sketch/fused.py): each rollout's gradient is formed one parameter use
    # at a time inside ONE batched backward and hashed at once, never whole, so all of a chip's rollouts
    # go in one chunk (16 >= the 4 per data shard). Its backward's weight cotangent is the update.
    c.sketch.fused = True
    c.sketch.chunk_size = 16
    # The decoder layers as one lax.scan (models/decoder.py, model.scan_layers): XLA:TPU compiles one
    # layer body instead of 28 (the GRPO step with in-run sketches: 120 CPU-s instead of > 6.6 CPU-min),
    # and the per-example sketches hash on the fly inside that scan (no int32 hash tables: 5.75 GiB
    # replicated at 1.54B; the scanned sketcher takes none).
    c.model.scan_layers = True
    c.sketch.in_run_tables = False
    c.targets.use_tables = False
    # The fused backward is the step's only backward (GRPOStepSpec.update_from_sketcher), so the
    # vmap(grad) path's grpo.one_backward (per-rollout gradients summed) is not needed. Same update
    # as configs/paper.py's batched backward up to float summation order (tests/test_grpo.py).
    c.grpo.one_backward = False
    c.compile.target = "tpu:v5e:2x4"
    c.compile.model = "qwen2p5_1p5b"
    # The GRPO step's FLOP and bytes ratios are XLA's counts of the step with over without in-run
    # sketches (stages/compile.loop_counted_cost): both variants are compiled.
    c.compile.both_sketch_variants = True
    return c
