"""Counterfactual replay vs GRPO: seconds per step on the same run, same machine, one process.

A replay step (``train/replay.py``: batch from the rollout log, the GRPO stage's jitted update, here
with per-rollout weights, the ``weighted`` program the counterfactual stage runs) against a GRPO step
of the same run (``stages/grpo.GRPORun.rollout_step``: sampling, reward, the update with its in-run
sketches, logging), started from the run's SFT state in a scratch copy. The two are timed in
alternating rounds so that load from other processes hits both alike; compile (the first round) is
excluded; each per-step time is the median over the timed rounds. Issue 13's target: ratio <= 0.5.

    python bench/bench_replay.py --workdir runs/tiny [--config configs/tiny.py --steps 8 --rounds 3]

Needs a finished run (``sft/state``, ``grpo/rollouts``). Applies main.py's CPU environment (AVX2
cap, malloc settings) by re-executing itself once.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import platform
import shutil
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from behaviortrace_jax import runtime  # noqa: E402

_ENV = runtime.reproducible_cpu_env(os.environ)
_ENV.update({k: v for k, v in {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "4294967295",
                                "MALLOC_ARENA_MAX": "1", "TOKENIZERS_PARALLELISM": "false"}.items()
             if k not in os.environ})
if _ENV:
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_ENV})

import importlib.util  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from behaviortrace_jax.io.layout import RunLayout  # noqa: E402
from behaviortrace_jax.models import sharding  # noqa: E402
from behaviortrace_jax.stages import grpo as grpo_stage  # noqa: E402
from behaviortrace_jax.train import replay as R  # noqa: E402
from behaviortrace_jax.stages.spec import RunSpec


def load_config(path: str):
    name, _, variant = path.partition(":")
    spec = importlib.util.spec_from_file_location("bench_cfg", REPO / name if not os.path.isabs(name) else name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(variant) if variant else mod.get_config()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", required=True, help="a finished run (its sft/ and grpo/rollouts)")
    ap.add_argument("--config", default="configs/tiny.py")
    ap.add_argument("--steps", type=int, default=8, help="steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (after one compile round)")
    args = ap.parse_args()
    config = load_config(args.config)
    run = pathlib.Path(args.workdir).expanduser().resolve()

    rp = R.Replayer(RunSpec.from_config(config).replay, run, layout=RunSpec.from_config(config).layout, rates=False)
    w = np.ones(rp.num_rollouts, np.float32)
    w[1::rp.shapes.num_rollouts] = 0.0  # one rollout off per step: the weighted program on every step
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="bench_replay_"))
    try:
        for d in ("base", "sft"):
            shutil.copytree(run / d, scratch / d)
        grun = grpo_stage.GRPORun(config, RunLayout(scratch))
        replay_times, grpo_times, gstep = [], [], 0
        for rnd in range(args.rounds + 1):
            stamps = []

            def on_step(_s, params, _o):
                jax.block_until_ready(params)
                stamps.append(time.perf_counter())

            t0 = time.perf_counter()
            rp.run(w, stop_step=args.steps, measure_steps=[], on_step=on_step)
            rt = np.diff([t0, *stamps])
            gt = []
            for _ in range(args.steps):
                t = time.perf_counter()
                grun.rollout_step(gstep)
                jax.block_until_ready(grun.updater.params)
                gt.append(time.perf_counter() - t)
                gstep += 1
            if rnd:  # round 0 compiles
                replay_times += rt.tolist()
                grpo_times += gt
            print(f"round {rnd}{' (compile)' if not rnd else ''}: replay {np.median(rt):.3f} s/step, "
                  f"grpo {np.median(gt):.3f} s/step", flush=True)
        r, g = float(np.median(replay_times)), float(np.median(grpo_times))
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
              f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")
        print(f"run: {run} ({config.grpo.prompts_per_step}x{config.grpo.group_size} rollouts/step, "
              f"{config.grpo.max_new_tokens} new tokens)")
        print(f"replay step {r:.3f} s, GRPO step {g:.3f} s, ratio replay/GRPO = {r / g:.2f} "
              f"(median of {len(replay_times)} steps each)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
