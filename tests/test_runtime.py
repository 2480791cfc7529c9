"""runtime.py: the CPU ISA cap for reproducible numerics, quiet library logs; pipeline path resolution."""
from __future__ import annotations

import logging as std_logging
import os

import pytest
from absl import logging as absl_logging

from behaviortrace_jax import pipeline
from behaviortrace_jax import runtime
from configs import reproduce, tiny


def test_reproducible_cpu_env_caps_xla_and_numpy_and_keeps_user_settings():
    env = runtime.reproducible_cpu_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8 --xla_cpu_max_isa=AVX2"
    assert "X86_V4" in env["NPY_DISABLE_CPU_FEATURES"]
    already = {"XLA_FLAGS": "--xla_cpu_max_isa=AVX", "NPY_DISABLE_CPU_FEATURES": "", "OPENBLAS_CORETYPE": "Zen"}
    assert runtime.reproducible_cpu_env(already) == {}  # a re-executed process does not loop
    assert runtime.reproducible_cpu_env({runtime.CPU_ISA_ENV: "native"}) == {}
    assert "--xla_cpu_max_isa=AVX512" in runtime.reproducible_cpu_env({runtime.CPU_ISA_ENV: "avx512"})["XLA_FLAGS"]
    with pytest.raises(ValueError, match="BEHAVIORTRACE_CPU_ISA"):
        runtime.reproducible_cpu_env({runtime.CPU_ISA_ENV: "fast; rm -rf"})


def _record(pathname: str, level: int) -> std_logging.LogRecord:
    return std_logging.LogRecord("absl", level, pathname, 1, "msg", None, None)


def test_library_info_lines_are_dropped_unless_verbose():
    handler = absl_logging.get_absl_handler()
    try:
        runtime.quiet_library_logs(0)
        ours = os.path.join(os.path.dirname(runtime.__file__), "grpo.py")
        assert handler.filter(_record(ours, std_logging.INFO))
        assert not handler.filter(_record("/site-packages/orbax/checkpoint/manager.py", std_logging.INFO))
        assert handler.filter(_record("/site-packages/orbax/checkpoint/manager.py", std_logging.WARNING))
        runtime.quiet_library_logs(1)
        assert handler.filter(_record("/site-packages/orbax/checkpoint/manager.py", std_logging.INFO))
    finally:
        runtime.quiet_library_logs(1)


def test_config_paths_resolve_relative_and_home(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    c = tiny.get_config()
    c.model.hf_dir, c.behavior.probes_path = "ckpt/qwen", "~/probes.jsonl"
    out = pipeline.resolve_config_paths(c)
    assert out.model.hf_dir == str(tmp_path / "ckpt" / "qwen")
    assert out.behavior.probes_path == str(tmp_path / "home" / "probes.jsonl")
    assert out.behavior.controls_path == ""  # "" keeps meaning "the default file"
    assert c.model.hf_dir == "ckpt/qwen"  # the caller's config is not changed
    r = reproduce.get_config()
    r.reference_dir = "ref"  # the top-level alias and the field that references it both resolve
    out = pipeline.resolve_config_paths(r)
    assert out.reference_dir == out.evaluation.reference_dir == str(tmp_path / "ref")
