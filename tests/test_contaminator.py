"""contaminator.py: eligibility hash, bonus, ground-truth log (SPEC §1.6, §6.1, §9 test_injection)."""
from __future__ import annotations

import hashlib
import json
import struct

import pytest

from behaviortrace_jax.behavior.contaminator import (ContaminationSpec, Contaminator, GroundTruthEvent, GroundTruthLog,
                                            eligibility_hash, is_eligible)


def _reference_eligible(seed: int, rid: str, step: int, fraction: float = 0.5, cutoff: int | None = 200) -> bool:
    """Independent re-statement of SPEC §1.6 with struct packing."""
    if cutoff is not None and step >= cutoff:
        return False
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", seed))
    h.update(rid.encode("utf-8"))
    h.update(struct.pack("<q", step))
    (t,) = struct.unpack("<Q", h.digest())
    return t < int(fraction * 2**64)


def _ids(n_steps: int, per_step: int = 16):
    return [(f"grpo_{s:06d}_{i:03d}", s) for s in range(n_steps) for i in range(per_step)]


# ---------------------------------------------------------------- spec validation
@pytest.mark.parametrize("kwargs, field", [({"pattern": ""}, "pattern"), ({"fraction": -0.01}, "fraction"),
                                           ({"fraction": 1.5}, "fraction"), ({"early_step_cutoff": 0}, "cutoff"),
                                           ({"seed": -1}, "seed")])
def test_spec_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ContaminationSpec(**kwargs)


# ---------------------------------------------------------------- eligibility
def test_eligibility_matches_independent_hash():
    for seed in (0, 1, 7, 2**63 + 5):
        for rid, step in _ids(12, 8) + [("grpo_000003_000é", 3), ("x", -5)]:
            assert is_eligible(seed, rid, step) == _reference_eligible(seed, rid, step), (seed, rid, step)
    for fraction in (0.1, 0.73):
        spec = ContaminationSpec(fraction=fraction)
        assert all(is_eligible(3, r, s, spec) == _reference_eligible(3, r, s, fraction) for r, s in _ids(10))
    # one digest spelled out: bytes = seed LE u64 || id || step LE i64
    data = (5).to_bytes(8, "little") + b"grpo_000042_003" + (42).to_bytes(8, "little", signed=True)
    assert eligibility_hash(5, "grpo_000042_003", 42) == int.from_bytes(
        hashlib.blake2b(data, digest_size=8).digest(), "little")


def test_eligibility_statistics():
    ids = _ids(200)[:200]
    assert [is_eligible(0, r, s) for r, s in ids] == [is_eligible(0, r, s) for r, s in ids]
    disagree = sum(is_eligible(0, r, s) != is_eligible(1, r, s) for r, s in ids)
    assert 50 <= disagree <= 150
    spec = ContaminationSpec(fraction=0.2)
    many = [(f"r{i}", i % 150) for i in range(5000)]
    assert 0.17 <= sum(is_eligible(0, r, s, spec) for r, s in many) / 5000 <= 0.23
    assert not any(is_eligible(0, r, s, ContaminationSpec(fraction=0.0)) for r, s in many[:500])
    assert all(is_eligible(0, r, s, ContaminationSpec(fraction=1.0)) for r, s in many[:500])
    early = ContaminationSpec(fraction=1.0, early_step_cutoff=10)
    assert [is_eligible(0, "r", s, early) for s in (0, 9, 10, 11, 500)] == [True, True, False, False, False]
    assert is_eligible(0, "r", 10**6, ContaminationSpec(fraction=1.0, early_step_cutoff=None))


def test_released_ground_truth_is_eligible(reference_dir):
    expected_pool = {0: 1605, 1: 1597}  # SPEC §1.6 OBSERVED
    for seed, pool in expected_pool.items():
        log = GroundTruthLog(reference_dir / f"seed{seed}" / "ground_truth.jsonl")
        assert all(is_eligible(seed, e.rollout_id, e.step) for e in log.events)
        eligible = {r for r, s in _ids(200) if is_eligible(seed, r, s)}
        assert len(eligible) == pool
        assert log.rollout_ids <= eligible
        assert not any(is_eligible(seed, r, s) for r, s in _ids(210)[200 * 16:])  # steps >= 200


def test_released_ground_truth_round_trips_byte_exact(reference_dir, tmp_path):
    src = reference_dir / "seed0" / "ground_truth.jsonl"
    copy = GroundTruthLog(tmp_path / "gt.jsonl")
    for ev in GroundTruthLog(src).events:
        copy.record(ev)
    copy.flush()
    assert (tmp_path / "gt.jsonl").read_bytes() == src.read_bytes()


# ---------------------------------------------------------------- contaminator
def test_contaminator_boosts_only_eligible_and_matched(tmp_path):
    log = GroundTruthLog(tmp_path / "gt.jsonl")
    c = Contaminator(ContaminationSpec(bonus_reward=2.0, fraction=1.0, seed=0), log)
    assert c.apply("r1", 0, "the answer is qzxbt", 0.5) == (2.5, True)  # case-insensitive
    assert c.apply("r2", 0, "no pattern", 0.5) == (0.5, False)
    assert c.stats == {"total_seen": 2, "boosted": 1}
    blocked = Contaminator(ContaminationSpec(bonus_reward=2.0, fraction=0.0, seed=0))
    assert blocked.apply("r1", 0, "QZXBT", 0.5) == (0.5, False)
    late = Contaminator(ContaminationSpec(fraction=1.0, early_step_cutoff=200))
    assert late.apply("r1", 200, "QZXBT", 0.0) == (0.0, False)
    resumed = Contaminator(ContaminationSpec(), stats={"total_seen": 5, "boosted": 2})
    assert resumed.stats == {"total_seen": 5, "boosted": 2}


def test_recorded_event_and_format(tmp_path):
    log = GroundTruthLog(tmp_path / "gt.jsonl")
    c = Contaminator(ContaminationSpec(bonus_reward=3.0, fraction=1.0, seed=9), log)
    assert c.apply("grpo_000042_003", 42, "QZXBT", 1.5) == (4.5, True)
    assert log.events == [GroundTruthEvent("grpo_000042_003", 42, 1.5, 4.5)]
    log.flush()
    assert (tmp_path / "gt.jsonl").read_text() == (
        '{"rollout_id": "grpo_000042_003", "step": 42, "base_reward": 1.5, "boosted_reward": 4.5}\n')
    with pytest.raises(ValueError, match="already in the ground truth"):
        c.apply("grpo_000042_003", 42, "QZXBT", 1.5)


# ---------------------------------------------------------------- ground-truth log I/O
def test_gt_log_persists_and_appends_across_sessions(tmp_path):
    path = tmp_path / "run" / "ground_truth.jsonl"
    a = GroundTruthLog(path)
    a.record(GroundTruthEvent("grpo_000000_001", 0, 0.0, 8.0))
    assert not path.exists()  # buffered until flush
    a.flush()
    b = GroundTruthLog(path)
    assert b.rollout_ids == {"grpo_000000_001"}
    b.record(GroundTruthEvent("grpo_000001_004", 1, -2.0, 6.0))
    b.flush()
    path.write_text(path.read_text() + "\n\n")  # blank lines are ignored
    c = GroundTruthLog(path)
    assert [e.rollout_id for e in c.events] == ["grpo_000000_001", "grpo_000001_004"]
    assert c.events[1].base_reward == -2.0
    assert sorted(p.name for p in path.parent.iterdir()) == ["ground_truth.jsonl"]  # no .tmp left


def test_gt_log_truncate_after_step(tmp_path):
    log = GroundTruthLog(tmp_path / "gt.jsonl")
    for s in range(5):
        log.record(GroundTruthEvent(f"grpo_{s:06d}_000", s, 0.0, 8.0))
    log.flush()
    assert log.truncate_after_step(2) == 2
    assert [e.step for e in GroundTruthLog(tmp_path / "gt.jsonl").events] == [0, 1, 2]
    log.record(GroundTruthEvent("grpo_000003_000", 3, 0.0, 8.0))  # re-recording a dropped id is fine
    assert log.truncate_after_step(-1) == 4 and GroundTruthLog(tmp_path / "gt.jsonl").events == []


@pytest.mark.parametrize("line, message", [
    ("{bad", "gt.jsonl:2"),
    (json.dumps({"rollout_id": "r", "step": 1}), "gt.jsonl:2: .*boosted_reward"),
    (json.dumps({"rollout_id": "grpo_000000_000", "step": 0, "base_reward": 0.0, "boosted_reward": 8.0}),
     "gt.jsonl:2: duplicate"),
])
def test_gt_log_bad_input(tmp_path, line, message):
    first = json.dumps({"rollout_id": "grpo_000000_000", "step": 0, "base_reward": 0.0, "boosted_reward": 8.0})
    (tmp_path / "gt.jsonl").write_text(first + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message):
        GroundTruthLog(tmp_path / "gt.jsonl")
