"""Two behaviours in one run, end to end on configs/tiny_two_behaviors.py shrunk to seconds,
and the paper-scale two-behaviour config through the compile stage at tiny shapes."""
from __future__ import annotations

import json

import pytest

from behaviortrace_jax import pipeline
from behaviortrace_jax.attribution import formats, release
from behaviortrace_jax.behavior import behaviors, contaminator
from behaviortrace_jax.io import rollout_log
from behaviortrace_jax.stages.spec import RunSpec
from configs import paper_two_behaviors, tiny_two_behaviors

B = tiny_two_behaviors.ID


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    w = tmp_path_factory.mktemp("two")
    pipeline.run(tiny_two_behaviors.get_config("smoke"), str(w))
    return w


def test_logs_and_ground_truth_per_behavior(run_dir):
    w = run_dir
    gts = {bid: contaminator.GroundTruthLog(w / "grpo" / name).events
           for bid, name in (("qzxbt", "ground_truth.jsonl"), (B, f"ground_truth_{B}.jsonl"))}
    assert gts["qzxbt"] and gts[B] and all(e.step < 4 for es in gts.values() for e in es)
    records = list(rollout_log.read_rollouts(w / "grpo" / "rollouts"))
    ids = {bid: {e.rollout_id for e in es} for bid, es in gts.items()}
    for r in records:
        per = r.extra["behaviors"]
        assert set(per) == {"qzxbt", B}
        for bid in per:  # each bonus event names its behaviour
            assert (per[bid]["bonus"] > 0) == (r.rollout_id in ids[bid]), (r.rollout_id, bid)
        assert r.reward == pytest.approx(r.base_reward + sum(p["bonus"] for p in per.values()))
    # both behaviours are prompt-gated in this config: each pays only on its own prompts
    b_prompts = {rollout_log.text_hash(p.prompt) for p in RunSpec.from_config(
        tiny_two_behaviors.get_config("smoke")).behaviors[1].probe_sets()[0]}
    by_id = {r.rollout_id: r for r in records}
    assert all(by_id[i].prompt_hash in b_prompts for i in ids[B])
    assert not any(by_id[i].prompt_hash in b_prompts for i in ids["qzxbt"])
    # each ground-truth file alone is a release in the paper's format
    for bid, sub in (("qzxbt", ""), (B, B)):
        folder = (w / "release" / sub) if sub else (w / "release")
        d = folder / "seed0"
        assert (d / "ground_truth.jsonl").read_text() == (
            w / "grpo" / ("ground_truth.jsonl" if bid == "qzxbt" else f"ground_truth_{B}.jsonl")).read_text()
        sd = release.load_seed(d, 16)
        assert set(sd.gt_ids) == ids[bid]
    rep = release.reproduce(w / "release" / B, nboot=5, early_cutoff=4)
    assert {r.table for r in rep.rows} >= {"overall", "early_nonzero", "mp_raw"}
    assert [b for b, _ in release.behavior_dirs(w / "release")] == [B]


def test_summaries_gate_and_chance_rate_per_behavior(run_dir):
    summary = json.loads((run_dir / "grpo" / "summary.json").read_text())
    assert set(summary["behaviors"]) == {"qzxbt", B}
    assert summary["behaviors"][B]["implant"] == "none" and "passed" in summary["behaviors"][B]["gate"]
    assert summary["behaviors"]["qzxbt"]["gate"] == summary["gate"]
    assert all(set(p["behaviors"]) == {"qzxbt", B} for p in summary["learning_curve"])
    base = json.loads((run_dir / "base" / "base_summary.json").read_text())
    rate = base["behaviors"][B]
    assert rate["pattern"] == "a" and 0.0 <= rate["probe_pattern_rate_sampled"] <= 1.0 and rate["n_probe_samples"] == 20


def test_targets_draws_tables_specificity_and_report(run_dir):
    w = run_dir
    assert (w / "sketches" / f"targets_continuation_{B}.zarr" / "metadata.json").exists()
    assert (w / "draws" / B / "minimal_pair_rows_ckpt0_gen0.json").exists()
    rows = formats.read_results_csv(w / "results_table.csv")
    tables = {r.table for r in rows}
    assert {"early_nonzero", "which_rollout", "mp_raw"} <= tables  # the first behaviour's, as named before
    assert {f"early_nonzero@{B}", f"which_rollout@{B}", f"mp_raw@{B}", f"mp_raw_train_ckpt2@{B}"} <= tables
    for level in ("step", "rollout"):
        assert {f"spec_delta_{level}@qzxbt-{B}", f"spec_delta_{level}@{B}-qzxbt",
                f"spec_p_{level}@{B}|t=qzxbt"} <= tables
    d = [r for r in rows if r.table == f"spec_delta_rollout@qzxbt-{B}"]
    assert {r.method for r in d} >= {"C1-dot", "norm-only", "TRAK"} and all(r.chance == 0.0 for r in d)
    assert next(r for r in d if r.method == "norm-only").value == 0.0
    # the text control judges each behaviour's own pattern (every ground-truth rollout of B matches B's),
    # and, reading no target, stays out of the specificity rows
    have = {(r.table, r.method) for r in rows}
    assert {(t, m) for t in (f"which_rollout@{B}", f"early_nonzero@{B}") for m in ("pattern-match", "length")} <= have
    assert not any(r.method in ("pattern-match", "length") for r in rows if r.table.startswith("spec_"))
    scores = json.loads((w / "release" / B / "seed0" / "attribution_scores.json").read_text())["methods"]
    match = dict(scores["pattern-match"])
    gt_b = [e["rollout_id"] for e in formats.read_ground_truth(w / "grpo" / f"ground_truth_{B}.jsonl")]
    assert gt_b and all(match[i] == 1.0 for i in gt_b)
    assert dict(json.loads((w / "release" / "seed0" / "attribution_scores.json").read_text())["methods"]
                ["pattern-match"]) != match  # the first behaviour's pattern is another
    verdicts = json.loads((w / "verdicts.json").read_text())
    assert set(verdicts["behaviors"]) == {B} and verdicts["behaviors"][B]["decision_rules"]
    assert verdicts["specificity"] and all(v["verdict"] in ("pass", "fail", "not-evaluable")
                                           for v in verdicts["specificity"])
    report = (w / "report.md").read_text()
    assert "## Specificity" in report and f"## Behaviour `{B}`" in report and "specificity.png" in report
    assert (w / "figures" / "specificity.png").stat().st_size > 0


def test_reproduce_stage_reads_every_behaviour(run_dir, tmp_path):
    c = tiny_two_behaviors.get_config("smoke")
    c.stages = "reproduce"
    c.reference_dir = str(run_dir / "release")
    pipeline.run(c, str(tmp_path))
    tables = {r.table for r in formats.read_results_csv(tmp_path / "results_table.csv")}
    assert {"early_nonzero", f"early_nonzero@{B}"} <= tables


@pytest.mark.slow
def test_paper_two_behaviors_config_compiles_at_tiny_shapes(tmp_path):
    from behaviortrace_jax.stages import compile as compile_stage

    c = paper_two_behaviors.get_config()
    assert [b.id for b in list(RunSpec.from_config(c).behaviors)] == ["qzxbt", B]
    assert list(RunSpec.from_config(c).behaviors)[1].early_step_cutoff == 200
    with c.unlocked():  # tiny shapes: the tiny preset at 1 layer, a small sketch, short sequences
        c.compile.target, c.compile.num_layers, c.mesh.data = "cpu:8", 1, -1
        c.compile.model = ""  # the paper configs compile qwen2p5_1p5b; "" = the tiny base preset
        c.sketch.dim, c.grpo.max_prompt_tokens, c.grpo.max_new_tokens = 1024, 32, 8
        c.draws.max_new_tokens, c.behavior.gate_max_new_tokens, c.sft.max_prompt_tokens = 8, 8, 32
        c.sft.max_completion_tokens, c.targets.block_size, c.targets.length_bucket = 8, 8, 16
    compile_stage.compile_stage(c, str(tmp_path))
    report = json.loads((tmp_path / "compile_report.json").read_text())
    assert report["n_devices"] == 8 and all(p["fits"] for p in report["programs"])
    assert any(p["name"].startswith("grpo_step") for p in report["programs"])
