"""Test set-up: CPU only, 8 fake devices (for the sharding tests), one compilation cache per test
run, the shared smoke run, and the shared/ reference dir.

The tests sit in one folder per package layer and two more, ``pipeline/`` and ``repo/``
(tests/README.md); this file and the helpers beside it (``hf_fixtures.py``, ``gcs_emulator.py``,
``distributed_worker.py``) stay at the top. pytest imports test modules by their file name
(``prepend`` import mode, no ``__init__.py``), so a file name is used once in all of tests/, and
every test folder is on ``sys.path`` from the start (:data:`TEST_FOLDERS`): test modules import each
other's toy set-ups by name (``from test_grpo import SHAPES``) across folders.

The suite runs on pytest-xdist workers by default (``pytest.ini``: ``-n auto --maxprocesses 4
--dist loadfile``; ``auto`` is one worker more than the CPUs, :func:`pytest_xdist_auto_num_workers`:
three on a 2-core VM; ``-n 0`` runs it in one process; ``-p no:xdist`` fails, as the ``-n`` of
``addopts`` then has no plugin to read it). What the workers share:

* JAX's persistent compilation cache, in a temporary folder made for this test run (the same small
  programs are compiled by many tests; a cache hit replaces a compile). Its size limit turns on
  JAX's file lock around every read and write, so two workers never read a half-written entry.
  ``JAX_COMPILATION_CACHE_DIR=<dir>`` names a folder that outlives the run instead. The variables
  are also set in ``os.environ``, so ``main.py`` run as a subprocess uses the same folder
  (``runtime.configure_compilation_cache``); the README command, the ``gs://`` run and the
  multi-process runs run in a user's environment instead (:func:`user_env`).
* The finished smoke run (:func:`smoke_finished`) and the README command's run (:func:`readme_run`):
  the first worker that needs one runs it under a file lock; the other reuses its folder.
* The GCS emulator (:func:`gcs_bucket`) is per worker: each starts its own on a free port.

A run of one test file (``python -m pytest tests/sketch/test_x.py``, any ``::test`` or ``-k`` in it) runs
in one process unless the command line names ``-n`` itself (:func:`pytest_cmdline_main`): its
tests would all go to one xdist worker anyway (``--dist loadfile``).

Every test gets exactly one tier marker (:func:`pytest_collection_modifyitems`, from the tables
:data:`E2E_FIXTURES`, :data:`MODULE_TIERS`, :data:`TEST_TIERS` and :data:`HEAVY_UNIT_TESTS`): ``unit`` (the default: no
model beyond a toy compiled, no pipeline run; ``python -m pytest -m unit -n 0`` is the inner loop),
``e2e`` (the shared smoke runs, a pipeline run or a ``main.py`` subprocess) and ``compile`` (the
``compile`` stage's ahead-of-time programs, libtpu, TPU topologies). ``slow`` is independent of
the tier.
"""
import json
import os
import pathlib
import shutil
import sys
import tempfile
import uuid

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from filelock import FileLock  # noqa: E402  (a dependency of huggingface_hub)

TESTS = pathlib.Path(__file__).resolve().parent
REPO = TESTS.parent
# The folders of test modules (tests/README.md). pytest puts a test module's folder on sys.path only
# when it imports that module; a module that imports another folder's module by name (test_metagradient
# -> test_grpo, the readme_run fixture -> test_readme_command) must find it whatever ran first.
TEST_FOLDERS = tuple(sorted(p for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py"))))
sys.path.extend(str(p) for p in TEST_FOLDERS if str(p) not in sys.path)
SHARED = pathlib.Path(os.environ.get("BEHAVIORTRACE_SHARED", REPO.parent / "shared"))
CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"  # JAX's own variable; main.py honours it too
CACHE_ROOT = pathlib.Path(tempfile.gettempdir()) / "behaviortrace_jax_tests"
_USER_CACHE = bool(os.environ.get(CACHE_ENV))  # named by the user (kept) or made for this test run (removed)
# What the test process sets for itself and its subprocesses, and what a user's shell does not have.
_TEST_ENV = ("XLA_FLAGS", "JAX_PLATFORMS", CACHE_ENV, "JAX_COMPILATION_CACHE_MAX_SIZE",
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")


def user_env(**extra: str) -> dict[str, str]:
    """``os.environ`` as a user's shell has it: without the test process's 8 fake devices
    (``XLA_FLAGS``), ``JAX_PLATFORMS`` and this test run's compilation cache (so ``main.py`` keeps
    its cache in ``<workdir>/.jax_cache``); plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if k not in _TEST_ENV}, **extra}


def _test_run_id(config) -> str:
    """One id per test run, the same in the xdist controller and every worker (xdist's
    ``testrunuid``, chosen here when the command line gives none)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        return workerinput["testrunuid"]
    if getattr(config.option, "testrunuid", None) is None:
        config.option.testrunuid = uuid.uuid4().hex  # xdist's controller hands it to its workers
    return config.option.testrunuid


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` / ``-n logical``: xdist's own count of the CPUs plus one (``--maxprocesses`` caps
    it; ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides it, as in xdist). A worker often waits without
    using its core: for a shared run another worker holds the file lock of (:func:`smoke_finished`,
    :func:`readme_run`), or for a subprocess. On the 2-core AMD EPYC VM (2026-12-06, the suite with
    ``../shared``, alternating orders) three workers took 916-926 s and two 965-970 s (0.95x)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    from xdist import plugin

    return plugin.pytest_xdist_auto_num_workers(config) + 1


def _names_workers(args) -> bool:
    """Whether command-line tokens set xdist's worker count (``-n 2``, ``-n0``, ``--numprocesses``)."""
    return any(t.startswith("--numprocesses") or (t.startswith("-n") and not t.startswith("--")) for t in args)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """One process for a run of one test file: ``-n 0`` unless the command line or
    ``PYTEST_ADDOPTS`` names a worker count (``pytest.ini``'s ``-n auto`` is for the suite; with
    ``--dist loadfile`` one file's tests all go to one worker, after that worker's start-up).
    Runs before xdist's own ``pytest_cmdline_main`` turns ``-n`` into workers."""
    from _pytest.config import Config

    if config.args_source != Config.ArgsSource.ARGS or not hasattr(config.option, "numprocesses"):
        return
    if _names_workers(config.invocation_params.args) or _names_workers(os.environ.get("PYTEST_ADDOPTS", "").split()):
        return
    paths = {pathlib.Path(config.invocation_params.dir, a.split("::")[0]).resolve() for a in config.args}
    if len(paths) == 1 and next(iter(paths)).is_file():
        config.option.numprocesses = 0


# ------------------------------------------------------------------------------------------------
# Test tiers: each test's one tier marker, from what it uses (the tables below)
# ------------------------------------------------------------------------------------------------
TIERS = ("unit", "e2e", "compile")
# Session fixtures that run the pipeline (or serve one): a test that uses one is end to end.
E2E_FIXTURES = frozenset({"smoke_finished", "smoke_sft", "smoke_grpo_run", "smoke_programs", "readme_run"})
# Test modules (by file name, unique in tests/) whose every test is of one tier (a module absent
# here: unit, unless TEST_TIERS or a fixture says otherwise).
MODULE_TIERS = {
    "test_compile_stage": "compile",          # the compile stage, AOT for cpu:N and tpu:* targets
    "test_config_source": "e2e",              # pipeline.run with other pattern and probe files
    "test_distributed": "e2e",                # two processes of a GRPO step (worker subprocesses)
    "test_end_to_end": "e2e",                 # the smoke run, its reruns and crashes
    "test_families_end_to_end": "e2e",        # pipeline.run per model family
    "test_gcs_run": "e2e",                    # the README command on a gs:// workdir
    "test_readme_command": "e2e",             # the README command as a subprocess
    "test_scan_layers_run": "e2e",            # pipeline.run with scanned layers
    "test_two_behaviors": "e2e",              # pipeline.run of the two-behaviour smoke config
}
# Single tests (``module::function``, parameters left off) whose tier is not their module's; they
# win over the fixtures and MODULE_TIERS.
TEST_TIERS = {
    "test_bad_input::test_pipeline_refuses_budgets_past_the_model_positions_before_writing": "e2e",  # pipeline.run
    "test_config_schema::test_main_refuses_a_config_file_with_an_unknown_key": "e2e",  # main.py subprocess
    "test_configs::test_unknown_config_key_is_refused": "e2e",                          # main.py subprocess
    "test_configs::test_unknown_stage_is_refused": "e2e",                               # main.py subprocess
    "test_hub::test_the_pipeline_loads_the_model_by_id": "e2e",                         # pipeline.run
    "test_layout::test_sketch_and_draws_stages_run_the_programs_compile_reports": "compile",
    "test_multiprocess::test_two_processes_equal_one_process_two_devices": "e2e",       # main.py subprocesses
    "test_multiprocess::test_killed_process_then_rerun_resumes": "e2e",                 # main.py subprocesses
    "test_no_silent_fallback::test_compile_metagradient_step_is_the_run_forward": "compile",
    "test_pallas_sketch::test_kernel_compiles_for_tpu_v5e": "compile",                  # libtpu, v5e:2x4
    "test_spec::test_main_refuses_a_bad_value_naming_its_key_before_writing": "e2e",    # main.py subprocess
    "test_two_behaviors::test_paper_two_behaviors_config_compiles_at_tiny_shapes": "compile",
    "test_watch::test_status_needs_an_existing_run": "e2e",                             # pipeline.run (status)
}


# Tests that would be ``unit`` by what they use but cost the most CPU time: ``e2e``, so that
# ``python -m pytest -m unit -n 0`` stays within about 2 minutes on 2 cores. CPU seconds (user + sys of
# the test process, all parameters of the test summed) measured per test on the 2-core AMD EPYC VM
# (2026-12-07, jax 0.10.2, ``-m unit`` under pytest-xdist, the machine shared with other jobs); the
# heaviest, in order, until the rest of the tier summed to at most 50 CPU seconds of tests (the 757
# tests: 909 CPU seconds; the run adds ~60 s of its own: imports, collection, first compiles).
HEAVY_UNIT_TESTS = {  # "module::test": CPU seconds
    "test_fused_sketcher::test_fused_equals_vmap_grad_and_numpy": 49.1,
    "test_sketcher::test_scan_layers_sketch_and_sum_and_shard_map": 37.0,
    "test_gpu_step_check::test_gpu_step_check_tiny": 36.7,
    "test_pallas_sketch::test_fused_sketcher_with_kernel_equals_xla_and_numpy": 34.9,
    "test_sketcher::test_scan_layers_sketches_equal_unrolled": 32.0,
    "test_readme::test_the_library_example_runs_as_printed": 30.9,
    "test_metagradient::test_remat_metagradient_vjp_equals_the_plain_one": 30.4,
    "test_scan_layers::test_scanned_forward_and_grads_match_unrolled": 29.7,
    "test_hash_family::test_new_family_through_the_sketcher_equals_plain_numpy_countsketch": 23.7,
    "test_block_hash::test_block_sketches_of_tiny_decoder_gradients": 23.0,
    "test_grpo::test_sharded_step_equals_single_device": 21.4,
    "test_fused_sketcher::test_fused_on_3_devices_equals_one_device": 21.3,
    "test_grpo::test_update_from_sketcher_equals_two_backward_step": 20.0,
    "test_pallas_sketch::test_kernel_equals_numpy_and_xla_fused": 18.8,
    "test_families::test_per_rollout_sketch_matches_pytorch": 18.0,
    "test_fused_sketcher::test_bfloat16_fused_sketches_track_float32": 17.9,
    "test_nonfinite::test_untied_metagradient_is_finite_and_matches_central_differences": 17.3,
    "test_sketcher::test_qwen2_per_rollout_sketch_matches_pytorch": 14.6,
    "test_grpo::test_rollout_sketches_sum_to_the_prebatch_gradient_sketch": 14.4,
    "test_fused_sketcher::test_remat_does_not_change_fused_sketches": 14.1,
    "test_grpo::test_no_clipping_gives_unclipped_step_sketches": 14.0,
    "test_sft::test_sft_writes_state_export_summary_and_marker": 13.4,
    "test_checkpoint_topology::test_state_saved_on_four_devices_restores_onto_one": 13.2,
    "test_families::test_table_order_equals_transformers_named_parameters": 12.8,
    "test_checkpoint_topology::test_restore_onto_another_mesh": 12.5,
    "test_families::test_greedy_matches_transformers_generate": 10.7,
    "test_families::test_logits_match_transformers_left_padded": 10.6,
    "test_lm_trainer::test_sharded_step_equals_single_device_step": 10.5,
    "test_base_model::test_base_dir_is_complete_and_summarised": 10.4,
    "test_families::test_kv_cache_decode_matches_full_forward": 10.3,
    "test_draws::test_draw_end_to_end_format_recompute_skip_and_settings": 10.1,
    "test_grpo::test_grpo_clip_rollout_sketches_sum_to_the_prebatch_gradient_sketch": 9.4,
    "test_grpo::test_step_raises_logprob_of_rewarded_completion": 9.2,
    "test_checkpoint_topology::test_state_saved_on_four_devices_restores_in_a_process_with_two": 8.4,
    "test_sharding::test_sharded_forward_backward_equal_single_device": 8.2,
    "test_fused_sketcher::test_decoder_loss_and_bad_inputs": 7.8,
    "test_sampler::test_greedy_matches_transformers_generate": 7.6,
    "test_block_hash::test_block_reference_equals_jax_on_random_vectors": 7.5,
    "test_targets::test_forced_sketcher_matches_direct_gradient_across_blocks": 7.4,
    "test_fused_sketcher::test_tied_embedding_norm_is_the_norm_of_the_sum": 6.3,
    "test_sketcher::test_shard_map_over_data_axis_gives_same_sketches": 6.2,
    "test_families::test_round_trip_flax_to_transformers": 5.7,
    "test_sampler::test_sharded_sampler_equals_single_device": 5.6,
    "test_lm_trainer::test_shared_prefix_gives_the_full_sequence_loss_and_gradient": 5.4,
    "test_hf_io::test_bf16_checkpoint_loads_and_runs": 5.2,
    "test_rope::test_rope_matches_transformers": 5.2,
    "test_qwen2::test_remat_gives_same_grads": 5.0,
    "test_lm_trainer::test_train_state_round_trip_and_restore_into_another_lr": 4.8,
    "test_runtime::test_compilation_cache_entries_hit_under_another_folder_and_workdir": 4.6,
    "test_qwen2::test_kv_cache_decode_matches_full_forward": 4.6,
    "test_countsketch::test_hash_spread_over_16_seeds": 4.5,
    "test_lm_trainer::test_steps_lower_the_loss_without_recompiling": 4.5,
    "test_nonfinite::test_lm_trainer_stops_at_a_non_finite_step_naming_it": 4.5,
    "test_nonfinite::test_grpo_step_returns_the_finite_flag": 4.2,
    "test_token_ids::test_completion_loss": 4.1,
    "test_configs::test_the_32b_config_builds_qwen2p5_32b_abstract_shapes": 4.1,
    "test_sampler::test_sample_chat_formats_and_truncates": 4.1,
    "test_qwen2::test_bf16_params_run_and_stay_close_to_fp32": 4.0,
    "test_sketcher::test_sketch_and_sum_coefficients": 3.7,
    "test_metagradient::test_toy_metagradient_through_clip_and_adamw_matches_central_differences": 3.7,
    "test_scan_layers::test_scanned_kv_cache_prefill_and_decode_match_unrolled": 3.6,
    "test_metagradient::test_differentiable_clip_matches_optax_and_is_finite_at_zero": 3.5,
    "test_sketcher::test_chunk_size_and_tables_do_not_change_results": 3.5,
    "test_qwen2::test_init_model_into_a_sharded_layout": 3.4,
    "test_sketcher::test_peak_memory_bounded_by_chunk_not_batch": 3.4,
    "test_sketcher::test_matches_loop_of_single_example_gradients": 3.4,
    "test_hf_io::test_round_trip_flax_to_transformers": 3.2,
    "test_base_model::test_transformers_loads_the_export_with_logit_parity": 3.2,
    "test_scan_layers::test_stack_unstack_round_trip_and_errors": 3.1,
    "test_qwen2::test_logits_match_transformers_left_padded": 3.0,
    "test_nonfinite::test_differentiable_adam_has_eps_root_and_the_run_update_is_unchanged": 3.0,
    "test_countsketch::test_sketch_batch_stacked_bit_identical_to_sketch_batch": 3.0,
    "test_sketcher::test_sharded_params_give_same_sketches": 2.8,
    "test_hf_io::test_table_order_equals_transformers_named_parameters": 2.6,
    "test_sketcher::test_sketch_and_sum_acc_dtype": 2.5,
    "test_lm_trainer::test_cross_entropy_backward_is_the_gradient_of_its_forward": 2.4,
    "test_countsketch::test_a_global_index_family_is_hashed_once_per_segment_and_others_once_per_parameter": 2.0,
    "test_layers::test_attribution_never_imports_jax": 1.9,
    "test_block_hash::test_block_inner_products_are_unbiased_with_the_stated_variance": 1.8,
    "test_token_ids::test_per_example_sketcher": 1.8,
    "test_layers::test_imports_run_downward_and_stages_do_not_import_each_other": 1.8,
    "test_nonfinite::test_every_loss_is_finite_with_extreme_inputs_at_masked_positions": 1.7,
}


def tier_of(item) -> str:
    """The tier the tables give a collected test: TEST_TIERS, then E2E_FIXTURES, then MODULE_TIERS,
    then HEAVY_UNIT_TESTS (``e2e``), else ``unit``."""
    module = item.module.__name__.rsplit(".", 1)[-1] if getattr(item, "module", None) else ""
    name = getattr(item, "originalname", None) or item.name.split("[")[0]
    if f"{module}::{name}" in TEST_TIERS:
        return TEST_TIERS[f"{module}::{name}"]
    if f"{module}::{name}" in HEAVY_UNIT_TESTS:
        return "e2e"
    if E2E_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return "e2e"
    return MODULE_TIERS.get(module, "unit")


COLLECTED_TIERS: dict[str, tuple[str, ...]] = {}  # node id -> its tier markers, before -m deselects
COLLECTED_ITEMS: list = []  # every collected test, before -m and -k deselect


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by -m
def pytest_collection_modifyitems(config, items):
    """Adds each test's tier marker (:func:`tier_of`) unless it carries one itself, and records
    every test and its tier markers (:data:`COLLECTED_ITEMS`, :data:`COLLECTED_TIERS`; test_tiers.py checks there is one each).
    A ``slow`` test runs only where ``-m`` names ``slow`` (``pytest.ini``'s ``not slow``, ``-m slow``),
    so ``-m unit`` and ``-m e2e`` leave the slow ones out too."""
    for item in items:
        if not any(m.name in TIERS for m in item.iter_markers()):
            item.add_marker(getattr(pytest.mark, tier_of(item)))
        COLLECTED_TIERS[item.nodeid] = tuple(m.name for m in item.iter_markers() if m.name in TIERS)
    COLLECTED_ITEMS[:] = items
    if "slow" not in (config.option.markexpr or ""):  # -m unit, -m e2e: still without the slow tests
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]


def pytest_configure(config):
    """Points JAX's persistent compilation cache at this test run's folder (before any compile)."""
    from behaviortrace_jax import runtime

    cache = os.environ.get(CACHE_ENV) or str(CACHE_ROOT / _test_run_id(config))
    # A size limit turns on jax's FileLock around cache reads and writes (jax/_src/lru_cache.py):
    # without it a worker can read an entry another worker is still writing, and XLA aborts.
    for name, value in {"jax_compilation_cache_max_size": 8 << 30,
                        "jax_persistent_cache_min_compile_time_secs": 0.5}.items():
        jax.config.update(name, value)
        os.environ[name.upper()] = str(value)  # JAX's own variables: main.py subprocesses read them
    os.environ[CACHE_ENV] = runtime.configure_compilation_cache(str(CACHE_ROOT), {CACHE_ENV: cache})


def pytest_unconfigure(config):
    """Removes this test run's compilation cache (by the controller, or a run without xdist)."""
    if getattr(config, "workerinput", None) is None and not _USER_CACHE:
        shutil.rmtree(CACHE_ROOT / _test_run_id(config), ignore_errors=True)


def shared_tmp(tmp_path_factory) -> pathlib.Path:
    """A folder every xdist worker of this test run sees (the base temp's parent under xdist, the
    base temp itself without it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


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
    test run (the first xdist worker to need it runs it under a file lock, the other waits and
    reuses it); tests that change it copy it first."""
    root = shared_tmp(tmp_path_factory)
    w, traced_file = root / "smoke_finished", root / "smoke_finished.programs.json"
    with FileLock(str(root / "smoke_finished.lock")):
        if not traced_file.exists():
            from behaviortrace_jax import pipeline
            from behaviortrace_jax.models import programs
            from configs import tiny

            shutil.rmtree(w, ignore_errors=True)  # a worker that died mid-run left a partial folder
            with programs.recording() as traced:
                pipeline.run(tiny.get_config("smoke"), str(w))
            traced_file.write_text(json.dumps(sorted(traced, key=str)))
    for name, shape in json.loads(traced_file.read_text()):
        SMOKE_TRACED.add((name, None if shape is None else tuple(tuple(axis) for axis in shape)))
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
    test run as a subprocess in a copy of the repository, in a user's environment (no XLA_FLAGS);
    the first xdist worker to need it runs it under a file lock, the other reads its record
    (test_readme_command.py and test_gcs_run.py may run on different workers)."""
    import dataclasses

    from test_readme_command import SmokeRun, run_readme_command

    root = shared_tmp(tmp_path_factory)
    record = root / "readme_run.json"
    with FileLock(str(root / "readme_run.lock")):
        if not record.exists():
            dest = root / "readme"
            shutil.rmtree(dest, ignore_errors=True)  # a worker that died mid-run left a partial folder
            dest.mkdir()
            run = run_readme_command(dest)
            record.write_text(json.dumps(dict(dataclasses.asdict(run), workdir=str(run.workdir))))
    fields = json.loads(record.read_text())
    return SmokeRun(**dict(fields, workdir=pathlib.Path(fields["workdir"])))


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
