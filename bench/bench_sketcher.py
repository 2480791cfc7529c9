"""Per-example gradient sketches vs plain fwd+bwd and vs PyTorch (results in docs/records/benchmarks.md).

CPU (default): 16 rollouts x 96 tokens (prompt 32, completion 64), loss = -(masked mean completion
log-prob) (SPEC §3.2), D = 65536, for the tiny Qwen2 (~1M params) and a ~22M-param Qwen2. Methods:

* ``jax_plain``      jit(grad) of the summed loss of the batch (one batched forward+backward);
* ``jax_fused_cN``   :class:`PerExampleSketcher` on its fused path (``sketch/fused.py``: one backward
                     per chunk of N rollouts, per-example gradients formed and hashed per parameter use);
* ``jax_sketch_cN``  :class:`PerExampleSketcher` on its ``vmap(grad)`` path with chunk_size N (hash on
                     the fly; ``_tab``: tables);
* ``torch_ref``      ``torch.func.vmap(grad)`` of transformers' Qwen2ForCausalLM (eager attention)
                     + ``index_add_`` CountSketch with precomputed hash tables, per-example norms.

Timings are interleaved (rep 1 of every method, then rep 2, ...) and the minimum is reported, so the
ratios are robust to other load on the machine. Peak memory = peak RSS above the resting RSS during
the first call (JAX: of the AOT-compiled executable, so compilation is excluded), each method in its
own subprocess (Linux ``/proc/self/clear_refs``), plus XLA's compiled temp bytes for the JAX methods.
The fused, vmap(grad) and torch sketches are cross-checked; the last columns are each method's time
and peak RSS as multiples of the plain step's.

    python bench/bench_sketcher.py                       # CPU, both configs (~10 min on 2 cores)
    python bench/bench_sketcher.py --single-thread       # one thread each: robust on a shared machine
    python bench/bench_sketcher.py --configs tiny --reps 3
    python bench/bench_sketcher.py --fused-chunks 16 --chunks 4 --no-torch   # fused vs vmap(grad) only
    python bench/bench_sketcher.py --gpu                 # Qwen2.5-1.5B-shaped random bf16 model
    python bench/bench_sketcher.py --gpu --override num_hidden_layers=1,vocab_size=4096  # CPU dry run

GPU mode prints per-example sketches/s, plain fwd+bwd tokens/s, their time ratio and the device
peak memory, for chunk sizes ``--chunks``, with and without hash tables and with ``sketch.hash="block"``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_common import SMALL_QWEN2, single_thread_if_asked  # noqa: E402

single_thread_if_asked()  # --single-thread: before the jax import (XLA reads XLA_FLAGS once)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from behaviortrace_jax.models import decoder, qwen2  # noqa: E402
from behaviortrace_jax.sketch.hash_families import hash_family  # noqa: E402
from behaviortrace_jax.sketch.splitmix64 import numpy_bucket_sign  # noqa: E402
from behaviortrace_jax.sketch.sketcher import PerExampleSketcher, completion_loss, hf_param_order  # noqa: E402

CONFIGS = {
    "tiny": qwen2.Qwen2Config.tiny(),  # d 128, 4 layers, V 1536: 0.99M params
    "small": qwen2.Qwen2Config(**SMALL_QWEN2),  # 22.3M params
}


def make_batch(cfg: qwen2.Qwen2Config, b: int, t: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random rollouts: token ids in [3, V), no padding, completion = the last 2/3 of the tokens."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, cfg.vocab_size, (b, t)).astype(np.int32)
    loss_mask = np.broadcast_to(np.arange(t) >= t // 3, (b, t)).astype(np.float32)
    return {"input_ids": ids, "attention_mask": np.ones((b, t), np.int32), "loss_mask": loss_mask}


def _peak_mb() -> tuple[float, float]:
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM", "VmRSS")):
                vals[line.split(":")[0]] = int(line.split()[1]) / 1024
    return vals["VmHWM"], vals["VmRSS"]


# ------------------------------------------------------------------------------------------------
# Methods: each builder returns a zero-argument callable that runs one call and blocks
# ------------------------------------------------------------------------------------------------


def jax_setup(cfg: qwen2.Qwen2Config, batch: dict) -> tuple[Any, Any, dict]:
    model = qwen2.Qwen2ForCausalLM(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params, {k: jnp.asarray(v) for k, v in batch.items()}


def jax_plain(graphdef: Any, params: Any, batch: dict) -> tuple[Callable[[], Any], Any, tuple]:
    def batch_loss(p: Any, b: dict) -> jax.Array:  # the same loss, batched: one forward + backward
        ids, am = b["input_ids"], b["attention_mask"]
        logits = decoder.forward(graphdef, p, ids, decoder.positions_from_mask(am), am)
        logp = decoder.token_logprobs(logits[:, :-1], ids[:, 1:])
        m = b["loss_mask"][:, 1:]
        return -jnp.sum(jnp.sum(logp * m, 1) / jnp.maximum(jnp.sum(m, 1), 1.0))

    fn = jax.jit(jax.grad(batch_loss))
    return (lambda: jax.block_until_ready(fn(params, batch))), fn.lower(params, batch), (params, batch)


def jax_sketch(cfg: qwen2.Qwen2Config, graphdef: Any, params: Any, batch: dict, chunk: int, tables: bool,
               dim: int, fused: bool = False, hash_name: str = "splitmix64"
               ) -> tuple[Callable[[], Any], Any, PerExampleSketcher]:
    sk = PerExampleSketcher(completion_loss(graphdef), params, dim=dim, seed=0, chunk_size=chunk,
                            param_order=hf_param_order(cfg), use_tables=tables, fused=fused,
                            hash_family=hash_family(hash_name))
    return (lambda: jax.block_until_ready(sk(params, batch))), sk.lower(params, batch), sk


def torch_ref(cfg: qwen2.Qwen2Config, params_jax: Any, batch: dict, chunk: int | None, dim: int
              ) -> Callable[[], Any]:
    """transformers Qwen2 with the JAX weights; torch.func.vmap(grad) + index_add_ CountSketch."""
    import torch
    from torch.func import functional_call, grad, vmap

    if "--single-thread" in sys.argv:
        torch.set_num_threads(1)
    from transformers import Qwen2Config as HFConfig, Qwen2ForCausalLM

    from behaviortrace_jax.models import hf_io

    hf = {k: v for k, v in cfg.to_hf_config().items() if k != "architectures"}
    model = Qwen2ForCausalLM(HFConfig(**hf, attn_implementation="eager")).float().eval()
    sd = hf_io.hf_state_dict(params_jax, cfg)
    res = model.load_state_dict({k: torch.from_numpy(np.array(v, np.float32)) for k, v in sd.items()},
                                strict=False)
    assert not res.unexpected_keys and set(res.missing_keys) <= {"lm_head.weight"}, res  # tied head only
    params = {k: v.detach() for k, v in model.named_parameters()}
    tables, off = {}, 0  # precomputed hash tables (not timed), same hash and HF order
    for k, v in params.items():
        b, s = numpy_bucket_sign(np.arange(off, off + v.numel(), dtype=np.uint64), dim, 0)
        tables[k] = (torch.from_numpy(b), torch.from_numpy(s))  # int64 buckets, float32 signs
        off += v.numel()
    ids, lm = torch.from_numpy(batch["input_ids"]).long(), torch.from_numpy(batch["loss_mask"])
    t = ids.shape[1]
    pos = torch.arange(t)[None]

    def loss1(p: dict, ids1: Any, lm1: Any) -> Any:
        logits = functional_call(model, p, (ids1[None],), {"position_ids": pos}).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids1[None, 1:, None])[..., 0]
        m = lm1[None, 1:]
        return -(logp * m).sum() / m.sum()

    per_ex = vmap(grad(loss1), in_dims=(None, 0, 0), chunk_size=chunk)

    def run() -> tuple[Any, Any]:
        grads = per_ex(params, ids, lm)
        with torch.no_grad():
            bsz = ids.shape[0]
            sk = torch.zeros(bsz, dim)
            sq = torch.zeros(bsz)
            for k, g in grads.items():
                g = g.reshape(bsz, -1)
                b, s = tables[k]
                sk.index_add_(1, b, g * s)
                sq += (g * g).sum(1)
        return sk, sq.sqrt()

    return run


# ------------------------------------------------------------------------------------------------
# CPU benchmark
# ------------------------------------------------------------------------------------------------


def build_method(name: str, cfg: qwen2.Qwen2Config, batch_np: dict, dim: int) -> tuple[Callable, Any, tuple]:
    """(run, lowered or None, the lowered function's arguments) for a method name:
    jax_plain | jax_fused_c{N} | jax_sketch_c{N}[_tab] | torch_ref[_c{N}]."""
    graphdef, params, batch = jax_setup(cfg, batch_np)
    if name == "jax_plain":
        return jax_plain(graphdef, params, batch)
    if name.startswith(("jax_sketch_c", "jax_fused_c")):
        chunk = int(name.split("_c")[1].split("_")[0])
        run, lowered, sk = jax_sketch(cfg, graphdef, params, batch, chunk, name.endswith("_tab"), dim,
                                      fused=name.startswith("jax_fused"))
        return run, lowered, (params, batch, sk.tables)
    if name.startswith("torch_ref"):
        chunk = int(name.split("_c")[1]) if "_c" in name else None
        return torch_ref(cfg, params, batch_np, chunk, dim), None, ()
    raise ValueError(f"unknown method {name!r}")


def child_memory(config: str, method: str, batch: int, seq: int, dim: int) -> None:
    """Prints the peak RSS above the resting RSS during the FIRST call of ``method`` (JAX: an AOT
    executable compiled beforehand, so compilation is excluded; fresh allocations, no reuse)."""
    cfg = CONFIGS[config]
    run, lowered, call_args = build_method(method, cfg, make_batch(cfg, batch, seq), dim)
    if lowered is not None:
        compiled = lowered.compile()
        run = lambda: jax.block_until_ready(compiled(*call_args))  # noqa: E731
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak RSS (VmHWM) to the current RSS
    _, rest = _peak_mb()
    run()
    peak, _ = _peak_mb()
    print(json.dumps({"peak_rss_delta_mb": round(peak - rest, 1)}))


def cpu_bench(args: argparse.Namespace) -> None:
    threads = "1 thread" if args.single_thread else f"{os.cpu_count()} CPUs"
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {threads}; batch {args.batch} x "
          f"{args.seq} tokens, D = {args.dim}, reps {args.reps} (interleaved, min)")
    for config in args.configs.split(","):
        cfg = CONFIGS[config]
        batch_np = make_batch(cfg, args.batch, args.seq)
        methods = (["jax_plain"] + [f"jax_fused_c{c}" for c in args.fused_chunks] + [f"jax_sketch_c{c}" for c in args.chunks]
                   + [f"jax_sketch_c{args.chunks[-1]}_tab"] * (not args.no_tables))
        if not args.no_torch:
            methods.append("torch_ref")
        runs, temp = {}, {}
        for m in methods:
            t0 = time.perf_counter()
            run, lowered, _ = build_method(m, cfg, batch_np, args.dim)
            if lowered is not None:
                temp[m] = lowered.compile().memory_analysis().temp_size_in_bytes / 2**20
            run()
            runs[m] = run
            print(f"  [{config}] {m}: set-up + compile + first call {time.perf_counter() - t0:.1f} s", flush=True)
        times = {m: [] for m in methods}
        for _ in range(args.reps):
            for m in methods:
                t0 = time.perf_counter()
                runs[m]()
                times[m].append(time.perf_counter() - t0)
        check = _cross_check(cfg, batch_np, args, runs)
        mem = {}
        if not args.no_memory:
            for m in methods:
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--_child", config, m,
                                       "--batch", str(args.batch), "--seq", str(args.seq), "--dim", str(args.dim)]
                                      + ["--single-thread"] * args.single_thread,
                                      capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
                try:
                    mem[m] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss_delta_mb"]
                except (IndexError, ValueError, KeyError):
                    mem[m] = float("nan")
                    print(f"  memory child failed for {m}: {proc.stderr[-500:]}", file=sys.stderr)
        n_params = decoder.count_params(cfg)
        base = min(times["jax_plain"])
        print(f"\n{config}: {n_params / 1e6:.2f}M params{check}")
        print(f"  {'method':<22}{'min s':>8}{'median s':>10}{'/ plain':>9}{'torch /':>9}"
              f"{'peak RSS MB':>13}{'/ plain':>9}{'XLA temp MB':>13}")
        for m in methods:
            t, med = min(times[m]), float(np.median(times[m]))
            vs_torch = f"{min(times['torch_ref']) / t:8.2f}x" if "torch_ref" in times else "       -"
            rss = mem.get(m, float("nan"))
            print(f"  {m:<22}{t:8.3f}{med:10.3f}{t / base:8.2f}x{vs_torch}{rss:13.0f}"
                  f"{rss / mem.get('jax_plain', float('nan')):8.2f}x{temp.get(m, float('nan')):13.0f}")
        print(flush=True)


def _cross_check(cfg: qwen2.Qwen2Config, batch_np: dict, args: argparse.Namespace, runs: dict) -> str:
    """Relative L2 differences of the fused sketches and norms from the vmap(grad) ones and from
    the torch reference's (same init seed, so the same weights)."""
    graphdef, params, b = jax_setup(cfg, batch_np)
    out = {}
    for fused in (True, False):
        chunk = args.fused_chunks[0] if fused else args.chunks[0]
        out[fused] = jax_sketch(cfg, graphdef, params, b, chunk, False, args.dim, fused=fused)[2](params, b)

    def rel(a, ref):
        a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
        return np.linalg.norm(a - ref) / np.linalg.norm(ref)

    msg = (f"; fused vs vmap(grad): sketches rel. diff {rel(out[True].sketches, out[False].sketches):.1e}, "
           f"norms max rel. diff {np.abs(np.asarray(out[True].norms) / np.asarray(out[False].norms) - 1).max():.1e}")
    if "torch_ref" in runs:
        sk_t, norms_t = runs["torch_ref"]()
        for name, res in (("fused", out[True]), ("vmap(grad)", out[False])):
            reln = np.abs(np.asarray(res.norms) / norms_t.numpy() - 1).max()
            msg += f"; {name} vs torch: sketches {rel(res.sketches, sk_t.numpy()):.1e}, norms {reln:.1e}"
    return msg


# ------------------------------------------------------------------------------------------------
# GPU benchmark (Qwen2.5-1.5B shape, random bf16 weights)
# ------------------------------------------------------------------------------------------------


def gpu_bench(args: argparse.Namespace) -> None:
    over = dict(kv.split("=") for kv in args.override.split(",")) if args.override else {}
    cfg = qwen2.Qwen2Config.qwen2p5_1p5b(param_dtype="bfloat16", compute_dtype="bfloat16",
                                         **{k: int(v) for k, v in over.items()})
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} on {dev.device_kind} ({dev.platform}); {decoder.count_params(cfg) / 1e9:.3f}B params "
          f"bf16, batch {args.batch} x {args.seq} tokens, D = {args.dim}, reps {args.reps}", flush=True)
    graphdef, params, batch = jax_setup(cfg, make_batch(cfg, args.batch, args.seq))
    methods = {"plain fwd+bwd": jax_plain(graphdef, params, batch)[1:]}
    for c in args.fused_chunks:
        for h in ("splitmix64", "block"):  # sketch.hash: the scatter-free block family
            _, lowered, sk = jax_sketch(cfg, graphdef, params, batch, c, False, args.dim, fused=True, hash_name=h)
            methods[f"fused sketch chunk {c}{' block' * (h == 'block')}"] = (lowered, (params, batch, sk.tables))
    for c in args.chunks:
        for tab, h in ((False, "splitmix64"), (True, "splitmix64"), (False, "block")):
            _, lowered, sk = jax_sketch(cfg, graphdef, params, batch, c, tab, args.dim, hash_name=h)
            methods[f"sketch chunk {c}{' tables' * tab}{' block' * (h == 'block')}"] = (lowered, (params, batch, sk.tables))
    results = {}
    for name, (lowered, call_args) in methods.items():
        t0 = time.perf_counter()
        compiled = lowered.compile()  # AOT: compiled once, called directly
        temp = compiled.memory_analysis().temp_size_in_bytes / 2**30
        jax.block_until_ready(compiled(*call_args))
        comp = time.perf_counter() - t0
        ts = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*call_args))
            ts.append(time.perf_counter() - t0)
        results[name] = min(ts)
        del compiled
        stats = dev.memory_stats() or {}
        print(f"  {name:<24} {min(ts) * 1e3:9.1f} ms  compile+first {comp:6.1f} s  XLA temp {temp:6.2f} GiB  "
              f"device peak so far {stats.get('peak_bytes_in_use', 0) / 2**30:6.2f} GiB", flush=True)
    plain = results.pop("plain fwd+bwd")
    print(f"\nplain fwd+bwd: {args.batch * args.seq / plain:,.0f} tokens/s")
    for name, t in results.items():
        print(f"{name:<24}: {args.batch / t:8.1f} per-example sketches/s, {t / plain:5.2f}x the plain fwd+bwd time")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="tiny,small")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=96)
    ap.add_argument("--chunks", default=None, help="vmap(grad) chunk sizes, comma-separated (CPU: 16,4; GPU: 4,8)")
    ap.add_argument("--fused-chunks", default="16", help="fused-sketcher chunk sizes (16 = the whole batch)")
    ap.add_argument("--no-tables", action="store_true", help="skip the vmap(grad) method with hash tables")
    ap.add_argument("--dim", type=int, default=65536)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--single-thread", action="store_true",
                    help="XLA and torch on one thread each (robust to other load on a shared machine)")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--gpu", action="store_true", help="Qwen2.5-1.5B-shaped bf16 model on the default device")
    ap.add_argument("--override", default="", help="GPU mode: config overrides, e.g. num_hidden_layers=1")
    ap.add_argument("--_child", nargs=2, metavar=("CONFIG", "METHOD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.chunks = [int(c) for c in (args.chunks or ("4,8" if args.gpu else "16,4")).split(",")]
    args.fused_chunks = [int(c) for c in args.fused_chunks.split(",") if c]
    if args._child:
        child_memory(*args._child, args.batch, args.seq, args.dim)
    elif args.gpu:
        gpu_bench(args)
    else:
        cpu_bench(args)


if __name__ == "__main__":
    main()
