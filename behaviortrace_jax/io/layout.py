"""Where every stage reads and writes under a run's workdir: one :class:`RunLayout`.

Every stage builds its paths from here (``RunLayout(workdir).grpo_summary`` ...), so a file's
location is written once. A draw's files (``draws/``, SPEC §7.3, §7.4) are named here too, by one
builder (:func:`draw_filename`) and read back by one parser per name (:func:`parse_rows_filename`,
:func:`parse_token_level_filename`): the ``draws`` stage writes them, the release format
(``attribution/release.py``) and the checklist (``attribution/verdicts.py``) read them. The other
names inside a release folder (``release/seed{N}/``) are the paper's release format and live with
its reader/writer, ``attribution/release.py``.
"""
from __future__ import annotations

import dataclasses
import os
import re

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

    Every module outside ``io/`` reaches the run's files through this (tests/io/test_remote_paths.py
    fails on a builtin ``open``, ``os.replace``, ``shutil`` call or ``pathlib.Path(...)`` there).
    """
    if isinstance(path, epath.Path):
        return path
    return epath.Path(os.fspath(path))


ROWS_STEM = "minimal_pair_rows"  # minimal_pair_rows_ckpt{C}_gen{G}.json (SPEC §7.3)
TOKEN_LEVEL_STEM = "token_level_cos_temp"  # token_level_cos_temp{T}.json (SPEC §7.4)
ROWS_GLOB = f"{ROWS_STEM}_ckpt*_gen*.json"
TOKEN_LEVEL_GLOB = f"{TOKEN_LEVEL_STEM}*.json"
_ROWS_RE = re.compile(rf"{ROWS_STEM}_ckpt(\d+)_gen(\d+)\.json")
_TOKEN_LEVEL_RE = re.compile(rf"{TOKEN_LEVEL_STEM}([0-9.]+)\.json")


def draw_filename(stem: str, ckpt_seed: int, gen_seed: int, ext: str) -> str:
    """``{stem}_ckpt{C}_gen{G}{ext}``: the name of every file of draw (C, G) but the pre-registered
    draw's token-level file (SPEC §10.2: C = the checkpoint's run seed, G = the generation seed)."""
    return f"{stem}_ckpt{ckpt_seed}_gen{gen_seed}{ext}"


def rows_filename(ckpt_seed: int, gen_seed: int) -> str:
    """``minimal_pair_rows_ckpt{C}_gen{G}.json`` (SPEC §7.3)."""
    return draw_filename(ROWS_STEM, ckpt_seed, gen_seed, ".json")


def parse_rows_filename(name: str) -> tuple[int, int] | None:
    """``(ckpt_seed, gen_seed)`` of a :func:`rows_filename` ``name`` (a file name, not a path);
    None when ``name`` is not one."""
    m = _ROWS_RE.fullmatch(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def token_level_filename(temperature: float, ckpt_seed: int, gen_seed: int, run_seed: int) -> str:
    """``token_level_cos_temp{T}.json`` (SPEC §7.4) for the pre-registered draw
    (ckpt_seed == gen_seed == run_seed); diagnostic draws add ``_ckpt{C}_gen{G}``."""
    base = f"{TOKEN_LEVEL_STEM}{float(temperature)}"
    if ckpt_seed == gen_seed == run_seed:
        return base + ".json"
    return draw_filename(base, ckpt_seed, gen_seed, ".json")


def parse_token_level_filename(name: str) -> str | None:
    """The temperature, as written (``"0.9"``), of the pre-registered draw's token-level file
    ``name`` (:func:`token_level_filename`); None for any other name (a diagnostic draw's too)."""
    m = _TOKEN_LEVEL_RE.fullmatch(name)
    return m.group(1) if m else None


@dataclasses.dataclass(frozen=True)
class DrawPaths:
    """The files of draw (``ckpt_seed``, ``gen_seed``) under ``root`` (``draws/`` or ``draws/<id>/``;
    :meth:`RunLayout.draw`): the rows and token-level files (SPEC §7.3, §7.4), the settings they were
    made with, targets, rollouts, sketch stores, and the per-repeat partial results of a killed run."""

    root: epath.Path
    ckpt_seed: int
    gen_seed: int
    token_level_name: str

    def _f(self, stem: str, ext: str) -> epath.Path:
        return self.root / draw_filename(stem, self.ckpt_seed, self.gen_seed, ext)

    rows = property(lambda self: self.root / rows_filename(self.ckpt_seed, self.gen_seed))
    token_level = property(lambda self: self.root / self.token_level_name)
    settings = property(lambda self: self._f("draw", ".settings.json"))
    targets_npz = property(lambda self: self._f("targets", ".npz"))
    targets_json = property(lambda self: self._f("targets", ".json"))
    rollouts = property(lambda self: self._f("rollouts", ".npz"))
    sketches = property(lambda self: self._f("sketches", ".zarr"))
    grad_norms = property(lambda self: self._f("grad_norms", ".zarr"))
    partial = property(lambda self: self._f("partial", ""))

    def rep(self, r: int) -> epath.Path:
        """``partial_ckpt{C}_gen{G}/rep{r:03d}.npz``: repeat ``r``'s results, kept until the draw is done."""
        return self.partial / f"rep{r:03d}.npz"


# The tensorstore arrays under ``sketches/`` (io/sketch_store.py): the in-run stores of the grpo
# stage (sketch/stores.py) and the sketch stage's targets and per-checkpoint rollout sketches.
IN_RUN_STORES = ("step_sketches", "step_grad_norms", "step_clip_factors", "rollout_sketches",
                 "rollout_grad_norms", "rollout_coefficients")
SKETCH_STORES = IN_RUN_STORES + ("targets_continuation", "checkpoint_rollout_sketches", "checkpoint_rollout_fluency",
                                 "checkpoint_rollout_norms")


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """The paths of one run under ``workdir`` (SPEC §2.5 layout, plus orbax state and our outputs).

    | stage | paths |
    |---|---|
    | ``base`` | ``base/`` (HF checkpoint; the policy's start unless ``config.model.hf_dir``) |
    | ``sft`` | ``sft/``: ``hf/``, ``state/``, ``sft_summary.json``, ``.sft_warmup_done`` |
    | ``grpo`` | ``grpo/``: ``rollouts/``, ``ground_truth.jsonl``, ``decoys.jsonl`` (decoy runs), ``checkpoints/``, ``registry.json``, ``state/``, ``learning_curve.json``, ``summary.json``, ``tb/``, ``progress.json`` |
    | ``grpo``, ``sketch`` | ``sketches/`` (tensorstore arrays) |
    | ``draws`` | ``draws/`` |
    | ``evaluate`` | ``release/seed{N}/``, ``results_table.csv``, ``attribution_scores.json``, ``verdicts.json``, ``which_rollout_top.json`` |
    | ``report`` | ``report.md``, ``figures/`` |
    | ``counterfactual`` | ``counterfactual/``: ``replays/*.json``, ``report_section.md``; rows of ``results_table.csv``, a section of ``report.md``, ``figures/counterfactual_topk.png`` |
    | ``cause`` | ``cause/``: ``replays/*.json``, ``gate.json``, ``results_rows.csv``, ``report_section.md`` (the causal gate) |
    | ``metagradient`` | ``metagradient/``: ``<advantages>.json`` (dM/dw per measure step), ``scores.json`` |
    | ``compile`` | ``compile_report.json``, ``compile_report.md`` |
    | every invocation | ``run_info.json``: CPU type, library versions, kernel variables (``machine.run_info``); ``.lock`` while a run writes the workdir (``io/workdir_lock.py``) |
    | ``sft``, ``grpo``, ``sketch``, ``draws`` | ``<folder>/<stage>.settings.json``: the stage's fingerprint (``stages/fingerprint.py``) |
    """

    workdir: epath.Path

    def __init__(self, workdir: str | os.PathLike):
        object.__setattr__(self, "workdir", as_path(workdir))

    def model_dir(self, hf_dir: str | os.PathLike = "") -> epath.Path:
        """The policy's starting HF checkpoint: ``hf_dir`` (``config.model.hf_dir``) or, if empty, ``workdir/base``."""
        return as_path(hf_dir) if hf_dir else self.base

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

    def behavior_targets(self, suffix: str = "") -> epath.Path:
        """``sketches/targets_continuation{suffix}.zarr``: a behaviour's continuation targets
        float32 [checkpoints, D] (suffix "" = the first behaviour's, ``sketch_store("targets_continuation")``)."""
        return self.sketches / f"targets_continuation{suffix}.zarr"

    def behavior_target_stats(self, suffix: str = "") -> epath.Path:
        """``sketches/targets{suffix}.json``: the statistics of :meth:`behavior_targets` per checkpoint."""
        return self.sketches / f"targets{suffix}.json"

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
    progress = property(lambda self: self.grpo / "progress.json")  # the last step, its times (the status stage)
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
    cause = property(lambda self: self.workdir / "cause")  # the causal gate (stages/cause.py)
    cause_gate = property(lambda self: self.cause / "gate.json")  # its verdicts, values and console lines
    metagradient = property(lambda self: self.workdir / "metagradient")  # <advantages>.json per mode
    metagradient_scores = property(lambda self: self.metagradient / "scores.json")  # the estimator's input
    compile_report_json = property(lambda self: self.workdir / "compile_report.json")
    compile_report_md = property(lambda self: self.workdir / "compile_report.md")
    run_info = property(lambda self: self.workdir / "run_info.json")
    lock = property(lambda self: self.workdir / ".lock")  # held by the run writing the workdir (io/workdir_lock.py)

    def sketch_store(self, name: str) -> epath.Path:
        """``sketches/{name}.zarr``, one of :data:`SKETCH_STORES`.

        Raises:
            ValueError: naming ``name`` when it is not one of them.
        """
        if name not in SKETCH_STORES:
            raise ValueError(f"unknown sketch store {name!r}; known: {', '.join(SKETCH_STORES)}")
        return self.sketches / f"{name}.zarr"

    def draw(self, ckpt_seed: int, gen_seed: int, *, temperature: float, run_seed: int,
             behavior_id: str = "") -> DrawPaths:
        """The :class:`DrawPaths` of draw (``ckpt_seed``, ``gen_seed``) at sampling ``temperature`` of the
        run of seed ``run_seed``: under ``draws/`` for the first behaviour (``behavior_id`` ""), else
        under ``draws/<id>/``."""
        root = self.draws / behavior_id if behavior_id else self.draws
        return DrawPaths(root, ckpt_seed, gen_seed, token_level_filename(temperature, ckpt_seed, gen_seed, run_seed))

    def release_seed(self, seed: int) -> epath.Path:
        """``release/seed{seed}``: one seed's files in the paper's release format."""
        return self.behavior_release("", seed)
