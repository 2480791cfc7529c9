"""The `compile` stage: ahead-of-time compilation of every program of a config."""
import importlib.util
import json

import jax
import jax.numpy as jnp
import pytest

from behaviortrace_jax.stages import compile as compile_stage
from behaviortrace_jax.stages.spec import RunSpec
from configs import tiny

FIELDS = ("name", "compile_s", "argument_bytes", "output_bytes", "temp_bytes", "alias_bytes",
          "generated_code_bytes", "total_bytes", "flops", "bytes_accessed", "flops_one_trip",
          "bytes_accessed_one_trip", "loops", "roofline_s", "fits", "host_peak_rss_bytes")


def _config(target):
    c = tiny.get_config("smoke")
    with c.unlocked():
        c.compile.target = target
        c.mesh.data = -1
    return c


def test_compiled_stages_are_the_stages_the_config_runs():
    c = _config("cpu:2")
    assert set(RunSpec.from_config(c).compile.stages) == {"base", "sft", "grpo", "sketch", "draws", "evaluate",
                                                          "report"}
    c.stages = "compile"  # --config.stages=compile alone: the programs of a paper run
    assert set(RunSpec.from_config(c).compile.stages) == set(compile_stage.PAPER_RUN_STAGES)
    c.stages, c.sweep.stages = "sweep,compile", "sft,grpo,metagradient"
    assert set(RunSpec.from_config(c).compile.stages) == {"sft", "grpo", "metagradient"}
    c.compile.stages = "grpo,metagradinet"
    with pytest.raises(ValueError, match="compile.stages.*metagradinet"):
        set(RunSpec.from_config(c).compile.stages)


def test_compile_stage_cpu_tiny(tmp_path):
    c = _config("cpu:2")
    c.compile.stages = "base,sft,grpo,metagradient,sketch,draws"  # every builder of the report
    compile_stage.compile_stage(c, str(tmp_path))
    report = json.loads((tmp_path / "compile_report.json").read_text())
    names = [p["name"] for p in report["programs"]]
    assert names[:4] == ["sampler_prefill", "sampler_decode", "sft_step", "sft_loss"]
    assert {"grpo_step[paper,in_run=on]", "grpo_step[paper,in_run=off]", "metagradient_step", "metagradient_step_vjp",
            "target_sketcher", "rollout_resketcher", "draws_sketcher", "target_mean_logprob"} <= set(names)
    for p in report["programs"]:
        assert set(FIELDS) <= set(p), p["name"]
        assert p["fits"] and p["flops"] > 0 and p["total_bytes"] > 0
    assert report["n_devices"] == 2 and report["mesh"] == {"data": 2, "model": 1}
    assert 1.0 < report["grpo_step_flop_ratio"] < 3.0 and report["grpo_step_bytes_ratio"] > 1.0
    decode = next(p for p in report["programs"] if p["name"] == "sampler_decode")
    assert decode["loops"] and decode["flops"] > 2 * decode["flops_one_trip"]  # the decode loop's trips counted
    assert "(both variants compiled" in (tmp_path / "compile_report.md").read_text()


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
    pr = compile_stage.Program("double", lambda: f.lower(jax.ShapeDtypeStruct((4,), jnp.float32)), "x")
    assert compile_stage.compile_program(pr, None, None)["fits"] is None
    assert compile_stage.compile_program(pr, None, 1e9)["fits"] is True
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

    pr = compile_stage.Program("grpo_step[paper,in_run=on]", lambda: Lowered(), "x")
    row = compile_stage.compile_program(pr, compile_stage.CHIPS["v5e"], 16 * compile_stage.GiB)
    assert row["fits"] is False and abs(row["temp_bytes"] / compile_stage.GiB - 17.87) < 0.01
    assert abs(row["memory_bytes"] / compile_stage.GiB - 15.75) < 0.01 and "RESOURCE_EXHAUSTED" in row["note"]
    md = compile_stage.report_markdown({"target": "tpu:v5e:2x4", "chip": "v5e", "n_devices": 8, "mesh": {},
                                        "model": "m", "host_peak_rss_bytes": 1e9, "stage_s": 1.0,
                                        "programs": [row], "grpo_step_flop_ratio": None})
    assert "| grpo_step[paper,in_run=on] |" in md and "False" in md
    assert "FLOP ratio -, bytes ratio - (not computed: it needs the step with and without" in md  # one variant only
    with pytest.raises(ValueError):
        compile_stage.compile_program(compile_stage.Program("p", lambda: (_ for _ in ()).throw(ValueError("x"))),
                                      None, None)


def test_loop_counted_cost_equals_the_unrolled_program():
    """XLA's cost analysis counts a while body once; loop_counted_cost counts every trip. Against
    the same computation written without loops (XLA's plain count): a nested fori_loop exactly (up
    to the loop counters' adds), and a tiny decoder's fwd+bwd with its layers scanned, and per-example
    gradients in a lax.map (to 1 % / 3 %)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from behaviortrace_jax.models import decoder, families
    from behaviortrace_jax.sketch.sketcher import completion_loss

    x = jnp.ones((16, 16))
    inner = lambda y: jax.lax.fori_loop(0, 3, lambda i, z: jnp.sin(z @ z), y)  # noqa: E731
    looped = jax.jit(lambda x: jax.lax.fori_loop(0, 4, lambda i, y: inner(y) * 2, x)).lower(x).compile()
    flat = jax.jit(lambda x: [x := jnp.sin(x @ x) * (1 if (k + 1) % 3 else 2) for k in range(12)][-1])
    counted, plain = compile_stage.loop_counted_cost(looped), flat.lower(x).compile().cost_analysis()
    assert sorted(counted["loops"]) == [3, 3, 3, 3, 4] and counted["flops_one_trip"] < counted["flops"] / 4
    assert abs(counted["flops"] - plain["flops"]) <= 64 and counted["transcendentals"] == plain["transcendentals"]

    cfg = families.preset("tiny", "qwen2", vocab_size=80, num_hidden_layers=3)
    _, params = nnx.split(decoder.init_model(cfg, seed=1), nnx.Param)
    rng = np.random.default_rng(0)
    b = {"input_ids": jnp.asarray(rng.integers(0, 80, (4, 12)), jnp.int32), "attention_mask": jnp.ones((4, 12), jnp.int32),
         "loss_mask": jnp.ones((4, 12))}

    def grad_program(scan, per_example):
        gd, _ = nnx.split(decoder.abstract_model(cfg.replace(scan_layers=scan)), nnx.Param)
        loss = completion_loss(gd)
        one = lambda ex: jax.tree.leaves(jax.grad(loss)(params, ex))  # noqa: E731
        if per_example == "map":
            fn = lambda p: jax.lax.map(one, b)  # noqa: E731
        elif per_example == "unrolled":
            fn = lambda p: [one(jax.tree.map(lambda a: a[i], b)) for i in range(4)]  # noqa: E731
        else:
            fn = jax.grad(lambda p: jnp.sum(loss.per_example(p, b, None)))
        return compile_stage.loop_counted_cost(jax.jit(fn).lower(params).compile())

    unrolled, scanned = grad_program(False, None), grad_program(True, None)
    assert unrolled["loops"] == [] and scanned["loops"] == [3, 3]
    assert abs(scanned["flops"] / unrolled["flops"] - 1) < 0.01 and scanned["flops_one_trip"] < 0.5 * scanned["flops"]
    # XLA:TPU annotates no trip counts: the same counts from the loops' conditions alone
    import re

    from behaviortrace_jax.aot import cost

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cost, "_TRIPS", re.compile("no annotation"))
        assert compile_stage.loop_counted_cost(looped) == counted
        assert grad_program(True, None) == scanned
    mapped, flat = grad_program(False, "map"), grad_program(False, "unrolled")
    # the two programs differ a little (the unrolled one shares work between examples): 3 %, where a
    # one-trip count would be 4x too low
    assert 4 in mapped["loops"] and abs(mapped["flops"] / flat["flops"] - 1) < 0.03
    assert mapped["flops_one_trip"] < 0.3 * mapped["flops"]


def test_metagradient_vjp_remat_is_compiled_and_reported(tmp_path):
    """metagradient.remat = "nothing_saveable" (configs/paper.py's) reaches the compiled vjp: on the
    smoke model with scanned layers the vjp recomputes each layer (more XLA-counted FLOPs than
    without), the forward program is unchanged (same FLOPs and temps) and the report's row names
    the policy. (Its memory saving shows at paper scale, docs/records/benchmarks.md; at smoke size the
    layers' residuals are small, and XLA:CPU's temps are not lower.)"""
    rows = {}
    for remat in ("", "nothing_saveable"):
        c = _config("cpu:2")
        with c.unlocked():
            c.compile.stages, c.compile.programs = "metagradient", "metagradient"
            c.metagradient.remat, c.model.scan_layers = remat, True
        compile_stage.compile_stage(c, str(tmp_path / (remat or "plain")))
        report = json.loads((tmp_path / (remat or "plain") / "compile_report.json").read_text())
        rows[remat] = {p["name"]: p for p in report["programs"]}
    plain, remat = rows[""], rows["nothing_saveable"]
    assert remat["metagradient_step_vjp"]["flops"] > 1.05 * plain["metagradient_step_vjp"]["flops"]
    for key in ("flops", "temp_bytes"):
        assert remat["metagradient_step"][key] == plain["metagradient_step"][key]
    assert "remat per layer: nothing_saveable" in remat["metagradient_step_vjp"]["note"]
    assert "remat per layer: none" in plain["metagradient_step_vjp"]["note"]
