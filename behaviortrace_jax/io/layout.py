"""Where every stage reads and writes under a run's workdir: one :class:`RunLayout`.

Every stage builds its paths from here (``RunLayout(workdir).grpo_summary`` ...), so a file's
location is written once. The names inside a release folder (``release/seed{N}/``) are the
paper's release format and live with its reader/writer, ``attribution/release.py``.
"""
from __future__ import annotations

import dataclasses
import os

import ml_collections
from etils import epath


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` names an object in a store (``gs://bucket/key``) rather than a local file."""
    return "://" in os.fspath(path)


def as_path(path: str | os.PathLike) -> epath.Path:
    """The one path type of the run's files: ``etils.epath.Path`` (what orbax uses), for a local path
    and for a URL (``gs://bucket/...``) alike; it keeps a URL's scheme (``pathlib`` would turn
    ``gs://`` into ``gs:/``, and ``pathlib.Path(<gs epath>)`` into ``/gs/...``), and supports ``/``,
    ``.name``, ``.parent``, ``open``, ``read_text``/``write_text``, ``exists``, ``iterdir``, ``glob``,
    ``mkdir``, ``unlink``, ``rmtree``. Local and remote differ only where a writer must choose how
    to make a write atomic (``files.write_strategy``): test with :func:`is_url`, never the type.

    Every module outside ``io/`` reaches the run's files through this (tests/test_remote_paths.py
    fails on a builtin ``open``, ``os.replace``, ``shutil`` call or ``pathlib.Path(...)`` there).
    """
    if isinstance(path, epath.Path):
        return path
    return epath.Path(os.fspath(path))


# The tensorstore arrays under ``sketches/`` (io/sketch_store.py): the in-run stores of the grpo
# stage (sketch/stores.py) and the sketch stage's targets and per-checkpoint rollout sketches.
SKETCH_STORES = ("step_sketches", "step_grad_norms", "step_clip_factors", "rollout_sketches",
                 "rollout_grad_norms", "rollout_coefficients", "targets_continuation", "checkpoint_rollout_sketches", "checkpoint_rollout_fluency",
                 "checkpoint_rollout_norms")


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """The paths of one run under ``workdir`` (SPEC §2.5 layout, plus orbax state and our outputs).

    | stage | paths |
    |---|---|
    | ``base`` | ``base/`` (HF checkpoint; the policy's start unless ``config.model.hf_dir``) |
    | ``sft`` | ``sft/``: ``hf/``, ``state/``, ``sft_summary.json``, ``.sft_warmup_done`` |
    | ``grpo`` | ``grpo/``: ``rollouts/``, ``ground_truth.jsonl``, ``decoys.jsonl`` (decoy runs), ``checkpoints/``, ``registry.json``, ``state/``, ``learning_curve.json``, ``summary.json``, ``tb/`` |
    | ``grpo``, ``sketch`` | ``sketches/`` (tensorstore arrays) |
    | ``draws`` | ``draws/`` |
    | ``evaluate`` | ``release/seed{N}/``, ``results_table.csv``, ``attribution_scores.json``, ``verdicts.json``, ``which_rollout_top.json`` |
    | ``report`` | ``report.md``, ``figures/`` |
    | ``counterfactual`` | ``counterfactual/``: ``replays/*.json``, ``report_section.md``; rows of ``results_table.csv``, a section of ``report.md``, ``figures/counterfactual_topk.png`` |
    | ``metagradient`` | ``metagradient/``: ``<advantages>.json`` (dM/dw per measure step), ``scores.json`` |
    | ``compile`` | ``compile_report.json``, ``compile_report.md`` |
    | every invocation | ``run_info.json``: CPU type, library versions, kernel variables (``machine.run_info``) |
    """

    workdir: epath.Path

    def __init__(self, workdir: str | os.PathLike):
        object.__setattr__(self, "workdir", as_path(workdir))

    def model_dir(self, config: ml_collections.ConfigDict) -> epath.Path:
        """The policy's starting HF checkpoint: ``config.model.hf_dir`` or, if empty, ``workdir/base``."""
        return as_path(config.model.hf_dir) if config.model.hf_dir else self.base

    base = property(lambda self: self.workdir / "base")
    # sft/
    sft = property(lambda self: self.workdir / "sft")
    sft_hf = property(lambda self: self.sft / "hf")  # HF export of the warmed-up policy
    sft_state = property(lambda self: self.sft / "state")  # orbax train state (AdamW carries, SPEC §1.7)
    sft_summary = property(lambda self: self.sft / "sft_summary.json")
    sft_done = property(lambda self: self.sft / ".sft_warmup_done")  # SPEC §1.7
    # grpo/
    grpo = property(lambda self: self.workdir / "grpo")
    rollouts = property(lambda self: self.grpo / "rollouts")  # JSONL shards (rollout_log.py)
    ground_truth = property(lambda self: self.grpo / "ground_truth.jsonl")  # SPEC §6.1
    decoys = property(lambda self: self.grpo / "decoys.jsonl")  # decoy bonuses (contamination.decoy_fraction > 0)

    def behavior_ground_truth(self, suffix: str = "") -> epath.Path:
        """``grpo/ground_truth{suffix}.jsonl``: the first behaviour's (suffix "") is ``ground_truth``;
        another behaviour's suffix is ``_<id>`` (behavior/behaviors.py; SPEC §6.1 format)."""
        return self.grpo / f"ground_truth{suffix}.jsonl"

    def behavior_release(self, behavior_id: str = "", seed: int = 0) -> epath.Path:
        """``release/seed{S}`` for the first behaviour (``behavior_id`` ""), else
        ``release/<id>/seed{S}``: each a folder in the paper's release format."""
        root = self.release / behavior_id if behavior_id else self.release
        return root / f"seed{int(seed)}"
    registry = property(lambda self: self.grpo / "registry.json")  # SPEC §2.4
    checkpoints = property(lambda self: self.grpo / "checkpoints")  # HF exports step_XXXXXXXX
    state = property(lambda self: self.grpo / "state")  # orbax train states
    curve = property(lambda self: self.grpo / "learning_curve.json")
    summary = property(lambda self: self.grpo / "summary.json")
    tensorboard = property(lambda self: self.grpo / "tb")
    # later stages
    sketches = property(lambda self: self.workdir / "sketches")
    draws = property(lambda self: self.workdir / "draws")
    release = property(lambda self: self.workdir / "release")
    results_table = property(lambda self: self.workdir / "results_table.csv")
    attribution_scores = property(lambda self: self.workdir / "attribution_scores.json")
    verdicts = property(lambda self: self.workdir / "verdicts.json")
    which_rollout_top = property(lambda self: self.workdir / "which_rollout_top.json")  # what each method blames
    report = property(lambda self: self.workdir / "report.md")
    figures = property(lambda self: self.workdir / "figures")
    # optional stages
    counterfactual = property(lambda self: self.workdir / "counterfactual")  # report_section.md
    counterfactual_replays = property(lambda self: self.counterfactual / "replays")  # one JSON per replay
    metagradient = property(lambda self: self.workdir / "metagradient")  # <advantages>.json per mode
    metagradient_scores = property(lambda self: self.metagradient / "scores.json")  # the estimator's input
    compile_report_json = property(lambda self: self.workdir / "compile_report.json")
    compile_report_md = property(lambda self: self.workdir / "compile_report.md")
    run_info = property(lambda self: self.workdir / "run_info.json")

    def sketch_store(self, name: str) -> epath.Path:
        """``sketches/{name}.zarr``, one of :data:`SKETCH_STORES`.

        Raises:
            ValueError: naming ``name`` when it is not one of them.
        """
        if name not in SKETCH_STORES:
            raise ValueError(f"unknown sketch store {name!r}; known: {', '.join(SKETCH_STORES)}")
        return self.sketches / f"{name}.zarr"

    def release_seed(self, seed: int) -> epath.Path:
        """``release/seed{seed}``: one seed's files in the paper's release format."""
        return self.behavior_release("", seed)
