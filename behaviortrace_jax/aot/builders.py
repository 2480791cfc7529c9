"""The programs a run compiles, built by the run's own constructors on the run's mesh (the catalogue
of ``models/programs.py`` at a config's real shapes), for the ``compile`` stage.

Nothing is allocated: :class:`AbstractRun` holds the abstract parameters, train state and shardings
of a config on a mesh (``jax.ShapeDtypeStruct`` leaves carrying their shardings), and each builder of
:data:`PROGRAM_BUILDERS` (``grpo.make_train_step``, ``sampler.Sampler``, ``lm_trainer.LMTrainer``,
``targets.ForcedSketcher``, ``metagradient.build_meta_step``) returns :class:`Program` rows whose
``lower()`` lowers the program through its public jitted function. :func:`compiled_stages` says
which stages' programs a config compiles (``compile.stages``) and :func:`build_programs` builds them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from behaviortrace_jax.models import decoder, programs, sampler as sampler_lib, sharding
from behaviortrace_jax.sketch import sketcher, targets
from behaviortrace_jax.train import grpo_step as grpo, lm_trainer, rollouts as rollouts_lib, train_state


def _sds(shape, dtype, sh) -> jax.ShapeDtypeStruct:
    """An abstract array of ``shape`` and ``dtype`` (a numpy or extended dtype) carrying sharding ``sh``."""
    dtype = dtype if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else jnp.dtype(dtype)
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sh)


def _with_sh(tree: Any, shardings: Any) -> Any:
    """``tree``'s abstract leaves, each carrying its sharding of ``shardings``."""
    return jax.tree.map(lambda a, s: _sds(a.shape, a.dtype, s), tree, shardings)


@dataclasses.dataclass
class Program:
    """One jitted program: ``lower()`` returns its ``jax.stages.Lowered``; ``note`` says its shapes;
    ``max_trips``: the trip count to count for a loop whose trip count XLA does not know (an upper
    bound, e.g. the decode loop's max_new_tokens - 1 steps; see ``aot.cost.loop_counted_cost``);
    ``program``: its name in ``models.programs.PROGRAMS`` (the report row ``name`` may add its
    variant); ``mesh``: ``programs.mesh_shape`` of the mesh it is built for (None: one device)."""

    name: str
    lower: Callable[[], Any]
    note: str = ""
    max_trips: int | None = None
    program: str = ""
    mesh: Any = None


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """What the compile stage compiles, built at the stage boundary (``stages/spec.py``,
    ``RunSpec.compile``; ``config.compile`` and the run's options the programs are built with).

    Fields:
        target: ``compile.target`` (``tpu:<topology>``, ``cpu:<n>``, ``local``; ``aot.memory``).
        stages: the stages whose programs are compiled (:func:`compiled_stages`).
        programs: ``compile.programs``, name prefixes of the programs kept (empty = every program).
        step: the run's GRPO step; step_variants: every GRPO step compiled (each requested loss of
            ``compile.losses``, in-run rollout sketches as configured and, with
            ``compile.both_sketch_variants``, flipped).
        optim, layout, rollouts: the run's optimizer, layout (FSDP) and rollout shapes / sampler.
        sft_batch_size, sft_length: the SFT step's batch (``sft.batch_size``, prompt + completion tokens).
        metagradient_mode: the first mode of ``metagradient.advantages``; metagradient_remat: its vjp's
            rematerialisation policy (``metagradient.remat``).
        forced: the forced sketcher's options; ctx_max_new_tokens (``targets.ctx_max_new_tokens``, -1
            resolved to the draws'), draws_max_new_tokens (``draws.max_new_tokens``): its lengths.
    """

    target: str
    stages: frozenset[str]
    programs: tuple[str, ...]
    step: grpo.GRPOStepSpec
    step_variants: tuple[grpo.GRPOStepSpec, ...]
    optim: train_state.OptimOptions
    layout: sharding.Layout
    rollouts: rollouts_lib.RolloutOptions
    sft_batch_size: int
    sft_length: int
    metagradient_mode: str
    metagradient_remat: str
    forced: targets.ForcedSketchOptions
    ctx_max_new_tokens: int
    draws_max_new_tokens: int


@dataclasses.dataclass(frozen=True)
class AbstractRun:
    """The abstract model, train state and shardings of ``options`` on ``mesh`` that every program is
    built and lowered with (``jax.ShapeDtypeStruct`` leaves carrying their shardings; nothing is
    allocated)."""

    options: CompileOptions
    cfg: decoder.DecoderConfig
    mesh: Any
    graphdef: Any
    abstract_params: Any  # without shardings, as the stages' constructors get them
    param_shardings: Any
    params: Any
    optimizer: Any
    state_shardings: Any
    state: Any

    @classmethod
    def build(cls, options: CompileOptions, cfg: decoder.DecoderConfig, mesh) -> "AbstractRun":
        """The model ``cfg`` with ``options``' optimizer and partition rules (``mesh.fsdp``) on ``mesh``."""
        graphdef, abs_params = nnx.split(decoder.abstract_model(cfg), nnx.Param)
        param_sh = options.layout.param_shardings(abs_params, mesh)  # as the stages place them
        tx = train_state.make_optimizer(options.optim)
        state_sh = train_state.train_state_shardings(tx, param_sh, mesh, abs_params)
        return cls(options, cfg, mesh, graphdef, abs_params, param_sh, _with_sh(abs_params, param_sh), tx, state_sh,
                   train_state.abstract_train_state(abs_params, tx, state_sh))

    @property
    def rep(self):
        """Replicated on the mesh."""
        return sharding.replicated(self.mesh)

    @property
    def data(self):
        """Leading axis over ``"data"``."""
        return sharding.data_sharding(self.mesh)

    def rows_sharding(self, rows: int):
        """Rows over ``"data"`` where they divide it, else replicated (as the stages place batches)."""
        return self.data if rows % self.mesh.shape[sharding.DATA] == 0 else self.rep

    def grpo_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The GRPO step's batch: N rollouts x (prompt + new) tokens over ``"data"``."""
        g = self.options.rollouts
        n, t = self.options.step.shapes.num_rollouts, g.max_prompt_tokens + g.max_new_tokens
        return {"input_ids": _sds((n, t), jnp.int32, self.data), "attention_mask": _sds((n, t), jnp.int32, self.data),
                "loss_mask": _sds((n, g.max_new_tokens), jnp.float32, self.data),
                "advantages": _sds((n,), jnp.float32, self.data)}


def sampler_programs(a: AbstractRun) -> list[Program]:
    """``sampler_prefill`` and ``sampler_decode`` of the GRPO rollouts (B x G rows, padded to the
    data axis), from ``models.sampler.Sampler`` on the run's mesh."""
    g = a.options.rollouts
    smp = sampler_lib.Sampler(a.graphdef, a.cfg, max_prompt_tokens=g.max_prompt_tokens,
                              max_new_tokens=g.max_new_tokens, eos_ids=[0], pad_id=0, mesh=a.mesh,
                              top_k=g.top_k if g.top_k >= 0 else 0)
    n_data = a.mesh.shape[sharding.DATA]
    rows = -(-a.options.step.shapes.num_rollouts // n_data) * n_data
    p = smp.bucket_for(g.max_prompt_tokens)
    key = jax.eval_shape(lambda: jax.random.key(0))
    key, f32 = _sds(key.shape, key.dtype, a.rep), _sds((), jnp.float32, a.rep)
    ids = _sds((rows, p), jnp.int32, a.data)
    prefill_args = (a.params, ids, ids, _sds((rows,), jnp.bool_, a.data), key, f32, f32, f32)

    def lower_decode():
        out = smp.prefill.lower(*prefill_args).out_info
        # the prefill's output state, rows over "data" (as the prefill's constraints place them)
        st = jax.tree.map(lambda o: _sds(o.shape, o.dtype, a.data if o.shape and o.shape[0] == rows else a.rep), out)
        return smp.decode.lower(a.params, st, key, f32, f32, f32)

    where = programs.mesh_shape(smp.mesh)
    return [Program("sampler_prefill", lambda: smp.prefill.lower(*prefill_args), f"{rows} rows x {p} prompt tokens",
                    program="sampler_prefill", mesh=where),
            Program("sampler_decode", lower_decode, f"while_loop of at most {g.max_new_tokens - 1} trips (counted as "
                    "that many)", max_trips=g.max_new_tokens - 1, program="sampler_decode", mesh=where)]


def lm_programs(a: AbstractRun) -> list[Program]:
    """The SFT step and loss (batch sft.batch_size x (prompt + completion) tokens, no shared prefix
    at batch 1), from ``train.lm_trainer.LMTrainer`` as the ``sft`` stage builds it."""
    bs, length = a.options.sft_batch_size, a.options.sft_length
    trainer = lm_trainer.LMTrainer(a.graphdef, a.cfg, a.optimizer, np.zeros((0,), np.int32), mesh=a.mesh,
                                   state_shardings=a.state_shardings)
    bsh = a.rows_sharding(bs)
    batch = {"tokens": _sds((bs, length), jnp.int32, bsh),
             "mask": _sds((bs, length), jnp.int32, bsh),
             "targets": _sds((bs, length), jnp.float32, bsh)}
    prefix = _sds((0,), jnp.int32, a.rep)
    where, note = programs.mesh_shape(trainer.mesh), f"batch {bs} x {length}"
    return [Program("sft_step", lambda: trainer.step_program.lower(a.state, prefix, batch), note, program="lm_step",
                    mesh=where),
            Program("sft_loss", lambda: trainer.loss_program.lower(a.params, prefix, batch), note, program="lm_loss",
                    mesh=where)]


def grpo_programs(a: AbstractRun) -> list[Program]:
    """The GRPO step (``train.grpo_step.make_train_step``) for every requested loss, in-run rollout
    sketches as configured (and flipped, for the FLOP ratio: ``compile.both_sketch_variants``), and
    the replay's zero-gradient step (``grpo_step.make_zero_gradient_step``) of the configured step."""
    gbatch = a.grpo_batch()
    n, t = gbatch["input_ids"].shape
    order = sketcher.hf_param_order(a.cfg)
    progs = []
    for spec in a.options.step_variants:  # CompileOptions' order: each loss, in-run on then off
        loss, on = spec.loss, spec.in_run_rollouts
        fn = grpo.make_train_step(a.graphdef, a.abstract_params, a.optimizer, spec, order=order, mesh=a.mesh,
                                  param_shardings=a.param_shardings, opt_shardings=a.state_shardings.opt_state)
        ref = a.params if spec.loss_spec.needs_reference else None
        progs.append(Program(f"grpo_step[{loss},in_run={'on' if on else 'off'}]",
                             (lambda fn=fn, ref=ref: fn.lower(a.params, a.state.opt_state, gbatch, ref)),
                             f"{n} rollouts x {t} tokens" + (f"; {step_path(spec)}" if on else ""),
                             program="grpo_step", mesh=programs.mesh_shape(a.mesh)))
    # the replay's exact shortcut of a zero-gradient step (counterfactual): the optimizer alone
    zero = grpo.make_zero_gradient_step(a.optimizer, a.options.step, mesh=a.mesh, param_shardings=a.param_shardings,
                                        opt_shardings=a.state_shardings.opt_state)
    progs.append(Program("grpo_zero_step", lambda: zero.lower(a.params, a.state.opt_state),
                         "optimizer update on zero gradients (replayed all-zero-advantage steps)",
                         program="grpo_zero_step", mesh=programs.mesh_shape(a.mesh)))
    return progs


def metagradient_programs(a: AbstractRun) -> list[Program]:
    """``metagradient_step`` and ``metagradient_step_vjp``: the :class:`train.metagradient.MetaStep`
    of ``train.metagradient.build_meta_step`` (the ``metagradient`` stage's constructor) for the
    configured loss and ``metagradient.advantages``' first mode: the forward is the program the
    stage steps with (the run's own weighted step, the fused one by default), the vjp that of the
    batched weighted step (in params, Adam moments and weights), each run once per replayed step;
    XLA's count covers the whole program."""
    from behaviortrace_jax.train import metagradient as mg_lib

    spec, mode = a.options.step, a.options.metagradient_mode
    gbatch = a.grpo_batch()
    batch = dict(gbatch, rewards=gbatch["advantages"]) if mode == "recomputed" else gbatch
    ref, ref_sh = (a.params, a.param_shardings) if spec.loss_spec.needs_reference else (None, None)
    # the stage's own constructor: forward = the run's step program where the run's update is the fused one
    meta = mg_lib.build_meta_step(a.options.optim, a.options.rollouts.adv_std_floor, a.graphdef, a.abstract_params,
                                  a.cfg, spec, a.mesh,
                                  (a.param_shardings, a.state_shardings.opt_state, {k: a.data for k in batch}, a.data,
                                   ref_sh, a.rep), a.state.opt_state, advantages=mode,
                                  remat=a.options.metagradient_remat)
    weights, opt = gbatch["advantages"], a.state.opt_state
    floats = mg_lib.opt_float_leaves(opt)
    note = f"{spec.shapes.num_rollouts} rollouts; advantages {mode}"
    where = programs.mesh_shape(a.mesh)
    return [Program("metagradient_step", lambda: meta.forward.lower(a.params, opt, batch, weights, ref), note,
                    program="metagradient_step", mesh=where),
            Program("metagradient_step_vjp", lambda: meta.backward.lower(a.params, opt, batch, weights, ref, a.params,
                                                                         floats),
                    note + "; held per step: params + Adam moments (the state) and their cotangents; "
                    f"remat per layer: {a.options.metagradient_remat or 'none'}",
                    program="metagradient_step_vjp", mesh=where)]


def sketcher_programs(a: AbstractRun) -> list[Program]:
    """The per-example sketcher of ``targets.ForcedSketcher.from_options`` on the run's mesh (as the
    ``sketch`` and ``draws`` stages build it) at the lengths of the checkpoint target sketches, the
    rollout re-sketches and the draws' sketches, and its masked mean log-prob program."""
    o, g = a.options, a.options.rollouts
    fs = targets.ForcedSketcher.from_options(o.forced, a.graphdef, a.cfg, a.abstract_params, pad_id=0, mesh=a.mesh)
    bucket = lambda x: -(-x // o.forced.length_bucket) * o.forced.length_bucket  # noqa: E731
    lengths = {"target_sketcher": bucket(g.max_prompt_tokens + o.ctx_max_new_tokens),
               "rollout_resketcher": bucket(g.max_prompt_tokens + g.max_new_tokens),
               "draws_sketcher": bucket(g.max_prompt_tokens + o.draws_max_new_tokens)}
    b, fsh = fs.block_size, fs.block_sharding() or a.rep  # the run's numpy blocks: the default device
    where = programs.mesh_shape(fs.sketcher.mesh)
    block = lambda length: {"input_ids": _sds((b, length), jnp.int32, fsh),  # noqa: E731
                            "attention_mask": _sds((b, length), jnp.int32, fsh),
                            "loss_mask": _sds((b, length), jnp.float32, fsh)}
    progs = [Program(name, (lambda fb=block(length): fs.sketcher.lower(a.params, fb)),
                     f"{b} sequences x {length}; {'fused' if fs.sketcher.fused else 'vmap(grad)'} sketcher, "
                     f"{b // fs.chunk_size} chunks", program="per_example_sketcher", mesh=where)
             for name, length in lengths.items()]
    lp = block(lengths["target_sketcher"])
    progs.append(Program("target_mean_logprob", lambda: fs.mean_logprob.lower(a.params, lp["input_ids"],
                                                                             lp["attention_mask"], lp["loss_mask"]),
                         f"lax.map of {b // fs.chunk_size} trips", program="forced_mean_logprob",
                         mesh=programs.mesh_shape(fs.sketcher.mesh)))
    return progs


# The programs of a run, in report order: each builder gives its rows of the report, for the stages
# that run those programs (compile.stages picks the builders).
PROGRAM_BUILDERS: tuple[tuple[Callable[[AbstractRun], list[Program]], frozenset[str]], ...] = (
    (sampler_programs, frozenset({"base", "sft", "grpo", "draws", "counterfactual"})),
    (lm_programs, frozenset({"base", "sft"})),
    (grpo_programs, frozenset({"grpo", "counterfactual"})),
    (metagradient_programs, frozenset({"metagradient"})),
    (sketcher_programs, frozenset({"sketch", "draws"})),
)
# What ``--config.stages=compile`` alone compiles: the stages of a paper run (configs/common.py's default).
PAPER_RUN_STAGES = ("sft", "grpo", "sketch", "draws")


def compiled_stages(compile_stages: str, run_stages: str, sweep_stages: str = "") -> set[str]:
    """The stages whose programs the compile stage compiles: ``compile_stages`` (``compile.stages``,
    comma-separated), or for "" the stages ``run_stages`` (``config.stages``) names besides
    ``compile`` (a sweep's ``sweep_stages`` included; the stage registry checks those names when the
    run starts), or :data:`PAPER_RUN_STAGES` when it names no other.

    Raises:
        ValueError: naming ``config.compile.stages`` and a stage in it that runs no program of
            :data:`PROGRAM_BUILDERS`.
    """
    split = lambda spec: [x.strip() for x in spec.split(",") if x.strip()]  # noqa: E731
    spec = str(compile_stages).strip()
    if spec:
        with_programs = set().union(*(stages for _, stages in PROGRAM_BUILDERS))
        bad = [x for x in split(spec) if x not in with_programs]
        if bad:
            raise ValueError(f"config.compile.stages={spec!r}: stage {bad[0]!r} runs no compiled program "
                             f"(stages with programs: {sorted(with_programs)})")
        return set(split(spec))
    names = split(str(run_stages))
    if "sweep" in names:
        names += split(str(sweep_stages))
    return (set(names) - {"compile", "sweep"}) or set(PAPER_RUN_STAGES)


def build_programs(options: CompileOptions, cfg: decoder.DecoderConfig, mesh) -> list[Program]:
    """Every jitted program that the stages of ``options.stages`` (:func:`compiled_stages`) run, at
    their real shapes on ``mesh``, from the run's own constructors (:data:`PROGRAM_BUILDERS`), less
    those ``options.programs`` (``compile.programs``: name prefixes; empty = all) leaves out."""
    run = AbstractRun.build(options, cfg, mesh)
    progs = [pr for builder, used_by in PROGRAM_BUILDERS if used_by & options.stages for pr in builder(run)]
    only = list(options.programs)
    return [pr for pr in progs if not only or any(pr.name.startswith(o) for o in only)]


def step_path(spec: grpo.GRPOStepSpec) -> str:
    """How the GRPO step of ``spec`` gets its update and in-run sketches, in words (the report's)."""
    if not spec.in_run_rollouts:
        return f"{spec.loss}, in-run rollout sketches off"
    how = ("fused sketcher: one backward for the update and the sketches" if spec.fused and spec.update_from_sketcher
           else "fused sketcher for the sketches + batched backward" if spec.fused
           else "one backward (summed per-rollout gradients)" if spec.update_from_sketcher
           else "batched backward + per-rollout vmap(grad)")
    hashing = f"{spec.sketch_hash.name} hash" + (f", Pallas kernel ({spec.sketch_kernel})" if spec.sketch_kernel != "xla"
                                                 and spec.fused else "")
    return f"{spec.loss}, in-run rollout sketches on, {how}, chunk {spec.chunk_size}, {hashing}"
