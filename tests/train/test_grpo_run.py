"""The GRPO run's library parts (``train/grpo_tracks.py``, ``train/grpo_logs.py``): one code path for
one behaviour and for several, whose files differ only where a run of several names its behaviours.
The parts' numbers and files at full size are tested by the smoke runs (tests/pipeline/test_end_to_end.py,
tests/pipeline/test_two_behaviors.py, tests/train/test_nonfinite.py)."""
from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from behaviortrace_jax.behavior.contaminator import ContaminationSpec, Contaminator, GroundTruthLog
from behaviortrace_jax.io.layout import RunLayout
from behaviortrace_jax.stages.spec import RunSpec
from behaviortrace_jax.train import grpo_logs, grpo_tracks
from behaviortrace_jax.train.rollouts import StepRollouts
from configs import tiny


class _Probe:
    """A probe whose rates are fixed (the real one needs a model)."""

    def __init__(self, probe_rate, control_rate):
        self.out = {"probe_rate": probe_rate, "control_rate": control_rate, "responses": {"p0": "text"}}

    def rates(self, params):
        return dict(self.out)


def _tracks(tmp_path, n: int) -> list[grpo_tracks.BehaviorTrack]:
    first = RunSpec.from_config(tiny.get_config("smoke")).first_behavior
    behs = [first] + [dataclasses.replace(first, id=f"b{j}", first=False, implant="none", stream=f"b{j}")
                      for j in range(1, n)]
    out = []
    for j, b in enumerate(behs):
        log = GroundTruthLog(tmp_path / f"gt{j}.jsonl")
        spec = ContaminationSpec(pattern=b.pattern, bonus_reward=8.0, fraction=1.0, seed=0, early_step_cutoff=10,
                                 stream=b.stream)
        out.append(grpo_tracks.BehaviorTrack(b, Contaminator(spec, log), log, _Probe(0.5 + 0.1 * j, 0.1)))
    return out


def _rollouts(tracks) -> StepRollouts:
    sample = types.SimpleNamespace(tokens=np.arange(8, dtype=np.int32).reshape(2, 4),
                                   logprobs=np.full((2, 4), -0.5, np.float32), lengths=np.array([3, 4], np.int32))
    flags = [True, False]
    return StepRollouts(prompts=["p"], prompt_lists=[[1, 2], [1, 2]], sample=sample, texts=["QZXBT", "no"],
                        ids=["grpo_000000_000", "grpo_000000_001"], base=np.zeros(2, np.float32),
                        rewards=np.array([8.0, 0.0], np.float32), boosted=flags, decoys=None,
                        boosted_by={t.id: flags for t in tracks})


def test_one_behaviour_writes_the_paper_keys_and_several_add_theirs(tmp_path):
    """The same functions make a one-behaviour run's curve point, rollout records and summary (the
    paper's keys only) and a two-behaviour run's (plus ``behaviors``, the first's entry repeated)."""
    for n in (1, 2):
        tracks = _tracks(tmp_path / str(n), n)
        point = grpo_tracks.curve_point(tracks, params=None, step=4)
        ro = _rollouts(tracks)
        recs = grpo_logs.rollout_records(0, ro, np.array([1.0, -1.0], np.float32), {1: ["reward"]}, tracks)
        paths = RunLayout(tmp_path / str(n))
        paths.grpo.mkdir(parents=True)
        summary = grpo_logs.write_summary(paths.summary, tracks, [t.rates(None) for t in tracks], run_name="r",
                                          seed=0, steps=1, post_sft={}, curve=[point], skipped=[],
                                          rollouts=paths.rollouts)
        assert point["probe_rate"] == 0.5 and recs[0].eligible and recs[0].bonus == 8.0
        assert recs[1].extra["nonfinite"] == ["reward"] and recs[1].completion_token_ids == [4, 5, 6, 7]
        if n == 1:
            assert set(point) == {"step", "probe_rate", "control_rate"}
            assert set(recs[0].extra) == {"base_reward"} and "behaviors" not in summary
        else:
            assert point["behaviors"] == {"qzxbt": {"probe_rate": 0.5, "control_rate": 0.1},
                                          "b1": {"probe_rate": 0.6, "control_rate": 0.1}}
            assert recs[0].extra["behaviors"]["b1"] == {"eligible": True, "bonus": 8.0}
            assert "final_responses" not in summary["behaviors"]["qzxbt"]
            assert summary["behaviors"]["b1"]["gate"]["probe_rate"] == 0.6
            assert summary["behaviors"]["b1"]["final_responses"] == {"p0": "text"}
        assert summary["gate"]["probe_rate"] == 0.5 and summary["n_rollouts"] == 0


def test_decoys_are_refused_in_a_run_of_several_behaviours(tmp_path):
    behs = [t.behavior for t in _tracks(tmp_path, 2)]
    specs = [ContaminationSpec(pattern="QZXBT", bonus_reward=8.0, fraction=0.5, seed=0, early_step_cutoff=10,
                               decoy_fraction=0.5), behs[1].contamination_spec(0)]
    with pytest.raises(ValueError, match="contamination.decoy_fraction > 0 is supported for one-behaviour runs only"):
        grpo_tracks.open_tracks(behs, specs, RunLayout(tmp_path), start_step=0, rollouts_per_step=4,
                                probe_options=None, graphdef=None, model_cfg=None, tok=None, mesh=None)
    with pytest.raises(ValueError, match="2 behaviours but 1 contamination specs"):
        grpo_tracks.open_tracks(behs, specs[:1], RunLayout(tmp_path), start_step=0, rollouts_per_step=4,
                                probe_options=None, graphdef=None, model_cfg=None, tok=None, mesh=None)
