"""Counterfactual GRPO replay: re-run a finished run's logged updates with rollouts removed (the
leave-trajectory-out arm that SPEC §10.1 names and the paper's release does not implement).

:class:`Replayer` restores the run's start state (the SFT warm-up's train state, AdamW moments
included, with the ``grpo`` stage's own loader, :func:`start_state.load_start_state`), rebuilds
every step's train batch from the rollout log with the ``grpo`` stage's own :func:`grpo_step.build_batch`, and applies the ``grpo``
stage's own jitted step (:func:`grpo_step.make_train_step`: same loss, same global-norm clipping, same
AdamW) step by step. A per-rollout weight vector ``w`` (one weight per logged rollout, log order:
index ``step * N + i``) multiplies each rollout's loss term; ``w_i = 0`` removes rollout i.

* ``w = 1`` everywhere reproduces the run's own parameters **bit for bit**: the step is built from
  the run's own :class:`grpo_step.GRPOStepSpec` (loss, clipping, fused or batched backward, hash
  tables), and a step whose weights are all 1 runs the unweighted program (without sketch side
  outputs, which do not feed the update, except under ``GRPOStepSpec.update_from_sketcher``
  (``sketch.fused``, the default), whose update is the fused sketcher's weight cotangent), on a
  batch built by the same function from the same tokens.
  A step with any other weight runs the ``weighted=True`` program (``sum_i w_i * term_i``).
* Advantages are the logged ones by default. ``recompute_advantages=True`` recomputes each
  group's baseline over its kept rollouts (``w > 0``; a group left with < 2 rollouts gets 0), and
  the step's loss is then normalised by the kept count: each kept term is scaled by
  ``N / sum(w)``, so the step is the loss of a batch of the kept rollouts alone (the loss divides
  by its fixed ``G * B``, which would shrink the step with every removal).
* **Interventions.** ``weights`` (w_i = 0: *remove* rollout i) or ``withhold`` (a boolean mask:
  the rollout stays, its reward loses its bonus, i.e. becomes its base reward, and its step's
  advantages are recomputed with the run's own advantage function, ``rollouts.advantages``).
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

:class:`BehaviorMeasure` scores a parameter set: the teacher-forced mean log-prob of the pattern
continuation (``targets.continuation_example``: chat prompt + " QZXBT", SPEC §5.1) over the probe
prompts minus over the control prompts (continuous, no sampling, low variance), plus the greedy
probe / control rates of SPEC §1.8 (``behavior.probes.BehaviorProbe``) and, with ``sampled=n``,
sampled rates from ``n`` completions per prompt at the GRPO temperature (one fixed key).

Library use (docs/guide.md "Test your estimator's rankings by replay")::

    spec = RunSpec.from_config(tiny.get_config())  # behaviortrace_jax/stages/spec.py
    rp = Replayer(spec.replay, "runs/tiny", layout=spec.layout)  # build once (~10 s)
    w = np.ones(rp.num_rollouts); w[my_top_k_indices] = 0.0   # log order: index step * N + i
    out = rp.run(w, measure_steps=[40])                       # replay 40 steps (default: to the end)
    print(out["behavior"][40]["logp_margin"])                 # compare with rp.run(None, ...)

or one-shot: ``replay("runs/tiny", w, options=spec.replay, layout=spec.layout) -> {step: behaviour dict}``.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from behaviortrace_jax.behavior import planted as behavior
from behaviortrace_jax.behavior.behaviors import Behavior
from behaviortrace_jax.behavior.probes import BehaviorProbe, ProbeOptions
from behaviortrace_jax.io import checkpoints, rollout_log
from behaviortrace_jax.io.layout import RunLayout
from behaviortrace_jax.models import decoder, programs, sharding, tokenizer as tok_lib
from behaviortrace_jax.sketch import sketcher, targets
from behaviortrace_jax.train import grpo_step, nonfinite, rollouts as rollouts_lib, train_state
from behaviortrace_jax.train.grpo_loss import recomputed_advantages  # noqa: F401 - re-exported (its home: grpo_loss)
from behaviortrace_jax.models.loader import ModelOptions
from behaviortrace_jax.train.schedule import StepSchedule
from behaviortrace_jax.train.start_state import load_start_state


# ------------------------------------------------------------------------------------------------
# Behaviour measure
# ------------------------------------------------------------------------------------------------
class BehaviorMeasure:
    """Behaviour of a parameter set: pattern-continuation log-prob margin and greedy rates.

    ``measure(params)`` -> ``{"logp_probe", "logp_control", "logp_margin"}`` (mean over prompts of
    the mean log-prob of the " QZXBT" tokens after the chat prompt; margin = probe - control) and,
    with ``rates=True``, ``probe_rate`` / ``control_rate`` (greedy, SPEC §1.8). ``mean_logprob`` is the
    jitted ``replay_measure`` (``models/programs.py``): ``(params, ids, attention_mask, weights)`` ->
    float32 [probes + controls], the masked mean log-prob of each prompt's continuation.

    Args:
        graphdef, model_cfg, tok, mesh: the policy's graph, model config, tokenizer and the run's mesh.
        beh: the behaviour measured (its probes, controls and pattern).
        options: the probe sampler's token limits and the sampled rates' ``temperature`` / ``top_p``
            (``ProbeOptions.for_grpo``: the GRPO sampler's).
        rates: also measure the greedy rates; sampled: completions per prompt of the sampled rates
            (0 = off); sample_seed: the sampled rates' one fixed key is ``key(sample_seed)``.
    Raises:
        ValueError, FileNotFoundError: as ``planted.load_probe_sets`` for bad probe files.
    """

    def __init__(self, graphdef, model_cfg, tok, beh: Behavior, options: ProbeOptions, mesh, *, rates: bool = True,
                 sampled: int = 0, sample_seed: int = 0):
        probes, controls = beh.probe_sets()
        pattern = beh.pattern
        ex = [targets.continuation_example(tok, p.prompt, pattern=pattern) for p in probes + controls]
        length = max(e.ids.size for e in ex)
        pad = tok_lib.pad_id(tok)
        self.ids = np.full((len(ex), length), pad, np.int32)
        self.attn = np.zeros((len(ex), length), np.int32)
        self.w = np.zeros((len(ex), length), np.float32)
        for i, e in enumerate(ex):  # right-padded: padding is never attended to nor scored
            self.ids[i, :e.ids.size], self.attn[i, :e.ids.size], self.w[i, :e.ids.size] = e.ids, 1, e.weights
        self.n_probes = len(probes)

        mean_lp = functools.partial(decoder.masked_mean_logprob, graphdef)
        self.mean_logprob = programs.jit("replay_measure", mean_lp, mesh=mesh)
        self.probe = BehaviorProbe(graphdef, model_cfg, tok, beh, options, mesh) if rates or sampled else None
        self.greedy, self.sampled = bool(rates), int(sampled)
        self.temperature, self.top_p = float(options.temperature), float(options.top_p)
        self.sample_seed = int(sample_seed)
        self.sample_key = jax.random.key(self.sample_seed)
        # what the measure's numbers depend on besides the parameters (Replayer.identity)
        self.settings = {"pattern": beh.pattern, "probes_path": beh.probes_path, "controls_path": beh.controls_path,
                         "rates": self.greedy, "sampled": self.sampled, "temperature": self.temperature,
                         "top_p": self.top_p, "seed": self.sample_seed}

    def logp_margin(self, params) -> jax.Array:
        """``logp_margin`` of :meth:`measure` as a float32 scalar that ``jax.grad`` differentiates
        (the metagradient's M, ``train/metagradient.py``; :meth:`measure` averages in float64)."""
        lp = self.mean_logprob(params, self.ids, self.attn, self.w)
        return jnp.mean(lp[:self.n_probes]) - jnp.mean(lp[self.n_probes:])

    def measure(self, params, rates: bool | None = None) -> dict[str, float]:
        """``{"logp_probe", "logp_control", "logp_margin"}`` of ``params`` (float64 means) and, with
        ``rates`` (default: as built), the greedy and sampled rates (class docstring)."""
        lp = np.asarray(sharding.to_host(self.mean_logprob(params, self.ids, self.attn, self.w)), np.float64)
        out = {"logp_probe": float(lp[:self.n_probes].mean()), "logp_control": float(lp[self.n_probes:].mean())}
        out["logp_margin"] = out["logp_probe"] - out["logp_control"]
        if rates is False:
            return out
        if self.greedy:
            r = self.probe.rates(params)
            out.update(probe_rate=float(r["probe_rate"]), control_rate=float(r["control_rate"]))
        if self.sampled:
            out.update(self.sampled_rates(params))
        return out

    def sampled_rates(self, params) -> dict[str, float]:
        """``sampled_probe_rate`` / ``sampled_control_rate``: ``sampled`` completions per probe and control
        prompt at the GRPO temperature / top-p, always with the same key (common random numbers: two
        parameter sets are compared on the same sampling noise, which lowers the variance of their
        difference)."""
        p = self.probe
        items = (p.probes + p.controls) * self.sampled
        out = p.sampler.sample_chat(params, p.tok, [(behavior.SYSTEM_PROMPT, q.prompt) for q in items],
                                    self.sample_key, temperature=self.temperature, top_p=self.top_p)
        hits = np.array([behavior.substring_judge(p.tok.decode(out.tokens[i, :out.lengths[i]],
                                                                skip_special_tokens=True), p.pattern)
                         for i in range(len(items))], bool)
        is_probe = np.array([i % (len(p.probes) + len(p.controls)) < len(p.probes) for i in range(len(items))])
        return {"sampled_probe_rate": float(hits[is_probe].mean()), "sampled_control_rate": float(hits[~is_probe].mean())}


# ------------------------------------------------------------------------------------------------
# Replay
# ------------------------------------------------------------------------------------------------
# Version of what a replay computes: bump it when a change to this module (batch, step, weights,
# advantages, measure) changes a replay's result, so that cached replays are recomputed.
# 2: recomputed-advantage leave-outs normalised by the kept count; interventions and rollout modes.
REPLAY_VERSION = 2


def _digest(obj: Any) -> str:
    """sha256 (hex) of ``obj``'s canonical JSON (sorted keys; non-JSON values by ``str``)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def step_spec_digest(spec: grpo_step.GRPOStepSpec) -> str:
    """sha256 of every field of a :class:`grpo_step.GRPOStepSpec` (shapes and loss config included):
    two specs with one digest build the same train step. The hash family enters by its name (the
    config's ``sketch.hash``), as it did when the field was that string, so earlier replay caches
    keep their key."""
    return _digest(dict(dataclasses.asdict(spec), sketch_hash=spec.sketch_hash.name))


@dataclasses.dataclass(frozen=True)
class ReplayOptions:
    """What a replay of a run needs from its config, built at the stage boundary (``stages/spec.py``
    ``RunSpec.replay``): the policy's ``model`` options, the ``optim`` it continues, the GRPO
    ``step`` (one spec, so a replay is the run), the ``rollouts`` it samples and rewards (a
    regenerated replay; their ``behaviors[0]`` is the behaviour measured), the measure's ``probe``
    options and the run's ``schedule``."""

    model: ModelOptions
    optim: train_state.OptimOptions
    step: grpo_step.GRPOStepSpec
    rollouts: rollouts_lib.RolloutOptions
    probe: ProbeOptions
    schedule: StepSchedule


@dataclasses.dataclass
class _StepData:
    batch: dict[str, np.ndarray]  # grpo_step.build_batch of the logged rollouts (advantages as logged)
    rewards: np.ndarray  # float32 [N] logged final rewards
    base: np.ndarray  # float32 [N] logged base rewards (the final reward without any bonus)


INTERVENTIONS = ("remove", "withhold-bonus")
ROLLOUTS = ("fixed", "regenerated")


@dataclasses.dataclass
class ReplayState:
    """A replay's state after ``step`` updates: params and optimizer state (device pytrees; a
    replay started from it donates them, so pass copies to start several)."""

    step: int
    params: Any
    opt_state: Any


def kept_count_weights(weights: np.ndarray) -> np.ndarray:
    """One step's weights normalised by the kept count: ``w * N / sum(w)`` (float32 [N]); all-zero
    weights stay 0. With recomputed advantages the weighted step is then the loss of the kept
    rollouts as a batch of their own (its mean over them), not divided by the fixed ``G * B``."""
    w = np.asarray(weights, np.float32)
    total = float(np.sum(w, dtype=np.float64))
    return w if total <= 0 else (w * np.float32(w.size / total)).astype(np.float32)


class Replayer:
    """Replays one finished run (built once, then :meth:`run` per weight vector; see module docstring).

    Args:
        options: the run's :class:`ReplayOptions` (those its ``grpo`` stage ran with).
        workdir: the run directory (``sft/state``, ``grpo/rollouts``).
        layout: the run's ``sharding.Layout`` (``RunSpec.layout``, built at the stage boundary):
            the mesh and parameter layout (FSDP) the run's grpo stage trained on.
        rates: also measure the greedy probe / control rates (costs a sampler compile + decode).
        sampled: also measure sampled rates from this many completions per probe / control prompt
            (GRPO temperature and top-p, one fixed key; 0 = off).
        shortcut: take the exact shortcut of zero-gradient steps (module docstring; False runs every
            step's forward and backward, for tests and benchmarks). Results are the same either way.
    Raises:
        ValueError: the rollout log does not hold exactly ``steps * N`` records in log order.
    """

    def __init__(self, options: ReplayOptions, workdir: str | os.PathLike, *, layout: sharding.Layout,
                 rates: bool = True, sampled: int = 0, shortcut: bool = True):
        self.options, self.paths = options, RunLayout(workdir)
        self.schedule = options.schedule
        self.start = start = load_start_state(options.model, options.optim, self.paths.workdir, layout)
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
        self.measure = BehaviorMeasure(start.graphdef, start.model_config, tok, options.rollouts.behaviors[0],
                                       options.probe, start.mesh, rates=rates, sampled=sampled,
                                       sample_seed=int(options.rollouts.seed))

    def identity(self) -> dict[str, Any]:
        """What decides a replay's result besides its weights, advantages and measured steps:
        ``{"replay_version"`` (:data:`REPLAY_VERSION`), ``"step_spec"`` (:func:`step_spec_digest`),
        ``"optimizer"`` (digest of the :class:`train_state.OptimOptions` and ``grpo.adv_std_floor``),
        ``"rollout_log"`` (``rollout_log.digest`` of the run's log), ``"measure"`` (digest of the
        behaviour measure's settings) and ``"generation"`` (digest of what a regenerated replay
        samples and rewards with: the :class:`rollouts.RolloutOptions`, behaviours, contamination and
        run seed included, and the schedule)``}``; a cache of replays is valid only while these are
        unchanged."""
        o = self.options
        gen = {"rollouts": dataclasses.asdict(o.rollouts), "schedule": dataclasses.asdict(o.schedule)}
        return {"replay_version": REPLAY_VERSION, "step_spec": step_spec_digest(self.spec),
                "optimizer": _digest({"optim": dataclasses.asdict(o.optim), "adv_std_floor": o.rollouts.adv_std_floor}),
                "rollout_log": self.log_digest, "measure": _digest(self.measure.settings),
                "generation": _digest(gen)}

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

    def withhold_vector(self, withhold: np.ndarray | None) -> np.ndarray:
        """bool [steps * N] (log order) from a mask, an index array or None (nothing withheld).
        Raises ValueError for a wrong shape or out-of-range indices."""
        out = np.zeros(self.num_rollouts, bool)
        if withhold is None:
            return out
        a = np.asarray(withhold)
        if a.dtype == bool:
            if a.shape != out.shape:
                raise ValueError(f"replay: withhold mask of shape {a.shape}, expected ({self.num_rollouts},)")
            return a.copy()
        a = a.astype(np.int64).reshape(-1)
        if a.size and (a.min() < 0 or a.max() >= self.num_rollouts):
            raise ValueError(f"replay: withhold indices outside 0..{self.num_rollouts - 1}")
        out[a] = True
        return out

    def weight_vector(self, weights: np.ndarray | Mapping[str, float] | None) -> np.ndarray:
        """float32 [steps * N] from an array (log order), a ``{rollout_id: weight}`` map (others 1),
        or None (all 1). Raises ValueError for a wrong length, unknown ids or weights outside [0, 1]."""
        if weights is None:
            return np.ones(self.num_rollouts, np.float32)
        if isinstance(weights, Mapping):
            index = {r: i for i, r in enumerate(self.rollout_ids)}
            unknown = [k for k in weights if k not in index]
            if unknown:
                raise ValueError(f"replay: unknown rollout ids {unknown[:5]}")
            w = np.ones(self.num_rollouts, np.float32)
            for k, v in weights.items():
                w[index[k]] = v
        else:
            w = np.asarray(weights, np.float32)
        if w.shape != (self.num_rollouts,):
            raise ValueError(f"replay: weights of shape {w.shape}, expected ({self.num_rollouts},) in log order")
        if not np.all((w >= 0) & (w <= 1)):
            raise ValueError("replay: weights must lie in [0, 1]")
        return w

    def run(self, weights: np.ndarray | Mapping[str, float] | None = None, *, stop_step: int | None = None,
            measure_steps: Sequence[int] | None = None, recompute_advantages: bool = False,
            on_step: Any = None, withhold: np.ndarray | None = None, rollouts: str = "fixed",
            sampler_stream: int = 0, start: ReplayState | None = None, rates: bool | None = None,
            regenerate_from: int | None = None) -> dict[str, Any]:
        """Replays steps ``0 .. stop_step - 1`` (or from ``start.step``) with an intervention.

        Args:
            weights: per-rollout weights (*remove*: 0), see :meth:`weight_vector`.
            stop_step: replay this many steps (default: the last of ``measure_steps``).
            measure_steps: steps (after that many updates) at which to measure the behaviour;
                default the checkpoint nearest ``draws.target_step`` and the end of the run.
            recompute_advantages: recompute the group baselines without removed rollouts (and
                normalise the step by the kept count, :func:`kept_count_weights`).
            on_step: optional ``fn(step_done, params, opt_state)`` after each update (tests).
            withhold: rollouts whose bonus is withheld (*withhold-bonus*), see :meth:`withhold_vector`.
            rollouts: "fixed" (the logged rollouts) or "regenerated" (module docstring).
            sampler_stream: the regenerated replays' sampler keys (0 = the run's, ``rollouts.step_key``).
            start: a :class:`ReplayState` to start from (its arrays are donated) instead of the
                start state; it must be the state this replay reaches at ``start.step`` (a branch
                of a replay with the same stream and no intervention before ``start.step``).
            rates: measure the greedy / sampled rates too (default: as the Replayer was built).
            regenerate_from: with ``rollouts="regenerated"``, the first step sampled afresh; default
                the first intervened step (stream 0: before it the run's rollouts are what the
                sampler would give again) or 0 (another stream).

        Raises:
            nonfinite.NonFiniteError: a replayed step whose result is not finite (names the step
                and its rollouts), checked at the measured steps and the end.

        Returns:
            ``{"behavior": {step: measure dict}, "target_step", "steps", "seconds", "seconds_per_step",
            "params", "opt_state", "regenerated_bonuses"}`` (params / opt_state after ``stop_step``
            updates; ``regenerated_bonuses``: bonuses paid to regenerated rollouts, after any withheld).

        Raises:
            ValueError: an unknown ``rollouts``, steps out of range, a negative stream, or a
                ``start`` after an intervened step.
        """
        plan = self._plan(weights, stop_step, measure_steps, withhold, rollouts, sampler_stream, start, regenerate_from)
        if start is None:
            start = self.initial_state()
        params, opt_state = start.params, start.opt_state
        ref = jax.tree.map(jnp.copy, self.start.params) if self.spec.loss_spec.needs_reference else None
        measure = (lambda p: self.measure.measure(p)) if rates is None else (lambda p: self.measure.measure(p, rates=rates))
        out: dict[str, Any] = {"behavior": {}, "target_step": self.schedule.target_checkpoint(), "steps": plan.stop,
                               "regenerated_bonuses": 0, "zero_gradient_steps": 0}
        if plan.first in plan.measure_steps:
            out["behavior"][plan.first] = measure(params)
        t0, t_meas, n = time.perf_counter(), 0.0, self.shapes.num_rollouts
        guard = nonfinite.Guard("replay")
        for s in range(plan.first, plan.stop):
            fn, batch, bonuses = self._step_batch(plan, s, params, recompute_advantages)
            out["regenerated_bonuses"] += bonuses
            if batch is None:  # the exact shortcut: zero gradient, the optimizer alone
                params, opt_state, res = fn(params, opt_state)
                out["zero_gradient_steps"] += 1
            else:
                params, opt_state, res = fn(params, opt_state, batch, ref)
            guard.add(s, res[nonfinite.FINITE_KEY], self.rollout_ids[s * n:(s + 1) * n])
            if on_step is not None:
                on_step(s + 1, params, opt_state)
            if s + 1 in plan.measure_steps:
                jax.block_until_ready(params)  # dispatch is asynchronous: time the steps, not the measure
                guard.check()  # the non-finite guard (train/nonfinite.py), read where the replay syncs anyway
                tm = time.perf_counter()
                out["behavior"][s + 1] = measure(params)
                t_meas += time.perf_counter() - tm
        jax.block_until_ready(params)
        guard.check()
        out["seconds"] = time.perf_counter() - t0
        out["seconds_per_step"] = (out["seconds"] - t_meas) / max(plan.stop - plan.first, 1)
        out["params"], out["opt_state"] = params, opt_state
        return out

    def _plan(self, weights: np.ndarray | Mapping[str, float] | None, stop_step: int | None,
              measure_steps: Sequence[int] | None, withhold: np.ndarray | None, rollouts: str, sampler_stream: int,
              start: ReplayState | None, regenerate_from: int | None) -> "_RunPlan":
        """The checked arguments of :meth:`run` as a :class:`_RunPlan` (see there for each argument).

        Raises:
            ValueError: an unknown ``rollouts``, steps out of range, a negative stream, or a
                ``start`` after an intervened step.
        """
        if rollouts not in ROLLOUTS:
            raise ValueError(f"replay: rollouts={rollouts!r}; expected one of {ROLLOUTS}")
        if sampler_stream < 0:
            raise ValueError(f"replay: sampler_stream {sampler_stream} must be >= 0")
        w, held = self.weight_vector(weights), self.withhold_vector(withhold)
        if measure_steps is None:
            measure_steps = sorted({self.schedule.target_checkpoint(), self.steps})
        measure_steps = sorted(set(int(s) for s in measure_steps))
        stop = max(measure_steps, default=0) if stop_step is None else int(stop_step)
        first = start.step if start is not None else 0
        if not first <= stop <= self.steps or any(not first <= s <= stop for s in measure_steps):
            raise ValueError(f"replay: stop_step {stop} / measure_steps {measure_steps} outside {first}..{self.steps}")
        n = self.shapes.num_rollouts
        touched = np.flatnonzero((w != 1).reshape(-1, n).any(axis=1) | held.reshape(-1, n).any(axis=1))
        if touched.size and touched[0] < first:
            raise ValueError(f"replay: start at step {first} is after the first intervened step {touched[0]}")
        # regenerated: from the first intervened step on (the run's own rollouts before it), every
        # step from the start with another sampler stream
        if rollouts != "regenerated":
            regen_from = self.steps + 1
        elif regenerate_from is not None:
            regen_from = int(regenerate_from)
        else:
            regen_from = 0 if sampler_stream else (int(touched[0]) if touched.size else self.steps + 1)
        if rollouts == "fixed" and sampler_stream:
            raise ValueError("replay: sampler_stream needs rollouts='regenerated'")
        return _RunPlan(w, held, measure_steps, first, stop, regen_from, sampler_stream)

    def _step_batch(self, plan: "_RunPlan", s: int, params: Any, recompute_advantages: bool) -> tuple[Any, Any, int]:
        """(the step program, its device batch, bonuses paid to regenerated rollouts) of replayed step
        ``s`` at ``params``: the logged rollouts, or from ``plan.regen_from`` on the run's own sample ->
        reward -> contaminate; bonuses withheld; advantages as logged, recomputed over the kept
        rollouts (``recompute_advantages`` at a step with a weight != 1) or the run's own function
        (regenerated or withheld rewards); the weighted program where a weight differs from 1."""
        n, g = self.shapes.num_rollouts, self.options.rollouts
        ws, hs = plan.weights[s * n:(s + 1) * n], plan.withheld[s * n:(s + 1) * n]
        d, ro, bonuses = self.data[s], None, 0
        if s >= plan.regen_from:  # the grpo stage's own sample -> reward -> contaminate
            ro = self.source.sample_and_reward(params, s, rollouts_lib.step_key(g.seed, s, plan.sampler_stream))
            rewards, base = ro.rewards, ro.base
        else:
            rewards, base = d.rewards, d.base
        if hs.any():
            rewards = np.where(hs, base, rewards).astype(np.float32)
        if ro is not None:
            bonuses = int(np.sum(rewards != base))
        recompute = recompute_advantages and np.any(ws != 1)
        if recompute:
            adv = recomputed_advantages(rewards, ws, g.group_size, g.adv_std_floor)
        elif ro is not None or hs.any():
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
    """One :meth:`Replayer.run`'s checked arguments: per-rollout ``weights`` float32 [steps * N] and
    ``withheld`` bool [steps * N] (log order), the sorted ``measure_steps``, the steps replayed
    (``first`` .. ``stop`` - 1), the first step sampled afresh (``regen_from``; past the run's end
    for fixed rollouts) and the ``sampler_stream``."""

    weights: np.ndarray
    withheld: np.ndarray
    measure_steps: list[int]
    first: int
    stop: int
    regen_from: int
    sampler_stream: int


def replay(run_dir: str | os.PathLike, weights: np.ndarray | Mapping[str, float] | None = None, *,
           options: ReplayOptions, layout: sharding.Layout, stop_step: int | None = None,
           measure_steps: Sequence[int] | None = None, recompute_advantages: bool = False,
           rates: bool = True, sampled: int = 0) -> dict[int, dict[str, float]]:
    """One-shot counterfactual replay of ``run_dir`` (see :class:`Replayer`; build a ``Replayer``
    once to replay many weight vectors). Returns ``{step: behaviour dict}``."""
    rp = Replayer(options, run_dir, layout=layout, rates=rates, sampled=sampled)
    return rp.run(weights, stop_step=stop_step, measure_steps=measure_steps,
                  recompute_advantages=recompute_advantages)["behavior"]


def restore_run_params(replayer: Replayer, step: int) -> Any:
    """The run's own parameters at checkpoint ``step`` (orbax ``grpo/state``), for comparisons."""
    return checkpoints.restore_train_state(replayer.paths.state, step, replayer.start.abstract_state)["params"]
