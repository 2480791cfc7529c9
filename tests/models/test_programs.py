"""The jitted programs of a run (``models/programs.py``): every ``jax.jit`` of the package is a named
program, and the ``compile`` stage compiles every program a smoke run traces, on the same mesh."""
from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import pytest

from behaviortrace_jax.models import programs, sharding
from behaviortrace_jax.stages.spec import RunSpec

PKG = pathlib.Path(__file__).resolve().parents[2] / "behaviortrace_jax"
# One-shot set-up programs, run once where they are made and not part of any stage's loop: the
# parameters' initialisation, the optimizer state's, the CountSketch hash tables and the compile
# stage's probe of XLA's memory limit.
SET_UP = {("models/decoder.py", "init_model"), ("train/train_state.py", "init_train_state"),
          ("sketch/hash_tables.py", "layout_tables"), ("aot/memory.py", "xla_memory_limit"),
          ("train/start_state.py", "load_start_state")}  # a fresh AdamW state (grpo.continue_sft_moments=False)
# Compiled by no builder of the compile stage: the replay's probe measure, whose shapes come from
# the tokenized probes and controls (the compile stage has no tokenizer).
NOT_COMPILED = {"replay_measure", "replay_measure_grad"}


def jit_calls() -> list[tuple[str, str, int]]:
    """(file under the package, enclosing function, line) of every ``jax.jit`` / ``nnx.jit`` call."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "jit"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id in ("jax", "nnx")):
                    found.append((rel, fn.name, node.lineno))
    return sorted(set(found))


def test_every_jit_of_the_package_is_a_named_program():
    calls = jit_calls()
    assert any(c[:2] == ("models/programs.py", "jit") for c in calls)
    stray = [c for c in calls if c[0] != "models/programs.py" and (c[0], c[1]) not in SET_UP]
    assert not stray, f"jax.jit outside models/programs.py (use programs.jit with a PROGRAMS name): {stray}"
    assert {(f, n) for f, n, _ in calls} >= SET_UP  # the list names real call sites


def test_programs_jit_records_the_outermost_program_and_its_mesh():
    mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    inner = programs.jit("forced_mean_logprob", lambda x: x + 1)
    outer = programs.jit("grpo_step", lambda x: inner(x) * 2, mesh=mesh)
    with programs.recording() as seen:
        assert float(outer(jnp.float32(1))) == 4.0
    assert seen == {("grpo_step", (("data", 1), ("model", 1)))}  # the nested program is part of grpo_step
    with programs.recording() as seen:
        inner(jnp.float32(1))  # traced already: a cache hit records nothing
        programs.jit("sampler_prefill", lambda x: x)(jnp.float32(1))
    assert seen == {("sampler_prefill", None)}
    with pytest.raises(ValueError, match=r"unknown program 'sampler'.*models/programs.py"):
        programs.jit("sampler", lambda x: x)


def test_every_program_a_smoke_run_jits_is_compiled_on_its_mesh(smoke_programs):
    """The compile stage's programs for the smoke config on the run's mesh (built, not compiled)
    include every (program, mesh) the smoke run traced."""
    from behaviortrace_jax.stages import compile as compile_stage
    from configs import tiny

    config = tiny.get_config("smoke")
    mesh = RunSpec.from_config(config).layout.mesh()  # the run's mesh, as every stage builds it
    spec = RunSpec.from_config(config)
    built = compile_stage.build_programs(spec.compile, compile_stage.model_config(spec), mesh)
    compiled = {(pr.program, pr.mesh) for pr in built}
    assert {"sampler_prefill", "sampler_decode", "lm_step", "grpo_step", "per_example_sketcher",
            "forced_mean_logprob"} <= {name for name, _ in smoke_programs}
    missing = sorted(smoke_programs - compiled, key=str)
    assert not missing, f"the smoke run jits programs the compile stage does not compile: {missing}; built: {compiled}"
    assert not {name for name, _ in compiled} & {"metagradient_step", "metagradient_step_vjp"}  # not a smoke stage
    with config.unlocked():
        config.compile.stages = "base,grpo,metagradient,sketch"  # every stage that runs a listed program
    every = compile_stage.build_programs(RunSpec.from_config(config).compile,
                                         compile_stage.model_config(RunSpec.from_config(config)), mesh)
    assert {pr.program for pr in every} == set(programs.PROGRAMS) - NOT_COMPILED
