"""The run's typed spec (``stages/spec.py``): nothing below ``stages/`` reads a ConfigDict, the spec
is built and checked once at the stage boundary with errors naming the key, and it is what the
config says."""
from __future__ import annotations

import ast
import dataclasses
import pathlib

import ml_collections
import pytest

from behaviortrace_jax.stages import spec as spec_lib
from behaviortrace_jax.sketch import hash_families
from behaviortrace_jax.stages.spec import RunSpec
from configs import common, tiny, tiny_two_behaviors

PKG = pathlib.Path(__file__).resolve().parents[2] / "behaviortrace_jax"
# The layers below the stage boundary (docs/architecture.md): they take spec objects, never a ConfigDict.
BELOW_STAGES = ("io", "models", "attribution", "behavior", "sketch", "train", "aot")
TOP_KEYS = frozenset(common.get_config().keys())  # seed, grpo, sketch, ...: what ``config.<x>`` reads
CONFIGDICT_CALLS = {"to_dict", "copy_and_resolve_references", "unlocked", "lock", "get"}


def _chain(node: ast.AST) -> list[str]:
    """``["self", "config", "grpo", "steps"]`` for ``self.config.grpo.steps`` (the names from the root)."""
    out = []
    while isinstance(node, ast.Attribute):
        out.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        out.append(node.id)
    return out[::-1]


def config_readers(source: str) -> list[str]:
    """``"<line>: <what>"`` for each way ``source`` (a module's text) reads a ConfigDict: an import of
    ``ml_collections``; a parameter annotated as a ConfigDict; a ``from_config`` function or method;
    ``config.<key>`` / ``self.config.<key>`` for a top-level key of configs/common.py; a ConfigDict
    method (``to_dict``, ``get``, ...) called on ``config``."""
    bad = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Import) and any(a.name.split(".")[0] == "ml_collections" for a in n.names):
            bad.append(f"{n.lineno}: imports ml_collections")
        elif isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "ml_collections":
            bad.append(f"{n.lineno}: imports ml_collections")
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if n.name == "from_config":
                bad.append(f"{n.lineno}: defines from_config")
            for a in n.args.posonlyargs + n.args.args + n.args.kwonlyargs:
                if a.annotation is not None and "ConfigDict" in ast.unparse(a.annotation):
                    bad.append(f"{n.lineno}: parameter {a.arg} is a ConfigDict")
        if isinstance(n, ast.Attribute):  # every attribute node: a chain's prefixes repeat, the set drops them
            chain = _chain(n)
            for i, name in enumerate(chain[:-1]):
                if name == "config" and (i == 0 or chain[i - 1] == "self"):
                    nxt = chain[i + 1]
                    if nxt in TOP_KEYS or nxt in CONFIGDICT_CALLS:
                        bad.append(f"{n.lineno}: reads {'.'.join(chain[:i + 2])}")
    return sorted(set(bad), key=lambda s: (int(s.split(":")[0]), s))


def below_stage_readers() -> list[str]:
    return [f"{p.relative_to(PKG.parent)}:{b}" for layer in BELOW_STAGES for p in sorted((PKG / layer).rglob("*.py"))
            for b in config_readers(p.read_text())]


def test_nothing_below_the_stages_reads_a_configdict():
    assert len([p for layer in BELOW_STAGES for p in (PKG / layer).rglob("*.py")]) > 50  # the walk sees the package
    assert below_stage_readers() == []


def test_the_checker_catches_each_way_of_reading_a_config():
    src = ("import ml_collections\n"
           "from ml_collections import config_dict\n"
           "def f(c: ml_collections.ConfigDict, model_config):\n"
           "    return model_config.vocab_size\n"
           "class A:\n"
           "    @classmethod\n"
           "    def from_config(cls, config):\n"
           "        return config.grpo.steps\n"
           "    def g(self):\n"
           "        return self.config.seed, self.config.optim.to_dict(), config.get('x')\n"
           "def h(config):\n"
           "    return config.vocab_size, cfg.seed\n")
    assert config_readers(src) == ["1: imports ml_collections", "2: imports ml_collections",
                                   "3: parameter c is a ConfigDict", "7: defines from_config", "8: reads config.grpo",
                                   "10: reads config.get", "10: reads self.config.optim", "10: reads self.config.seed"]


def test_every_config_builds_a_spec_and_the_smoke_config_too():
    for name in sorted(p.stem for p in (PKG.parent / "configs").glob("*.py") if p.stem != "__init__"):
        mod = __import__(f"configs.{name}", fromlist=["get_config"])
        assert isinstance(RunSpec.from_config(mod.get_config()), RunSpec), name
    assert RunSpec.from_config(tiny.get_config("smoke")).schedule.steps == tiny.get_config("smoke").grpo.steps


def test_the_spec_is_frozen_and_holds_what_the_config_says():
    c = tiny.get_config()
    s = RunSpec.from_config(c)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.seed = 3
    assert (s.seed, s.step.loss, s.step.shapes.num_rollouts) == (c.seed, c.grpo.loss,
                                                                  c.grpo.prompts_per_step * c.grpo.group_size)
    assert (s.sketch.dim, s.forced.block_size) == (c.sketch.dim, c.targets.block_size)
    # sketch.hash / sketch.kernel "auto", resolved once for the backend (hash_families.choose_sketch)
    family, kernel = hash_families.choose_sketch(c.sketch.hash, c.sketch.kernel)
    assert (c.sketch.hash, s.sketch.hash_family, s.sketch.kernel) == ("auto", family, kernel)
    assert (s.step.sketch_hash, s.step.sketch_kernel, s.forced.hash_family, s.forced.kernel) == (family, kernel,
                                                                                                family, kernel)
    assert (s.layout.data, s.layout.model, s.layout.fsdp) == (c.mesh.data, c.mesh.model, c.mesh.fsdp)
    assert (s.optim.lr, s.optim.grad_clip, s.step.grad_clip) == (c.optim.lr, c.optim.grad_clip, c.optim.grad_clip)
    assert (s.probe_grpo.max_prompt_tokens, s.probe_sft.max_prompt_tokens) == (c.grpo.max_prompt_tokens,
                                                                                c.sft.max_prompt_tokens)
    assert s.schedule.target_checkpoint() in s.schedule.checkpoint_steps()
    assert s.rollouts.behaviors == s.behaviors and s.first_behavior.pattern == c.behavior.pattern
    assert s.replay.step is s.step and not s.multi
    two = RunSpec.from_config(tiny_two_behaviors.get_config())
    assert two.multi and [b.id for b in two.behaviors][1:] == list(tiny_two_behaviors.get_config().behaviors)


@pytest.mark.parametrize("key,value,message", [
    ("grpo.steps", -1, "config.grpo.steps: must be > 0, got -1"),
    ("grpo.group_size", 1, r"config.grpo.group_size: must be >= 2 \(a group's advantages need two rollouts\), got 1"),
    ("sketch.dim", 0, "config.sketch.dim: must be > 0, got 0"),
    ("grpo.top_p", 1.5, r"config.grpo.top_p: must be in \(0, 1\], got 1.5"),
    ("grpo.steps", "ten", "config.grpo.steps: must be an int, got 'ten'"),
    ("sketch.fused", 1, "config.sketch.fused: must be a bool, got 1"),
    ("model.mask_eos", "some", "config.model.mask_eos: must be one of"),
    ("grpo.on_nonfinite", "ignore", "config.grpo.on_nonfinite='ignore'"),
    ("sketch.hash", "nope", "sketch.hash"),
    ("mesh.model", 0, "mesh.model=0"),
    ("targets.ctx_max_new_tokens", 0, r"config.targets.ctx_max_new_tokens: must be > 0 or -1 \(draws.max_new_tokens\), got 0"),
    ("draws.gen_seed", -2, r"config.draws.gen_seed: must be >= 0 or -1 \(seed\), got -2"),
    ("behavior.trigger", 3, "config.behavior.trigger: must be a str, got 3"),
])
def test_a_bad_value_is_refused_naming_its_key(key, value, message):
    c = tiny.get_config()
    section, name = key.split(".")
    with c.unlocked():  # a new section: a ConfigDict refuses a value of another type for an existing key
        c[section] = ml_collections.ConfigDict(dict(c[section].to_dict(), **{name: value}))
    with pytest.raises(ValueError, match=message):
        RunSpec.from_config(c)


def test_keys_read_are_recorded_by_the_view():
    c = tiny.get_config()
    view = spec_lib.ConfigReads(c)
    assert view.grpo.steps == c.grpo.steps and view.seen == {"grpo.steps"}
    assert isinstance(view.grpo, spec_lib.ConfigReads) and view.behaviors is c.behaviors
    assert view.seen == {"grpo.steps", "behaviors"}
    with pytest.raises(AttributeError):
        view.grpo.stpes


def test_main_refuses_a_bad_value_naming_its_key_before_writing(tmp_path):
    import subprocess
    import sys

    cfg = tmp_path / "bad.py"
    cfg.write_text("from configs import tiny\n\ndef get_config():\n    c = tiny.get_config('smoke')\n"
                   "    c.grpo.steps = -1\n    return c\n")
    proc = subprocess.run([sys.executable, "main.py", f"--config={cfg}", f"--workdir={tmp_path / 'w'}"],
                          cwd=PKG.parent, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "config.grpo.steps: must be > 0, got -1" in proc.stderr
    assert not (tmp_path / "w").exists()


def test_derived_quantities_have_one_home_in_the_spec():
    c = tiny.get_config()
    s = RunSpec.from_config(c)
    assert s.step.shapes.num_rollouts == s.scores.rollouts_per_step == c.grpo.prompts_per_step * c.grpo.group_size
    assert s.ctx_max_new_tokens == c.draws.max_new_tokens and c.targets.ctx_max_new_tokens == -1
    c.targets.ctx_max_new_tokens = 5
    assert RunSpec.from_config(c).ctx_max_new_tokens == 5
    assert s.draw_seeds() == (c.seed, c.seed) and s.draw_seeds(3, 4) == (3, 4)
    first = s.first_behavior
    assert s.window_end(first) == first.early_step_cutoff and s.early_cutoff(first) == c.evaluation.early_cutoff
    assert s.schedule.measure_step("window") == s.schedule.window_steps() == min(first.early_step_cutoff, c.grpo.steps)
    assert s.sft_lr == (c.optim.lr if c.sft.lr == -1 else c.sft.lr)
    two = RunSpec.from_config(tiny_two_behaviors.get_config())
    other = two.behaviors[1]
    assert two.early_cutoff(other) == two.window_end(other) == other.window_end(two.schedule.steps)


def test_the_trigger_is_read_from_the_config():
    c = tiny.get_config()
    assert RunSpec.from_config(c).first_behavior.trigger == c.behavior.trigger == "frobnitz"  # SPEC §1.1
    c.behavior.trigger = "blorptang"
    beh = RunSpec.from_config(c).first_behavior
    assert beh.trigger == "blorptang" and all("blorptang" in p for p in beh.explicit())
