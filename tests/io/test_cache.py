"""Keyed caches (io/cache.py): one rule for every file a stage reuses. A file without the key of
the result asked for is recomputed with a log line naming the fields that changed; a corrupt one
(not an object, a key that is not a map, wrong shapes) is refused by name. The metagradient stage's
files go through it (a fake file of the right shape used to be accepted), with fakes for the
replay and the reverse sweep (no model is trained here)."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from behaviortrace_jax.io import cache
from behaviortrace_jax.io.files import read_json, write_json
from behaviortrace_jax.io.layout import RunLayout
from behaviortrace_jax.stages.spec import RunSpec
from configs import tiny


def test_load_missing_valid_stale_and_unkeyed(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    path = tmp_path / "r.json"
    key = {"version": 1, "rollout_log": "abc", "steps": (2, 4)}
    assert cache.load(path, key, what="t") is None  # no file
    written = cache.store(path, {"value": 1.5}, key)
    assert written["cache"] == {"version": 1, "rollout_log": "abc", "steps": [2, 4]}
    assert cache.load(path, key, what="t")["value"] == 1.5
    for changed, field in (({"version": 2}, "version"), ({"rollout_log": "abd"}, "rollout_log"),
                           ({"steps": [2]}, "steps")):
        caplog.clear()
        assert cache.load(path, dict(key, **changed), what="t") is None
        assert f"differs in {field}" in caplog.text and str(path) in caplog.text
    caplog.clear()
    assert cache.load(path, {k: v for k, v in key.items() if k != "steps"}, what="t") is None  # a field dropped
    assert "differs in steps" in caplog.text
    write_json(path, {"value": 1.5})  # a file without a key (older code, or by hand): recomputed
    caplog.clear()
    assert cache.load(path, key, what="t") is None and "has no key" in caplog.text


def test_load_refuses_corrupt_files_by_name(tmp_path):
    path, key = tmp_path / "r.json", {"v": 1}
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"r\.json: expected a JSON object, got list"):
        cache.load(path, key, what="t")
    path.write_text('{"value": 1, "cache": [1]}')
    with pytest.raises(ValueError, match=r"r\.json: field 'cache' is a list"):
        cache.load(path, key, what="t")
    path.write_text('{"value": 1, "cach')
    with pytest.raises(ValueError, match=r"r\.json: invalid JSON"):
        cache.load(path, key, what="t")
    cache.store(path, {"value": "x"}, key)

    def check(rec):
        if not isinstance(rec["value"], float):
            raise ValueError("field 'value' is not a number")

    with pytest.raises(ValueError, match=r"r\.json: field 'value' is not a number"):
        cache.load(path, key, what="t", check=check)
    with pytest.raises(ValueError, match=r"field 'x' = nan is not a finite JSON value"):
        cache.store(path, {"value": 1.0}, {"x": float("nan")})
    with pytest.raises(ValueError, match="own 'cache' field"):
        cache.store(path, {"cache": 1}, key)
    assert read_json(path)["value"] == "x"  # nothing refused overwrote the file


# ------------------------------------------------------------------------------------------------
# The metagradient stage's cache, with a fake replay and reverse sweep
# ------------------------------------------------------------------------------------------------
class _FakeReplayer:
    identity_value = {"replay_version": 1, "step_spec": "s", "optimizer": "o", "rollout_log": "", "measure": "m"}

    def __init__(self, options, workdir, *, layout=None, measures=(), measure_settings=None):  # Replayer's signature
        n = options.step.shapes.num_rollouts
        self.rollout_ids = [f"{s}-{i}" for s in range(options.schedule.steps) for i in range(n)]
        self.log_digest = ""  # rollout_log.digest of the (absent) log: what the scores reader checks

        class _Margin:  # the differentiated measure's identity (train/measures.py)
            def identity(self):
                return {"name": "logp_margin", "version": 1}

        self.measures = {"logp_margin": _Margin()}

    def identity(self):
        return dict(self.identity_value)


class _FakeRun:
    calls: list = []

    def __init__(self, options, workdir, *, advantages, replayer, remat=""):
        self.mode, self.rp = advantages, replayer

    def run(self, steps, checkpoint_every=0):
        from behaviortrace_jax.train.metagradient import ReverseStats

        _FakeRun.calls.append(self.mode)
        n = len(self.rp.rollout_ids)
        grads = {s: np.arange(n, dtype=np.float64) * (s + 1) for s in steps}
        return grads, {s: 0.5 * s for s in steps}, ReverseStats(0.0, 0.0, 1, 1, 1, 1, 1, 1)


@pytest.fixture
def fake_metagradient(monkeypatch):
    from behaviortrace_jax.train import metagradient as MG, replay as R

    monkeypatch.setattr(R, "Replayer", _FakeReplayer)
    monkeypatch.setattr(MG, "RunMetagradient", _FakeRun)
    _FakeRun.calls = []
    config = tiny.get_config("smoke")
    config.metagradient.advantages = "logged"
    return config


def _run_stage(config, w):
    from behaviortrace_jax.stages.metagradient import metagradient_stage

    metagradient_stage(config, str(w))


def test_metagradient_stage_recomputes_a_fake_or_stale_file(fake_metagradient, tmp_path, caplog):
    from behaviortrace_jax.attribution.scores import metagradient_scores
    from behaviortrace_jax.train import replay as R

    caplog.set_level(logging.INFO)
    config, paths = fake_metagradient, RunLayout(tmp_path)
    ids = _FakeReplayer(RunSpec.from_config(config).replay, tmp_path).rollout_ids
    schedule = RunSpec.from_config(config).schedule
    steps = sorted({schedule.target_checkpoint(), schedule.measure_step(config.counterfactual.measure)})
    fake = {"advantages": "logged", "rollout_ids": ids, "stats": {},
            "measures": {str(s): {"value": 9.0, "dM_dw": [7.0] * len(ids)} for s in steps}}
    write_json(paths.metagradient / "logged.json", fake)  # the right shape, no key: not the result of this run
    _run_stage(config, tmp_path)
    assert _FakeRun.calls == ["logged"] and "has no key" in caplog.text
    rec = read_json(paths.metagradient / "logged.json")
    assert rec["cache"]["rollout_log"] == "" and rec["cache"]["measure_steps"] == steps
    at = RunSpec.from_config(config).schedule.measure_step(config.counterfactual.measure)
    np.testing.assert_array_equal(metagradient_scores(paths, ids, "logged"), np.arange(len(ids)) * (at + 1))
    _run_stage(config, tmp_path)  # keyed and unchanged: reused
    assert _FakeRun.calls == ["logged"]
    _FakeReplayer.identity_value = dict(_FakeReplayer.identity_value, step_spec="s2")  # another step
    try:
        caplog.clear()
        _run_stage(config, tmp_path)
        assert _FakeRun.calls == ["logged", "logged"] and "differs in step_spec" in caplog.text
    finally:
        _FakeReplayer.identity_value = dict(_FakeReplayer.identity_value, step_spec="s")


def test_metagradient_stage_refuses_a_keyed_file_of_the_wrong_shape(fake_metagradient, tmp_path):
    from behaviortrace_jax.train import replay as R

    config, paths = fake_metagradient, RunLayout(tmp_path)
    _run_stage(config, tmp_path)
    rec = read_json(paths.metagradient / "logged.json")
    at = str(RunSpec.from_config(config).schedule.measure_step(config.counterfactual.measure))
    rec["measures"][at]["dM_dw"] = rec["measures"][at]["dM_dw"][:-1]
    write_json(paths.metagradient / "logged.json", rec)
    with pytest.raises(ValueError, match=rf"logged\.json: field 'measures\.{at}\.dM_dw' is not a list of"):
        _run_stage(config, tmp_path)
    assert read_json(paths.metagradient / "logged.json") == rec  # refused, not overwritten


def test_metagradient_scores_refuse_an_unkeyed_or_foreign_file(tmp_path):
    from behaviortrace_jax.attribution.scores import metagradient_scores

    paths, ids = RunLayout(tmp_path), ["0-0", "0-1", "0-2"]
    fake = {"method": "metagradient", "advantages": "logged", "measure_step": 4, "rollout_ids": ids,
            "scores": [1.0, 2.0, 3.0]}
    write_json(paths.metagradient_scores, fake)  # the right shape, written by no stage
    with pytest.raises(ValueError, match=r"scores\.json: no 'cache' key"):
        metagradient_scores(paths, ids)
    key = {"metagradient": "d", "rollout_log": "another log", "advantages": "logged", "measure_step": 4}
    write_json(paths.metagradient_scores, dict(fake, cache=key))
    with pytest.raises(ValueError, match=r"field 'cache\.rollout_log'"):
        metagradient_scores(paths, ids)
    write_json(paths.metagradient_scores, dict(fake, cache=dict(key, rollout_log="")))
    np.testing.assert_array_equal(metagradient_scores(paths, ids, "logged"), [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"field 'cache\.advantages' = 'logged'"):
        metagradient_scores(paths, ids, "recomputed")
    write_json(paths.metagradient_scores, dict(fake, cache=dict(key, rollout_log=""), scores=[1.0, "x", 3.0]))
    with pytest.raises(ValueError, match=r"field 'scores' is not a list of 3 numbers"):
        metagradient_scores(paths, ids)
