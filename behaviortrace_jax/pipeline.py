"""The pipeline: imports every stage module (so each registers itself) and runs the configured stages.

Stages, in the order of a full run (each skips itself when its outputs are complete):

| stage | module | writes under the workdir |
|---|---|---|
| ``info`` | ``stages/info.py`` | nothing (prints the model, devices, mesh and a probe completion) |
| ``base`` | ``stages/base.py`` | ``base/`` (tiny instruct model as an HF checkpoint) |
| ``sft`` | ``stages/sft.py`` | ``sft/`` (train state after the warm-up, HF export, summary) |
| ``grpo`` | ``stages/grpo.py`` | ``grpo/`` (rollout + ground-truth logs, checkpoints, registry, summary), ``sketches/`` |
| ``sketch`` | ``stages/sketch.py`` | ``sketches/`` (targets and rollout sketches at checkpoints) |
| ``draws`` | ``stages/draws.py`` | ``draws/`` (rollout-level rows of fresh groups, SPEC §5.6) |
| ``evaluate`` | ``stages/evaluate.py`` | ``results_table.csv``, ``attribution_scores.json``, ``verdicts.json`` |
| ``report`` | ``stages/report.py`` | ``report.md``, ``figures/*.png`` |
| ``reproduce`` | ``stages/reproduce.py`` | the paper's tables from its released files |
| ``sweep`` | ``stages/sweep.py`` | ``seed{S}/`` runs, diagnostic draws, one aggregate report |
| ``counterfactual`` | ``stages/counterfactual.py`` | ``counterfactual/`` replays; leave-top-k-out and LDS rows |
| ``metagradient`` | ``stages/metagradient.py`` | ``metagradient/`` (dM/dw of every rollout; the ``metagradient`` estimator's input) |
| ``cause`` | ``stages/cause.py`` | ``cause/`` (the causal gate: replays, ``gate.json``, ``causal_gate[...]`` rows) |
| ``status`` | ``stages/status.py`` | nothing (prints where a run stands; safe while the run goes on) |

``config.model.hf_id`` (a model in the Hugging Face cache) is resolved once, here, into
``config.model.hf_dir`` (:func:`with_model_source`, ``models/hub.py``), so every stage loads it as a local checkpoint.
"""
from __future__ import annotations

import hashlib

import ml_collections
from absl import logging

from behaviortrace_jax.attribution import report
from behaviortrace_jax.attribution.verdicts import Verdict
from behaviortrace_jax.io import files, machine, workdir_lock
from behaviortrace_jax.io.layout import RunLayout, as_path
from behaviortrace_jax.models import hub
from behaviortrace_jax.stages import fingerprint, registry as stages

HEADLINE_STAGES = {"evaluate", "report", "sweep", "reproduce"}  # stages that (re)write verdicts.json
# Stages that only read the workdir: an invocation of these alone neither creates the workdir nor appends
# to run_info.json, so it can look at a run that another process is writing.
READ_ONLY_STAGES = {"status"}


def resolve_config_paths(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of ``config`` whose path keys (names ending in ``_dir`` or ``_path``, any depth) are
    absolute, with ``~`` expanded (:func:`files.resolve_path`); ``""`` keeps meaning "the default".

    Raises:
        TypeError: naming the key, if a path key holds something other than a string.
    """
    out = config.copy_and_resolve_references()

    def walk(node: ml_collections.ConfigDict, prefix: str) -> None:
        for key in list(node.keys()):
            value = node[key]
            if isinstance(value, ml_collections.ConfigDict):
                walk(value, f"{prefix}{key}.")
            elif key.endswith(("_dir", "_path")):
                if not isinstance(value, str):
                    raise TypeError(f"config.{prefix}{key} is a path key but holds {value!r}")
                node[key] = files.resolve_path(value)

    with out.unlocked():
        walk(out, "")
    return out


def run_digest(config: ml_collections.ConfigDict, workdir: str) -> dict[str, str]:
    """sha256 of a run's key outputs, to compare runs across machines (docs/reproducibility.md).

    Returns:
        ``{"base_weights": hex, "results_table.csv": hex}`` for whichever exist: the starting
        model's ``*.safetensors`` files (hashed in name order as one stream of digests) and
        ``workdir/results_table.csv``.
    """
    out = {}
    weights = sorted(RunLayout(workdir).model_dir(config.model.hf_dir).glob("*.safetensors"))
    if weights:
        out["base_weights"] = (files.sha256_file(weights[0]) if len(weights) == 1 else
                               hashlib.sha256("".join(files.sha256_file(w) for w in weights).encode()).hexdigest())
    table = RunLayout(workdir).results_table
    if table.is_file():
        out["results_table.csv"] = files.sha256_file(table)
    return out


def record_run_info(workdir: str, stages_text: str) -> dict:
    """Appends this invocation (``stages_text`` and :func:`machine.run_info`) to ``W/run_info.json``
    and returns it; logs a warning when an earlier invocation on ``workdir`` ran on another CPU type
    (a resumed run then mixes the numerics of two machines, docs/reproducibility.md)."""
    path = RunLayout(workdir).run_info
    runs = files.read_json(path, {"runs": []}).get("runs", [])
    entry = {"stages": str(stages_text), **machine.run_info()}
    seen = {r.get("cpu", {}).get("key") for r in runs}
    if seen and entry["cpu"]["key"] not in seen:
        logging.warning("%s was started on another CPU type (%s); this invocation runs on %s, so its stages' "
                        "numbers are not comparable bit for bit with the earlier ones", workdir,
                        "; ".join(sorted(k for k in seen if k)), entry["cpu"]["key"])
    files.write_json(path, {"runs": runs + [entry]}, indent=1)
    return entry


def with_model_source(config: ml_collections.ConfigDict, *, strict: bool = True) -> ml_collections.ConfigDict:
    """``config`` with ``model.hf_id`` resolved: a copy whose ``model.hf_dir`` is the id's snapshot
    folder (``hub.resolve_hf_id``) and ``model.hf_id`` empty; ``config`` itself when ``hf_id`` is empty.

    ``strict=False`` (read-only stages such as ``status``): a model missing from the cache (or a cached
    snapshot it cannot be loaded from) is logged and the config returned unresolved instead of raising.

    Raises:
        ValueError: both ``model.hf_id`` and ``model.hf_dir`` are set (naming both values).
        FileNotFoundError / ValueError: as ``hub.resolve_hf_id`` (with ``strict``).
    """
    hf_id = str(config.model.hf_id).strip()
    if not hf_id:
        return config
    if config.model.hf_dir:
        raise ValueError(f"config.model.hf_id={hf_id!r} and config.model.hf_dir={config.model.hf_dir!r} are both "
                         "set; set one (hf_id: a model in the Hugging Face cache, hf_dir: a checkpoint folder)")
    try:
        path = hub.resolve_hf_id(hf_id, allow_download=bool(config.model.allow_download))
    except (FileNotFoundError, ValueError) as e:  # ValueError: a corrupt cached snapshot (hub._check_snapshot)
        if strict:
            raise
        logging.warning("%s", e)
        return config
    logging.info("model.hf_id=%s -> %s", hf_id, path)
    out = config.copy_and_resolve_references()
    with out.unlocked():
        out.model.hf_dir, out.model.hf_id = str(path), ""
    return out


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, str]:
    """Imports the stage modules and runs ``config.stages`` on ``workdir`` (created if needed).

    ``workdir`` and every path key of ``config`` may be relative (to the current directory) or
    start with ``~``. Prints the headline verdicts (``report.headline_lines``: the step and
    which-rollout rules) when a stage of :data:`HEADLINE_STAGES` ran, then prints and returns
    :func:`run_digest`.

    ``config.model.hf_id`` is resolved into ``config.model.hf_dir`` first (:func:`with_model_source`).
    An invocation of :data:`READ_ONLY_STAGES` alone writes nothing (no workdir, no ``run_info.json``
    entry, no lock) and tolerates a model missing from the cache. Any other holds the workdir's lock
    (``io/workdir_lock.py``: one writer per workdir) for its whole life, and first compares every
    recorded stage fingerprint with the config (``stages/fingerprint.py``; ``config.on_changed_config``
    chooses between refusing and recomputing).

    Raises:
        ValueError: if ``config.stages`` names an unknown stage, sets both ``model.hf_id`` and
            ``model.hf_dir``, or holds a value the run's spec refuses (``stages/spec.py``, naming the
            key; before anything is written).
        FileNotFoundError: ``model.hf_id`` is not in the Hugging Face cache (naming the download
            command), or a read-only invocation's workdir does not exist.
        RuntimeError: another run holds the workdir's lock (naming its host, pid and start time).
        ValueError: a recorded stage fingerprint differs from the config's (naming each key and both
            values) with ``on_changed_config="refuse"``.
    """
    stages.load_stages()  # every stage module of behaviortrace_jax/stages/ registers itself
    from behaviortrace_jax.stages.spec import RunSpec, check_model_positions  # with the stage modules (jax), not at import

    names = stages.parse_stages(config.stages)  # an unknown stage name fails before anything is written
    read_only = bool(names) and set(names) <= READ_ONLY_STAGES
    config, workdir = resolve_config_paths(config), files.resolve_path(workdir)
    config = with_model_source(config, strict=not read_only)
    spec = RunSpec.from_config(config)  # every key typed and checked (errors naming it) before anything is written
    if not read_only:
        check_model_positions(spec, tuple(names))  # prompt + completion budgets within hf_dir's max_position_embeddings
    if read_only:
        if not as_path(workdir).is_dir():
            raise FileNotFoundError(f"--workdir={workdir}: no such run directory")
        stages.run_stages(config, workdir)
    else:
        as_path(workdir).mkdir(parents=True, exist_ok=True)
        with workdir_lock.hold(workdir):  # one writer per workdir, for the whole run
            # every recorded stage fingerprint against this config, before anything is written
            fingerprint.check_workdir(config, workdir, names, mode=config.on_changed_config)
            record_run_info(workdir, config.stages)
            stages.run_stages(config, workdir, record=fingerprint.recording)
    verdicts = RunLayout(workdir).verdicts
    if set(stages.parse_stages(config.stages)) & HEADLINE_STAGES and verdicts.is_file():
        rules = [Verdict.from_dict(v) for v in files.read_json(verdicts).get("decision_rules", [])]
        for line in report.headline_lines(rules):
            print(line)
    digest = run_digest(config, workdir)
    for name, hexdigest in digest.items():
        print(f"digest {name}: sha256 {hexdigest}")
    return digest
