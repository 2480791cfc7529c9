"""runtime.py: the CPU ISA cap, quiet library logs; pipeline path resolution; io/machine.py: the CPU identity
and run_info.json."""
from __future__ import annotations

import json
import logging as std_logging
import os

import pytest
from absl import logging as absl_logging

from behaviortrace_jax import pipeline
from behaviortrace_jax import runtime
from behaviortrace_jax.io import machine
from configs import reproduce, tiny
from conftest import user_env


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
    r.reference_dir = "ref"  # the reproduce stage's one reference_dir key resolves like every path
    out = pipeline.resolve_config_paths(r)
    assert out.reference_dir == str(tmp_path / "ref")


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9B14
flags\t\t: fpu sse4_2 avx fma avx2 avx512f avx512bw avx512_bf16 sha_ni

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9B14
flags\t\t: fpu sse4_2 avx fma avx2 avx512f avx512bw avx512_bf16 sha_ni
"""


def test_cpu_identity_names_vendor_family_model_numeric_flags_and_cpus():
    got = machine.cpu_identity(CPUINFO, cpus=2)
    assert {k: got[k] for k in ("vendor", "family", "model", "cpus")} == {
        "vendor": "AuthenticAMD", "family": 25, "model": 17, "cpus": 2}
    assert got["flags"] == ["avx", "avx2", "avx512_bf16", "avx512bw", "avx512f", "fma", "sse4_2"]  # not fpu, sha_ni
    assert got["key"] == "AuthenticAMD family 25 model 17, " + " ".join(got["flags"]) + ", 2 CPUs"
    assert machine.cpu_identity("", cpus=1)["key"] == "unknown family ? model ?, , 1 CPUs"
    here = machine.cpu_identity()
    assert here["cpus"] >= 1 and here["key"] == machine.cpu_key(here)


def test_every_invocation_is_recorded_in_run_info(tmp_path, monkeypatch):
    warned = []
    monkeypatch.setattr(absl_logging, "warning", lambda msg, *a: warned.append(msg % a))
    first = pipeline.record_run_info(str(tmp_path), "base")
    assert first["cpu"]["key"] == machine.cpu_identity()["key"] and first["versions"]["jax"] and not warned
    monkeypatch.setattr(machine, "cpu_identity", lambda: {**first["cpu"], "key": "another CPU type"})
    pipeline.record_run_info(str(tmp_path), "sft,grpo")
    runs = json.loads((tmp_path / "run_info.json").read_text())["runs"]
    assert [r["stages"] for r in runs] == ["base", "sft,grpo"] and len(warned) == 1 and "another CPU type" in warned[0]


_CACHE_PROBE = """
import sys
import jax, jax.numpy as jnp
from behaviortrace_jax import runtime
hits = []
jax.monitoring.register_event_listener(lambda e, **kw: hits.append(e) if e.endswith("/cache_hits") else None)
print(runtime.configure_compilation_cache(sys.argv[1]))
jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((16, 16)))
print(len(hits))
"""


def test_compilation_cache_entries_hit_under_another_folder_and_workdir(tmp_path):
    """A cache copied to another folder (another workdir's .jax_cache, or $JAX_COMPILATION_CACHE_DIR)
    still hits: the key holds no path (runtime.configure_compilation_cache)."""
    import shutil
    import subprocess
    import sys

    def probe(workdir, cache=None):
        env = user_env(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PLATFORMS="cpu")
        if cache:
            env[runtime.CACHE_DIR_ENV] = str(cache)
        out = subprocess.run([sys.executable, "-c", _CACHE_PROBE, str(workdir)], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        folder, hits = out.stdout.split()
        return folder, int(hits)

    a = tmp_path / "a" / ".jax_cache"
    assert probe(tmp_path / "a") == (str(a), 0)
    n = len(list(a.glob("*-cache")))  # the jitted function and the eager ops (jnp.ones) it ran
    assert n >= 2
    shutil.copytree(a, tmp_path / "b" / ".jax_cache")
    assert probe(tmp_path / "b") == (str(tmp_path / "b" / ".jax_cache"), n)  # copied to another workdir: all hit
    assert probe(tmp_path / "c", cache=a) == (str(a), n)  # one cache for several workdirs
    assert len(list(a.glob("*-cache"))) == n and not (tmp_path / "c" / ".jax_cache").exists()
    assert runtime.compilation_cache_dir("gs://b/run", {}) == "gs://b/run/.jax_cache"
    assert runtime.compilation_cache_dir("w", {runtime.CACHE_DIR_ENV: "/shared"}) == "/shared"
