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


# ---------------------------------------------------------------- decoys (not in the paper)
@pytest.mark.parametrize("kwargs, field", [({"decoy_fraction": -0.1}, "decoy_fraction"),
                                           ({"decoy_fraction": float("nan")}, "decoy_fraction"),
                                           ({"decoy_stream": ""}, "decoy_stream"),
                                           ({"decoy_stream": "x" * 17}, "decoy_stream")])
def test_decoy_spec_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ContaminationSpec(**kwargs)


def test_decoy_stream_is_its_own_blake2b_stream_independent_of_eligibility():
    import numpy as np

    data = (5).to_bytes(8, "little") + b"grpo_000042_003" + (42).to_bytes(8, "little", signed=True)
    ref = int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"decoy/").digest(), "little")
    c = Contaminator(ContaminationSpec(seed=5, decoy_fraction=1.0))
    assert eligibility_hash(5, "grpo_000042_003", 42, c.spec.decoy_stream) == ref
    assert ref != eligibility_hash(5, "grpo_000042_003", 42)  # not the paper's eligibility hash
    # a decoy iff its hash is below probability * 2**64 (margins of 2**20 for float rounding)
    assert c.is_decoy("grpo_000042_003", 42, (ref + 2**20) / 2**64)
    assert not c.is_decoy("grpo_000042_003", 42, (ref - 2**20) / 2**64)

    ids = _ids(1000)  # 16,000 rollouts
    spec = ContaminationSpec(early_step_cutoff=None, decoy_fraction=1.0)
    c = Contaminator(spec)
    a = np.array([is_eligible(0, r, s, spec) for r, s in ids])
    b = np.array([c.is_decoy(r, s, 0.5) for r, s in ids])
    n = len(ids)
    # each ~ Bernoulli(0.5); jointly ~ independent: P(a & b) ~ 0.25 within 4 sd, correlation ~ 0
    assert abs(a.mean() - 0.5) < 4 * np.sqrt(0.25 / n) and abs(b.mean() - 0.5) < 4 * np.sqrt(0.25 / n)
    assert abs((a & b).mean() - 0.25) < 4 * np.sqrt(0.25 * 0.75 / n)
    assert abs(np.corrcoef(a, b)[0, 1]) < 4 / np.sqrt(n)


def test_decoy_probability_maps_decoy_fraction_to_decoys_per_gt_event():
    from behaviortrace_jax.behavior.contaminator import decoy_probability

    spec = ContaminationSpec(fraction=0.5, decoy_fraction=1.0)
    assert decoy_probability(spec, 4, 12) == pytest.approx(1.0 * 0.5 * 4 / 12)  # E[decoys] = 2 = E[GT]
    assert decoy_probability(spec, 15, 1) == 1.0  # capped: fewer decoys than GT at such a step
    assert decoy_probability(spec, 4, 0) == 0.0 and decoy_probability(spec, 0, 12) == 0.0
    assert decoy_probability(ContaminationSpec(fraction=0.5), 4, 12) == 0.0  # off by default
    assert decoy_probability(ContaminationSpec(fraction=0.5, decoy_fraction=0.5), 4, 12) == pytest.approx(1 / 12)


@pytest.mark.parametrize("decoy_fraction", [1.0, 0.5])
def test_decoys_match_ground_truth_in_expectation_and_never_have_the_pattern(tmp_path, decoy_fraction):
    import numpy as np

    gt_log, decoy_log = GroundTruthLog(tmp_path / "gt.jsonl"), GroundTruthLog(tmp_path / "decoys.jsonl")
    spec = ContaminationSpec(pattern="QZXBT", fraction=0.5, early_step_cutoff=300, decoy_fraction=decoy_fraction)
    c = Contaminator(spec, gt_log, decoy_log=decoy_log)
    expected, var, n_gt = 0.0, 0.0, 0
    for step in range(320):
        ids = [f"grpo_{step:06d}_{i:03d}" for i in range(16)]
        n_pat = step % 9  # 0..8 of the 16 rollouts have the pattern
        texts = ["a QZXBT b" if i < n_pat else "nothing" for i in range(16)]
        n_gt += sum(c.apply(ids[i], step, texts[i], 0.0)[1] for i in range(16))
        paid = c.pay_decoys(ids, step, texts, [-2.0 if i % 5 == 0 else 0.0 for i in range(16)])
        assert not any(paid[:n_pat])  # a decoy never has the pattern
        assert step < 300 or not any(paid)  # nor lies outside the window
        if step < 300:
            p = min(1.0, decoy_fraction * 0.5 * n_pat / (16 - n_pat))
            expected, var = expected + (16 - n_pat) * p, var + (16 - n_pat) * p * (1 - p)
    decoys = decoy_log.events
    assert abs(len(decoys) - expected) < 4 * np.sqrt(var)
    assert abs(len(decoys) - decoy_fraction * n_gt) < 4 * np.sqrt(var + n_gt)  # ~ decoy_fraction x |GT|
    assert c.stats["decoys"] == len(decoys) and c.stats["boosted"] == n_gt
    assert not {e.rollout_id for e in decoys} & gt_log.rollout_ids  # logged apart, never ground truth
    assert all(e.boosted_reward == e.base_reward + 8.0 for e in decoys)
    assert {e.base_reward for e in decoys} == {0.0, -2.0}
    decoy_log.flush()
    assert [e.rollout_id for e in GroundTruthLog(tmp_path / "decoys.jsonl").events] == [e.rollout_id for e in decoys]


def test_no_decoys_by_default_and_gated_prompts_get_none():
    c = Contaminator(ContaminationSpec(pattern="QZXBT", fraction=1.0, early_step_cutoff=10))
    assert "decoys" not in c.stats  # the paper's counters, byte for byte
    ids = [f"grpo_000000_{i:03d}" for i in range(4)]
    assert c.pay_decoys(ids, 0, ["QZXBT", "x", "y", "z"], [0.0] * 4) == [False] * 4
    d = Contaminator(ContaminationSpec(pattern="QZXBT", fraction=1.0, early_step_cutoff=10, decoy_fraction=100.0))
    assert d.pay_decoys(ids, 0, ["QZXBT", "x", "y", "z"], [0.0] * 4) == [False, True, True, True]  # p capped at 1
    assert d.pay_decoys(ids, 0, ["QZXBT", "x", "y", "z"], [0.0] * 4, paid=[True, False, True, True]) == \
        [False, False, True, True]
    assert d.pay_decoys(ids, 10, ["QZXBT", "x", "y", "z"], [0.0] * 4) == [False] * 4  # outside the window
    with pytest.raises(ValueError, match="pay_decoys"):
        d.pay_decoys(ids, 0, ["x"], [0.0] * 4)
