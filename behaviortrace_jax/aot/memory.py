"""The memory plan of ahead-of-time compilation: the target's devices and how much memory XLA lets
one program use on each (``config.compile.target``), and a compiled program's per-chip bytes.

* :data:`CHIPS`: peak FLOP/s, HBM bytes and bandwidth per chip (the roofline's and the fit's inputs,
  each row with its source);
* :func:`target_devices`: ``tpu:<topology>`` (a compile-only topology, libtpu), ``cpu:<n>`` or
  ``local``, with the memory per device a program is judged against (:func:`xla_memory_limit`: XLA's
  own limit read from its out-of-memory error);
* :func:`memory_bytes`: ``compiled.memory_analysis()`` per chip; :func:`hbm_exhausted`: XLA:TPU's
  refusal to compile a program over the chip's HBM, read as a row that does not fit.

Used by the ``compile`` stage (``stages/compile.py``) through ``aot/report.py``.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """Peak dense bf16 FLOP/s, HBM bytes and HBM bytes/s of one chip (per chip, not per board), and
    ``xla_limit_bytes``: the bytes XLA lets one program use where it was read from XLA's own
    out-of-memory message (None: not measured; :func:`xla_memory_limit` asks XLA at compile time)."""

    name: str
    peak_flops: float
    hbm_bytes: float
    hbm_bw: float
    xla_limit_bytes: float | None = None


CHIPS: dict[str, Chip] = {
    # https://cloud.google.com/tpu/docs/v4 : 275 TFLOP/s bf16, 32 GiB HBM2, 1,200 GB/s.
    "v4": Chip("v4", 275e12, 32 * GiB, 1200e9),
    # https://cloud.google.com/tpu/docs/v5e : 197 TFLOP/s bf16, 16 GiB HBM2, 819 GB/s.
    # XLA:TPU (libtpu 0.0.42) refuses programs over 15.75G on v5e ("exceeds available HBM (15.75G)").
    "v5e": Chip("v5e", 197e12, 16 * GiB, 819e9, 15.75 * GiB),
    # https://cloud.google.com/tpu/docs/v5p : 459 TFLOP/s bf16, 95 GiB HBM2e, 2,765 GB/s.
    "v5p": Chip("v5p", 459e12, 95 * GiB, 2765e9),
    # https://cloud.google.com/tpu/docs/v6e : 918 TFLOP/s bf16, 32 GiB HBM, 1,640 GB/s.
    "v6e": Chip("v6e", 918e12, 32 * GiB, 1640e9),
    # https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
    # A100 80GB SXM: 312 TFLOP/s dense bf16, 80 GB HBM2e, 2,039 GB/s.
    "A100": Chip("A100", 312e12, 80e9, 2039e9),
    # https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
    # H100 SXM: 989 TFLOP/s dense bf16 (1,979 with sparsity), 80 GB HBM3, 3.35 TB/s.
    "H100": Chip("H100", 989e12, 80e9, 3350e9),
    # https://www.nvidia.com/en-us/data-center/h200/ : H200 SXM: 989 TFLOP/s dense bf16, 141 GB HBM3e, 4.8 TB/s.
    "H200": Chip("H200", 989e12, 141e9, 4800e9),
}
_KIND_TO_CHIP = (("v5 lite", "v5e"), ("v5e", "v5e"), ("v5litepod", "v5e"), ("v6 lite", "v6e"), ("v6e", "v6e"),
                 ("v5p", "v5p"), ("v5", "v5p"), ("v4", "v4"), ("h200", "H200"), ("h100", "H100"), ("a100", "A100"))


class DoesNotFit(RuntimeError):
    """A compiled program needs more memory per chip than the target has."""


def chip_for(kind: str) -> Chip | None:
    """The :data:`CHIPS` row of a device kind / topology name ("TPU v5 lite", "v5e", "NVIDIA H200")."""
    k = kind.lower()
    for pattern, name in _KIND_TO_CHIP:
        if pattern in k:
            return CHIPS[name]
    return None


def xla_memory_limit(device: Any) -> float | None:
    """Bytes per device that XLA lets one program use on ``device`` (a TPU, also a compile-only
    topology device), read from the out-of-memory error of a probe program that asks for 1 TiB;
    None where XLA compiles it anyway (CPU) or names no limit."""
    probe = jax.jit(lambda: jnp.zeros((1 << 40,), jnp.int8), out_shardings=jax.sharding.SingleDeviceSharding(device))
    try:
        probe.lower().compile()
    except Exception as e:  # noqa: BLE001 - XLA reports the limit in its out-of-memory error
        need = hbm_exhausted(e)
        return float(need[1]) if need and need[1] else None
    return None


def _tpu_chip(target: str, name: str) -> Chip:
    chip = chip_for(name)
    if chip is None or not chip.name.startswith("v"):
        known = sorted(c for c in CHIPS if c.startswith("v"))
        raise ValueError(f"compile.target={target!r}: unknown TPU chip {name!r}; known: {known} "
                         "(add its row to aot/memory.py CHIPS)")
    return chip


def target_devices(target: str) -> tuple[list[Any], Chip | None, float | None]:
    """(devices, chip row or None, memory bytes per device or None) of ``config.compile.target``.

    The memory is what XLA lets a program use: for a TPU, XLA's own limit (:func:`xla_memory_limit`,
    else the chip's measured ``xla_limit_bytes``, else its nominal HBM with a warning); for ``local``,
    the device's ``bytes_limit``; for ``cpu:<n>``, host memory / n. None: unknown (fits not judged).

    Raises:
        ValueError: for an unknown target or TPU chip, or ``cpu:<n>`` when JAX has fewer CPU devices.
        RuntimeError: for ``tpu:...`` without libtpu (install the ``tpu`` extra).
    """
    kind, _, rest = target.partition(":")
    if kind == "tpu":
        chip = _tpu_chip(target, rest.split(":")[0])
        from jax.experimental import topologies
        try:
            topo = topologies.get_topology_desc(topology_name=rest, platform="tpu")
        except Exception as e:  # noqa: BLE001 - libtpu missing or unknown topology
            raise RuntimeError(f"compile.target={target!r}: no TPU topology ({type(e).__name__}: {e}); "
                               "install the tpu extra: pip install -e '.[tpu]'") from e
        devs = list(topo.devices)
        mem = xla_memory_limit(devs[0]) or chip.xla_limit_bytes
        if mem is None:
            logging.warning("compile: XLA named no memory limit for %s; judging fit against the nominal %.2f GiB "
                            "HBM (XLA can use less)", chip.name, chip.hbm_bytes / GiB)
        return devs, chip, mem or chip.hbm_bytes
    if kind == "cpu":
        n = int(rest)
        devs = jax.devices("cpu")
        if len(devs) < n:
            raise ValueError(f"compile.target={target!r} but JAX has {len(devs)} CPU device(s): start through "
                             f"main.py (it sets jax_num_cpu_devices) or set jax.config jax_num_cpu_devices={n} "
                             "before JAX initialises")
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return devs[:n], None, host / n
    if kind == "local":
        devs = jax.devices()
        chip = chip_for(devs[0].device_kind)
        mem = None
        try:
            mem = float((devs[0].memory_stats() or {}).get("bytes_limit")) or None
        except Exception:  # noqa: BLE001 - not every backend has memory stats
            pass
        if mem is None and chip is None:
            logging.warning("compile: no memory limit known for device kind %r; fits are not judged",
                            devs[0].device_kind)
        return devs, chip, mem or (chip.xla_limit_bytes or chip.hbm_bytes if chip else None)
    raise ValueError(f"compile.target={target!r}: expected tpu:<topology>, cpu:<n> or local")



def memory_bytes(compiled: Any) -> dict[str, int]:
    """Per-chip bytes of ``compiled.memory_analysis()``: ``argument``, ``output``, ``temp``, ``alias``,
    ``generated_code`` and their ``total`` (arguments + outputs - aliased + temps + code); {} where the
    backend gives no memory analysis."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    out = {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
           for k in ("argument", "output", "temp", "alias", "generated_code")}
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"] + out["generated_code"]
    return out



def hbm_exhausted(e: Exception) -> tuple[int, int | None, str] | None:
    """(required temp bytes, available bytes, message) when XLA refused to compile for lack of HBM
    ("RESOURCE_EXHAUSTED: Ran out of memory on HBM ... temporaries (17.87G) exceeds available HBM
    (15.75G)"), else None. The program compiled through code generation; only the memory is known."""
    import re

    msg = str(e)
    if "RESOURCE_EXHAUSTED" not in msg:
        return None
    sizes = [float(x) * GiB for x in re.findall(r"\(([0-9.]+)G\)", msg)]
    first = msg.splitlines()[0][:300]
    return (int(sizes[0]) if sizes else 0, int(sizes[1]) if len(sizes) > 1 else None, first)
