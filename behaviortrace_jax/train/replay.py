"""Counterfactual GRPO replay: re-run a finished run's logged updates with rollouts removed (the
leave-trajectory-out arm that SPEC §10.1 names and the paper's release does not implement).

:class:`Replayer` restores the run's start state (the SFT warm-up's train state, AdamW moments
included, with the ``grpo`` stage's own loader, :func:`start_state.load_start_state`), rebuilds
every step's train batch from the rollout log with the ``grpo`` stage's own :func:`grpo_step.build_batch`, and applies the ``grpo``
stage's own jitted step (:func:`grpo_step.make_train_step`: same loss, same global-norm clipping, same
AdamW) step by step. A per-rollout weight vector ``w`` (one weight per logged rollout, log order:
index ``step * N + i``) multiplies each rollout's loss term; ``w_i = 0`` removes rollout i.

* No intervention (``w = 1`` everywhere) reproduces the run's own parameters **bit for bit**: the step is built from
  the run's own :class:`grpo_step.GRPOStepSpec` (loss, clipping, fused or batched backward, hash
  tables), and a step whose weights are all 1 runs the unweighted program (without sketch side
  outputs, which do not feed the update, except under ``GRPOStepSpec.update_from_sketcher``
  (``sketch.fused``, the default), whose update is the fused sketcher's weight cotangent), on a
  batch built by the same function from the same tokens.
  A step with any other weight runs the ``weighted=True`` program (``sum_i w_i * term_i``).
* **Requests.** A replay is a :class:`replay_request.ReplayRequest` (track, intervention and
  the slots it targets, advantages choice, steps, measures); ``Replayer.run(request)`` returns a
  :class:`ReplayResult`; :meth:`Replayer.cache_key` is its one cache key and
  ``replay_request.replay_file`` its one file.
* **Interventions** are registered objects (``train/interventions.py``): each says what it does to
  a step's per-rollout weights and rewards on the targeted slots, and whether the step's advantages
  are then recomputed with the run's own function (``rollouts.advantages``). ``remove`` weights its
  rollouts 0; ``withhold-bonus`` keeps them with their base reward.
* Advantages are the logged ones by default. ``advantages="recomputed"`` recomputes each
  group's baseline over its kept rollouts (``w > 0``; a group left with < 2 rollouts gets 0), and
  the step's loss is then normalised by the kept count: each kept term is scaled by
  ``N / sum(w)``, so the step is the loss of a batch of the kept rollouts alone (the loss divides
  by its fixed ``G * B``, which would shrink the step with every removal).
* **Rollouts.** ``rollouts="fixed"`` (default) replays the logged rollouts. ``"regenerated"``:
  from the first intervened step on, every step keeps the run's prompts and sampler key but its
  completions are sampled from the *replayed* policy with the run's own sampler, rewarded by the
  run's reward function and contaminator (the bonus rule keeps running) and trained with the run's
  step: ``train/rollouts.RolloutSource``, the ``grpo`` stage's own code path. The interventions
  act on rollout slots ``(step, index)``, whatever is sampled there. ``sampler_stream`` j > 0
  regenerates every step from step 0 with another sequence of sampler keys
  (``rollouts.step_key``: an independent sampler seed; the run is stream 0). Regenerated with
  no intervention and stream 0 reproduces the run bit for bit (tested).
* **Fixed rollouts are off-policy after the first change.** The rollouts are the logged ones, sampled by the
  *original* policy. Once a weight differs from 1, the replayed policy differs from the one that
  sampled later steps, so those steps' rollouts are no longer what this policy would have
  sampled (the ``paper`` loss has no importance ratio to correct for it). Replay therefore
  measures "the same data, minus these rollouts", not "a run in which these rollouts never
  happened"; no sampling is done (``rollouts="regenerated"`` is that run).

:class:`ReplayResult` holds every requested measure (registered objects, ``train/measures.py``:
the teacher-forced pattern log-prob margin and its probe and control halves, the greedy and the
sampled rates) at every measure step.

Library use (docs/guides/extending.md, "Test your estimator's rankings by replay")::

    spec = RunSpec.from_config(tiny.get_config())  # behaviortrace_jax/stages/spec.py
    rp = Replayer(spec.replay, "runs/tiny", layout=spec.layout)  # build once (~10 s)
    req = ReplayRequest(intervention="remove", target=my_top_k_indices,  # log order: step * N + i
                        measure_steps=(40,))                         # replay 40 steps
    print(rp.run(req).value(40, "logp_margin"))   # compare with rp.run(ReplayRequest(measure_steps=(40,)))

or one-shot: ``replay("runs/tiny", req, options=spec.replay, layout=spec.layout) -> {step: floats}``.
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from behaviortrace_jax.train import measures as measures_lib
from behaviortrace_jax.train.measures import DEFAULT_MEASURES
from behaviortrace_jax.io import checkpoints, rollout_log
from behaviortrace_jax.io.layout import RunLayout
from behaviortrace_jax.models import sharding, tokenizer as tok_lib
from behaviortrace_jax.sketch import sketcher
from behaviortrace_jax.io import replay_request
from behaviortrace_jax.train import grpo_step, interventions, nonfinite, rollouts as rollouts_lib
from behaviortrace_jax.io.replay_request import ReplayRequest
from behaviortrace_jax.train.grpo_loss import recomputed_advantages  # noqa: F401 - re-exported (its home: grpo_loss)
from behaviortrace_jax.train.replay_types import (  # noqa: F401 - re-exported (their home: replay_types)
    ReplayOptions, ReplayResult, ReplayState, kept_count_weights, step_spec_digest)
from behaviortrace_jax.train.start_state import load_start_state


# ------------------------------------------------------------------------------------------------
# Replay
# ------------------------------------------------------------------------------------------------
# Version of what a replay computes: bump it when a change to this module (batch, step, weights,
# advantages, measure) changes a replay's result, so that cached replays are recomputed.
# 2: recomputed-advantage leave-outs normalised by the kept count; interventions and rollout modes.
# 3: typed requests (replay_request.py), registered interventions and measures; the exact shortcut.
REPLAY_VERSION = 3


@dataclasses.dataclass
class _StepData:
    batch: dict[str, np.ndarray]  # grpo_step.build_batch of the logged rollouts (advantages as logged)
    rewards: np.ndarray  # float32 [N] logged final rewards
    base: np.ndarray  # float32 [N] logged base rewards (the final reward without any bonus)


ROLLOUTS = replay_request.ROLLOUTS


class Replayer:
    """Replays one finished run (built once, then :meth:`run` per request; see module docstring).

    Args:
        options: the run's :class:`ReplayOptions` (those its ``grpo`` stage ran with).
        workdir: the run directory (``sft/state``, ``grpo/rollouts``).
        layout: the run's ``sharding.Layout`` (``RunSpec.layout``, built at the stage boundary):
            the mesh and parameter layout (FSDP) the run's grpo stage trained on.
        measures: the registered measures (``train/measures.py``) its replays can record, in order
            (the greedy and sampled rates cost a sampler compile + decode each time).
        measure_settings: ``{measure name: settings}`` (e.g. ``{"sampled_rate": {"samples": 4}}``).
        shortcut: take the exact shortcut of zero-gradient steps (module docstring; False runs every
            step's forward and backward, for tests and benchmarks). Results are the same either way.
    Raises:
        ValueError: the rollout log does not hold exactly ``steps * N`` records in log order.
    """

    def __init__(self, options: ReplayOptions, workdir: str | os.PathLike, *, layout: sharding.Layout,
                 measures: Sequence[str] = DEFAULT_MEASURES, measure_settings: Mapping[str, Mapping[str, Any]] | None = None,
                 shortcut: bool = True):
        self.options, self.paths = options, RunLayout(workdir)
        self.schedule = options.schedule
        self.start = start = load_start_state(options.model, options.optim, self.paths.workdir, layout,
                                                  continue_sft_moments=options.continue_sft_moments)
        self.shapes = options.step.shapes
        n, steps = self.shapes.num_rollouts, options.schedule.steps
        self.num_rollouts, self.steps = n * steps, steps
        tok = start.tokenizer
        mask_eos, pad = tok_lib.mask_eos_ids(tok, options.rollouts.mask_eos), tok_lib.pad_id(tok)
        records = list(rollout_log.read_rollouts(self.paths.rollouts))
        ids = [r.rollout_id for r in records]
        if ids != [rollout_log.rollout_id(s, i) for s in range(steps) for i in range(n)]:
            raise ValueError(f"{self.paths.rollouts}: {len(ids)} records; replay needs the {steps * n} rollouts of a "
                             f"complete run in log order")
        self.rollout_ids = ids
        self.log_digest = rollout_log.digest(self.paths.rollouts)
        self.data: list[_StepData] = []
        t = self.shapes.completion_len
        for s in range(steps):
            rec = records[s * n:(s + 1) * n]
            comp = np.full((n, t), pad, np.int32)
            for i, r in enumerate(rec):
                comp[i, :len(r.completion_token_ids)] = r.completion_token_ids
            lengths = np.array([len(r.completion_token_ids) for r in rec], np.int32)
            adv = np.array([r.advantage for r in rec], np.float32)
            batch = grpo_step.build_batch([r.prompt_token_ids for r in rec], comp, lengths, adv, mask_eos, self.shapes, pad,
                                          vocab_size=start.model_config.vocab_size)
            batch["loss_mask"][nonfinite.dropped_rows(rec)] = 0.0  # rollouts a "skip" run dropped (train/nonfinite.py)
            self.data.append(_StepData(batch, np.array([r.reward for r in rec], np.float32),
                                       np.array([r.base_reward for r in rec], np.float32)))
        # The grpo stage's own step (one spec, so a replay is the run): without sketch side outputs,
        # except where the update is the per-rollout sketcher's gradient sum (update_from_sketcher).
        self.spec = options.step
        order = sketcher.hf_param_order(start.model_config) if self.spec.update_from_sketcher else None
        kw = dict(order=order, mesh=start.mesh, param_shardings=start.param_shardings, opt_shardings=start.opt_shardings)
        self.step_fn = grpo_step.make_train_step(start.graphdef, start.abstract_params, start.optimizer, self.spec, **kw)
        self.weighted_step_fn = grpo_step.make_train_step(start.graphdef, start.abstract_params, start.optimizer,
                                                          self.spec, weighted=True, **kw)
        # The exact shortcut (issue 46 item 5): a step whose every weight x advantage is 0, under a
        # loss that declares a zero gradient there (``grpo_loss.Loss.zero_at_zero_advantage``), runs
        # the optimizer on zero gradients instead of the forward and backward, bit for bit the same.
        self.shortcut = bool(shortcut) and self.spec.loss_spec.zero_gradient_at_zero_advantage(self.spec.loss_cfg)
        self.zero_step_fn = grpo_step.make_zero_gradient_step(start.optimizer, self.spec, mesh=start.mesh,
                                                              param_shardings=start.param_shardings,
                                                              opt_shardings=start.opt_shardings)
        self.data_sharding = sharding.data_sharding(start.mesh)
        self._source = None  # the regenerated replays' RolloutSource, built on first use
        env = measures_lib.MeasureEnv(start.graphdef, start.model_config, tok, options.rollouts.behaviors[0],
                                      options.probe, start.mesh, int(options.rollouts.seed))
        self.measures = measures_lib.MeasureSet(env, measures, measure_settings)

    def identity(self) -> dict[str, Any]:
        """What decides a replay's result besides its weights, advantages and measured steps:
        ``{"replay_version"`` (:data:`REPLAY_VERSION`), ``"step_spec"`` (:func:`step_spec_digest`),
        ``"optimizer"`` (digest of the :class:`train_state.OptimOptions`, ``grpo.adv_std_floor`` and a fresh
        AdamW start, ``grpo.continue_sft_moments = False``),
        ``"rollout_log"`` (``rollout_log.digest`` of the run's log) and ``"generation"`` (digest of what a regenerated replay
        samples and rewards with: the :class:`rollouts.RolloutOptions`, behaviours, contamination and
        run seed included, and the schedule)``}``; a cache of replays is valid only while these are
        unchanged. The measures' identities enter each request's key (:meth:`cache_key`)."""
        o = self.options
        gen = {"rollouts": dataclasses.asdict(o.rollouts), "schedule": dataclasses.asdict(o.schedule)}
        return {"replay_version": REPLAY_VERSION, "step_spec": step_spec_digest(self.spec),
                "optimizer": replay_request.digest({"optim": dataclasses.asdict(o.optim), "adv_std_floor": o.rollouts.adv_std_floor,
                                                    **({} if o.continue_sft_moments else {"sft_moments": False})}),
                "rollout_log": self.log_digest, "generation": replay_request.digest(gen)}

    @property
    def source(self) -> rollouts_lib.RolloutSource:
        """The regenerated replays' :class:`rollouts.RolloutSource` (the run's sampler, reward and
        contaminators, recording nothing), built on first use."""
        if self._source is None:
            st = self.start
            self._source = rollouts_lib.RolloutSource(self.options.rollouts, st.graphdef, st.model_config, st.tokenizer,
                                                      st.mesh, self.paths.sft_hf, self.shapes)
        return self._source

    def initial_state(self) -> ReplayState:
        """The run's start state (copies: a replay donates its inputs) at step 0."""
        return ReplayState(0, jax.tree.map(jnp.copy, self.start.params), jax.tree.map(jnp.copy, self.start.opt_state))

    def cache_key(self, request: ReplayRequest) -> dict:
        """The request's one cache key (``replay_request.cache_key``): this replayer's
        :meth:`identity`, the request, its intervention's identity and its measures' identities."""
        iv = None if request.intervention is None else interventions.get_intervention(request.intervention).identity()
        return replay_request.cache_key(request, self.identity(), iv, [self.measures[m].identity()
                                                                        for m in request.measures])

    def target_mask(self, request: ReplayRequest) -> np.ndarray:
        """bool [steps * N] (log order) of the request's targeted slots. Raises ValueError for
        indices past the run's rollouts."""
        out = np.zeros(self.num_rollouts, bool)
        if request.target and request.target[-1] >= self.num_rollouts:
            raise ValueError(f"replay: target indices outside 0..{self.num_rollouts - 1}")
        out[list(request.target)] = True
        return out

    def run(self, request: ReplayRequest, *, start: ReplayState | None = None, on_step: Any = None) -> ReplayResult:
        """Replays ``request`` (a :class:`replay_request.ReplayRequest`) and measures it.

        Args:
            request: the replay (track, intervention and its target, advantages, steps, measures).
            start: the no-intervention state at ``request.start_step`` (its arrays are donated; a
                branch of a baseline with the same track). None: from the start state, advanced
                without intervention to ``request.start_step`` first.
            on_step: optional ``fn(step_done, params, opt_state)`` after each update (tests).

        Returns:
            a :class:`ReplayResult` (measures per step, timings, shortcut count, final state).

        Raises:
            ValueError: steps past the run's end, a start state at another step, a target before
                ``start_step`` or outside the run, an unregistered intervention or unconfigured measure.
            nonfinite.NonFiniteError: a replayed step whose result is not finite (names the step
                and its rollouts), checked at the measured steps and the end.
        """
        plan = self._plan(request)
        if start is None:
            start = self.initial_state()
            if request.start_step:
                base = dataclasses.replace(request, intervention=None, target=(), measure_steps=(), start_step=0,
                                           stop_step=request.start_step, advantages="logged",
                                           regenerate_from=0 if request.track.stream else None)
                start = self.run(base).state
        if start.step != request.start_step:
            raise ValueError(f"replay: start state at step {start.step}, request.start_step {request.start_step}")
        params, opt_state = start.params, start.opt_state
        ref = jax.tree.map(jnp.copy, self.start.params) if self.spec.loss_spec.needs_reference else None
        names = request.measures
        for m in names:
            self.measures[m]  # noqa: B018 - raises ValueError for a measure this replayer does not record
        measure = lambda p: self.measures.measure(p, names)  # noqa: E731
        out = ReplayResult(request, {}, 0.0, 0.0, 0, 0, None)
        if plan.first in request.measure_steps:
            out.measures[plan.first] = measure(params)
        t0, t_meas, n = time.perf_counter(), 0.0, self.shapes.num_rollouts
        guard = nonfinite.Guard("replay")
        for s in range(plan.first, plan.stop):
            fn, batch, bonuses = self._step_batch(plan, s, params)
            out.regenerated_bonuses += bonuses
            if batch is None:  # the exact shortcut: zero gradient, the optimizer alone
                params, opt_state, res = fn(params, opt_state)
                out.zero_gradient_steps += 1
            else:
                params, opt_state, res = fn(params, opt_state, batch, ref)
            guard.add(s, res[nonfinite.FINITE_KEY], self.rollout_ids[s * n:(s + 1) * n])
            if on_step is not None:
                on_step(s + 1, params, opt_state)
            if s + 1 in request.measure_steps:
                jax.block_until_ready(params)  # dispatch is asynchronous: time the steps, not the measure
                guard.check()  # the non-finite guard (train/nonfinite.py), read where the replay syncs anyway
                tm = time.perf_counter()
                out.measures[s + 1] = measure(params)
                t_meas += time.perf_counter() - tm
        jax.block_until_ready(params)
        guard.check()
        out.seconds = time.perf_counter() - t0
        out.seconds_per_step = (out.seconds - t_meas) / max(plan.stop - plan.first, 1)
        out.state = ReplayState(plan.stop, params, opt_state)
        return out

    def _plan(self, request: ReplayRequest) -> "_RunPlan":
        """The request checked against the run: the intervention, the target mask, the steps and
        the first regenerated step. Raises ValueError as :meth:`run`."""
        iv = None if request.intervention is None else interventions.get_intervention(request.intervention)
        target = self.target_mask(request)
        first, stop = request.start_step, request.stop
        if stop > self.steps:
            raise ValueError(f"replay: stop_step {stop} / measure_steps {list(request.measure_steps)} outside "
                             f"{first}..{self.steps}")
        n = self.shapes.num_rollouts
        touched = np.flatnonzero(target.reshape(-1, n).any(axis=1))
        if touched.size and touched[0] < first:
            raise ValueError(f"replay: start at step {first} is after the first intervened step {touched[0]}")
        # regenerated: from the first intervened step on (the run's own rollouts before it), every
        # step from the start with another sampler stream
        track = request.track
        if track.rollouts != "regenerated":
            regen_from = self.steps + 1
        elif request.regenerate_from is not None:
            regen_from = int(request.regenerate_from)
        else:
            regen_from = 0 if track.stream else (int(touched[0]) if touched.size else self.steps + 1)
        return _RunPlan(iv, target, request.advantages == "recomputed", first, stop, regen_from, track.stream)

    def _step_batch(self, plan: "_RunPlan", s: int, params: Any) -> tuple[Any, Any, int]:
        """(the step program, its device batch, bonuses paid to regenerated rollouts) of replayed step
        ``s`` at ``params``: the logged rollouts, or from ``plan.regen_from`` on the run's own sample ->
        reward -> contaminate; the intervention's :class:`interventions.StepEffect` on the targeted
        slots; advantages as logged, recomputed over the kept rollouts (``plan.recompute`` at a step
        with a weight != 1) or with the run's own function (regenerated rollouts, or an intervention
        that declares ``recomputes_advantages``); the weighted program where a weight differs from 1.
        A step whose gradient is exactly zero (:attr:`shortcut`, ``grpo_step.zero_gradient_step_applies``)
        gives ``(zero_step_fn, None, bonuses)``: the optimizer on zero gradients, no batch."""
        n, g = self.shapes.num_rollouts, self.options.rollouts
        hs = plan.target[s * n:(s + 1) * n]
        d, ro, bonuses = self.data[s], None, 0
        if s >= plan.regen_from:  # the grpo stage's own sample -> reward -> contaminate
            ro = self.source.sample_and_reward(params, s, rollouts_lib.step_key(g.seed, s, plan.sampler_stream))
            rewards, base = ro.rewards, ro.base
        else:
            rewards, base = d.rewards, d.base
        ws, rerun = np.ones(n, np.float32), ro is not None
        if hs.any():
            eff = plan.intervention.step(rewards, base, hs)
            if eff.weights is not None:
                ws = np.asarray(eff.weights, np.float32)
            if eff.rewards is not None:
                rewards = np.asarray(eff.rewards, np.float32)
            rerun = rerun or plan.intervention.recomputes_advantages
        if ro is not None:
            bonuses = int(np.sum(rewards != base))
        recompute = plan.recompute and np.any(ws != 1)
        if recompute:
            adv = recomputed_advantages(rewards, ws, g.group_size, g.adv_std_floor)
        elif rerun:
            adv = rollouts_lib.advantages(rewards, g)  # the run's own advantage function
        else:
            adv = None  # as logged
        batch = self.source.batch(ro, adv) if ro is not None else dict(d.batch)
        if adv is not None and ro is None:
            batch["advantages"] = adv
        if np.all(ws == 1):
            fn = self.step_fn
        else:
            fn, batch["weights"] = self.weighted_step_fn, kept_count_weights(ws) if recompute else ws
        if self.shortcut and grpo_step.zero_gradient_step_applies(self.spec, batch["advantages"], batch.get("weights")):
            return self.zero_step_fn, None, bonuses
        return fn, jax.device_put(batch, self.data_sharding), bonuses


@dataclasses.dataclass(frozen=True)
class _RunPlan:
    """One :meth:`Replayer.run`'s checked request: the ``intervention`` (None: none), the ``target``
    mask bool [steps * N] (log order), ``recompute`` (advantages "recomputed"), the steps replayed
    (``first`` .. ``stop`` - 1), the first step sampled afresh (``regen_from``; past the run's end
    for fixed rollouts) and the ``sampler_stream``."""

    intervention: interventions.Intervention | None
    target: np.ndarray
    recompute: bool
    first: int
    stop: int
    regen_from: int
    sampler_stream: int


def replay(run_dir: str | os.PathLike, request: ReplayRequest, *, options: ReplayOptions, layout: sharding.Layout,
           measures: Sequence[str] = DEFAULT_MEASURES) -> dict[int, dict[str, float]]:
    """One-shot counterfactual replay of ``run_dir`` (see :class:`Replayer`; build a ``Replayer``
    once to replay many requests). Returns ``{step: {measure output: float}}``."""
    rp = Replayer(options, run_dir, layout=layout, measures=measures)
    return rp.run(request).measures


def restore_run_params(replayer: Replayer, step: int) -> Any:
    """The run's own parameters at checkpoint ``step`` (orbax ``grpo/state``), for comparisons."""
    return checkpoints.restore_train_state(replayer.paths.state, step, replayer.start.abstract_state)["params"]
