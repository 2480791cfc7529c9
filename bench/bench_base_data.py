"""The base stage's data preparation under main.py's CPU malloc settings: tokenizers' threads on or off.

main.py re-executes itself with one glibc malloc arena (``MALLOC_ARENA_MAX=1``, plus no mmap and no
trim) because XLA's train step is fastest that way. The ``tokenizers`` library's worker threads then
contend for that one arena. This script runs the base stage's data preparation (the 40k-chat corpus,
BPE training, encoding every chat) in fresh child processes, each with main.py's malloc settings and
``TOKENIZERS_PARALLELISM`` true (the library's default) or false (what main.py sets), and prints the
seconds of each part and the ratio true / false measured in the same run (this machine is noisy).
The encoding is also timed for every chat vs each distinct chat once (``encode_chat_examples``
tokenizes distinct texts once; 32,249 of the 40,000 chats are distinct).

    python bench/bench_base_data.py [--reps 2]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "4294967295", "MALLOC_ARENA_MAX": "1"}


def child() -> None:
    """One measurement; prints a JSON line of seconds."""
    sys.path.insert(0, str(REPO))
    from configs import tiny
    from behaviortrace_jax.behavior import corpus
    from behaviortrace_jax.train import lm_trainer
    from behaviortrace_jax.behavior import tiny_tokenizer
    from behaviortrace_jax.models import tokenizer as tok_lib

    b = tiny.get_config().base
    out = {}
    t = time.perf_counter()
    examples = corpus.build_corpus(b.seed, b.corpus_size, n_terms=b.n_terms, n_heldout=b.n_heldout)
    out["corpus"] = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        tiny_tokenizer.train_tokenizer(tiny_tokenizer.training_texts(examples), d, b.vocab_size)
        out["bpe_training"] = time.perf_counter() - t
        tok = tok_lib.load_tokenizer(d)
    chats = [(e.system, e.user, e.assistant) for e in examples]
    t = time.perf_counter()
    lm_trainer.encode_chat_examples(tok, chats, append_eos=True)
    out["encode_distinct_once"] = time.perf_counter() - t
    texts = [tok_lib.chat_prompt(tok, s, u) + a + tok.eos_token for s, u, a in chats]
    t = time.perf_counter()
    tok(texts, add_special_tokens=False)
    out["tokenize_every_chat"] = time.perf_counter() - t
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2, help="child runs per setting (interleaved)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child()
    results: dict[str, list[dict]] = {"true": [], "false": []}
    for _ in range(args.reps):
        for par in results:
            env = {**os.environ, **MALLOC, "TOKENIZERS_PARALLELISM": par}
            line = subprocess.run([sys.executable, __file__, "--child"], env=env, check=True, capture_output=True,
                                  text=True).stdout.strip().splitlines()[-1]
            results[par].append(json.loads(line))
    keys = list(results["true"][0])
    best = {par: {k: min(r[k] for r in rs) for k in keys} for par, rs in results.items()}
    print(f"{'part (best of %d, s)' % args.reps:28s} {'parallel':>9s} {'1 thread':>9s} {'ratio':>6s}")
    for k in keys:
        print(f"{k:28s} {best['true'][k]:9.2f} {best['false'][k]:9.2f} {best['true'][k] / best['false'][k]:6.2f}")
    tot = {p: best[p]["corpus"] + best[p]["bpe_training"] + best[p]["encode_distinct_once"] for p in best}
    print(f"{'data total (as in the stage)':28s} {tot['true']:9.2f} {tot['false']:9.2f} {tot['true'] / tot['false']:6.2f}")


if __name__ == "__main__":
    main()
