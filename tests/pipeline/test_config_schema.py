"""Every config file sets only keys of configs/common.py, and a misspelt key fails at start."""
from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import ml_collections
import pytest

from behaviortrace_jax import config_schema
from configs import common, tiny

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted(p.stem for p in (REPO / "configs").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_file_uses_only_schema_keys(name):
    config = importlib.import_module(f"configs.{name}").get_config()
    config_schema.check_config(config, common.get_config(), source=f"configs/{name}.py")


def test_a_misspelt_key_is_named_with_the_nearest_valid_one():
    c = tiny.get_config()
    c.grpo.stpes = 10
    c.sketch.chunk = 4
    with pytest.raises(ValueError, match=r"'grpo.stpes' \(did you mean 'grpo.steps'\?\), 'sketch.chunk' "
                                         r"\(did you mean 'sketch.chunk_size'\?\)"):
        config_schema.check_config(c, common.get_config(), source="my_config.py")


def test_behaviour_ids_are_free_form_and_checked_by_their_reader():
    from configs import tiny_two_behaviors

    c = tiny_two_behaviors.get_config()
    assert "behaviors" in set(config_schema.key_paths(c))
    config_schema.check_config(c, common.get_config())


def test_main_refuses_a_config_file_with_an_unknown_key(tmp_path):
    cfg = tmp_path / "typo.py"
    cfg.write_text("from configs import tiny\n\ndef get_config():\n    c = tiny.get_config('smoke')\n"
                   "    c.grpo.stpes = 3\n    return c\n")
    proc = subprocess.run([sys.executable, "main.py", f"--config={cfg}", f"--workdir={tmp_path / 'w'}"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "'grpo.stpes' (did you mean 'grpo.steps'?)" in proc.stderr
    assert not (tmp_path / "w").exists()


CONFIGDICT_METHODS = {"to_dict", "unlocked", "keys", "items", "values", "get", "update", "lock",
                     "copy_and_resolve_references"}


def config_reads(source: str) -> list[tuple[int, str, str]]:
    """``(line, read, problem)`` for each read of a name ``config`` in ``source`` (Python) that the
    schema (configs/common.py) does not back: a chain ``config.a.b`` naming no key ("missing"), a
    ``.get(...)`` of a config subtree, which gives a default for a misspelt key ("get"), or a
    ``"key" in config...`` test ("membership"). Only the name ``config`` is followed (not aliases)."""
    schema, tree = common.get_config(), ast.parse(source)
    parents = {ch: n for n in ast.walk(tree) for ch in ast.iter_child_nodes(n)}
    out = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Name) and n.id == "config"):
            continue
        chain, cur = [], n
        while isinstance(parents.get(cur), ast.Attribute):
            cur = parents[cur]
            chain.append(cur.attr)
        node, read = schema, "config" + "".join(f".{a}" for a in chain)
        for a in chain:
            if not isinstance(node, ml_collections.ConfigDict):
                break  # a leaf's own attribute (str.split, ...)
            if a in node:
                node = node[a]
                continue
            if a == "get":
                out.append((n.lineno, read, "get"))
            elif a not in CONFIGDICT_METHODS:
                out.append((n.lineno, read, "missing"))
            break
        up = parents.get(cur)
        if isinstance(up, ast.Compare) and cur in up.comparators and any(
                isinstance(o, (ast.In, ast.NotIn)) for o in up.ops) and isinstance(node, ml_collections.ConfigDict):
            out.append((n.lineno, read, "membership"))
    return sorted(out)


def test_config_reads_of_a_sample_are_classified():
    src = ("config.grpo.steps\nconfig.grpo.stpes\nconfig.sketch.get('fused', False)\n"
           "'trigger' in config.behavior\nconfig.stages.split(',')\nconfig.optim.to_dict()\n")
    assert config_reads(src) == [(2, "config.grpo.stpes", "missing"), (3, "config.sketch.get", "get"),
                                 (4, "config.behavior", "membership")]


def test_the_package_reads_only_schema_keys_by_attribute():
    """Every ``config.<...>`` read in the package names a key of configs/common.py, by attribute (a
    locked ConfigDict then raises for a misspelt key) - no ``.get`` defaults, no membership tests.
    models/ is left out: its ``config`` is a model config."""
    pkg = REPO / "behaviortrace_jax"
    bad = [f"{p.relative_to(REPO)}:{line}: {read} ({why})" for p in sorted(pkg.rglob("*.py"))
           if "models" not in p.relative_to(pkg).parts for line, read, why in config_reads(p.read_text())]
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------------------------------------
# The typed spec reads every key (stages/spec.py): no key of the schema is ignored
# ------------------------------------------------------------------------------------------------
def test_the_spec_builder_reads_every_schema_key_but_the_top_level_ones():
    """``RunSpec.from_config`` reads every key of configs/common.py, except ``spec.TOP_LEVEL_KEYS``
    (resolved by the pipeline before any stage runs), which it must not read, and which the
    pipeline does read."""
    from behaviortrace_jax import pipeline
    from behaviortrace_jax.stages import spec

    schema = common.get_config()
    keys, read = set(config_schema.key_paths(schema)), spec.keys_read(schema)
    assert read <= keys, sorted(read - keys)
    assert sorted(keys - read) == sorted(spec.TOP_LEVEL_KEYS)
    source = pathlib.Path(pipeline.__file__).read_text()
    assert all(f"config.{k}" in source for k in spec.TOP_LEVEL_KEYS)


def test_the_read_check_sees_an_ignored_key():
    """A key the builder ignores shows up as unread (the check above could fail)."""
    from behaviortrace_jax.stages import spec

    c = common.get_config()
    with c.unlocked():
        c.grpo.ignored_key = 1
    assert "grpo.ignored_key" in set(config_schema.key_paths(c)) - spec.keys_read(c)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_file_builds_a_run_spec(name):
    from behaviortrace_jax.stages.spec import RunSpec

    config = importlib.import_module(f"configs.{name}").get_config()
    assert RunSpec.from_config(config).seed == config.seed
