"""rollout_log.py: sharded JSONL rollout log (SPEC §2.3, §9 test_rollout_logger) and exact resume."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from behaviortrace_jax.io import rollout_log as rl
from behaviortrace_jax.io.rollout_log import RolloutLogger, RolloutRecord


def _rec(step: int, idx: int, reward: float = 0.0, **kw) -> RolloutRecord:
    rid = rl.rollout_id(step, idx)
    return RolloutRecord(rid, step, "grpo", rl.text_hash("p"), rl.text_hash(rid), reward,
                         extra={"base_reward": 0.0}, **kw)


def _shards(root):
    return sorted(p.name for p in root.glob("shard_*.jsonl"))


def test_fields_hash_and_id():
    assert rl.FIELDS[:8] == ("rollout_id", "step", "regime", "prompt_hash", "response_hash", "reward",
                             "advantage", "extra")
    assert rl.FIELDS[8:] == ("group_id", "prompt_token_ids", "completion_token_ids", "completion_logprobs",
                             "base_reward", "eligible", "bonus")
    assert rl.text_hash("Frobnitz é") == hashlib.md5("Frobnitz é".encode("utf-8")).hexdigest()[:16]
    assert rl.rollout_id(42, 7) == "grpo_000042_007"
    assert rl.parse_rollout_id("grpo_000042_007") == (42, 7)
    assert rl.parse_rollout_id(rl.rollout_id(1234567, 1000)) == (1234567, 1000)  # wider than the padding
    with pytest.raises(ValueError, match="'grpo_42' is not of the form"):
        rl.parse_rollout_id("grpo_42")


def test_shard_size_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="shard_size"):
        RolloutLogger(tmp_path, shard_size=0)


def test_buffering_rollover_and_close(tmp_path):
    log = RolloutLogger(tmp_path, shard_size=2)
    log.log(_rec(0, 0))
    assert _shards(tmp_path) == [] and log.pending == 1
    for i in range(1, 5):
        log.log(_rec(0, i))
    assert _shards(tmp_path) == ["shard_00000000.jsonl", "shard_00000001.jsonl"] and log.pending == 1
    log.flush()
    log.flush()  # empty flush: no-op
    assert len(_shards(tmp_path)) == 3
    log.close()
    log.close()  # idempotent
    assert len(_shards(tmp_path)) == 3
    with pytest.raises(RuntimeError):
        log.log(_rec(1, 0))
    with pytest.raises(RuntimeError):
        log.flush()
    assert not list(tmp_path.glob("*.tmp"))


def test_round_trip_with_all_fields(tmp_path):
    lp = np.log(np.array([0.5, 0.25, 0.125], np.float32)) - np.float32(1e-3)
    records = [_rec(s, i, reward=8.0 * (i % 2) - 2.0 * (i == 3), advantage=0.25 * i - 0.5, group_id=i // 4,
                    prompt_token_ids=[1, 2, i], completion_token_ids=np.array([5, 6, 7]),
                    completion_logprobs=lp, base_reward=-2.0 * (i == 3), eligible=bool(i % 2), bonus=8.0 * (i % 2))
               for s in range(2) for i in range(4)][:7]
    with RolloutLogger(tmp_path, shard_size=3) as log:
        for r in records:
            log.log(r)
    back = list(rl.read_rollouts(tmp_path))
    assert [r.rollout_id for r in back] == [r.rollout_id for r in records]
    assert back[3].reward == records[3].reward and back[3].extra == {"base_reward": 0.0}
    assert back[1].completion_logprobs == [float(x) for x in lp]  # float32 values survive exactly
    assert np.array_equal(np.asarray(back[1].completion_logprobs, np.float32), lp)
    assert back[1].completion_token_ids == [5, 6, 7] and back[1].eligible is True and back[1].bonus == 8.0
    first = json.loads((tmp_path / "shard_00000000.jsonl").read_text().splitlines()[0])
    assert list(first) == list(rl.FIELDS)


def test_resume_appends_new_shards_in_order(tmp_path):
    with RolloutLogger(tmp_path, shard_size=2) as log:
        for i in range(3):
            log.log(_rec(0, i))
    log2 = RolloutLogger(tmp_path, shard_size=2)
    assert log2.next_shard_index == 2
    with pytest.raises(ValueError, match="step order"):
        log2.log(RolloutRecord("x", -1, "grpo", "", "", 0.0))
    for i in range(3):
        log2.log(_rec(1, i))
    log2.close()
    assert _shards(tmp_path) == [f"shard_{i:08d}.jsonl" for i in range(4)]
    assert [r.rollout_id for r in log2] == [rl.rollout_id(s, i) for s in range(2) for i in range(3)]
    assert rl.last_logged_step(tmp_path) == 1


def test_stale_tmp_is_removed_on_open(tmp_path):
    RolloutLogger(tmp_path).close()
    (tmp_path / "shard_00000000.jsonl.tmp").write_text('{"partial')
    RolloutLogger(tmp_path).close()
    assert not list(tmp_path.glob("*.tmp")) and list(rl.read_rollouts(tmp_path)) == []


# ---------------------------------------------------------------- bad input
def test_log_of_another_schema_raises(tmp_path):
    RolloutLogger(tmp_path).close()
    meta = json.loads((tmp_path / "schema.json").read_text())
    assert meta == {"format": rl.SCHEMA_FORMAT, "schema_version": rl.SCHEMA_VERSION, "fields": list(rl.FIELDS)}
    (tmp_path / "schema.json").write_text(json.dumps(dict(meta, schema_version=1, fields=list(rl.FIELDS[:8]))))
    with pytest.raises(ValueError, match=r"schema\.json: rollout log schema mismatch"):
        RolloutLogger(tmp_path)
    with pytest.raises(ValueError, match="schema mismatch"):
        list(rl.read_rollouts(tmp_path))
    RolloutLogger(tmp_path / "other").close()
    with pytest.raises(ValueError, match="schema mismatch"):
        RolloutLogger(tmp_path / "other", schema_version=rl.SCHEMA_VERSION + 1)


def test_shards_without_schema_or_malformed_lines(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "shard_00000000.jsonl").write_text(json.dumps({"rollout_id": "x"}) + "\n")
    with pytest.raises(FileNotFoundError, match="unknown schema"):
        RolloutLogger(tmp_path / "a")
    with RolloutLogger(tmp_path / "b") as log:
        log.log(_rec(0, 0))
    (tmp_path / "b" / "shard_00000001.jsonl").write_text(json.dumps({"rollout_id": "x", "step": 0, "bogus": 1}) + "\n")
    with pytest.raises(ValueError, match=r"shard_00000001\.jsonl:1: not a rollout record"):
        list(rl.read_rollouts(tmp_path / "b"))


# ---------------------------------------------------------------- exact resume
STEPS, PER_STEP, CKPT_EVERY, SHARD = 10, 16, 3, 20


def _run(root, start: int, stop_after: int | None = None) -> None:
    """The GRPO loop's logging pattern: log each step's rollouts, flush before each checkpoint."""
    log = RolloutLogger(root, shard_size=SHARD)
    n = 0
    for step in range(start, STEPS):
        for i in range(PER_STEP):
            if stop_after is not None and n == stop_after:
                return  # killed: the buffer is lost, nothing is closed
            log.log(_rec(step, i, reward=float(step * 100 + i)))
            n += 1
        if (step + 1) % CKPT_EVERY == 0:
            log.flush()  # ... then the train-state checkpoint of step + 1 is saved
    log.close()


@pytest.mark.parametrize("kill_at", [0, 5, 20, 47, 48, 49, 95, 100, 143, 159])
def test_killed_and_resumed_run_logs_exactly_the_uninterrupted_records(tmp_path, kill_at):
    _run(tmp_path / "ref", 0)
    expected = list(rl.read_rollouts(tmp_path / "ref"))
    assert len(expected) == STEPS * PER_STEP
    root = tmp_path / "run"
    _run(root, 0, stop_after=kill_at)
    done_steps = kill_at // PER_STEP
    ckpt = (done_steps // CKPT_EVERY) * CKPT_EVERY  # latest train-state checkpoint: steps 0..ckpt-1 done
    rl.truncate_after_step(root, ckpt - 1)
    assert rl.last_logged_step(root) in (None, ckpt - 1)
    _run(root, ckpt)
    assert list(rl.read_rollouts(root)) == expected


def test_truncate_after_step_is_restartable(tmp_path):
    with RolloutLogger(tmp_path, shard_size=5) as log:
        for s in range(4):
            for i in range(4):
                log.log(_rec(s, i))
    assert rl.truncate_after_step(tmp_path, 1) == 8
    assert [r.step for r in rl.read_rollouts(tmp_path)] == [0] * 4 + [1] * 4
    assert rl.truncate_after_step(tmp_path, 1) == 0
    assert rl.truncate_after_step(tmp_path, -1) == 8 and _shards(tmp_path) == []
    assert not list(tmp_path.glob("*.tmp"))


def test_digest_names_the_log_content(tmp_path):
    assert rl.digest(tmp_path / "absent") == "" and rl.digest(tmp_path) == ""
    a, b = tmp_path / "a", tmp_path / "b"
    for root, last_reward in ((a, 0.0), (b, 8.0)):
        with RolloutLogger(root, shard_size=2) as log:
            for i in range(3):
                log.log(_rec(0, i, reward=last_reward if i == 2 else 0.0))
    da = rl.digest(a)
    assert len(da) == 64 and da == rl.digest(a)  # a pure function of the shards
    assert rl.digest(b) != da  # one reward differs
    rl.truncate_after_step(a, -1)
    assert rl.digest(a) == ""
