"""The GRPO step on one accelerator, three ways (issue 34, item 5): plain (no in-run rollout sketches),
fused with the XLA path (splitmix64, and the block hash), fused with the Pallas kernel
(``sketch/pallas_sketch.py``, block hash). Run by ``bench/gpu_check.sh``.

Paper shape: Qwen2.5-1.5B (``qwen2p5_1p5b``, 28 layers, scanned as in configs/paper.py) with random
weights in bfloat16, the batch shape of ``configs/seed0.py`` (prompts_per_step x group_size rollouts,
max_prompt_tokens + max_new_tokens tokens, sketch D and chunk), one device. The variants are timed in
alternating rounds (compile, the first call, excluded); the figure is the median ms per step. Memory:
XLA's per-program bytes (arguments + outputs + temps - aliased, ``memory_analysis``) and the device's
peak bytes in use after each variant's rounds (monotone over the run, where the backend reports it).

The kernel is Mosaic-TPU code: it is timed where the device is a TPU, interpreted with ``--tiny``
(a correctness run of the same code path), and reported as skipped elsewhere (a GPU runs the block
hash on the XLA path: ``hash_families.AUTO_RULES``).

    python bench/gpu_step_check.py [--rounds 5 --steps 3]
    python bench/gpu_step_check.py --tiny --rounds 1 --steps 1     # CPU, tiny shapes (tests)
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from behaviortrace_jax.models import decoder, families, sharding  # noqa: E402
from behaviortrace_jax.sketch import hash_families, sketcher  # noqa: E402
from behaviortrace_jax.train import grpo_loss, grpo_step, train_state  # noqa: E402
from configs import seed0  # noqa: E402

# variant -> GRPOStepSpec overrides (hash family name, kernel, in-run rollout sketches)
VARIANTS = {"plain": ("splitmix64", "xla", False), "fused_xla": ("splitmix64", "xla", True),
            "fused_block_xla": ("block", "xla", True), "fused_kernel": ("block", "pallas", True)}


def _model(tiny: bool, dtype: str):
    """(config, graphdef, params): Qwen2.5-1.5B's shapes (or the tiny preset, 1 layer) with random weights."""
    if tiny:
        cfg = families.preset("tiny", "qwen2", vocab_size=256, num_hidden_layers=1, param_dtype=dtype,
                              compute_dtype=dtype)
    else:
        cfg = families.preset("qwen2p5_1p5b", "qwen2", param_dtype=dtype, compute_dtype=dtype, scan_layers=True)
    model = decoder.init_model(cfg, seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    return cfg, graphdef, params


def _program_bytes(compiled) -> int | None:
    m = compiled.memory_analysis()
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def _peak() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def build(args):
    """(steps, states, batch, shapes, cfg, notes): the jitted step of each variant that runs here."""
    c = seed0.get_config()
    g, sk = c.grpo, c.sketch
    cfg, graphdef, params = _model(args.tiny, "bfloat16")
    platform = jax.devices()[0].platform
    shapes = grpo_step.StepShapes(2, 2, 16, 8) if args.tiny else \
        grpo_step.StepShapes(g.prompts_per_step, g.group_size, g.max_prompt_tokens, g.max_new_tokens)
    dim, chunk = (4096, 4) if args.tiny else (int(sk.dim), int(sk.chunk_size))
    mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    p_sh = sharding.param_shardings(params, mesh)
    tx = train_state.make_optimizer(c.optim)
    o_sh = train_state.opt_state_shardings(tx, p_sh, mesh, params)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    rng = np.random.default_rng(0)
    n, t = shapes.num_rollouts, shapes.completion_len
    prompts = [list(rng.integers(3, cfg.vocab_size, size=shapes.prompt_len - 8)) for _ in range(n)]
    comps = rng.integers(3, cfg.vocab_size, size=(n, t)).astype(np.int32)
    batch = grpo_step.build_batch(prompts, comps, np.full(n, t, np.int32), rng.standard_normal(n).astype(np.float32),
                                  (0,), shapes, 0, vocab_size=cfg.vocab_size)
    steps, states, notes = {}, {}, {}
    for name, (family, kernel, in_run) in VARIANTS.items():
        if kernel == "pallas" and platform != "tpu":
            if not args.tiny:
                notes[name] = f"skipped: the kernel is Mosaic-TPU code, the device is {platform}"
                continue
            kernel = "interpret"
        spec = grpo_step.GRPOStepSpec(shapes, "paper", grpo_loss.LossConfig(), grad_clip=1.0, sketch_dim=dim,
                                      sketch_seed=0, chunk_size=chunk, in_run_rollouts=in_run,
                                      sketch_hash=hash_families.hash_family(family), sketch_kernel=kernel)
        steps[name] = grpo_step.make_train_step(graphdef, abstract, tx, spec, order=sketcher.hf_param_order(cfg),
                                                mesh=mesh, param_shardings=p_sh, opt_shardings=o_sh)
        p = jax.device_put(jax.tree.map(lambda x: jnp.array(x, copy=True), params), p_sh)  # the step donates it
        states[name] = (p, tx.init(p))
        notes[name] = f"{family} hash, {kernel}" + ("" if in_run else ", no in-run rollout sketches")
    return steps, states, batch, shapes, cfg, notes, params


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on any backend (the kernel interpreted)")
    args = ap.parse_args(argv)
    steps, states, batch, shapes, cfg, notes, params = build(args)
    mem, peak, times = {}, {}, {k: [] for k in steps}
    for k, fn in steps.items():
        mem[k] = _program_bytes(fn.lower(*states[k], batch, None).compile())
    for r in range(args.rounds + 1):
        for k, fn in steps.items():
            p, o = states[k]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                p, o, out = fn(p, o, batch, None)
            jax.block_until_ready(out)
            states[k] = (p, o)
            if r:  # round 0 compiles
                times[k].append((time.perf_counter() - t0) / args.steps)
            peak[k] = _peak()
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"device {jax.devices()[0].device_kind} ({jax.devices()[0].platform}), jax {jax.__version__}; "
          f"{shapes.num_rollouts} rollouts x {shapes.prompt_len + shapes.completion_len} tokens, "
          f"{n_params:,} params, bfloat16; median of {args.rounds} rounds x {args.steps} steps")
    base = statistics.median(times["plain"])
    med = {k: statistics.median(v) for k, v in times.items()}
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    print("| variant | median ms | x plain | program GiB | x plain | device peak GiB (cumulative) | what |")
    print("|---|---|---|---|---|---|---|")
    for k in VARIANTS:
        if k not in steps:
            print(f"| {k} | - | - | - | - | - | {notes[k]} |")
            continue
        mratio = "-" if not mem[k] or not mem["plain"] else f"{mem[k] / mem['plain']:.2f}"
        print(f"| {k} | {med[k] * 1e3:.1f} | {med[k] / base:.2f} | {gib(mem[k])} | {mratio} | {gib(peak[k])} | "
              f"{notes[k]} |")
    return {"median_s": med, "program_bytes": mem, "peak_bytes": peak, "notes": notes}


if __name__ == "__main__":
    main()
