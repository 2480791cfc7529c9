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
def smoke_grpo_run(tmp_path_factory):
    """``(config, workdir)`` of one smoke run's ``base,sft,grpo`` stages (~1 min), shared by every test
    module that replays or differentiates a finished run (test_replay, test_metagradient)."""
    from behaviortrace_jax import pipeline
    from configs import tiny

    w = tmp_path_factory.mktemp("smoke_grpo_run")
    config = tiny.get_config("smoke")
    config.stages = "base,sft,grpo"
    pipeline.run(config, str(w))
    return config, w
