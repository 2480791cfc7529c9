"""BehaviorTrace-JAX entry point: `python main.py --config=configs/tiny.py --workdir=W`.

Kept short on purpose: the logic lives in `behaviortrace_jax/` where it is tested. The config file
names the stages to run (`--config.stages=base,sft,...`); each stage skips itself when its outputs
are complete, so running the same command again resumes.
"""
import os
import sys

# On CPU, glibc's default of mmap-ing XLA's large per-step temporaries afresh costs ~25% of a train
# step in page faults; these settings keep them on the heap. They only act at process start, so the
# entry point re-executes itself once with them (set BEHAVIORTRACE_MALLOC_TUNING=0 to skip). With one
# malloc arena, the `tokenizers` library's worker threads contend for it and tokenize ~1.7x slower
# than one thread does, so its parallelism is off too (base data 22.5 s -> 13.2 s, bench/bench_base_data.py).
_CPU_MALLOC = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "4294967295", "MALLOC_ARENA_MAX": "1",
               "TOKENIZERS_PARALLELISM": "false"}
if (os.environ.get("BEHAVIORTRACE_MALLOC_TUNING", "1") != "0" and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu"
        and any(k not in os.environ for k in _CPU_MALLOC)):
    os.execve(sys.executable, [sys.executable, *sys.argv], {**_CPU_MALLOC, **os.environ})

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).", lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory: every output and checkpoint goes here.")
flags.DEFINE_bool("multihost", False, "Call jax.distributed.initialize() (set by launch/ scripts).")
flags.mark_flags_as_required(["config", "workdir"])
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    import jax

    if FLAGS.multihost:
        jax.distributed.initialize()
    # Reruns and resumed runs reuse compiled programs instead of recompiling.
    jax.config.update("jax_compilation_cache_dir", os.path.join(FLAGS.workdir, ".jax_cache"))
    logging.info("JAX process %d/%d, devices: %s", jax.process_index(), jax.process_count(), jax.devices())

    from behaviortrace_jax import pipeline

    pipeline.run(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
    app.run(main)
