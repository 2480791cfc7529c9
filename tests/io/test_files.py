"""files.py: atomic JSON writes, read_json defaults, JSONL errors naming file:line."""
from __future__ import annotations

import json
import os

import pytest

from behaviortrace_jax.io import files


def test_write_and_read_json(tmp_path):
    path = tmp_path / "a" / "b.json"
    files.write_json(path, {"b": 1, "a": [1, 2]}, sort_keys=True)
    assert path.read_text() == json.dumps({"a": [1, 2], "b": 1}, indent=2) + "\n"
    assert files.read_json(path) == {"a": [1, 2], "b": 1}
    assert not list(path.parent.glob("*.tmp"))
    assert files.read_json(tmp_path / "missing.json", {}) == {}
    with pytest.raises(FileNotFoundError):
        files.read_json(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json: invalid JSON"):
        files.read_json(tmp_path / "bad.json")


def test_unencodable_value_leaves_the_old_file(tmp_path):
    path = tmp_path / "x.json"
    files.write_json(path, {"ok": True})
    with pytest.raises(TypeError):
        files.write_json(path, {"bad": object()})
    assert files.read_json(path) == {"ok": True}


def test_iter_jsonl_skips_blanks_and_names_the_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n')
    assert list(files.iter_jsonl(path)) == [(1, {"a": 1}), (3, {"a": 2})]
    for bad, msg in (("{oops", "x.jsonl:2: invalid JSON"), ("[1, 2]", "x.jsonl:2: expected a JSON object, got list")):
        path.write_text('{"a": 1}\n' + bad + "\n")
        with pytest.raises(ValueError, match=msg):
            list(files.iter_jsonl(path))


def test_atomic_write_dir_replaces_whole_or_not_at_all(tmp_path):
    out = tmp_path / "ckpt"
    files.atomic_write_dir(out, lambda d: (d / "a.txt").write_text("1"))
    files.atomic_write_dir(out, lambda d: (d / "b.txt").write_text("2"))
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]  # the old directory is gone, not merged

    def broken(d):
        (d / "c.txt").write_text("3")
        raise RuntimeError("killed while writing")

    with pytest.raises(RuntimeError):
        files.atomic_write_dir(out, broken)
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary or old siblings left
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "b.txt").stat().st_mode & 0o777 == 0o666 & ~umask
