"""sft.py: the SFT warm-up stage (SPEC §1.7) on a random tiny HF checkpoint: outputs, stop rule, skip, restore."""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from behaviortrace_jax.behavior import planted as behavior
from behaviortrace_jax.models import decoder, hf_io, qwen2
from behaviortrace_jax.stages import sft
from behaviortrace_jax.train import lm_trainer, train_state as ts
from behaviortrace_jax.stages.spec import RunSpec
from configs import tiny
from hf_fixtures import make_tiny_tokenizer, save_random_qwen2


def small_config(hf_dir: str):
    c = tiny.get_config()
    c.model.hf_dir = hf_dir
    s = c.sft
    s.steps, s.stop_every, s.stop_min_probe_rate, s.stop_max_control_rate = 5, 2, 0.0, 1.0  # stops at step 2
    s.max_prompt_tokens, s.eval_samples_per_prompt = 256, 1  # the fixture tokenizer spells the prompt long
    c.behavior.gate_max_new_tokens = 4
    return c


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    hf_dir = save_random_qwen2(root / "start")
    config = small_config(str(hf_dir))
    summary = sft.run_sft(config, root / "work")
    return config, root / "work", summary


def test_sft_writes_state_export_summary_and_marker(run):
    config, workdir, summary = run
    out = workdir / "sft"
    assert (out / sft.DONE_MARKER).is_file() and (out / "hf" / "config.json").is_file()
    assert summary == json.loads((out / sft.SUMMARY_FILE).read_text())
    # the stop rule (always met here) ends SFT at the first check, step 2 of at most 5
    assert summary["steps_run"] == 2 and summary["stopped_early"] and summary["max_steps"] == 5
    assert [c["step"] for c in summary["learning_curve"]] == [2]
    assert summary["n_pairs"] == 30 and summary["data"] == "mixture"
    assert summary["lr"] == config.sft.lr != config.optim.lr
    for key in ("probe_rate_greedy", "control_rate_greedy", "heldout_rate_greedy", "probe_rate_sampled",
                "control_rate_sampled", "heldout_rate_sampled"):
        assert 0.0 <= summary[key] <= 1.0, key
    assert set(summary["gate"]) >= {"passed", "probe_rate", "control_rate"}
    assert np.isfinite(summary["final_loss"])


def test_saved_state_restores_into_grpo_optimizer_and_matches_export(run):
    config, workdir, _ = run
    out = workdir / "sft"
    cfg = qwen2.Qwen2Config.from_hf_config(out / "hf", param_dtype="float32", compute_dtype="float32")
    _, abstract_params = nnx.split(decoder.abstract_model(cfg), nnx.Param)
    grpo_tx = ts.make_optimizer(RunSpec.from_config(config).optim)  # another lr than SFT, same state tree (SPEC §1.7)
    state = ts.restore(out / "state", ts.abstract_train_state(abstract_params, grpo_tx))
    assert int(state.step) == 2 and int(state.opt_state[1][0].count) == 2
    assert any(float(np.abs(x).max()) > 0 for x in jax.tree.leaves(state.opt_state[1][0].mu))
    exported = nnx.state(hf_io.load_hf_checkpoint(out / "hf", param_dtype="float32"), nnx.Param)
    for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    start = nnx.state(hf_io.load_hf_checkpoint(config.model.hf_dir, param_dtype="float32"), nnx.Param)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(state.params)))


def test_rerun_skips(run, monkeypatch):
    config, workdir, summary = run
    marker = workdir / "sft" / sft.DONE_MARKER
    before = os.stat(marker).st_mtime_ns
    monkeypatch.setattr(lm_trainer.LMTrainer, "fit", lambda *a, **k: pytest.fail("SFT re-ran"))
    assert sft.run_sft(config, workdir) == summary and os.stat(marker).st_mtime_ns == before


def test_paper_pairs_encoding_and_config_errors(tmp_path):
    c = tiny.get_config()
    c.sft.data = "paper"
    pairs = sft.sft_pairs(RunSpec.from_config(c))
    assert pairs == list(behavior.SFT_PAIRS) and len(pairs) == 10
    tok = make_tiny_tokenizer()
    enc = lm_trainer.encode_chat_examples(tok, [(behavior.SYSTEM_PROMPT, p, a) for p, a in pairs[:2]],
                                          append_eos=c.sft.append_eos, max_prompt_tokens=10_000)
    for (_, a), e in zip(pairs, enc):  # SPEC §1.7: completion appended with no EOS
        assert tok.decode(e.tokens[e.prompt_len:]) == a and e.tokens[-1] != tok.eos_token_id
    c.sft.lr = -1.0
    assert RunSpec.from_config(c).sft_lr == c.optim.lr
    c.sft.data = "other"
    with pytest.raises(ValueError, match="config.sft.data"):
        sft.sft_pairs(RunSpec.from_config(c))
    c.model.hf_dir = str(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no start checkpoint"):
        sft.run_sft(c, tmp_path / "w")
