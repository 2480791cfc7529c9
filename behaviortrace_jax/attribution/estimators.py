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

Where each part lives: the registry, names and shared similarities in ``estimator_registry.py``;
the step-level estimators in ``step_estimators.py``; the log controls in ``controls.py``; the
rollout-level estimators and the runners here. Every public name is importable from this module.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

# The plug-in API and the estimators, in registration order (the tables' order): the step-level
# estimators, then the log controls, then the rollout-level estimators below. Re-exported here.
from behaviortrace_jax.attribution.estimator_registry import (  # noqa: F401
    ABS_ADVANTAGE_CONTROL, ANSWERED_FRACTION, COS_EPS, DIRECTION, ESTIMATORS, LENGTH_CONTROL, LOG_INPUTS,
    REWARD_ONLY_ROLLOUT_CONTROLS, REWARD_ONLY_STEP_CONTROLS, ROLLOUT_COS_EPS, ROLLOUT_NORM_CONTROL,
    STEP_NORM_CONTROL, TEXT_CONTROL, TEXT_ROLLOUT_CONTROLS, TEXT_STEP_CONTROLS, Estimator, base_method,
    call_estimator, check_sketches, check_steps, cosine, estimators, group_center, is_direction, log_control,
    reads_sketches, register_estimator, reward_only, rollout_cosine)
from behaviortrace_jax.attribution.step_estimators import (  # noqa: F401
    c1_cosine, c1_dot, governing_checkpoint, local_buffer, local_buffer_steps, metagradient_scores, norm_only,
    random_scores, tracin_cp, trak)
from behaviortrace_jax.attribution.controls import (  # noqa: F401
    abs_advantage_control, advantage_control, length_control, norm_over_abs_advantage, pattern_match_control,
    reward_control, step_reward_std, step_sum_abs_advantage, step_sum_length, step_sum_pattern_match)


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
