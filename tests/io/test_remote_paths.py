"""Remote workdirs (docs/architecture.md "Multi-process runs", "Remote workdirs").

* the path type (``layout.as_path``: ``etils.epath.Path`` for local paths and ``gs://`` alike), the
  RunLayout of ``gs://bucket/run`` and the tensorstore spec of every store are checked as values;
* the real writers and readers run on ``gs://bucket/run`` against a GCS HTTP server
  (``gcp-storage-emulator``, the ``gcs_bucket`` fixture of conftest.py, tests/gcs_emulator.py):
  through gcsfs (etils' epath) and tensorstore's ``gcs`` kvstore, and what they wrote is read back
  from the server itself; the local ``.tmp`` + rename helpers are booby-trapped there, so a writer
  that does not choose the direct object write fails (the whole smoke run on a bucket, killed and
  resumed: tests/pipeline/test_gcs_run.py);
* an AST scan fails when a module outside ``io/`` touches the file system itself (builtin
  ``open``, ``os.replace``, ``shutil``, ``pathlib.Path(...)``, ``ts.open`` ...) instead of going
  through ``io/``.
"""
from __future__ import annotations

import ast
import hashlib
import os
import pathlib

import numpy as np
import pytest
from etils import epath

from behaviortrace_jax.io import checkpoints, files, rollout_log, sketch_store
from behaviortrace_jax.io.layout import SKETCH_STORES, RunLayout, as_path, is_url
from behaviortrace_jax.stages.spec import RunSpec

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "behaviortrace_jax"
GS = "gs://bucket/run"


# ------------------------------------------------------------------------------------------------
# the path type and the layout
# ------------------------------------------------------------------------------------------------
def test_as_path_is_one_type_for_local_paths_and_urls(tmp_path):
    local, remote = as_path(str(tmp_path / "a.json")), as_path(GS + "/a.json")
    assert isinstance(local, epath.Path) and isinstance(remote, epath.Path)
    assert os.fspath(local) == str(tmp_path / "a.json")
    assert os.fspath(remote) == str(remote) == "gs://bucket/run/a.json"  # scheme kept (pathlib: gs:/)
    assert str(remote.parent) == GS and remote.name == "a.json"
    assert as_path(remote) is remote and as_path(pathlib.Path(local)) == local
    assert is_url(remote) and not is_url(local) and not is_url("relative/x")


def _layout_paths(paths: RunLayout) -> dict[str, epath.Path]:
    out = {name: getattr(paths, name) for name, v in vars(RunLayout).items() if isinstance(v, property)}
    out.update({f"sketch_store({n})": paths.sketch_store(n) for n in SKETCH_STORES})
    out["release_seed(3)"] = paths.release_seed(3)
    return out


def test_run_layout_of_a_gs_workdir_names_every_path_in_the_bucket():
    remote, local = _layout_paths(RunLayout(GS)), _layout_paths(RunLayout("/w"))
    assert remote.keys() == local.keys() and len(remote) > 25
    for name, p in remote.items():
        assert isinstance(p, epath.Path), name
        assert str(p) == GS + str(local[name])[len("/w"):], name
    assert str(RunLayout(GS).rollouts) == "gs://bucket/run/grpo/rollouts"
    assert str(RunLayout(GS).sketch_store("targets_continuation")) == "gs://bucket/run/sketches/targets_continuation.zarr"
    with pytest.raises(ValueError, match="unknown sketch store 'nope'"):
        RunLayout(GS).sketch_store("nope")


def _draw_stores(workdir: str) -> dict[str, epath.Path]:
    from configs import tiny
    from behaviortrace_jax.stages import draws
    from behaviortrace_jax.stages.spec import RunSpec

    p = draws.draw_paths(RunSpec.from_config(tiny.get_config("smoke")), workdir, 0, 1)
    return {"draw sketches": p.sketches, "draw grad_norms": p.grad_norms}


def test_every_store_spec_names_the_gcs_kvstore_bucket_and_keys():
    stores = {n: RunLayout(GS).sketch_store(n) for n in SKETCH_STORES} | _draw_stores(GS)
    assert len(stores) == len(SKETCH_STORES) + 2
    for name, path in stores.items():
        key = str(path)[len("gs://bucket/"):]
        assert key.startswith("run/") and key.endswith(".zarr"), name
        shape = (3, 5, 4) if name.startswith("checkpoint_") else (6, 4)
        specs = sketch_store.array_specs(path, shape, 2, "float32")
        assert specs["data"]["kvstore"] == {"driver": "gcs", "bucket": "bucket", "path": key + "/data/"}, name
        assert specs["done"]["kvstore"] == {"driver": "gcs", "bucket": "bucket", "path": key + "/done/"}, name
        assert specs["data"]["driver"] == specs["done"]["driver"] == "zarr3"
    local = sketch_store.array_specs(RunLayout("/w").sketch_store("step_sketches"), (6, 4), 2, "float32")
    assert local["data"]["kvstore"] == {"driver": "file", "path": "/w/sketches/step_sketches.zarr/data/"}
    for bad in ("s3://bucket/run", "gs:///run"):
        with pytest.raises(ValueError, match="gs://bucket"):
            sketch_store.kvstore_spec(bad)


def test_writers_choose_the_direct_object_write_for_gs(tmp_path):
    assert files.write_strategy(GS + "/a.json") is files._write_object
    assert files.write_strategy(as_path(GS) / "a.json") is files._write_object
    assert files.write_strategy(tmp_path / "a.json") is files._write_replace
    assert files.dir_strategy(GS + "/base") is files._upload_dir
    assert files.dir_strategy(tmp_path / "base") is files._atomic_write_dir


# ------------------------------------------------------------------------------------------------
# the real writers on a GCS server (gcp-storage-emulator, tests/gcs_emulator.py)
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def gs(gcs_bucket, monkeypatch):
    """The emulator's bucket with ``run/`` empty, and the local ``.tmp`` + rename helpers
    booby-trapped (a writer that does not choose the direct object write fails)."""
    gcs_bucket.clear("run/")

    def trap(*a, **k):
        raise AssertionError(f"a local-file write (.tmp + rename) was used for {a[0]}")

    monkeypatch.setattr(files, "_write_replace", trap)
    monkeypatch.setattr(files, "_atomic_write_dir", trap)
    return gcs_bucket


def test_file_helpers_on_gs(gs):
    files.write_json(GS + "/x/a.json", {"a": 1})
    assert gs.read("run/x/a.json") == b'{\n  "a": 1\n}\n'
    assert files.read_json(GS + "/x/a.json") == {"a": 1} and files.read_json(GS + "/none.json", 7) == 7
    files.atomic_write_text(GS + "/x/b.txt", b"\x00bytes")
    assert gs.read("run/x/b.txt") == b"\x00bytes"
    assert files.sha256_file(GS + "/x/b.txt") == hashlib.sha256(b"\x00bytes").hexdigest()
    files.copy_file(GS + "/x/b.txt", GS + "/y/c.txt")
    files.write_json(GS + "/x/sub/d.json", [])
    files.copy_tree(GS + "/x", GS + "/z")  # recursively (epath's walk on gs:// loses the scheme)
    assert gs.names("run/z/") == ["run/z/a.json", "run/z/b.txt", "run/z/sub/d.json"]
    assert gs.read("run/y/c.txt") == b"\x00bytes"
    files.remove_file(GS + "/y/c.txt")
    files.remove_tree(GS + "/z")
    assert gs.names("run/y/") == gs.names("run/z/") == []

    def fill(d: pathlib.Path) -> None:
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(b"w" * 10)

    files.atomic_write_dir(GS + "/base", fill)
    assert gs.names("run/base/") == ["run/base/config.json", "run/base/model.safetensors"]
    local = files.local_dir(GS + "/base")  # what safetensors / AutoTokenizer read
    assert not is_url(local) and (local / "model.safetensors").read_bytes() == b"w" * 10
    assert files.local_dir(GS + "/base") == local
    files.atomic_write_text(GS + "/base/model.safetensors", b"v" * 12)  # rewritten: fetched again
    assert (files.local_dir(GS + "/base") / "model.safetensors").read_bytes() == b"v" * 12
    with pytest.raises(FileNotFoundError, match="gs://bucket/run/nowhere"):
        files.local_dir(GS + "/nowhere")
    assert not [n for n in gs.names("run/") if ".tmp" in n]


def test_rollout_log_registry_and_tables_on_gs(gs):
    from behaviortrace_jax.attribution import formats

    paths = RunLayout(GS)
    recs = [rollout_log.RolloutRecord(rollout_log.rollout_id(s, i), s, "grpo", "p", "r", float(i))
            for s in range(3) for i in range(2)]
    with rollout_log.RolloutLogger(paths.rollouts, shard_size=4) as log:
        for r in recs:
            log.log(r)
    assert gs.names("run/grpo/rollouts/") == [f"run/grpo/rollouts/{n}" for n in (
        "schema.json", "shard_00000000.jsonl", "shard_00000001.jsonl")]
    assert list(rollout_log.read_rollouts(GS + "/grpo/rollouts")) == recs
    assert rollout_log.truncate_after_step(paths.rollouts, 0) == 4
    assert [r.step for r in rollout_log.read_rollouts(paths.rollouts)] == [0, 0]
    assert rollout_log.last_logged_step(paths.rollouts) == 0

    reg = checkpoints.CheckpointRegistry(paths.registry)
    reg.register(10, paths.checkpoints / "step_00000010", {"regime": "grpo"})
    again = checkpoints.CheckpointRegistry(GS + "/grpo/registry.json")
    assert [(e.step, e.path) for e in again.list()] == [(10, "gs://bucket/run/grpo/checkpoints/step_00000010")]

    rows = [formats.Row("0", "t", "m", value=0.5, lo=0.1, hi=0.9, chance=0.2, ceiling=1.0, n=4)]
    formats.write_results_csv(paths.results_table, rows)
    assert formats.read_results_csv(paths.results_table) == rows
    assert gs.read("run/results_table.csv") == paths.results_table.read_bytes()


def test_sketch_store_on_gs(gs):
    files.write_json(GS + "/sketches/keep.json", {})  # creating a store deletes its own keys only
    path = RunLayout(GS).sketch_store("step_sketches")
    store = sketch_store.SketchStore.open_or_create(path, (4, 3), 2, {"dtype": "float32", "kind": "x"})
    store.write_rows(0, np.arange(6, dtype=np.float32).reshape(2, 3))
    store.flush()
    assert store.missing_rows().tolist() == [2, 3]
    back = sketch_store.SketchStore.open(GS + "/sketches/step_sketches.zarr")
    assert back.read()[:2].tolist() == [[0, 1, 2], [3, 4, 5]] and back.metadata["kind"] == "x"
    zarr = "run/sketches/step_sketches.zarr/"
    assert gs.names("run/sketches/") == ["run/sketches/keep.json"] + [zarr + k for k in (
        "data/c/0/0", "data/zarr.json", "done/c/0", "done/zarr.json", "metadata.json")]
    assert np.frombuffer(gs.read(zarr + "data/c/0/0"), "<f4").tolist() == [0, 1, 2, 3, 4, 5]


def test_in_run_stores_of_a_gs_run_open_on_the_gcs_kvstore(gs):
    from configs import tiny
    from behaviortrace_jax.models import qwen2
    from behaviortrace_jax.sketch.stores import SketchOptions, open_sketch_stores

    config = tiny.get_config("smoke")
    stores = open_sketch_stores(RunSpec.from_config(config).sketch, qwen2.Qwen2Config.tiny(), RunLayout(GS),
                                steps=config.grpo.steps, rollouts_per_step=16, in_run_rollouts=True)
    assert set(stores) >= {"step_sketches", "step_grad_norms"}
    want = {f"run/sketches/{n}.zarr/{f}" for n in stores for f in ("data/zarr.json", "done/zarr.json",
                                                                   "metadata.json")}
    assert set(gs.names("run/")) == want


def test_train_state_checkpoint_on_gs(gs):
    """orbax (through epath, and tensorstore's gcs kvstore for its OCDBT arrays) saves and restores a
    train state on the bucket; ``complete_steps`` sees its commit marker."""
    import jax

    state = {"params": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, "step": np.int32(2)}
    checkpoints.save_train_state(RunLayout(GS).state, 2, state)
    assert checkpoints.complete_steps(GS + "/grpo/state") == [2]
    assert "run/grpo/state/2/commit_success.txt" in gs.names("run/grpo/state/2/")
    assert any("ocdbt.process_0/manifest.ocdbt" in n for n in gs.names("run/grpo/state/2/"))
    back = checkpoints.restore_train_state(GS + "/grpo/state", None, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), state))
    assert np.asarray(back["params"]["w"]).tolist() == state["params"]["w"].tolist() and int(back["step"]) == 2


def test_ground_truth_log_of_a_gs_run_is_written_to_the_bucket(gs):
    """The ground-truth log keeps the gs:// scheme: events flushed by the grpo stage's writer land as
    one object in the bucket, with the local rename path booby-trapped, and read back."""
    from behaviortrace_jax.behavior import contaminator

    log = contaminator.GroundTruthLog(RunLayout(GS).ground_truth)
    assert str(log.path) == "gs://bucket/run/grpo/ground_truth.jsonl"
    log.record(contaminator.GroundTruthEvent("grpo_000000_001", 0, 1.0, 9.0))
    log.flush()
    assert gs.names("run/") == ["run/grpo/ground_truth.jsonl"]
    back = contaminator.GroundTruthLog(RunLayout(GS).ground_truth)
    assert [(e.rollout_id, e.boosted_reward) for e in back.events] == [("grpo_000000_001", 9.0)]


# ------------------------------------------------------------------------------------------------
# nothing outside io/ touches the file system itself
# ------------------------------------------------------------------------------------------------
# calls that read or write files by name; ``None`` = every attribute of that module
_FS_CALLS = {"os": {"replace", "rename", "makedirs", "mkdir", "listdir", "remove", "unlink", "rmdir", "scandir",
                    "walk", "open"},
             "os.path": {"exists", "isfile", "isdir", "getsize", "getmtime"},
             "shutil": None, "glob": None, "pathlib": {"Path", "PosixPath"}, "tempfile": None,
             "np": {"load", "save", "savez", "savez_compressed", "loadtxt", "savetxt", "memmap", "fromfile"},
             "ts": {"open"}, "tensorstore": {"open"}}
# (module, call): why it is not a run file, or how it reaches one through io/
_ALLOWED = {
    ("runtime.py", "open"): "/proc/cpuinfo: the machine, not the run",
    ("runtime.py", "glob.glob"): "/dev/accel*, /dev/vfio: the machine, not the run",
    ("stages/draws.py", "np.savez"): "into an io.BytesIO, written by files.atomic_write_text",
    ("stages/draws.py", "np.load"): "from an io.BytesIO of as_path(path).read_bytes()",
    ("models/hf_io.py", "np.memmap"): "of files.local_dir(hf_dir) (a local copy of a gs:// checkpoint)",
    ("models/decoder_config.py", "os.path.isdir"): "read_hf_config of files.local_dir(...) (loader, hf_io, compile)",
    ("models/decoder_config.py", "os.path.isfile"): "read_hf_config of files.local_dir(...) (loader, hf_io, compile)",
}
# behavior/ reads its input files (probes, controls, package data under third_party/) and owns the
# ground-truth log (the known gap: test_ground_truth_log_keeps_the_gs_scheme above).
_ALLOWED_FOLDERS = ("io/", "behavior/")


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return base and f"{base}.{node.attr}"
    return None


def fs_calls(source: str) -> list[tuple[int, str]]:
    """(line, call) of every file-system call in ``source`` (see ``_FS_CALLS``), including builtin
    ``open`` and ``Path(...)`` imported from pathlib."""
    tree = ast.parse(source)
    from_pathlib = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                    and n.module == "pathlib" for a in n.names if a.name in ("Path", "PosixPath")}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and (f.id == "open" or f.id in from_pathlib):
            out.append((node.lineno, f.id))
        elif isinstance(f, ast.Attribute):
            mod = _dotted(f.value)
            if mod in _FS_CALLS and (_FS_CALLS[mod] is None or f.attr in _FS_CALLS[mod]):
                out.append((node.lineno, f"{mod}.{f.attr}"))
    return out


def test_the_scan_finds_file_system_calls():
    src = ("import os, shutil\nfrom pathlib import Path\nimport numpy as np\nopen('a')\nos.replace('a', 'b')\n"
           "shutil.copytree('a', 'b')\nPath('x')\nos.path.isfile('x')\nnp.load('x')\nts.open({})\n")
    assert [c for _, c in fs_calls(src)] == ["open", "os.replace", "shutil.copytree", "Path", "os.path.isfile",
                                             "np.load", "ts.open"]
    assert fs_calls("from behaviortrace_jax.io.layout import as_path\nas_path('x').open()\n") == []


def test_no_module_outside_io_touches_files_itself():
    bad, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(_ALLOWED_FOLDERS):
            continue
        for line, call in fs_calls(path.read_text(encoding="utf-8")):
            if (rel, call) in _ALLOWED:
                used.add((rel, call))
            else:
                bad.append(f"behaviortrace_jax/{rel}:{line}: {call}(...)")
    assert not bad, ("file-system calls outside io/ (use io.layout.as_path and the io/files.py helpers, which "
                     "choose local .tmp + rename or a direct gs:// object write):\n" + "\n".join(bad))
    assert used == set(_ALLOWED), f"stale allowances: {set(_ALLOWED) - used}"
