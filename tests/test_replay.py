"""Counterfactual replay: a toy problem with a known answer, the all-ones replay of a
smoke GRPO run reproducing its own checkpoints bit for bit, and (slow) the counterfactual stage on
that run: its tables, a rerun from its files, and a kill -9 mid-stage then rerun giving the same table."""
from __future__ import annotations

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from behaviortrace_jax import pipeline
from behaviortrace_jax.models import sharding
from behaviortrace_jax.stages import counterfactual as CF
from behaviortrace_jax.train import grpo_loss, replay as R
from behaviortrace_jax.stages.spec import RunSpec
from configs import tiny
from conftest import copy_start


# ------------------------------------------------------------------------------------------------
# Toy: 2 parameters, 8 examples over 4 SGD steps; only example 5 moves the "behaviour" parameter.
# ------------------------------------------------------------------------------------------------
X = np.array([[1.0, 0.0], [0.5, 0.0], [-1.0, 0.0], [2.0, 0.0], [0.3, 0.0], [0.0, 1.5], [-0.7, 0.0], [1.2, 0.0]],
             np.float32)
Y = np.array([1.0, -0.5, 0.3, 1.0, 0.0, 2.0, -1.0, 0.5], np.float32)
STEPS = np.array([0, 0, 1, 1, 2, 2, 3, 3])  # two examples per step


def toy_replay(weights: np.ndarray, tx=None) -> float:
    """Replays the toy run with per-example weights; behaviour = theta[1] at the end."""
    tx = tx or optax.sgd(0.1)
    theta = jnp.zeros(2)
    state = tx.init(theta)

    def loss(t, x, y, w):
        return jnp.sum(w * (x @ t - y) ** 2)

    for s in range(4):
        i = STEPS == s
        g = jax.grad(loss)(theta, X[i], Y[i], jnp.asarray(weights[i]))
        upd, state = tx.update(g, state, theta)
        theta = optax.apply_updates(theta, upd)
    return float(theta[1])


def test_leave_one_out_finds_the_one_example_and_exact_influence_has_lds_one():
    n = len(Y)
    full = toy_replay(np.ones(n, np.float32))
    loo = np.array([full - toy_replay(CF.removal_weights(n, [i])) for i in range(n)])  # drop when removed
    assert CF.top_k(loo, np.arange(n), 1).tolist() == [5]
    assert np.count_nonzero(loo) == 1
    # LDS: the exact LOO influence predicts the behaviour of random half-subsets (predicted effect
    # = sum of influence over kept examples; here the behaviour is additive in the kept set).
    subsets = CF.half_subsets(np.arange(n), 16, seed=0)
    measured = np.array([toy_replay(CF.removal_weights(n, s)) for s in subsets])
    predicted = np.array([CF.predicted_effect(loo, np.arange(n), s) for s in subsets])
    rho, lo, hi = CF.lds(predicted, measured, nboot=200, seed=0)
    assert rho > 0.99 and lo > 0.9
    rho_rand, _, _ = CF.lds(np.random.default_rng(1).normal(size=16), measured, nboot=10, seed=0)
    assert rho_rand < 0.9


def test_top_k_and_plan_helpers():
    s = np.array([0.1, 5.0, 5.0, -1.0, 3.0])
    assert CF.top_k(s, np.arange(5), 2).tolist() == [1, 2]  # ties by index
    assert CF.top_k(s, np.array([0, 3, 4]), 2).tolist() == [0, 4]  # only candidates
    assert CF.predicted_effect(np.array([1.0, -np.inf, 2.0]), np.arange(3), [2]) == 1.0
    assert all(len(x) == 5 for x in CF.half_subsets(np.arange(10), 4, 0))


def test_recomputed_advantages_match_group_advantages_when_nothing_is_removed():
    r = np.array([0, 8, 0, 0, 1, 1, 1, 1], np.float32)
    np.testing.assert_array_equal(R.recomputed_advantages(r, np.ones(8), 4, 0.0), grpo_loss.group_advantages(r, 4))
    adv = R.recomputed_advantages(r, np.array([1, 0, 1, 1, 1, 1, 1, 1]), 4, 0.0)
    assert adv[1] == 0 and np.all(adv[:4] == 0)  # the bonus rollout removed: the rest are all-equal


# ------------------------------------------------------------------------------------------------
# The replay cache: a replay is reused only under the key it was computed for.
# ------------------------------------------------------------------------------------------------
class FakeReplayer:
    """The counterfactual stage's view of a Replayer (identity, num_rollouts, run), without a model:
    the behaviour is a known function of the weights, the advantages choice and the step."""

    def __init__(self, n: int = 8, log: str = "log-a"):
        self.num_rollouts, self.log, self.calls = n, log, []

    def identity(self):
        return {"replay_version": R.REPLAY_VERSION, "step_spec": "spec", "optimizer": "opt", "rollout_log": self.log,
                "measure": "m"}

    def run(self, weights, *, measure_steps, recompute_advantages):  # the stage's default: remove, fixed
        self.calls.append((tuple(np.flatnonzero(weights == 0)), tuple(measure_steps), recompute_advantages))
        v = float(np.sum(weights * np.arange(self.num_rollouts))) + (0.5 if recompute_advantages else 0.0)
        return {"behavior": {s: {"logp_margin": v + s} for s in measure_steps}, "seconds_per_step": 0.0}


def test_replay_cache_reuses_only_replays_of_the_same_key(tmp_path, caplog):
    jobs = {"full": (np.zeros(0, np.int64), False), "C1-dot__k2": (np.array([1, 5]), False),
            "C1-dot__k2" + CF.RECOMPUTED: (np.array([1, 5]), True)}
    rp = FakeReplayer()
    CF.run_replays(rp, jobs, tmp_path, measure_steps=[2, 4], at=4)
    assert len(rp.calls) == 3
    rec = json.loads((tmp_path / "C1-dot__k2__recomputed.json").read_text())
    assert rec["value"] == 28 - 6 + 0.5 + 4 and rec["cache"]["recompute_advantages"] is True
    assert rec["cache"] == CF.cache_key(rp.identity(), np.array([1, 5]), [2, 4], 4, True)
    CF.run_replays(rp, jobs, tmp_path, measure_steps=[2, 4], at=4)  # same key: nothing replayed
    assert len(rp.calls) == 3
    # another measured step (another --config.counterfactual.measure): every replay again, new values
    with caplog.at_level("INFO"):
        CF.run_replays(rp, jobs, tmp_path, measure_steps=[2], at=2)
    assert len(rp.calls) == 6 and "stale" in caplog.text and "measure_steps" in caplog.text
    assert json.loads((tmp_path / "full.json").read_text())["value"] == 28 + 2
    # other removed ids, or the other advantages, under the same file name: that replay only
    jobs["C1-dot__k2"] = (np.array([1, 6]), False)
    CF.run_replays(rp, jobs, tmp_path, measure_steps=[2], at=2)
    assert rp.calls[6:] == [((1, 6), (2,), False)]
    jobs["C1-dot__k2"] = (np.array([1, 6]), True)
    CF.run_replays(rp, jobs, tmp_path, measure_steps=[2], at=2)
    assert rp.calls[7:] == [((1, 6), (2,), True)]
    # another run's rollout log, or another replay version: every replay again
    rp.log = "log-b"
    CF.run_replays(rp, jobs, tmp_path, measure_steps=[2], at=2)
    assert len(rp.calls) == 11


def test_stale_fields_and_cache_key():
    key = CF.cache_key({"replay_version": 1, "rollout_log": "x"}, np.array([3]), [20, 40], 40, False)
    assert key == {"replay_version": 1, "rollout_log": "x", "removed": [3], "measure_steps": [20, 40],
                   "measure_step": 40, "recompute_advantages": False, "intervention": "remove", "rollouts": "fixed"}
    assert CF.stale_fields(None, key) is None  # no file
    assert CF.stale_fields({"cache": dict(key)}, key) == []
    assert CF.stale_fields({"cache": dict(key, replay_version=0)}, key) == ["replay_version"]
    assert CF.stale_fields({"value": 1.0}, key) == list(key)  # a file written before cache keys: stale


def test_replay_jobs_add_the_recomputed_leave_outs_once():
    config = cf_config()
    removed = {"full": np.zeros(0, np.int64), "oracle__k2": np.array([0, 1]), "random0__k2": np.array([2, 3]),
               "lds000": np.array([0, 2])}
    jobs = CF.replay_jobs(config, removed)
    assert {k: rec for k, (_, rec) in jobs.items()} == {
        "full": False, "oracle__k2": False, "random0__k2": False, "lds000": False,
        "oracle__k2__recomputed": True, "random0__k2__recomputed": True}
    config.counterfactual.recompute_advantages = True  # every replay recomputed already: no second copy
    assert {k: rec for k, (_, rec) in CF.replay_jobs(config, removed).items()} == dict.fromkeys(removed, True)
    config.counterfactual.recompute_advantages, config.counterfactual.topk_recomputed = False, False
    assert list(CF.replay_jobs(config, removed)) == list(removed)


def test_recomputed_rows_are_the_top_k_table_of_the_recomputed_replays():
    removed = {"full": np.zeros(0, np.int64), "oracle__k1": np.array([0]), "C1-dot__k1": np.array([1]),
               "random0__k1": np.array([2]), "random1__k1": np.array([3]), "lds000": np.array([0]),
               "lds001": np.array([1])}
    logged = {"full": 10.0, "oracle__k1": 4.0, "C1-dot__k1": 8.0, "random0__k1": 9.0, "random1__k1": 9.5,
              "lds000": 4.0, "lds001": 8.0}
    results = {k: {"value": v} for k, v in logged.items()}
    results.update({k + CF.RECOMPUTED: {"value": v - 1.0} for k, v in logged.items() if "__k" in k})
    scores = {"C1-dot": np.array([0.0, 1.0, 0.0, 0.0])}
    rows = CF.recomputed_rows("0", results, removed, scores, np.arange(4), nboot=10)
    assert {r.table for r in rows} == {"counterfactual_topk_recomputed"}
    by = {r.method: r for r in rows}
    assert by["oracle"].value == 10.0 - 3.0 and by["C1-dot"].value == 10.0 - 7.0
    assert by["C1-dot"].ceiling == 7.0 and by["random"].chance == pytest.approx(10.0 - 8.25)
    main = CF.tables("0", {k: v for k, v in results.items() if not k.endswith(CF.RECOMPUTED)}, removed, scores,
                     np.arange(4), nboot=10)
    assert {r.table for r in main} == {"counterfactual_topk", "lds"}
    assert CF.recomputed_rows("0", {"full": {"value": 1.0}}, removed, scores, np.arange(4), nboot=10) == []
    section = CF.report_section(main + rows, None, step=4)
    assert "| 0 | logged | C1-dot | 1 | 2.0000 |" in section and "| 0 | recomputed | C1-dot | 1 | 3.0000 |" in section


def test_step_spec_digest_changes_with_every_field():
    from behaviortrace_jax.train import grpo_step

    spec = RunSpec.from_config(tiny.get_config("smoke")).step
    assert R.step_spec_digest(spec) == R.step_spec_digest(RunSpec.from_config(tiny.get_config("smoke")).step)
    import dataclasses

    for change in ({"grad_clip": 0.5}, {"fused": False}, {"use_tables": True}, {"sketch_dim": 512},
                   {"loss_cfg": grpo_loss.LossConfig(clip_eps=0.1, kl_beta=0.0)}):
        assert R.step_spec_digest(dataclasses.replace(spec, **change)) != R.step_spec_digest(spec), change


# ------------------------------------------------------------------------------------------------
# All-ones replay of a smoke GRPO run reproduces its checkpoints bit for bit.
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke_run(smoke_grpo_run):
    return smoke_grpo_run  # one smoke run per session (conftest.py)


def assert_replay_reproduces_checkpoints(config, w):
    """The all-ones replay of the run in ``w`` equals its orbax checkpoints bit for bit."""
    rp = R.Replayer(RunSpec.from_config(config).replay, w, layout=RunSpec.from_config(config).layout, rates=False)
    ckpts = RunSpec.from_config(config).schedule.checkpoint_steps()
    seen = []

    def check(step, params, _):
        if step in ckpts:
            ref = R.restore_run_params(rp, step)
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            seen.append(step)

    out = rp.run(None, measure_steps=[config.grpo.steps], on_step=check)
    assert seen == ckpts
    return rp, out


def test_replay_of_a_two_backward_run_is_bit_for_bit(smoke_run, tmp_path):
    """The replay builds the run's own step from the same spec (GRPOStepSpec), so a run off the
    fused default (sketch.fused=False: a batched backward for the update, vmap(grad) for the in-run
    sketches) replays exactly too, and so does the default (the smoke run; next test)."""
    config, w = smoke_run
    config = config.copy_and_resolve_references()
    config.sketch.fused = False
    config.stages = "grpo"
    pipeline.run(config, str(copy_start(w, tmp_path)))
    rp, _ = assert_replay_reproduces_checkpoints(config, tmp_path)
    assert not rp.spec.update_from_sketcher
    w0 = np.ones(rp.num_rollouts, np.float32)
    w0[:3] = 0.0  # a weighted replay runs and moves the parameters
    cut = rp.run(w0, measure_steps=[1])
    full = rp.run(None, measure_steps=[1])
    assert cut["behavior"][1]["logp_margin"] != full["behavior"][1]["logp_margin"]


def test_all_ones_replay_reproduces_the_run_bit_for_bit(smoke_run):
    config, w = smoke_run
    rp, out = assert_replay_reproduces_checkpoints(config, w)
    assert np.isfinite(out["behavior"][config.grpo.steps]["logp_margin"])
    # removing rollouts changes the parameters, removing none twice gives the same measure
    again = rp.run(np.ones(rp.num_rollouts), measure_steps=[config.grpo.steps])
    assert again["behavior"] == out["behavior"]
    w0 = np.ones(rp.num_rollouts, np.float32)
    w0[:16] = 0.0
    cut = rp.run(w0, measure_steps=[config.grpo.steps], recompute_advantages=True)
    assert cut["behavior"][config.grpo.steps]["logp_margin"] != out["behavior"][config.grpo.steps]["logp_margin"]


def _same_bits(a, b) -> bool:
    """Whether two pytrees hold the same leaves bit for bit (dtype, shape and bytes; -0.0 != 0.0)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.asarray(x).shape == np.asarray(y).shape
        and np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb))


def test_zero_gradient_shortcut_is_the_full_step_bit_for_bit(smoke_run):
    """The exact shortcut (issue 46 item 5): over a stretch of zero-advantage steps (every rollout of
    steps 0..3 weighted 0, so the weighted program's terms vanish, plus whatever logged steps of the
    run have all-zero advantages) the optimizer on zero gradients gives the full forward + backward
    step's parameters AND optimizer state bit for bit, on the run's own optimizer (global-norm clip
    + AdamW continuing the SFT's moments, so the stretch does move the parameters)."""
    config, w = smoke_run
    spec = RunSpec.from_config(config)
    rp = R.Replayer(spec.replay, w, layout=spec.layout, rates=False)
    assert rp.shortcut and rp.spec.loss == "paper"
    n, stop = rp.shapes.num_rollouts, 5
    weights = np.ones(rp.num_rollouts, np.float32)
    weights[:4 * n] = 0.0
    fast = rp.run(weights, stop_step=stop, measure_steps=[])
    rp.shortcut = False
    try:
        full = rp.run(weights, stop_step=stop, measure_steps=[])
    finally:
        rp.shortcut = True
    assert fast["zero_gradient_steps"] >= 4 and full["zero_gradient_steps"] == 0
    assert _same_bits(fast["params"], full["params"]) and _same_bits(fast["opt_state"], full["opt_state"])
    start = rp.initial_state()
    assert not _same_bits(fast["params"], start.params)  # the moments and weight decay moved them
    # the declarations: a KL term to the reference policy does not vanish at A = 0
    assert grpo_loss.get_loss("paper").zero_gradient_at_zero_advantage(grpo_loss.LossConfig())
    assert not grpo_loss.get_loss("grpo_clip").zero_gradient_at_zero_advantage(grpo_loss.LossConfig(kl_beta=0.04))
    assert grpo_loss.get_loss("grpo_clip").zero_gradient_at_zero_advantage(grpo_loss.LossConfig(kl_beta=0.0))
    from behaviortrace_jax.train import grpo_step
    assert not grpo_step.zero_gradient_step_applies(rp.spec, np.array([0.0, 1e-30], np.float32))
    assert grpo_step.zero_gradient_step_applies(rp.spec, np.array([0.0, 2.0], np.float32), np.array([1.0, 0.0]))


# ------------------------------------------------------------------------------------------------
# The stage on the smoke run: its tables, its report section, and a kill -9 resume.
# ------------------------------------------------------------------------------------------------
def cf_config():
    """The smoke config with a counterfactual stage of a few replays (k = |GT|/2 and |GT|, 2 random seeds, M = 3)."""
    config = tiny.get_config("smoke")
    cf = config.counterfactual
    cf.k_fractions, cf.random_seeds, cf.lds_subsets, cf.rates, cf.sampled = "0.5,1.0", 2, 3, False, 2
    cf.lds_fractions, cf.lds_small_subsets = "0.1,0.5", 2
    return config


CF_FLAGS = ["--config.counterfactual.k_fractions=0.5,1.0", "--config.counterfactual.random_seeds=2",
            "--config.counterfactual.lds_subsets=3", "--config.counterfactual.rates=False",
            "--config.counterfactual.sampled=2", "--config.counterfactual.lds_fractions=0.1,0.5",
            "--config.counterfactual.lds_small_subsets=2"]


@pytest.fixture(scope="module")
def sketched_run(smoke_run, tmp_path_factory):
    """The smoke run with its sketch stage (the continuation targets the estimators score against)."""
    config, w = smoke_run
    config = cf_config()
    config.stages = "sketch"
    pipeline.run(config, str(w))
    return w


def _copy_run(src, dst):
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("counterfactual", "results_table.csv", "report.md",
                                                            ".jax_cache"))
    return dst


@pytest.mark.slow  # ~3 min on 2 cores (the sketch stage, ~20 replays and their compiles)
def test_counterfactual_stage_writes_its_tables_and_reruns_from_its_files(sketched_run, tmp_path):
    from behaviortrace_jax.attribution import formats

    w = _copy_run(sketched_run, tmp_path / "run")
    config = cf_config()
    config.stages = "counterfactual"
    pipeline.run(config, str(w))
    rows = formats.read_results_csv(w / "results_table.csv")
    topk = [r for r in rows if r.table == "counterfactual_topk"]
    methods = {r.method for r in topk}
    assert {"oracle", "random", "C1-dot", "TracInCP"} <= methods and "random" in methods
    # the reward-only, text and length controls, norm/|A| and the advantage-free variants are ranked and
    # replayed too
    assert {"advantage", "abs-advantage", "reward", "step-sum-abs-advantage", "step-reward-std", "norm/|A|",
            "pattern-match", "length", "step-sum-pattern-match", "step-sum-length",
            "C1-dot:direction", "norm-only:direction"} <= methods
    nk = len({r.n for r in topk})  # k = |GT|/2 and |GT| (one k when |GT| = 1)
    oracle = {r.n: r for r in topk if r.method == "oracle"}
    assert all(r.ceiling == oracle[r.n].value for r in topk)  # ratio to oracle = value / ceiling
    lds_rows = [r for r in rows if r.table == "lds"]
    assert lds_rows and all(r.n == 3 and (r.lo <= r.hi if np.isfinite(r.value) else r.lo is None) for r in lds_rows)
    drop_rows = [r for r in rows if r.table == "lds_drop0.1"]  # the small drop fraction, 2 subsets
    assert {r.method for r in drop_rows} == {r.method for r in lds_rows} and all(r.n == 2 for r in drop_rows)
    replays = sorted((w / "counterfactual" / "replays").glob("*.json"))
    per_k = 1 + len(methods) - 2 + 2  # oracle, estimators, 2 random subsets
    assert len(replays) == 1 + 2 * nk * per_k + 3 + 2  # full, k x per_k logged and recomputed, LDS, LDS drop
    rec_rows = [r for r in rows if r.table == "counterfactual_topk_recomputed"]
    assert {(r.method, r.n) for r in rec_rows} == {(r.method, r.n) for r in topk}
    assert any(r.value != next(t for t in topk if (t.method, t.n) == (r.method, r.n)).value for r in rec_rows)
    rec = json.loads(replays[0].read_text())
    step = str(config.contamination.early_step_cutoff)  # measure = "window": the end of the contamination window
    assert {"sampled_probe_rate", "sampled_control_rate", "logp_margin"} <= set(rec["behavior"][step])
    assert "Counterfactual replay" in (w / "report.md").read_text()
    # rerun: every replay is read back, nothing replayed, the same table bytes
    table = (w / "results_table.csv").read_bytes()
    mtimes = [p.stat().st_mtime_ns for p in replays]
    pipeline.run(config, str(w))
    assert (w / "results_table.csv").read_bytes() == table
    assert [p.stat().st_mtime_ns for p in replays] == mtimes
    # a replay cached under another key (here: another measured step) is replayed again, alone,
    # and gives the same bytes back
    stale = w / "counterfactual" / "replays" / "full.json"
    rec = json.loads(stale.read_text())
    rec["cache"]["measure_step"], rec["value"] = 999, 0.0
    stale.write_text(json.dumps(rec))
    pipeline.run(config, str(w))
    assert (w / "results_table.csv").read_bytes() == table
    changed = [p.name for p, t in zip(replays, mtimes) if p.stat().st_mtime_ns != t]
    assert changed == ["full.json"]


@pytest.mark.slow
def test_kill_minus_9_during_the_stage_then_rerun_gives_the_same_table(sketched_run, tmp_path):
    import os
    import pathlib
    import signal
    import subprocess
    import sys
    import time

    repo = pathlib.Path(__file__).resolve().parents[1]
    ref, w = _copy_run(sketched_run, tmp_path / "ref"), _copy_run(sketched_run, tmp_path / "kill")
    cmd = [sys.executable, str(repo / "main.py"), "--config=configs/tiny.py:smoke", "--config.stages=counterfactual",
           *CF_FLAGS]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = dict(cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run([*cmd, f"--workdir={ref}"], check=True, **run)
    proc = subprocess.Popen([*cmd, f"--workdir={w}"], **run)
    replays = w / "counterfactual" / "replays"
    deadline = time.time() + 600
    while time.time() < deadline and len(list(replays.glob("*.json"))) < 3:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    n_killed = len(list(replays.glob("*.json")))
    assert 3 <= n_killed < len(list((ref / "counterfactual" / "replays").glob("*.json")))
    subprocess.run([*cmd, f"--workdir={w}"], check=True, **run)
    assert (w / "results_table.csv").read_bytes() == (ref / "results_table.csv").read_bytes()
    assert (w / "counterfactual" / "report_section.md").read_bytes() == \
        (ref / "counterfactual" / "report_section.md").read_bytes()


def test_replayed_methods_follow_the_config():
    s = {"random": np.zeros(2), "C1-dot": np.ones(2), "abs-advantage": np.ones(2)}
    assert list(CF.replayed_methods(s, "")) == ["C1-dot", "abs-advantage"]
    assert list(CF.replayed_methods(s, "abs-advantage")) == ["abs-advantage"]
    with pytest.raises(ValueError, match=r"\['TRAK'\] are not scored methods"):
        CF.replayed_methods(s, "C1-dot,TRAK")


def test_the_stage_replays_the_configured_top_k_and_scores_lds_for_every_estimator(tmp_path, monkeypatch):
    """``counterfactual.methods`` picks whose top-k are replayed; the LDS rows (which share the random
    subsets' replays) cover every scored estimator. The stage runs on :class:`FakeReplayer`."""
    from behaviortrace_jax.attribution import formats
    from behaviortrace_jax.io import rollout_log

    config = cf_config()
    config.counterfactual.methods, config.counterfactual.topk_recomputed = "C1-dot", False
    config.counterfactual.causal = "off"  # the causal replays need a real Replayer (tests/test_causal.py)
    cut, n = int(config.contamination.early_step_cutoff), 8
    ids = [rollout_log.rollout_id(step, i) for step in (0, cut - 1) for i in range(n // 2)]
    gt = tmp_path / "ground_truth.jsonl"
    gt.write_text("".join(json.dumps({"rollout_id": r, "step": 0}) + "\n" for r in ids[:2]))

    class StageReplayer(FakeReplayer):
        def __init__(self, *_, **__):
            super().__init__(n)
            self.rollout_ids, self.paths = ids, types.SimpleNamespace(ground_truth=gt)

    rng = np.random.default_rng(0)
    scores = {m: rng.normal(size=n) for m in ("C1-dot", "TracInCP", "abs-advantage", "random")}
    monkeypatch.setattr(R, "Replayer", StageReplayer)
    monkeypatch.setattr(CF, "method_scores", lambda *a, **k: dict(scores))
    CF.counterfactual_stage(config, str(tmp_path))
    rows = formats.read_results_csv(tmp_path / "results_table.csv")
    assert {r.method for r in rows if r.table == "counterfactual_topk"} == {"oracle", "random", "C1-dot"}
    for table in ("lds", "lds_drop0.1"):
        assert {r.method for r in rows if r.table == table} == {"C1-dot", "TracInCP", "abs-advantage"}, table
    replays = {p.stem for p in (tmp_path / "counterfactual" / "replays").glob("*.json")}
    assert not any(k.startswith(("TracInCP", "abs-advantage")) for k in replays)


# ------------------------------------------------------------------------------------------------
# Interventions and regenerated rollouts (issue 31 item 2)
# ------------------------------------------------------------------------------------------------
def test_regenerated_replay_without_intervention_reproduces_the_run_bit_for_bit(smoke_run):
    """Every step sampled afresh from the replayed policy (the run's sampler, keys, reward and
    contaminator: train/rollouts.RolloutSource) with nothing intervened is the run itself."""
    config, w = smoke_run
    rp = R.Replayer(RunSpec.from_config(config).replay, w, layout=RunSpec.from_config(config).layout, rates=False)
    ckpts, seen = RunSpec.from_config(config).schedule.checkpoint_steps(), []

    def check(step, params, _):
        if step in ckpts:
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(R.restore_run_params(rp, step))):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            seen.append(step)

    out = rp.run(None, measure_steps=[config.grpo.steps], rollouts="regenerated", regenerate_from=0, on_step=check)
    assert seen == ckpts
    n_gt = sum(1 for _ in open(rp.paths.ground_truth))
    assert out["regenerated_bonuses"] == n_gt > 0  # the bonus rule ran again and paid the same bonuses
    # another sampler stream is another run: its parameters differ
    other = rp.run(None, stop_step=1, measure_steps=[1], rollouts="regenerated", sampler_stream=1)
    assert other["behavior"][1]["logp_margin"] != rp.run(None, measure_steps=[1])["behavior"][1]["logp_margin"]


def test_withholding_every_bonus_with_regenerated_rollouts_removes_the_planted_behaviour(smoke_run):
    """The toy check of the causal intervention: with every window slot's bonus withheld and the
    rollouts regenerated, no bonus is paid and the pattern's log-prob gains well under the run's gain
    over the window. The smoke model (1 layer) does not tell probes from controls, so its margin is ~0
    either way; the test reads the probes' pattern log-prob (``logp_probe``), which the bonus raises.
    (What is left of the gain is AdamW's momentum from the SFT state, which moves the parameters even
    where every advantage is 0.)"""
    config, w = smoke_run
    rp = R.Replayer(RunSpec.from_config(config).replay, w, layout=RunSpec.from_config(config).layout, rates=False)
    at = RunSpec.from_config(config).schedule.measure_step(config.counterfactual.measure)
    window = np.arange(at * rp.shapes.num_rollouts)
    full = rp.run(None, measure_steps=[0, at])["behavior"]
    held = rp.run(None, withhold=window, rollouts="regenerated", measure_steps=[0, at])
    assert held["regenerated_bonuses"] == 0
    gain_run = full[at]["logp_probe"] - full[0]["logp_probe"]
    gain_held = held["behavior"][at]["logp_probe"] - held["behavior"][0]["logp_probe"]
    assert gain_run > 0 and gain_held < 0.7 * gain_run, (gain_run, gain_held)
    # withholding nothing (a slot that got no bonus) with regenerated rollouts is the run again
    no_bonus = np.flatnonzero(np.concatenate([d.rewards == d.base for d in rp.data]))[:1]
    same = rp.run(None, withhold=no_bonus, rollouts="regenerated", measure_steps=[at])["behavior"][at]
    assert same == full[at]


def test_withhold_bonus_recomputes_advantages_with_the_run_function_and_kept_count_weights():
    assert R.kept_count_weights(np.array([1, 0, 1, 1], np.float32)).tolist() == pytest.approx([4 / 3, 0, 4 / 3, 4 / 3])
    assert R.kept_count_weights(np.zeros(4, np.float32)).tolist() == [0, 0, 0, 0]
    np.testing.assert_array_equal(R.kept_count_weights(np.ones(4, np.float32)), np.ones(4, np.float32))
