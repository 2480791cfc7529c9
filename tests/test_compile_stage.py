"""The `compile` stage (issue 12): ahead-of-time compilation of every program of a config."""
import importlib.util
import json

import jax
import jax.numpy as jnp
import pytest

from behaviortrace_jax.stages import compile as compile_stage
from configs import tiny

FIELDS = ("name", "compile_s", "argument_bytes", "output_bytes", "temp_bytes", "alias_bytes",
          "generated_code_bytes", "total_bytes", "flops", "bytes_accessed", "analytic_flops_per_chip",
          "roofline_s", "fits", "host_peak_rss_bytes")


def _config(target):
    c = tiny.get_config("smoke")
    with c.unlocked():
        c.compile.target = target
        c.mesh.data = -1
    return c


def test_compile_stage_cpu_tiny(tmp_path):
    compile_stage.compile_stage(_config("cpu:2"), str(tmp_path))
    report = json.loads((tmp_path / "compile_report.json").read_text())
    names = [p["name"] for p in report["programs"]]
    assert names[:3] == ["sampler_prefill", "sampler_decode", "sft_step"]
    assert {"grpo_step[paper,in_run=on]", "grpo_step[paper,in_run=off]", "target_sketcher",
            "rollout_resketcher", "draws_sketcher"} <= set(names)
    for p in report["programs"]:
        assert set(FIELDS) <= set(p), p["name"]
        assert p["fits"] and p["flops"] > 0 and p["total_bytes"] > 0
    assert report["n_devices"] == 2 and report["mesh"] == {"data": 2, "model": 1}
    assert 1.0 < report["grpo_step_flop_ratio"] < 3.0
    assert "grpo_step_flop_ratio" in (tmp_path / "compile_report.md").read_text()


def test_compile_stage_names_programs_that_do_not_fit(tmp_path, monkeypatch):
    real = compile_stage.target_devices
    monkeypatch.setattr(compile_stage, "target_devices", lambda t: (real(t)[0], None, 1024.0))
    c = _config("cpu:2")
    with c.unlocked():
        c.compile.programs = "sampler_prefill"
    with pytest.raises(compile_stage.DoesNotFit, match=r"sampler_prefill needs .* GiB over"):
        compile_stage.compile_stage(c, str(tmp_path))
    assert (tmp_path / "compile_report.json").exists()


def test_unknown_target_and_too_many_cpus():
    with pytest.raises(ValueError, match="expected tpu"):
        compile_stage.target_devices("gpu:1")
    with pytest.raises(ValueError, match="CPU device"):
        compile_stage.target_devices("cpu:4096")
    with pytest.raises(ValueError, match=r"unknown TPU chip 'v9z'.*known: \['v4', 'v5e'"):
        compile_stage.target_devices("tpu:v9z:2x4")  # before any libtpu call: no silent fits=True


def test_fit_is_not_judged_without_a_memory_limit():
    """A program whose device has no known memory limit gets fits=None (not True), and only
    fits=False stops the stage."""
    f = jax.jit(lambda x: x * 2)
    pr = compile_stage.Program("double", lambda: f.lower(jax.ShapeDtypeStruct((4,), jnp.float32)), 4.0, "x")
    assert compile_stage.compile_program(pr, None, None, 1)["fits"] is None
    assert compile_stage.compile_program(pr, None, 1e9, 1)["fits"] is True
    assert compile_stage.xla_memory_limit(jax.devices("cpu")[0]) is None  # XLA:CPU names no limit


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed (pip install -e '.[tpu]')")
def test_compile_stage_tpu_target_tiny(tmp_path):
    c = _config("tpu:v5e:2x4")
    with c.unlocked():
        c.compile.programs = "sampler_prefill,sft_step"
    compile_stage.compile_stage(c, str(tmp_path))
    report = json.loads((tmp_path / "compile_report.json").read_text())
    assert report["chip"] == "v5e" and report["n_devices"] == 8
    assert all(p["fits"] and p["roofline_s"] > 0 for p in report["programs"])
    # fits is judged against what XLA:TPU lets a program use (its own limit), not the nominal 16 GiB
    assert {p["memory_bytes"] for p in report["programs"]} == {15.75 * compile_stage.GiB}


def test_platform_env_and_compile_cpu_devices(monkeypatch):
    from behaviortrace_jax import runtime

    assert runtime.platform_env({"JAX_PLATFORMS": "tpu"}) == {}
    env = runtime.platform_env({})
    if importlib.util.find_spec("libtpu") is None:
        assert env == {}
    else:
        assert env in ({}, {"JAX_PLATFORMS": "cpu"}, {"JAX_PLATFORMS": "cuda,cpu"})
    c = _config("cpu:4")
    assert runtime.compile_cpu_devices(c) == 0  # `compile` not in config.stages
    with c.unlocked():
        c.stages = "compile"
    assert runtime.compile_cpu_devices(c) == 4


def test_hbm_exhausted_at_compile_is_a_row_that_does_not_fit():
    """XLA:TPU refuses a program over the chip's HBM inside compile(); the stage reports it as a
    row with fits=False and the temp bytes XLA asked for, instead of dying."""

    class Lowered:
        def compile(self):
            raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for "
                               "HLO temporaries (17.87G) exceeds available HBM (15.75G).")

    pr = compile_stage.Program("grpo_step[paper,in_run=on]", lambda: Lowered(), 8e12, "x")
    row = compile_stage.compile_program(pr, compile_stage.CHIPS["v5e"], 16 * compile_stage.GiB, 8)
    assert row["fits"] is False and abs(row["temp_bytes"] / compile_stage.GiB - 17.87) < 0.01
    assert abs(row["memory_bytes"] / compile_stage.GiB - 15.75) < 0.01 and "RESOURCE_EXHAUSTED" in row["note"]
    md = compile_stage.report_markdown({"target": "tpu:v5e:2x4", "chip": "v5e", "n_devices": 8, "mesh": {},
                                        "model": "m", "host_peak_rss_bytes": 1e9, "stage_s": 1.0,
                                        "programs": [row], "grpo_step_flop_ratio": None})
    assert "| grpo_step[paper,in_run=on] |" in md and "False" in md
    with pytest.raises(ValueError):
        compile_stage.compile_program(compile_stage.Program("p", lambda: (_ for _ in ()).throw(ValueError("x")), 0.0),
                                      None, None, 1)


def test_configured_flop_ratio_follows_the_grpo_path():
    """The report's GRPO step FLOP ratio is that of the configured path (issue 12 item 4, <= 1.15):
    ~2.0 with a batched backward plus per-rollout backwards (the paper loss declares no old log-probs,
    so no extra forward is counted: XLA removes it as dead code), ~1.0 with one backward (paper_tpu),
    exactly 1 without in-run sketches; computed analytically, nothing compiled."""
    from configs import paper, paper_tpu

    c = paper_tpu.get_config()
    cfg = compile_stage.model_config(c)
    assert cfg.num_hidden_layers == 28 and cfg.hidden_size == 1536
    one = compile_stage.configured_flop_ratio(c, cfg)
    assert c.grpo.one_backward and 1.0 < one["ratio"] <= 1.15 and "one backward" in one["path"]
    two = compile_stage.configured_flop_ratio(paper.get_config(), cfg)
    assert 1.95 < two["ratio"] < 2.05 and two["flops_without_in_run"] == one["flops_without_in_run"]
    with c.unlocked():  # without in-run sketches one_backward has no gradient sum to use: the spec refuses it
        c.sketch.in_run_rollouts = False
    with pytest.raises(ValueError, match="one_backward needs sketch.in_run_rollouts"):
        compile_stage.configured_flop_ratio(c, cfg)
    with c.unlocked():
        c.grpo.one_backward = False
    assert compile_stage.configured_flop_ratio(c, cfg)["ratio"] == 1.0
