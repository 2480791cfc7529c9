"""The GRPO step with and without its fused non-finite flag (``train/nonfinite.step_finite``).

The smoke config's shapes (``configs/tiny.py:smoke``: N = 16, P = 256, T = 4, fused sketcher with
in-run sketches), or with ``--default`` the tiny default's model (4 layers, vocab 1500), random
weights, one CPU device. The same step is built twice, once with ``step_finite`` replaced by a
constant True; the two are timed in alternating rounds (compile excluded); prints the median and
minimum milliseconds per step.

    python bench/bench_nonfinite_flag.py [--default] [--rounds 15]
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time
from behaviortrace_jax.stages.spec import RunSpec

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--default", action="store_true", help="the tiny default's model instead of the smoke one")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from behaviortrace_jax.sketch import sketcher
    from behaviortrace_jax.stages import base
    from behaviortrace_jax.train import grpo_loss, grpo_step, nonfinite, train_state
    from configs import tiny

    config = tiny.get_config("" if args.default else "smoke")
    cfg = base.model_config(RunSpec.from_config(config))
    gd, params = nnx.split(cfg.module_class()(cfg, rngs=nnx.Rngs(params=0)), nnx.Param)
    spec = RunSpec.from_config(config).step
    sh = spec.shapes
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, 200, 40)) for _ in range(sh.num_rollouts)]
    comp = rng.integers(1, 200, (sh.num_rollouts, sh.completion_len)).astype(np.int32)
    adv = grpo_loss.group_advantages(rng.normal(size=sh.num_rollouts).astype(np.float32), sh.group_size)
    batch = {k: jnp.asarray(v) for k, v in grpo_step.build_batch(
        prompts, comp, np.full(sh.num_rollouts, sh.completion_len), adv, (0,), sh, 0).items()}
    tx = train_state.make_optimizer(RunSpec.from_config(config).optim)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    real, fns = nonfinite.step_finite, {}
    for name, flag in (("with the flag", real), ("without", lambda loss, norm, p: jnp.bool_(True))):
        nonfinite.step_finite = flag  # read when the step is traced
        step = grpo_step.train_step_function(gd, abstract, tx, spec, order=sketcher.hf_param_order(cfg), mesh=None)[0]
        fns[name] = jax.jit(step)
        jax.block_until_ready(fns[name](params, tx.init(params), batch, None))
    nonfinite.step_finite = real
    opt = tx.init(params)
    times = {k: [] for k in fns}
    for _ in range(args.rounds):
        for k, f in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(f(params, opt, batch, None))
            times[k].append(time.perf_counter() - t)
    for k, v in times.items():
        print(f"{k:14s} median {1e3 * np.median(v):7.2f} ms   min {1e3 * min(v):7.2f} ms")


if __name__ == "__main__":
    main()
