"""Attribution estimators on sketched gradients (SPEC §4), as small pure numpy functions by name.

Two levels:

* ``level="step"`` estimators score the training rollouts that the step-level tables rank
  (SPEC §6.6). They take step sketches ``sketches`` float32 [S, D] with ``steps`` int [S] and a
  target float32 [D] and return one score per row (``per="key"``), which :func:`score_step_methods`
  expands to the rollouts of that step (a step with no row gets ``-inf``). ``random`` scores the
  rollouts directly (``per="rollout"``). The same functions also run on per-rollout in-run sketches
  ([N, D], one row per rollout) for the "which rollout" table.
* ``level="rollout"`` estimators score fresh rollouts of a minimal-pair draw (SPEC §5.6, §6.7):
  per-rollout sketches [R, D] with group ids [R]; each fills one column of the rows file (§7.3).

Plug-in API: an estimator is a function whose parameter names say what it needs. The runners
(:func:`score_step_methods`, :func:`score_rollout_rows`) pass, by name, the inputs they hold:
``sketches, steps, target, targets_by_checkpoint, rollout_ids, rollout_steps, rollout_sketches,
advantages, rewards, pattern_matches, completion_lengths, groups, targets, fluency, token_logprobs,
completion_mask, seed`` plus any
option given to the runner
(``damping``, ``lr``, ``current_step``, ``window``, ``weights``...). Register it and every table,
control and verdict of ``tables.py`` and ``verdicts.py`` picks it up (``in_tables=False`` keeps a column out of the tables)::

    from behaviortrace_jax.attribution.estimators import register_estimator, cosine

    @register_estimator("C1-cosine-clipped", level="step")
    def c1_cosine_clipped(sketches, target):
        \"\"\"cos(v_s, t) with negative scores clipped to 0.\"\"\"
        return np.maximum(cosine(sketches, target), 0.0)

A step-level estimator counts in the pre-registered step rule (best targeted method vs norm-only,
SPEC §6.11) when ``role="primary"`` (the default); ``role="baseline"`` is reported only;
``role="control"`` marks target-free controls. A rollout-level estimator gets raw, residualised
and fluency-matched AUC rows (``column=`` names its rows-file key; ``target=`` picks which entry of
``targets`` it receives as ``target``).

Reward-only controls (target-free and gradient-free; ``role="control"``, ``per="rollout"``). The
runners pass the training log's ``advantages`` A_i and final ``rewards`` r_i (float [N], log
order) with ``rollout_steps``; an estimator that names them gets them:

* ``advantage`` (A_i), ``abs-advantage`` (|A_i|, :data:`ABS_ADVANTAGE_CONTROL`) and ``reward``
  (r_i) rank rollouts;
* ``step-sum-abs-advantage`` (Σ_{j in step} |A_j|) and ``step-reward-std`` (np.std of the step's
  rewards) rank steps (every rollout of a step gets its step's value).

The bonus reward defines the ground truth, so ``reward`` reaches the ceiling by construction when
the bonus exceeds the spread of the base rewards, and ``advantage`` nearly so (a group without a
bonus can still hold a high A_i): they say what the training log alone reveals, and a gradient
method is asked whether it recovers more than that.

Text and length controls (target-free and gradient-free too; ``role="control"``, ``per="rollout"``).
The runners pass ``pattern_matches`` (bool [N], log order: whether the logged completion, decoded as
the ``grpo`` stage decoded it, contains the behaviour's pattern by the contaminator's own judge,
``behavior.contaminator.pattern_matches``; the stage computes it, since decoding needs the tokenizer)
and ``completion_lengths`` (int [N], the logged completion's token count, EOS included):

* ``pattern-match`` (1.0 / 0.0, :data:`TEXT_CONTROL`) and ``length`` (tokens,
  :data:`LENGTH_CONTROL`) rank rollouts;
* ``step-sum-pattern-match`` (how many of the step's responses match) and ``step-sum-length``
  (the step's completion tokens) rank steps, summed over the step as ``step-sum-abs-advantage`` is
  (every rollout of a step gets its step's value).

The ground truth is "eligible and contains the pattern", so ``pattern-match`` holds every
ground-truth rollout among its ties at 1.0 and reaches the ceiling wherever every matching
response in the population was paid (``contamination.fraction`` 1.0, or decoys that pay every
match); length is a known confound of gradient attribution (longer completions, other gradients).
:func:`log_control` names these and the reward-only controls: the controls that read the log
alone, which decide whether a table is "answered by the log" (``verdicts.answered_by_log``). ``norm/|A|`` (|v_i| / |A_i|, 0 where A_i = 0) is the
magnitude control with the advantage divided out; it reads ``rollout_sketches``, which the runner
passes only when the sketches are per rollout (``per_rollout_sketches=True``), so it is absent
from step-sketch tables.

Two sketches per rollout (the "which rollout" tables; ``scores.py``): *weighted*, the
rollout's real contribution to its step's update (clip_s x c_i x g_i with g_i the gradient of
SPEC §3.2's rollout loss -meanlp_i and c_i its loss coefficient, TracIn's definition; the method
names as registered), and *direction*, the advantage-free g_i itself (method name +
:data:`DIRECTION`, e.g. ``C1-dot:direction``). Every estimator that reads ``sketches`` is scored
both ways; :func:`base_method` strips the suffix (roles and controls follow the base name).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
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
def _check(sketches, target=None) -> tuple[np.ndarray, np.ndarray | None]:
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


def _steps(steps, n: int) -> np.ndarray:
    s = np.asarray(steps)
    if s.shape != (n,):
        raise ValueError(f"steps must have shape ({n},), got {s.shape}")
    return s.astype(np.int64)


def cosine(sketches, target, eps: float = COS_EPS) -> np.ndarray:
    """cos(v_s, t) = v_s·t / max(|v_s||t|, eps) per row; float64 [S] (SPEC §4).

    A zero row gives 0. Raises "zero norm" if |t| < eps, "1-D"/"shape mismatch" on bad shapes.
    """
    v, t = _check(sketches, target)
    tn = float(np.linalg.norm(t.astype(np.float64)))
    if tn < eps:
        raise ValueError(f"target has zero norm ({tn}); cosine is undefined")
    dots = (v @ t).astype(np.float64)
    return dots / np.maximum(np.linalg.norm(v, axis=1).astype(np.float64) * tn, eps)


def rollout_cosine(sketches, target) -> np.ndarray:
    """Rollout-level cos(g_i, t) = g·t / ((|g|+1e-12)(|t|+1e-12)); float64 [R] (SPEC §4)."""
    v, t = _check(sketches, target)
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


# --------------------------------------------------------------------------------------------
# step-level estimators (SPEC §4 table)
# --------------------------------------------------------------------------------------------
@register_estimator("C1-dot", level="step")
def c1_dot(sketches, target) -> np.ndarray:
    """C1-dot (GAS, dot): score_s = v_s·t (SPEC §4). float64 [S]."""
    v, t = _check(sketches, target)
    return (v @ t).astype(np.float64)


@register_estimator("C1-cosine", level="step")
def c1_cosine(sketches, target) -> np.ndarray:
    """C1-cosine (GAS): v_s·t / max(|v_s||t|, 1e-9); raises if |t| < 1e-9 (SPEC §4)."""
    return cosine(sketches, target)


@register_estimator("TRAK", level="step")
def trak(sketches, target, damping: float = 0.1, weights=None) -> np.ndarray:
    """TRAK-style whitened score, float64 (SPEC §4).

    Φ = sketches [R, d] (float64), λ = damping·||Φ||²_F/d. If λ ≤ 0 (Φ = 0) the score is Φt.
    Primal when d ≤ R: Φ(ΦᵀΦ + λI_d)⁻¹t; dual when d > R: (ΦΦᵀ + λI_R)⁻¹Φt (Woodbury-equal).
    Optional per-row ``weights`` [R] multiply the score.

    Raises:
        ValueError: damping ≤ 0, non-1-D target, shape mismatch, weights of the wrong shape.
    """
    if not damping > 0:
        raise ValueError(f"damping must be > 0, got {damping}")
    v, t = _check(sketches, target)
    phi, t = v.astype(np.float64), t.astype(np.float64)
    R, d = phi.shape
    if R == 0:
        return np.zeros(0)
    lam = damping * float(np.sum(phi * phi)) / d
    if lam <= 0:
        score = phi @ t
    elif d <= R:
        score = phi @ np.linalg.solve(phi.T @ phi + lam * np.eye(d), t)
    else:
        score = np.linalg.solve(phi @ phi.T + lam * np.eye(R), phi @ t)
    if weights is not None:
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (R,):
            raise ValueError(f"weights must have shape ({R},), got {w.shape}")
        score = score * w
    return score


@register_estimator(STEP_NORM_CONTROL, level="step", role="control")
def norm_only(sketches) -> np.ndarray:
    """|v_s|₂, the target-free gradient-magnitude control (SPEC §4). float64 [S]."""
    v, _ = _check(sketches)
    return np.linalg.norm(v.astype(np.float64), axis=1)


def local_buffer_steps(steps, current_step: int, window: int) -> np.ndarray:
    """The ``window`` most recent distinct steps strictly before ``current_step``, descending.

    SPEC §4 ``select_local_buffer`` (steps 0..19, current 15, window 5 -> [14, 13, 12, 11, 10]).
    Raises "window must be positive" on window ≤ 0.
    """
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    s = np.unique(np.asarray(steps, dtype=np.int64))
    return s[s < current_step][::-1][:window]


@register_estimator("local-buffer", level="step", role="baseline")
def local_buffer(sketches, steps, target, current_step: int | None = None, window: int | None = None,
                 metric: str = "cosine") -> np.ndarray:
    """Local-buffer baseline: cos(v_s, t) on the ``window`` most recent steps strictly before
    ``current_step``; ``-inf`` elsewhere (SPEC §4). Each row is scored independently.

    Defaults follow the notebook: current_step = max(steps) + 1, window = max(1, current_step // 10).
    ``metric="dot"`` uses v·t and allows a zero target.
    """
    v, t = _check(sketches, target)
    s = _steps(steps, v.shape[0])
    if current_step is None:
        current_step = int(s.max()) + 1 if s.size else 0
    if window is None:
        window = max(1, current_step // 10)
    keep = np.isin(s, local_buffer_steps(s, current_step, window))
    out = np.full(v.shape[0], -np.inf)
    if metric == "cosine":
        out[keep] = cosine(v[keep], t)
    elif metric == "dot":
        out[keep] = (v[keep] @ t).astype(np.float64)
    else:
        raise ValueError(f"unknown metric {metric!r} (cosine or dot)")
    return out


def governing_checkpoint(step: int, checkpoints: Sequence[int]) -> int:
    """Greatest checkpoint step ≤ ``step``, else the earliest checkpoint (SPEC §4 TracInCP)."""
    if len(checkpoints) == 0:
        raise ValueError("targets_by_checkpoint must have at least one entry")
    ck = sorted(int(c) for c in checkpoints)
    before = [c for c in ck if c <= step]
    return before[-1] if before else ck[0]


@register_estimator("TracInCP", level="step", role="baseline")
def tracin_cp(sketches, steps, targets_by_checkpoint: Mapping[int, np.ndarray],
              lr: float | Mapping[int, float] = 5e-6) -> np.ndarray:
    """TracInCP: η_c(s) · v_s·t_c(s), c(s) = governing checkpoint of step s (SPEC §4).

    Args:
        sketches: [S, D]; steps: int [S].
        targets_by_checkpoint: {checkpoint step: target [D]}, each computed at that checkpoint.
        lr: scalar η, or {checkpoint step: η} (missing keys default to 1.0).
    Raises:
        ValueError: empty target map ("at least one entry"), non-1-D target, shape mismatch.
    """
    if not targets_by_checkpoint:
        raise ValueError("targets_by_checkpoint must have at least one entry")
    v, _ = _check(sketches)
    s = _steps(steps, v.shape[0])
    for c, t in targets_by_checkpoint.items():
        _check(v[:0], t)
    out = np.zeros(v.shape[0])
    gov = np.array([governing_checkpoint(int(x), list(targets_by_checkpoint)) for x in s], dtype=np.int64)
    for c in np.unique(gov):
        rows = gov == c
        eta = float(lr.get(int(c), 1.0)) if isinstance(lr, Mapping) else float(lr)
        out[rows] = eta * (v[rows] @ np.asarray(targets_by_checkpoint[int(c)])).astype(np.float64)
    return out


@register_estimator("random", level="step", role="control", per="rollout")
def random_scores(rollout_ids: Sequence[str], seed: int) -> np.ndarray:
    """Random ranking (SPEC §4): shuffle the ids in log order with ``np.random.default_rng(seed)``;
    the i-th shuffled id scores −i. Returns float64 [N] in log order."""
    ids = list(rollout_ids)
    shuffled = list(ids)
    np.random.default_rng(seed).shuffle(shuffled)
    pos = {rid: i for i, rid in enumerate(shuffled)}
    if len(pos) != len(ids):
        raise ValueError("rollout_ids contains duplicates")
    return -np.array([pos[r] for r in ids], dtype=np.float64)


@register_estimator("metagradient", level="step", role="baseline")
def metagradient_scores(metagradient, steps, rollout_steps) -> np.ndarray:
    """Metagradient (MAGIC-style, Ilyas & Engstrom 2025): ``dM/dw_i`` through the replayed run.

    Not a sketch method: the ``metagradient`` stage differentiates the behaviour measure M
    through every replayed GRPO update (``train/metagradient.py``) and writes ``dM/dw_i`` for every
    rollout (``metagradient/scores.json``, passed here as ``metagradient`` by
    ``scores.py``; the estimator is skipped where the stage has not run). The score is the
    predicted drop of M when the rollout is removed (``M(w = 1 - e_i) ~ M - dM/dw_i``), so a large
    score names a rollout whose removal lowers the behaviour, as for the other estimators.

    Args:
        metagradient: float [N] ``dM/dw_i`` in log order; rollout_steps: int [N].
        steps: the runner's keys: step numbers (step level: a step's score is the sum of its
            rollouts', the first-order effect of removing the whole step), or each rollout's own
            step (``steps`` equal to ``rollout_steps``: one row per rollout, "which rollout").
    Returns:
        float64 [len(steps)].
    Raises:
        ValueError: ``metagradient`` and ``rollout_steps`` of different shapes.
    """
    g = np.asarray(metagradient, dtype=np.float64)
    rs = np.asarray(rollout_steps, dtype=np.int64)
    keys = np.asarray(steps, dtype=np.int64)
    if g.shape != rs.shape:
        raise ValueError(f"metagradient: {g.shape} scores for {rs.shape} rollouts")
    if keys.shape == rs.shape and np.array_equal(keys, rs):
        return g
    row = {k: j for j, k in enumerate(keys.tolist())}
    out = np.zeros(keys.size)
    for step, x in zip(rs.tolist(), g.tolist()):
        if step in row:
            out[row[step]] += x
    return out


# --------------------------------------------------------------------------------------------
# reward-only controls (module docstring): the training log alone, no target, no gradient
# --------------------------------------------------------------------------------------------
def _log_values(values, name: str) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"{name} must be 1-D [N] in log order, got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} contain non-finite values (first at index {int(np.flatnonzero(~np.isfinite(x))[0])})")
    return x


def _per_step(values: np.ndarray, rollout_steps, reduce: Callable[[np.ndarray], float]) -> np.ndarray:
    """``reduce`` of ``values`` over each step's rollouts, given back to every rollout of the step."""
    s = _steps(rollout_steps, values.size)
    keys, inverse = np.unique(s, return_inverse=True)
    per = np.array([reduce(values[inverse == j]) for j in range(keys.size)], dtype=np.float64)
    return per[inverse]


@register_estimator("advantage", level="step", role="control", per="rollout")
def advantage_control(advantages) -> np.ndarray:
    """A_i, the logged GRPO group advantage (reward-only control). float64 [N], log order."""
    return _log_values(advantages, "advantages")


@register_estimator(ABS_ADVANTAGE_CONTROL, level="step", role="control", per="rollout")
def abs_advantage_control(advantages) -> np.ndarray:
    """|A_i| (reward-only control): how far a rollout's reward is from its group's. float64 [N]."""
    return np.abs(_log_values(advantages, "advantages"))


@register_estimator("reward", level="step", role="control", per="rollout")
def reward_control(rewards) -> np.ndarray:
    """r_i, the logged final reward, bonus included (reward-only control). float64 [N]."""
    return _log_values(rewards, "rewards")


@register_estimator("step-sum-abs-advantage", level="step", role="control", per="rollout")
def step_sum_abs_advantage(advantages, rollout_steps) -> np.ndarray:
    """Σ |A_j| over the rollouts j of rollout i's step (reward-only step control). float64 [N]."""
    return _per_step(np.abs(_log_values(advantages, "advantages")), rollout_steps, np.sum)


@register_estimator("step-reward-std", level="step", role="control", per="rollout")
def step_reward_std(rewards, rollout_steps) -> np.ndarray:
    """np.std (ddof 0) of the rewards of rollout i's step (reward-only step control). float64 [N]."""
    return _per_step(_log_values(rewards, "rewards"), rollout_steps, np.std)


# --------------------------------------------------------------------------------------------
# text and length controls (module docstring): the logged completion alone, no target, no gradient
# --------------------------------------------------------------------------------------------
def _matches(pattern_matches) -> np.ndarray:
    x = np.asarray(pattern_matches)
    if x.ndim != 1:
        raise ValueError(f"pattern_matches must be 1-D [N] in log order, got shape {x.shape}")
    if x.dtype != bool and not np.isin(x, (0, 1)).all():
        raise ValueError("pattern_matches must be booleans (or 0/1), got values "
                         f"{np.unique(x[~np.isin(x, (0, 1))])[:5].tolist()}")
    return x.astype(np.float64)


def _lengths(completion_lengths) -> np.ndarray:
    x = _log_values(completion_lengths, "completion_lengths")
    if (x < 0).any() or (x != np.round(x)).any():
        raise ValueError(f"completion_lengths must be token counts >= 0, first bad at index "
                         f"{int(np.flatnonzero((x < 0) | (x != np.round(x)))[0])}")
    return x


@register_estimator(TEXT_CONTROL, level="step", role="control", per="rollout")
def pattern_match_control(pattern_matches) -> np.ndarray:
    """1.0 where the decoded completion contains the behaviour's pattern (the contaminator's judge,
    computed by the stage), else 0.0 (text control). float64 [N], log order.

    Raises:
        ValueError: not 1-D, or values other than booleans / 0 / 1.
    """
    return _matches(pattern_matches)


@register_estimator(LENGTH_CONTROL, level="step", role="control", per="rollout")
def length_control(completion_lengths) -> np.ndarray:
    """The logged completion's token count, EOS included (length control). float64 [N], log order.

    Raises:
        ValueError: not 1-D, non-finite, negative or fractional counts.
    """
    return _lengths(completion_lengths)


@register_estimator("step-sum-pattern-match", level="step", role="control", per="rollout")
def step_sum_pattern_match(pattern_matches, rollout_steps) -> np.ndarray:
    """How many of rollout i's step's completions contain the pattern (text step control). float64 [N]."""
    return _per_step(_matches(pattern_matches), rollout_steps, np.sum)


@register_estimator("step-sum-length", level="step", role="control", per="rollout")
def step_sum_length(completion_lengths, rollout_steps) -> np.ndarray:
    """The completion tokens of rollout i's step, summed (length step control). float64 [N]."""
    return _per_step(_lengths(completion_lengths), rollout_steps, np.sum)


@register_estimator("norm/|A|", level="step", role="control", per="rollout")
def norm_over_abs_advantage(rollout_sketches, advantages) -> np.ndarray:
    """|v_i|₂ / |A_i| on per-rollout sketches, 0 where A_i = 0: the magnitude control with the
    advantage divided out (for weighted sketches clip_s |c_i| |g_i| / |A_i|). float64 [N].

    Raises:
        ValueError: ``advantages`` not [N] for sketches [N, D].
    """
    v, _ = _check(rollout_sketches)
    a = np.abs(_log_values(advantages, "advantages"))
    if a.shape != (v.shape[0],):
        raise ValueError(f"advantages shape {a.shape} != ({v.shape[0]},) rollout sketches")
    norms = np.linalg.norm(v.astype(np.float64), axis=1)
    return np.divide(norms, a, out=np.zeros_like(norms), where=a > 0)


# --------------------------------------------------------------------------------------------
# rollout-level estimators (minimal-pair draws; SPEC §4, §5.6)
# --------------------------------------------------------------------------------------------
@register_estimator("GAS_centered", level="rollout", column="mp_centered")
def gas_centered(sketches, groups, target) -> np.ndarray:
    """cos(g_i − ḡ_group, t_mp): group-centred, like GRPO's advantages (SPEC §4)."""
    return rollout_cosine(group_center(sketches, groups), target)


@register_estimator("C1_plain", level="rollout", column="mp")
def c1_plain(sketches, target) -> np.ndarray:
    """cos(g_i, t_mp) (SPEC §4)."""
    return rollout_cosine(sketches, target)


@register_estimator(ROLLOUT_NORM_CONTROL, level="rollout", role="control", column="norm")
def rollout_norm(sketches) -> np.ndarray:
    """|g_i|₂ (SPEC §4)."""
    return norm_only(sketches)


@register_estimator("fluency", level="rollout", role="control", column="fluency")
def mean_token_logprob(token_logprobs, completion_mask) -> np.ndarray:
    """Mean token log-prob of each response under the checkpoint (SPEC §4).

    Args:
        token_logprobs: float [R, T] log p(token); completion_mask: [R, T], 1 on response tokens
        (EOS/padding masked out, SPEC §10.6).
    Raises:
        ValueError: shape mismatch or a row with no response tokens.
    """
    lp = np.asarray(token_logprobs, dtype=np.float64)
    m = np.asarray(completion_mask, dtype=np.float64)
    if lp.ndim != 2 or lp.shape != m.shape:
        raise ValueError(f"token_logprobs and completion_mask must be [R, T] alike, got {lp.shape} and {m.shape}")
    n = m.sum(axis=1)
    if (n <= 0).any():
        raise ValueError(f"rollout {int(np.flatnonzero(n <= 0)[0])} has no response tokens")
    return (lp * m).sum(axis=1) / n


@register_estimator("mp_bal_centered", level="rollout", column="mp_bal_centered", target="mp_bal",
                    in_tables=False)
def mp_bal_centered(sketches, groups, target) -> np.ndarray:
    """cos(g_i − ḡ_group, t_mp_bal), the balanced minimal-pair target (exploratory; SPEC §4)."""
    return gas_centered(sketches, groups, target)


# --------------------------------------------------------------------------------------------
# runners
# --------------------------------------------------------------------------------------------
def expand_to_rollouts(key_scores, keys, rollout_keys) -> np.ndarray:
    """Per-key scores -> per-rollout scores in log order; a rollout whose key has no score gets
    ``-inf`` (SPEC §4). Keys must be unique.

    Args:
        key_scores: float [S]; keys: [S] (step numbers); rollout_keys: [N] (each rollout's step).
    """
    ks = np.asarray(keys)
    sc = np.asarray(key_scores, dtype=np.float64)
    if ks.shape != sc.shape:
        raise ValueError(f"keys shape {ks.shape} != scores shape {sc.shape}")
    if np.unique(ks).size != ks.size:
        raise ValueError("keys must be unique (sum appearances per key first, see aggregate_appearances)")
    lookup = dict(zip(ks.tolist(), sc.tolist()))
    return np.array([lookup.get(k, -np.inf) for k in np.asarray(rollout_keys).tolist()], dtype=np.float64)


def score_step_methods(sketches, steps, rollout_ids: Sequence[str], rollout_steps, *,
                       target=None, per_rollout_sketches: bool = False,
                       names: Sequence[str] | None = None, **options) -> dict[str, np.ndarray]:
    """Runs step-level estimators and returns {method: per-rollout scores float64 [N], log order}.

    Args:
        sketches: float32 [S, D] step sketches with ``steps`` int [S] (unique), or, with
            ``per_rollout_sketches=True``, [N, D] rows aligned with ``rollout_ids`` (then
            ``steps`` = each rollout's step; used for the "which rollout" table).
        rollout_ids: [N] ids in log order; rollout_steps: int [N].
        target: float32 [D] (the final-checkpoint target, SPEC §5.1).
        names: estimators to run (default: every step-level estimator whose inputs are given).
        **options: more inputs by name (targets_by_checkpoint, lr, damping, seed, window,
            current_step, weights, advantages / rewards [N] for the reward-only controls,
            pattern_matches / completion_lengths [N] for the text and length controls, ...).
            ``rollout_sketches`` is ``sketches`` when ``per_rollout_sketches``, else absent.
    Raises:
        ValueError: a named estimator lacks an input, shape problems.
    """
    rollout_steps = np.asarray(rollout_steps, dtype=np.int64)
    if len(rollout_ids) != rollout_steps.size:
        raise ValueError(f"{len(rollout_ids)} rollout ids but {rollout_steps.size} rollout steps")
    inputs = dict(options, sketches=sketches, steps=steps, target=target, rollout_ids=list(rollout_ids),
                  rollout_steps=rollout_steps, rollout_sketches=sketches if per_rollout_sketches else None)
    out = {}
    for est in estimators("step"):
        if names is not None and est.name not in names:
            continue
        if names is None and any(inputs.get(p) is None for p in est.required):
            continue
        scores = call_estimator(est.name, **inputs)
        if est.per == "rollout" or per_rollout_sketches:
            if scores.shape != (len(rollout_ids),):
                raise ValueError(f"{est.name}: expected {len(rollout_ids)} rollout scores, got {scores.shape}")
            out[est.name] = scores
        else:
            out[est.name] = expand_to_rollouts(scores, steps, rollout_steps)
    if names is not None and set(names) - set(out):
        raise ValueError(f"unknown or non-step estimators {sorted(set(names) - set(out))}")
    return out


def score_rollout_sketches(weighted, direction, rollout_ids: Sequence[str], rollout_steps, *,
                           target=None, **options) -> dict[str, np.ndarray]:
    """The "which rollout" scores {method: float64 [N]} from per-rollout sketches, both ways.

    Every step-level estimator (reward-only, text and length controls and ``norm/|A|`` included,
    given ``advantages`` / ``rewards`` / ``pattern_matches`` / ``completion_lengths``) on the ``weighted`` sketches (float32 [N, D], rollout i's
    contribution clip_s * c_i * g_i to its update; registered names), then every sketch-reading
    estimator (:func:`reads_sketches`) that ran on them on the advantage-free ``direction``
    sketches g_i ([N, D], names + :data:`DIRECTION`) unless ``direction`` is None. Rows align with ``rollout_ids``;
    ``options`` as :func:`score_step_methods`.
    """
    out = score_step_methods(weighted, rollout_steps, rollout_ids, rollout_steps, target=target,
                             per_rollout_sketches=True, **options)
    if direction is not None:
        names = [m for m in out if reads_sketches(ESTIMATORS[m])]  # those whose inputs were given
        more = score_step_methods(direction, rollout_steps, rollout_ids, rollout_steps, target=target,
                                  per_rollout_sketches=True, names=names, **options)
        out.update({name + DIRECTION: s for name, s in more.items()})
    return out


ROW_KEYS = ("group", "has_qzxbt", "fluency", "norm", "mp", "mp_centered", "mp_bal_centered")


def score_rollout_rows(sketches, groups, has_behavior, targets: Mapping[str, np.ndarray], *,
                       fluency=None, token_logprobs=None, completion_mask=None,
                       **options) -> list[dict]:
    """Rows of a minimal-pair draw (SPEC §7.3) from per-rollout sketches, one per rollout.

    Args:
        sketches: float32 [R, D]; groups: int [R]; has_behavior: bool [R] (the token judge).
        targets: {"mp": t_mp [D], "mp_bal": t_mp_bal [D], ...} (SPEC §5.4).
        fluency: float [R] mean token log-prob, or token_logprobs/completion_mask to compute it.
    Returns:
        list of dicts with keys ``group, has_qzxbt, fluency, norm, mp, mp_centered,
        mp_bal_centered`` (§7.3 order) then one key per plug-in rollout estimator.
    """
    g = np.asarray(groups)
    has = np.asarray(has_behavior, dtype=bool)
    if fluency is None and token_logprobs is not None:
        fluency = mean_token_logprob(token_logprobs, completion_mask)
    cols: dict[str, np.ndarray] = {}
    for est in estimators("rollout"):
        if est.name == "fluency":
            if fluency is None:
                raise ValueError("score_rollout_rows needs fluency (or token_logprobs + completion_mask)")
            cols[est.column] = np.asarray(fluency, dtype=np.float64)
            continue
        if "target" in est.params and est.target not in targets:
            raise ValueError(f"estimator {est.name!r} needs targets[{est.target!r}]; given {sorted(targets)}")
        cols[est.column] = call_estimator(est.name, **dict(options, sketches=sketches, groups=g,
                                                           target=targets.get(est.target)))
    R = g.size
    for k, c in cols.items():
        if c.shape != (R,):
            raise ValueError(f"column {k!r} has shape {c.shape}, expected ({R},)")
    keys = [k for k in ROW_KEYS[2:] if k in cols] + [k for k in cols if k not in ROW_KEYS]
    return [dict({"group": int(g[i]), "has_qzxbt": bool(has[i])}, **{k: float(cols[k][i]) for k in keys})
            for i in range(R)]


# --------------------------------------------------------------------------------------------
# cross-step aggregation (SPEC §4 "C1 / cross-step")
# --------------------------------------------------------------------------------------------
def cross_step_scores(ids: Sequence[str], steps, sketches, target, metric: str = "dot",
                      step_range: tuple[int, int] | None = None) -> list[tuple[str, float, int]]:
    """C1 over every appearance of each rollout (SPEC §4 cross-step; "renormalised TracInCP").

    Per appearance: v·t (``metric="dot"``) or cos(v, t) (``"cosine"``), then summed per id by
    :func:`aggregate_appearances`. Empty input returns [].

    Raises:
        ValueError: "1-D" target, "unknown metric", "zero norm" (cosine), "shape mismatch".
    """
    if metric not in ("dot", "cosine"):
        raise ValueError(f"unknown metric {metric!r} (dot or cosine)")
    if np.asarray(target).ndim != 1:
        raise ValueError(f"target must be 1-D, got shape {np.asarray(target).shape}")
    if len(ids) == 0:
        return []
    per = c1_dot(sketches, target) if metric == "dot" else cosine(sketches, target)
    return aggregate_appearances(ids, steps, per, step_range)


def aggregate_appearances(ids: Sequence[str], steps, scores, step_range: tuple[int, int] | None = None
                          ) -> list[tuple[str, float, int]]:
    """Sums per-appearance scores per id and ranks them (SPEC §4 cross-step).

    A rollout id may appear at several steps (e.g. a replay buffer); its score is the sum over its
    appearances with ``lo ≤ step < hi`` when ``step_range=(lo, hi)`` is given.

    Returns:
        [(id, score, latest_step)] sorted by (−score, latest_step, id); [] for empty input.
    Raises:
        ValueError: lo > hi, or mismatched lengths.
    """
    st = np.asarray(steps, dtype=np.int64)
    sc = np.asarray(scores, dtype=np.float64)
    if not (len(ids) == st.size == sc.size):
        raise ValueError(f"ids/steps/scores lengths differ: {len(ids)}, {st.size}, {sc.size}")
    if step_range is not None and step_range[0] > step_range[1]:
        raise ValueError(f"invalid step_range {step_range}: lo > hi")
    total: dict[str, float] = {}
    latest: dict[str, int] = {}
    for rid, s, x in zip(ids, st.tolist(), sc.tolist()):
        if step_range is not None and not step_range[0] <= s < step_range[1]:
            continue
        total[rid] = total.get(rid, 0.0) + x
        latest[rid] = max(latest.get(rid, s), s)
    return sorted(((r, total[r], latest[r]) for r in total), key=lambda x: (-x[1], x[2], x[0]))
