"""Stage registry: every pipeline stage is a function ``stage(config, workdir) -> None``.

A stage module registers itself with ``@register_stage("name")``; :func:`load_stages` imports every
module of ``behaviortrace_jax/stages/`` (so the registry is the one list of stages: a new stage is a
new module there); ``run_stages`` runs the stages named in ``config.stages`` (comma-separated) in
that order. A stage whose outputs are complete
skips itself, so re-running the same command resumes.
"""
from __future__ import annotations

import contextlib
import importlib
import pkgutil
from typing import Callable, ContextManager

import ml_collections
from absl import logging

Stage = Callable[[ml_collections.ConfigDict, str], None]
STAGES: dict[str, Stage] = {}


def register_stage(name: str) -> Callable[[Stage], Stage]:
    """Decorator that registers ``fn`` as the stage ``name``.

    Raises:
        ValueError: if ``name`` is already registered.
    """

    def wrap(fn: Stage) -> Stage:
        if name in STAGES:
            raise ValueError(f"stage {name!r} is already registered (by {STAGES[name].__module__})")
        STAGES[name] = fn
        return fn

    return wrap


def load_stages() -> dict[str, Stage]:
    """Imports every module of the ``behaviortrace_jax.stages`` package, so that each stage module
    registers its stages, and returns :data:`STAGES` (name -> stage function). Idempotent."""
    package = importlib.import_module(__package__)
    for mod in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{__package__}.{mod.name}")
    return STAGES


def parse_stages(spec: str) -> list[str]:
    """Splits ``config.stages`` ("a,b,c") into names and checks each is registered.

    Raises:
        ValueError: naming the unknown stage and listing the known ones.
    """
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        raise ValueError(f"config.stages names unknown stage(s) {unknown}; known: {sorted(STAGES)}")
    return names


def run_stages(config: ml_collections.ConfigDict, workdir: str,
               record: Callable[[ml_collections.ConfigDict, str, str], ContextManager[None]] | None = None) -> None:
    """Runs each stage of ``config.stages`` in order on ``workdir``; each inside ``record(config,
    workdir, name)`` when given (the pipeline's ``stages/fingerprint.recording``: the stage's
    fingerprint recorded as it starts)."""
    from behaviortrace_jax.stages.spec import RunSpec  # the registry is imported by the spec's stages

    for name in parse_stages(RunSpec.from_config(config).stages):
        logging.info("=== stage %s ===", name)
        with (record(config, workdir, name) if record is not None else contextlib.nullcontext()):
            STAGES[name](config, workdir)
