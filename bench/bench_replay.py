"""Counterfactual replay: seconds per step against GRPO, the exact shortcut, and the cost of a late measure.

One run, one process, three measurements on a finished run (the tiny default):

1. A replay step (``train/replay.py``: batch from the rollout log, the GRPO stage's jitted update, here
   with one rollout removed per step, the ``weighted`` program the counterfactual stage runs) against
   a GRPO step of the same run (``stages/grpo.GRPORun.rollout_step``: sampling, reward, the update with
   its in-run sketches, logging), started from the run's SFT state in a scratch copy. Timed in
   alternating rounds so that load from other processes hits both alike; the first round compiles and
   is excluded; medians over the timed rounds. Issue 13's target: ratio <= 0.5.
2. The exact shortcut (issue 46 item 5) on a stretch of the run's zero-advantage steps: the full
   forward + backward step against the optimizer on zero gradients (``Replayer.shortcut``), from the
   same state, alternating; the final parameters and optimizer state are checked bit for bit.
3. A fixed-rollout replay measured at the run's end (200 steps) against one measured at the end of the
   contamination window (40 steps), shortcut on, measure included. Issue 46's target: <= 1.5x.

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
from behaviortrace_jax.stages.spec import RunSpec  # noqa: E402
from behaviortrace_jax.train import replay as R  # noqa: E402
from behaviortrace_jax.io.replay_request import ReplayRequest  # noqa: E402


def load_config(path: str):
    name, _, variant = path.partition(":")
    spec = importlib.util.spec_from_file_location("bench_cfg", REPO / name if not os.path.isabs(name) else name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(variant) if variant else mod.get_config()


def _same_bits(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb))


def _copy(state: R.ReplayState) -> R.ReplayState:
    return R.ReplayState(state.step, jax.tree.map(jax.numpy.copy, state.params), jax.tree.map(jax.numpy.copy,
                                                                                            state.opt_state))


def replay_vs_grpo(config, rp, run: pathlib.Path, steps: int, rounds: int) -> tuple[float, float]:
    """Median s/step of the weighted replay step and of the GRPO step (measurement 1)."""
    n = rp.shapes.num_rollouts
    req = ReplayRequest(intervention="remove", target=range(1, steps * n, n), stop_step=steps)  # one off per step
    rp.shortcut = False  # the program the stage runs on a step with a nonzero advantage
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="bench_replay_"))
    try:
        for d in ("base", "sft"):
            shutil.copytree(run / d, scratch / d)
        grun = grpo_stage.GRPORun(config, RunLayout(scratch))
        replay_times, grpo_times, gstep = [], [], 0
        for rnd in range(rounds + 1):
            stamps = []

            def on_step(_s, params, _o):
                jax.block_until_ready(params)
                stamps.append(time.perf_counter())

            t0 = time.perf_counter()
            rp.run(req, on_step=on_step)
            rt = np.diff([t0, *stamps])
            gt = []
            for _ in range(steps):
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
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        rp.shortcut = True
    return float(np.median(replay_times)), float(np.median(grpo_times))


def shortcut_vs_full(rp, steps: int, rounds: int) -> tuple[float, float, int, bool]:
    """(full s/step, shortcut s/step, first step of the stretch, bit-identical) on ``steps``
    consecutive zero-advantage steps after the window (measurement 2)."""
    zero = [all(float(a) == 0.0 for a in d.batch["advantages"]) for d in rp.data]
    first = next(s for s in range(rp.schedule.window_steps(), rp.steps - steps + 1) if all(zero[s:s + steps]))
    state = rp.run(ReplayRequest(stop_step=first)).state
    req = ReplayRequest(start_step=first, stop_step=first + steps)
    full_t, fast_t, same = [], [], True
    for rnd in range(rounds + 1):
        out = {}
        for mode in (False, True):
            rp.shortcut = mode
            res = rp.run(req, start=_copy(state))
            out[mode] = res
            if rnd:
                (fast_t if mode else full_t).append(res.seconds_per_step)
        same &= _same_bits(out[True].state.params, out[False].state.params) and \
            _same_bits(out[True].state.opt_state, out[False].state.opt_state)
        print(f"round {rnd}{' (compile)' if not rnd else ''}: zero-advantage steps {first}..{first + steps - 1}: "
              f"full {out[False].seconds_per_step:.4f} s/step, shortcut {out[True].seconds_per_step:.4f} s/step "
              f"({out[True].zero_gradient_steps} shortcut)", flush=True)
    rp.shortcut = True
    return float(np.median(full_t)), float(np.median(fast_t)), first, same


def late_vs_early(rp, rounds: int) -> tuple[float, float, int, int]:
    """(seconds of a fixed replay measured at the run's end, at the window's end, those steps)
    (measurement 3): wall time of ``Replayer.run`` with the measure, shortcut on, median of rounds."""
    early, late = rp.schedule.window_steps(), rp.steps
    times = {early: [], late: []}
    for rnd in range(rounds + 1):
        for at in (early, late):
            res = rp.run(ReplayRequest(measure_steps=(at,)))
            if rnd:
                times[at].append(res.seconds)
            print(f"round {rnd}{' (compile)' if not rnd else ''}: fixed replay to step {at}: {res.seconds:.2f} s "
                  f"({res.zero_gradient_steps} of {at} steps shortcut)", flush=True)
    return float(np.median(times[late])), float(np.median(times[early])), late, early


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", required=True, help="a finished run (its sft/ and grpo/rollouts)")
    ap.add_argument("--config", default="configs/tiny.py")
    ap.add_argument("--steps", type=int, default=8, help="steps per round (measurements 1 and 2)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (after one compile round)")
    args = ap.parse_args()
    config = load_config(args.config)
    run = pathlib.Path(args.workdir).expanduser().resolve()
    rp = R.Replayer(RunSpec.from_config(config).replay, run, layout=RunSpec.from_config(config).layout)
    r, g = replay_vs_grpo(config, rp, run, args.steps, args.rounds)
    full, fast, first, same = shortcut_vs_full(rp, args.steps, args.rounds)
    late, early, n_late, n_early = late_vs_early(rp, args.rounds)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}, "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")
    print(f"run: {run} ({config.grpo.prompts_per_step}x{config.grpo.group_size} rollouts/step, "
          f"{config.grpo.max_new_tokens} new tokens, {rp.steps} steps)")
    print(f"1. replay step {r:.3f} s, GRPO step {g:.3f} s, ratio replay/GRPO = {r / g:.2f} (median of "
          f"{args.rounds * args.steps} steps each)")
    print(f"2. zero-advantage steps {first}..{first + args.steps - 1}: full {full:.4f} s/step, shortcut "
          f"{fast:.4f} s/step ({full / fast:.1f}x); bit-identical params and optimizer state: {same}")
    print(f"3. fixed replay measured at step {n_late}: {late:.2f} s, at step {n_early}: {early:.2f} s, "
          f"ratio {late / early:.2f} (target <= 1.5)")


if __name__ == "__main__":
    main()
