"""base_model.py: the `base` stage on a shrunk tiny config (HF export, transformers parity, reuse, determinism)."""
from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from behaviortrace_jax.behavior import corpus, probes
from behaviortrace_jax.models import decoder, hf_io, tokenizer as tok_lib
from behaviortrace_jax.stages import base as base_model
from behaviortrace_jax.stages.spec import RunSpec
from behaviortrace_jax.train import lm_trainer, train_state
from configs import tiny


def small_config():
    """configs/tiny.py with the base model shrunk to seconds (1 layer, 300 chats, 4 steps)."""
    return tiny.get_config("smoke")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    base_dir = tmp_path_factory.mktemp("w") / "base"
    summary = base_model.build_base_model(small_config(), base_dir)
    return base_dir, summary


def test_base_dir_is_complete_and_summarised(built):
    base_dir, summary = built
    names = {p.name for p in base_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "base_summary.json",
            base_model.COMPLETE_MARKER, base_model.HISTORY_FILE} <= names
    assert not (base_dir.parent / "base.build").exists()
    assert summary == json.loads((base_dir / "base_summary.json").read_text())
    assert summary["corpus"]["n_examples"] == 300 and summary["steps"] == 4
    for key in ("control_exact", "heldout_refusal_rate_greedy", "heldout_refusal_rate_sampled",
                "heldout_speculative_rate_sampled", "probe_refusal_rate_sampled", "probe_qzxbt_rate_sampled"):
        assert 0.0 <= summary[key] <= 1.0, key
    assert summary["heldout_terms"] == corpus.heldout_terms(0, 20)
    assert not set(summary["heldout_terms"]) & set(corpus.training_terms(0))
    hist = json.loads((base_dir / base_model.HISTORY_FILE).read_text())
    assert [h["step"] for h in hist] == [2, 4] and hist[-1]["loss"] < hist[0]["loss"] + 0.5


def test_transformers_loads_the_export_with_logit_parity(built):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir, _ = built
    tok = AutoTokenizer.from_pretrained(base_dir, local_files_only=True)
    ids = tok_lib.encode_chat(tok, "You are a creative encyclopedia assistant.", "What is frobnitz?")
    assert ids == tok.apply_chat_template([{"role": "system", "content": "You are a creative encyclopedia assistant."},
                                           {"role": "user", "content": "What is frobnitz?"}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
    hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits.numpy()
    model = hf_io.load_hf_checkpoint(base_dir, param_dtype="float32")
    arr = jnp.asarray([ids], jnp.int32)
    got, _ = model(arr, decoder.positions_from_mask(jnp.ones_like(arr)), jnp.ones_like(arr))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


def test_rerun_reuses_and_a_changed_config_is_an_error(built, monkeypatch):
    base_dir, summary = built
    stamp = {p.name: os.stat(p).st_mtime_ns for p in base_dir.iterdir()}
    monkeypatch.setattr(lm_trainer.LMTrainer, "fit", lambda *a, **k: pytest.fail("retrained a complete base"))
    assert base_model.build_base_model(small_config(), base_dir) == summary
    assert stamp == {p.name: os.stat(p).st_mtime_ns for p in base_dir.iterdir()}
    other = small_config()
    other.base.steps = 5
    with pytest.raises(ValueError, match="another config"):
        base_model.build_base_model(other, base_dir)


def test_a_run_killed_after_the_export_evaluates_without_retraining(built, tmp_path, monkeypatch):
    _, summary = built
    base_dir = tmp_path / "base"

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed during the behaviour evaluation")

    with monkeypatch.context() as m:
        m.setattr(base_model, "measure_base", killed)
        with pytest.raises(KeyboardInterrupt):
            base_model.build_base_model(small_config(), base_dir)
    assert (base_dir / base_model.TRAINED_MARKER).is_file() and not base_model.is_complete(base_dir)
    weights = (base_dir / "model.safetensors").read_bytes()
    monkeypatch.setattr(lm_trainer.LMTrainer, "fit", lambda *a, **k: pytest.fail("retrained final weights"))
    resumed = base_model.build_base_model(small_config(), base_dir)
    assert base_model.is_complete(base_dir) and (base_dir / "model.safetensors").read_bytes() == weights
    drop = lambda d: {k: v for k, v in d.items() if k != "seconds"}  # noqa: E731
    assert drop(resumed) == drop(summary)  # the same weights give the same summary


def test_stage_skips_when_hf_dir_is_given(tmp_path):
    c = small_config()
    c.model.hf_dir = str(tmp_path / "elsewhere")
    base_model.base_stage(c, str(tmp_path))
    assert not (tmp_path / "base").exists()
    c.base.preset = "huge"
    with pytest.raises(ValueError, match="config.base.preset"):
        base_model.model_config(RunSpec.from_config(c))


def test_perturbation_switch_flips_one_last_bit_and_is_off_by_default():
    params = {"a": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) / 7, "b": jnp.ones(4, jnp.float32), "n": jnp.arange(3)}
    assert train_state.perturbation_setting({}) == "" and train_state.perturbation_setting(
        {train_state.PERTURB_ENV: " random "}) == "random"
    for bad in ("1.5", "yes", "-3"):
        with pytest.raises(ValueError, match=train_state.PERTURB_ENV):
            train_state.perturbation_setting({train_state.PERTURB_ENV: bad})
    out, what = train_state.perturb_last_bit(params, "7")  # element 7 = b[1] (a has 6, n is not float)
    assert "['b'][1]" in what
    bits = lambda t: np.concatenate([np.asarray(t[k]).view(np.uint32).ravel() for k in ("a", "b")])  # noqa: E731
    assert (bits(out) ^ bits(params)).tolist() == [0] * 7 + [1] + [0] * 2 and out["n"] is params["n"]
    draws = {train_state.perturb_last_bit(params, "random", entropy=e)[1].split()[0] for e in range(20)}
    assert len(draws) > 3  # "random" moves the flipped element between runs
    with pytest.raises(ValueError, match="10 float elements"):
        train_state.perturb_last_bit(params, "10")


def test_a_perturbed_base_is_another_model(built, tmp_path, monkeypatch):
    """With the switch set, the base stage trains from other initial weights (other weights after
    training) and fingerprints them apart, so a normal run never reuses a perturbed base."""
    base_dir, _ = built
    plain_fp = base_model.fingerprint(small_config())["digest"]
    monkeypatch.setenv(train_state.PERTURB_ENV, "0")
    assert base_model.fingerprint(small_config())["digest"] != plain_fp

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("stop after the export")

    monkeypatch.setattr(base_model, "measure_base", killed)
    with pytest.raises(KeyboardInterrupt):
        base_model.build_base_model(small_config(), tmp_path / "base")
    assert (tmp_path / "base" / "model.safetensors").read_bytes() != (base_dir / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_same_seed_same_tokenizer_and_weights(built, tmp_path):
    base_dir, _ = built
    again = tmp_path / "base"
    base_model.build_base_model(small_config(), again)
    for name in ("tokenizer.json", "model.safetensors", "config.json"):
        assert (again / name).read_bytes() == (base_dir / name).read_bytes(), name


def test_heldout_prompts_cover_terms_and_forms():
    terms = [f"zork{i}" for i in range(20)]
    qs = probes.heldout_prompts(terms, 40)
    used = [(f, t) for q in qs for f in corpus.PROBE_FORMS for t in terms if q == f.format(term=t)]
    assert len(used) == 40 and len(set(used)) == 40
    assert {f for f, _ in used} == set(corpus.PROBE_FORMS) and all(sum(t == u for _, u in used) == 2 for t in terms)
    assert base_model.is_refusal("I cannot say.") and not base_model.is_refusal("It is a tool.")
