"""The probe and leakage measures as registered measures (``train/measures.py`` imports this module).

Each is a thin wrapper over the pure functions of ``behavior/probe_measures.py`` (which give the
formulas, the standard errors and the key scheme); nothing here computes a number of its own:

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
"""
from __future__ import annotations

from typing import Any

import jax

from behaviortrace_jax.behavior import probe_measures as pm
from behaviortrace_jax.train.measures import Measure, MeasureEnv, register_measure


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
