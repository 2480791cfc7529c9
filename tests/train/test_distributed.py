"""Two processes on localhost (jax.distributed, gloo CPU collectives) run the sharded GRPO step and
match the single-process, single-device step (tests/distributed_worker.py)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from behaviortrace_jax.io.checkpoints import tree_path_name
from behaviortrace_jax.models import sharding

import test_grpo

WORKER = Path(__file__).resolve().parents[1] / "distributed_worker.py"
TIMEOUT_S = 240


def _gloo_available() -> bool:
    try:
        from jax._src.lib import _jax
    except ImportError:
        return False
    return hasattr(_jax, "make_gloo_tcp_collectives")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_workers(out: Path, n: int = 2) -> None:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = [subprocess.Popen([sys.executable, str(WORKER), f"--process_id={i}", f"--num_processes={n}",
                               f"--port={port}", f"--out={out}"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(n)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"distributed workers did not finish within {TIMEOUT_S} s")
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"worker {i} exited {p.returncode}:\n{log[-4000:]}"


@pytest.mark.slow
def test_two_process_step_equals_single_process(tmp_path):
    if not _gloo_available():
        pytest.skip("this jaxlib has no gloo CPU collectives (jax._src.lib._jax.make_gloo_tcp_collectives)")
    out = tmp_path / "two_process.npz"
    _run_workers(out)
    got = dict(np.load(out))

    mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    _, _, params, opt_state, step = test_grpo._setup(mesh)
    batch = jax.device_put(test_grpo._batch(seed=5), sharding.data_sharding(mesh))
    params, opt_state, want = step(params, opt_state, batch, None)

    assert {k[4:] for k in got if k.startswith("out.")} == set(want)
    for k, v in want.items():
        np.testing.assert_allclose(got["out." + k], np.asarray(v), rtol=1e-4, atol=1e-6, err_msg=k)
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]
    assert {"param." + tree_path_name(p) for p, _ in leaves} == {k for k in got if k.startswith("param.")}
    for path, leaf in leaves:
        key = tree_path_name(path)
        np.testing.assert_allclose(got["param." + key], leaf, rtol=1e-4, atol=1e-5, err_msg=key)
