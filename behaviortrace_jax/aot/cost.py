"""The cost counting of ahead-of-time compilation: XLA's FLOPs, bytes accessed and transcendentals
of a compiled program per chip with every loop trip counted (:func:`loop_counted_cost`).

XLA's own ``cost_analysis`` (:func:`xla_cost`) counts a ``while`` body (``lax.scan``, ``lax.map``,
``fori_loop``, the sampler's decode loop) once. Here the optimised HLO module is parsed into its
computations, each loop's trip count is read (XLA's ``known_trip_count``, else inferred from the
loop's ``counter < N`` condition, :func:`_inferred_trips`, else the caller's bound), and each body is
costed by XLA's own cost analysis of the module re-entered at that body. Where a loop cannot be
counted, :class:`UncountedLoop` names it (never a silent one-trip count).
"""
from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np

COST_KEYS = (("flops", "flops"), ("bytes accessed", "bytes_accessed"), ("transcendentals", "transcendentals"))
_COMPUTATION = re.compile(r"^(ENTRY )?%([^\s(]+) \(")
_CALLEE = re.compile(r"\b(?:condition|body|calls|to_apply)=%([^\s,)}]+)")
_CALLEES = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_WHILE = re.compile(r"\swhile\(.*\bcondition=%([^\s,]+), body=%([^\s,]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_KERNEL = re.compile(r'custom_call_target="tpu_custom_call".*?"cost_estimate":\{([^}]*)\}')  # a Pallas kernel's
_DECLARED_KEYS = (("flops", "flops"), ("bytes_accessed", "bytes accessed"), ("transcendentals", "transcendentals"))


def declared_kernel_cost(line: str) -> np.ndarray | None:
    """The cost a Mosaic (Pallas TPU) kernel declares (``pl.CostEstimate``, in its custom call's
    backend config) as [flops, bytes accessed, transcendentals] in :data:`COST_KEYS` order, or None
    for a line that is not such a kernel. XLA:TPU's own cost analysis reads it; the host CPU
    client's, which counts the loop bodies here, does not know the kernel and counts none of it."""
    m = _KERNEL.search(line)
    if m is None:
        return None
    fields = dict(re.findall(r'"(\w+)":"?(\d+)"?', m.group(1)))
    by_cost_key = {cost: float(fields.get(decl, 0)) for decl, cost in _DECLARED_KEYS}
    return np.array([by_cost_key[k] for k, _ in COST_KEYS])
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


def _hlo_text_and_client(compiled: Any) -> tuple[str, Any]:
    """(the optimised HLO module's text, the client whose cost analysis counts it) of a compiled program.

    A compile-only TPU client has no cost analysis of its own; XLA's HloCostAnalysis of the host CPU
    client, run on the TPU-optimised module, gives the same FLOPs and bytes to < 1 %
    (docs/records/benchmarks.md), so it counts the per-body figures there.

    Raises:
        UncountedLoop: the executable gives no HLO module.
    """
    try:
        ex = compiled.runtime_executable()
        text = ex.hlo_modules()[0].to_string()
    except Exception as e:  # noqa: BLE001 - a backend whose executables expose no HLO module
        raise UncountedLoop(f"the executable gives no HLO module to count loop trips in ({type(e).__name__}: "
                            f"{e})") from e
    return text, getattr(ex, "client", None) or jax.devices("cpu")[0].client


def _kernel_costs(comps: dict) -> Any:
    """``declared(name)``: the Pallas kernels' declared costs (:func:`declared_kernel_cost`) in
    computation ``name`` of ``comps`` and in what it calls, each computation counted once (as
    XLA's cost analysis counts a loop body once)."""
    memo: dict[str, np.ndarray] = {}

    def declared(name: str) -> np.ndarray:
        if name not in memo:
            memo[name] = np.zeros(len(COST_KEYS))  # (a cycle guard; HLO has none)
            total = np.zeros(len(COST_KEYS))
            for line in comps.get(name, ()):
                k = declared_kernel_cost(line)
                if k is not None:
                    total = total + k
                callees = _CALLEE.findall(line) + [c.strip().lstrip("%") for g in _CALLEES.findall(line)
                                                   for c in g.split(",") if c.strip()]
                for c in callees:
                    total = total + declared(c)
            memo[name] = total
        return memo[name]

    return declared


def loop_counted_cost(compiled: Any, unknown_trips: int | None = None) -> dict[str, Any] | None:
    """XLA's cost analysis of a compiled program (per chip, from its optimised HLO) with every loop
    trip counted: XLA's ``cost_analysis`` counts a ``while`` body once; here each while loop whose
    trip count XLA annotated (``known_trip_count``: ``lax.scan``, ``lax.map``, ``fori_loop``) adds
    ``trips x (its body's count, nested loops counted the same way) - its body's one-trip count``
    (XLA:TPU does not annotate trip counts: there they come from the loop's condition,
    :func:`_inferred_trips`),
    and its condition ``trips + 1`` times. A body's one-trip count is XLA's own cost analysis of the
    module re-entered at that body (``hlo_module_cost_analysis`` with the program's client, or the
    host CPU client's for a compile-only TPU executable: same cost model, same HLO), plus the cost
    each Pallas TPU kernel in it declares (:func:`declared_kernel_cost`), which the CPU client's
    analysis does not see. A loop
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

    text, client = _hlo_text_and_client(compiled)
    comps, entry, lines = _hlo_computations(text)
    cache: dict[str, np.ndarray] = {}

    declared = _kernel_costs(comps)

    def once(name: str) -> np.ndarray:
        if name not in cache:
            mod = hlo.hlo_module_from_text(_with_entry(lines, name))
            ca = _jax.hlo_module_cost_analysis(client, mod)
            cache[name] = np.array([float(ca.get(k, 0.0)) for k, _ in COST_KEYS]) + declared(name)
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



def xla_cost(compiled: Any) -> dict[str, float]:
    """XLA's own ``cost_analysis`` of a compiled program (a ``while`` body counted once): ``flops``,
    ``bytes_accessed`` per chip (0.0 where XLA gives none)."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    ca = ca or {}
    return {"flops": float(ca.get("flops", 0.0)), "bytes_accessed": float(ca.get("bytes accessed", 0.0))}
