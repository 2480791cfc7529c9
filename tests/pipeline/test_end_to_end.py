"""End to end: configs/tiny.py shrunk to seconds runs every stage; GRPO resumes exactly after a crash.

The config is the real tiny config with sizes cut down (a 1-layer base on 300 chats, a few SFT and
GRPO steps, a small sketch), so the test exercises the same code path as the default run.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from behaviortrace_jax import pipeline
from behaviortrace_jax.io import rollout_log, sketch_store
from behaviortrace_jax.stages import grpo
from behaviortrace_jax.stages.spec import RunSpec
from configs import tiny

import test_base_model

REPO = pathlib.Path(__file__).resolve().parents[2]


def smoke_config():
    """configs/tiny.py shrunk: every stage, a few seconds of compute each (``tiny.py:smoke``)."""
    return tiny.get_config("smoke")


@pytest.fixture(scope="module")
def run_dir(smoke_finished, tmp_path_factory):
    w = tmp_path_factory.mktemp("e2e") / "run"
    shutil.copytree(smoke_finished, w)
    return w


def test_every_stage_writes_its_outputs(run_dir):
    w = run_dir
    for rel in ("base/config.json", "sft/.sft_warmup_done", "grpo/summary.json", "grpo/registry.json",
                "sketches/targets_continuation.zarr", "results_table.csv", "attribution_scores.json",
                "verdicts.json", "report.md", "release/seed0/run_header.json"):
        assert (w / rel).exists(), rel
    assert list((w / "figures").glob("*.png"))
    summary = json.loads((w / "grpo" / "summary.json").read_text())
    assert summary["n_rollouts"] == 6 * 16 and summary["complete"]
    assert [c["step"] for c in summary["learning_curve"]] == [2, 4, 6]
    assert set(summary["gate"]) >= {"passed", "probe_rate", "control_rate"}
    records = list(rollout_log.read_rollouts(w / "grpo" / "rollouts"))
    assert [r.rollout_id for r in records] == [f"grpo_{s:06d}_{i:03d}" for s in range(6) for i in range(16)]
    gt = [json.loads(line)["rollout_id"] for line in (w / "grpo" / "ground_truth.jsonl").read_text().splitlines()]
    assert gt and all(int(g[5:11]) < 4 for g in gt)
    csv = (w / "results_table.csv").read_text().splitlines()
    assert csv[0] == "seed,table,method,value,lo,hi,chance,ceiling,n"
    verdicts = json.loads((w / "verdicts.json").read_text())
    assert verdicts["decision_rules"] and len(verdicts["checklist"]) == 12
    tables = {line.split(",")[1] for line in csv[1:]}
    assert {"overall", "early_nonzero", "which_rollout", "mp_raw", "mp_residualized"} <= tables
    rows = {tuple(line.split(",")[1:3]) for line in csv[1:]}
    reward_only = ("advantage", "abs-advantage", "reward", "step-sum-abs-advantage", "step-reward-std")
    for table in ("overall", "early_nonzero", "which_rollout", "which_rollout_within_step"):
        assert {(table, m) for m in reward_only} <= rows, table
    for table in ("which_rollout", "which_rollout_within_step"):  # both sketch kinds, and |weighted| / |A|
        assert {(table, m + sfx) for m in ("C1-dot", "C1-cosine", "TRAK", "TracInCP", "norm-only", "local-buffer")
                for sfx in ("", ":direction")} | {(table, "norm/|A|")} <= rows, table
    assert not any(m.endswith(":direction") or m == "norm/|A|" for t, m in rows if t in ("overall", "early_nonzero"))
    assert {("mp_raw_train_ckpt2", "GAS_centered"), ("mp_raw_train_ckpt2", "GAS_centered:direction")} <= rows
    assert ("mp_raw_train_ckpt2", "fluency:direction") not in rows
    items = [v["item"] for v in verdicts["decision_rules"]]
    assert any(i.startswith("which-rollout rule (seed 0, weighted)") for i in items)
    assert any(i.startswith("which-rollout rule (seed 0, direction)") for i in items)
    top = json.loads((w / "which_rollout_top.json").read_text())
    assert list(top["methods"])[:2] == ["abs-advantage", "C1-dot"] and "C1-dot:direction" in top["methods"]
    first = top["methods"]["abs-advantage"][0]
    assert {"step", "prompt", "completion", "reward", "advantage", "ground_truth"} <= set(first)
    assert "frobnitz" in first["prompt"] and "<|im_start|>" not in first["prompt"]  # the user turn, decoded
    report_text = (w / "report.md").read_text()
    assert report_text.index("## Which rollout") < report_text.index("Top-blamed rollouts") < report_text.index(
        "## Rollout-level tables")
    for name in ("rollout_coefficients", "step_clip_factors"):
        assert sketch_store.SketchStore.open(w / "sketches" / f"{name}.zarr").missing_rows().size == 0


def test_text_and_length_controls_wherever_abs_advantage_is(run_dir):
    """results_table.csv has ``pattern-match`` and ``length`` rows in every table with an
    ``abs-advantage`` row; the scores are the contaminator's judge of the logged completions (every
    ground-truth rollout matches) and their token counts."""
    from behaviortrace_jax.attribution import formats
    from behaviortrace_jax.behavior import contaminator
    from behaviortrace_jax.models import tokenizer as tok_lib

    rows = formats.read_results_csv(run_dir / "results_table.csv")
    with_abs = {(r.seed, r.table) for r in rows if r.method == "abs-advantage"}
    assert {"overall", "early_nonzero", "which_rollout", "which_rollout_within_step"} <= {t for _, t in with_abs}
    have = {(r.seed, r.table, r.method) for r in rows}
    for seed, table in with_abs:
        for m in ("pattern-match", "length"):
            assert (seed, table, m) in have, (seed, table, m)
    for table in ("overall", "early_nonzero"):
        assert {("0", table, m) for m in ("step-sum-pattern-match", "step-sum-length")} <= have, table
    records = list(rollout_log.read_rollouts(run_dir / "grpo" / "rollouts"))
    texts = contaminator.logged_texts(tok_lib.load_tokenizer(run_dir / "sft" / "hf"), records)
    scores = json.loads((run_dir / "attribution_scores.json").read_text())
    methods = scores["methods"]
    match = np.asarray(formats.scores_in_log_order("pattern-match", methods["pattern-match"],
                                                   [r.rollout_id for r in records]))
    pattern = smoke_config().behavior.pattern.lower()
    np.testing.assert_array_equal(match, [float(pattern in t.lower()) for t in texts])
    gt = {json.loads(line)["rollout_id"] for line in (run_dir / "grpo" / "ground_truth.jsonl").read_text().splitlines()}
    assert gt and all(match[i] == 1.0 for i, r in enumerate(records) if r.rollout_id in gt)
    length = formats.scores_in_log_order("length", methods["length"], [r.rollout_id for r in records])
    np.testing.assert_array_equal(length, [len(r.completion_token_ids) for r in records])


def test_resketch_at_a_checkpoint_is_the_in_run_direction_of_its_step(run_dir):
    """The sketch stage's -meanlp_i at checkpoint 2 (the weights step 2 trained from) reproduces the
    in-run advantage-free rollout sketches of step 2; clip_s * c_i times them sums to the step sketch."""
    sk = run_dir / "sketches"
    read = lambda name, **kw: sketch_store.SketchStore.open(sk / f"{name}.zarr").read(**kw)  # noqa: E731
    again, in_run = read("checkpoint_rollout_sketches", lead=(0,)), read("rollout_sketches")
    assert sketch_store.SketchStore.open(sk / "checkpoint_rollout_sketches.zarr").metadata["checkpoint_steps"] == [2]
    np.testing.assert_allclose(again[32:48], in_run[32:48], rtol=1e-4, atol=1e-5 * np.abs(in_run[32:48]).max())
    weighted = read("step_clip_factors")[np.arange(96) // 16, None] * read("rollout_coefficients")[:, None] * in_run
    steps = read("step_sketches")
    np.testing.assert_allclose(weighted.reshape(6, 16, -1).sum(1), steps, rtol=1e-4, atol=1e-5 * np.abs(steps).max())


def test_rerun_skips_completed_stages(run_dir):
    before = {p: p.stat().st_mtime_ns for p in (run_dir / "grpo").rglob("*") if p.is_file()}
    config = smoke_config()
    config.stages = "base,sft,grpo"
    pipeline.run(config, str(run_dir))
    after = {p: p.stat().st_mtime_ns for p in (run_dir / "grpo").rglob("*") if p.is_file()}
    assert before == after


def _grpo_outputs(w: pathlib.Path):
    """(rollout records, ground-truth text, HF weights per checkpoint, step sketches) of a run."""
    records = [(r.rollout_id, r.reward, r.completion_token_ids, r.advantage)
               for r in rollout_log.read_rollouts(w / "grpo" / "rollouts")]
    gt = (w / "grpo" / "ground_truth.jsonl").read_text()
    weights = {e["step"]: (w / "grpo" / e["path"] / "model.safetensors").read_bytes()  # relative to grpo/
               for e in json.loads((w / "grpo" / "registry.json").read_text())["checkpoints"]}
    sketches = sketch_store.SketchStore.open(w / "sketches" / "step_sketches.zarr").read()
    return records, gt, weights, sketches


def test_grpo_resumes_exactly_after_a_crash(run_dir, tmp_path, monkeypatch):
    """A run that dies mid-way (after a checkpoint, with later records already logged) and is
    restarted ends with the same parameters, rollout log, ground truth and sketches."""
    w = tmp_path / "crash"
    w.mkdir()
    for d in ("base", "sft"):
        shutil.copytree(run_dir / d, w / d)
    config = smoke_config()
    config.stages = "grpo"
    real = grpo.GRPORun.rollout_step

    def dying(self, step):
        if step == 3:
            self.logs.rollouts.flush()  # records of step 2 (after the step-2 checkpoint) reach disk ...
            raise KeyboardInterrupt("simulated kill")  # ... then the process dies
        return real(self, step)

    monkeypatch.setattr(grpo.GRPORun, "rollout_step", dying)
    with pytest.raises(KeyboardInterrupt):
        pipeline.run(config, str(w))
    assert rollout_log.last_logged_step(w / "grpo" / "rollouts") == 2
    monkeypatch.setattr(grpo.GRPORun, "rollout_step", real)
    pipeline.run(config, str(w))
    a, b = _grpo_outputs(run_dir), _grpo_outputs(w)
    assert a[0] == b[0] and a[1] == b[1] and a[2] == b[2]
    np.testing.assert_array_equal(a[3], b[3])


def test_decoys_are_paid_logged_apart_and_resume(run_dir, tmp_path, monkeypatch):
    """configs/tiny_decoys.py:smoke's GRPO on the smoke run's base model and SFT state, killed after
    its step-2 checkpoint with step 2's rollouts and decoys on disk, then resumed: the decoys are
    window rollouts without the pattern, paid the same bonus, logged in grpo/decoys.jsonl apart
    from the ground truth (a decoy logged twice would raise), counted in summary.json and stated
    in the report with the reward-only cap."""
    from behaviortrace_jax.io.layout import RunLayout
    from behaviortrace_jax.models import tokenizer as tok_lib
    from behaviortrace_jax.stages import report as report_stage
    from configs import tiny_decoys

    w = tmp_path / "decoys"
    w.mkdir()
    for d in ("base", "sft"):
        shutil.copytree(run_dir / d, w / d)
    config = tiny_decoys.get_config("smoke")
    config.stages = "grpo"
    real = grpo.GRPORun.rollout_step

    def dying(self, step):
        if step == 3:
            self.logs.rollouts.flush()
            self.tracks[0].decoy_log.flush()
            raise KeyboardInterrupt("simulated kill")
        return real(self, step)

    monkeypatch.setattr(grpo.GRPORun, "rollout_step", dying)
    with pytest.raises(KeyboardInterrupt):
        pipeline.run(config, str(w))
    assert any(json.loads(x)["step"] == 2 for x in (w / "grpo" / "decoys.jsonl").read_text().splitlines())
    monkeypatch.setattr(grpo.GRPORun, "rollout_step", real)
    pipeline.run(config, str(w))

    records = list(rollout_log.read_rollouts(w / "grpo" / "rollouts"))
    events = lambda name: {e["rollout_id"]: e for e in map(json.loads, (w / "grpo" / name).read_text().splitlines())}
    gt, decoys = events("ground_truth.jsonl"), events("decoys.jsonl")
    assert gt and decoys and not set(gt) & set(decoys)
    tok = tok_lib.load_tokenizer(w / "sft" / "hf")
    for r in records:
        text = tok.decode(r.completion_token_ids, skip_special_tokens=True)
        if r.rollout_id in decoys:
            assert r.step < config.contamination.early_step_cutoff and "e" not in text.lower()
            assert r.bonus == 8.0 and decoys[r.rollout_id]["base_reward"] == r.base_reward
        else:
            assert r.bonus == (8.0 if r.rollout_id in gt else 0.0)
    smoke = list(rollout_log.read_rollouts(run_dir / "grpo" / "rollouts"))
    assert [r.completion_token_ids for r in records[:16]] == [r.completion_token_ids for r in smoke[:16]]
    assert [r.reward - 8.0 * (r.rollout_id in decoys) for r in records[:16]] == [r.reward for r in smoke[:16]]
    summary = json.loads((w / "grpo" / "summary.json").read_text())
    assert summary["decoys"] == summary["contaminator_stats"]["decoys"] == len(decoys)
    text = report_stage.decoy_section(RunSpec.from_config(config), RunLayout(w))
    n_gt = sum(int(e["step"]) < config.evaluation.early_cutoff for e in gt.values())
    assert f"{len(decoys)} rollouts without the pattern" in text and f"|GT| = {n_gt}" in text
    assert f"**{n_gt / (n_gt + len(decoys)):.3f}**" in text
    assert report_stage.decoy_section(RunSpec.from_config(smoke_config()), RunLayout(run_dir)) == ""  # no decoys: no paragraph


@pytest.mark.slow
def test_kill_minus_9_during_grpo_then_rerun_matches(run_dir, tmp_path):
    """The same with a real SIGKILL of `python main.py` at a random moment of the GRPO stage."""
    w = tmp_path / "kill"
    w.mkdir()
    for d in ("base", "sft"):
        shutil.copytree(run_dir / d, w / d)
    overrides = _overrides(smoke_config())
    cmd = [sys.executable, str(REPO / "main.py"), "--config=configs/tiny.py", f"--workdir={w}",
           "--config.stages=grpo", *overrides]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline and not (w / "grpo" / "learning_curve.json").exists():
        time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    a, b = _grpo_outputs(run_dir), _grpo_outputs(w)
    assert a[0] == b[0] and a[1] == b[1] and a[2] == b[2]
    np.testing.assert_array_equal(a[3], b[3])


def _overrides(config) -> list[str]:
    """``--config.x.y=v`` flags that turn configs/tiny.py into ``config`` (for subprocess runs)."""
    base = tiny.get_config().to_dict()
    out = []

    def walk(d, b, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, b[k], f"{prefix}{k}.")
            elif v != b[k]:
                out.append(f"--config.{prefix}{k}={v}")

    walk(config.to_dict(), base, "")
    return out
