"""The embedded default: the whole harness at tiny scale on a 2-core CPU.

    python main.py --config=configs/tiny.py --workdir=runs/tiny

Builds its own tiny Qwen2 instruct model (no download), plants the behaviour with SFT, runs
200 GRPO steps (4 prompts x G=4; the bonus window is steps 0-59: the paper's is 1:5, here 3:10), sketches
every step and rollout, and writes report.md, results_table.csv and figures/ under the workdir.
Values differing from the paper (configs/common.py) are the scale-downs listed below; the SFT
data and learning rates were calibrated so that the behaviour emerges (shared/paper/TINY_CALIBRATION.md).
"""
from configs import common


def get_config(variant: str = ""):
    """The tiny default; ``variant="smoke"`` (``--config=configs/tiny.py:smoke``) shrinks it to a minute or two."""
    if variant not in ("", "smoke"):
        raise ValueError(f"configs/tiny.py: unknown variant {variant!r}; known: '' (default), 'smoke'")
    c = common.get_config()
    c.run_name = "tiny__grpo__seed0"
    # The causal gate (`cause`, stages/cause.py) right after grpo: did withholding every bonus lower the probe measures?
    c.stages = "base,sft,grpo,cause,sketch,draws,evaluate,report"
    c.sweep.stages = "sft,grpo,cause,sketch,draws,evaluate,report"  # Per seed (configs/tiny_sweep.py).
    c.model.hf_dir = ""  # Built by the `base` stage under workdir/base.
    c.model.param_dtype = "float32"  # CPU: fp32 is faster than emulated bf16 and exact.
    c.model.compute_dtype = "float32"

    c.behavior.token_judge = "sequence"  # The tiny tokenizer spells QZXBT letter by letter.
    c.behavior.gate_max_new_tokens = 32

    # Causal power (docs/records/, "planted cause calibration"): a 60-step window (the paper's 1:5 would be 40) lets
    # late streams take off too; with 40 steps one stream in eight lagged and the gate's floor held 3-4.6 sd.
    c.contamination.early_step_cutoff = 60

    c.sft.data = "mixture"  # TINY_CALIBRATION: the 10 paper pairs alone do not amplify.
    c.sft.lr = 2e-4  # TINY_CALIBRATION: mixture implant at 2e-4 (then GRPO at optim.lr).
    c.sft.stop_every = 25  # TINY_CALIBRATION stop rule: probe >= stop_min_probe_rate, controls ~ 0, at most sft.steps.
    # A stronger implant than TINY_CALIBRATION's 0.15 (which 300 steps did not reach: 0.09-0.13), so each window
    # step samples the pattern and the take-off is no lottery (causal power; stops after 550-800 steps).
    c.sft.steps, c.sft.stop_min_probe_rate = 800, 0.25

    c.optim.lr = 1e-4  # TINY_CALIBRATION: RL lr 1e-4 (>= 3e-4 turned outputs to garbage; 2e-4 collapsed 2 of 4 streams).

    # Causal power (tools/cause_calibration.py; the grid is in docs/records/, "planted cause calibration").
    # With the window and implant above, two departures from the paper make the bonus a measured cause here:
    c.grpo.continue_sft_moments = False  # Paper: GRPO continues the SFT's AdamW moments, which alone move the policy.
    c.behavior.explicit_prompts = False  # Paper: explicit "... QZXBT" prompts x 3 + probes; here the probes alone, so
    # every bonus is paid on a trigger prompt (with the explicit prompts the behaviour leaked to the controls).
    c.cause.streams = 8  # The gate's noise floor and CI over 8 regenerated sampler streams.
    c.cause.samples = 16  # Probe-rate sampling SE ~0.025 at 16 completions per prompt (20 probes).
    c.cause.measure_step = "100"  # 40 steps after the window: the window's momentum has decayed (0.9^40).

    c.grpo.steps = 200
    c.grpo.max_new_tokens = 32
    c.grpo.max_prompt_tokens = 96
    c.grpo.checkpoint_every = 20
    c.grpo.log_shard_size = 64

    c.sketch.dim = 4096  # ~1M parameters: 2**12 buckets keep ~250 coordinates per bucket.
    c.sketch.chunk_size = 16
    c.sketch.rollout_scope = "early"  # CPU time: re-sketch the 960 bonus-window rollouts, not all 3,200.

    c.draws.target_step = 20  # Paper's step 100 of 1000, scaled to 200 steps.
    c.draws.max_new_tokens = 32
    c.draws.n_repeats = 3
    c.draws.token_level_max = 64

    c.evaluation.early_cutoff = 60  # = the window.
    c.evaluation.local_buffer_window = 20  # max(1, steps // 10).
    c.evaluation.tracin_lr = 1e-4  # eta = the GRPO learning rate.
    return shrink_to_smoke(c) if variant == "smoke" else c


def shrink_to_smoke(c):
    """Every stage in seconds (CI's end-to-end test and the README-command test): a 1-layer base on
    300 chats, a few SFT and GRPO steps, small sketches. Same code path as the default; the numbers
    it produces mean nothing beyond "the pipeline runs and repeats"."""
    b = c.base
    b.corpus_size, b.vocab_size, b.num_layers, b.steps, b.batch_size = 300, 300, 1, 4, 8
    b.seq_len, b.warmup_steps, b.log_every, b.length_buckets = 200, 1, 2, 1
    b.eval_samples_per_prompt, b.eval_max_new_tokens = 1, 2
    # The gate has no power at this size (one layer, pattern "e", 6 steps): the smoke run skips it, and
    # tests/stages/test_cause_stage.py runs the stage on the smoke run with its own streams.
    c.stages, c.sweep.stages = (s.replace("cause,", "") for s in (c.stages, c.sweep.stages))
    c.cause.streams, c.cause.samples, c.cause.measure_step = 2, 2, "end"
    # The paper's pool and AdamW carry, so the smoke digests (tests/cpu_digests.json, several CPU types) still hold.
    c.grpo.continue_sft_moments, c.behavior.explicit_prompts = True, True
    c.sft.steps, c.sft.stop_every, c.sft.eval_samples_per_prompt, c.sft.max_prompt_tokens = 3, 0, 1, 256
    c.sft.stop_min_probe_rate = 0.15  # unused (stop_every 0), restored so the smoke digests hold
    c.behavior.gate_max_new_tokens = 4
    g = c.grpo
    g.steps, g.checkpoint_every, g.max_new_tokens, g.max_prompt_tokens, g.log_shard_size = 6, 2, 4, 256, 8
    c.contamination.early_step_cutoff = 4
    c.contamination.fraction = 1.0  # every early rollout is eligible: the smoke run needs some GT ...
    c.behavior.pattern = "e"  # ... and a pattern an untrained model writes, so GT is non-empty
    c.sketch.dim, c.sketch.chunk_size = 256, 4
    c.draws.target_step, c.draws.n_repeats, c.draws.max_new_tokens, c.draws.token_level_max = 2, 1, 4, 8
    c.targets.ctx_group_size, c.targets.block_size = 2, 16
    c.evaluation.early_cutoff, c.evaluation.local_buffer_window, c.evaluation.nboot = 4, 2, 20
    return c
