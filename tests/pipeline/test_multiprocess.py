"""Multi-process runs (docs/architecture.md "Multi-process runs").

* Unit tests (fast): the launch settings, the one-writer file helpers (``gs://`` paths and the
  kvstore a path selects: tests/io/test_remote_paths.py).
* ``test_two_processes_equal_one_process_two_devices``: the smoke pipeline as
  ``launch/local_multiprocess.sh 2`` (2 processes x 1 CPU device, one shared workdir) and as one
  process over 2 fake devices, side by side: the same rollout log and ground truth (and, with every
  stage, results_table.csv), byte for byte; the same files; no ``.tmp`` left. CI runs the training
  stages (base, sft, grpo: the gradient all-reduce, the logs, checkpoints and orbax state of two
  processes); every default stage (the sketch stores, draws, tables and report too) is ``slow``.
* ``test_killed_process_then_rerun_resumes`` (slow): 4 processes, one killed (SIGKILL) mid-GRPO; the
  others exit within 60 s with an error naming the lost task; the rerun resumes from the last
  checkpoint and ends with the uninterrupted run's table.
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
import dataclasses

import numpy as np
import pytest

from behaviortrace_jax import runtime
from behaviortrace_jax.io import files, rollout_log, sketch_store
from conftest import user_env

REPO = pathlib.Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch" / "local_multiprocess.sh"
SMOKE = "configs/tiny.py:smoke"
TIMEOUT_S = 1200
# Files whose names or bytes hold the host, the time or the process layout (not run outputs).
_VOLATILE = (".jax_cache", "tb")


def _gloo_available() -> bool:
    try:
        from jax._src.lib import _jax
    except ImportError:
        return False
    return hasattr(_jax, "make_gloo_tcp_collectives")


def _env(devices: int | None = None) -> dict[str, str]:
    env = user_env()
    env["PYTHON"] = sys.executable  # the launcher runs this interpreter, not whatever python3 is on PATH
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def _single(workdir: pathlib.Path, devices: int, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "main.py", f"--config={SMOKE}", f"--workdir={workdir}", *flags],
                            cwd=REPO, env=_env(devices), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _multi(n: int, workdir: pathlib.Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(LAUNCH), str(n), SMOKE, str(workdir), *flags], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(proc: subprocess.Popen, what: str) -> str:
    try:
        out = proc.communicate(timeout=TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL) if proc.pid else None
        pytest.fail(f"{what} did not finish within {TIMEOUT_S} s")
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{out[-6000:]}"
    return out


def _listing(w: pathlib.Path) -> set[str]:
    """The run's files, relative to ``w``. Inside an orbax train state (``*/state/STEP/ITEM/``) only
    the step and item directories count: orbax lays out its files per process (``ocdbt.process_I/``,
    ``array_metadatas/process_I``, content-hashed names), as orbax does multi-host."""
    out = set()
    for p in w.rglob("*"):
        parts = p.relative_to(w).parts
        if not p.is_file() or parts[0] in _VOLATILE or parts[:2] == ("grpo", "tb"):
            continue
        out.add("/".join(parts[:4]) if len(parts) > 4 and parts[1] == "state" else "/".join(parts))
    return out


def _assert_same_outputs(got: pathlib.Path, want: pathlib.Path, bitwise: bool = True) -> None:
    """The same results_table.csv and ground truth, byte for byte, and the same rollout log:
    bitwise, or (``bitwise=False``) the same up to the first differing completion
    token, with the log-probs before it equal to float32 rounding. At 4 processes the gradient
    all-reduce over "data" (gloo's ring between processes vs XLA's in-process sum) adds the 4
    replicas' gradients in another order, so the trained weights differ in their last bits and the
    logged log-probs by ~1e-7 relative (docs/architecture.md "Multi-process runs")."""
    if (want / "results_table.csv").exists() or (got / "results_table.csv").exists():
        assert (got / "results_table.csv").read_bytes() == (want / "results_table.csv").read_bytes()
    assert (got / "grpo" / "ground_truth.jsonl").read_bytes() == (want / "grpo" / "ground_truth.jsonl").read_bytes()
    a = list(rollout_log.read_rollouts(got / "grpo" / "rollouts"))
    b = list(rollout_log.read_rollouts(want / "grpo" / "rollouts"))
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        if bitwise:
            assert x == y, f"first differing rollout: {x.rollout_id}"
            continue
        ta, tb = x.completion_token_ids, y.completion_token_ids
        first = next((i for i, (u, v) in enumerate(zip(ta, tb)) if u != v), None)
        if first is None and len(ta) != len(tb):
            first = min(len(ta), len(tb))
        np.testing.assert_allclose(x.completion_logprobs[:first], y.completion_logprobs[:first], rtol=1e-5,
                                   atol=1e-5, err_msg=f"rollout {x.rollout_id}: log-probs before token {first}")
        if first is not None:
            print(f"rollout logs agree up to rollout {x.rollout_id}, completion token {first}")
            return
        assert dataclasses.replace(x, completion_logprobs=[]) == dataclasses.replace(y, completion_logprobs=[]), \
            f"first differing rollout: {x.rollout_id}"


# ------------------------------------------------------------------------------------------------
# unit tests
# ------------------------------------------------------------------------------------------------
def test_distributed_settings_from_flags_and_environment():
    assert runtime.distributed_settings(None, None, None, {}) is None
    env = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert runtime.distributed_settings(None, None, None, env) == {
        "coordinator_address": "h:1", "num_processes": 4, "process_id": 3}
    assert runtime.distributed_settings("x:2", 2, 0, env) == {
        "coordinator_address": "x:2", "num_processes": 2, "process_id": 0}
    with pytest.raises(ValueError, match="num_processes"):
        runtime.distributed_settings("x:2", None, None, {})
    with pytest.raises(ValueError, match="not in"):
        runtime.distributed_settings("x:2", 2, 2, {})
    assert runtime.start_distributed(None) is False  # a single process: nothing happens


def test_heartbeat_timeout_default_and_override():
    assert runtime.heartbeat_timeout_s({}) == runtime.HEARTBEAT_TIMEOUT_S == 20
    assert runtime.heartbeat_timeout_s({runtime.HEARTBEAT_ENV: "120"}) == 120
    for bad in ("0", "-5", "1.5", "soon"):
        with pytest.raises(ValueError, match=f"BEHAVIORTRACE_HEARTBEAT_TIMEOUT_S={bad!r}"):
            runtime.heartbeat_timeout_s({runtime.HEARTBEAT_ENV: bad})


def test_non_writer_process_writes_nothing_and_meets_every_barrier(tmp_path):
    calls = []
    files.configure_writer(False, calls.append)
    try:
        files.write_json(tmp_path / "a.json", {"x": 1})
        files.atomic_write_text(tmp_path / "b.txt", "b")
        files.atomic_write_dir(tmp_path / "d", lambda d: (d / "f").write_text("f"))
        (tmp_path / "keep").write_text("k")
        files.remove_file(tmp_path / "keep")
        files.remove_tree(tmp_path)
        files.copy_file(tmp_path / "keep", tmp_path / "copy")
    finally:
        files.configure_writer(True, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]
    assert len(calls) == 2 * 6 and all(c.startswith(("before ", "after ")) for c in calls)


def test_writer_process_store_rows_and_reads_meet_barriers(tmp_path):
    calls = []
    files.configure_writer(True, calls.append)
    try:
        store = sketch_store.SketchStore.open_or_create(tmp_path / "s", (4, 2), 2, {"dtype": "float32"})
        store.write_rows(0, [[1, 2], [3, 4]])
        assert store.missing_rows().tolist() == [2, 3]
        assert store.read()[1].tolist() == [3, 4]
    finally:
        files.configure_writer(True, None)
    assert len(calls) == 2 + 2 + 2  # create, missing_rows, read


def test_launch_script_checks_its_arguments():
    proc = subprocess.run(["bash", str(LAUNCH), "two"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "positive integer" in proc.stderr


# ------------------------------------------------------------------------------------------------
# the pipeline in several processes
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stages", ["base,sft,grpo", pytest.param("", marks=pytest.mark.slow)],
                         ids=["training_stages", "every_stage"])
def test_two_processes_equal_one_process_two_devices(tmp_path, stages):
    if not _gloo_available():
        pytest.skip("this jaxlib has no gloo CPU collectives")
    ref, mp = tmp_path / "one_process", tmp_path / "two_processes"
    flags = [f"--config.stages={stages}"] if stages else []
    t0 = time.perf_counter()
    procs = (_single(ref, 2, *flags), _multi(2, mp, *flags))  # side by side: the machine's cores take turns
    out_ref, out_mp = _finish(procs[0], "1 process x 2 devices"), _finish(procs[1], "2 processes x 1 device")
    print(f"both runs: {time.perf_counter() - t0:.0f} s")
    assert "JAX process 1/2" in out_mp and "JAX process 0/1" in out_ref
    _assert_same_outputs(mp, ref)
    assert _listing(mp) == _listing(ref)
    assert not [p for p in mp.rglob("*") if ".tmp" in p.name]
    assert not [p for p in mp.rglob("*") if ".old-" in p.name or p.name.endswith(".build")]


@pytest.mark.slow
def test_killed_process_then_rerun_resumes(tmp_path):
    if not _gloo_available():
        pytest.skip("this jaxlib has no gloo CPU collectives")
    ref, mp = tmp_path / "one_process", tmp_path / "four_processes"
    ref_proc = _single(ref, 4)
    proc = _multi(4, mp)
    victim = _process_pids(proc.pid)[2]
    state = mp / "grpo" / "state"
    deadline = time.time() + TIMEOUT_S
    while not (state.is_dir() and any(p.name.isdigit() for p in state.iterdir())):  # mid-GRPO
        assert proc.poll() is None and time.time() < deadline, "the 4-process run ended before its first GRPO state"
        time.sleep(0.05)
    os.kill(victim, signal.SIGKILL)
    t_kill = time.time()
    assert not (mp / "grpo" / "summary.json").exists(), "killed only after the GRPO stage had ended"
    try:
        out = proc.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the other processes did not exit within 120 s of the kill")
    waited = time.time() - t_kill
    print(f"the other processes exited {waited:.0f} s after the kill")
    assert proc.returncode != 0
    assert waited < 60, f"the others took {waited:.0f} s to exit"
    assert "task 2" in out.lower() or "task_id: 2" in out.lower() or "/task:2" in out.lower(), out[-4000:]
    _finish(_multi(4, mp), "the rerun")
    _finish(ref_proc, "1 process x 4 devices")
    _assert_same_outputs(mp, ref, bitwise=False)


def _process_pids(launcher: int) -> list[int]:
    """The main.py processes the launch script started, by process id (--process_id=I)."""
    pids = {}
    for _ in range(600):
        out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(launcher)],  # -ww: whole command
                             capture_output=True, text=True).stdout
        for line in out.splitlines():
            pid, args = line.strip().split(" ", 1)
            if "--process_id=" in args:
                pids[int(args.split("--process_id=")[1].split()[0])] = int(pid)
        if len(pids) == 4:
            return [pids[i] for i in range(4)]
        time.sleep(0.1)
    raise AssertionError(f"launch script's processes not found: {pids}")
