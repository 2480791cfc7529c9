"""docs/reference/config.md is generated from configs/common.py (tools/config_reference.py) and
current: every key, its default and its comment."""
import importlib.util
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "tools" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_config_reference_is_current():
    tool = _tool()
    assert tool.OUTPUT.read_text() == tool.render(), "run python tools/config_reference.py"


def test_every_key_is_documented_with_its_default_and_comment():
    from configs import common

    tool = _tool()
    text = tool.OUTPUT.read_text()
    for key, value in tool._flat(common.get_config()).items():
        row = next((r for r in text.splitlines() if r.startswith(f"| `{key}` |")), None)
        assert row is not None, f"{key} missing"
        assert f"`{value!r}`" in row, (key, row)
        assert not row.endswith("|  |"), f"{key} has no comment"


def test_comments_before_after_and_continued():
    tool = _tool()
    source = '''def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0  # The seed.
    # --- model (SPEC §2) ---
    c.model = ml_collections.ConfigDict()
    # Said before
    # over two lines.
    c.model.a = 1
    c.model.b = 2  # Goes on
    # below it.
    c.model.c = 3  # Its own.
    return c
'''
    assert tool.parse(source) == [("key", "seed", "The seed."), ("section", "model", "model (SPEC §2)"),
                                  ("key", "model.a", "Said before over two lines."),
                                  ("key", "model.b", "Goes on below it."), ("key", "model.c", "Its own.")]


def test_a_key_missing_from_the_file_is_named(monkeypatch, tmp_path):
    tool = _tool()
    src = tmp_path / "common.py"
    src.write_text(tool.SOURCE.read_text().replace("    c.seed = 0", "    c['seed'] = 0"))
    monkeypatch.setattr(tool, "SOURCE", src)
    with pytest.raises(ValueError, match=r"not assigned as c.<key> = \.\.\.: \['seed'\]"):
        tool.render()
