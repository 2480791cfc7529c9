"""What the default CPU ISA cap costs: the tiny model's train step under XLA:CPU capped at AVX2 vs native.

main.py caps XLA:CPU (and numpy) at AVX2 so that runs repeat across x86-64 machines
(behaviortrace_jax/runtime.py). This measures the price on the host: the base stage's shape
(tiny Qwen2, 4 layers, d 128, vocab 1500; batch 32 x 96 tokens; one jitted forward+backward+AdamW
step, as lm_trainer does) and the GRPO-sized forward+backward (16 x 128 tokens). Each setting runs in
its own process (XLA reads its flags once); processes alternate (native, AVX2, native, AVX2, ...)
and each reports its best step time, so the ratio is robust to other load on the machine.

    python bench/bench_cpu_isa.py                # 3 alternations x 30 timed steps
    python bench/bench_cpu_isa.py --rounds 2 --steps 10
    python bench/bench_cpu_isa.py --no-ynnpack   # also: AVX2 with YNNPACK off and oneDNN capped at AVX2

``--no-ynnpack`` adds a third setting, the candidate for dots that do not depend on the CPU beyond
AVX2 (docs/reproducibility.md): ``--xla_cpu_experimental_ynn_fusion_type=`` sends every dot to
Eigen with oneDNN's sgemm, which ``ONEDNN_MAX_CPU_ISA=AVX2`` caps. Ratios are against AVX2.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(steps: int) -> dict:
    sys.path.insert(0, REPO)
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from behaviortrace_jax.models import decoder, qwen2

    cfg = qwen2.Qwen2Config.tiny(vocab_size=1500, param_dtype="float32", compute_dtype="float32")
    graphdef, params = nnx.split(decoder.init_model(cfg, seed=0), nnx.Param)
    opt = optax.adamw(1e-3)
    opt_state = opt.init(params)

    def loss(p, ids):
        mask = jnp.ones_like(ids)
        logits, _ = nnx.merge(graphdef, p)(ids, decoder.positions_from_mask(mask), mask)
        return -jnp.mean(decoder.token_logprobs(logits[:, :-1], ids[:, 1:]))

    @jax.jit
    def step(p, s, ids):
        g = jax.grad(loss)(p, ids)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    out = {}
    for name, shape in (("base_step_32x96", (32, 96)), ("fwd_bwd_16x128", (16, 128))):
        ids = jax.random.randint(jax.random.key(1), shape, 0, cfg.vocab_size, jnp.int32)
        p, s = step(params, opt_state, ids)
        jax.block_until_ready(p)
        best = float("inf")
        for _ in range(steps):
            t = time.perf_counter()
            p, s = step(p, s, ids)
            jax.block_until_ready(p)
            best = min(best, time.perf_counter() - t)
        out[name] = best
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--no-ynnpack", action="store_true", help="also time AVX2 without YNNPACK, oneDNN at AVX2")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.steps)))
        return
    sys.path.insert(0, REPO)
    from behaviortrace_jax import runtime

    settings = {"native": {}, "AVX2": {}}
    if args.no_ynnpack:
        settings["AVX2, no YNNPACK"] = {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for isa, extra in settings.items():
            env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPY_DISABLE_CPU_FEATURES",
                                                                   "ONEDNN_MAX_CPU_ISA")}
            env.update(extra)
            env[runtime.CPU_ISA_ENV] = isa.split(",")[0]
            env.update(runtime.reproducible_cpu_env(env))
            res = json.loads(subprocess.run([sys.executable, __file__, "--worker", "--steps", str(args.steps)],
                                            env=env, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
            for k, v in res.items():
                best.setdefault(isa, {})[k] = min(best.get(isa, {}).get(k, float("inf")), v)
    print(f"{'program':<18} {'native ms':>10} {'AVX2 ms':>10} {'AVX2/native':>12}"
          + "".join(f" {name + ' ms':>22} {'/ AVX2':>7}" for name in list(settings)[2:]))
    for k in best["native"]:
        n, a = best["native"][k] * 1e3, best["AVX2"][k] * 1e3
        print(f"{k:<18} {n:>10.2f} {a:>10.2f} {a / n:>12.3f}"
              + "".join(f" {best[name][k] * 1e3:>22.2f} {best[name][k] * 1e3 / a:>7.3f}" for name in list(settings)[2:]))


if __name__ == "__main__":
    main()
