"""The machine a run ran on: its CPU type, library versions and kernel-selecting variables.

A run's numbers depend on these besides its config and seed (docs/reproducibility.md): XLA:CPU's
matmul libraries pick kernels and split sums by the host CPU
and the number of CPUs the process may use. ``pipeline.run`` appends :func:`run_info` to
``W/run_info.json`` (left out of the digests that tests/pipeline/test_readme_command.py compares, so a run
whose numbers match on two CPU types also matches there); tests key their recorded digests by
:func:`cpu_identity`.
"""
from __future__ import annotations

import os
from typing import Mapping

CPU_ISA_ENV = "BEHAVIORTRACE_CPU_ISA"  # runtime.py reads it; recorded here with the other variables

# The x86 flags that decide which kernels XLA:CPU's libraries (YNNPACK, oneDNN) and numpy dispatch to
# at run time; the rest of /proc/cpuinfo's flags do not change float results.
NUMERIC_FLAGS = ("sse4_2", "avx", "fma", "f16c", "avx2", "avx512f", "avx512dq", "avx512bw", "avx512vl",
                 "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_identity(cpuinfo: str | None = None, cpus: int | None = None) -> dict:
    """What identifies this machine's CPU type for numerics (docs/reproducibility.md).

    Args:
        cpuinfo: the text of /proc/cpuinfo (read when None; empty where there is none).
        cpus: the CPUs this process may run on (``os.sched_getaffinity``) when None: XLA:CPU sizes
            its thread pool by it, and matmuls split their sums by thread (docs/reproducibility.md).
    Returns:
        ``{"vendor", "family", "model", "model_name", "flags", "cpus", "key"}``: family and model
        as ints (None where absent), ``flags`` the sorted :data:`NUMERIC_FLAGS` the first processor
        lists, and ``key`` one line naming all of it (:func:`cpu_key`). The model name alone does not
        tell CPU types apart (a KVM guest may report "Intel(R) Xeon(R) Processor" for any Xeon).
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    first: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if first:
                break  # the first processor's block is enough: all cores of a VM are one type
            continue
        name, _, value = line.partition(":")
        first.setdefault(name.strip(), value.strip())
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)

    def as_int(text: str | None) -> int | None:
        return int(text) if text and text.isdigit() else None

    have = set(first.get("flags", "").split())
    out = {"vendor": first.get("vendor_id", "unknown"), "family": as_int(first.get("cpu family")),
           "model": as_int(first.get("model")), "model_name": first.get("model name", ""),
           "flags": sorted(f for f in NUMERIC_FLAGS if f in have), "cpus": int(cpus)}
    out["key"] = cpu_key(out)
    return out


def cpu_key(identity: Mapping) -> str:
    """One line for :func:`cpu_identity`'s fields, e.g. ``GenuineIntel family 6 model 167, avx avx2 ...
    avx512f ... fma, 2 CPUs``; a field that is None (not recorded) reads ``?``."""
    def show(v):
        return "?" if v is None else v
    flags = identity.get("flags")
    return (f"{identity.get('vendor')} family {show(identity.get('family'))} model {show(identity.get('model'))}, "
            f"{' '.join(flags) if flags is not None else 'flags ?'}, {show(identity.get('cpus'))} CPUs")


def run_info(environ: Mapping[str, str] = os.environ) -> dict:
    """What a run's numbers depend on besides config and seed: the CPU (:func:`cpu_identity`), the
    library versions, and the variables that select kernels (written to ``W/run_info.json``)."""
    import importlib.metadata as md

    versions = {}
    for dist in ("jax", "jaxlib", "numpy", "flax", "optax", "tokenizers"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    env_keys = ("XLA_FLAGS", "NPY_DISABLE_CPU_FEATURES", "OPENBLAS_CORETYPE", "ONEDNN_MAX_CPU_ISA",
                CPU_ISA_ENV, "JAX_PLATFORMS")
    return {"cpu": cpu_identity(), "versions": versions,
            "environment": {k: environ[k] for k in env_keys if k in environ}}
