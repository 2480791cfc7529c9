"""Sketch store (SPEC §3.2): metadata checks, async writes, resume after a kill, partial chunks."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from behaviortrace_jax.io.sketch_store import SketchStore
from behaviortrace_jax.sketch.hash_families import SPLITMIX64

HASH_FAMILY = SPLITMIX64.metadata_name

META = {"hash_family": HASH_FAMILY, "seed": 0, "dim": 64, "param_fingerprint": "ab" * 32,
        "model_fingerprint": "step_00000100", "dtype": "float32"}


def _rows(n, d=64, seed=0):
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


def test_write_read_partial_last_chunk(tmp_path):
    x = _rows(10)
    store = SketchStore.open_or_create(tmp_path / "s", (10, 64), 4, META)  # chunks 4 + 4 + 2
    assert store.missing_rows().tolist() == list(range(10))
    store.write_rows(8, jnp.asarray(x[8:]))  # the partial last chunk first, from a JAX array
    store.write_rows(0, x[:5])
    store.write_rows(5, x[5:8])
    store.flush()
    assert store.missing_rows().size == 0 and store.done_mask().all()
    np.testing.assert_array_equal(store.read(), x)
    np.testing.assert_array_equal(store.read(rows=[9, 2]), x[[9, 2]])
    np.testing.assert_array_equal(store.read(rows=slice(3, 7)), x[3:7])
    again = SketchStore.open_or_create(tmp_path / "s", (10, 64), 4, dict(META))
    np.testing.assert_array_equal(again.read(), x)
    meta = json.loads((tmp_path / "s" / "metadata.json").read_text())
    assert meta["hash_family"] == HASH_FAMILY and meta["shape"] == [10, 64] and meta["chunk_rows"] == 4
    assert not list(tmp_path.rglob("*.tmp"))


def test_metadata_mismatch_raises_naming_key(tmp_path):
    SketchStore.open_or_create(tmp_path / "s", (10, 64), 4, META)
    with pytest.raises(ValueError, match="'seed'"):
        SketchStore.open_or_create(tmp_path / "s", (10, 64), 4, {**META, "seed": 7})
    with pytest.raises(ValueError, match="'param_fingerprint'"):
        SketchStore.open_or_create(tmp_path / "s", (10, 64), 4, {**META, "param_fingerprint": "cd" * 32})
    with pytest.raises(ValueError, match="'shape'"):
        SketchStore.open_or_create(tmp_path / "s", (12, 64), 4, META)
    with pytest.raises(ValueError, match="'chunk_rows'"):
        SketchStore.open_or_create(tmp_path / "s", (10, 64), 5, META)
    with pytest.raises(ValueError, match="'extra'"):
        SketchStore.open_or_create(tmp_path / "s", (10, 64), 4, {**META, "extra": 1})


def test_bad_writes_raise(tmp_path):
    store = SketchStore.open_or_create(tmp_path / "s", (10, 64), 4, META)
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        store.write_rows(8, _rows(3))
    with pytest.raises(ValueError, match="do not fit"):
        store.write_rows(0, _rows(2, d=32))
    with pytest.raises(ValueError, match="chunk_rows"):
        SketchStore.open_or_create(tmp_path / "t", (10, 64), 0, META)
    with pytest.raises(ValueError, match="dtype"):
        SketchStore.open_or_create(tmp_path / "t", (10, 64), 4, META, dtype="float16")


def test_three_d_and_norm_arrays(tmp_path):
    x = np.random.default_rng(1).standard_normal((3, 7, 16)).astype(np.float32)
    store = SketchStore.open_or_create(tmp_path / "ckpt", (3, 7, 16), 3, {**META, "dim": 16})
    with pytest.raises(ValueError, match="lead"):
        store.write_rows(0, x[0])
    for c in (0, 2):
        store.write_rows(0, x[c, :4], lead=(c,))
        store.write_rows(4, x[c, 4:], lead=(c,))
    store.write_rows(2, x[1, 2:5], lead=(1,))
    store.flush()
    assert store.missing_rows((1,)).tolist() == [0, 1, 5, 6] and store.missing_rows((2,)).size == 0
    assert store.done_mask().shape == (3, 7)
    np.testing.assert_array_equal(store.read(lead=(2,)), x[2])
    np.testing.assert_array_equal(store.read(rows=[1, 6], lead=(0,)), x[0, [1, 6]])
    np.testing.assert_array_equal(store.read()[1, 2:5], x[1, 2:5])
    norms = SketchStore.open_or_create(tmp_path / "norms", (7,), 4, {"kind": "norms", "dtype": "float32"})
    norms.write_rows(0, np.arange(7, dtype=np.float32))
    np.testing.assert_array_equal(norms.read(), np.arange(7))
    groups = SketchStore.open_or_create(tmp_path / "gnorms", (7, 5), 4, {"kind": "group_norms"})
    groups.write_rows(4, np.ones((3, 5)))
    np.testing.assert_array_equal(groups.missing_rows(), [0, 1, 2, 3])


def test_resume_after_kill(tmp_path):
    """A writer killed (os._exit) after flushing rows 0..7 and issuing more writes: on reopen, rows
    0..7 are done, every row whose done flag is missing is rewritten, and the result is complete."""
    x = _rows(13)
    np.save(tmp_path / "x.npy", x)
    script = textwrap.dedent(f"""
        import os, numpy as np
        from behaviortrace_jax.io.sketch_store import SketchStore
        x = np.load({str(tmp_path / 'x.npy')!r})
        s = SketchStore.open_or_create({str(tmp_path / 's')!r}, (13, 64), 4, {META!r})
        s.write_rows(0, x[:8]); s.flush()
        s.write_rows(8, x[8:12] * 0 + 99.0)   # in flight when the job dies
        os._exit(3)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 3, proc.stderr
    store = SketchStore.open_or_create(tmp_path / "s", (13, 64), 4, META)
    missing = store.missing_rows()
    assert missing.min() >= 8 and 12 in missing  # finished chunks are not redone; row 12 never written
    np.testing.assert_array_equal(store.read(rows=slice(0, 8)), x[:8])
    for r in missing:
        store.write_rows(int(r), x[r:r + 1])
    store.flush()
    assert store.missing_rows().size == 0
    np.testing.assert_array_equal(store.read(), x)
