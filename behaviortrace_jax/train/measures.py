"""Behaviour measures as registered objects (issue 46 item 2): what a replay records at a step.

A measure maps a parameter set (and the behaviour's probe and control prompts, and fixed sampling
keys where it samples) to named floats. Every replay records every configured measure
(``counterfactual.measures``); the causal and counterfactual tables read one of them by name
(``counterfactual.table_measure``), and the metagradient differentiates a measure that declares
``differentiable`` (its :meth:`Measure.scalar` is a float32 scalar that ``jax.grad`` takes).

Registered here (names are also the keys of the floats they give, except the rates):

* ``logp_margin`` (differentiable): teacher-forced mean log-prob of the pattern continuation
  (``targets.continuation_example``: chat prompt + " QZXBT", SPEC §5.1) over the probe prompts minus
  over the control prompts; float64 means of the float32 per-prompt values.
* ``logp_probe`` / ``logp_control``: the two means alone (one forward, shared with the margin).
* ``greedy_rate`` -> ``probe_rate``, ``control_rate``: greedy probe / control rates (SPEC §1.8,
  ``behavior.probes.BehaviorProbe``).
* ``sampled_rate`` -> ``sampled_probe_rate``, ``sampled_control_rate``: ``samples`` completions
  per probe and control prompt at the GRPO temperature / top-p, always with one fixed key
  (``key(seed)``: common random numbers across branches, so their difference has less variance).

**Probe and leakage measures.** Each is a thin wrapper over the pure functions of
``behavior/probe_measures.py`` (which give the formulas, the standard errors and the key
scheme); none computes a number of its own:

* ``probe-rate``: the sampled probe rate (SPEC §1.1 substring judge) with its standard errors,
  ``samples`` completions per probe prompt at the GRPO sampler's temperature / top-p, sample j of
  every prompt under ``fold_in(fold_in(fold_in(key(seed), stream), 0), j)``. Outputs
  ``probe_rate``, ``probe_rate_se`` (the measure's own sampling error), ``probe_rate_se_binomial``,
  ``probe_rate_se_cluster``, ``probe_rate_prompts``, ``probe_rate_samples_per_prompt``.
  (Its ``probe_rate`` is the float ``greedy_rate`` also gives: configure one of the two.)
* ``probe-pair`` (differentiable): SPEC §5.4's minimal-pair log-ratio on the trigger's pairs
  (``probe_pairs``), nats: ``probe_pair_logratio``, ``probe_pair_logratio_se_items``,
  ``probe_pair_logp_pos``, ``probe_pair_logp_neg``, ``probe_pair_cells``; :meth:`ProbePair.scalar`
  is ``pair_log_ratio`` (float32, ``jax.grad`` takes it).
* ``leakage``: the same two on the control prompts, reported beside the probe measures and never
  subtracted from them: ``leakage_rate*`` (key ``fold_in(fold_in(key(seed), stream), 1)``) and
  ``leakage_pair_*`` (``control_pairs``).

Settings (JSON, in every replay's cache key): ``probe-rate`` and ``leakage`` take ``samples``
(completions per prompt, >= 1; default 4), ``seed`` (default the run seed) and ``stream`` (default
0): the branches of one sampler stream share a key (their difference is paired), streams take
independent keys (``behavior/probe_measures.py``, "Which key where"). ``temperature`` and ``top_p``
default to the GRPO sampler's.

**Adding a measure** is one registration::

    @register_measure("my_measure", version=1)
    class MyMeasure(Measure):
        def __call__(self, params, memo):
            lp = self.env.pattern_logprobs(params, memo)   # shared helpers of MeasureEnv
            return {"my_measure": float(...)}

``settings`` (a JSON dict given at construction, e.g. ``{"samples": 4}``) and the class's
``version`` enter every replay's cache key through :meth:`Measure.identity`, together with the
behaviour's pattern and probe files: change what a measure computes and bump its version, and
cached replays recompute. ``memo`` is a dict fresh per measured parameter set, shared by the
measures of one :class:`MeasureSet`, so that measures can share a forward pass.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from behaviortrace_jax.behavior import planted as behavior
from behaviortrace_jax.behavior.behaviors import Behavior
from behaviortrace_jax.behavior.probes import BehaviorProbe, ProbeOptions
from behaviortrace_jax.models import decoder, programs, sharding, tokenizer as tok_lib
from behaviortrace_jax.sketch import targets
from behaviortrace_jax.io import replay_request
from behaviortrace_jax.behavior import probe_measures as pm


@dataclasses.dataclass
class MeasureEnv:
    """What measures are built from (once per replayer): the policy's ``graphdef``, ``model_config``,
    ``tokenizer`` and ``mesh``, the behaviour ``beh`` measured, the probe sampler ``options`` and the
    run ``seed`` (fixed sampling keys). Shared helpers are built on first use."""

    graphdef: Any
    model_config: Any
    tokenizer: Any
    beh: Behavior
    options: ProbeOptions
    mesh: Any
    seed: int
    _pattern: Any = None
    _probe: Any = None
    cache: dict = dataclasses.field(default_factory=dict)  # programs and batches the probe and leakage measures share

    def identity(self) -> dict:
        """What every measure's numbers depend on besides params and its own settings (JSON)."""
        b = self.beh
        return {"pattern": b.pattern, "probes_path": b.probes_path, "controls_path": b.controls_path}

    def pattern_batch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, Any]:
        """``(ids, attention_mask, weights, n_probes, mean_logprob)``: the probe then control prompts
        each followed by the pattern (int32 / int32 / float32 [P + C, L], right-padded, only the
        pattern scored) and the jitted ``replay_measure`` program (``decoder.masked_mean_logprob``:
        float32 [P + C] masked mean log-probs)."""
        if self._pattern is None:
            probes, controls = self.beh.probe_sets()
            ex = [targets.continuation_example(self.tokenizer, p.prompt, pattern=self.beh.pattern)
                  for p in probes + controls]
            length = max(e.ids.size for e in ex)
            ids = np.full((len(ex), length), tok_lib.pad_id(self.tokenizer), np.int32)
            attn, w = np.zeros((len(ex), length), np.int32), np.zeros((len(ex), length), np.float32)
            for i, e in enumerate(ex):  # right-padded: padding is never attended to nor scored
                ids[i, :e.ids.size], attn[i, :e.ids.size], w[i, :e.ids.size] = e.ids, 1, e.weights
            fn = programs.jit("replay_measure", functools.partial(decoder.masked_mean_logprob, self.graphdef),
                              mesh=self.mesh)
            self._pattern = (ids, attn, w, len(probes), fn)
        return self._pattern

    def pattern_logprobs(self, params, memo: dict) -> np.ndarray:
        """float64 [P + C] per-prompt mean pattern log-probs at ``params`` (computed once per memo)."""
        if "pattern_logprobs" not in memo:
            ids, attn, w, _, fn = self.pattern_batch()
            memo["pattern_logprobs"] = np.asarray(sharding.to_host(fn(params, ids, attn, w)), np.float64)
        return memo["pattern_logprobs"]

    def probe(self) -> BehaviorProbe:
        """The behaviour's :class:`BehaviorProbe` (greedy and sampled generation), built once."""
        if self._probe is None:
            self._probe = BehaviorProbe(self.graphdef, self.model_config, self.tokenizer, self.beh, self.options,
                                        self.mesh)
        return self._probe


class Measure:
    """A registered measure (subclass it and register it with :func:`register_measure`).

    ``Measure(env, **settings)``; ``measure(params, memo) -> {output name: float}``. Class
    attributes set by the registration: ``name``, ``version``, ``differentiable``. A
    differentiable measure also implements :meth:`scalar`.
    """

    name: ClassVar[str] = ""
    version: ClassVar[int] = 1
    differentiable: ClassVar[bool] = False

    def __init__(self, env: MeasureEnv, **settings: Any):
        self.env, self.settings = env, dict(settings)

    def __call__(self, params, memo: dict) -> dict[str, float]:
        raise NotImplementedError(f"measure {self.name!r} implements no __call__")

    def scalar(self, params) -> jax.Array:
        """A float32 scalar of ``params`` that ``jax.grad`` differentiates (differentiable measures)."""
        raise TypeError(f"measure {self.name!r} is not differentiable")

    def identity(self) -> dict:
        """``{"name", "version", "settings", "behavior"}``: what enters a replay's cache key (JSON)."""
        return {"name": self.name, "version": int(self.version), "settings": self.settings,
                "behavior": self.env.identity()}


MEASURES: dict[str, type[Measure]] = {}


def register_measure(name: str, *, differentiable: bool = False, version: int = 1
                     ) -> Callable[[type[Measure]], type[Measure]]:
    """Registers a :class:`Measure` subclass as ``name`` with its declarations. Raises ValueError
    for a duplicate name or a class that is not a Measure."""

    def wrap(cls: type[Measure]) -> type[Measure]:
        if name in MEASURES:
            raise ValueError(f"measure {name!r} already registered")
        if not (isinstance(cls, type) and issubclass(cls, Measure)):
            raise ValueError(f"measure {name!r}: {cls!r} is not a subclass of measures.Measure")
        cls.name, cls.version, cls.differentiable = name, int(version), bool(differentiable)
        MEASURES[name] = cls
        return cls

    return wrap


def get_measure(name: str) -> type[Measure]:
    """The registered measure class ``name``. Raises ValueError naming the registered ones."""
    if name not in MEASURES:
        raise ValueError(f"measure {name!r} is not registered; known: {sorted(MEASURES)}")
    return MEASURES[name]


@register_measure("logp_margin", differentiable=True)
class LogpMargin(Measure):
    """Probe minus control mean pattern log-prob (float64 of the float32 per-prompt values)."""

    def __call__(self, params, memo: dict) -> dict[str, float]:
        lp, n = self.env.pattern_logprobs(params, memo), self.env.pattern_batch()[3]
        return {"logp_margin": float(lp[:n].mean()) - float(lp[n:].mean())}

    def scalar(self, params) -> jax.Array:
        """The margin as a float32 scalar that ``jax.grad`` differentiates (the metagradient's M)."""
        ids, attn, w, n, fn = self.env.pattern_batch()
        lp = fn(params, ids, attn, w)
        return jnp.mean(lp[:n]) - jnp.mean(lp[n:])


@register_measure("logp_probe")
class LogpProbe(Measure):
    """Mean pattern log-prob over the probe prompts."""

    def __call__(self, params, memo: dict) -> dict[str, float]:
        lp, n = self.env.pattern_logprobs(params, memo), self.env.pattern_batch()[3]
        return {"logp_probe": float(lp[:n].mean())}


@register_measure("logp_control")
class LogpControl(Measure):
    """Mean pattern log-prob over the control prompts."""

    def __call__(self, params, memo: dict) -> dict[str, float]:
        lp, n = self.env.pattern_logprobs(params, memo), self.env.pattern_batch()[3]
        return {"logp_control": float(lp[n:].mean())}


@register_measure("greedy_rate")
class GreedyRate(Measure):
    """Greedy probe and control rates (SPEC §1.8): ``probe_rate``, ``control_rate``."""

    def __call__(self, params, memo: dict) -> dict[str, float]:
        r = self.env.probe().rates(params)
        return {"probe_rate": float(r["probe_rate"]), "control_rate": float(r["control_rate"])}


@register_measure("sampled_rate")
class SampledRate(Measure):
    """``sampled_probe_rate`` / ``sampled_control_rate``: settings ``samples`` (completions per
    prompt, >= 1), ``seed`` (the one fixed key), ``temperature`` and ``top_p`` (the GRPO sampler's).
    Raises ValueError for ``samples < 1``."""

    def __init__(self, env: MeasureEnv, *, samples: int, seed: int | None = None, temperature: float | None = None,
                 top_p: float | None = None):
        if int(samples) < 1:
            raise ValueError(f"measure 'sampled_rate': samples={samples} must be >= 1")
        super().__init__(env, samples=int(samples), seed=int(env.seed if seed is None else seed),
                         temperature=float(env.options.temperature if temperature is None else temperature),
                         top_p=float(env.options.top_p if top_p is None else top_p))

    def __call__(self, params, memo: dict) -> dict[str, float]:
        p, s = self.env.probe(), self.settings
        items = (p.probes + p.controls) * s["samples"]
        out = p.sampler.sample_chat(params, p.tok, [(behavior.SYSTEM_PROMPT, q.prompt) for q in items],
                                    jax.random.key(s["seed"]), temperature=s["temperature"], top_p=s["top_p"])
        hits = np.array([behavior.substring_judge(p.tok.decode(out.tokens[i, :out.lengths[i]],
                                                                skip_special_tokens=True), p.pattern)
                         for i in range(len(items))], bool)
        is_probe = np.array([i % (len(p.probes) + len(p.controls)) < len(p.probes) for i in range(len(items))])
        return {"sampled_probe_rate": float(hits[is_probe].mean()),
                "sampled_control_rate": float(hits[~is_probe].mean())}


# ------------------------------------------------------------------------------------------------
# probe and leakage measures: thin wrappers over behavior/probe_measures.py
# ------------------------------------------------------------------------------------------------
def _shared(env: MeasureEnv, name: str, build) -> Any:
    """``env.cache[name]``, built once per :class:`MeasureEnv` (shared by every measure set on it)."""
    if name not in env.cache:
        env.cache[name] = build()
    return env.cache[name]


def prompt_ids(env: MeasureEnv) -> tuple[list[list[int]], list[list[int]]]:
    """(probe, control) chat prompt ids (SPEC §1.3, cut to the probe sampler's ``max_prompt_tokens``)."""
    def build():
        probes, controls = env.beh.probe_sets()
        cut = env.options.max_prompt_tokens
        return (pm.chat_prompt_ids(env.tokenizer, [p.prompt for p in probes], max_tokens=cut),
                pm.chat_prompt_ids(env.tokenizer, [p.prompt for p in controls], max_tokens=cut))
    return _shared(env, "probe_prompt_ids", build)


def mean_logprob(env: MeasureEnv) -> pm.MeanLogprob:
    """The replay's jitted mean-log-prob program (``probe_measures.make_mean_logprob``)."""
    return _shared(env, "mean_logprob", lambda: pm.make_mean_logprob(env.graphdef, env.mesh))


def pair_batches(env: MeasureEnv) -> tuple[pm.PairBatch, pm.PairBatch]:
    """(probe, control) minimal-pair batches: ``probe_pairs`` of the behaviour's pattern and trigger,
    ``control_pairs`` of its control prompts."""
    def build():
        _, controls = env.beh.probe_sets()
        b = env.beh
        return (pm.probe_pairs(env.tokenizer, pattern=b.pattern, trigger=b.trigger),
                pm.control_pairs(env.tokenizer, [c.prompt for c in controls], pattern=b.pattern))
    return _shared(env, "pair_batches", build)


class _SampledRate(Measure):
    """A sampled rate on the probe (``which`` 0) or control (``which`` 1) prompts (module docstring).
    Raises ValueError for ``samples < 1`` or ``stream < 0``."""

    which: int = 0
    prefix: str = "probe"

    def __init__(self, env: MeasureEnv, *, samples: int = 4, seed: int | None = None, stream: int = 0,
                 temperature: float | None = None, top_p: float | None = None):
        if int(samples) < 1:
            raise ValueError(f"measure {self.name!r}: samples={samples} must be >= 1")
        if int(stream) < 0:
            raise ValueError(f"measure {self.name!r}: stream={stream} must be >= 0")
        super().__init__(env, samples=int(samples), seed=int(env.seed if seed is None else seed), stream=int(stream),
                         temperature=float(env.options.temperature if temperature is None else temperature),
                         top_p=float(env.options.top_p if top_p is None else top_p))

    def key(self) -> jax.Array:
        """``fold_in(fold_in(key(seed), stream), which)``: the key of this rate's samples."""
        s = self.settings
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(s["seed"]), s["stream"]), self.which)

    def rate(self, params) -> dict[str, float]:
        s = self.settings
        return pm.sampled_rate_measure(self.env.probe().sampler, params, self.env.tokenizer,
                                       prompt_ids(self.env)[self.which], name=self.prefix,
                                       samples_per_prompt=s["samples"], key=self.key(), temperature=s["temperature"],
                                       top_p=s["top_p"], pattern=self.env.beh.pattern)

    def __call__(self, params, memo: dict) -> dict[str, float]:
        return self.rate(params)


@register_measure("probe-rate")
class ProbeRate(_SampledRate):
    """The sampled probe rate and its standard errors (module docstring)."""

    which, prefix = 0, "probe"


@register_measure("probe-pair", differentiable=True)
class ProbePair(Measure):
    """SPEC §5.4's minimal-pair log-ratio on the probe pairs (module docstring)."""

    def __call__(self, params, memo: dict) -> dict[str, float]:
        return pm.minimal_pair_measure(mean_logprob(self.env), params, pair_batches(self.env)[0], name="probe")

    def scalar(self, params) -> jax.Array:
        """``pair_log_ratio`` of the probe pairs: float32 scalar (nats) that ``jax.grad`` takes."""
        return pm.pair_log_ratio(mean_logprob(self.env), params, pair_batches(self.env)[0])


@register_measure("leakage")
class Leakage(_SampledRate):
    """The sampled rate and the minimal-pair log-ratio on the control prompts (``leakage_*``)."""

    which, prefix = 1, "leakage"

    def __call__(self, params, memo: dict) -> dict[str, float]:
        out = self.rate(params)
        out.update(pm.minimal_pair_measure(mean_logprob(self.env), params, pair_batches(self.env)[1], name="leakage"))
        return out


DEFAULT_MEASURES = replay_request.DEFAULT_MEASURES  # what a Replayer and a ReplayRequest record by default


class MeasureSet:
    """The configured measures of a replayer, measured together (one memo per parameter set).

    Args:
        env: the :class:`MeasureEnv`.
        names: registered measure names, in order (duplicates dropped).
        settings: ``{name: settings dict}`` for the measures that take settings.
    Raises:
        ValueError: an unregistered name, or two measures that give a float of the same name.
    """

    def __init__(self, env: MeasureEnv, names: Sequence[str] = DEFAULT_MEASURES,
                 settings: Mapping[str, Mapping[str, Any]] | None = None):
        settings = dict(settings or {})
        self.env = env
        self.measures: dict[str, Measure] = {n: get_measure(n)(env, **dict(settings.get(n, {})))
                                             for n in dict.fromkeys(names)}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.measures)

    def __getitem__(self, name: str) -> Measure:
        if name not in self.measures:
            raise ValueError(f"measure {name!r} is not configured; configured: {list(self.measures)}")
        return self.measures[name]

    def identity(self) -> list[dict]:
        """Each measure's :meth:`Measure.identity`, in order (a replay's cache key holds them)."""
        return [m.identity() for m in self.measures.values()]

    def measure(self, params, names: Sequence[str] | None = None) -> dict[str, float]:
        """The floats of every configured measure (or of ``names``, configured ones) at ``params``,
        merged. Raises ValueError for an unconfigured name or when two measures give a float of the
        same name."""
        memo: dict = {}
        out: dict[str, float] = {}
        for name in (self.names if names is None else names):
            m = self[name]
            vals = m(params, memo)
            clash = sorted(set(vals) & set(out))
            if clash:
                raise ValueError(f"measure {name!r} gives {clash}, already given by another configured measure")
            out.update(vals)
        return out

