"""The measured causal ground truth: single-unit replays of the contamination window (issue 31
item 3), for both interventions and both rollout modes of :class:`replay.Replayer`.

Design: **one replay per unit** (not a random-subset least-squares design). A unit is one window
step (``counterfactual.causal_units = "steps"``, the default: ``early_step_cutoff`` units) or one
GRPO group of a window step (``"groups"``: B per step). Each unit's replay *branches* off the
no-intervention trajectory at the unit's first step: the states before it are the baseline's, so
the branch replays only ``at - step`` steps (``at`` = the measure step). One *track* = one
baseline trajectory: ``fixed`` (the logged rollouts; = the run) and, for regenerated rollouts,
one per sampler stream j (``counterfactual.causal_streams``; stream 0 is the run's sampler keys,
whose baseline is the run itself, so it branches off the logged trajectory; stream j > 0
regenerates every step from step 0 with its own keys). A track runs the baseline forward once and
branches each unit's replays (one per intervention) off it. Cost per track and intervention:
``sum_u (at - step_u) = at (at + 1) / 2`` steps for step units (820 at tiny scale, vs 1,600 for
replays from step 0, and vs >= U + 1 replays of ``at`` steps each, 41 x 40, for a datamodels fit
that is then only a linear model of the same numbers); plus two "withhold all" replays per track
(every ground-truth bonus; every bonus of the window).

Resumable: every replay's result is one atomic JSON file ``counterfactual/causal/<key>.json``
with its cache key (:func:`cache_key`: the replay's ``Replayer.identity()``, the unit's rollouts,
intervention, rollouts, stream, measure step, advantages choice); a killed stage reruns only the
missing or stale ones (the baseline is advanced again only as far as the last missing branch).
A withhold-bonus branch whose unit holds no bonus in the track's own rollouts changes nothing
(fixed rollouts, or regenerated stream 0, whose unit step is the logged one): it is recorded as
Δ = 0 without a replay (``"skipped"`` in its file).
"""
from __future__ import annotations

import dataclasses
import urllib.parse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from behaviortrace_jax.io.cache import stale_fields  # the one rule of every keyed cache
from behaviortrace_jax.io.files import read_json, write_json
from behaviortrace_jax.train import replay as R
from behaviortrace_jax.train.schedule import StepSchedule

UNITS = ("steps", "groups")
REGENERATED = ("units", "label")  # counterfactual.causal_regenerated: what the regenerated tracks replay
ALL_GT, ALL_BONUSES = "withhold-all-gt", "withhold-all-bonuses"


@dataclasses.dataclass(frozen=True)
class Units:
    """The causal units: ``names`` (``s<step>`` or ``s<step>g<group>``), ``rollouts`` (int64 index
    arrays, log order), ``steps`` (each unit's step)."""

    names: list[str]
    rollouts: list[np.ndarray]
    steps: list[int]


def causal_units(schedule: StepSchedule, group_size: int, n_per_step: int, kind: str) -> Units:
    """The window's units (steps < ``schedule.early_step_cutoff``, capped at ``schedule.steps``)
    of ``kind`` (``counterfactual.causal_units``); a group is ``group_size`` (G) rollouts. Raises
    ValueError naming the key otherwise."""
    if kind not in UNITS:
        raise ValueError(f"counterfactual.causal_units={kind!r}; expected one of {UNITS}")
    cut = schedule.window_steps()
    g = int(group_size)
    names, rollouts, steps = [], [], []
    for s in range(cut):
        if kind == "steps":
            names.append(f"s{s}")
            rollouts.append(np.arange(s * n_per_step, (s + 1) * n_per_step, dtype=np.int64))
            steps.append(s)
        else:
            for j in range(n_per_step // g):
                names.append(f"s{s}g{j}")
                rollouts.append(np.arange(s * n_per_step + j * g, s * n_per_step + (j + 1) * g, dtype=np.int64))
                steps.append(s)
    return Units(names, rollouts, steps)


def tracks(rollouts: str, streams: int) -> list[tuple[str, int]]:
    """The ``(rollouts, stream)`` tracks: ``("fixed", 0)`` always, and with ``rollouts =
    "regenerated"`` also ``("regenerated", j)`` for j < ``streams``. Raises ValueError for an
    unknown mode or ``streams < 1``."""
    if rollouts not in R.ROLLOUTS:
        raise ValueError(f"counterfactual.rollouts={rollouts!r}; expected one of {R.ROLLOUTS}")
    if rollouts == "regenerated" and streams < 1:
        raise ValueError(f"counterfactual.causal_streams={streams}: need >= 1")
    out = [("fixed", 0)]
    if rollouts == "regenerated":
        out += [("regenerated", j) for j in range(int(streams))]
    return out


def cache_key(identity: dict, unit: np.ndarray | None, intervention: str | None, rollouts: str, stream: int, at: int,
              recompute: bool) -> dict:
    """A causal replay's cache key (JSON types): ``identity`` plus the intervened rollouts (None
    for the baseline), intervention, rollouts, stream, measure step and advantages choice."""
    return dict(identity, unit=None if unit is None else [int(i) for i in unit], intervention=intervention,
                rollouts=rollouts, stream=int(stream), measure_step=int(at), recompute_advantages=bool(recompute))


def replay_file(out_dir, key: str):
    """``out_dir/<key>.json``, the key percent-encoded."""
    return out_dir / f"{urllib.parse.quote(key, safe='-_.')}.json"


def _copy(state: R.ReplayState) -> R.ReplayState:
    return R.ReplayState(state.step, jax.tree.map(jnp.copy, state.params), jax.tree.map(jnp.copy, state.opt_state))


def _kwargs(intervention: str, rollouts_idx: np.ndarray, n: int, recompute: bool) -> dict[str, Any]:
    if intervention == "remove":
        w = np.ones(n, np.float32)
        w[rollouts_idx] = 0.0
        return {"weights": w, "recompute_advantages": recompute}
    if intervention == "withhold-bonus":
        return {"withhold": np.asarray(rollouts_idx, np.int64)}
    raise ValueError(f"counterfactual.intervention={intervention!r}; expected one of {R.INTERVENTIONS}")


def run_causal(rp, out_dir, *, units: Units, gt: np.ndarray, at: int,
               rollouts: str, streams: int, recompute: bool, regenerated: str = "units") -> dict[str, dict]:
    """Runs (or reads back) every causal replay; returns ``{file key: record}``.

    Keys: ``<track>__base`` (the baseline), ``<track>__<unit>__<intervention>`` and
    ``<track>__withhold-all-gt`` / ``__withhold-all-bonuses``; ``<track>`` = ``fixed`` or
    ``regenerated<j>``. A record: ``{"key", "value" (logp margin at ``at``), "seconds",
    "regenerated_bonuses", "skipped", "cache"}``.

    Args:
        rp: the run's :class:`replay.Replayer` (its ``schedule`` gives the window).
        units: :func:`causal_units`; gt: int64 indices of the ground-truth rollouts (log order).
        at: the measure step (the replays stop there); rollouts / streams: :func:`tracks`.
        recompute: the remove intervention's advantages (``counterfactual.recompute_advantages``).
        regenerated: ``counterfactual.causal_regenerated``: "units" (every unit's branches on every
            regenerated track, as on the fixed one) or "label" (regenerated tracks replay only their
            baseline and the two withhold-all replays: the label's check with a CI over streams, at
            ~3 x ``at`` regenerated steps per stream instead of ~``at**2``).
    Raises:
        ValueError: ``regenerated`` not in :data:`REGENERATED` (naming the config key).
    """
    if regenerated not in REGENERATED:
        raise ValueError(f"counterfactual.causal_regenerated={regenerated!r}; expected one of {REGENERATED}")
    out_dir.mkdir(parents=True, exist_ok=True)
    identity, n = rp.identity(), rp.num_rollouts
    per_step = rp.shapes.num_rollouts
    window = np.arange(min(int(rp.schedule.early_step_cutoff), at) * per_step, dtype=np.int64)
    logged_bonus = np.concatenate([d.rewards != d.base for d in rp.data])  # bool [steps * N]
    results: dict[str, dict] = {}
    for mode, stream in tracks(rollouts, streams):
        track = "fixed" if mode == "fixed" else f"regenerated{stream}"
        # stream 0's regenerated baseline is the run (bit for bit), so it branches off the logged states
        base_mode = "fixed" if stream == 0 else mode
        todo: list[tuple[str, dict, dict, int]] = []  # (file key, cache key, replay kwargs, branch step)
        jobs = [(f"{track}__base", None, None, 0)]
        if mode == "fixed" or regenerated == "units":
            jobs += [(f"{track}__{name}__{iv}", u, iv, st)
                     for name, u, st in zip(units.names, units.rollouts, units.steps) for iv in R.INTERVENTIONS]
        jobs += [(f"{track}__{ALL_GT}", gt[gt < window.size], "withhold-bonus", 0),
                 (f"{track}__{ALL_BONUSES}", window, "withhold-bonus", 0)]
        for key, u, iv, st in jobs:
            want = cache_key(identity, u, iv, mode, stream, at, recompute and iv == "remove")
            path = replay_file(out_dir, key)
            stale = stale_fields(read_json(path) if path.exists() else None, want)
            if stale == []:
                results[key] = read_json(path)
                continue
            if stale:
                logging.info("causal: %s is stale (differs in %s); replaying it again", path.name, ", ".join(stale))
            kw = {} if u is None else _kwargs(iv, u, n, recompute)
            if iv == "withhold-bonus" and stream == 0 and not logged_bonus[u].any():
                rec = {"key": key, "value": None, "skipped": "no bonus in the unit: the replay is the baseline",
                       "seconds": 0.0, "regenerated_bonuses": None, "cache": want}
                write_json(path, rec)
                results[key] = rec
                continue
            todo.append((key, want, kw, st))
        if not todo:
            continue
        # the baseline forward, branching each missing replay off it at its unit's step
        todo.sort(key=lambda t: t[3])
        state = rp.initial_state()
        common = dict(measure_steps=[at], rollouts=mode, sampler_stream=stream, rates=False)
        for key, want, kw, st in todo:
            if st > state.step:  # advance the baseline (no intervention) to the branch point
                adv = rp.run(None, start=state, stop_step=st, measure_steps=[], rollouts=base_mode,
                             sampler_stream=stream, rates=False, regenerate_from=0 if stream else None)
                state = R.ReplayState(st, adv["params"], adv["opt_state"])
            res = rp.run(start=_copy(state), **common, **kw)
            rec = {"key": key, "value": res["behavior"][at]["logp_margin"], "skipped": None,
                   "seconds": res["seconds"], "regenerated_bonuses": res["regenerated_bonuses"], "cache": want}
            write_json(path := replay_file(out_dir, key), rec)
            results[key] = rec
            logging.info("causal: %s -> %.4f (%.1f s)", path.name, rec["value"], rec["seconds"])
    return results


def effects(results: dict[str, dict], units: Units, rollouts: str, streams: int,
            regenerated: str = "units") -> dict[tuple[str, str], np.ndarray]:
    """``{(intervention, rollouts): float64 [tracks of that mode, U]}``: Δ_u = baseline - replay
    per track (a skipped replay: 0). With ``regenerated = "label"`` only the fixed track has unit
    effects."""
    out: dict[tuple[str, str], list] = {}
    for mode, stream in tracks(rollouts, streams):
        if mode != "fixed" and regenerated == "label":
            continue
        track = "fixed" if mode == "fixed" else f"regenerated{stream}"
        base = results[f"{track}__base"]["value"]
        for iv in R.INTERVENTIONS:
            row = []
            for name in units.names:
                v = results[f"{track}__{name}__{iv}"]["value"]
                row.append(0.0 if v is None else base - v)
            out.setdefault((iv, mode), []).append(row)
    return {k: np.array(v, np.float64) for k, v in out.items()}


def label_deltas(results: dict[str, dict], rollouts: str, streams: int) -> dict[tuple[str, str], np.ndarray]:
    """``{(rollouts, withhold-all-gt | withhold-all-bonuses): float64 [tracks]}`` Δs."""
    out: dict[tuple[str, str], list] = {}
    for mode, stream in tracks(rollouts, streams):
        track = "fixed" if mode == "fixed" else f"regenerated{stream}"
        base = results[f"{track}__base"]["value"]
        for name in (ALL_GT, ALL_BONUSES):
            v = results[f"{track}__{name}"]["value"]
            out.setdefault((mode, name), []).append(0.0 if v is None else base - v)
    return {k: np.array(v, np.float64) for k, v in out.items()}
