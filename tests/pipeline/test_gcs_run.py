"""The smoke run on a ``gs://`` workdir, against a GCS HTTP server, killed and resumed (issue #35).

``python main.py --config=configs/tiny.py:smoke --workdir=gs://bucket/smoke`` runs as a subprocess
against ``gcp-storage-emulator`` (the ``gcs_bucket`` fixture, tests/gcs_emulator.py): its whole
workdir goes to the bucket (orbax train states, HF exports, the tensorstore sketch stores, the
rollout log, TensorBoard events, the JAX compilation cache, results and report). It is killed with
SIGKILL in the grpo stage once a train-state checkpoint is in the bucket, rerun with the same command,
and must resume there and end with the digests of the same config run on a local workdir in the
same environment: the session's ``readme_run`` (test_readme_command.py: ``main.py`` with the smoke
config as a subprocess, local relative workdir). Both run in a user's environment, without the
test process's ``XLA_FLAGS`` (8 fake devices) and ``JAX_PLATFORMS``: the in-process
``smoke_finished`` run on 8 fake devices trains other base weights (``base_weights`` differs, the
results table does not), and so did this command with the 8 devices inherited.

The bucket's compilation cache starts with the local run's entries (``<workdir>/.jax_cache``, every
program: ``tests/conftest.user_env``), all but those of the base stage's train step (``jit_step``):
the run reads the others from the bucket instead of compiling them, and writes that one to it.
"""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import time

from behaviortrace_jax.io import rollout_log
from behaviortrace_jax.io.layout import RunLayout

from conftest import REPO, user_env

RUN = "smoke"  # the workdir's key prefix in the bucket
COMMAND = ["main.py", "--config=configs/tiny.py:smoke", f"--workdir=gs://bucket/{RUN}"]
DIGEST_RE = re.compile(r"^digest (\S+): sha256 ([0-9a-f]{64})$", re.M)


def _run_until(gcs, stop_when, timeout_s: float = 900) -> tuple[str, int | None]:
    """Runs :data:`COMMAND` until it exits or ``stop_when(object names)`` holds, then SIGKILLs it;
    returns (its console, its exit code or None when killed)."""
    with tempfile.TemporaryFile() as log:
        env = user_env(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")  # as readme_run
        proc = subprocess.Popen([sys.executable, *COMMAND], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline, killed = time.monotonic() + timeout_s, False
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if stop_when is not None and stop_when(gcs.names(RUN + "/grpo/")):
                    proc.send_signal(signal.SIGKILL)
                    killed = True
                    break
                time.sleep(0.2)
        finally:
            if proc.poll() is None and not killed:
                proc.kill()
            proc.wait()
        log.seek(0)
        return log.read().decode(errors="replace"), None if killed else proc.returncode


def _seed_compilation_cache(gcs, local_cache) -> tuple[list[str], list[str]]:
    """Uploads the local run's compilation cache entries to ``<RUN>/.jax_cache/`` but those of
    ``jit_step`` (the base stage's train step); returns (uploaded names, withheld names)."""
    entries = sorted(p for p in local_cache.iterdir() if p.is_file())
    seeded = [p for p in entries if not p.name.startswith("jit_step-")]
    withheld = [p.name for p in entries if p not in seeded]
    assert withheld and seeded, f"no jit_step entry among {[p.name for p in entries]}"
    for p in seeded:
        gcs.write(f"{RUN}/.jax_cache/{p.name}", p.read_bytes())
    return [p.name for p in seeded], withheld


def test_smoke_run_on_gs_killed_mid_grpo_resumes_to_the_local_digests(gcs_bucket, readme_run):
    gcs_bucket.clear(RUN + "/")
    seeded, withheld = _seed_compilation_cache(gcs_bucket, readme_run.workdir / ".jax_cache")
    committed = re.compile(rf"^{RUN}/grpo/state/(\d+)/commit_success\.txt$")  # orbax's last write of a step
    steps = lambda names: sorted(m.group(1) for m in map(committed.match, names) if m)  # noqa: E731
    console, rc = _run_until(gcs_bucket, steps)
    assert rc is None, f"the run ended (rc {rc}) before a grpo checkpoint was seen:\n{console[-3000:]}"
    at_kill = gcs_bucket.names(RUN + "/")
    done = steps(at_kill)
    assert done and f"{RUN}/grpo/summary.json" not in at_kill, done  # killed mid-stage
    assert f"{RUN}/sft/sft_summary.json" in at_kill and f"{RUN}/results_table.csv" not in at_kill

    console, rc = _run_until(gcs_bucket, None)
    assert rc == 0, console[-3000:]
    resumed = re.search(r"grpo: resuming from step (\d+)", console)
    assert resumed and resumed.group(1) in done, console[-3000:]
    remote = dict(DIGEST_RE.findall(console))
    local = {k: readme_run.digest[k] for k in ("base_weights", "results_table.csv")}
    print("gs:// run digests", remote, "local", local)
    assert set(remote) == {"base_weights", "results_table.csv"} and remote == local, (remote, local)
    gs = RunLayout(f"gs://bucket/{RUN}")
    assert rollout_log.digest(gs.rollouts) == rollout_log.digest(RunLayout(str(readme_run.workdir)).rollouts)

    names = gcs_bucket.names(RUN + "/")
    for want in (f"{RUN}/grpo/state/6/commit_success.txt", f"{RUN}/grpo/checkpoints/step_00000006/model.safetensors",
                 f"{RUN}/grpo/registry.json", f"{RUN}/grpo/rollouts/shard_00000000.jsonl",
                 f"{RUN}/sketches/step_sketches.zarr/metadata.json", f"{RUN}/results_table.csv", f"{RUN}/report.md"):
        assert want in names, want
    assert any(n.startswith(f"{RUN}/sketches/step_sketches.zarr/data/c/") for n in names)
    assert any(n.startswith(f"{RUN}/grpo/tb/events.out.tfevents.") for n in names)
    cached = {n.split("/")[-1] for n in names if n.startswith(f"{RUN}/.jax_cache/")}
    assert set(seeded) <= cached and set(withheld) <= cached, sorted(set(withheld) - cached)  # the run wrote it
    assert gcs_bucket.read(f"{RUN}/results_table.csv") == (readme_run.workdir / "results_table.csv").read_bytes()
    assert not [n for n in names if ".tmp" in n]
