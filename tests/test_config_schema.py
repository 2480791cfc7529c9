"""Every config file sets only keys of configs/common.py, and a misspelt key fails at start."""
from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys

import pytest

from behaviortrace_jax import config_schema
from configs import common, tiny

REPO = pathlib.Path(__file__).resolve().parents[1]
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
