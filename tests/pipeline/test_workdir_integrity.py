"""A workdir that cannot lie (issue 49, items 1-3): stage outputs keyed by what made them, one
writer at a time, and a workdir that can move.

Each kind of workdir state is a generator of cases (:data:`CHANGED_KEYS`, :data:`EXCLUDED_KEYS`,
:data:`LOCK_STATES`, :data:`MOVES`), run on a copy of the shared finished smoke run
(``conftest.smoke_finished``). A refusal happens before any stage runs, so most cases take well
under a second; the few that run a stage run one that skips.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import pytest

from behaviortrace_jax import pipeline
from behaviortrace_jax.io import checkpoints, workdir_lock
from behaviortrace_jax.io.layout import RunLayout
from behaviortrace_jax.stages import fingerprint
from configs import tiny

REPO = pathlib.Path(__file__).resolve().parents[2]


def smoke_config(stages: str = "base,sft,grpo,sketch,draws", **changes):
    """The smoke config with ``changes`` (dotted key -> value) and ``stages``."""
    c = tiny.get_config("smoke")
    c.stages = stages
    for key, value in changes.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


def copy_run(src: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """A copy of the finished run ``src`` (without its compilation cache) at ``dest``."""
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(".jax_cache"))
    return dest


def snapshot(w: pathlib.Path) -> dict[str, float]:
    """``{relative path: mtime}`` of every file under ``w``: what a refused run must leave alone."""
    return {p.relative_to(w).as_posix(): p.stat().st_mtime_ns for p in w.rglob("*") if p.is_file()}


@pytest.fixture
def finished(smoke_finished, tmp_path) -> pathlib.Path:
    """A private copy of the finished smoke run (every stage recorded its fingerprint)."""
    return copy_run(smoke_finished, tmp_path / "run")


# ------------------------------------------------------------------------------------------------
# 1. Stage outputs keyed by what made them
# ------------------------------------------------------------------------------------------------
# (changed key, new value, the first stage whose record names it): a value of each stage's sections
CHANGED_KEYS = [
    ("sft.lr", 3e-4, "sft"),  # SFT learning rate
    ("optim.lr", 5e-5, "grpo"),  # RL learning rate (SFT's too only when sft.lr = -1)
    ("contamination.bonus_reward", 4.0, "grpo"),
    ("grpo.group_size", 2, "grpo"),
    ("sketch.dim", 512, "grpo"),
    ("sketch.rollout_scope", "all", "sketch"),
    ("draws.n_repeats", 2, "draws"),
    ("targets.ctx_group_size", 4, "sketch"),
    ("base.steps", 5, "base"),
    ("seed", 1, "sft"),
]


@pytest.mark.parametrize("key,value,stage", CHANGED_KEYS, ids=[k for k, _, _ in CHANGED_KEYS])
def test_a_changed_key_is_refused_before_anything_is_written(finished, key, value, stage):
    """A rerun with one changed key refuses, naming the stage's record, the key and both values,
    before it writes anything (no run_info entry, no lock left, no file touched)."""
    before = snapshot(finished)
    old = smoke_config()
    for part in key.split("."):
        old = old[part]
    with pytest.raises(ValueError) as e:
        pipeline.run(smoke_config(**{key: value}), str(finished))
    msg = str(e.value)
    assert f"stage {stage} (" in msg and f"{key}: {old!r} (recorded) -> {value!r} (now)" in msg, msg
    assert "on_changed_config=recompute" in msg
    assert snapshot(finished) == before
    assert not (finished / workdir_lock.LOCK_NAME).exists()


def test_several_changed_keys_are_all_named(finished):
    """SFT lr, RL lr and bonus reward changed together: each is named once, under the first stage it
    shapes; the later stages refer to it."""
    with pytest.raises(ValueError) as e:
        pipeline.run(smoke_config(**{"sft.lr": 3e-4, "optim.lr": 5e-5, "contamination.bonus_reward": 4.0}),
                     str(finished))
    line = {ln.split()[1]: ln for ln in str(e.value).splitlines() if ln.startswith("  stage ")}
    assert list(line) == ["sft", "grpo", "sketch", "draws"]
    assert "sft.lr: 0.0002 (recorded) -> 0.0003 (now)" in line["sft"] and "bonus" not in line["sft"]
    assert "optim.lr: 0.0001 (recorded) -> 5e-05 (now)" in line["grpo"] and "contamination.bonus_reward" in line["grpo"]
    assert line["grpo"].endswith("and the keys of sft above")
    assert line["draws"].endswith("): and the keys of grpo, sft above")


def test_a_stage_killed_mid_run_is_checked_on_resume(finished):
    """GRPO incomplete (no summary.json, as after a kill): its record, written when it started,
    refuses a resume with another RL lr (before: it resumed from the orbax state at the new lr)."""
    (finished / "grpo" / "summary.json").unlink()
    with pytest.raises(ValueError, match=r"stage grpo .*optim\.lr: 0\.0001 \(recorded\) -> 0\.0002 \(now\)"):
        pipeline.run(smoke_config("grpo", **{"optim.lr": 2e-4}), str(finished))


def test_a_changed_probe_file_is_refused_by_its_contents(finished, tmp_path):
    """An input named by a path enters by its contents: the same probes at another path pass, other
    probes at the same path are refused (naming the key)."""
    default = REPO / "third_party" / "behaviortrace" / "probes.jsonl"
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    shutil.copyfile(default, a)
    shutil.copyfile(default, b)
    digest = fingerprint.input_digest(a)
    assert digest == fingerprint.input_digest(b) and digest.startswith("sha256:")
    with pytest.raises(ValueError, match=r"behavior\.probes_path: '' \(recorded\) -> 'sha256:"):
        fingerprint.check_workdir(smoke_config(**{"behavior.probes_path": str(a)}), finished, ["sft"], mode="refuse")
    b.write_text(default.read_text(encoding="utf-8").replace("frobnitz", "grobnitz"), encoding="utf-8")
    assert fingerprint.input_digest(b) != digest


# keys that cannot change a stage's result: a rerun with them changed is not refused
EXCLUDED_KEYS = [("base.log_every", 7), ("mesh.data", 1), ("sketch.chunk_size", 2), ("sketch.fused", False),
                 ("model.scan_layers", True), ("stages", "sft"), ("evaluation.nboot", 10), ("counterfactual.sampled", 2)]


@pytest.mark.parametrize("key,value", EXCLUDED_KEYS, ids=[k for k, _ in EXCLUDED_KEYS])
def test_keys_that_cannot_change_a_result_are_not_in_any_fingerprint(finished, key, value):
    cfg = smoke_config(**{key: value})
    assert fingerprint.excluded(key)
    assert fingerprint.check_workdir(cfg, finished, ["base", "sft", "grpo", "sketch", "draws", "evaluate"],
                                     mode="refuse") == []


def test_every_excluded_key_is_a_config_key():
    """:data:`fingerprint.EXCLUDED` names keys (or sections) of configs/common.py, and every stage's
    sections too (a misspelt one would silently leave a key out)."""
    from behaviortrace_jax import config_schema
    from configs import common

    keys = set(config_schema.key_paths(common.get_config()))
    names = list(fingerprint.EXCLUDED) + [s for secs in fingerprint.STAGE_SECTIONS.values() for s in secs]
    for name in names:
        assert any(k == name or (name.endswith(".") and k.startswith(name)) for k in keys) or name == "behaviors.", name


def test_every_config_key_shapes_a_stage_or_is_left_out_with_a_reason():
    """A key of configs/common.py is in some stage's fingerprint or in :data:`fingerprint.EXCLUDED`:
    a key added later must be placed (else a change to it would pass every check silently)."""
    from behaviortrace_jax import config_schema
    from configs import common

    c = common.get_config()
    with c.unlocked():  # base.family is keyed when it is not qwen2 (a qwen2 base keeps its digest); a behaviour
        c.base.family = "llama"
        c.behaviors.b2 = {"pattern": "ZZ"}
    keyed = {k for stage in ("base", "sft", "grpo", "sketch", "draws") for k in fingerprint.stage_key(c, stage)}
    loose = [k for k in config_schema.key_paths(c) if k not in keyed and not fingerprint.excluded(k)
             and k != "behaviors"]  # the free-form subtree (config_schema.FREE_FORM): its entries are keyed
    assert loose == [] and "behaviors.b2.pattern" in keyed
    assert all(reason for reason in fingerprint.EXCLUDED.values())


def test_recompute_removes_the_changed_stage_and_every_stage_after_it(finished, caplog):
    """``on_changed_config=recompute``: the changed stage's outputs and every later stage's are
    removed (so the run recomputes them), with a log line naming the key; earlier stages stay."""
    cfg = smoke_config("draws,evaluate,report", **{"draws.n_repeats": 2, "on_changed_config": "recompute"})
    with caplog.at_level("WARNING"):
        removed = fingerprint.check_workdir(cfg, finished, ["draws", "evaluate", "report"], mode="recompute")
    assert removed == ["draws", "evaluate", "report"]
    assert any("draws.n_repeats: 1 (recorded) -> 2 (now)" in r.getMessage() for r in caplog.records)
    assert not (finished / "draws").exists() and not (finished / "results_table.csv").exists()
    assert not (finished / "report.md").exists()
    assert (finished / "grpo" / "summary.json").is_file() and (finished / "sketches").is_dir()


def test_recompute_refuses_a_changed_stage_the_run_does_not_name(finished):
    """A changed upstream stage that the run does not name cannot be recomputed: refused, naming it."""
    cfg = smoke_config("draws", **{"optim.lr": 5e-5})
    with pytest.raises(ValueError, match=r"(?s)stage grpo .*optim\.lr.*add them to config\.stages"):
        fingerprint.check_workdir(cfg, finished, ["draws"], mode="recompute")


def test_an_unknown_mode_is_refused(finished):
    with pytest.raises(ValueError, match="config.on_changed_config='skip'"):
        pipeline.run(smoke_config(on_changed_config="skip"), str(finished))


def test_a_failed_stage_start_leaves_no_record(tmp_path):
    """A stage that raises before writing anything leaves no fingerprint, so fixing the config and
    rerunning is not refused."""
    w = tmp_path / "w"
    w.mkdir()
    with pytest.raises(RuntimeError):
        with fingerprint.recording(smoke_config(), w, "sft"):
            raise RuntimeError("failed at start")
    assert not fingerprint.record_path(w, "sft").exists()


# ------------------------------------------------------------------------------------------------
# 2. One writer per workdir
# ------------------------------------------------------------------------------------------------
def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


LOCK_STATES = {  # lock file contents -> refused (True) or taken over (False)
    "live_same_host": (lambda: {"host": socket.gethostname(), "pid": os.getpid(), "started": "t0"}, True),
    "other_host": (lambda: {"host": "elsewhere.example", "pid": 1, "started": "t0"}, True),
    "dead_pid_same_host": (lambda: {"host": socket.gethostname(), "pid": _dead_pid(), "started": "t0"}, False),
    "garbage": (lambda: "not json", True),
}


@pytest.mark.parametrize("state", list(LOCK_STATES))
def test_a_held_lock_refuses_and_a_stale_one_is_taken_over(finished, state, caplog):
    make, refused = LOCK_STATES[state]
    holder = make()
    lock = finished / workdir_lock.LOCK_NAME
    lock.write_text(json.dumps(holder) if isinstance(holder, dict) else holder)
    cfg = smoke_config("sft")  # a stage that skips: the lock is all this run does
    if refused:
        with pytest.raises(RuntimeError, match="is being written by another run") as e:
            pipeline.run(cfg, str(finished))
        if isinstance(holder, dict):
            assert f"pid {holder['pid']} on host {holder['host']} since t0" in str(e.value)
        assert lock.is_file()  # the holder's lock is left alone
    else:
        with caplog.at_level("WARNING"):
            pipeline.run(cfg, str(finished))
        assert any("taking the lock over" in r.getMessage() for r in caplog.records)
        assert not lock.exists()  # released at the end of the run


def test_two_runs_one_refused_the_other_completes_with_the_lone_runs_table(finished, smoke_finished):
    """A run holds the lock (this process, as a run mid-way would); a second run on the workdir is
    refused, naming it, and writes nothing; once the first ends, a run completes and its results
    table equals the lone smoke run's."""
    text = workdir_lock.acquire(finished)
    before = snapshot(finished)
    try:
        with pytest.raises(RuntimeError, match=f"pid {os.getpid()} on host"):
            pipeline.run(smoke_config("base,sft,grpo,sketch,draws,evaluate"), str(finished))
        assert snapshot(finished) == before
    finally:
        workdir_lock.release(finished, text)
    pipeline.run(smoke_config("base,sft,grpo,sketch,draws,evaluate"), str(finished))
    assert (finished / "results_table.csv").read_bytes() == (smoke_finished / "results_table.csv").read_bytes()
    assert not (finished / workdir_lock.LOCK_NAME).exists()


def test_status_takes_no_lock(finished, capsys):
    """``status`` reads a workdir another run holds (and leaves the lock alone), naming the writer."""
    text = workdir_lock.acquire(finished)
    try:
        pipeline.run(smoke_config("status"), str(finished))
        assert f"written by: pid {os.getpid()} on host {socket.gethostname()}" in capsys.readouterr().out
        assert json.loads((finished / workdir_lock.LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        workdir_lock.release(finished, text)


def test_the_lock_on_a_gs_workdir_is_a_generation_matched_object(gcs_bucket):
    """On ``gs://``: the lock object is created only if absent (a second taker is refused naming the
    holder), a dead holder's is taken over, and release deletes only this run's object."""
    w = "gs://bucket/lock_test/w"
    gcs_bucket.clear("lock_test/")
    text = workdir_lock.acquire(w)
    assert json.loads(gcs_bucket.read("lock_test/w/.lock"))["pid"] == os.getpid()
    with pytest.raises(RuntimeError, match=f"pid {os.getpid()} on host"):
        workdir_lock.acquire(w)
    workdir_lock.release(w, text)
    assert gcs_bucket.names("lock_test/") == []
    gcs_bucket.write("lock_test/w/.lock", json.dumps({"host": socket.gethostname(), "pid": _dead_pid(),
                                                      "started": "t0"}).encode())
    text = workdir_lock.acquire(w)  # taken over
    workdir_lock.release(w, '{"someone": "else"}')  # another run's text: left alone
    assert gcs_bucket.names("lock_test/") == ["lock_test/w/.lock"]
    workdir_lock.release(w, text)
    assert gcs_bucket.names("lock_test/") == []


@pytest.mark.slow
def test_two_main_py_processes_started_together(tmp_path, smoke_finished):
    """Two ``main.py`` on one fresh workdir, started together: one is refused at once naming the
    other, the other completes with the lone run's results table (a full smoke run: slow)."""
    from conftest import user_env

    w = tmp_path / "w"
    cmd = [sys.executable, "main.py", "--config=configs/tiny.py:smoke", f"--workdir={w}"]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=user_env(PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes[0] == 0 and codes[1] != 0, outs
    loser = outs[[p.returncode for p in procs].index(codes[1])]
    assert "is being written by another run" in loser
    assert (w / "results_table.csv").read_bytes() == (smoke_finished / "results_table.csv").read_bytes()


# ------------------------------------------------------------------------------------------------
# 3. A relocatable workdir
# ------------------------------------------------------------------------------------------------
def _files_naming(w: pathlib.Path, text: str) -> list[str]:
    """Files under ``w`` whose bytes contain ``text`` (orbax's commit_success.txt, a message orbax
    writes and never reads, left out)."""
    return sorted(p.relative_to(w).as_posix() for p in w.rglob("*")
                  if p.is_file() and p.name != "commit_success.txt" and text.encode() in p.read_bytes())


def test_no_absolute_path_is_stored_inside_a_workdir(smoke_finished):
    assert _files_naming(smoke_finished, str(smoke_finished)) == []
    reg = json.loads((smoke_finished / "grpo" / "registry.json").read_text())
    assert all(not os.path.isabs(e["path"]) for e in reg["checkpoints"])


MOVES = ["moved", "copied_original_gone", "copied_original_kept"]


@pytest.mark.parametrize("how", MOVES)
def test_a_moved_or_copied_workdir_reads_only_its_own_files(finished, tmp_path, how, capsys):
    """After ``mv`` (or a copy), ``status`` names the new folder and a resume of every stage up to
    draws skips on the new folder's own files (the draws stage reads its checkpoint's folder)."""
    dest = tmp_path / "elsewhere" / "run2"
    dest.parent.mkdir()
    if how == "moved":
        shutil.move(finished, dest)
    else:
        copy_run(finished, dest)
        if how == "copied_original_gone":
            shutil.rmtree(finished)
    for e in checkpoints.CheckpointRegistry(RunLayout(dest).registry).list():
        assert pathlib.Path(e.path).is_relative_to(dest), e.path
    pipeline.run(smoke_config("status"), str(dest))
    out = capsys.readouterr().out
    assert str(dest) in out and str(finished) not in out
    before = snapshot(dest)
    pipeline.run(smoke_config("base,sft,grpo,sketch,draws"), str(dest))
    changed = {k for k, v in snapshot(dest).items() if before.get(k) != v}
    assert changed <= {"run_info.json"}, changed
    if how == "copied_original_kept":
        assert _files_naming(dest, str(finished)) == []


def test_a_legacy_absolute_registry_resolves_to_the_workdirs_own_checkpoints(finished, tmp_path):
    """A registry written by older code (absolute paths) in a copied workdir reads the copy's own
    checkpoints, not the original's; a checkpoint registered from elsewhere keeps its path."""
    reg = finished / "grpo" / "registry.json"
    data = json.loads(reg.read_text())
    for e in data["checkpoints"]:
        e["path"] = f"/old/place/grpo/{e['path']}"
    data["checkpoints"].append({"step": 99, "path": "/models/external", "metadata": {}})
    reg.write_text(json.dumps(data))
    entries = checkpoints.CheckpointRegistry(reg).list()
    assert all(e.path.startswith(str(finished / "grpo" / "checkpoints")) for e in entries if e.step != 99)
    assert entries[-1].path == "/models/external"
