"""XLA compile time of the GRPO step with splitmix64 hashed once per run of consecutive parameters
(``HashFamily.global_index``, ``countsketch.hash_segments``) against once per parameter (the same
family with ``global_index=False``, as before), on CPU.

The tiny default's model and step shapes (configs/tiny.py), one device, the persistent compilation
cache off. For each program the two hashings are lowered and compiled in alternating rounds (load
from other processes hits both alike); the figures are the median compile seconds and the lines of
the lowered StableHLO. Both hashings give the same sketches (checked on one step).

    python bench/bench_compile_hash.py [--rounds 3]

Programs: ``two_backward`` (``sketch.fused=False``: vmap(grad) rollout sketches, ``sketch_batch``,
and the step sketch, ``sketch_tree``), ``no_sketches`` (the step sketch only), ``fused`` (the fused
sketcher, which hashes per parameter use and is unchanged: a control), and ``scanned two_backward``
(``model.scan_layers``: ``sketch_batch_stacked``).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from behaviortrace_jax import runtime  # noqa: E402

_ENV = runtime.reproducible_cpu_env(os.environ)
_ENV.update(runtime.platform_env(os.environ))
if _ENV:
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_ENV})

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from behaviortrace_jax.models import qwen2, sharding  # noqa: E402
from behaviortrace_jax.sketch import hash_families, sketcher  # noqa: E402
from behaviortrace_jax.train import grpo_loss, grpo_step, train_state  # noqa: E402
from behaviortrace_jax.stages.spec import RunSpec  # noqa: E402
from configs import tiny  # noqa: E402

SEGMENT = hash_families.SPLITMIX64
PER_PARAMETER = dataclasses.replace(SEGMENT, global_index=False)  # same buckets and signs, hashed per parameter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    c = tiny.get_config()
    g, sk = c.grpo, c.sketch
    mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    tx = train_state.make_optimizer(RunSpec.from_config(c).optim)
    models = {}
    for scan in (False, True):  # the tiny default's model, its layers unrolled and scanned
        cfg = qwen2.Qwen2Config.tiny(vocab_size=c.base.vocab_size, num_hidden_layers=c.base.num_layers,
                                     param_dtype=c.model.param_dtype, compute_dtype=c.model.compute_dtype,
                                     scan_layers=scan)
        graphdef, params = nnx.split(qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
        p_sh = sharding.param_shardings(params, mesh)
        params = jax.device_put(params, p_sh)
        models[scan] = (cfg, graphdef, params, tx.init(params), p_sh, train_state.opt_state_shardings(tx, p_sh, mesh, params))
    shapes = grpo_step.StepShapes(g.prompts_per_step, g.group_size, g.max_prompt_tokens, g.max_new_tokens)
    rng = np.random.default_rng(0)
    n, t = shapes.num_rollouts, g.max_new_tokens
    prompts = [list(rng.integers(3, c.base.vocab_size, size=40)) for _ in range(n)]
    comps = rng.integers(3, c.base.vocab_size, size=(n, t)).astype(np.int32)
    batch = grpo_step.build_batch(prompts, comps, np.full(n, t, np.int32), rng.standard_normal(n).astype(np.float32),
                                  (0,), shapes, 0, vocab_size=c.base.vocab_size)
    programs = {"two_backward": (dict(fused=False), False), "no_sketches": (dict(in_run_rollouts=False), False),
                "fused": (dict(fused=True), False), "scanned two_backward": (dict(fused=False), True)}

    def step(kw: dict, scan: bool, family: hash_families.HashFamily):
        cfg, graphdef, params, _, p_sh, o_sh = models[scan]
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        spec = grpo_step.GRPOStepSpec(shapes, "paper", grpo_loss.LossConfig(), grad_clip=1.0, sketch_dim=sk.dim,
                                      sketch_seed=sk.seed, sketch_hash=family, chunk_size=sk.chunk_size,
                                      **{"in_run_rollouts": True, **kw})
        return grpo_step.make_train_step(graphdef, abstract, tx, spec, order=sketcher.hf_param_order(cfg), mesh=mesh,
                                         param_shardings=p_sh, opt_shardings=o_sh)

    secs = {(p, h): [] for p in programs for h in ("segment", "per_parameter")}
    lines, outs = {}, {}
    for r in range(args.rounds):
        for name, (kw, scan) in programs.items():
            for hname, family in (("segment", SEGMENT), ("per_parameter", PER_PARAMETER)):
                fn = step(kw, scan, family)
                params, opt_state = models[scan][2:4]
                lowered = fn.lower(params, opt_state, batch, None)
                t0 = time.perf_counter()
                compiled = lowered.compile()
                secs[(name, hname)].append(time.perf_counter() - t0)
                if r == 0:
                    lines[(name, hname)] = lowered.as_text().count("\n")
                    p, o = jax.tree.map(np.array, (params, opt_state))  # the step may donate its arguments
                    outs[(name, hname)] = jax.device_get(compiled(p, o, batch, None)[2])
    cfg, params = models[False][0], models[False][2]
    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs; tiny default ({cfg.num_hidden_layers} layers, "
          f"{sum(x.size for x in jax.tree.leaves(params)):,} params), {n} rollouts, D {sk.dim}; "
          f"median compile s of {args.rounds} rounds")
    for name in programs:
        a, b = (statistics.median(secs[(name, h)]) for h in ("segment", "per_parameter"))
        same = all(np.array_equal(outs[(name, "segment")][k], outs[(name, "per_parameter")][k])
                   for k in outs[(name, "segment")])
        print(f"  {name:<21} per parameter {b:6.2f} s {lines[(name, 'per_parameter')]:6d} lines | segments "
              f"{a:6.2f} s {lines[(name, 'segment')]:6d} lines | {a / b:.2f}x compile; outputs bit-identical: {same}")


if __name__ == "__main__":
    main()
