"""One process of the two-process GRPO train step test (run by tests/train/test_distributed.py).

Usage: ``python tests/distributed_worker.py --process_id=I --num_processes=2 --port=P --out=FILE``.
Each process fakes ``--local_devices`` CPU devices, joins ``jax.distributed`` on ``localhost:P``
(cross-process collectives over gloo), builds the tiny random Qwen2 of ``tests/train/test_grpo.py`` with
the same seed on a global ``(data, model)`` mesh over all processes' devices, runs one sharded
GRPO step (``grpo.make_train_step``) and gathers the outputs; process 0 writes them to FILE as
``.npz`` (atomic): ``out.<key>`` for ``loss``, ``grad_norm``, ``step_sketch``, ``rollout_sketches``,
``rollout_grad_norms`` and ``param.<HF key>`` for every updated parameter (full, unsharded).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--process_id", type=int, required=True)
    ap.add_argument("--num_processes", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True, help="the .npz that process 0 writes")
    ap.add_argument("--local_devices", type=int, default=2, help="fake CPU devices per process")
    ap.add_argument("--model", type=int, default=2, help="model axis size; data = global devices // model")
    ap.add_argument("--batch_seed", type=int, default=5)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Runs the worker; raises ``ValueError`` on a bad ``--process_id``."""
    a = _args(argv)
    if not 0 <= a.process_id < a.num_processes:
        raise ValueError(f"--process_id={a.process_id} not in [0, --num_processes={a.num_processes})")
    os.environ["JAX_PLATFORMS"] = "cpu"  # before jax is imported
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={a.local_devices}"
    sys.path[:0] = [str(HERE.parent), str(HERE / "train")]  # the package; test_grpo.py

    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{a.port}", num_processes=a.num_processes,
                               process_id=a.process_id, initialization_timeout=120)
    import test_grpo  # the tiny model, batch and step set-up shared with the single-process tests
    from behaviortrace_jax.io.checkpoints import tree_path_name
    from behaviortrace_jax.models import sharding

    mesh = sharding.make_mesh(data=-1, model=a.model)  # all processes' devices
    _, _, params, opt_state, step = test_grpo._setup(mesh)  # device_put of same-seed values: global arrays
    batch = jax.device_put(test_grpo._batch(seed=a.batch_seed), sharding.data_sharding(mesh))
    params, opt_state, out = step(params, opt_state, batch, None)

    gathered = multihost_utils.process_allgather({"out": out, "param": params}, tiled=True)
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(gathered["out"])[0]:
        flat["out." + path[0].key] = np.asarray(leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(gathered["param"])[0]:
        flat["param." + tree_path_name(path)] = np.asarray(leaf)
    if a.process_id == 0:
        tmp = a.out + ".tmp"
        with open(tmp, "wb") as f:
            np.savez(f, **flat)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, a.out)
    multihost_utils.sync_global_devices("distributed_worker done")
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
