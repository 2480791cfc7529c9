"""The named jitted programs of a run: every program a stage jits is made by :func:`jit` under one of
the names in :data:`PROGRAMS`, and the ``compile`` stage compiles each of them from the same
constructors (``aot/builders.py``, which the stage runs; each report row names its program), all but the
replay measure's two, whose shapes come from the tokenized probes (the compile stage has no
tokenizer).

A program is one jitted function of the run, built by the object that runs it, at the shapes and on
the mesh of that object. ``tests/models/test_programs.py`` checks that every ``jax.jit`` of the package goes
through here (apart from the one-shot set-up programs it lists) and that every program a smoke run
traces, with its mesh, is among those the ``compile`` stage compiles for the same config.

:func:`recording` collects the ``(name, mesh shape)`` of every program traced inside it (the test's
hook); outside it, :func:`jit` adds nothing to the traced function.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import jax

# name -> where it is built and which stages run it
PROGRAMS: dict[str, str] = {
    "sampler_prefill": "models.sampler.Sampler.prefill: prompt into the KV cache, first token (grpo, probes, draws)",
    "sampler_decode": "models.sampler.Sampler.decode: the decode while_loop (grpo, probes, draws)",
    "lm_step": "train.lm_trainer.LMTrainer.step_program: one causal-LM update (base, sft)",
    "lm_loss": "train.lm_trainer.LMTrainer.loss_program: the causal-LM loss without an update (base, sft)",
    "grpo_step": "train.grpo_step.make_train_step: one GRPO update with its sketches (grpo, counterfactual)",
    "grpo_zero_step": "train.grpo_step.make_zero_gradient_step: the optimizer on zero gradients, the replay's "
                      "exact shortcut of an all-zero-advantage step (counterfactual, metagradient)",
    "per_example_sketcher": "sketch.sketcher.PerExampleSketcher: per-example gradient sketches (sketch, draws)",
    "forced_mean_logprob": "sketch.targets.ForcedSketcher.mean_logprob: masked mean log-probs (sketch, draws)",
    "metagradient_step": "train.metagradient.MetaStep.forward: one weighted GRPO step (metagradient)",
    "metagradient_step_vjp": "train.metagradient.MetaStep.backward: its vjp (metagradient)",
    "replay_measure": "train.measures.MeasureEnv.pattern_batch: probe and control log-probs (counterfactual)",
    "replay_measure_grad": "train.metagradient.RunMetagradient.measure_grad: value and gradient of the replay "
                           "measure (metagradient)",
}

_recording: list[set[tuple[str, Any]]] = []
_depth = [0]  # programs being traced now (nested calls)


def mesh_shape(mesh: Any) -> tuple[tuple[str, int], ...] | None:
    """``(("data", n), ("model", m))`` of a mesh; None for no mesh (the default device)."""
    return None if mesh is None else tuple((str(k), int(v)) for k, v in dict(mesh.shape).items())


def jit(name: str, fun: Callable, *, mesh: Any = None, **jit_kwargs: Any) -> Any:
    """``jax.jit(fun, **jit_kwargs)`` as the program ``name`` of :data:`PROGRAMS`, built for ``mesh``
    (None: the default device). The traced computation is ``fun``'s, unchanged.

    Raises:
        ValueError: ``name`` is not in :data:`PROGRAMS`.
    """
    if name not in PROGRAMS:
        raise ValueError(f"programs.jit: unknown program {name!r}; add it to models/programs.py PROGRAMS "
                         f"(known: {sorted(PROGRAMS)})")
    where = mesh_shape(mesh)

    @functools.wraps(fun)
    def traced(*args, **kwargs):
        if not _depth[0]:  # a program called inside another one's trace is part of that program
            for seen in _recording:
                seen.add((name, where))
        _depth[0] += 1
        try:
            return fun(*args, **kwargs)
        finally:
            _depth[0] -= 1

    if not hasattr(fun, "__name__"):  # a functools.partial: XLA's module is named for its function
        traced.__name__ = getattr(getattr(fun, "func", None), "__name__", name)
    return jax.jit(traced, **jit_kwargs)


@contextlib.contextmanager
def recording() -> Iterator[set[tuple[str, Any]]]:
    """Collects ``(program name, mesh_shape)`` of every program :func:`jit` made that is traced in
    the block (a jitted program is traced at its first call per argument shape); a program called
    inside the trace of another is part of that one and not collected."""
    seen: set[tuple[str, Any]] = set()
    _recording.append(seen)
    try:
        yield seen
    finally:
        _recording.remove(seen)
