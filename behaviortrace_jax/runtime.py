"""Process set-up for a run: CPU numerics that repeat across x86-64 machines, and quiet library logs.

Same seed, same command, another CPU: XLA:CPU compiles for the host's instruction set (FMA and
vector width change float rounding), and numpy dispatches its SIMD loops on the CPU at run time. A
run is only reproducible across machines if both are pinned to one instruction set, so
:func:`reproducible_cpu_env` caps

* XLA:CPU at AVX2 (``XLA_FLAGS=--xla_cpu_max_isa=AVX2``; every x86-64 CPU of the last decade has it),
* numpy's run-time dispatch at the same level (``NPY_DISABLE_CPU_FEATURES``: no AVX-512 loops),
* OpenBLAS at its Haswell (AVX2) kernels (``OPENBLAS_CORETYPE``, only if not set already).

These variables act at process start only, so ``main.py`` re-executes itself once with them. Set
``BEHAVIORTRACE_CPU_ISA=native`` to run with the host's full instruction set instead (faster on
AVX-512, not comparable across machines). What was measured: docs/records/benchmarks.md ("CPU ISA cap").

:func:`quiet_library_logs` keeps the console to this project's own lines: orbax, absl and other
libraries log through the same absl handler at INFO (~520 lines of a default run); below
``--verbosity=1`` only their warnings and errors are shown.
"""
from __future__ import annotations

import logging as std_logging
import os
import sys
from typing import Mapping

from behaviortrace_jax.io.machine import CPU_ISA_ENV  # jax-free: safe to import before the re-exec

DEFAULT_CPU_ISA = "AVX2"
# numpy >= 2.4 names its x86 levels X86_V2 (SSE4.2), X86_V3 (AVX2/FMA), X86_V4 (AVX-512) plus extras.
_NUMPY_ABOVE_AVX2 = "X86_V4,AVX512_ICL,AVX512_SPR"
_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def reproducible_cpu_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to ``environ`` so CPU numerics do not depend on the CPU model.

    Args:
        environ: the current environment (not modified).
    Returns:
        a dict of variables to set (empty when ``BEHAVIORTRACE_CPU_ISA=native`` or when all are in
        place). ``XLA_FLAGS`` keeps the caller's flags and gains the ISA cap unless it has one;
        ``NPY_DISABLE_CPU_FEATURES`` (numpy without AVX-512 loops) and ``OPENBLAS_CORETYPE``
        (Haswell, only on a CPU with AVX2) are set only where the caller has not set them.
    Raises:
        ValueError: if ``BEHAVIORTRACE_CPU_ISA`` is not ``native`` or an XLA ISA name
            (SSE4_2, AVX, AVX2, AVX512, ...).
    """
    isa = environ.get(CPU_ISA_ENV, DEFAULT_CPU_ISA).strip()
    if isa.lower() == "native":
        return {}
    if not isa.replace("_", "").isalnum() or not isa.upper().startswith(("SSE", "AVX")):
        raise ValueError(f"{CPU_ISA_ENV}={isa!r}: expected 'native' or an XLA:CPU ISA such as AVX2")
    out: dict[str, str] = {}
    xla = environ.get("XLA_FLAGS", "")
    if "--xla_cpu_max_isa" not in xla:
        out["XLA_FLAGS"] = f"{xla} --xla_cpu_max_isa={isa.upper()}".strip()
    if "NPY_DISABLE_CPU_FEATURES" not in environ:
        out["NPY_DISABLE_CPU_FEATURES"] = _NUMPY_ABOVE_AVX2
    if "OPENBLAS_CORETYPE" not in environ and _host_has("avx2"):
        out["OPENBLAS_CORETYPE"] = "Haswell"
    return out


def platform_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``JAX_PLATFORMS`` to set so a CPU run stays quiet where ``libtpu`` is installed (the ``tpu`` extra)
    but no TPU is attached: JAX would otherwise try the TPU backend first and print its
    initialisation errors. Returns ``{}`` when ``JAX_PLATFORMS`` is set, libtpu is absent or a TPU is
    attached (``/dev/accel*`` or ``/dev/vfio/[0-9]*``); else ``cpu``, preceded by ``cuda`` when a JAX CUDA
    plugin is installed. Compiling for a TPU topology (the ``compile`` stage) works with either.
    """
    import glob
    import importlib.util

    if "JAX_PLATFORMS" in environ or importlib.util.find_spec("libtpu") is None:
        return {}
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return {}
    cuda = any(importlib.util.find_spec(m) is not None for m in ("jax_cuda13_plugin", "jax_cuda12_plugin"))
    return {"JAX_PLATFORMS": "cuda,cpu" if cuda else "cpu"}


def compile_cpu_devices(config) -> int:
    """n when ``config`` runs the ``compile`` stage with target ``cpu:<n>`` (main.py then sets
    ``jax_num_cpu_devices`` before JAX starts its backends), else 0."""
    stages = [s.strip() for s in str(config.stages).split(",")]
    if "compile" not in stages or not str(config.compile.target).startswith("cpu:"):
        return 0
    return int(str(config.compile.target).split(":", 1)[1])


def _host_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists ``flag`` (False where there is no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False


class _OwnLinesOnly(std_logging.Filter):
    """Passes records of this package and of the entry script, and anything at WARNING or above;
    drops library INFO/DEBUG."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        if record.levelno >= std_logging.WARNING or record.pathname.startswith(_PACKAGE):
            return True
        main = getattr(sys.modules.get("__main__"), "__file__", None)
        return main is not None and os.path.abspath(record.pathname) == os.path.abspath(main)


_FILTER = _OwnLinesOnly()


def quiet_library_logs(verbosity: int = 0) -> None:
    """Shows only this project's INFO lines unless ``verbosity`` >= 1 (absl ``--verbosity``).

    Installs a filter on absl's handler (orbax, etils and jax log through absl) and raises the
    standard-library loggers of chatty libraries to WARNING. Idempotent; ``verbosity >= 1`` removes
    the filter again.
    """
    from absl import logging as absl_logging

    handler = absl_logging.get_absl_handler()
    if verbosity >= 1:
        handler.removeFilter(_FILTER)
        return
    if _FILTER not in handler.filters:
        handler.addFilter(_FILTER)
    for name in ("jax", "orbax", "etils", "absl.logging", "matplotlib", "tensorstore"):
        std_logging.getLogger(name).setLevel(std_logging.WARNING)


# --------------------------------------------------------------------------------------------
# Multi-process runs (docs/architecture.md "Multi-process runs")
# --------------------------------------------------------------------------------------------
DISTRIBUTED_ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
                   "process_id": "JAX_PROCESS_ID"}
HEARTBEAT_TIMEOUT_S = 20  # a killed process is declared lost after this long; the others then exit
# On an overloaded host (load far above the core count) a live process can miss 20 s of heartbeats
# during a long XLA compile and end the run (docs/reproducibility.md "Multi-process runs"): raise it there.
HEARTBEAT_ENV = "BEHAVIORTRACE_HEARTBEAT_TIMEOUT_S"


def heartbeat_timeout_s(environ: Mapping[str, str] = os.environ) -> int:
    """Seconds without a heartbeat after which a process is declared lost: ``$BEHAVIORTRACE_HEARTBEAT_TIMEOUT_S``
    if set, else :data:`HEARTBEAT_TIMEOUT_S`.

    Raises:
        ValueError: naming the variable, for a value that is not a positive integer.
    """
    raw = environ.get(HEARTBEAT_ENV)
    if raw is None or raw == "":
        return HEARTBEAT_TIMEOUT_S
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{HEARTBEAT_ENV}={raw!r}: expected a positive whole number of seconds")
    return value
BARRIER_TIMEOUT_S = 1800  # one barrier of files.mutation (every process runs the same code)


def distributed_settings(coordinator: str | None, num_processes: int | None, process_id: int | None,
                         environ: Mapping[str, str]) -> dict | None:
    """The ``jax.distributed.initialize`` arguments from main.py's flags, else the usual variables
    (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``).

    Returns:
        None when neither names a coordinator (a single process, or ``--multihost`` with SLURM/TPU
        auto-detection); else ``{"coordinator_address", "num_processes", "process_id"}``.
    Raises:
        ValueError: a coordinator without the number of processes or the process id, or an id
            outside ``[0, num_processes)``.
    """
    coordinator = coordinator or environ.get(DISTRIBUTED_ENV["coordinator"]) or None
    if num_processes is None and environ.get(DISTRIBUTED_ENV["num_processes"]):
        num_processes = int(environ[DISTRIBUTED_ENV["num_processes"]])
    if process_id is None and environ.get(DISTRIBUTED_ENV["process_id"]):
        process_id = int(environ[DISTRIBUTED_ENV["process_id"]])
    if coordinator is None:
        return None
    if num_processes is None or process_id is None:
        raise ValueError(f"coordinator {coordinator}: also give --num_processes and --process_id "
                         f"(or {DISTRIBUTED_ENV['num_processes']} and {DISTRIBUTED_ENV['process_id']})")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"--process_id={process_id} not in [0, --num_processes={num_processes})")
    return {"coordinator_address": coordinator, "num_processes": int(num_processes), "process_id": int(process_id)}


def start_distributed(settings: dict | None, auto: bool = False) -> bool:
    """Joins a multi-process run and makes process 0 the only writer of the run's files.

    Args:
        settings: :func:`distributed_settings` (explicit coordinator), or None.
        auto: ``--multihost`` without a coordinator: ``jax.distributed.initialize()``'s own cluster
            detection (SLURM, Cloud TPU, ...).
    Returns:
        False (nothing done) for a single process; True after ``jax.distributed.initialize``.
    Several CPU processes use gloo collectives. A process that dies is declared lost after
    ``heartbeat_timeout_s()`` seconds; the coordination service then ends the others with an error naming it.
    Call before any JAX computation.
    """
    import jax

    if settings is None and not auto:
        return False
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if (settings or {}).get("num_processes", 2) > 1 and platforms.split(",")[0] in ("cpu", ""):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**(settings or {}), heartbeat_timeout_seconds=heartbeat_timeout_s(),
                               shutdown_timeout_seconds=60, initialization_timeout=300)
    if jax.process_count() > 1:
        from behaviortrace_jax.io import files

        files.configure_writer(jax.process_index() == 0, _barrier())
    return True


def _barrier():
    """``barrier(name)``: every process waits for the others (the coordination service's barrier).
    The barrier's id is its number and name, so processes that took different paths wait at
    different ids and fail with the coordination service's timeout instead of pairing up wrongly."""
    import zlib

    from jax._src import distributed

    client, count = distributed.global_state.client, [0]

    def barrier(name: str) -> None:
        count[0] += 1
        client.wait_at_barrier(f"behaviortrace:{count[0]}:{zlib.crc32(name.encode()):08x}", BARRIER_TIMEOUT_S * 1000)

    return barrier


# --------------------------------------------------------------------------------------------
# JAX's persistent compilation cache
# --------------------------------------------------------------------------------------------
CACHE_DIR_ENV = "JAX_COMPILATION_CACHE_DIR"  # JAX's own variable (the default of jax_compilation_cache_dir)


def compilation_cache_dir(workdir: str, environ: Mapping[str, str] = os.environ) -> str:
    """The folder of JAX's persistent compilation cache for a run in ``workdir``: ``$JAX_COMPILATION_CACHE_DIR``
    where it is set (one cache shared by many runs), else ``<workdir>/.jax_cache`` (a ``gs://`` path
    where the workdir is one)."""
    return environ.get(CACHE_DIR_ENV) or os.path.join(workdir, ".jax_cache")


def configure_compilation_cache(workdir: str, environ: Mapping[str, str] = os.environ) -> str:
    """Points JAX's persistent compilation cache at :func:`compilation_cache_dir` so reruns, resumed
    runs and (with ``$JAX_COMPILATION_CACHE_DIR``) other runs of the same programs load them instead
    of compiling. Returns the folder.

    Off a GPU it also turns off the XLA caches JAX adds beside its own
    (``jax_persistent_cache_enable_xla_caches``, by default the GPU autotune cache): JAX writes their
    folder, a path inside the cache folder, into the compile options it hashes into every cache key
    (jax/_src/compiler.py, jax 0.10.2), so with them a cache that is copied, moved or shared under
    another path never hits. They only act on GPUs, where they stay on. Call after
    :func:`start_distributed` (it asks JAX for its backend).
    """
    import jax

    folder = compilation_cache_dir(workdir, environ)
    if jax.default_backend() != "gpu":
        jax.config.update("jax_persistent_cache_enable_xla_caches", "")
    jax.config.update("jax_compilation_cache_dir", folder)
    return folder
