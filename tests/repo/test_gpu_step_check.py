"""bench/gpu_step_check.py (run by bench/gpu_check.sh on a lent GPU) at tiny shapes on CPU: every
variant builds and steps, the kernel variant through the Pallas interpreter, and the table prints."""
from __future__ import annotations

import importlib.util
import pathlib

import jax

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_gpu_step_check_tiny(capsys):
    spec = importlib.util.spec_from_file_location("gpu_step_check", REPO / "bench" / "gpu_step_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(["--tiny", "--rounds", "1", "--steps", "1"])
    assert set(res["median_s"]) == set(mod.VARIANTS)  # on CPU --tiny runs the kernel interpreted
    assert all(t > 0 for t in res["median_s"].values())
    assert "interpret" in res["notes"]["fused_kernel"] and "block" in res["notes"]["fused_block_xla"]
    out = capsys.readouterr().out
    assert "| fused_kernel |" in out and f"jax {jax.__version__}" in out
