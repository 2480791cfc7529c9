"""The ``compile`` stage: ahead-of-time compilation of every jitted program a config runs.

    python main.py --config=configs/seed0.py --config.stages=compile \\
        --config.compile.target=tpu:v5e:2x4 --config.compile.model=qwen2p5_1p5b --workdir=W

Nothing is allocated on an accelerator: each program (a name of ``models.programs.PROGRAMS``) is
built by the same constructor the run uses, on the run's mesh (``grpo.make_train_step``,
``sampler.Sampler``, ``lm_trainer.LMTrainer``, ``targets.ForcedSketcher``, ``metagradient.MetaStep``;
``aot.builders.PROGRAM_BUILDERS``) and lowered through its public jitted function with
``jax.ShapeDtypeStruct`` arguments that carry their shardings on a mesh of the target's devices,
then compiled. ``config.compile.target``:

* ``tpu:<topology>`` (``tpu:v5e:2x4``, ``tpu:v6e:2x4``, ``tpu:v5p:2x2x1``): the devices of
  ``jax.experimental.topologies.get_topology_desc`` - XLA:TPU on this host; needs ``libtpu``
  (``pip install -e '.[tpu]'``);
* ``cpu:<n>``: n host CPU devices (``main.py`` sets ``jax_num_cpu_devices`` before JAX starts;
  jax 0.10.2 has no CPU topology description);
* ``local``: the attached devices (a GPU, a TPU VM).

Per program: compile seconds, host peak RSS, per-chip bytes of ``compiled.memory_analysis()``
(arguments, outputs, temps, aliased, generated code) against the chip's memory, XLA's FLOPs and
bytes accessed per chip with every loop trip counted (``aot.cost.loop_counted_cost``: XLA's own cost
analysis counts a ``while`` body - ``lax.scan``, ``lax.map``, the decode loop - once) and a roofline
``max(FLOPs / peak, bytes / bandwidth)`` from ``aot.memory.CHIPS`` on those counts. The GRPO step's FLOP and
bytes ratios (with over without in-run rollout sketches) are of the same counts.
Writes ``W/compile_report.{json,md}``; raises ``DoesNotFit`` naming each program over budget.

This module is the stage's orchestration; the library is ``behaviortrace_jax/aot/`` (the programs:
``builders``; the memory plan: ``memory``; the cost counting: ``cost``; the report: ``report``), whose
public names are re-exported here for the stage's callers.
"""
from __future__ import annotations

import json
import time

import ml_collections
from absl import logging

from behaviortrace_jax.aot.builders import (  # noqa: F401 - re-exported: the stage's library names
    PAPER_RUN_STAGES, PROGRAM_BUILDERS, AbstractRun, CompileOptions, Program, build_programs, compiled_stages, grpo_programs,
    lm_programs, metagradient_programs, sampler_programs, sketcher_programs, step_path)
from behaviortrace_jax.aot.cost import UncountedLoop, loop_counted_cost  # noqa: F401 - re-exported
from behaviortrace_jax.aot.memory import (  # noqa: F401 - re-exported
    CHIPS, GiB, Chip, DoesNotFit, chip_for, target_devices, xla_memory_limit)
from behaviortrace_jax.aot.report import compile_program, does_not_fit, fmt_gib, report_markdown, run_report
from behaviortrace_jax.io import files
from behaviortrace_jax.io.layout import RunLayout, as_path
from behaviortrace_jax.models import decoder, families
from behaviortrace_jax.stages.registry import register_stage
from behaviortrace_jax.stages.spec import RunSpec


def model_config(spec: RunSpec) -> decoder.DecoderConfig:
    """The model to compile: ``compile.model`` = a model-family preset (e.g. ``qwen2p5_1p5b``,
    ``llama3p2_1b``, ``qwen3_1p7b``; of ``model.family`` when set), or "" = ``model.hf_dir``'s
    config.json when present, else the ``base`` stage's preset of ``base.family``. Only shapes
    are read; no weights. ``compile.num_layers`` > 0 overrides the depth; ``model.scan_layers`` (when
    the config has it) sets the model's scan over layers."""
    c, dt = spec.compile_keys, dict(param_dtype=spec.model.param_dtype, compute_dtype=spec.model.compute_dtype)
    hf, family = spec.hf_dir, spec.model.family
    if c.model:
        cfg = families.preset(c.model, family, **dt)
    elif hf and (as_path(hf) / "config.json").is_file():
        cfg = families.config_from_hf(files.local_dir(hf), family, **dt)
    else:
        cfg = families.preset(spec.base.preset, spec.base.family,
                              vocab_size=spec.base.vocab_size, num_hidden_layers=spec.base.num_layers, **dt)
    if spec.model.scan_layers:  # a lax.scan over the layers (models/decoder.py)
        cfg = cfg.replace(scan_layers=True)
    return cfg.replace(num_hidden_layers=c.num_layers) if c.num_layers > 0 else cfg


@register_stage("compile")
def compile_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Compiles every program of ``config`` for ``config.compile.target``; writes the report.

    Raises:
        DoesNotFit: naming every program whose per-chip bytes exceed the chip's memory, and by how much.
    """
    t_start = time.perf_counter()
    run = RunSpec.from_config(config)
    devs, chip, memory = target_devices(run.compile.target)
    # the sketch family and kernel of the target's backend ("tpu" for a topology compiled on this host)
    spec = RunSpec.from_config(config, platform=str(devs[0].platform) if devs else None).compile
    mesh = spec.layout.on(devs).mesh()
    cfg = model_config(run)
    programs = build_programs(spec, cfg, mesh)
    rows = []
    for pr in programs:
        logging.info("compile: %s ...", pr.name)
        row = compile_program(pr, chip, memory)
        rows.append(row)
        logging.info("compile: %s in %.1f s, %s GiB/chip, fits=%s", pr.name, row["compile_s"],
                     fmt_gib(row.get("total_bytes")), row["fits"])
    report = run_report(spec, devs, chip, mesh, cfg, rows, t_start)
    paths = RunLayout(workdir)  # local or gs:// (files.write_strategy)
    files.atomic_write_text(paths.compile_report_json, json.dumps(report, indent=2))
    md = report_markdown(report)
    files.atomic_write_text(paths.compile_report_md, md)
    print(md)
    error = does_not_fit(report)
    if error is not None:
        raise error
