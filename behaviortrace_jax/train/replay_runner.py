"""Runs typed replay requests resumably (the engine under every replay plan, ``attribution/replay_plans.py``).

Every request's result is one atomic JSON file (``replay_request.replay_file``) holding its cache
key (``Replayer.cache_key``); a killed stage reruns only the missing or stale ones (logged with the
differing fields, ``io/cache.stale_fields``). Requests of one track run off one baseline: sorted by
their ``start_step``, each branches off the no-intervention trajectory, which is advanced only as
far as the last missing branch. A request whose intervention changes nothing in the track's own
rollouts (fixed rollouts, or regenerated stream 0, whose steps up to the first change are the
logged ones), e.g. withholding the bonus of a unit that holds none, is recorded without a replay
(``"skipped"``): its replay would be the baseline bit for bit, so its Δ is 0.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from behaviortrace_jax.io.cache import stale_fields  # the one rule of every keyed cache
from behaviortrace_jax.io.files import read_json, write_json
from behaviortrace_jax.train import interventions, replay as R
from behaviortrace_jax.io.replay_request import ReplayRequest, replay_file


def changes_nothing(rp: R.Replayer, request: ReplayRequest) -> bool:
    """Whether the request's intervention leaves every targeted step of the track's own rollouts as
    logged (weights all 1, rewards unchanged); only for fixed rollouts and regenerated stream 0."""
    if request.intervention is None or request.track.stream:
        return False
    iv, n = interventions.get_intervention(request.intervention), rp.shapes.num_rollouts
    target = rp.target_mask(request)
    for s in np.flatnonzero(target.reshape(-1, n).any(axis=1)):
        d = rp.data[s]
        eff = iv.step(d.rewards, d.base, target[s * n:(s + 1) * n])
        if eff.weights is not None and np.any(eff.weights != 1):
            return False
        if eff.rewards is not None and np.any(eff.rewards != d.rewards):
            return False
    return True


def _copy(state: R.ReplayState) -> R.ReplayState:
    return R.ReplayState(state.step, jax.tree.map(jnp.copy, state.params), jax.tree.map(jnp.copy, state.opt_state))


def run_requests(rp: R.Replayer, requests: Sequence[ReplayRequest], out_dir, *, name: str = "replay"
                 ) -> dict[ReplayRequest, dict]:
    """Runs (or reads back) every request; returns ``{request: record}``.

    A record (JSON): ``{"request"`` (its key fields), ``"measures"`` (``{str(step): {output:
    float}}``; None when skipped), ``"seconds"``, ``"seconds_per_step"``, ``"regenerated_bonuses"``,
    ``"zero_gradient_steps"``, ``"skipped"`` (None or why), ``"cache"`` (its key)``}``.
    ``name`` labels the log lines.
    """
    reqs = list(dict.fromkeys(requests))
    results: dict[ReplayRequest, dict] = {}
    todo: list[tuple[ReplayRequest, dict]] = []
    for q in reqs:
        want, path = rp.cache_key(q), replay_file(out_dir, q)
        stale = stale_fields(read_json(path) if path.exists() else None, want)
        if stale == []:
            results[q] = read_json(path)
            continue
        if stale:
            logging.info("%s: %s is stale (differs in %s); replaying it again", name, path, ", ".join(stale))
        if changes_nothing(rp, q):
            rec = {"request": q.key_fields(), "measures": None, "seconds": 0.0, "seconds_per_step": 0.0,
                   "regenerated_bonuses": None, "zero_gradient_steps": 0,
                   "skipped": "the intervention changes nothing in the track's rollouts: the replay is the baseline",
                   "cache": want}
            write_json(path, rec)
            results[q] = rec
            continue
        todo.append((q, want))
    done = 0
    for track in dict.fromkeys(q.track for q, _ in todo):
        mine = sorted((t for t in todo if t[0].track == track), key=lambda t: t[0].start_step)
        state = rp.initial_state()
        for q, want in mine:
            if q.start_step > state.step:  # advance the baseline (no intervention) to the branch point
                base = ReplayRequest(track, stop_step=q.start_step, start_step=state.step, measures=q.measures,
                                     regenerate_from=0 if track.stream else None)
                state = rp.run(base, start=state).state
            res = rp.run(q, start=_copy(state))
            rec = dict(res.record(), request=q.key_fields(), skipped=None, cache=want)
            write_json(path := replay_file(out_dir, q), rec)
            results[q] = rec
            done += 1
            logging.info("%s: %d/%d %s %s -> %s (%.1f s, %d zero-gradient steps)", name, done, len(todo), track.label,
                         q.intervention or "baseline", path.name, rec["seconds"], rec["zero_gradient_steps"])
    return results


def value(record: dict, step: int, output: str) -> float | None:
    """The float ``output`` a record measured at ``step``; None for a skipped replay (Δ = 0).
    Raises KeyError naming the step and output when the record lacks them."""
    if record.get("skipped"):
        return None
    try:
        return float(record["measures"][str(int(step))][output])
    except (KeyError, TypeError):
        raise KeyError(f"replay record {record.get('request')}: no {output!r} at step {step}") from None
