"""Generation throughput: the jitted KV-cache sampler vs transformers ``generate`` on the same weights.

A random Qwen2 of a few million parameters (d 256, 4 layers by default) is saved with transformers
and loaded into JAX; both generate ``--new`` tokens for ``--batch`` left-padded prompts of
``--prompt-len`` +- 7 tokens, with every row forced to the full length (no EOS in JAX,
``min_new_tokens`` in transformers). Compile time (the first JAX call) is reported separately and
excluded from tokens/s; transformers gets one untimed warm-up call. Greedy tokens of the two are
compared as a sanity check. Run on CPU:

    JAX_PLATFORMS=cpu python bench/bench_sampler.py [--batch 16 --new 64 --prompt-len 57 --reps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

from behaviortrace_jax.models import hf_io  # noqa: E402
from behaviortrace_jax.models import sampler  # noqa: E402
from hf_fixtures import save_random_qwen2  # noqa: E402


def _timed(fn, reps: int) -> float:
    """Median wall-clock seconds of ``fn()`` over ``reps`` calls."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=57)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.9, help="0 = greedy; SPEC §2.1: 0.9")
    ap.add_argument("--top-p", type=float, default=0.9)
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = save_random_qwen2(pathlib.Path(tmp) / "m", vocab=args.vocab, hidden=args.hidden,
                                   layers=args.layers, heads=4, kv_heads=2, intermediate=3 * args.hidden,
                                   tokenizer=False)
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        model = hf_io.load_hf_checkpoint(hf_dir)
    graphdef, params = nnx.split(model, nnx.Param)
    n_params = sum(int(x.size) for x in jax.tree.leaves(params))

    rng = np.random.default_rng(0)
    lens = rng.integers(args.prompt_len - 7, args.prompt_len + 8, args.batch)
    prompts = [rng.integers(3, args.vocab, n).tolist() for n in lens]
    s = sampler.Sampler(graphdef, model.config, max_prompt_tokens=int(lens.max()), max_new_tokens=args.new,
                        eos_ids=(), pad_id=0, buckets=[64 * -(-int(lens.max()) // 64)])
    ids, mask = s.pad_prompts(prompts)
    t_ids, t_mask = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)

    def run_jax(temperature, key=0):
        return s.sample(params, prompts, jax.random.key(key), temperature=temperature, top_p=args.top_p)

    def run_hf(temperature):
        kw = dict(do_sample=True, temperature=temperature, top_p=args.top_p, top_k=0) if temperature else \
            dict(do_sample=False)
        with torch.no_grad():
            return hf.generate(t_ids, attention_mask=t_mask, max_new_tokens=args.new, min_new_tokens=args.new,
                               pad_token_id=0, **kw)[:, ids.shape[1]:].numpy()

    t = time.perf_counter()
    run_jax(args.temperature)
    compile_s = time.perf_counter() - t
    run_hf(args.temperature)  # warm-up
    tokens = args.batch * args.new
    jax_s = _timed(lambda: run_jax(args.temperature), args.reps)
    hf_s = _timed(lambda: run_hf(args.temperature), args.reps)
    greedy_match = float((run_jax(0.0).tokens == run_hf(0.0)).mean())
    res = {
        "params": n_params, "batch": args.batch, "new_tokens": args.new,
        "prompt_tokens": f"{lens.min()}-{lens.max()} (padded to {ids.shape[1]})",
        "temperature": args.temperature, "top_p": args.top_p,
        "jax_compile_s": round(compile_s, 2), "jax_s": round(jax_s, 3), "hf_s": round(hf_s, 3),
        "jax_tok_per_s": round(tokens / jax_s, 1), "hf_tok_per_s": round(tokens / hf_s, 1),
        "speedup": round(hf_s / jax_s, 2), "greedy_token_match": greedy_match,
        "platform": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
                    f"jax {jax.__version__} {jax.default_backend()}, torch {torch.__version__} "
                    f"({torch.get_num_threads()} threads)",
    }
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
