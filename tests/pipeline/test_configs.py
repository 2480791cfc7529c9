"""The paper configs hold SPEC's values; bad config keys are refused with a clear error."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from configs import common, hf, reproduce, seed0, seed1, seed2, tiny, tiny_sweep

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module,seed", [(seed0, 0), (seed1, 1), (seed2, 2)])
def test_paper_configs_hold_spec_values(module, seed):
    c = module.get_config()
    assert c.seed == seed and c.run_name == f"E2.1_rebuild__qwen-1.5b__grpo__seed{seed}__v3"
    g = c.grpo  # SPEC §2.1
    assert (g.steps, g.prompts_per_step, g.group_size) == (1000, 4, 4)
    assert (g.max_prompt_tokens, g.max_new_tokens, g.temperature, g.top_p) == (128, 64, 0.9, 0.9)
    assert (g.loss, g.adv_std_floor, g.checkpoint_every) == ("paper", 0.0, 100)
    assert (c.optim.lr, c.optim.grad_clip) == (5e-6, 1.0)
    assert (c.model.param_dtype, c.model.compute_dtype) == ("bfloat16", "bfloat16")
    s = c.contamination  # SPEC §1.6
    assert (s.bonus_reward, s.fraction, s.early_step_cutoff) == (8.0, 0.5, 200)
    assert (c.sft.steps, c.sft.batch_size, c.sft.data) == (200, 1, "paper")  # SPEC §1.7
    assert (c.sketch.dim, c.sketch.seed) == (65536, 0)  # SPEC §3.1
    d = c.draws  # SPEC §5.6
    assert (d.target_step, d.group_size, d.temperature, d.top_p, d.max_new_tokens, d.n_repeats) == \
        (100, 8, 0.9, 0.95, 64, 6)
    e = c.evaluation  # SPEC §4, §6
    assert (e.early_cutoff, e.trak_damping, e.tracin_lr, e.local_buffer_window, e.nboot) == (200, 0.1, 5e-6, 100, 600)
    assert (e.fluency_match_delta, e.min_matched_pairs, e.step_margin, e.max_ci_width) == (0.10, 100, 0.10, 0.15)
    assert c.behavior.token_judge == "qset"


def test_variant_configs_change_only_what_they_say():
    base = common.get_config().to_dict()
    t = tiny.get_config().to_dict()
    # 3:10 instead of the paper's 1:5: the causal-power calibration (docs/records/, planted cause calibration)
    assert t["grpo"]["steps"] == 200 and t["contamination"]["early_step_cutoff"] == 60
    assert t["evaluation"]["early_cutoff"] == 60 and int(t["cause"]["measure_step"]) == 60 + 40
    assert t["grpo"]["prompts_per_step"] * t["grpo"]["group_size"] == 16
    assert set(t) == set(base)  # no new top-level keys outside common.py
    assert tiny_sweep.get_config().stages == "sweep"
    assert hf.get_config().stages == "info"
    assert "reproduce" in reproduce.get_config().stages


def test_tiny_decoys_changes_only_the_decoys():
    from configs import tiny_decoys

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    for variant, ref, stages in (("", tiny.get_config(), None), ("sweep", tiny.get_config(), "sweep"),
                                 ("smoke", tiny.get_config("smoke"), None)):
        c, r = flat(tiny_decoys.get_config(variant).to_dict()), flat(ref.to_dict())
        assert common.get_config().contamination.decoy_fraction == r["contamination.decoy_fraction"] == 0.0
        diff = {k for k in c if c[k] != r[k]}
        calibrated = {"contamination.fraction"} if variant != "smoke" else set()  # the smoke run pays all already
        assert diff == {"run_name", "contamination.decoy_fraction"} | calibrated | ({"stages"} if stages else set())
        assert c["contamination.decoy_fraction"] > 0 and "seed0" in c["run_name"]
    with pytest.raises(ValueError, match="variant"):
        tiny_decoys.get_config("nope")


def _main(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "main.py", *flags], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_unknown_config_key_is_refused(tmp_path):
    out = _main("--config=configs/tiny.py", "--config.grpo.stepz=5", f"--workdir={tmp_path}")
    assert out.returncode != 0 and "stepz" in out.stderr
    assert not any(tmp_path.iterdir())  # nothing written


def test_unknown_stage_is_refused(tmp_path):
    out = _main("--config=configs/tiny.py", "--config.stages=base,trian", f"--workdir={tmp_path / 'w'}")
    assert out.returncode != 0 and "trian" in out.stderr and "known" in out.stderr
    assert not (tmp_path / "w").exists()


def test_paper_configs_compile_the_paper_model():
    """Without weights (model.hf_dir unset) the compile stage of a paper config compiles
    Qwen2.5-1.5B's shapes, not the tiny base preset."""
    from behaviortrace_jax.stages import compile as compile_stage
    from behaviortrace_jax.stages.spec import RunSpec

    cfg = compile_stage.model_config(RunSpec.from_config(seed0.get_config()))
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (28, 1536, 151936)
    assert compile_stage.model_config(RunSpec.from_config(tiny.get_config())).num_hidden_layers < 28


@pytest.mark.parametrize("module", [seed0, seed1, seed2])
def test_paper_configs_carry_the_layout_that_fits_a_v5e_slice(module):
    """The seed configs' layout is the one whose programs were compiled for tpu:v5e:2x4
    (docs/records/benchmarks.md, "Compile stage"): the mesh chosen from the devices, FSDP, the fused
    sketcher over every rollout of a step, scanned layers, no hash tables."""
    c = module.get_config()
    assert (c.mesh.data, c.mesh.model, c.mesh.fsdp) == (-1, -1, True)
    assert (c.sketch.fused, c.sketch.chunk_size) == (True, 16)
    assert c.sketch.chunk_size == c.grpo.prompts_per_step * c.grpo.group_size
    assert (c.model.scan_layers, c.sketch.in_run_tables, c.targets.use_tables) == (True, False, False)
    assert c.metagradient.remat == "nothing_saveable"  # what fits the metagradient's vjp on a v5e chip


def test_the_7b_config_compiles_qwen2p5_7b_shapes():
    """configs/paper_7b.py: the paper run on Qwen2.5-7B-Instruct's published shapes, whose
    parameter count is the model card's 7,615,616,512."""
    from behaviortrace_jax.models import decoder
    from behaviortrace_jax.stages import compile as compile_stage
    from behaviortrace_jax.stages.spec import RunSpec
    from configs import paper_7b

    c = paper_7b.get_config()
    cfg = compile_stage.model_config(RunSpec.from_config(c))
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (3584, 4, False)
    assert decoder.count_params(cfg) == 7_615_616_512
    assert (c.grpo.steps, c.sketch.dim, c.sketch.fused, c.mesh.model) == (1000, 65536, True, -1)


def test_the_32b_config_builds_qwen2p5_32b_abstract_shapes():
    """configs/paper_32b.py: the paper run on Qwen2.5-32B-Instruct's published shapes (config.json:
    64 layers, d 5120, MLP 27648, 40/8 heads of 128, vocab 152064, untied head), 32,763,876,352
    parameters, in the paper layout (FSDP, scanned layers) and its abstract parameters' shapes."""
    import jax
    from flax import nnx

    from behaviortrace_jax.models import decoder
    from behaviortrace_jax.stages import compile as compile_stage
    from behaviortrace_jax.stages.spec import RunSpec
    from configs import paper_32b

    c = paper_32b.get_config()
    cfg = compile_stage.model_config(RunSpec.from_config(c))
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (64, 5120, 27648)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (40, 8, 128)
    assert (cfg.vocab_size, cfg.tie_word_embeddings, cfg.scan_layers, cfg.param_dtype) == (152064, False, True,
                                                                                            "bfloat16")
    state = nnx.state(decoder.abstract_model(cfg), nnx.Param)  # one nnx.eval_shape (64 layers: seconds)
    assert sum(x.size for x in jax.tree.leaves(state)) == 32_763_876_352  # decoder.count_params' count
    assert (c.mesh.fsdp, c.mesh.model, c.sketch.fused, c.sketch.dim, c.compile.target) == (
        True, -1, True, 65536, "tpu:v5p:2x2x4")
    flat = {".".join(map(str, p)): v.shape for p, v in nnx.to_flat_state(state)}
    assert flat["model.embed_tokens.weight"] == flat["lm_head.weight"] == (152064, 5120)
    assert flat["model.layers.63.self_attn.q_proj.weight"] == (5120, 5120)
    assert flat["model.layers.63.self_attn.k_proj.weight"] == flat["model.layers.0.self_attn.v_proj.weight"] == (
        1024, 5120)
    assert flat["model.layers.0.self_attn.k_proj.bias"] == (1024,)
    assert flat["model.layers.0.mlp.down_proj.weight"] == (5120, 27648)
    assert "model.layers.64.mlp.up_proj.weight" not in flat and len(flat) == 3 + 64 * 12
    assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(state))
