"""Where every stage reads and writes under a run's workdir: one :class:`RunLayout`."""
from __future__ import annotations

import dataclasses
import os
import pathlib

import ml_collections


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """Where the GRPO stage writes, under ``workdir`` (SPEC §2.5 layout, plus orbax state)."""

    workdir: pathlib.Path

    @property
    def root(self) -> pathlib.Path:
        return self.workdir / "grpo"

    rollouts = property(lambda self: self.root / "rollouts")  # JSONL shards (rollout_log.py)
    ground_truth = property(lambda self: self.root / "ground_truth.jsonl")  # SPEC §6.1
    registry = property(lambda self: self.root / "registry.json")  # SPEC §2.4
    checkpoints = property(lambda self: self.root / "checkpoints")  # HF exports step_XXXXXXXX
    state = property(lambda self: self.root / "state")  # orbax train states
    curve = property(lambda self: self.root / "learning_curve.json")
    summary = property(lambda self: self.root / "summary.json")
    tensorboard = property(lambda self: self.root / "tb")
    sketches = property(lambda self: self.workdir / "sketches")


def model_dir(config: ml_collections.ConfigDict, workdir: str) -> str:
    """The policy's starting HF checkpoint: ``config.model.hf_dir`` or, if empty, ``workdir/base``."""
    return config.model.hf_dir or os.path.join(workdir, "base")
