"""Sketched against exact inner products of per-rollout gradients, splitmix64 vs block hash (docs/records/benchmarks.md).

Takes ``--n`` logged rollouts (log order, from the start of the run: the bonus window) of a finished
tiny run, their exact gradients of ``-(masked mean completion log-prob)`` (SPEC §3.2, the rollout
re-sketch loss) at one checkpoint (``jax.vmap(jax.grad)``, HF parameter order), and for every pair
i < j the relative error ``|<S g_i, S g_j> - <g_i, g_j>| / (|g_i| |g_j|)`` of the CountSketch S of
each family (``countsketch.sketch_batch``; ``--seeds`` hash seeds, D = the config's ``sketch.dim``).
Prints, per family, the median and 90th percentile over all pairs and seeds, the same for seed 0
alone, the CountSketch scale ``sqrt(2 / D)`` for reference, and the two families' sketch times on
the same gradients (minimum of interleaved repeats; their ratio is measured within this run).

    python bench/bench_block_hash.py --run /work/runs/tiny_sweep/seed0 --step 20 --n 64 --seeds 5
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from behaviortrace_jax.io import checkpoints, rollout_log  # noqa: E402
from behaviortrace_jax.io.layout import RunLayout  # noqa: E402
from behaviortrace_jax.models import tokenizer as tok_lib  # noqa: E402
from behaviortrace_jax.sketch import countsketch, targets  # noqa: E402
from behaviortrace_jax.sketch.hash_families import hash_family  # noqa: E402
from behaviortrace_jax.sketch.param_layout import ParamLayout  # noqa: E402
from behaviortrace_jax.sketch.sketcher import completion_loss, hf_param_order  # noqa: E402
from behaviortrace_jax.stages.sketch import CheckpointLoader  # noqa: E402
from behaviortrace_jax.stages.spec import RunSpec  # noqa: E402
from configs import tiny  # noqa: E402

FAMILIES = ("splitmix64", "block")  # config sketch.hash values


def rollout_gradients(run: str, step: int, n: int) -> tuple[list[np.ndarray], ParamLayout]:
    """Exact per-rollout gradients (float32, one array [n, *shape] per parameter in HF order) of the
    first ``n`` logged rollouts of ``run`` at its checkpoint ``step``, and their layout."""
    config = tiny.get_config()
    paths = RunLayout(run)
    entry = {e.step: e for e in checkpoints.CheckpointRegistry(paths.registry).list()}[step]
    loader = CheckpointLoader(RunSpec.from_config(config), entry.path)
    eos = tok_lib.mask_eos_ids(loader.tokenizer, config.model.mask_eos)
    records = [r for _, r in zip(range(n), rollout_log.read_rollouts(paths.rollouts))]
    examples = []
    for rec in records:
        toks = np.asarray(rec.completion_token_ids, np.int64)
        examples.append(targets.response_examples(rec.prompt_token_ids, toks, toks.size, eos, frozenset())[0])
    forced = targets.ForcedSketcher(loader.graphdef, loader.model_config, loader.abstract, dim=config.sketch.dim,
                                    block_size=n, pad_id=tok_lib.pad_id(loader.tokenizer))
    batch = {k: v[:n] for k, v in forced.pack(examples).items()}
    params = loader.params(entry.path)
    order = hf_param_order(loader.model_config)
    grads = jax.jit(jax.vmap(jax.grad(completion_loss(loader.graphdef)), in_axes=(None, 0)))(params, batch)
    arrs = [np.asarray(a, np.float32) for a in order.arrays(grads)]
    return arrs, ParamLayout(order.names, tuple(a.shape[1:] for a in arrs))


def pair_errors(arrs: list[np.ndarray], layout: ParamLayout, dim: int, seed: int,
                hash_name: str) -> np.ndarray:
    """float64 [n(n-1)/2]: the relative inner-product error of every pair i < j (module docstring)."""
    family = hash_family(hash_name)
    sk = np.asarray(jax.jit(lambda g: countsketch.sketch_batch(g, layout, dim, seed, hash_family=family))(arrs), np.float64)
    flat = np.concatenate([a.reshape(a.shape[0], -1).astype(np.float64) for a in arrs], axis=1)
    exact, approx = flat @ flat.T, sk @ sk.T
    norms = np.linalg.norm(flat, axis=1)
    iu = np.triu_indices(len(flat), 1)
    keep = (norms[iu[0]] > 0) & (norms[iu[1]] > 0)
    rel = np.abs(approx - exact)[iu] / (norms[iu[0]] * norms[iu[1]])
    return rel[keep]


def sketch_times(arrs: list[np.ndarray], layout: ParamLayout, dim: int, reps: int) -> dict:
    """Minimum seconds of ``sketch_batch`` of the gradients per family (compiled first, reps interleaved)."""
    fns = {h: jax.jit(lambda g, h=h: countsketch.sketch_batch(g, layout, dim, 0, hash_family=hash_family(h))) for h in FAMILIES}
    dev = jax.device_put(arrs)
    for f in fns.values():
        f(dev).block_until_ready()
    best = {h: float("inf") for h in FAMILIES}
    for _ in range(reps):
        for h, f in fns.items():
            t = time.perf_counter()
            f(dev).block_until_ready()
            best[h] = min(best[h], time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", default="/work/runs/tiny_sweep/seed0", help="a finished tiny run (read only)")
    ap.add_argument("--step", type=int, default=20, help="checkpoint step (default: draws.target_step)")
    ap.add_argument("--n", type=int, default=64, help="rollouts (all n(n-1)/2 pairs)")
    ap.add_argument("--seeds", type=int, default=5, help="hash seeds 0 .. seeds-1")
    ap.add_argument("--reps", type=int, default=5, help="timing repeats")
    args = ap.parse_args()
    dim = int(tiny.get_config().sketch.dim)
    arrs, layout = rollout_gradients(args.run, args.step, args.n)
    out = {"run": args.run, "step": args.step, "n": args.n, "dim": dim, "params": layout.total,
           "sqrt_2_over_D": float(np.sqrt(2 / dim)), "families": {}}
    for h in FAMILIES:
        per_seed = [pair_errors(arrs, layout, dim, s, h) for s in range(args.seeds)]
        pooled = np.concatenate(per_seed)
        out["families"][h] = {"pairs": int(per_seed[0].size), "median": float(np.median(pooled)),
                              "p90": float(np.percentile(pooled, 90)), "seed0_median": float(np.median(per_seed[0])),
                              "seed0_p90": float(np.percentile(per_seed[0], 90)),
                              "rms": float(np.sqrt(np.mean(pooled ** 2)))}
    times = sketch_times(arrs, layout, dim, args.reps)
    out["sketch_s"] = times
    out["block_over_splitmix64_time"] = times["block"] / times["splitmix64"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
