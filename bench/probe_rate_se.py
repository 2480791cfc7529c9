"""How the sampled probe rate's sampling error shrinks with samples per prompt (issue 47): the
standard errors of ``behavior.probe_measures.rate_stats`` (stratified binomial ``se``, pooled
``se_binomial``) against the measured sd of the rate over independent sampler keys, on one finished
run's policy (its last GRPO checkpoint's HF export, else the SFT export).

For each of ``--keys`` keys, ``max(--n)`` samples of every probe prompt are drawn once (the measure's
nested keys: the first n samples are the n-sample measure), so every n is measured on the same draws.

    python bench/probe_rate_se.py --workdir /tmp/run --variant smoke [--keys 16] [--n 1,2,4,8,16,32]

Prints one JSON line per n: the mean rate, the measured sd over keys, the mean predicted ``se`` and
``se_binomial``, and their ratio to the measured sd.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--variant", default="smoke", help="configs/tiny.py variant the run was made with")
    ap.add_argument("--keys", type=int, default=16)
    ap.add_argument("--n", default="1,2,4,8,16,32")
    args = ap.parse_args()

    import jax
    from flax import nnx

    from behaviortrace_jax.behavior import probe_measures as pm
    from behaviortrace_jax.behavior.probes import make_sampler
    from behaviortrace_jax.io.layout import RunLayout
    from behaviortrace_jax.models import hf_io, tokenizer as tok_lib
    from behaviortrace_jax.stages.spec import RunSpec
    from configs import tiny

    spec = RunSpec.from_config(tiny.get_config(args.variant))
    beh, opts = spec.behaviors[0], spec.probe_grpo
    paths = RunLayout(args.workdir)
    ckpts = sorted(paths.checkpoints.glob("step_*")) if paths.checkpoints.is_dir() else []
    hf_dir = ckpts[-1] if ckpts else paths.sft_hf
    tok = tok_lib.load_tokenizer(hf_dir)
    model = hf_io.load_hf_checkpoint(hf_dir, param_dtype="float32")
    graphdef, params = nnx.split(model, nnx.Param)
    probes, _ = beh.probe_sets()
    ids = pm.chat_prompt_ids(tok, [p.prompt for p in probes], max_tokens=opts.max_prompt_tokens)
    smp = make_sampler(graphdef, model.config, tok, None, opts.max_new_tokens, opts.max_prompt_tokens)
    ns = sorted(int(x) for x in args.n.split(","))
    t0 = time.perf_counter()
    hits = [pm.sampled_hits(smp, params, tok, ids, samples_per_prompt=ns[-1], key=jax.random.key(k),
                            temperature=opts.temperature, top_p=opts.top_p, pattern=beh.pattern)
            for k in range(args.keys)]
    seconds = time.perf_counter() - t0
    print(json.dumps({"checkpoint": str(hf_dir), "pattern": beh.pattern, "prompts": len(ids), "keys": args.keys,
                      "max_new_tokens": opts.max_new_tokens, "temperature": opts.temperature, "top_p": opts.top_p,
                      "sampling_seconds": round(seconds, 1), "samples": args.keys * ns[-1] * len(ids)}))
    for n in ns:
        st = [pm.rate_stats(h[:, :n]) for h in hits]
        rates = np.array([s["rate"] for s in st])
        measured = float(np.std(rates, ddof=1))
        se = float(np.sqrt(np.mean([s["se"] ** 2 for s in st]))) if n > 1 else float("nan")
        binom = float(np.sqrt(np.mean([s["se_binomial"] ** 2 for s in st])))
        print(json.dumps({"n": n, "rate": round(float(rates.mean()), 4), "measured_sd": round(measured, 4),
                          "se": round(se, 4), "se_binomial": round(binom, 4),
                          "se_over_measured": round(se / measured, 3) if measured > 0 else None,
                          "binomial_over_measured": round(binom / measured, 3) if measured > 0 else None}))


if __name__ == "__main__":
    main()
