"""BehaviorTrace-JAX entry point: `python main.py --config=configs/tiny.py --workdir=W`.

Kept short on purpose: the logic lives in `behaviortrace_jax/` where it is tested. The config file
names the stages to run (`--config.stages=base,sft,...`); each stage skips itself when its outputs
are complete, so running the same command again resumes. `--verbosity=1` shows library logs too.
"""
import os
import sys

from behaviortrace_jax import runtime

# On CPU, glibc's default of mmap-ing XLA's large per-step temporaries afresh costs ~25% of a train
# step in page faults; these settings keep them on the heap (set BEHAVIORTRACE_MALLOC_TUNING=0 to
# skip). With one malloc arena, the `tokenizers` library's worker threads contend for it and tokenize
# ~1.7x slower than one thread does, so its parallelism is off too (bench/bench_base_data.py).
# runtime.reproducible_cpu_env pins XLA:CPU and numpy to AVX2 so results repeat across x86-64 CPUs.
# All of these act only at process start, so the entry point re-executes itself once with them.
_CPU_MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "4294967295", "MALLOC_ARENA_MAX": "1",
               "TOKENIZERS_PARALLELISM": "false"}
_ENV = runtime.reproducible_cpu_env(os.environ)
_ENV.update(runtime.platform_env(os.environ))  # libtpu installed, no TPU attached: CPU, quietly
if os.environ.get("BEHAVIORTRACE_MALLOC_TUNING", "1") != "0" and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
    _ENV.update({k: v for k, v in _CPU_MALLOC.items() if k not in os.environ})
if _ENV:
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_ENV})

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).", lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory (relative or absolute): every output and checkpoint goes here.")
flags.DEFINE_bool("multihost", False, "Call jax.distributed.initialize() with SLURM/TPU auto-detection (launch/ scripts).")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (or JAX_COORDINATOR_ADDRESS): a multi-process run.")
flags.DEFINE_integer("num_processes", None, "Processes of a multi-process run (or JAX_NUM_PROCESSES).")
flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes) (or JAX_PROCESS_ID).")
flags.mark_flags_as_required(["config", "workdir"])
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    runtime.quiet_library_logs(FLAGS.verbosity)
    from behaviortrace_jax import config_schema
    from configs import common

    # A misspelt or unread key in a config file fails here, naming it and the nearest valid key.
    config_schema.check_config(FLAGS.config, common.get_config(), source=flags.FLAGS["config"].config_filename)
    import jax

    if n_cpu := runtime.compile_cpu_devices(FLAGS.config):  # `compile` for cpu:<n>: before JAX starts
        jax.config.update("jax_num_cpu_devices", n_cpu)
    from behaviortrace_jax.io import files
    from behaviortrace_jax import pipeline

    runtime.start_distributed(runtime.distributed_settings(FLAGS.coordinator_address, FLAGS.num_processes,
                                                           FLAGS.process_id, os.environ), auto=FLAGS.multihost)
    # Reruns and resumed runs reuse compiled programs instead of recompiling.
    runtime.configure_compilation_cache(files.resolve_path(FLAGS.workdir), os.environ)
    logging.info("JAX process %d/%d, devices: %s", jax.process_index(), jax.process_count(), jax.devices())
    pipeline.run(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
    app.run(main)
