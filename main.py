"""BehaviorTrace-JAX entry point: `python main.py --config=configs/tiny.py --workdir=W`.

Kept short on purpose: the logic lives in `behaviortrace_jax/` where it is tested. The config file
names the stages to run (`--config.stages=base,sft,...`); each stage skips itself when its outputs
are complete, so running the same command again resumes.
"""
from absl import app, flags, logging
from ml_collections import config_flags

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
    logging.info("JAX process %d/%d, devices: %s", jax.process_index(), jax.process_count(), jax.devices())

    from behaviortrace_jax import pipeline

    pipeline.run(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
    app.run(main)
