"""``models.sharding.Layout``: the one mesh of a run (issue 33, "One mesh").

The layout is read from ``config.mesh`` once (``stages/spec.py``, ``RunSpec.layout``), its ``mesh()`` is
the only place the package builds a mesh, and FSDP is honoured wherever parameters are placed: the
``sketch`` and ``draws`` stages run the very programs (same parameter shardings, same lowered
module) that the ``compile`` stage lowers and reports for the same config.
"""
from __future__ import annotations

import ast
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

from behaviortrace_jax.models import sharding
from behaviortrace_jax.models.sharding import Layout
from behaviortrace_jax.stages.spec import RunSpec
from configs import tiny
from hf_fixtures import save_random_qwen2

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "behaviortrace_jax"


def test_the_spec_reads_and_checks_the_mesh_keys():
    c = tiny.get_config("smoke")
    assert RunSpec.from_config(c).layout == Layout(c.mesh.data, c.mesh.model, c.mesh.fsdp)
    with c.unlocked():
        c.mesh.data, c.mesh.model, c.mesh.fsdp = 4, 2, True
    layout = RunSpec.from_config(c).layout
    assert (layout.data, layout.model, layout.fsdp, layout.devices) == (4, 2, True, None)
    assert dict(layout.mesh().shape) == {"data": 4, "model": 2}
    assert layout.mesh() == layout.mesh() and hash(layout) == hash(Layout(4, 2, True))
    for key, value in (("data", 0), ("model", -2)):
        bad = tiny.get_config("smoke")
        setattr(bad.mesh, key, value)
        with pytest.raises(ValueError, match=rf"mesh\.{key}={value}"):
            RunSpec.from_config(bad).layout
    with pytest.raises(ValueError, match=r"mesh\.data=2\.0"):
        Layout(data=2.0)
    with pytest.raises(ValueError, match=r"mesh\.fsdp=1 must be a bool"):
        Layout(fsdp=1)
    with pytest.raises(ValueError, match=r"mesh\.data=3 x mesh\.model=2 = 6 != 8 devices"):
        Layout(3, 2).mesh()
    with pytest.raises(ValueError, match="no devices"):
        Layout(devices=())


def test_devices_and_fsdp_shardings():
    devs = jax.devices()
    two = RunSpec.from_config(tiny.get_config("smoke")).layout.on(devs[2:4])
    assert two.mesh().devices.ravel().tolist() == devs[2:4] and two == Layout(-1, 1, False).on(devs[2:4])
    abstract = nnx.state(_abstract(), nnx.Param)
    plain = jax.tree.leaves(Layout(4, 2).param_shardings(abstract))
    fsdp = jax.tree.leaves(Layout(4, 2, fsdp=True).param_shardings(abstract))
    assert not any("data" in s.spec for s in plain)
    assert any("data" in s.spec for s in fsdp)  # every matrix split over "data" where it divides
    assert [s.spec for s in jax.tree.leaves(Layout(1, 8, fsdp=True).param_shardings(abstract))] == \
        [s.spec for s in jax.tree.leaves(Layout(1, 8).param_shardings(abstract))]  # data axis 1: no-op


def _abstract():
    from behaviortrace_jax.models import decoder, qwen2

    return decoder.abstract_model(qwen2.Qwen2Config.tiny(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                         num_hidden_layers=1, num_attention_heads=4,
                                                         num_key_value_heads=2, head_dim=16))


# ------------------------------------------------------------------------------------------------
# one construction site
# ------------------------------------------------------------------------------------------------

# (file, enclosing function): the only places in the package that may build a mesh. The io layer
# sits below models (it cannot import Layout); its one mesh is not a run layout but "replicated
# over every device" for a restored leaf that was requested without a sharding in a multi-process
# run (io/checkpoints._default_sharding).
MESH_BUILDERS = {("models/sharding.py", "make_mesh"), ("io/checkpoints.py", "_default_sharding")}
MAKE_MESH_CALLERS = {("models/sharding.py", "mesh")}  # Layout.mesh


def _calls(name_of: callable) -> list[tuple[str, str, int]]:
    """(file, enclosing function, line) of every call in the package whose callee ``name_of`` accepts."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(), str(path))

        def visit(node, func):
            for child in ast.iter_child_nodes(node):
                inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
                if isinstance(child, ast.Call):
                    f = child.func
                    callee = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                    if callee and name_of(callee):
                        out.append((rel, func, child.lineno))
                visit(child, inner)

        visit(tree, "<module>")
    return out


def test_only_layout_mesh_constructs_a_mesh():
    meshes = _calls(lambda n: n in ("Mesh", "AbstractMesh"))
    assert {(f, fn) for f, fn, _ in meshes} == MESH_BUILDERS, meshes
    makers = _calls(lambda n: n == "make_mesh")  # models.sharding.make_mesh and jax.make_mesh alike
    assert {(f, fn) for f, fn, _ in makers} == MAKE_MESH_CALLERS, makers
    assert any(f == "models/sharding.py" and fn == "make_mesh" for f, fn, _ in meshes)  # the scan sees calls


def test_only_layout_reads_the_mesh_keys():
    """No ``<config>.mesh`` read in the package outside the spec builder (``stages/spec.build``, whose
    read-tracking view of the config is ``c``)."""
    reads = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef):
                for sub in ast.walk(node):
                    v = getattr(sub, "value", None)
                    if isinstance(sub, ast.Attribute) and sub.attr == "mesh" and (
                            isinstance(v, ast.Name) and v.id in ("config", "c")
                            or isinstance(v, ast.Attribute) and v.attr == "config"):
                        reads.append((rel, node.name, sub.lineno))
    assert {(f, fn) for f, fn, _ in reads} == {("stages/spec.py", "build")}, reads


# ------------------------------------------------------------------------------------------------
# the stages run what the compile stage reports
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """A random Qwen2 checkpoint and a smoke config on 4 x 2 of the 8 fake devices with FSDP."""
    hf = save_random_qwen2(tmp_path_factory.mktemp("ckpt") / "hf", layers=1)
    c = tiny.get_config("smoke")
    with c.unlocked():
        c.model.hf_dir = str(hf)
        c.mesh.data, c.mesh.model, c.mesh.fsdp = 4, 2, True
        c.compile.target, c.compile.stages = "cpu:8", "sketch,draws"
    return c, hf


def _flat_shardings(tree) -> dict[str, jax.sharding.NamedSharding]:
    return {jax.tree_util.keystr(p): x.sharding for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _block(forced, length: int):
    """A packed block of ``length`` tokens placed as ``ForcedSketcher.__call__`` places it."""
    b = forced.block_size
    batch = {"input_ids": np.zeros((b, length), np.int32), "attention_mask": np.ones((b, length), np.int32),
             "loss_mask": np.ones((b, length), np.float32)}
    return jax.device_put(batch, forced.block_sharding())


def test_sketch_and_draws_stages_run_the_programs_compile_reports(fsdp_run):
    from behaviortrace_jax.models import tokenizer as tok_lib
    from behaviortrace_jax.sketch import targets
    from behaviortrace_jax.stages import compile as compile_stage, draws, sketch

    config, hf = fsdp_run
    devs = compile_stage.target_devices(config.compile.target)[0]
    cfg = compile_stage.model_config(RunSpec.from_config(config))
    mesh = RunSpec.from_config(config).layout.on(devs).mesh()  # what compile_stage builds
    run = compile_stage.AbstractRun.build(RunSpec.from_config(config).compile, cfg, mesh)
    reported = {pr.name: pr for pr in compile_stage.build_programs(RunSpec.from_config(config).compile, cfg, mesh)}
    want = _flat_shardings(run.params)
    assert any("data" in s.spec for s in want.values())  # FSDP is on in what compile lowers

    # the sketch stage: its checkpoint loader and forced sketcher (sketch_stage)
    loader = sketch.CheckpointLoader(RunSpec.from_config(config), str(hf))
    params = loader.params(str(hf))
    assert _flat_shardings(params) == want
    forced = targets.ForcedSketcher.from_options(loader.spec.forced, loader.graphdef, loader.model_config,
                                                 loader.abstract, tok_lib.pad_id(loader.tokenizer), mesh=loader.mesh)
    # the draws stage: its loaded checkpoint, sampler and forced sketcher (draws._load_env)
    env = draws._load_env(RunSpec.from_config(config), hf)
    assert _flat_shardings(env.params) == want
    assert env.sampler.mesh == mesh

    g, tg = config.grpo, config.targets
    bucket = lambda x: -(-x // tg.length_bucket) * tg.length_bucket  # noqa: E731
    ctx_new = RunSpec.from_config(config).ctx_max_new_tokens  # targets.ctx_max_new_tokens, -1: draws'
    runs = {"target_sketcher": (forced, params, bucket(g.max_prompt_tokens + ctx_new)),
            "rollout_resketcher": (forced, params, bucket(g.max_prompt_tokens + g.max_new_tokens)),
            "draws_sketcher": (env.sketcher, env.params, bucket(g.max_prompt_tokens + config.draws.max_new_tokens))}
    for name, (fs, p, length) in runs.items():
        ran = fs.sketcher.lower(p, _block(fs, length))
        assert ran.as_text() == reported[name].lower().as_text(), name
    blk = _block(forced, runs["target_sketcher"][2])
    ran = forced.mean_logprob.lower(params, blk["input_ids"], blk["attention_mask"], blk["loss_mask"])
    assert ran.as_text() == reported["target_mean_logprob"].lower().as_text()
