"""The ``compile`` stage: ahead-of-time compilation of every jitted program a config runs.

    python main.py --config=configs/seed0.py --config.stages=compile \\
        --config.compile.target=tpu:v5e:2x4 --config.compile.model=qwen2p5_1p5b --workdir=W

Nothing is allocated on an accelerator: each program (a name of ``models.programs.PROGRAMS``) is
built by the same constructor the run uses, on the run's mesh (``grpo.make_train_step``,
``sampler.Sampler``, ``lm_trainer.LMTrainer``, ``targets.ForcedSketcher``, ``metagradient.MetaStep``;
:data:`PROGRAM_BUILDERS`) and lowered through its public jitted function with
``jax.ShapeDtypeStruct`` arguments that carry their shardings on a mesh of the target's devices,
then compiled. ``config.compile.target``:

* ``tpu:<topology>`` (``tpu:v5e:2x4``, ``tpu:v6e:2x4``, ``tpu:v5p:2x2x1``): the devices of
  ``jax.experimental.topologies.get_topology_desc`` - XLA:TPU on this host; needs ``libtpu``
  (``pip install -e '.[tpu]'``);
* ``cpu:<n>``: n host CPU devices (``main.py`` sets ``jax_num_cpu_devices`` before JAX starts;
  jax 0.10.2 has no CPU topology description);
* ``local``: the attached devices (a GPU, a TPU VM).

Per program: compile seconds, host peak RSS, per-chip bytes of ``compiled.memory_analysis()``
(arguments, outputs, temps, aliased, generated code) against the chip's memory, XLA's FLOPs and
bytes accessed per chip with every loop trip counted (:func:`loop_counted_cost`: XLA's own cost
analysis counts a ``while`` body - ``lax.scan``, ``lax.map``, the decode loop - once) and a roofline
``max(FLOPs / peak, bytes / bandwidth)`` from :data:`CHIPS` on those counts. The GRPO step's FLOP and
bytes ratios (with over without in-run rollout sketches) are of the same counts.
Writes ``W/compile_report.{json,md}``; raises :class:`DoesNotFit` naming each program over budget.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from behaviortrace_jax.io import files
from behaviortrace_jax.io.layout import RunLayout, as_path
from behaviortrace_jax.models import decoder, families, programs, sampler as sampler_lib, sharding
from behaviortrace_jax.sketch import sketcher, targets
from behaviortrace_jax.stages.registry import register_stage
from behaviortrace_jax.train import grpo_loss, grpo_step as grpo, lm_trainer, train_state

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
        need = _hbm_exhausted(e)
        return float(need[1]) if need and need[1] else None
    return None


def _tpu_chip(target: str, name: str) -> Chip:
    chip = chip_for(name)
    if chip is None or not chip.name.startswith("v"):
        known = sorted(c for c in CHIPS if c.startswith("v"))
        raise ValueError(f"compile.target={target!r}: unknown TPU chip {name!r}; known: {known} "
                         "(add its row to stages/compile.py CHIPS)")
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


def model_config(config: ml_collections.ConfigDict) -> decoder.DecoderConfig:
    """The model to compile: ``compile.model`` = a model-family preset (e.g. ``qwen2p5_1p5b``,
    ``llama3p2_1b``, ``qwen3_1p7b``; of ``model.family`` when set), or "" = ``model.hf_dir``'s
    config.json when present, else the ``base`` stage's preset of ``base.family``. Only shapes
    are read; no weights. ``compile.num_layers`` > 0 overrides the depth; ``model.scan_layers`` (when
    the config has it) sets the model's scan over layers."""
    c, dt = config.compile, dict(param_dtype=config.model.param_dtype, compute_dtype=config.model.compute_dtype)
    hf, family = config.model.hf_dir, config.model.family or None
    if c.model:
        cfg = families.preset(c.model, family, **dt)
    elif hf and (as_path(hf) / "config.json").is_file():
        cfg = families.config_from_hf(files.local_dir(hf), family, **dt)
    else:
        cfg = families.preset(config.base.preset, config.base.family,
                              vocab_size=config.base.vocab_size, num_hidden_layers=config.base.num_layers, **dt)
    if config.model.scan_layers:  # a lax.scan over the layers (models/decoder.py)
        cfg = cfg.replace(scan_layers=True)
    return cfg.replace(num_hidden_layers=c.num_layers) if c.num_layers > 0 else cfg


# ------------------------------------------------------------------------------------------------
# XLA's own cost analysis with every loop trip counted
# ------------------------------------------------------------------------------------------------

COST_KEYS = (("flops", "flops"), ("bytes accessed", "bytes_accessed"), ("transcendentals", "transcendentals"))
_COMPUTATION = re.compile(r"^(ENTRY )?%([^\s(]+) \(")
_CALLEE = re.compile(r"\b(?:condition|body|calls|to_apply)=%([^\s,)}]+)")
_CALLEES = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_WHILE = re.compile(r"\swhile\(.*\bcondition=%([^\s,]+), body=%([^\s,]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_DEF = re.compile(r"^\s*(?:ROOT )?%([^\s=]+) = ")
_CONST = re.compile(r"\bconstant\((-?\d+)\)")


class UncountedLoop(ValueError):
    """A compiled program whose loop trips :func:`loop_counted_cost` cannot count (no HLO module, a
    ``while`` loop without a known or inferable trip count and no caller bound, a loop whose start
    is not a constant); the message names the loop."""


def _inferred_trips(line: str, comps: dict[str, list[str]], caller: str) -> int | None:
    """The trip count of a ``while`` instruction ``line`` (in computation ``caller``) that XLA did
    not annotate (XLA:TPU's optimised HLO has no ``known_trip_count``), from the loop's own form:
    its condition is ``counter < N`` with ``counter`` a tuple element and N a constant, the
    counter's initial value (the while operand's element) a constant c (through copies) and its
    step 1 (JAX's): N - c. None when the condition has another form.

    Raises:
        UncountedLoop: the condition is ``counter < N`` but the counter's initial value is not a
            constant that can be traced (no silent start of 0), naming the loop.
    """
    cond = _WHILE.search(line).group(1)
    defs = {m.group(1): ln for ln in comps.get(cond, ()) if (m := _DEF.match(ln))}
    root = next((ln for ln in comps.get(cond, ()) if ln.lstrip().startswith("ROOT ")), "")
    m = re.search(r"compare\(%([^\s,]+), %([^\s,)]+)\), direction=(LT|GT)", root)
    f = re.search(r"fusion\(%([^\s,]+), %([^\s,)]+)\),.*\bcalls=%([^\s,]+)", root)
    if not m and f:  # the compare wrapped in a fusion of (counter, bound): map its parameters back
        inner = comps.get(f.group(3), ())
        params = {m2.group(1): int(m2.group(2)) for ln in inner
                  if (m2 := re.match(r"^\s*%([^\s=]+) = .*\sparameter\((\d+)\)", ln))}
        root_f = next((ln for ln in inner if ln.lstrip().startswith("ROOT ")), "")
        c = re.search(r"compare\(%([^\s,]+), %([^\s,)]+)\), direction=(LT|GT)", root_f)
        if c and c.group(1) in params and c.group(2) in params:
            ops = (f.group(1), f.group(2))
            m = (ops[params[c.group(1)]], ops[params[c.group(2)]], c.group(3))
    if not m:
        return None
    a, b, direction = m if isinstance(m, tuple) else m.groups()
    counter, bound = (a, b) if direction == "LT" else (b, a)
    c_bound, c_counter = _CONST.search(defs.get(bound, "")), re.search(r"get-tuple-element\(.*index=(\d+)", defs.get(counter, ""))
    if not c_bound or not c_counter:
        return None
    index = int(c_counter.group(1))
    caller_defs = {m.group(1): ln for ln in comps.get(caller, ()) if (m := _DEF.match(ln))}
    operand = re.search(r"\swhile\(%([^\s,)]+)\)", line)
    init = None
    tup = caller_defs.get(operand.group(1), "") if operand else ""
    args = re.search(r"\stuple\((.*?)\)(?:,|$)", tup)
    if args:
        name = [x.strip().lstrip("%") for x in args.group(1).split(",")][index] if index < len(args.group(1).split(",")) else ""
        for _ in range(8):  # through copies / bitcasts to a constant
            d = caller_defs.get(name, "")
            if (k := _CONST.search(d)) and " constant(" in d:
                init = int(k.group(1))
                break
            nxt = re.search(r"\s(?:copy|copy-done|bitcast|copy-start)\(%([^\s,)]+)", d)
            if not nxt:
                break
            name = nxt.group(1)
    if init is None:
        raise UncountedLoop(f"while loop (condition %{cond}, in %{caller}): bound {c_bound.group(1)}, but the "
                            f"counter's initial value (tuple element {index} of the loop's operand) is not a "
                            "constant; its trips cannot be counted")
    return max(int(c_bound.group(1)) - init, 0)


def _hlo_computations(text: str) -> tuple[dict[str, list[str]], str, list[str]]:
    """({computation name: its instruction lines}, entry name, the module text's lines) of an HLO
    module printed by ``HloModule.to_string()``."""
    lines = text.splitlines()
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in lines:
        m = _COMPUTATION.match(line)
        if m and line.rstrip().endswith("{"):
            current = m.group(2)
            comps[current] = []
            entry = current if m.group(1) else entry
        elif current is not None and line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps, entry, lines


def _with_entry(lines: list[str], name: str) -> str:
    """The module text with computation ``name`` as its entry (the header's entry layout dropped)."""
    out = []
    for i, line in enumerate(lines):
        if i == 0 and line.startswith("HloModule"):
            line = line.split(",")[0]
        m = _COMPUTATION.match(line)
        if m and line.rstrip().endswith("{"):
            line = ("ENTRY " if m.group(2) == name else "") + line[len(m.group(1) or ""):]
        out.append(line)
    return "\n".join(out)


def loop_counted_cost(compiled: Any, unknown_trips: int | None = None) -> dict[str, Any] | None:
    """XLA's cost analysis of a compiled program (per chip, from its optimised HLO) with every loop
    trip counted: XLA's ``cost_analysis`` counts a ``while`` body once; here each while loop whose
    trip count XLA annotated (``known_trip_count``: ``lax.scan``, ``lax.map``, ``fori_loop``) adds
    ``trips x (its body's count, nested loops counted the same way) - its body's one-trip count``
    (XLA:TPU does not annotate trip counts: there they come from the loop's condition,
    :func:`_inferred_trips`),
    and its condition ``trips + 1`` times. A body's one-trip count is XLA's own cost analysis of the
    module re-entered at that body (``hlo_module_cost_analysis`` with the program's client, or the
    host CPU client's for a compile-only TPU executable: same cost model, same HLO). A loop
    without a known trip count (a ``while_loop`` that may stop early, e.g. the sampler's decode loop)
    is counted ``unknown_trips`` times when given (the caller's upper bound).

    Returns ``{"flops", "bytes_accessed", "transcendentals"}`` (every trip), the same keys with
    ``_one_trip`` (XLA's own figure) and ``loops`` (trip count of every loop, nested ones as often
    as they appear; ``-n`` where unknown and counted n = ``unknown_trips`` times).

    Raises:
        UncountedLoop: where it cannot count (never a silent one trip or a loop start of 0): the
            executable gives no HLO module; a loop without a known or inferable trip count and no
            ``unknown_trips``; a loop whose counter does not start at a constant (each names the loop).
    """
    from jax._src.lib import _jax
    import jaxlib._hlo as hlo

    try:
        ex = compiled.runtime_executable()
        text = ex.hlo_modules()[0].to_string()
    except Exception as e:  # noqa: BLE001 - a backend whose executables expose no HLO module
        raise UncountedLoop(f"the executable gives no HLO module to count loop trips in ({type(e).__name__}: "
                            f"{e})") from e
    # A compile-only TPU client has no cost analysis of its own; XLA's HloCostAnalysis of the host
    # CPU client, run on the TPU-optimised module, gives the same FLOPs and bytes to < 1 %
    # (docs/benchmarks.md), so it counts the per-body figures there.
    client = getattr(ex, "client", None) or jax.devices("cpu")[0].client
    comps, entry, lines = _hlo_computations(text)
    cache: dict[str, np.ndarray] = {}

    def once(name: str) -> np.ndarray:
        if name not in cache:
            mod = hlo.hlo_module_from_text(_with_entry(lines, name))
            ca = _jax.hlo_module_cost_analysis(client, mod)
            cache[name] = np.array([float(ca.get(k, 0.0)) for k, _ in COST_KEYS])
        return cache[name]

    memo: dict[str, tuple[np.ndarray, list]] = {}

    def extra(name: str) -> tuple[np.ndarray, list]:
        """(what counting every trip adds to ``once`` for the loops reachable from ``name``, their trips)."""
        if name in memo:
            return memo[name]
        add, loops = np.zeros(len(COST_KEYS)), []
        for line in comps.get(name, ()):
            w = _WHILE.search(line)
            if w:
                cond, body = w.groups()
                t = _TRIPS.search(line)
                known = int(t.group(1)) if t else _inferred_trips(line, comps, name)
                trips = known if known is not None else unknown_trips
                if trips is None:
                    raise UncountedLoop(f"while loop (body %{body}, in %{name}) has no known trip count and its "
                                        "condition is not `counter < constant`; pass the caller's bound "
                                        "(Program.max_trips)")
                inner, inner_loops = extra(body)
                loops += [known if known is not None else -trips] + inner_loops * trips
                add += trips * (once(body) + inner) - once(body) + trips * once(cond)
                continue
            callees = _CALLEE.findall(line) + [c.strip().lstrip("%") for g in _CALLEES.findall(line)
                                               for c in g.split(",") if c.strip()]
            for c in callees:
                a, lp = extra(c)
                add, loops = add + a, loops + lp
        memo[name] = (add, loops)
        return memo[name]

    total_once = once(entry)
    added, loops = extra(entry)
    total = total_once + added
    out: dict[str, Any] = {key: float(v) for (_, key), v in zip(COST_KEYS, total)}
    out.update({f"{key}_one_trip": float(v) for (_, key), v in zip(COST_KEYS, total_once)})
    out["loops"] = loops
    return out


def _sds(shape, dtype, sh) -> jax.ShapeDtypeStruct:
    dtype = dtype if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else jnp.dtype(dtype)
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sh)


def _with_sh(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda a, s: _sds(a.shape, a.dtype, s), tree, shardings)


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _cost(compiled) -> dict[str, float]:
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    ca = ca or {}
    return {"flops": float(ca.get("flops", 0.0)), "bytes_accessed": float(ca.get("bytes accessed", 0.0))}


def _memory(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    if m is None:
        return {}
    out = {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
           for k in ("argument", "output", "temp", "alias", "generated_code")}
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"] + out["generated_code"]
    return out


@dataclasses.dataclass
class Program:
    """One jitted program: ``lower()`` returns its ``jax.stages.Lowered``; ``note`` says its shapes;
    ``max_trips``: the trip count to count for a loop whose trip count XLA does not know (an upper
    bound, e.g. the decode loop's max_new_tokens - 1 steps; see :func:`loop_counted_cost`);
    ``program``: its name in ``models.programs.PROGRAMS`` (the report row ``name`` may add its
    variant); ``mesh``: ``programs.mesh_shape`` of the mesh it is built for (None: one device)."""

    name: str
    lower: Callable[[], Any]
    note: str = ""
    max_trips: int | None = None
    program: str = ""
    mesh: Any = None


@dataclasses.dataclass(frozen=True)
class AbstractRun:
    """The abstract model, train state and shardings of ``config`` on ``mesh`` that every program is
    built and lowered with (``jax.ShapeDtypeStruct`` leaves carrying their shardings; nothing is
    allocated)."""

    config: ml_collections.ConfigDict
    cfg: decoder.DecoderConfig
    mesh: Any
    graphdef: Any
    abstract_params: Any  # without shardings, as the stages' constructors get them
    param_shardings: Any
    params: Any
    optimizer: Any
    state_shardings: Any
    state: Any

    @classmethod
    def build(cls, config: ml_collections.ConfigDict, cfg: decoder.DecoderConfig, mesh) -> "AbstractRun":
        """The model ``cfg`` with ``config``'s optimizer and partition rules (``mesh.fsdp``) on ``mesh``."""
        graphdef, abs_params = nnx.split(decoder.abstract_model(cfg), nnx.Param)
        param_sh = sharding.Layout.from_config(config).param_shardings(abs_params, mesh)  # as the stages place them
        tx = train_state.make_optimizer(config.optim)
        state_sh = train_state.train_state_shardings(tx, param_sh, mesh, abs_params)
        return cls(config, cfg, mesh, graphdef, abs_params, param_sh, _with_sh(abs_params, param_sh), tx, state_sh,
                   train_state.abstract_train_state(abs_params, tx, state_sh))

    @property
    def rep(self):
        """Replicated on the mesh."""
        return sharding.replicated(self.mesh)

    @property
    def data(self):
        """Leading axis over ``"data"``."""
        return sharding.data_sharding(self.mesh)

    def rows_sharding(self, rows: int):
        """Rows over ``"data"`` where they divide it, else replicated (as the stages place batches)."""
        return self.data if rows % self.mesh.shape[sharding.DATA] == 0 else self.rep

    def grpo_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The GRPO step's batch: N rollouts x (prompt + new) tokens over ``"data"``."""
        g = self.config.grpo
        n, t = grpo.GRPOStepSpec.from_config(self.config).shapes.num_rollouts, g.max_prompt_tokens + g.max_new_tokens
        return {"input_ids": _sds((n, t), jnp.int32, self.data), "attention_mask": _sds((n, t), jnp.int32, self.data),
                "loss_mask": _sds((n, g.max_new_tokens), jnp.float32, self.data),
                "advantages": _sds((n,), jnp.float32, self.data)}


def sampler_programs(a: AbstractRun) -> list[Program]:
    """``sampler_prefill`` and ``sampler_decode`` of the GRPO rollouts (B x G rows, padded to the
    data axis), from ``models.sampler.Sampler`` on the run's mesh."""
    g = a.config.grpo
    smp = sampler_lib.Sampler(a.graphdef, a.cfg, max_prompt_tokens=g.max_prompt_tokens,
                              max_new_tokens=g.max_new_tokens, eos_ids=[0], pad_id=0, mesh=a.mesh,
                              top_k=g.top_k if g.top_k >= 0 else 0)
    n_data = a.mesh.shape[sharding.DATA]
    rows = -(-g.prompts_per_step * g.group_size // n_data) * n_data
    p = smp.bucket_for(g.max_prompt_tokens)
    key = jax.eval_shape(lambda: jax.random.key(0))
    key, f32 = _sds(key.shape, key.dtype, a.rep), _sds((), jnp.float32, a.rep)
    ids = _sds((rows, p), jnp.int32, a.data)
    prefill_args = (a.params, ids, ids, _sds((rows,), jnp.bool_, a.data), key, f32, f32, f32)

    def lower_decode():
        out = smp.prefill.lower(*prefill_args).out_info
        # the prefill's output state, rows over "data" (as the prefill's constraints place them)
        st = jax.tree.map(lambda o: _sds(o.shape, o.dtype, a.data if o.shape and o.shape[0] == rows else a.rep), out)
        return smp.decode.lower(a.params, st, key, f32, f32, f32)

    where = programs.mesh_shape(smp.mesh)
    return [Program("sampler_prefill", lambda: smp.prefill.lower(*prefill_args), f"{rows} rows x {p} prompt tokens",
                    program="sampler_prefill", mesh=where),
            Program("sampler_decode", lower_decode, f"while_loop of at most {g.max_new_tokens - 1} trips (counted as "
                    "that many)", max_trips=g.max_new_tokens - 1, program="sampler_decode", mesh=where)]


def lm_programs(a: AbstractRun) -> list[Program]:
    """The SFT step and loss (batch sft.batch_size x (prompt + completion) tokens, no shared prefix
    at batch 1), from ``train.lm_trainer.LMTrainer`` as the ``sft`` stage builds it."""
    s = a.config.sft
    length = s.max_prompt_tokens + s.max_completion_tokens
    trainer = lm_trainer.LMTrainer(a.graphdef, a.cfg, a.optimizer, np.zeros((0,), np.int32), mesh=a.mesh,
                                   state_shardings=a.state_shardings)
    bsh = a.rows_sharding(s.batch_size)
    batch = {"tokens": _sds((s.batch_size, length), jnp.int32, bsh),
             "mask": _sds((s.batch_size, length), jnp.int32, bsh),
             "targets": _sds((s.batch_size, length), jnp.float32, bsh)}
    prefix = _sds((0,), jnp.int32, a.rep)
    where, note = programs.mesh_shape(trainer.mesh), f"batch {s.batch_size} x {length}"
    return [Program("sft_step", lambda: trainer.step_program.lower(a.state, prefix, batch), note, program="lm_step",
                    mesh=where),
            Program("sft_loss", lambda: trainer.loss_program.lower(a.params, prefix, batch), note, program="lm_loss",
                    mesh=where)]


def grpo_programs(a: AbstractRun) -> list[Program]:
    """The GRPO step (``train.grpo_step.make_train_step``) for every requested loss, in-run rollout
    sketches as configured (and flipped, for the FLOP ratio: ``compile.both_sketch_variants``)."""
    config, g = a.config, a.config.grpo
    gbatch = a.grpo_batch()
    n, t = gbatch["input_ids"].shape
    order = sketcher.hf_param_order(a.cfg)
    losses = sorted(grpo_loss.LOSSES) if config.compile.losses == "all" else [
        x.strip() for x in (config.compile.losses or g.loss).split(",") if x.strip()]
    in_run = config.sketch.in_run_rollouts
    variants = [in_run] + ([not in_run] if config.compile.both_sketch_variants else [])
    progs = []
    for loss in losses:
        for on in variants:
            spec = grpo.GRPOStepSpec.from_config(config, loss=loss, in_run_rollouts=on)
            fn = grpo.make_train_step(a.graphdef, a.abstract_params, a.optimizer, spec, order=order, mesh=a.mesh,
                                      param_shardings=a.param_shardings, opt_shardings=a.state_shardings.opt_state)
            ref = a.params if spec.loss_spec.needs_reference else None
            progs.append(Program(f"grpo_step[{loss},in_run={'on' if on else 'off'}]",
                                 (lambda fn=fn, ref=ref: fn.lower(a.params, a.state.opt_state, gbatch, ref)),
                                 f"{n} rollouts x {t} tokens" + (f"; {step_path(spec)}" if on else ""),
                                 program="grpo_step", mesh=programs.mesh_shape(a.mesh)))
    return progs


def metagradient_programs(a: AbstractRun) -> list[Program]:
    """``metagradient_step`` and ``metagradient_step_vjp``: the :class:`train.metagradient.MetaStep`
    of ``train.metagradient.build_meta_step`` (the ``metagradient`` stage's constructor) for the
    configured loss and ``metagradient.advantages``' first mode: the forward is the program the
    stage steps with (the run's own weighted step, the fused one by default), the vjp that of the
    batched weighted step (in params, Adam moments and weights), each run once per replayed step;
    XLA's count covers the whole program."""
    from behaviortrace_jax.train import metagradient as mg_lib

    config = a.config
    spec = grpo.GRPOStepSpec.from_config(config)
    mode = str(config.metagradient.advantages).split(",")[0].strip()
    gbatch = a.grpo_batch()
    batch = dict(gbatch, rewards=gbatch["advantages"]) if mode == "recomputed" else gbatch
    ref, ref_sh = (a.params, a.param_shardings) if spec.loss_spec.needs_reference else (None, None)
    # the stage's own constructor: forward = the run's step program where the run's update is the fused one
    meta = mg_lib.build_meta_step(config, a.graphdef, a.abstract_params, a.cfg, spec, a.mesh,
                                  (a.param_shardings, a.state_shardings.opt_state, {k: a.data for k in batch}, a.data,
                                   ref_sh, a.rep), a.state.opt_state, advantages=mode)
    weights, opt = gbatch["advantages"], a.state.opt_state
    floats = mg_lib.opt_float_leaves(opt)
    note = f"{spec.shapes.num_rollouts} rollouts; advantages {mode}"
    where = programs.mesh_shape(a.mesh)
    return [Program("metagradient_step", lambda: meta.forward.lower(a.params, opt, batch, weights, ref), note,
                    program="metagradient_step", mesh=where),
            Program("metagradient_step_vjp", lambda: meta.backward.lower(a.params, opt, batch, weights, ref, a.params,
                                                                         floats),
                    note + "; held per step: params + Adam moments (the state) and their cotangents",
                    program="metagradient_step_vjp", mesh=where)]


def sketcher_programs(a: AbstractRun) -> list[Program]:
    """The per-example sketcher of ``targets.ForcedSketcher.from_config`` on the run's mesh (as the
    ``sketch`` and ``draws`` stages build it) at the lengths of the checkpoint target sketches, the
    rollout re-sketches and the draws' sketches, and its masked mean log-prob program."""
    config, g, tg = a.config, a.config.grpo, a.config.targets
    fs = targets.ForcedSketcher.from_config(config, a.graphdef, a.cfg, a.abstract_params, pad_id=0, mesh=a.mesh)
    bucket = lambda x: -(-x // tg.length_bucket) * tg.length_bucket  # noqa: E731
    ctx_new = tg.ctx_max_new_tokens if tg.ctx_max_new_tokens > 0 else config.draws.max_new_tokens
    lengths = {"target_sketcher": bucket(g.max_prompt_tokens + ctx_new),
               "rollout_resketcher": bucket(g.max_prompt_tokens + g.max_new_tokens),
               "draws_sketcher": bucket(g.max_prompt_tokens + config.draws.max_new_tokens)}
    b, fsh = fs.block_size, fs.block_sharding() or a.rep  # the run's numpy blocks: the default device
    where = programs.mesh_shape(fs.sketcher.mesh)
    block = lambda length: {"input_ids": _sds((b, length), jnp.int32, fsh),  # noqa: E731
                            "attention_mask": _sds((b, length), jnp.int32, fsh),
                            "loss_mask": _sds((b, length), jnp.float32, fsh)}
    progs = [Program(name, (lambda fb=block(length): fs.sketcher.lower(a.params, fb)),
                     f"{b} sequences x {length}; {'fused' if fs.sketcher.fused else 'vmap(grad)'} sketcher, "
                     f"{b // fs.chunk_size} chunks", program="per_example_sketcher", mesh=where)
             for name, length in lengths.items()]
    lp = block(lengths["target_sketcher"])
    progs.append(Program("target_mean_logprob", lambda: fs.mean_logprob.lower(a.params, lp["input_ids"],
                                                                             lp["attention_mask"], lp["loss_mask"]),
                         f"lax.map of {b // fs.chunk_size} trips", program="forced_mean_logprob",
                         mesh=programs.mesh_shape(fs.sketcher.mesh)))
    return progs


# The programs of a run, in report order: each builder gives its rows of the report, for the stages
# that run those programs (compile.stages picks the builders).
PROGRAM_BUILDERS: tuple[tuple[Callable[[AbstractRun], list[Program]], frozenset[str]], ...] = (
    (sampler_programs, frozenset({"base", "sft", "grpo", "draws", "counterfactual"})),
    (lm_programs, frozenset({"base", "sft"})),
    (grpo_programs, frozenset({"grpo", "counterfactual"})),
    (metagradient_programs, frozenset({"metagradient"})),
    (sketcher_programs, frozenset({"sketch", "draws"})),
)
# What ``--config.stages=compile`` alone compiles: the stages of a paper run (configs/common.py's default).
PAPER_RUN_STAGES = ("sft", "grpo", "sketch", "draws")


def compiled_stages(config: ml_collections.ConfigDict) -> set[str]:
    """The stages whose programs the compile stage compiles: ``compile.stages`` (comma-separated), or
    for "" the stages ``config.stages`` names besides ``compile`` (a sweep's ``sweep.stages`` included;
    the stage registry checks those names when the run starts), or :data:`PAPER_RUN_STAGES` when it
    names no other.

    Raises:
        ValueError: naming ``config.compile.stages`` and a stage in it that runs no program of
            :data:`PROGRAM_BUILDERS`.
    """
    split = lambda spec: [x.strip() for x in spec.split(",") if x.strip()]  # noqa: E731
    spec = str(config.compile.stages).strip()
    if spec:
        with_programs = set().union(*(stages for _, stages in PROGRAM_BUILDERS))
        bad = [x for x in split(spec) if x not in with_programs]
        if bad:
            raise ValueError(f"config.compile.stages={spec!r}: stage {bad[0]!r} runs no compiled program "
                             f"(stages with programs: {sorted(with_programs)})")
        return set(split(spec))
    names = split(config.stages)
    if "sweep" in names:
        names += split(config.sweep.stages)
    return (set(names) - {"compile", "sweep"}) or set(PAPER_RUN_STAGES)


def build_programs(config: ml_collections.ConfigDict, cfg: decoder.DecoderConfig, mesh) -> list[Program]:
    """Every jitted program that the stages of :func:`compiled_stages` run for ``config``, at its real
    shapes on ``mesh``, from the run's own constructors (:data:`PROGRAM_BUILDERS`), less those
    ``compile.programs`` leaves out (a list of name prefixes; "" = all)."""
    run, stages = AbstractRun.build(config, cfg, mesh), compiled_stages(config)
    progs = [pr for builder, used_by in PROGRAM_BUILDERS if used_by & stages for pr in builder(run)]
    only = [x.strip() for x in config.compile.programs.split(",") if x.strip()]
    return [pr for pr in progs if not only or any(pr.name.startswith(o) for o in only)]


def step_path(spec: grpo.GRPOStepSpec) -> str:
    """How the GRPO step of ``spec`` gets its update and in-run sketches, in words (the report's)."""
    if not spec.in_run_rollouts:
        return f"{spec.loss}, in-run rollout sketches off"
    how = ("fused sketcher: one backward for the update and the sketches" if spec.fused and spec.update_from_sketcher
           else "fused sketcher for the sketches + batched backward" if spec.fused
           else "one backward (summed per-rollout gradients)" if spec.update_from_sketcher
           else "batched backward + per-rollout vmap(grad)")
    return f"{spec.loss}, in-run rollout sketches on, {how}, chunk {spec.chunk_size}"


def compile_program(pr: Program, chip: Chip | None, memory: float | None) -> dict[str, Any]:
    """Lowers and compiles one program; its report row."""
    t0 = time.perf_counter()
    lowered = pr.lower()
    t1 = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - XLA:TPU refuses a program over the chip's HBM at compile time
        need = _hbm_exhausted(e)
        if need is None:
            raise
        t2 = time.perf_counter()
        return {"name": pr.name, "lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2),
                "host_peak_rss_bytes": _rss_bytes(), "argument_bytes": None, "output_bytes": None,
                "temp_bytes": need[0], "alias_bytes": None, "generated_code_bytes": None, "total_bytes": need[0],
                "flops": 0.0, "bytes_accessed": 0.0, "flops_one_trip": 0.0, "bytes_accessed_one_trip": 0.0,
                "loops": None, "note": f"{pr.note}; XLA: {need[2]}", "roofline_s": None,
                "memory_bytes": need[1] or memory, "fits": False}
    t2 = time.perf_counter()
    mem, once = _memory(compiled), _cost(compiled)
    cost = {"flops_one_trip": once["flops"], "bytes_accessed_one_trip": once["bytes_accessed"]}
    try:
        counted = loop_counted_cost(compiled, pr.max_trips)
        cost.update({k: counted[k] for k in ("flops", "bytes_accessed", "loops")})
    except UncountedLoop as e:  # said in the row and the log, never XLA's one-trip figures as the count
        logging.warning("compile: %s: FLOPs and bytes not counted: %s", pr.name, e)
        cost.update(flops=None, bytes_accessed=None, loops=None, cost_error=str(e))
    row: dict[str, Any] = {"name": pr.name, "lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2),
                           "host_peak_rss_bytes": _rss_bytes(), **{f"{k}_bytes": v for k, v in mem.items()},
                           **cost, "note": pr.note}
    if chip is not None and cost["flops"] is not None:
        row["roofline_s"] = max(cost["flops"] / chip.peak_flops, cost["bytes_accessed"] / chip.hbm_bw)
        row["roofline_compute_s"] = cost["flops"] / chip.peak_flops
    else:
        row["roofline_s"] = None
    row["memory_bytes"] = memory
    row["fits"] = None if memory is None else bool(mem.get("total", 0) <= memory)  # None: not judged
    return row


def _hbm_exhausted(e: Exception) -> tuple[int, int | None, str] | None:
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


def _fmt_gib(x: Any) -> str:
    return "-" if x is None else f"{x / GiB:.2f}"


def report_markdown(report: dict[str, Any]) -> str:
    head = (f"# Compile report: {report['target']} ({report['n_devices']} devices, chip {report['chip'] or '-'}, "
            f"mesh {report['mesh']})\n\nModel: {report['model']}. Host peak RSS {report['host_peak_rss_bytes'] / 1e9:.2f} GB; "
            f"stage {report['stage_s']:.1f} s.\n\n"
            "| program | compile s | args GiB | out GiB | temp GiB | alias GiB | code GiB | total GiB | of GiB | "
            "FLOPs/chip | bytes/chip | loop trips | roofline s | fits |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in report["programs"]:
        rl = "-" if r["roofline_s"] is None else f"{r['roofline_s']:.3g}"
        fl = lambda v: "-" if not v else f"{v:.3g}"  # noqa: E731
        loops = r.get("loops")
        trips = ("not counted" if r.get("cost_error") else "-" if not loops else
                 ", ".join(f"<={-x}" if x < 0 else str(x) for x in sorted(set(loops), key=str)))
        lines.append(f"| {r['name']} | {r['compile_s']:.1f} | {_fmt_gib(r.get('argument_bytes'))} | "
                     f"{_fmt_gib(r.get('output_bytes'))} | {_fmt_gib(r.get('temp_bytes'))} | "
                     f"{_fmt_gib(r.get('alias_bytes'))} | {_fmt_gib(r.get('generated_code_bytes'))} | "
                     f"{_fmt_gib(r.get('total_bytes'))} | {_fmt_gib(r['memory_bytes'])} | {fl(r['flops'])} | "
                     f"{fl(r['bytes_accessed'])} | {trips} | {rl} | {r['fits']} |")
    ratio, bratio = report.get("grpo_step_flop_ratio"), report.get("grpo_step_bytes_ratio")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    tail = ("\n\nFLOPs and bytes are XLA's own cost analysis of each compiled program per chip with every "
            "loop trip counted (stages/compile.loop_counted_cost: XLA counts a while body once; each loop "
            "with a known trip count adds trips x its body's count); `loop trips` lists the distinct trip "
            "counts (<=n: no known trip count, counted n times as an upper bound; 'not counted': a loop that cannot be counted, its row's `cost_error` says which, FLOPs and bytes left empty). The roofline is max(FLOPs / peak, bytes / bandwidth). "
            "XLA:TPU's 'bytes accessed' is inflated by several scatters into one accumulator "
            "(../shared/notes/AOT_FINDINGS.md), so bandwidth-bound rooflines of sketching programs are "
            "upper bounds.\n\n"
            f"GRPO step with over without in-run rollout sketches [{report.get('grpo_step_path') or '-'}]: "
            f"FLOP ratio {fmt(ratio)}, bytes ratio {fmt(bratio)} (both variants compiled; "
            "`compile.both_sketch_variants`)\n")
    return head + "\n".join(lines) + tail


@register_stage("compile")
def compile_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Compiles every program of ``config`` for ``config.compile.target``; writes the report.

    Raises:
        DoesNotFit: naming every program whose per-chip bytes exceed the chip's memory, and by how much.
    """
    t_start = time.perf_counter()
    devs, chip, memory = target_devices(config.compile.target)
    mesh = sharding.Layout.from_config(config, devices=devs).mesh()
    cfg = model_config(config)
    programs = build_programs(config, cfg, mesh)
    rows = []
    for pr in programs:
        logging.info("compile: %s ...", pr.name)
        row = compile_program(pr, chip, memory)
        rows.append(row)
        logging.info("compile: %s in %.1f s, %s GiB/chip, fits=%s", pr.name, row["compile_s"],
                     _fmt_gib(row.get("total_bytes")), row["fits"])
    by = {r["name"]: r for r in rows}
    ratio = bratio = None
    on, off = f"grpo_step[{config.grpo.loss},in_run=on]", f"grpo_step[{config.grpo.loss},in_run=off]"
    if on in by and off in by and by[off]["flops"] and by[on]["flops"]:
        ratio = by[on]["flops"] / by[off]["flops"]
        bratio = by[on]["bytes_accessed"] / by[off]["bytes_accessed"] if by[off]["bytes_accessed"] else None
    report = {"target": config.compile.target, "chip": chip.name if chip else None, "n_devices": len(devs),
              "mesh": dict(mesh.shape), "model": f"{cfg.num_hidden_layers} layers, d {cfg.hidden_size}, "
              f"vocab {cfg.vocab_size}, {cfg.param_dtype}", "programs": rows, "grpo_step_flop_ratio": ratio,
              "grpo_step_bytes_ratio": bratio, "grpo_step_path": step_path(grpo.GRPOStepSpec.from_config(config)),
              "cost_method": "XLA cost analysis per chip, every loop trip counted (loop_counted_cost)",
              "host_peak_rss_bytes": _rss_bytes(), "stage_s": time.perf_counter() - t_start, "jax": jax.__version__}
    paths = RunLayout(workdir)  # local or gs:// (files.write_strategy)
    files.atomic_write_text(paths.compile_report_json, json.dumps(report, indent=2))
    md = report_markdown(report)
    files.atomic_write_text(paths.compile_report_md, md)
    print(md)
    bad = [r for r in rows if r["fits"] is False]
    if bad:
        raise DoesNotFit("; ".join(f"{r['name']} needs {_fmt_gib(r['total_bytes'])} GiB per chip, "
                                   f"{_fmt_gib(r['total_bytes'] - r['memory_bytes'])} GiB over the "
                                   f"{_fmt_gib(r['memory_bytes'])} GiB of {report['chip'] or 'a device'}" for r in bad))
