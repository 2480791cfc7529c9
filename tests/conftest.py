"""Test set-up: CPU only, 8 fake devices (for the sharding tests), and the shared/ reference dir."""
import hashlib
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
# Many tests compile the same small functions; a persistent cache turns repeats into cache hits. One
# cache per checkout: two test runs of different checkouts writing one cache at once made XLA abort.
_CHECKOUT = hashlib.sha256(str(REPO).encode()).hexdigest()[:12]
jax.config.update("jax_compilation_cache_dir", os.environ.get(
    "BEHAVIORTRACE_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "behaviortrace_jax_tests", _CHECKOUT)))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
SHARED = pathlib.Path(os.environ.get("BEHAVIORTRACE_SHARED", REPO.parent / "shared"))


@pytest.fixture
def shared_dir() -> pathlib.Path:
    """The read-only ``shared/`` folder beside the repo; skips the test where it is absent."""
    if not (SHARED / "reference").is_dir():
        pytest.skip(f"shared reference files not found at {SHARED}")
    return SHARED


@pytest.fixture
def reference_dir(shared_dir) -> pathlib.Path:
    """``shared/reference``: the paper's released per-seed result files."""
    return shared_dir / "reference"


@pytest.fixture(scope="session")
def smoke_sft(smoke_finished):
    """``(config, workdir)``: the smoke config and a workdir whose ``base/`` and ``sft/`` hold its
    trained start state (the finished smoke run's); tests copy them with :func:`copy_start`."""
    from configs import tiny

    return tiny.get_config("smoke"), smoke_finished


@pytest.fixture(scope="session")
def smoke_finished(tmp_path_factory) -> pathlib.Path:
    """The workdir of a finished smoke run (``configs/tiny.py:smoke``, every stage), run once per
    session; tests that change it copy it first."""
    from behaviortrace_jax import pipeline
    from behaviortrace_jax.models import programs
    from configs import tiny

    w = tmp_path_factory.mktemp("smoke_finished")
    with programs.recording() as traced:
        pipeline.run(tiny.get_config("smoke"), str(w))
    SMOKE_TRACED.update(traced)
    return w


SMOKE_TRACED: set = set()  # (program name, mesh shape) of every program the smoke run traced


@pytest.fixture(scope="session")
def smoke_programs(smoke_finished) -> frozenset:
    """``(name, mesh shape)`` (``models.programs``) of every jitted program :func:`smoke_finished`'s
    run traced."""
    return frozenset(SMOKE_TRACED)


def copy_start(src: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """Copies a run's ``base/`` and ``sft/`` (the GRPO start state) into ``dest``; returns ``dest``."""
    import shutil

    for sub in ("base", "sft"):
        shutil.copytree(src / sub, dest / sub)
    return dest


@pytest.fixture(scope="session")
def smoke_grpo_run(smoke_sft, tmp_path_factory):
    """``(config, workdir)`` of one smoke run's ``base``, ``sft`` and ``grpo`` stages (a copy of
    :func:`smoke_finished`'s ``grpo/`` and in-run sketch stores, so the run is not trained twice),
    shared by every test module that replays or differentiates a finished run (test_replay,
    test_metagradient)."""
    import shutil

    from behaviortrace_jax.io.layout import IN_RUN_STORES, RunLayout

    config, start = smoke_sft
    config = config.copy_and_resolve_references()
    config.stages = "grpo"
    w = copy_start(start, tmp_path_factory.mktemp("smoke_grpo_run"))
    shutil.copytree(start / "grpo", w / "grpo")
    src, dst = RunLayout(str(start)), RunLayout(str(w))
    for name in IN_RUN_STORES:  # the grpo stage's sketch arrays (sketches/<name>.zarr)
        if src.sketch_store(name).exists():
            shutil.copytree(src.sketch_store(name), dst.sketch_store(name))
    return config, w


@pytest.fixture(scope="session")
def readme_run(tmp_path_factory):
    """``test_readme_command.SmokeRun``: the README's command with the smoke config, run once per
    session as a subprocess in a copy of the repository, in a user's environment (no XLA_FLAGS)."""
    from test_readme_command import run_readme_command

    return run_readme_command(tmp_path_factory.mktemp("readme"))


GCS_BUCKET = "bucket"  # the emulator's bucket: gs://bucket/... (tensorstore needs >= 3 characters)


@pytest.fixture(scope="session")
def gcs_bucket():
    """A GCS HTTP server serving ``gs://bucket`` (``tests/gcs_emulator.GcsEmulator``, the
    ``gcp-storage-emulator`` of the ``test`` extra), with the variables that point gcsfs / etils'
    epath / orbax, tensorstore and google-cloud-storage at it set in ``os.environ`` (so subprocesses
    inherit them) until the session ends; then the server stops. Skips where the emulator or the
    ``gcs`` extra's libraries are not installed."""
    import importlib.util
    import sys

    from gcs_emulator import GcsEmulator

    def installed(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package is missing
            return False

    missing = [m for m in ("gcp_storage_emulator", "gcsfs", "google.cloud.storage") if not installed(m)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (pip install -e '.[test]')")
    with GcsEmulator(GCS_BUCKET) as gcs, pytest.MonkeyPatch.context() as mp:
        for k, v in gcs.env().items():
            mp.setenv(k, v)
        if "gcsfs" in sys.modules:  # imported before these variables were set: its choice is made
            import gcsfs
            import gcsfs.core

            assert gcsfs.GCSFileSystem is gcsfs.core.GCSFileSystem, (
                "gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set: its experimental "
                "file system waits 60 s per bucket on the emulator")
        import fsspec

        mp.setitem(fsspec.config.conf, "gcs", {**fsspec.config.conf.get("gcs", {}), "token": "anon"})
        yield gcs
