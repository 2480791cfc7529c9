"""Watching a run: the per-step TensorBoard scalars of the grpo stage, ``grpo/progress.json`` and the
``status`` stage (on the finished smoke run and on a copy of it cut back to mid-GRPO)."""
import json
import pathlib
import shutil
import struct

import numpy as np
import pytest

from behaviortrace_jax import pipeline
from behaviortrace_jax.io import progress as progress_lib, rollout_log
from behaviortrace_jax.io.layout import RunLayout
from behaviortrace_jax.io.sketch_store import SketchStore
from behaviortrace_jax.stages import status as status_lib
from behaviortrace_jax.stages.spec import RunSpec
from configs import tiny


def read_scalars(tb_dir: pathlib.Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of every scalar in the tfevents files under ``tb_dir``, read with the
    TFRecord framing (length, masked CRC32C of it, an ``Event`` proto, its masked CRC32C; every CRC
    checked) and tensorboardX's ``Event`` proto (tensorboard itself is not installed)."""
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c

    out: dict[str, dict[int, float]] = {}
    files = sorted(tb_dir.glob("events.out.tfevents.*"))
    assert files, f"no event files under {tb_dir}"
    for f in files:
        data, pos = f.read_bytes(), 0
        while pos < len(data):
            header = data[pos:pos + 8]
            (n,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", data[pos + 8:pos + 12])[0] == masked_crc32c(header), f"{f}: bad length CRC"
            body = data[pos + 12:pos + 12 + n]
            assert struct.unpack("<I", data[pos + 12 + n:pos + 16 + n])[0] == masked_crc32c(body), f"{f}: bad CRC"
            pos += 16 + n
            event = event_pb2.Event.FromString(body)
            for v in event.summary.value:
                out.setdefault(v.tag, {})[int(event.step)] = float(v.simple_value)
    return out


@pytest.fixture(scope="module")
def smoke_scalars(smoke_finished):
    return read_scalars(RunLayout(smoke_finished).tensorboard)


def _by_step(records):
    steps = {}
    for r in records:
        steps.setdefault(r.step, []).append(r)
    return steps


def test_event_files_hold_the_per_behaviour_scalars_of_every_step(smoke_finished, smoke_scalars):
    config = tiny.get_config("smoke")
    run = RunLayout(smoke_finished)
    steps = list(range(config.grpo.steps))
    bid = config.behavior.id
    tags = [f"grpo/{bid}/reward_mean", f"grpo/{bid}/reward_std", f"grpo/{bid}/pattern_rate", f"grpo/{bid}/bonuses",
            "grpo/reward", "grpo/reward_std", "grpo/loss", "grpo/grad_norm", "grpo/grad_clip_factor",
            "grpo/grad_clipped", "sketch/step_sketch_norm", "perf/step_time_s", "perf/sample_time_s",
            "perf/tokens_per_s", "perf/completion_tokens"]
    for tag in tags:
        assert sorted(smoke_scalars.get(tag, {})) == steps, tag
    by_step = _by_step(rollout_log.read_rollouts(run.rollouts))
    step_sketches = SketchStore.open(run.sketch_store("step_sketches")).read()
    clip = SketchStore.open(run.sketch_store("step_clip_factors")).read()
    for s in steps:  # each scalar is what the run logged elsewhere, recomputed from those logs
        rewards = np.array([r.reward for r in by_step[s]], np.float32)
        assert smoke_scalars[f"grpo/{bid}/reward_mean"][s] == pytest.approx(float(rewards.mean()), rel=1e-6, abs=1e-6)
        assert smoke_scalars[f"grpo/{bid}/reward_std"][s] == pytest.approx(float(rewards.std()), rel=1e-6, abs=1e-6)
        assert smoke_scalars[f"grpo/{bid}/bonuses"][s] == sum(r.bonus > 0 for r in by_step[s])
        assert smoke_scalars[f"grpo/{bid}/pattern_rate"][s] == smoke_scalars["grpo/qzxbt"][s]
        assert smoke_scalars["perf/completion_tokens"][s] == sum(len(r.completion_token_ids) for r in by_step[s])
        assert smoke_scalars["sketch/step_sketch_norm"][s] == pytest.approx(
            float(np.linalg.norm(step_sketches[s].astype(np.float64))), rel=1e-6)
        assert smoke_scalars["grpo/grad_clip_factor"][s] == pytest.approx(float(clip[s]), rel=1e-6)
        assert smoke_scalars["grpo/grad_clipped"][s] == float(clip[s] < 1.0)
        assert smoke_scalars["perf/step_time_s"][s] > 0 and smoke_scalars["perf/tokens_per_s"][s] > 0
    for key in ("probe_rate", "control_rate"):
        assert set(smoke_scalars[f"behavior/{key}"]) == {e["step"] for e in json.loads(run.curve.read_text())}


def test_progress_json_of_the_finished_run(smoke_finished):
    config = tiny.get_config("smoke")
    p = progress_lib.read_progress(RunLayout(smoke_finished).progress)
    assert p["step"] == p["steps"] == config.grpo.steps and p["start_step"] == 0
    assert len(p["step_s"]) == config.grpo.steps and p["last_checkpoint"] == config.grpo.steps
    assert progress_lib.eta_seconds(p) == 0.0
    assert p["metrics"]["reward"] == pytest.approx(read_scalars(RunLayout(smoke_finished).tensorboard)["grpo/reward"][
        config.grpo.steps - 1])


def test_eta_counts_the_steps_and_checkpoints_left():
    p = progress_lib.progress_record(None, step=1, steps=10, start_step=0, started=0.0, step_s=100.0, metrics={},
                                     checkpoint=None, checkpoint_every=4, now=1.0)
    for s, t in ((2, 2.0), (3, 3.0)):
        p = progress_lib.progress_record(p, step=s, steps=10, start_step=0, started=0.0, step_s=t, metrics={},
                                         checkpoint=None, checkpoint_every=4, now=float(s))
    assert p["step_s"] == [100.0, 2.0, 3.0] and p["checkpoint_s"] is None
    p = progress_lib.progress_record(p, step=4, steps=10, start_step=0, started=0.0, step_s=2.0, metrics={},
                                     checkpoint={"step": 4, "seconds": 7.0}, checkpoint_every=4, now=4.0)
    # 6 steps left at the median 2.5 s (the compile-slow first step does not count), and checkpoints at 8 and 10
    assert progress_lib.eta_seconds(p) == pytest.approx(6 * 2.5 + 2 * 7.0)
    assert p["last_checkpoint"] == 4


def _status(config, workdir, capsys) -> str:
    config.stages = "status"
    before = sorted((p.relative_to(workdir).as_posix(), p.stat().st_mtime_ns) for p in workdir.rglob("*"))
    pipeline.run(config, str(workdir))
    after = sorted((p.relative_to(workdir).as_posix(), p.stat().st_mtime_ns) for p in workdir.rglob("*"))
    assert before == after  # status writes nothing (not even run_info.json)
    return capsys.readouterr().out


def test_status_of_the_finished_run(smoke_finished, capsys):
    config = tiny.get_config("smoke")
    out = _status(config, smoke_finished, capsys)
    summary = json.loads(RunLayout(smoke_finished).summary.read_text())
    for stage in ("base", "sft", "sketch", "draws", "evaluate", "report"):
        assert any(line.split()[:2] == [stage, "done"] for line in out.splitlines()), (stage, out)
    assert f"grpo      done ({config.grpo.steps} steps)" in out
    assert f"last checkpoint: step {config.grpo.steps} " in out
    assert ("emergence gate: PASSED" if summary["gate"]["passed"] else "emergence gate: FAILED") in out
    log = rollout_log.digest(RunLayout(smoke_finished).rollouts)
    assert f"digest rollout log (steps 0-{config.grpo.steps - 1}): sha256 {log}" in out
    assert "digest results_table.csv: sha256" in out  # pipeline.run's own digest lines follow


def cut_back_to_mid_grpo(src: pathlib.Path, dest: pathlib.Path, step: int, checkpoint: int) -> pathlib.Path:
    """A copy of the finished run ``src`` as a kill after GRPO step ``step - 1`` leaves it, with the
    last checkpoint at step ``checkpoint`` <= ``step``: the start state, ``grpo/`` without its summary,
    the rollout log and ground truth as flushed at that checkpoint, the train states, HF exports and
    registry entries up to it, the learning curve up to it, and ``progress.json`` as the loop wrote
    it after ``step`` steps (the finished run's step times and metrics of those steps)."""
    for sub in ("base", "sft", "grpo"):
        shutil.copytree(src / sub, dest / sub)
    shutil.copy(src / "run_info.json", dest / "run_info.json")
    run = RunLayout(dest)
    run.summary.unlink()
    rollout_log.truncate_after_step(run.rollouts, checkpoint - 1)
    gt = [line for line in run.ground_truth.read_text().splitlines(keepends=True)
          if rollout_log.parse_rollout_id(json.loads(line)["rollout_id"])[0] < checkpoint]
    run.ground_truth.write_text("".join(gt))
    for d in run.state.iterdir():
        if d.name.isdigit() and int(d.name) > checkpoint:
            shutil.rmtree(d)
    for d in run.checkpoints.iterdir():
        if int(d.name.split("_")[1]) > checkpoint:
            shutil.rmtree(d)
    reg = json.loads(run.registry.read_text())
    reg["checkpoints"] = [e for e in reg["checkpoints"] if e["step"] <= checkpoint]
    run.registry.write_text(json.dumps(reg))
    run.curve.write_text(json.dumps([c for c in json.loads(run.curve.read_text()) if c["step"] <= checkpoint]))
    done = json.loads((src / "grpo" / "progress.json").read_text())
    p = None
    for s in range(1, step + 1):
        p = progress_lib.progress_record(p, step=s, steps=done["steps"], start_step=0, started=done["started"],
                                         step_s=done["step_s"][s - 1], metrics=done["metrics"],
                                         checkpoint={"step": s, "seconds": 0.5} if s == checkpoint else None,
                                         checkpoint_every=done["checkpoint_every"], now=done["started"] + s)
    run.progress.write_text(json.dumps(p))
    return dest


def test_status_of_a_run_killed_mid_grpo(smoke_finished, tmp_path, capsys):
    config = tiny.get_config("smoke")
    steps, every = config.grpo.steps, config.grpo.checkpoint_every
    w = cut_back_to_mid_grpo(smoke_finished, tmp_path / "w", step=every + 1, checkpoint=every)
    assert json.loads(RunLayout(smoke_finished).registry.read_text())  # the source is untouched
    out = _status(config, w, capsys)
    assert f"grpo      step {every + 1}/{steps} (" in out and ", ETA " in out and "[progress.json]" in out
    for stage in ("sketch", "draws", "evaluate", "report"):
        assert f"{stage:<8}  not started" in out
    assert f"last checkpoint: step {every} " in out and f"train state step {every} " in out
    assert f"emergence gate: not yet (decided when grpo ends); at checkpoint step {every} it would be " in out
    assert "latest step: reward " in out
    log = rollout_log.digest(RunLayout(w).rollouts)
    assert f"digest rollout log (steps 0-{every - 1}): sha256 {log}" in out

    # progress.json half-written by a crash (or absent): the rollout log gives the step
    RunLayout(w).progress.write_text('{"stage": "grpo", "st')
    lines = status_lib.status_lines(config, str(w))
    assert any(f"grpo      step {every}/{steps} (" in line and "[rollout log" in line for line in lines), lines


def test_status_needs_an_existing_run(tmp_path):
    config = tiny.get_config("smoke")
    config.stages = "status"
    with pytest.raises(FileNotFoundError, match="no such run directory"):
        pipeline.run(config, str(tmp_path / "absent"))
    assert not (tmp_path / "absent").exists()


def test_watch_metrics_per_behaviour_of_a_two_behaviour_step():
    """Each behaviour's reward statistics are over the rollouts of its own prompts; its pattern rate
    over every rollout; a behaviour none of whose prompts the step sampled gets no reward point."""
    import types

    from behaviortrace_jax.train.grpo_logs import step_scalars, watch_metrics

    behaviors = [types.SimpleNamespace(id="a", pattern="AAA"), types.SimpleNamespace(id="b", pattern="BBB"),
                 types.SimpleNamespace(id="c", pattern="CCC")]
    own_prompts = {"a": {"pa"}, "b": {"pb"}, "c": {"pc"}}
    rewards = np.array([1.0, 3.0, 8.0, 0.0], np.float32)
    texts = ["AAA", "x", "BBB AAA", "y"]
    out = {"clip_factor": np.float32(1.0), "step_sketch": np.array([3.0, 4.0], np.float32),
           "rollout_sketches": np.array([[3.0, 4.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0]], np.float32),
           "rollout_grad_norms": np.array([1.0, 2.0, 3.0, 4.0], np.float32)}
    m = watch_metrics(behaviors, own_prompts, rewards, texts, ["pa", "pa", "pb", "pb"],
                      {"a": [False] * 4, "b": [False, False, True, False], "c": [False] * 4}, out)
    assert m["a/reward_mean"] == 2.0 and m["a/reward_std"] == 1.0 and m["b/reward_mean"] == 4.0
    assert "c/reward_mean" not in m and m["c/pattern_rate"] == 0.0
    assert m["a/pattern_rate"] == 0.5 and m["b/pattern_rate"] == 0.25 and m["b/bonuses"] == 1
    assert m["grad_clip_factor"] == 1.0 and m["grad_clipped"] == 0.0 and m["step_sketch_norm"] == 5.0
    assert m["rollout_sketch_norm_mean"] == pytest.approx((5 + 1 + 0 + 1) / 4) and m["rollout_grad_norm_mean"] == 2.5
    tags = step_scalars({**m, "step_time_s": 1.0, "reward": 3.0})
    assert tags["grpo/a/reward_mean"] == 2.0 and tags["perf/step_time_s"] == 1.0 and tags["grpo/reward"] == 3.0
    assert tags["sketch/step_sketch_norm"] == 5.0 and tags["sketch/rollout_grad_norm_mean"] == 2.5


def test_status_line_of_the_causal_gate(tmp_path):
    """status's ``cause`` line: not started, the replays written so far of 2 x streams, then the
    primary verdict read from cause/gate.json (a gate.json as the cause stage writes it)."""
    config = tiny.get_config()
    spec, run = RunSpec.from_config(config), RunLayout(tmp_path)
    line = status_lib.STAGE_LINES["cause"]
    assert line(spec, run) == "not started"
    for j in range(3):
        (run.cause / "replays" / f"regenerated{j}" / "base").mkdir(parents=True)
        (run.cause / "replays" / f"regenerated{j}" / "base" / "k.json").write_text("{}")
    assert line(spec, run) == f"replays 3/{2 * config.cause.streams} (baseline and withhold-every-bonus per stream)"
    verdict = {"measure": "probe_rate", "status": "acted", "effect_delta": 0.693, "effect_ci_low": 0.6017,
               "effect_ci_high": 0.7842, "delta_over_sd": 7.65}
    run.cause_gate.write_text(json.dumps({"primary": "probe_rate", "streams": 8, "measure_step": 100,
                                          "verdicts": [{"measure": "leakage_rate", "status": "acted"}, verdict]}))
    assert line(spec, run) == "done: probe_rate acted, Δ 0.693 [0.602, 0.784], 7.65 floor sd, 8 streams, step 100"
    from behaviortrace_jax.stages.registry import load_stages

    load_stages()
    assert "cause" in status_lib.run_stages(spec, run)  # the tiny default's stages name it
