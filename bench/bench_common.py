"""What several benchmark scripts share, importable before jax (no jax import here).

* :data:`SMALL_QWEN2`: the ``small`` Qwen2 of bench_sketcher.py and bench_grpo_step.py (22.3 M
  parameters: 6 layers, d 512, 8 query / 2 KV heads of 64, FFN 1536, vocab 8192), as
  ``qwen2.Qwen2Config`` keyword arguments.
* :func:`single_thread_if_asked`: ``--single-thread`` on the command line puts XLA:CPU (and OpenMP,
  for torch) on one thread; it must run before jax is imported, since XLA reads ``XLA_FLAGS`` once.
"""
from __future__ import annotations

import os
import sys

SMALL_QWEN2 = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)


def single_thread_if_asked(argv: list[str] = sys.argv, environ=os.environ) -> bool:
    """If ``"--single-thread"`` is in ``argv``, appends ``--xla_cpu_multi_thread_eigen=false
    intra_op_parallelism_threads=1`` to ``environ["XLA_FLAGS"]`` and sets ``OMP_NUM_THREADS=1``;
    returns whether it did. Call it before ``import jax`` (a later call has no effect on XLA)."""
    if "--single-thread" not in argv:
        return False
    environ["XLA_FLAGS"] = (environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
                            " intra_op_parallelism_threads=1").strip()
    environ["OMP_NUM_THREADS"] = "1"
    return True
