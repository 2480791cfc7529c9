"""The README's recipes ("Extend"; in full: docs/guides/extending.md), followed from outside the package: a GRPO
loss registered in a test file runs the smoke GRPO stage, the replay and the compile stage with no
package file changed."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from behaviortrace_jax import pipeline
from behaviortrace_jax.io import rollout_log
from behaviortrace_jax.stages import compile as compile_stage
from behaviortrace_jax.train import grpo_loss
from conftest import copy_start
from configs import tiny

import test_replay

TOY_LOSS = "test_sum_logprob"


def sum_logprob_loss(inp: grpo_loss.LossInputs, cfg: grpo_loss.LossConfig) -> jnp.ndarray:
    """Toy loss: ``-A_i * sum_t(lp * mask) / (G * B)`` (token sum, not mean; Dr. GRPO-like), with the
    default declarations (no reference, no old log-probs, one iteration)."""
    del cfg
    return -inp.advantages * jnp.sum(inp.logprobs * inp.mask, -1) / (inp.group_size * inp.num_prompts)


@pytest.fixture
def toy_loss():
    """Registers :func:`sum_logprob_loss` as ``TOY_LOSS`` for one test and removes it after. Registered
    at import, it would join the tests parametrised by every registered loss (test_grpo, test_nonfinite)
    in the files collected after this one, so their count would hang on the order of the folders."""
    grpo_loss.register_loss(TOY_LOSS)(sum_logprob_loss)
    yield TOY_LOSS
    del grpo_loss.LOSSES[TOY_LOSS]


def test_a_loss_registered_outside_the_package_runs_grpo_replay_and_compile(toy_loss, smoke_sft, tmp_path):
    config, start = smoke_sft
    config = config.copy_and_resolve_references()
    config.stages, config.grpo.loss = "grpo", toy_loss
    w = copy_start(start, tmp_path / "run")
    pipeline.run(config, str(w))
    records = list(rollout_log.read_rollouts(w / "grpo" / "rollouts"))
    n = config.grpo.steps * config.grpo.prompts_per_step * config.grpo.group_size
    assert len(records) == n and json.loads((w / "grpo" / "summary.json").read_text())["complete"]
    rp, out = test_replay.assert_replay_reproduces_checkpoints(config, w)
    assert rp.spec.loss == TOY_LOSS and np.isfinite(out.value(config.grpo.steps, "logp_margin"))
    config.compile.target, config.compile.programs, config.mesh.data = "cpu:2", "grpo_step", -1
    compile_stage.compile_stage(config, str(tmp_path / "compile"))
    report = json.loads((tmp_path / "compile" / "compile_report.json").read_text())
    assert {p["name"] for p in report["programs"]} >= {f"grpo_step[{TOY_LOSS},in_run=on]"}


def test_an_estimator_registered_outside_the_package_reaches_tables_report_and_verdicts(smoke_finished, tmp_path):
    """README "Extend", an estimator (docs/guides/extending.md "Add an estimator"): register it in your own
    module, rerun ``evaluate,report`` on a finished run; its rows join every step-level and
    which-rollout table and the step rule."""
    import shutil

    from behaviortrace_jax.attribution import estimators, formats

    w = tmp_path / "run"
    shutil.copytree(smoke_finished, w)

    @estimators.register_estimator("test-C1-dot-sign", level="step")
    def c1_dot_sign(sketches, target):
        """sign(v_s . t): a deliberately crude step-level ranker."""
        return np.sign(np.asarray(sketches, np.float64) @ np.asarray(target, np.float64))

    try:
        config = tiny.get_config("smoke")
        config.stages = "evaluate,report"
        pipeline.run(config, str(w))
    finally:
        del estimators.ESTIMATORS["test-C1-dot-sign"]
    rows = formats.read_results_csv(w / "results_table.csv")
    assert {(r.table, r.method) for r in rows} >= {(t, "test-C1-dot-sign") for t in
                                                   ("overall", "early_nonzero", "which_rollout")}
    assert "test-C1-dot-sign" in (w / "report.md").read_text()
