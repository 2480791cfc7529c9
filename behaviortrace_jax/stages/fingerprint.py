"""Each stage's outputs keyed by what made them: the config values and inputs that shape them.

A stage's *fingerprint* is a flat key (``io/cache.py``: ``{"sft.lr": 0.0002, ...}``): the config
values of :data:`STAGE_SECTIONS` that shape its outputs, plus the fingerprints of the stages it
reads (:data:`UPSTREAM`), so a changed SFT learning rate changes the fingerprint of ``sft`` and of
every stage after it, and a refusal names the key itself, not an upstream digest. Inputs named by a
path enter as the digest of their contents (:func:`input_digest`), never as the path, so a workdir
or a model folder can move. Keys that cannot change a stage's result are left out of every
fingerprint (:data:`EXCLUDED`, with the reason for each).

Where a fingerprint is recorded (:func:`record_path`): ``base/.complete`` (the ``base`` stage's own
fingerprint, written when the model is done), else ``<stage folder>/<stage>.settings.json``
(``sft/``, ``grpo/``, ``sketches/``, ``draws/``), written when the stage starts, so a run killed
mid-stage is checked on resume too; a stage that fails before writing anything leaves none.

:func:`check_workdir` runs before any stage (``registry.run_stages``): every recorded stage among
the requested ones and those they read is compared with the fingerprint of the config now.
``config.on_changed_config`` chooses what a difference does:

* ``"refuse"`` (the default): a ``ValueError`` naming the stage, every changed key and both values,
  before anything is written;
* ``"recompute"``: one log line per changed key, then the stage's outputs and those of every stage
  after it are removed (:data:`OUTPUTS`), so the requested stages recompute them; a changed stage
  that the run does not name is refused, as it cannot be recomputed.

Stages without a fingerprint (``evaluate``, ``report``, ``counterfactual``, ``metagradient``, ``cause``, ...):
``evaluate`` and ``report`` rewrite their outputs on every run; ``counterfactual``,
``metagradient`` and ``cause`` key each cached file by its inputs (``io/cache.py``). They are downstream of
``draws`` / ``grpo``, so a recompute removes ``evaluate``'s and ``report``'s stale tables too.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import Any, Iterator

import ml_collections
from absl import logging
from etils import epath

from behaviortrace_jax.io import cache, files
from behaviortrace_jax.io.layout import RunLayout, as_path

ON_CHANGED = ("refuse", "recompute")  # config.on_changed_config
# Config keys (dotted; a trailing "." is a whole section) that cannot change any stage's result.
EXCLUDED = {
    "stages": "the stage list: which stages run, not what they compute",
    "on_changed_config": "what a changed key does, not what a stage computes",
    "model.hf_id": "resolved into model.hf_dir before any stage runs (pipeline.with_model_source)",
    "model.allow_download": "whether a missing model is downloaded",
    "model.hf_dir": "a path: the folder's contents enter as input_digest instead",
    "reference_dir": "a path read only by the reproduce stage",
    "base.log_every": "logging",
    "draws.ckpt_seed": "names which draw a run makes: each draw's files carry (ckpt, gen) and their own settings",
    "draws.gen_seed": "names which draw a run makes: each draw's files carry (ckpt, gen) and their own settings",
    "grpo.on_nonfinite": ("what a non-finite value does: under 'stop' no state with one is ever saved, so a run "
                          "stopped there resumes under 'skip' from the same outputs; each skip is in the rollout log "
                          "and summary.json"),
    "mesh.": "the device layout (workers): a run resumes on another mesh (tests/io/test_checkpoint_topology.py)",
    "model.scan_layers": "execution: the same parameters, checkpoints and sketch coordinates",
    "sketch.kernel": "execution: which kernel computes the same sketch",
    "sketch.chunk_size": "execution: examples per sketcher call",
    "sketch.fused": "execution: one backward or vmap(grad) for the same per-example gradients",
    "sketch.in_run_tables": "execution: hash tables or hashes on the fly, the same buckets",
    "targets.use_tables": "execution: hash tables or hashes on the fly, the same buckets",
    "sweep.": "the sweep stage's own seeds and stage list (each seed's run has its own workdir)",
    "compile.": "the compile stage allocates nothing and writes its own report",
    "info.": "the info stage writes nothing",
    "counterfactual.": "the counterfactual stage keys each replay file itself (io/cache.py)",
    "metagradient.": "the metagradient stage keys its files itself (io/cache.py)",
    "cause.": "the cause stage keys each replay file itself (io/replay_request.py) and rewrites its gate on every run",
    "evaluation.": "read by evaluate and report, which rewrite their outputs on every run",
}
# The config keys (dotted; a trailing "." is a whole section) that shape each stage's own outputs.
STAGE_SECTIONS = {
    "sft": ("seed", "sft.", "optim.", "behavior.", "behaviors.", "base.seed", "base.n_heldout", "grpo.temperature",
            "grpo.top_p", "model."),
    "grpo": ("run_name", "grpo.", "optim.", "contamination.", "sketch.dim", "sketch.seed", "sketch.hash",
             "sketch.in_run_rollouts", "model."),
    "sketch": ("sketch.rollout_checkpoints", "sketch.rollout_scope", "draws.target_step", "targets."),
    "draws": ("draws.", "targets."),
}
# Which recorded stages each stage reads (directly); the fingerprint of a stage includes theirs.
UPSTREAM = {"base": (), "sft": ("base",), "grpo": ("sft",), "sketch": ("grpo",), "draws": ("grpo",),
            "evaluate": ("sketch", "draws"), "report": ("evaluate",), "counterfactual": ("grpo",),
            "metagradient": ("grpo",), "cause": ("grpo",)}
# Stage -> its outputs under the workdir (globs), removed when ``on_changed_config=recompute``
# recomputes it or a stage before it.
OUTPUTS = {
    "base": ("base", "base.build"),
    "sft": ("sft",),
    "grpo": ("grpo", "sketches"),
    "sketch": ("sketches/targets_continuation*.zarr", "sketches/targets*.json", "sketches/checkpoint_rollout_*.zarr",
               "sketches/sketch.settings.json"),
    "draws": ("draws",),
    "evaluate": ("release", "results_table.csv", "attribution_scores.json", "verdicts.json", "which_rollout_top.json"),
    "report": ("report.md", "figures"),
}
RECORD_DIRS = {"sft": "sft", "grpo": "grpo", "sketch": "sketches", "draws": "draws"}


def excluded(key: str) -> bool:
    """Whether the dotted config ``key`` is one of :data:`EXCLUDED` (or in an excluded section)."""
    return any(key == e or (e.endswith(".") and key.startswith(e)) for e in EXCLUDED)


def input_digest(path: str | os.PathLike) -> str:
    """``"sha256:<hex>"`` of what a path key names: a file's bytes, or for a folder (a model
    checkpoint) its ``config.json`` bytes with the name and size of every file in it; ``""`` for
    ``""`` (the default input).

    Raises:
        FileNotFoundError: naming ``path`` when it does not exist.
    """
    if not str(path):
        return ""
    p = as_path(path)
    if p.is_file():
        return "sha256:" + files.sha256_file(p)
    if not p.is_dir():
        raise FileNotFoundError(f"{path}: no such file or folder")
    h = hashlib.sha256()
    for f in sorted(p.iterdir(), key=lambda x: x.name):
        h.update(f"{f.name} {f.stat().st_size if f.is_file() else 'dir'}\n".encode())
    if (p / "config.json").is_file():
        h.update((p / "config.json").read_bytes())
    return "sha256:" + h.hexdigest()


def base_fingerprint(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The ``base`` stage's fingerprint, as ``base/.complete`` holds it: the config values that
    determine the base model (``config.base``, optimizer betas/eps/decay/clip, model dtypes; the
    test switch ``BEHAVIORTRACE_PERTURB_BASE_WEIGHT`` only when set) as ``values``, and their sha256
    ``digest``."""
    from behaviortrace_jax.train import train_state  # jax: only where a base model is fingerprinted

    o = config.optim
    values = {"base": config.base.to_dict(), "param_dtype": config.model.param_dtype,
              "compute_dtype": config.model.compute_dtype,
              "optim": {k: o[k] for k in ("b1", "b2", "eps", "weight_decay", "grad_clip")}}
    if values["base"]["family"] == "qwen2":  # the default family: not a value (the digest of a qwen2 base)
        del values["base"]["family"]
    if perturb := train_state.perturbation_setting():  # a determinism test's perturbed base is another model
        values["perturb_base_weight"] = perturb
    blob = json.dumps(values, sort_keys=True)
    return {"digest": hashlib.sha256(blob.encode()).hexdigest(), "values": values}


def _values(config: ml_collections.ConfigDict, sections: tuple[str, ...]) -> dict[str, Any]:
    """The config's values under ``sections`` (not :func:`excluded`), path keys as their digests."""
    flat = cache.flatten(config.to_dict())
    out = {}
    for k, v in flat.items():
        if excluded(k) or not any(k == s or (s.endswith(".") and k.startswith(s)) for s in sections):
            continue
        out[k] = input_digest(v) if k.endswith(("_path", "_dir")) and isinstance(v, str) else v
    return out


def stage_key(config: ml_collections.ConfigDict, stage: str) -> dict[str, Any]:
    """The fingerprint of ``stage`` (module docstring): a flat ``{dotted key: JSON value}`` map.

    ``base``: the values of :func:`base_fingerprint` under dotted names (``base.steps``, ``optim.eps``);
    ``sft``: the base's (or, with ``model.hf_dir``, ``model.hf_dir`` = :func:`input_digest` of the
    start checkpoint) plus its sections; each later stage: its upstream stages' plus its sections.
    """
    if stage == "base":
        return {k: v for k, v in cache.flatten(base_fingerprint(config)["values"]).items() if not excluded(k)}
    key: dict[str, Any] = {}
    if stage == "sft" and str(config.model.hf_dir):
        key["model.hf_dir"] = input_digest(config.model.hf_dir)
    for up in UPSTREAM[stage]:
        if up in STAGE_SECTIONS or up == "base":
            if not (up == "base" and str(config.model.hf_dir)):
                key.update(stage_key(config, up))
    key.update(_values(config, STAGE_SECTIONS[stage]))
    if stage == "sft" and float(config.sft.lr) != -1:
        del key["optim.lr"]  # the RL learning rate; SFT's own is sft.lr (SPEC §1.7: optim.lr only when sft.lr = -1)
    return cache.check_key(key, f"the fingerprint of stage {stage}")


def record_path(workdir: str | os.PathLike, stage: str) -> epath.Path | None:
    """Where ``stage``'s fingerprint is recorded (module docstring); None for a stage without one."""
    run = RunLayout(workdir)
    if stage == "base":
        return run.base / ".complete"
    if stage in RECORD_DIRS:
        return run.workdir / RECORD_DIRS[stage] / f"{stage}.settings.json"
    return None


def recorded(workdir: str | os.PathLike, stage: str) -> dict[str, Any] | None:
    """The fingerprint recorded for ``stage`` in ``workdir`` (None: none recorded).

    Raises:
        ValueError: naming the file when it is not a JSON object with a ``"cache"`` (or, for
            ``base/.complete``, ``"values"``) object.
    """
    path = record_path(workdir, stage)
    rec = files.read_json(path, None) if path is not None else None
    if rec is None:
        return None
    field = "values" if stage == "base" else cache.CACHE_FIELD
    if not isinstance(rec, dict) or not isinstance(rec.get(field), dict):
        raise ValueError(f"{path}: expected a JSON object with a {field!r} object (the fingerprint of stage {stage}); "
                         "delete the file to record the config now")
    if stage == "base":
        return {k: v for k, v in cache.flatten(rec["values"]).items() if not excluded(k)}
    return rec[field]


def _closure(names: list[str]) -> list[str]:
    """``names`` and every stage they read, transitively."""
    out, todo = [], list(names)
    while todo:
        n = todo.pop()
        if n not in out:
            out.append(n)
            todo.extend(UPSTREAM.get(n, ()))
    return out


def downstream(stage: str) -> list[str]:
    """``stage`` and every stage that reads it, transitively (in :data:`UPSTREAM`'s order)."""
    out = [stage]
    for n in UPSTREAM:
        if n not in out and any(u in out for u in _closure([n]) if u != n):
            out.append(n)
    return out


def check_workdir(config: ml_collections.ConfigDict, workdir: str | os.PathLike, names: list[str], *,
                  mode: str | None = None) -> list[str]:
    """Compares every recorded fingerprint of the stages ``names`` run or read with the config now
    (module docstring); returns the stages whose outputs were removed to be recomputed. ``mode``:
    "refuse" or "recompute"; None = ``config.on_changed_config``.

    Raises:
        ValueError: ``mode`` is not one of :data:`ON_CHANGED`; a stage's
            fingerprint differs and the mode is "refuse", or the stage is not in ``names`` (naming
            the stage, the record's file, each changed key and both values).
    """
    mode = str(config.on_changed_config if mode is None else mode)
    if mode not in ON_CHANGED:
        raise ValueError(f"config.on_changed_config={mode!r}; expected one of {ON_CHANGED}")
    changed: dict[str, list[tuple[str, Any, Any]]] = {}
    closure = _closure(names)
    for stage in [s for s in UPSTREAM if s in closure]:  # in pipeline order
        if record_path(workdir, stage) is None:
            continue
        have = recorded(workdir, stage)
        if have is None:
            continue
        diff = cache.differences(have, stage_key(config, stage))
        if diff:
            changed[stage] = diff
    if not changed:
        return []

    named: dict[str, str] = {}  # key -> the first (upstream-most) stage whose line names it

    def lines(stage: str) -> str:
        own = [(k, old, new) for k, old, new in changed[stage] if named.setdefault(k, stage) == stage]
        later = sorted({named[k] for k, _, _ in changed[stage]} - {stage})
        text = "; ".join(f"{k}: {old!r} (recorded) -> {new!r} (now)" for k, old, new in own)
        return "; ".join(x for x in (text, f"and the keys of {', '.join(later)} above" if later else "") if x)

    where = {s: record_path(workdir, s) for s in changed}
    cannot = [s for s in changed if mode == "refuse" or s not in names]
    if cannot:
        detail = "\n".join(f"  stage {s} ({where[s]}): {lines(s)}" for s in cannot)
        hint = ("rerun with --config.on_changed_config=recompute to recompute these stages and every stage after them"
                if mode == "refuse" else "add them to config.stages to recompute them")
        raise ValueError(f"{workdir} holds outputs made with another config:\n{detail}\n{hint}, or use another "
                         "workdir (keys that cannot change a result: stages/fingerprint.py EXCLUDED)")
    removed: list[str] = []
    for stage in changed:
        logging.warning("on_changed_config=recompute: stage %s (%s) changed: %s; recomputing it and the stages after "
                        "it", stage, where[stage], lines(stage))
        for s in downstream(stage):
            if s not in removed:
                invalidate(workdir, s)
                removed.append(s)
    return removed


def invalidate(workdir: str | os.PathLike, stage: str) -> None:
    """Removes ``stage``'s outputs (:data:`OUTPUTS`) and its recorded fingerprint, with a log line."""
    root = as_path(workdir)
    gone = []
    for pattern in OUTPUTS.get(stage, ()):
        for p in (sorted(root.glob(pattern)) if "*" in pattern else [root / pattern]):
            if p.is_dir():
                files.remove_tree(p)
                gone.append(p.name)
            elif p.exists():
                files.remove_file(p)
                gone.append(p.name)
    if gone:
        logging.warning("on_changed_config=recompute: removed stage %s's outputs %s", stage, ", ".join(gone))


@contextlib.contextmanager
def recording(config: ml_collections.ConfigDict, workdir: str | os.PathLike, stage: str) -> Iterator[None]:
    """Records ``stage``'s fingerprint before the body runs the stage (unless one is recorded), and
    again after it if the stage removed it (``sft`` starts a partial warm-up afresh, folder and
    all); if the body raises having written nothing else in the stage's folder, the record is
    removed again (a failed start leaves no fingerprint behind)."""
    path = record_path(workdir, stage)
    if path is None or stage == "base":
        yield
        return
    if path.exists():
        yield
    else:
        before = {p.name for p in path.parent.iterdir()} if path.parent.is_dir() else set()
        key = stage_key(config, stage)
        logging.info("stage %s: recording its fingerprint (%d config values) in %s", stage, len(key), path)
        cache.store(path, {"stage": stage}, key)
        try:
            yield
        except BaseException:
            after = ({p.name for p in path.parent.iterdir()} if path.parent.is_dir() else set()) - {path.name}
            if after <= before:
                files.remove_file(path)
            raise
    if not path.exists():
        cache.store(path, {"stage": stage}, stage_key(config, stage))
