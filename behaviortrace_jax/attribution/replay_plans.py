"""Replay plans as registered objects (issue 46 item 3): a plan turns a finished run into typed
replay requests, says what they cost before anything runs, and turns their measured results into
table rows with its own estimator (``attribution/replay_estimators.py``). numpy only.

Registered here (``counterfactual.plans`` picks extra ones; ``counterfactual.causal`` the first two):

* ``leave-top-k-out``: the oracle's, each replayed estimator's and random k-subsets' top-k window
  rollouts intervened on, plus the LDS subsets (``counterfactual_topk*``, ``lds*`` tables;
  estimator: difference and Spearman, ``attribution/counterfactual_tables.py``).
* ``single-unit``: one branch per unit and intervention off each track's baseline, plus the
  "withhold all" label checks (``causal_*`` tables, ``attribution/causal.py``; estimator: difference).
* ``datamodels``: ``counterfactual.plan_subsets`` random unit subsets (each unit in with
  probability 1/2), fixed rollouts, ``counterfactual.intervention``; estimator: least squares
  (``datamodels_effect_*`` and ``causal_spearman_datamodels_*`` / ``causal_p@k_datamodels_*``), and
  the fit's checks (``datamodels_fit_*``: ``loo-r2``, the held-out R² of the additive fit;
  ``equal-effects-p``, whether the units' effects can be told apart at all; ``interaction-p``,
  whether pairwise interactions add to the fit).
* ``factorial``: a two-level fractional factorial over the units (R = the power of 2 above U
  runs); estimator: the main-effect contrast (``factorial_effect_*`` and the method rows).

A new plan is one registration (a subclass of :class:`ReplayPlan` with ``@register_plan(name)``)
in any module imported before the stage runs.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from behaviortrace_jax.attribution import causal as causal_tables, counterfactual_tables as T, formats
from behaviortrace_jax.attribution import replay_estimators as E
from behaviortrace_jax.io.replay_request import ReplayRequest, Track

UNITS = ("steps", "groups", "blocks")
REGENERATED = ("units", "label")  # counterfactual.causal_regenerated: what the regenerated tracks replay
ALL_GT, ALL_BONUSES = "withhold-all-gt", "withhold-all-bonuses"
PRIMARY_MEASURE = "logp_margin"  # tables of this measure keep their plain names


@dataclasses.dataclass(frozen=True)
class Units:
    """The causal units: ``names`` (``s<step>``, ``s<step>g<group>`` or ``s<first>-<last>`` for a
    block; row labels), ``rollouts`` (int64 index arrays, log order), ``steps`` (each unit's first
    step)."""

    names: list[str]
    rollouts: list[np.ndarray]
    steps: list[int]


def causal_units(window_steps: int, group_size: int, n_per_step: int, kind: str, block_steps: int = 10) -> Units:
    """The window's units (steps < ``window_steps``) of ``kind`` (``counterfactual.causal_units``);
    a group is ``group_size`` rollouts, a block ``block_steps`` consecutive steps (the last block may
    be shorter; units sized by power: ``attribution/unit_designs.py``). Raises ValueError naming the
    key for an unknown kind or ``block_steps < 1``."""
    if kind not in UNITS:
        raise ValueError(f"counterfactual.causal_units={kind!r}; expected one of {UNITS}")
    if kind == "blocks":
        if int(block_steps) < 1:
            raise ValueError(f"counterfactual.causal_block_steps={block_steps}: must be >= 1")
        b, w = int(block_steps), int(window_steps)
        firsts = list(range(0, w, b))
        return Units([f"s{a}-{min(a + b, w) - 1}" for a in firsts],
                     [np.arange(a * n_per_step, min(a + b, w) * n_per_step, dtype=np.int64) for a in firsts], firsts)
    names, rollouts, steps, g = [], [], [], int(group_size)
    for s in range(int(window_steps)):
        per = [(f"s{s}", s * n_per_step, (s + 1) * n_per_step)] if kind == "steps" else [
            (f"s{s}g{j}", s * n_per_step + j * g, s * n_per_step + (j + 1) * g) for j in range(n_per_step // g)]
        for name, a, b in per:
            names.append(name)
            rollouts.append(np.arange(a, b, dtype=np.int64))
            steps.append(s)
    return Units(names, rollouts, steps)


def tracks(rollouts: str, streams: int) -> list[Track]:
    """The tracks: fixed always, and with ``rollouts = "regenerated"`` also regenerated stream j for
    j < ``streams``. Raises ValueError naming the key for an unknown mode or ``streams < 1``."""
    if rollouts not in ("fixed", "regenerated"):
        raise ValueError(f"counterfactual.rollouts={rollouts!r}; expected one of ('fixed', 'regenerated')")
    if rollouts == "regenerated" and streams < 1:
        raise ValueError(f"counterfactual.causal_streams={streams}: need >= 1")
    return [Track()] + ([Track("regenerated", j) for j in range(int(streams))] if rollouts == "regenerated" else [])


def measure_table(table: str, measure: str) -> str:
    """A table's name for ``measure``: ``table`` for :data:`PRIMARY_MEASURE`, else ``table[measure]``."""
    return table if measure == PRIMARY_MEASURE else f"{table}[{measure}]"


@dataclasses.dataclass(frozen=True)
class PlanContext:
    """What plans are made from (numpy and config values; built by the counterfactual stage).

    seed: the run's seed (row label, random draws); steps: int64 [num_rollouts] each rollout's step;
    n_per_step, group_size: N and G; cutoff: ``contamination.early_step_cutoff`` (the top-k window);
    at: the measure step the tables read; target_step: the checkpoint nearest ``draws.target_step``;
    gt: int64 ground-truth indices; scores / replayed: ``{method: float64 [num_rollouts]}`` every
    scored method and those whose top-k are replayed; measures: the recorded measure names;
    table_measures: the measure outputs tables are made of; cf: ``RunSpec.counterfactual``; nboot.
    """

    seed: int
    steps: np.ndarray
    n_per_step: int
    group_size: int
    cutoff: int
    at: int
    target_step: int
    gt: np.ndarray
    scores: dict[str, np.ndarray]
    replayed: dict[str, np.ndarray]
    measures: tuple[str, ...]
    table_measures: tuple[str, ...]
    cf: Any
    nboot: int

    @property
    def window(self) -> np.ndarray:
        """int64 indices of the window's rollouts (steps < ``cutoff``)."""
        return np.flatnonzero(self.steps < self.cutoff)

    @property
    def label(self) -> str:
        return str(int(self.seed))

    def units(self) -> Units:
        """The causal units of the window capped at the measure step."""
        return causal_units(min(self.cutoff, self.at), self.group_size, self.n_per_step, self.cf.causal_units,
                            self.cf.causal_block_steps)

    def request(self, track: Track, intervention: str | None = None, target=(), *, advantages: str = "logged",
                measure_steps: Sequence[int] | None = None, start_step: int = 0) -> ReplayRequest:
        """A request of this context's measures (default measure step: ``at``)."""
        return ReplayRequest(track, intervention, tuple(int(i) for i in np.asarray(target, np.int64).reshape(-1)),
                             advantages, tuple(measure_steps or (self.at,)), None, int(start_step), None, self.measures)


@dataclasses.dataclass(frozen=True)
class PlannedReplay:
    """One replay of a plan and what it is in the plan's design (typed; never a parsed string):
    ``role`` (e.g. "baseline", "oracle", "method", "random", "lds", "unit", "subset"), ``method``,
    ``k``, ``draw`` (a random seed or subset index), ``unit`` (a unit index), ``fraction`` (LDS)."""

    request: ReplayRequest
    role: str
    method: str | None = None
    k: int | None = None
    draw: int = 0
    unit: int | None = None
    fraction: float | None = None


Values = Callable[[PlannedReplay, str], "float | None"]  # (replay, measure output) -> value at ``at``; None: skipped


class ReplayPlan:
    """A registered replay plan (subclass it; :func:`register_plan`)."""

    name: ClassVar[str] = ""

    def replays(self, ctx: PlanContext) -> list[PlannedReplay]:
        raise NotImplementedError

    def rows(self, ctx: PlanContext, replays: list[PlannedReplay], value: Values) -> list[formats.Row]:
        raise NotImplementedError


def plan_cost(replays: Sequence[PlannedReplay]) -> int:
    """Replayed steps of ``replays``: each one's ``stop - start_step``, plus, per track, the baseline
    advanced to its last branch point (``train/replay_runner.py`` runs it once per track)."""
    reqs = list(dict.fromkeys(r.request for r in replays))
    branch = {}
    for q in reqs:
        branch[q.track] = max(branch.get(q.track, 0), q.start_step)
    return int(sum(q.stop - q.start_step for q in reqs) + sum(branch.values()))


PLANS: dict[str, type[ReplayPlan]] = {}


def register_plan(name: str) -> Callable[[type[ReplayPlan]], type[ReplayPlan]]:
    """Registers a :class:`ReplayPlan` subclass as ``name``. Raises ValueError for a duplicate."""

    def wrap(cls: type[ReplayPlan]) -> type[ReplayPlan]:
        if name in PLANS:
            raise ValueError(f"replay plan {name!r} already registered")
        cls.name = name
        PLANS[name] = cls
        return cls

    return wrap


def get_plan(name: str) -> ReplayPlan:
    """An instance of the registered plan ``name``. Raises ValueError naming the known ones."""
    if name not in PLANS:
        raise ValueError(f"counterfactual.plans: {name!r} is not a registered replay plan; known: {sorted(PLANS)}")
    return PLANS[name]()


def _delta(value: Values, item: PlannedReplay, base: PlannedReplay, out: str) -> float:
    v = value(item, out)
    return 0.0 if v is None else value(base, out) - v  # a skipped replay changed nothing: Δ = 0


@register_plan("leave-top-k-out")
class LeaveTopKOut(ReplayPlan):
    """Leave-top-k-out (oracle, replayed estimators, random k-subsets; k = ``counterfactual.k_fractions``
    x |GT in window|) and the LDS subsets (``counterfactual.lds_fractions``), on the main track
    (``counterfactual.rollouts``, stream 0) with ``counterfactual.intervention``; with
    ``counterfactual.topk_recomputed`` (remove, logged advantages) the top-k again with recomputed
    advantages. Measured at the target checkpoint and ``at``; not branched (start 0)."""

    def replays(self, ctx: PlanContext) -> list[PlannedReplay]:
        cf, window = ctx.cf, ctx.window
        gt = ctx.gt[ctx.steps[ctx.gt] < ctx.cutoff]
        ks = sorted({max(1, int(round(float(f) * gt.size))) for f in cf.k_fractions.split(",")}) if gt.size else []
        track, iv = Track(cf.rollouts, 0), cf.intervention
        rec = bool(cf.recompute_advantages) and iv == "remove"
        steps = sorted({ctx.target_step, ctx.at})
        req = lambda target, adv: ctx.request(track, iv, target, advantages=adv, measure_steps=steps)  # noqa: E731
        out = [PlannedReplay(ctx.request(track, measure_steps=steps), "baseline")]
        advs = ["recomputed" if rec else "logged"] + (["recomputed"] if cf.topk_recomputed and not rec and iv == "remove"
                                                      else [])
        for adv in advs:
            for k in ks:
                out.append(PlannedReplay(req(gt[:k] if k < gt.size else gt, adv), "oracle", "oracle", k))
                for name, s in ctx.replayed.items():
                    out.append(PlannedReplay(req(T.top_k(s, window, k), adv), "method", name, k))
                for seed in range(int(cf.random_seeds)):
                    rng = np.random.default_rng([int(ctx.seed), seed, k])
                    out.append(PlannedReplay(req(np.sort(rng.choice(window, k, replace=False)), adv), "random",
                                             "random", k, seed))
        adv = advs[0]
        for f in T.lds_fractions(cf.lds_fractions):
            subs = (T.half_subsets(window, int(cf.lds_subsets), int(ctx.seed)) if f == 0.5 else
                    T.drop_subsets(window, f, int(cf.lds_small_subsets), int(ctx.seed)))
            out += [PlannedReplay(req(sub, adv), "lds", draw=j, fraction=f) for j, sub in enumerate(subs)]
        return out

    def rows(self, ctx: PlanContext, replays: list[PlannedReplay], value: Values) -> list[formats.Row]:
        base = next(r for r in replays if r.role == "baseline")
        main = "recomputed" if bool(ctx.cf.recompute_advantages) and ctx.cf.intervention == "remove" else "logged"
        rows: list[formats.Row] = []
        for out in ctx.table_measures:
            tables = {main: "counterfactual_topk"}
            if main == "logged":
                tables["recomputed"] = "counterfactual_topk_recomputed"
            topk = {adv: {} for adv in tables}
            lds: dict[float, list] = {}
            for r in replays:
                if r.role in ("oracle", "method", "random") and r.request.advantages in topk:
                    topk[r.request.advantages][(r.method, r.k, r.draw)] = _delta(value, r, base, out)
                elif r.role == "lds":
                    v = value(r, out)
                    lds.setdefault(r.fraction, []).append((np.array(r.request.target, np.int64),
                                                           value(base, out) if v is None else v))
            main_rows = T.topk_rows(ctx.label, measure_table(tables[main], out), topk[main], list(ctx.replayed))
            main_rows += T.lds_rows(ctx.label, {f: v for f, v in lds.items()}, ctx.scores, ctx.window, nboot=ctx.nboot)
            rows += [r if out == PRIMARY_MEASURE or not r.table.startswith("lds") else
                     dataclasses.replace(r, table=measure_table(r.table, out)) for r in main_rows]
            if "recomputed" in tables and topk["recomputed"]:
                rows += T.topk_rows(ctx.label, measure_table(tables["recomputed"], out), topk["recomputed"],
                                    list(ctx.replayed))
        return rows


@register_plan("single-unit")
class SingleUnit(ReplayPlan):
    """Single-unit branches (the causal ground truth, ``attribution/causal.py``): per track, its
    baseline, each unit's replay per intervention of ``counterfactual.causal_interventions``
    branched at the unit's step (on regenerated tracks only with ``causal_regenerated = "units"``),
    and withholding every ground-truth bonus / every bonus of the window. Cost per track and
    intervention ``sum_u (at - step_u)`` steps (820 at tiny scale for 40 step units)."""

    def interventions(self, ctx: PlanContext) -> list[str]:
        return [s.strip() for s in str(ctx.cf.causal_interventions).split(",") if s.strip()]

    def replays(self, ctx: PlanContext) -> list[PlannedReplay]:
        cf, units = ctx.cf, ctx.units()
        if cf.causal_regenerated not in REGENERATED:
            raise ValueError(f"counterfactual.causal_regenerated={cf.causal_regenerated!r}; expected one of {REGENERATED}")
        window = np.arange(min(ctx.cutoff, ctx.at) * ctx.n_per_step, dtype=np.int64)
        out = []
        for tr in tracks(cf.rollouts, int(cf.causal_streams)):
            out.append(PlannedReplay(ctx.request(tr), "baseline"))
            if tr.rollouts == "fixed" or cf.causal_regenerated == "units":
                out += [PlannedReplay(ctx.request(tr, iv, u, advantages="recomputed" if cf.recompute_advantages
                                                  and iv == "remove" else "logged", start_step=st), "unit", iv, unit=j)
                        for j, (u, st) in enumerate(zip(units.rollouts, units.steps)) for iv in self.interventions(ctx)]
            out += [PlannedReplay(ctx.request(tr, "withhold-bonus", ctx.gt[ctx.gt < window.size]), "label", ALL_GT),
                    PlannedReplay(ctx.request(tr, "withhold-bonus", window), "label", ALL_BONUSES)]
        return out

    def rows(self, ctx: PlanContext, replays: list[PlannedReplay], value: Values) -> list[formats.Row]:
        units, rows = ctx.units(), []
        is_gt = np.zeros(ctx.steps.size, bool)
        is_gt[ctx.gt] = True
        for out in ctx.table_measures:
            effects: dict[tuple[str, str], list] = {}
            labels: dict[tuple[str, str], list] = {}
            baselines: dict[str, list] = {}
            for tr in dict.fromkeys(r.request.track for r in replays):
                mine = [r for r in replays if r.request.track == tr]
                base = next(r for r in mine if r.role == "baseline")
                baselines.setdefault(tr.rollouts, []).append(value(base, out))
                for iv in self.interventions(ctx):
                    row = [_delta(value, r, base, out) for r in mine if r.role == "unit" and r.method == iv]
                    if row:
                        effects.setdefault((iv, tr.rollouts), []).append(row)
                for r in mine:
                    if r.role == "label":
                        labels.setdefault((tr.rollouts, r.method), []).append(_delta(value, r, base, out))
            got = causal_tables.tables(ctx.label, unit_names=units.names, unit_rollouts=units.rollouts,
                                       effects={k: np.array(v, np.float64) for k, v in effects.items()},
                                       label_deltas={k: np.array(v, np.float64) for k, v in labels.items()},
                                       scores=ctx.scores, is_gt=is_gt, k_fraction=float(ctx.cf.causal_k),
                                       nboot=ctx.nboot, rng_seed=int(ctx.seed),
                                       baselines={k: np.array(v, np.float64) for k, v in baselines.items()})
            rows += [dataclasses.replace(r, table=measure_table(r.table, out)) for r in got]
        return rows


class _SubsetDesign(ReplayPlan):
    """A design over the units: replay r intervenes on the units with ``design[r, u] > 0``
    (``counterfactual.intervention``); subclasses give the design and the estimator. Track
    (``counterfactual.plan_rollouts``): "fixed" replays the logged rollouts (the baseline on the same
    track); "regenerated" samples every replay's rollouts from its replayed policy, replay r on its
    own sampler stream r + 1 (training noise independent between replays, so the least-squares fit
    averages it out: ``attribution/unit_designs.py``), the baseline on stream 0 (the run's keys; the
    fit's intercept absorbs it). Rows: ``<name>_effect_<iv>_<mode>`` per unit and the
    ``causal_spearman`` / ``causal_p@k`` rows of every method against the estimated effects (suffix
    ``<name>_<iv>_<mode>``)."""

    table = ""

    @staticmethod
    def track(ctx: PlanContext, r: int | None) -> Track:
        """Replay r's track (None: the baseline's). Raises ValueError naming the key for another mode."""
        mode = ctx.cf.plan_rollouts
        if mode not in ("fixed", "regenerated"):
            raise ValueError(f"counterfactual.plan_rollouts={mode!r}; expected one of ('fixed', 'regenerated')")
        return Track() if mode == "fixed" else Track("regenerated", 0 if r is None else r + 1)

    def design(self, ctx: PlanContext, units: int) -> np.ndarray:
        raise NotImplementedError

    def estimate(self, baseline: float, design: np.ndarray, values: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def replays(self, ctx: PlanContext) -> list[PlannedReplay]:
        units = ctx.units()
        x = self.design(ctx, len(units.names))
        out = [PlannedReplay(ctx.request(self.track(ctx, None)), "baseline")]
        for r in range(x.shape[0]):
            target = np.concatenate([units.rollouts[u] for u in np.flatnonzero(x[r] > 0)] or [np.zeros(0, np.int64)])
            out.append(PlannedReplay(ctx.request(self.track(ctx, r), ctx.cf.intervention, target), "subset", draw=r))
        return out

    def rows(self, ctx: PlanContext, replays: list[PlannedReplay], value: Values) -> list[formats.Row]:
        units = ctx.units()
        x = self.design(ctx, len(units.names))
        base = next(r for r in replays if r.role == "baseline")
        subs = sorted((r for r in replays if r.role == "subset"), key=lambda r: r.draw)
        mode = ctx.cf.plan_rollouts
        rows, suffix = [], f"{self.table}_{ctx.cf.intervention}_{mode}"
        for out in ctx.table_measures:
            b = value(base, out)
            vals = np.array([b if value(r, out) is None else value(r, out) for r in subs], np.float64)
            beta = self.estimate(b, x, vals)
            # each unit's t interval and the leave-one-out R² of the additive fit (0/1 coding of the design)
            fit = E.least_squares_fit(b, (np.asarray(x) > 0).astype(np.int8), vals)
            ci = [(None, None) if not np.isfinite(lo) else (float(lo), float(hi))
                  for lo, hi in zip(fit.ci_low, fit.ci_high)] if np.allclose(fit.beta, beta) else [(None, None)] * len(beta)
            rows += [formats.Row(ctx.label, measure_table(f"{self.table}_effect_{ctx.cf.intervention}_{mode}", out), name,
                                 float(v), lo, hi, n=len(subs)) for name, v, (lo, hi) in zip(units.names, beta, ci)]
            fit_table = measure_table(f"{self.table}_fit_{ctx.cf.intervention}_{mode}", out)
            rows += [formats.Row(ctx.label, fit_table, name, float(v), n=len(subs)) for name, v in
                     (("loo-r2", fit.loo_r2), ("equal-effects-p", fit.equal_effects_p), ("interaction-p", fit.interaction_p))]
            per_unit = {m: causal_tables.unit_scores(s, units.rollouts) for m, s in ctx.scores.items()}
            k = max(1, int(round(float(ctx.cf.causal_k) * len(units.names))))
            got = causal_tables.method_rows(ctx.label, suffix, beta, per_unit, k=k, nboot=ctx.nboot,
                                            rng_seed=int(ctx.seed))
            rows += [dataclasses.replace(r, table=measure_table(r.table, out)) for r in got]
        return rows


@register_plan("datamodels")
class Datamodels(_SubsetDesign):
    """``counterfactual.plan_subsets`` random unit subsets (each unit in with probability 1/2,
    ``default_rng([seed, 46])``), fitted by least squares (``replay_estimators.least_squares``)."""

    table = "datamodels"

    def design(self, ctx: PlanContext, units: int) -> np.ndarray:
        rng = np.random.default_rng([int(ctx.seed), 46])
        return (rng.random((int(ctx.cf.plan_subsets), units)) < 0.5).astype(np.int8)

    def estimate(self, baseline, design, values):
        return E.least_squares(baseline, design, values)


@register_plan("factorial")
class Factorial(_SubsetDesign):
    """A two-level fractional factorial over the units (``replay_estimators.fractional_factorial``),
    estimated by its main-effect contrasts (``replay_estimators.factorial_contrast``)."""

    table = "factorial"

    def design(self, ctx: PlanContext, units: int) -> np.ndarray:
        return E.fractional_factorial(units)

    def estimate(self, baseline, design, values):
        return E.factorial_contrast(baseline, design, values)
