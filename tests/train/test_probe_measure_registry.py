"""The registered probe and leakage measures (``train/measures.py``) on a tiny random Qwen2:
each one's floats are the pure functions' of ``behavior/probe_measures.py`` on the same params,
keys and prompts; a MeasureSet records them together; the minimal-pair measure's scalar is its
float and differentiable; the stream setting changes the sampled rate's key and only it."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from behaviortrace_jax.behavior import probe_measures as pm
from behaviortrace_jax.behavior.probes import ProbeOptions
from behaviortrace_jax.train import measures as M
from hf_fixtures import load_random_qwen2

TEMPERATURE, TOP_P, SAMPLES, SEED = 0.9, 0.9, 2, 3


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from behaviortrace_jax.stages.spec import RunSpec
    from configs import tiny

    _, tok, model, graphdef, params = load_random_qwen2(tmp_path_factory.mktemp("hf") / "m", layers=1)
    beh = RunSpec.from_config(tiny.get_config("smoke")).first_behavior
    opts = ProbeOptions(max_prompt_tokens=128, max_new_tokens=3, temperature=TEMPERATURE, top_p=TOP_P,
                        samples_per_prompt=1)
    return M.MeasureEnv(graphdef, model.config, tok, beh, opts, None, SEED), params


def _direct(env: M.MeasureEnv, params, stream: int = 0) -> dict[str, float]:
    """Every output of the three measures from the pure functions alone (their documented recipe)."""
    probes, controls = env.beh.probe_sets()
    ids = [pm.chat_prompt_ids(env.tokenizer, [p.prompt for p in ps], max_tokens=128) for ps in (probes, controls)]
    key = jax.random.fold_in(jax.random.key(SEED), stream)
    mlp, smp = pm.make_mean_logprob(env.graphdef), env.probe().sampler
    return pm.probe_and_leakage(
        smp, mlp, params, env.tokenizer, probe_ids=ids[0], control_ids=ids[1],
        probe_pair_batch=pm.probe_pairs(env.tokenizer, pattern=env.beh.pattern, trigger=env.beh.trigger),
        control_pair_batch=pm.control_pairs(env.tokenizer, [c.prompt for c in controls], pattern=env.beh.pattern),
        samples_per_prompt=SAMPLES, key=key, temperature=TEMPERATURE, top_p=TOP_P, pattern=env.beh.pattern)


def test_registered_measures_equal_the_pure_functions_and_a_measure_set_records_them(env):
    e, params = env
    settings = {"probe-rate": {"samples": SAMPLES}, "leakage": {"samples": SAMPLES}}
    ms = M.MeasureSet(e, ("probe-rate", "probe-pair", "leakage", "logp_margin"), settings)
    got = ms.measure(params)
    want = _direct(e, params)
    assert set(want) <= set(got) and "logp_margin" in got
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-6, atol=1e-7, err_msg=k)
    assert got["probe_rate_samples_per_prompt"] == SAMPLES and got["probe_pair_cells"] == 18
    assert ms["probe-pair"].differentiable and not ms["probe-rate"].differentiable
    # the differentiable scalar is the recorded float, and jax.grad takes it
    np.testing.assert_allclose(float(ms["probe-pair"].scalar(params)), got["probe_pair_logratio"], rtol=1e-5)
    g = jax.grad(ms["probe-pair"].scalar)(params)
    assert any(float(np.abs(np.asarray(x)).max()) > 0 for x in jax.tree.leaves(g))
    # settings enter the identity (the replay cache key); a bad setting is refused by name
    assert ms["probe-rate"].identity()["settings"] == {"samples": SAMPLES, "seed": SEED, "stream": 0,
                                                       "temperature": TEMPERATURE, "top_p": TOP_P}
    with pytest.raises(ValueError, match="'probe-rate': samples=0"):
        M.get_measure("probe-rate")(e, samples=0)
    # greedy_rate gives a float of the same name as probe-rate: refused, naming the clash
    with pytest.raises(ValueError, match="probe_rate"):
        M.MeasureSet(e, ("greedy_rate", "probe-rate")).measure(params)


def test_the_stream_setting_is_the_pure_functions_stream_key(env):
    e, params = env
    ms = M.MeasureSet(e, ("probe-rate", "leakage"), {"probe-rate": {"samples": SAMPLES, "stream": 1},
                                                     "leakage": {"samples": SAMPLES, "stream": 1}})
    got, want = ms.measure(params), _direct(e, params, stream=1)
    for k in ("probe_rate", "probe_rate_se", "leakage_rate", "leakage_pair_logratio"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)
