"""The compile report: one row per compiled program (:func:`compile_program`: compile time, per-chip
bytes against the device's memory, loop-counted FLOPs and bytes, roofline) and the files
``compile_report.json`` (:func:`run_report`) and ``compile_report.md`` (:func:`report_markdown`)
the ``compile`` stage writes; :func:`does_not_fit` names the programs over budget.
"""
from __future__ import annotations

import resource
import time
from typing import Any

import jax
from absl import logging

from behaviortrace_jax.aot.builders import CompileOptions, Program, step_path
from behaviortrace_jax.aot.cost import UncountedLoop, loop_counted_cost, xla_cost
from behaviortrace_jax.aot.memory import GiB, Chip, DoesNotFit, hbm_exhausted, memory_bytes
from behaviortrace_jax.models import decoder


def rss_bytes() -> int:
    """This process's peak resident set size in bytes (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def compile_program(pr: Program, chip: Chip | None, memory: float | None) -> dict[str, Any]:
    """Lowers and compiles one program; its report row: seconds to lower and compile, host peak RSS,
    per-chip bytes (:func:`memory.memory_bytes`), FLOPs and bytes with every loop trip counted
    (:func:`cost.loop_counted_cost`; None with ``cost_error`` where a loop cannot be counted) beside
    XLA's one-trip figures, the roofline on ``chip`` and ``fits`` against ``memory`` bytes (None: not
    judged). A program XLA refuses for lack of HBM is a row with ``fits=False``.

    Raises:
        Exception: whatever lowering or compiling raises, except XLA's out-of-memory refusal.
    """
    t0 = time.perf_counter()
    lowered = pr.lower()
    t1 = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - XLA:TPU refuses a program over the chip's HBM at compile time
        need = hbm_exhausted(e)
        if need is None:
            raise
        t2 = time.perf_counter()
        return {"name": pr.name, "lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2),
                "host_peak_rss_bytes": rss_bytes(), "argument_bytes": None, "output_bytes": None,
                "temp_bytes": need[0], "alias_bytes": None, "generated_code_bytes": None, "total_bytes": need[0],
                "flops": 0.0, "bytes_accessed": 0.0, "flops_one_trip": 0.0, "bytes_accessed_one_trip": 0.0,
                "loops": None, "note": f"{pr.note}; XLA: {need[2]}", "roofline_s": None,
                "memory_bytes": need[1] or memory, "fits": False}
    t2 = time.perf_counter()
    mem, once = memory_bytes(compiled), xla_cost(compiled)
    cost = {"flops_one_trip": once["flops"], "bytes_accessed_one_trip": once["bytes_accessed"]}
    try:
        counted = loop_counted_cost(compiled, pr.max_trips)
        cost.update({k: counted[k] for k in ("flops", "bytes_accessed", "loops")})
    except UncountedLoop as e:  # said in the row and the log, never XLA's one-trip figures as the count
        logging.warning("compile: %s: FLOPs and bytes not counted: %s", pr.name, e)
        cost.update(flops=None, bytes_accessed=None, loops=None, cost_error=str(e))
    row: dict[str, Any] = {"name": pr.name, "lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2),
                           "host_peak_rss_bytes": rss_bytes(), **{f"{k}_bytes": v for k, v in mem.items()},
                           **cost, "note": pr.note}
    if chip is not None and cost["flops"] is not None:
        row["roofline_s"] = max(cost["flops"] / chip.peak_flops, cost["bytes_accessed"] / chip.hbm_bw)
        row["roofline_compute_s"] = cost["flops"] / chip.peak_flops
    else:
        row["roofline_s"] = None
    row["memory_bytes"] = memory
    row["fits"] = None if memory is None else bool(mem.get("total", 0) <= memory)  # None: not judged
    return row



def fmt_gib(x: Any) -> str:
    """Bytes as GiB with 2 decimals; "-" for None."""
    return "-" if x is None else f"{x / GiB:.2f}"


def report_markdown(report: dict[str, Any]) -> str:
    """compile_report.md: one table row per program of ``report`` (:func:`run_report`) and what the
    counts mean."""
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
        lines.append(f"| {r['name']} | {r['compile_s']:.1f} | {fmt_gib(r.get('argument_bytes'))} | "
                     f"{fmt_gib(r.get('output_bytes'))} | {fmt_gib(r.get('temp_bytes'))} | "
                     f"{fmt_gib(r.get('alias_bytes'))} | {fmt_gib(r.get('generated_code_bytes'))} | "
                     f"{fmt_gib(r.get('total_bytes'))} | {fmt_gib(r['memory_bytes'])} | {fl(r['flops'])} | "
                     f"{fl(r['bytes_accessed'])} | {trips} | {rl} | {r['fits']} |")
    ratio, bratio = report.get("grpo_step_flop_ratio"), report.get("grpo_step_bytes_ratio")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    tail = ("\n\nFLOPs and bytes are XLA's own cost analysis of each compiled program per chip with every "
            "loop trip counted (aot/cost.loop_counted_cost: XLA counts a while body once; each loop "
            "with a known trip count adds trips x its body's count); `loop trips` lists the distinct trip "
            "counts (<=n: no known trip count, counted n times as an upper bound; 'not counted': a loop that cannot be counted, its row's `cost_error` says which, FLOPs and bytes left empty). The roofline is max(FLOPs / peak, bytes / bandwidth). "
            "XLA:TPU's 'bytes accessed' is inflated by several scatters into one accumulator "
            "(../shared/notes/AOT_FINDINGS.md), so bandwidth-bound rooflines of sketching programs are "
            "upper bounds.\n\n"
            f"GRPO step with over without in-run rollout sketches [{report.get('grpo_step_path') or '-'}]: "
            f"FLOP ratio {fmt(ratio)}, bytes ratio {fmt(bratio)} "
            + ("(both variants compiled: `compile.both_sketch_variants`)\n" if ratio is not None else
               "(not computed: it needs the step with and without in-run sketches in this report, "
               "`sketch.in_run_rollouts` and `compile.both_sketch_variants`)\n"))
    return head + "\n".join(lines) + tail


def run_report(options: CompileOptions, devs: list[Any], chip: Chip | None, mesh: Any,
               cfg: decoder.DecoderConfig, rows: list[dict[str, Any]], t_start: float) -> dict[str, Any]:
    """compile_report.json: the target, chip, mesh and model, every program's row, and the GRPO
    step's FLOP and bytes ratios with over without in-run rollout sketches (None unless both
    variants of the run's loss, ``options.step.loss``, were compiled and counted); ``t_start``:
    the stage's ``time.perf_counter()`` at its start."""
    by = {r["name"]: r for r in rows}
    ratio = bratio = None
    on, off = f"grpo_step[{options.step.loss},in_run=on]", f"grpo_step[{options.step.loss},in_run=off]"
    if on in by and off in by and by[off]["flops"] and by[on]["flops"]:
        ratio = by[on]["flops"] / by[off]["flops"]
        bratio = by[on]["bytes_accessed"] / by[off]["bytes_accessed"] if by[off]["bytes_accessed"] else None
    return {"target": options.target, "chip": chip.name if chip else None, "n_devices": len(devs),
            "mesh": dict(mesh.shape), "model": f"{cfg.num_hidden_layers} layers, d {cfg.hidden_size}, "
            f"vocab {cfg.vocab_size}, {cfg.param_dtype}", "programs": rows, "grpo_step_flop_ratio": ratio,
            "grpo_step_bytes_ratio": bratio, "grpo_step_path": step_path(options.step),
            "cost_method": "XLA cost analysis per chip, every loop trip counted (loop_counted_cost)",
            "host_peak_rss_bytes": rss_bytes(), "stage_s": time.perf_counter() - t_start, "jax": jax.__version__}


def does_not_fit(report: dict[str, Any]) -> DoesNotFit | None:
    """The error naming every program of ``report`` whose per-chip bytes exceed the device's memory,
    and by how much; None when none does (``fits`` None, not judged, is not a failure)."""
    bad = [r for r in report["programs"] if r["fits"] is False]
    if not bad:
        return None
    return DoesNotFit("; ".join(f"{r['name']} needs {fmt_gib(r['total_bytes'])} GiB per chip, "
                                f"{fmt_gib(r['total_bytes'] - r['memory_bytes'])} GiB over the "
                                f"{fmt_gib(r['memory_bytes'])} GiB of {report['chip'] or 'a device'}" for r in bad))
