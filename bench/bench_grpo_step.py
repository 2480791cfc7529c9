"""GRPO train step on CPU: ``sketch.fused=False`` (two passes: a batched backward for the update +
per-rollout vmap(grad) sketches) vs the default ``sketch.fused`` (the fused sketcher: one backward
gives the update and the in-run sketches), and the plain step without in-run sketches.

The tiny default's shapes (configs/tiny.py: base preset ``tiny``, B x G rollouts, prompt + completion
lengths, sketch D and chunk), random weights, one device. The two programs are timed in alternating
rounds so that load from other processes hits both alike; compile (the first call) is excluded; the
figure is the median seconds per step.

The second table is the ``sketch`` stage's unit of work: one ``targets.ForcedSketcher`` block
(``targets.block_size`` sequences of the rollout re-sketcher's length, the tiny default's chunk
and hash tables) with ``vmap(grad)`` and with the fused sketcher, alternating likewise.

    python bench/bench_grpo_step.py [--rounds 5 --steps 3]
    python bench/bench_grpo_step.py --model small --single-thread --no-stage   # issue #34's CPU target

``--model small`` is bench_common.SMALL_QWEN2 (bench_sketcher.py's ``small``: 22.3 M parameters, 6
layers, d 512, V 8192) at the same step shapes; ``--single-thread`` runs XLA on one thread (robust on
a shared machine).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from behaviortrace_jax import runtime  # noqa: E402

from bench.bench_common import SMALL_QWEN2, single_thread_if_asked  # noqa: E402

single_thread_if_asked()  # --single-thread: before the jax import (XLA reads XLA_FLAGS once)

_ENV = runtime.reproducible_cpu_env(os.environ)
_ENV.update(runtime.platform_env(os.environ))
if _ENV:
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_ENV})

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from behaviortrace_jax.models import qwen2, sharding  # noqa: E402
from behaviortrace_jax.sketch import sketcher, targets  # noqa: E402
from behaviortrace_jax.train import grpo_loss, grpo_step, train_state  # noqa: E402
from behaviortrace_jax.stages.spec import RunSpec  # noqa: E402
from configs import tiny  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--model", choices=("tiny", "small"), default="tiny",
                    help="tiny: the tiny default's base model; small: bench_common.SMALL_QWEN2, 22.3M parameters")
    ap.add_argument("--single-thread", action="store_true", help="XLA on one thread (read before jax starts)")
    ap.add_argument("--no-stage", action="store_true", help="skip the sketch stage's ForcedSketcher block")
    args = ap.parse_args()
    c = tiny.get_config()
    g, sk = c.grpo, c.sketch
    dt = dict(param_dtype=c.model.param_dtype, compute_dtype=c.model.compute_dtype)
    if args.model == "small":
        cfg = qwen2.Qwen2Config(**SMALL_QWEN2, **dt)
    else:
        cfg = qwen2.Qwen2Config.tiny(vocab_size=c.base.vocab_size, num_hidden_layers=c.base.num_layers, **dt)
    mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    graphdef, params = nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    p_sh = sharding.param_shardings(params, mesh)
    tx = train_state.make_optimizer(RunSpec.from_config(c).optim)
    o_sh = train_state.opt_state_shardings(tx, p_sh, mesh, params)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    shapes = grpo_step.StepShapes(g.prompts_per_step, g.group_size, g.max_prompt_tokens, g.max_new_tokens)
    rng = np.random.default_rng(0)
    n, t = shapes.num_rollouts, g.max_new_tokens
    prompts = [list(rng.integers(3, cfg.vocab_size, size=40)) for _ in range(n)]
    comps = rng.integers(3, cfg.vocab_size, size=(n, t)).astype(np.int32)
    batch = grpo_step.build_batch(prompts, comps, np.full(n, t, np.int32), rng.standard_normal(n).astype(np.float32),
                                  (0,), shapes, 0, vocab_size=cfg.vocab_size)
    steps, states = {}, {}
    programs = {"two_backward": dict(fused=False), "fused": dict(fused=True),
                "no_sketches": dict(in_run_rollouts=False)}
    for one, kw in programs.items():
        kw = {"in_run_rollouts": True, **kw}
        spec = grpo_step.GRPOStepSpec(shapes, "paper", grpo_loss.LossConfig(), grad_clip=1.0, sketch_dim=sk.dim,
                                      sketch_seed=sk.seed, chunk_size=sk.chunk_size, **kw)
        steps[one] = grpo_step.make_train_step(graphdef, abstract, tx, spec, order=sketcher.hf_param_order(cfg),
                                               mesh=mesh, param_shardings=p_sh, opt_shardings=o_sh)
        p = jax.device_put(jax.tree.map(np.asarray, params), p_sh)
        states[one] = (p, tx.init(p))
    times = {k: [] for k in programs}
    for r in range(args.rounds + 1):
        for one in programs:
            p, o = states[one]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                p, o, out = steps[one](p, o, batch, None)
            jax.block_until_ready(out)
            states[one] = (p, o)
            if r:  # round 0 compiles
                times[one].append((time.perf_counter() - t0) / args.steps)
    base = statistics.median(times["two_backward"])
    plain = statistics.median(times["no_sketches"])
    threads = "1 thread" if args.single_thread else f"{os.cpu_count()} CPUs"
    print(f"jax {jax.__version__}, {threads}; model {args.model}; {n} rollouts x {g.max_prompt_tokens + t} tokens, "
          f"{sum(x.size for x in jax.tree.leaves(params)):,} params, D {sk.dim}, chunk {sk.chunk_size}; "
          f"median of {args.rounds} rounds x {args.steps} steps")
    for k in programs:
        med = statistics.median(times[k])
        print(f"  {k:<14} {med * 1e3:8.1f} ms/step  ({med / base:.2f}x two_backward, {med / plain:.2f}x no_sketches)")
    if not args.no_stage:
        sketch_stage(c, cfg, graphdef, params, args)


def sketch_stage(c, cfg, graphdef, params, args) -> None:
    """One ForcedSketcher block (the sketch stage's re-sketcher shapes), vmap(grad) vs fused."""
    g, tg = c.grpo, c.targets
    rng = np.random.default_rng(1)
    length = g.max_prompt_tokens + g.max_new_tokens
    ex = []
    for _ in range(tg.block_size):
        ids = rng.integers(3, cfg.vocab_size, size=length)
        w = np.zeros(length, np.float32)
        w[g.max_prompt_tokens:] = 1
        ex.append(targets.ForcedExample(ids, w))
    fs = {f: targets.ForcedSketcher(graphdef, cfg, params, dim=c.sketch.dim, seed=c.sketch.seed,
                                    chunk_size=c.sketch.chunk_size, block_size=tg.block_size,
                                    length_bucket=tg.length_bucket, use_tables=tg.use_tables, fused=f)
          for f in (False, True)}
    times = {f: [] for f in fs}
    for r in range(args.rounds + 1):
        for f, sk in fs.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                out = sk(params, ex)
            if r:
                times[f].append((time.perf_counter() - t0) / args.steps)
    a, b = (statistics.median(times[f]) for f in (False, True))
    rel = float(np.linalg.norm(out.sketches - fs[False](params, ex).sketches) / np.linalg.norm(out.sketches))
    print(f"ForcedSketcher block: {tg.block_size} sequences x {length} tokens, chunk {c.sketch.chunk_size}, "
          f"tables {tg.use_tables}")
    print(f"  vmap(grad)     {a * 1e3:8.1f} ms/block")
    print(f"  fused          {b * 1e3:8.1f} ms/block  ({b / a:.2f}x; sketches rel. diff {rel:.1e})")


if __name__ == "__main__":
    main()
