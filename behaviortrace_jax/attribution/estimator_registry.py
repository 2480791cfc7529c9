"""The estimators' plug-in API (SPEC §4): the registry (:func:`register_estimator`, :data:`ESTIMATORS`,
:func:`estimators`, :func:`call_estimator`), the method names the tables and verdicts key on
(controls, the ``:direction`` suffix, the log inputs) with what they say of a method
(:func:`base_method`, :func:`reward_only`, :func:`log_control`), and the shared checks and
similarities every estimator uses (:func:`cosine`, :func:`rollout_cosine`, :func:`group_center`).

The estimators themselves register in ``step_estimators.py``, ``controls.py`` and ``estimators.py``
(rollout level), which imports them in that order (the registration order is the tables' order)
and re-exports this module's names; its docstring describes the API.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dataclasses import dataclass

import numpy as np

# Two epsilons because SPEC §4 uses two: the step-level C1-cosine / local-buffer divide by
# |v||t| + 1e-9, the rollout-level cosines (estimators here and sketch/targets.py) by (|a|+1e-12)(|b|+1e-12).
COS_EPS = 1e-9
ROLLOUT_COS_EPS = 1e-12
# SPEC spells the magnitude control two ways, and the released results CSV uses both: "norm-only" in the
# step-level tables (SPEC §4 table, §6.11), "norm_only" in the rollout-level ones (SPEC §5.6, §6.10).
STEP_NORM_CONTROL = "norm-only"
ROLLOUT_NORM_CONTROL = "norm_only"
# Method-name suffix of scores computed on advantage-free rollout sketches (module docstring).
DIRECTION = ":direction"
# The reward-only controls (module docstring): the rollout-level magnitude-of-advantage control that
# a method must beat to "find which rollout" (verdicts.decision_rules), and the step-level ones.
ABS_ADVANTAGE_CONTROL = "abs-advantage"
REWARD_ONLY_ROLLOUT_CONTROLS = ("advantage", ABS_ADVANTAGE_CONTROL, "reward")
REWARD_ONLY_STEP_CONTROLS = ("step-sum-abs-advantage", "step-reward-std")
# The text and length controls (module docstring), per rollout and per step.
TEXT_CONTROL = "pattern-match"
LENGTH_CONTROL = "length"
TEXT_ROLLOUT_CONTROLS = (TEXT_CONTROL, LENGTH_CONTROL)
TEXT_STEP_CONTROLS = ("step-sum-pattern-match", "step-sum-length")
# The runners' inputs read from the training log alone (advantages, rewards, completion text and
# length): an estimator that reads only these (and the log order) is a log control (log_control).
LOG_INPUTS = frozenset({"advantages", "rewards", "pattern_matches", "completion_lengths"})
# A table is "answered by the log" when some log control reaches this fraction of its ceiling.
ANSWERED_FRACTION = 0.95


# --------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimator:
    """A registered estimator: ``fn`` plus how the runners call it and how tables use it."""

    name: str  # method name in the tables (the CSV ``method`` column)
    level: str  # "step" | "rollout"
    fn: Callable[..., np.ndarray]
    role: str  # "primary" | "baseline" | "control"
    per: str  # step level: "key" (one score per sketch row) | "rollout" (per rollout id)
    column: str  # rollout level: key in the rows file (SPEC §7.3)
    target: str  # rollout level: which entry of ``targets`` is passed as ``target``
    in_tables: bool  # False: computed into rows files but kept out of the result tables
    params: tuple[str, ...]  # parameter names of fn
    required: tuple[str, ...]  # parameters without defaults


ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(name: str, level: str, *, role: str = "primary", per: str = "key",
                       column: str | None = None, target: str = "mp", in_tables: bool = True) -> Callable:
    """Decorator registering ``fn`` as estimator ``name`` (see the module docstring).

    Raises:
        ValueError: a duplicate name, an unknown level/role/per.
    """
    if level not in ("step", "rollout"):
        raise ValueError(f"level must be 'step' or 'rollout', got {level!r}")
    if role not in ("primary", "baseline", "control"):
        raise ValueError(f"role must be primary/baseline/control, got {role!r}")
    if per not in ("key", "rollout"):
        raise ValueError(f"per must be 'key' or 'rollout', got {per!r}")

    def wrap(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
        if name in ESTIMATORS:
            raise ValueError(f"estimator {name!r} is already registered")
        sig = inspect.signature(fn).parameters.values()
        params = tuple(p.name for p in sig if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
        required = tuple(p.name for p in sig if p.default is p.empty
                         and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
        ESTIMATORS[name] = Estimator(name, level, fn, role, per, column or name, target, in_tables,
                                    params, required)
        return fn

    return wrap


def estimators(level: str) -> list[Estimator]:
    """Registered estimators of ``level`` in registration order."""
    return [e for e in ESTIMATORS.values() if e.level == level]


def base_method(name: str) -> str:
    """``name`` without the :data:`DIRECTION` suffix (``"C1-dot:direction"`` -> ``"C1-dot"``)."""
    return name[:-len(DIRECTION)] if name.endswith(DIRECTION) else name


def is_direction(name: str) -> bool:
    """Whether ``name`` is a score on advantage-free rollout sketches (ends with :data:`DIRECTION`)."""
    return name.endswith(DIRECTION)


def reads_sketches(est: Estimator) -> bool:
    """Whether ``est`` scores the sketches it is given (``sketches``): these get a :data:`DIRECTION`
    variant on per-rollout sketches; target-free, sketch-free controls (random, reward-only) do not."""
    return "sketches" in est.params


def reward_only(name: str) -> bool:
    """Whether method ``name`` is a registered reward-only control: it reads the training log's
    ``advantages`` / ``rewards`` and no sketch (module docstring)."""
    est = ESTIMATORS.get(base_method(name))
    return (est is not None and bool({"advantages", "rewards"} & set(est.params))
            and not {"sketches", "rollout_sketches"} & set(est.params))


def log_control(name: str) -> bool:
    """Whether method ``name`` is a registered log control: a target-free, gradient-free control that
    reads the training log alone (:data:`LOG_INPUTS`, optionally with ``rollout_steps``): the
    reward-only controls (:func:`reward_only`) and the text and length controls (module
    docstring). ``random`` (reads nothing) and ``norm/|A|`` (reads sketches) are not."""
    est = ESTIMATORS.get(base_method(name))
    if est is None or est.role != "control":
        return False
    params = set(est.params)
    return bool(LOG_INPUTS & params) and params <= LOG_INPUTS | {"rollout_steps"}


def call_estimator(name: str, **inputs) -> np.ndarray:
    """Calls estimator ``name`` with the subset of ``inputs`` its parameters name.

    Raises:
        KeyError: unknown estimator. ValueError: a required input is missing.
    """
    if name not in ESTIMATORS:
        raise KeyError(f"unknown estimator {name!r}; registered: {sorted(ESTIMATORS)}")
    est = ESTIMATORS[name]
    missing = [p for p in est.required if inputs.get(p) is None]
    if missing:
        raise ValueError(f"estimator {name!r} needs input(s) {missing}")
    kwargs = {p: inputs[p] for p in est.params if inputs.get(p) is not None}
    return np.asarray(est.fn(**kwargs), dtype=np.float64)


# --------------------------------------------------------------------------------------------
# shared checks and similarity
# --------------------------------------------------------------------------------------------
def check_sketches(sketches, target=None) -> tuple[np.ndarray, np.ndarray | None]:
    """(sketches as a 2-D array [S, D], target as a 1-D array [D] or None).

    Raises:
        ValueError: sketches not 2-D, target not 1-D, or their D differ.
    """
    v = np.asarray(sketches)
    if v.ndim != 2:
        raise ValueError(f"sketches must be 2-D [S, D], got shape {v.shape}")
    if target is None:
        return v, None
    t = np.asarray(target)
    if t.ndim != 1:
        raise ValueError(f"target must be 1-D, got shape {t.shape}")
    if v.shape[1] != t.shape[0]:
        raise ValueError(f"shape mismatch: sketches have D={v.shape[1]}, target has {t.shape[0]}")
    return v, t


def check_steps(steps, n: int) -> np.ndarray:
    """``steps`` as int64 [n]. Raises ValueError for another shape."""
    s = np.asarray(steps)
    if s.shape != (n,):
        raise ValueError(f"steps must have shape ({n},), got {s.shape}")
    return s.astype(np.int64)


def cosine(sketches, target, eps: float = COS_EPS) -> np.ndarray:
    """cos(v_s, t) = v_s·t / max(|v_s||t|, eps) per row; float64 [S] (SPEC §4).

    A zero row gives 0. Raises "zero norm" if |t| < eps, "1-D"/"shape mismatch" on bad shapes.
    """
    v, t = check_sketches(sketches, target)
    tn = float(np.linalg.norm(t.astype(np.float64)))
    if tn < eps:
        raise ValueError(f"target has zero norm ({tn}); cosine is undefined")
    dots = (v @ t).astype(np.float64)
    return dots / np.maximum(np.linalg.norm(v, axis=1).astype(np.float64) * tn, eps)


def rollout_cosine(sketches, target) -> np.ndarray:
    """Rollout-level cos(g_i, t) = g·t / ((|g|+1e-12)(|t|+1e-12)); float64 [R] (SPEC §4)."""
    v, t = check_sketches(sketches, target)
    v64, t64 = v.astype(np.float64), t.astype(np.float64)
    return (v64 @ t64) / ((np.linalg.norm(v64, axis=1) + ROLLOUT_COS_EPS) * (np.linalg.norm(t64) + ROLLOUT_COS_EPS))


def group_center(sketches, groups) -> np.ndarray:
    """g_i − mean of g over i's group (same prompt draw), float64 [R, D] (SPEC §4)."""
    v = np.asarray(sketches, dtype=np.float64)
    g = np.asarray(groups)
    if v.ndim != 2 or g.shape != (v.shape[0],):
        raise ValueError(f"sketches [R, D] and groups [R] expected, got {v.shape} and {g.shape}")
    _, inv = np.unique(g, return_inverse=True)
    sums = np.zeros((inv.max() + 1, v.shape[1])) if v.size else np.zeros((0, v.shape[1]))
    np.add.at(sums, inv, v)
    return v - (sums / np.bincount(inv)[:, None])[inv]
