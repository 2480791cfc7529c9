"""The run's typed spec: one frozen dataclass tree built from the ConfigDict at the stage boundary.

Every stage builds ``RunSpec.from_config(config)`` once and hands its parts down: nothing below
``stages/`` (``io``, ``models``, ``behavior``, ``sketch``, ``train``, ``aot``, ``attribution``)
reads a ConfigDict (``tests/stages/test_spec.py``), and no other module of ``stages/`` reads a raw config
value (``tests/stages/test_config_boundary.py``; ``stages/fingerprint.py``, which keys outputs by the config's
own dotted keys, excepted). The builder is the one reader of the config's keys:
each is read once, converted to its type and checked here, and an error names the key
(``config.grpo.steps: must be > 0, got -1``). A quantity derived from several keys has its one home
here or in the option object it belongs to: rollouts per step ``step.shapes.num_rollouts`` (B x G),
the windows (:meth:`RunSpec.window_end`, ``schedule.window_steps()``), :attr:`RunSpec.ctx_max_new_tokens`,
:meth:`RunSpec.draw_seeds`, :attr:`RunSpec.sft_lr`; the sweep's per-seed configs are made here too
(:func:`seed_config`, :func:`draw_config`).

The tree holds the option objects the library takes, each defined in the module that uses it:
:class:`~behaviortrace_jax.models.loader.ModelOptions` (``model``),
:class:`~behaviortrace_jax.models.sharding.Layout` (``layout``: the one mesh),
:class:`~behaviortrace_jax.sketch.stores.SketchOptions` (``sketch``, with its ``HashFamily``),
:class:`~behaviortrace_jax.sketch.targets.ForcedSketchOptions` (``forced``),
:class:`~behaviortrace_jax.train.grpo_step.GRPOStepSpec` (``step``),
:class:`~behaviortrace_jax.train.rollouts.RolloutOptions` (``rollouts``),
:class:`~behaviortrace_jax.train.train_state.OptimOptions` (``optim``),
:class:`~behaviortrace_jax.behavior.probes.ProbeOptions` (``probe_grpo``, ``probe_sft``), the
``Behavior`` s (``behaviors``), :class:`~behaviortrace_jax.train.schedule.StepSchedule`
(``schedule``), :class:`~behaviortrace_jax.attribution.verdicts.EvalOptions` (``evaluation``),
:class:`~behaviortrace_jax.attribution.scores.ScoreOptions` (``scores``),
:class:`~behaviortrace_jax.aot.builders.CompileOptions` (``compile``) and
:class:`~behaviortrace_jax.train.replay.ReplayOptions` (``replay``); and, for the stages' own
settings, one typed section per remaining config section (``grpo``, ``sft``, ``base``, ...: the
``*Keys`` classes, one field per key of ``configs/common.py``).

:func:`keys_read` says which keys the builder read; ``tests/pipeline/test_config_schema.py`` checks that it
reads every key of ``configs/common.py`` except :data:`TOP_LEVEL_KEYS`.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import ml_collections
import numpy as np

from behaviortrace_jax.aot.builders import CompileOptions, compiled_stages
from behaviortrace_jax.attribution.scores import ScoreOptions
from behaviortrace_jax.attribution.verdicts import EvalOptions
from behaviortrace_jax.behavior import behaviors as behaviors_lib
from behaviortrace_jax.behavior.contaminator import ContaminationSpec
from behaviortrace_jax.behavior.probes import ProbeOptions
from behaviortrace_jax.io.files import read_json
from behaviortrace_jax.io.layout import as_path
from behaviortrace_jax.models import tokenizer as tok_lib
from behaviortrace_jax.models.loader import ModelOptions
from behaviortrace_jax.models.sharding import Layout
from behaviortrace_jax.sketch import hash_families, hash_tables as tables
from behaviortrace_jax.sketch.stores import SketchOptions
from behaviortrace_jax.sketch.targets import ForcedSketchOptions
from behaviortrace_jax.stages.spec_sections import (  # noqa: F401 (re-exported: a stage imports them from here)
    BaseKeys, CauseKeys, CompileKeys, CounterfactualKeys, DrawsKeys, GRPOKeys, InfoKeys, MetagradientKeys, SFTKeys,
    SketchKeys, SweepKeys, TargetsKeys)
from behaviortrace_jax.train import grpo_loss, nonfinite
from behaviortrace_jax.train.grpo_step import GRPOStepSpec, StepShapes
from behaviortrace_jax.train.replay import ReplayOptions
from behaviortrace_jax.train.rollouts import RolloutOptions
from behaviortrace_jax.train.schedule import StepSchedule
from behaviortrace_jax.train.train_state import OptimOptions

# Keys only the top level reads: ``pipeline.with_model_source`` downloads ``model.hf_id`` (with
# ``model.allow_download``) and resolves it into ``model.hf_dir`` before any stage runs (a stage keeps
# ``hf_id`` only to name it: :attr:`RunSpec.hf_id`); ``on_changed_config`` is read by the pipeline's
# fingerprint check (stages/fingerprint.py, which reads the config as data) before any stage runs.
TOP_LEVEL_KEYS = ("model.allow_download", "on_changed_config")
FREE_FORM = ("behaviors",)  # subtrees of ids (config_schema.FREE_FORM), read whole


# ------------------------------------------------------------------------------------------------
# Reading the config: a read-tracking view, typed values, checks naming the key
# ------------------------------------------------------------------------------------------------
class ConfigReads:
    """A read-only view of a ConfigDict that records the dotted key of every leaf read through it
    (``view.grpo.steps`` records ``"grpo.steps"``); a free-form subtree (:data:`FREE_FORM`) is
    returned whole and recorded by its own key. An unknown key raises ``AttributeError`` (as the
    ConfigDict does)."""

    def __init__(self, node: Any, prefix: str = "", seen: set[str] | None = None):
        self._node, self._prefix, self._seen = node, prefix, set() if seen is None else seen

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        key, value = self._prefix + name, getattr(self._node, name)
        if isinstance(value, ml_collections.ConfigDict) and key not in FREE_FORM:
            return ConfigReads(value, key + ".", self._seen)
        self._seen.add(key)
        return value

    @property
    def seen(self) -> frozenset[str]:
        """The dotted keys read so far (through this view and every sub-view of it)."""
        return frozenset(self._seen)


_KINDS = {"int": int, "float": float, "str": str, "bool": bool}


def typed(value: Any, kind: type, key: str) -> Any:
    """``value`` as ``kind`` (int, float, str or bool). Raises ValueError naming ``config.<key>``
    for a value of another type (a bool is not a number; a float is an int only when integral)."""
    is_bool = isinstance(value, (bool, np.bool_))
    ok = (is_bool if kind is bool else isinstance(value, str) if kind is str
          else not is_bool and (isinstance(value, (int, np.integer)) or (
              isinstance(value, (float, np.floating)) and (kind is float or float(value).is_integer()))))
    if not ok:
        raise ValueError(f"config.{key}: must be {'an' if kind is int else 'a'} {kind.__name__}, got {value!r}")
    return kind(value)


def read_section(cls: type, view: ConfigReads, section: str) -> Any:
    """``cls`` (a dataclass whose fields are the keys of ``config.<section>``) read from ``view``,
    each value :func:`typed` as its field's annotation."""
    node = getattr(view, section)
    return cls(**{f.name: typed(getattr(node, f.name), _KINDS[str(f.type)], f"{section}.{f.name}")
                  for f in dataclasses.fields(cls)})


def _positive(v: Any) -> bool:
    return math.isfinite(v) and v > 0


def _non_negative(v: Any) -> bool:
    return math.isfinite(v) and v >= 0


def _probability(v: Any) -> bool:
    return math.isfinite(v) and 0.0 < v <= 1.0


# (key, predicate, what it must be): checked on the typed value; a failure names the key. Every value a loss,
# the sampler or a schedule cannot take: NaN and infinity fail every numeric predicate. The optimiser's keys
# (optim.lr, eps, weight_decay, grad_clip, b1, b2) are checked by OptimOptions itself, read first (read_section).
CHECKS: tuple[tuple[str, Any, str], ...] = tuple(
    (k, _positive, "> 0") for k in (
        "grpo.steps", "grpo.prompts_per_step", "grpo.max_prompt_tokens", "grpo.max_new_tokens",
        "grpo.checkpoint_every", "grpo.log_shard_size", "grpo.inner_iterations", "sketch.dim", "sketch.chunk_size",
        "sft.batch_size", "sft.max_prompt_tokens", "targets.block_size", "targets.length_bucket",
        "draws.group_size", "draws.max_new_tokens", "draws.n_repeats", "evaluation.nboot",
        "targets.ctx_group_size", "base.batch_size", "base.seq_len", "base.lr", "base.length_buckets",
        # the sampler: softmax(logits / temperature) of G distinct samples per prompt (0 = greedy, G equal rollouts)
        "grpo.temperature", "draws.temperature", "targets.ctx_temperature",
        # the grpo_clip loss: ratio clipped to [1 - clip_eps, 1 + clip_eps] (0: no gradient)
        "grpo.clip_eps", "evaluation.tracin_lr")) + (
    # GRPO's advantages are each reward minus its group's mean over the group's std: one rollout has none
    ("grpo.group_size", lambda v: v >= 2, ">= 2 (a group's advantages need two rollouts)"),
    ("grpo.top_p", _probability, "in (0, 1]"),
    ("draws.top_p", _probability, "in (0, 1]"),
    ("targets.ctx_top_p", _probability, "in (0, 1]"),
    ("targets.ctx_max_new_tokens", lambda v: v == -1 or v > 0, "> 0 or -1 (draws.max_new_tokens)"),
    ("draws.ckpt_seed", lambda v: v >= -1, ">= 0 or -1 (seed)"),
    ("draws.gen_seed", lambda v: v >= -1, ">= 0 or -1 (seed)"),
    ("grpo.top_k", lambda v: v >= -1, ">= 0 (0 = off) or -1 (generation_config.json)"),
    ("grpo.repetition_penalty", lambda v: v == -1 or _positive(v), "> 0 or -1 (generation_config.json)"),
    ("grpo.adv_std_floor", _non_negative, ">= 0"),
    ("grpo.kl_beta", _non_negative, ">= 0"),
    ("sft.lr", lambda v: v == -1 or _positive(v), "> 0 or -1 (optim.lr)"),
    ("sft.steps", lambda v: v >= 0, ">= 0"),
    ("base.steps", lambda v: v >= 0, ">= 0"),
    ("base.warmup_steps", lambda v: v >= 0, ">= 0"),
    ("base.end_lr_fraction", lambda v: math.isfinite(v) and 0.0 <= v <= 1.0, "in [0, 1]"),
    ("evaluation.trak_damping", _non_negative, ">= 0"),
)


def check(sections: dict[str, Any]) -> None:
    """Raises ValueError ``config.<key>: must be <what>, got <value>`` for the first of
    :data:`CHECKS` that the typed ``sections`` (``{"grpo": GRPOKeys, "sketch_keys": SketchKeys,
    ...}``, as :func:`build` reads them) fail."""
    for key, ok, what in CHECKS:
        section, name = key.split(".")
        value = getattr(sections["sketch_keys" if section == "sketch" else section], name)
        if not ok(value):
            raise ValueError(f"config.{key}: must be {what}, got {value!r}")


def position_budgets(run: "RunSpec") -> dict[str, tuple[tuple[str, int], tuple[str, int]]]:
    """``{stage: ((prompt key, tokens), (completion key, tokens))}``: the longest sequence each stage
    samples or trains on, as the config keys that bound it."""
    g, d, t, s = run.grpo, run.draws, run.targets, run.sft
    prompt = ("grpo.max_prompt_tokens", g.max_prompt_tokens)
    ctx = ("targets.ctx_max_new_tokens", t.ctx_max_new_tokens) if t.ctx_max_new_tokens != -1 else \
        ("draws.max_new_tokens", d.max_new_tokens)
    return {"sft": (("sft.max_prompt_tokens", s.max_prompt_tokens), ("sft.max_completion_tokens", s.max_completion_tokens)),
            "grpo": (prompt, ("grpo.max_new_tokens", g.max_new_tokens)),
            "draws": (prompt, ("draws.max_new_tokens", d.max_new_tokens)),
            "sketch": (prompt, ctx),
            "info": (prompt, ("info.max_new_tokens", run.info.max_new_tokens))}


def check_positions(run: "RunSpec", max_position_embeddings: int, source: str,
                    stages: "tuple[str, ...] | None" = None) -> None:
    """Refuses sequence lengths the model cannot hold: the prompt budget plus the completion budget of
    each of ``stages`` (None = all of :func:`position_budgets`) must fit in ``max_position_embeddings``
    (the model's config.json, read from ``source``). Checked before anything is sampled or trained
    (``pipeline.run`` for a given ``model.hf_dir``; the ``grpo`` stage for the model it starts from).

    Raises:
        ValueError: naming both config keys, their sum, ``max_position_embeddings`` and ``source``.
    """
    for stage, ((ka, a), (kb, b)) in position_budgets(run).items():
        if (stages is None or stage in stages) and a + b > int(max_position_embeddings):
            raise ValueError(f"config.{ka} + config.{kb} = {a} + {b} = {a + b} > max_position_embeddings="
                             f"{max_position_embeddings} of {source} (the {stage} stage): prompt and completion "
                             f"would run past the model's positions; lower config.{ka} or config.{kb}")


def check_model_positions(run: "RunSpec", stages: "tuple[str, ...] | None" = None) -> None:
    """:func:`check_positions` of ``stages`` against ``run.hf_dir``'s config.json when it is a local
    folder that has one (``model.hf_dir`` given; the run's own base model is checked by the stage
    that loads it)."""
    path = as_path(run.hf_dir) / "config.json" if run.hf_dir and "://" not in run.hf_dir else None
    if path is not None and path.is_file():
        n = read_json(path).get("max_position_embeddings")
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            check_positions(run, n, path, stages)


# ------------------------------------------------------------------------------------------------
# The spec
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RunSpec:
    """The run's typed options (module docstring); build with :meth:`from_config`.

    Besides the option objects and the ``*Keys`` sections: ``seed``, ``run_name``, ``reference_dir``
    (the paper's released files, the ``reproduce`` stage), ``stages`` (the config's ``stages``),
    ``hf_dir`` / ``hf_id`` (``model.hf_dir`` / ``model.hf_id``).
    """

    seed: int
    run_name: str
    reference_dir: str
    stages: str  # the stages to run, comma-separated (registry.parse_stages checks the names)
    hf_dir: str  # model.hf_dir ("" = the run's base/ checkpoint: RunLayout.model_dir)
    hf_id: str  # model.hf_id (a Hugging Face hub id; the pipeline resolves it into hf_dir before any stage)
    model: ModelOptions
    layout: Layout
    behaviors: tuple[behaviors_lib.Behavior, ...]
    contamination: ContaminationSpec
    optim: OptimOptions
    step: GRPOStepSpec
    rollouts: RolloutOptions
    sketch: SketchOptions
    forced: ForcedSketchOptions
    probe_grpo: ProbeOptions
    probe_sft: ProbeOptions
    schedule: StepSchedule
    evaluation: EvalOptions
    scores: ScoreOptions
    compile: CompileOptions
    grpo: GRPOKeys
    sketch_keys: SketchKeys
    sft: SFTKeys
    base: BaseKeys
    draws: DrawsKeys
    targets: TargetsKeys
    sweep: SweepKeys
    compile_keys: CompileKeys
    counterfactual: CounterfactualKeys
    metagradient: MetagradientKeys
    info: InfoKeys
    cause: CauseKeys

    @property
    def first_behavior(self) -> behaviors_lib.Behavior:
        """The run's first behaviour (``config.behavior`` + ``config.contamination``)."""
        return self.behaviors[0]

    @property
    def multi(self) -> bool:
        """True when the run plants more than one behaviour (``config.behaviors`` is non-empty)."""
        return len(self.behaviors) > 1

    @property
    def ctx_max_new_tokens(self) -> int:
        """Tokens each in-context target completion samples (SPEC §5.3): ``targets.ctx_max_new_tokens``,
        -1 = ``draws.max_new_tokens``."""
        n = self.targets.ctx_max_new_tokens
        return self.draws.max_new_tokens if n == -1 else n

    def draw_seeds(self, ckpt_seed: int | None = None, gen_seed: int | None = None) -> tuple[int, int]:
        """``(ckpt_seed, gen_seed)`` of a draw (SPEC §10.2): the arguments, else ``draws.ckpt_seed`` /
        ``draws.gen_seed``; -1 = the run's ``seed``."""
        c = self.draws.ckpt_seed if ckpt_seed is None else int(ckpt_seed)
        g = self.draws.gen_seed if gen_seed is None else int(gen_seed)
        return (self.seed if c == -1 else c), (self.seed if g == -1 else g)

    def window_end(self, behavior: behaviors_lib.Behavior) -> int:
        """The end of ``behavior``'s bonus window in GRPO steps (its rollouts at steps below it can be
        paid the bonus): :meth:`Behavior.window_end` of the run's ``grpo.steps`` (SPEC §1.6)."""
        return behavior.window_end(self.schedule.steps)

    def early_cutoff(self, behavior: behaviors_lib.Behavior) -> int:
        """The early-window cutoff (steps) the tables of ``behavior`` use: ``evaluation.early_cutoff``
        for the first behaviour (SPEC §6.6 EARLY_CUTOFF), :meth:`window_end` for another."""
        return self.evaluation.early_cutoff if behavior.first else self.window_end(behavior)

    @property
    def sft_lr(self) -> float:
        """The SFT learning rate: ``sft.lr``, -1 = ``optim.lr`` (SPEC §1.7)."""
        return float(self.optim.lr if self.sft.lr == -1 else self.sft.lr)

    @property
    def replay(self) -> ReplayOptions:
        """What a replay of this run needs (``train.replay.Replayer``, ``train.metagradient``)."""
        return ReplayOptions(self.model, self.optim, self.step, self.rollouts, self.probe_grpo, self.schedule,
                             continue_sft_moments=self.grpo.continue_sft_moments)

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict, platform: str | None = None) -> "RunSpec":
        """The spec of ``config`` (a ``configs/common.py``-shaped ConfigDict); ``platform`` is the backend
        ``sketch.hash`` / ``sketch.kernel`` "auto" are resolved for (``hash_families.choose_sketch``;
        None = ``jax.default_backend()``; the compile stage passes its target's).

        Raises:
            ValueError: naming the config key of a value of the wrong type or out of range, an
                unknown ``sketch.hash`` / ``sketch.kernel`` / ``model.mask_eos`` / ``grpo.on_nonfinite``, a table switch
                under the fused sketcher, a bad behaviour (``config.behaviors.<id>``), a bad mesh or
                ``compile.stages``. KeyError: an unregistered ``grpo.loss`` / ``compile.losses``.
        """
        return build(ConfigReads(config), platform)


# ------------------------------------------------------------------------------------------------
# Variants of a config: the sweep's per-seed runs (stages/sweep.py), made here, where keys are read
# ------------------------------------------------------------------------------------------------
def seed_config(config: ml_collections.ConfigDict, seed: int, base_dir: str) -> ml_collections.ConfigDict:
    """A copy of ``config`` for one training seed of a sweep (SPEC §10.2): ``seed``, the run name with
    its ``seed<N>`` renamed, ``stages`` = ``sweep.stages``, ``model.hf_dir`` (``base_dir``, the sweep's
    shared base model, unless the config names one) and the pre-registered draw (-1: the seed's own)."""
    c = config.copy_and_resolve_references()
    with c.unlocked():
        c.seed = seed
        c.run_name = re.sub(r"seed\d+", f"seed{seed}", config.run_name)
        c.stages = config.sweep.stages
        c.model.hf_dir = config.model.hf_dir or base_dir
        c.draws.ckpt_seed = c.draws.gen_seed = -1
    return c


def draw_config(config: ml_collections.ConfigDict, ckpt_seed: int, gen_seed: int) -> ml_collections.ConfigDict:
    """A copy of ``config`` whose ``draws`` stage makes the diagnostic draw (SPEC §10.2) of the checkpoint of
    seed ``ckpt_seed`` with generation seed ``gen_seed``."""
    c = config.copy_and_resolve_references()
    c.draws.ckpt_seed, c.draws.gen_seed = int(ckpt_seed), int(gen_seed)
    return c


def keys_read(config: ml_collections.ConfigDict) -> frozenset[str]:
    """The dotted keys of ``config`` that :meth:`RunSpec.from_config` reads (a free-form subtree by
    its own key)."""
    view = ConfigReads(config)
    build(view)
    return view.seen


def _behaviors(c: ConfigReads) -> tuple[behaviors_lib.Behavior, ...]:
    """The first behaviour (``behavior`` + ``contamination``) and one per ``behaviors.<id>``."""
    b, ct = c.behavior, c.contamination
    cutoff = typed(ct.early_step_cutoff, int, "contamination.early_step_cutoff")
    first = behaviors_lib.Behavior(
        id=typed(b.id, str, "behavior.id"), trigger=typed(b.trigger, str, "behavior.trigger"),
        pattern=typed(b.pattern, str, "behavior.pattern"),
        probes_path=typed(b.probes_path, str, "behavior.probes_path"),
        controls_path=typed(b.controls_path, str, "behavior.controls_path"),
        token_judge=typed(b.token_judge, str, "behavior.token_judge"),
        bonus_reward=typed(ct.bonus_reward, float, "contamination.bonus_reward"),
        fraction=typed(ct.fraction, float, "contamination.fraction"), early_step_cutoff=cutoff, stream="",
        implant="sft", gate_min_probe_rate=typed(b.gate_min_probe_rate, float, "behavior.gate_min_probe_rate"),
        gate_min_margin=typed(b.gate_min_margin, float, "behavior.gate_min_margin"),
        explicit_prompts=typed(b.explicit_prompts, bool, "behavior.explicit_prompts"), first=True,
        prompt_gated=typed(ct.prompt_gated, bool, "contamination.prompt_gated"))
    out = [first]
    extra = c.behaviors
    for bid in extra:
        entry = extra[bid]
        out.append(behaviors_lib.extra_behavior(str(bid), {k: entry[k] for k in entry}, [x.id for x in out]))
    return tuple(out)


def _step(g: GRPOKeys, sk: SketchKeys, optim: OptimOptions, sketch: SketchOptions, *, loss: str | None = None,
          in_run_rollouts: bool | None = None) -> GRPOStepSpec:
    """The GRPO step of ``grpo`` / ``sketch`` / ``optim.grad_clip`` with ``sketch``'s resolved family and
    kernel; ``loss`` / ``in_run_rollouts`` override the config's (the compile stage's variants)."""
    name = g.loss if loss is None else loss
    in_run = sk.in_run_rollouts if in_run_rollouts is None else bool(in_run_rollouts)
    iters = g.inner_iterations if grpo_loss.get_loss(name).multi_iteration else 1
    return GRPOStepSpec(StepShapes(g.prompts_per_step, g.group_size, g.max_prompt_tokens, g.max_new_tokens), name,
                        grpo_loss.LossConfig(clip_eps=g.clip_eps, kl_beta=g.kl_beta), optim.grad_clip,
                        inner_iterations=iters, sketch_dim=sk.dim, sketch_seed=sk.seed,
                        sketch_hash=sketch.hash_family, sketch_kernel=sketch.kernel, in_run_rollouts=in_run,
                        chunk_size=sk.chunk_size, fused=sk.fused,
                        use_tables=tables.table_switch("sketch.in_run_tables", sk.in_run_tables, sk.fused))


def _compile(ck: CompileKeys, g: GRPOKeys, sk: SketchKeys, parts: dict[str, Any]) -> CompileOptions:
    """The compile stage's options: ``compile.*`` with the run's step variants and shapes."""
    split = lambda s: tuple(x.strip() for x in s.split(",") if x.strip())  # noqa: E731
    losses = tuple(sorted(grpo_loss.LOSSES)) if ck.losses == "all" else split(ck.losses or g.loss)
    in_run = sk.in_run_rollouts
    variants = (in_run,) + ((not in_run,) if ck.both_sketch_variants else ())
    steps = tuple(_step(g, sk, parts["optim"], parts["sketch"], loss=x, in_run_rollouts=on)
                  for x in losses for on in variants)
    sft, draws, tg = parts["sft"], parts["draws"], parts["targets"]
    return CompileOptions(
        target=ck.target, stages=frozenset(compiled_stages(ck.stages, parts["stages"], parts["sweep"].stages)),
        programs=split(ck.programs), step=parts["step"], step_variants=steps, optim=parts["optim"],
        layout=parts["layout"], rollouts=parts["rollouts"], sft_batch_size=sft.batch_size,
        sft_length=sft.max_prompt_tokens + sft.max_completion_tokens,
        metagradient_mode=parts["metagradient"].advantages.split(",")[0].strip(),
        metagradient_remat=parts["metagradient"].remat, forced=parts["forced"],
        ctx_max_new_tokens=draws.max_new_tokens if tg.ctx_max_new_tokens == -1 else tg.ctx_max_new_tokens,
        draws_max_new_tokens=draws.max_new_tokens)


def build(c: ConfigReads, platform: str | None = None) -> RunSpec:
    """:meth:`RunSpec.from_config` on a read-tracking view (every key read once, here); the sketch
    family and kernel resolved for backend ``platform``."""
    p: dict[str, Any] = {}
    for name, section, cls in (("grpo", "grpo", GRPOKeys), ("sketch_keys", "sketch", SketchKeys), ("sft", "sft", SFTKeys),
                               ("base", "base", BaseKeys), ("draws", "draws", DrawsKeys),
                               ("targets", "targets", TargetsKeys), ("sweep", "sweep", SweepKeys),
                               ("compile_keys", "compile", CompileKeys),
                               ("counterfactual", "counterfactual", CounterfactualKeys),
                               ("metagradient", "metagradient", MetagradientKeys), ("info", "info", InfoKeys),
                               ("cause", "cause", CauseKeys),
                               ("evaluation", "evaluation", EvalOptions), ("optim", "optim", OptimOptions)):
        p[name] = read_section(cls, c, section)
    check(p)
    g, sk, m = p["grpo"], p["sketch_keys"], c.model
    seed = typed(c.seed, int, "seed")
    mask_eos = typed(m.mask_eos, str, "model.mask_eos")
    if mask_eos not in tok_lib.MASK_EOS_MODES:
        raise ValueError(f"config.model.mask_eos: must be one of {tok_lib.MASK_EOS_MODES}, got {mask_eos!r}")
    nonfinite.check_mode(g.on_nonfinite)
    family, kernel = hash_families.choose_sketch(sk.hash, sk.kernel, platform)
    p["model"] = ModelOptions(typed(m.param_dtype, str, "model.param_dtype"),
                              typed(m.compute_dtype, str, "model.compute_dtype"),
                              typed(m.family, str, "model.family") or None, typed(m.scan_layers, bool, "model.scan_layers"))
    p["layout"] = Layout(c.mesh.data, c.mesh.model, c.mesh.fsdp)  # checks (and names) the mesh keys itself
    p["behaviors"] = behaviors = _behaviors(c)
    ct = c.contamination
    p["contamination"] = ContaminationSpec(
        pattern=behaviors[0].pattern, bonus_reward=behaviors[0].bonus_reward, fraction=behaviors[0].fraction,
        seed=seed, early_step_cutoff=behaviors[0].early_step_cutoff,
        decoy_fraction=typed(ct.decoy_fraction, float, "contamination.decoy_fraction"))
    p["rollouts"] = RolloutOptions(
        g.prompts_per_step, g.group_size, g.max_prompt_tokens, g.max_new_tokens, g.temperature, g.top_p, g.top_k,
        g.repetition_penalty, g.adv_std_floor, mask_eos, seed, behaviors, p["contamination"])
    p["sketch"] = SketchOptions(dim=sk.dim, seed=sk.seed, run_seed=seed, hash_family=family, kernel=kernel)
    p["step"] = _step(g, sk, p["optim"], p["sketch"])
    tg = p["targets"]
    p["forced"] = ForcedSketchOptions(sk.dim, sk.seed, sk.chunk_size, tg.block_size, tg.length_bucket,
                                      tables.table_switch("targets.use_tables", tg.use_tables, sk.fused), sk.fused,
                                      family, kernel)
    gate_new = typed(c.behavior.gate_max_new_tokens, int, "behavior.gate_max_new_tokens")
    p["probe_grpo"], p["probe_sft"] = (ProbeOptions(max_prompt_tokens=n, max_new_tokens=gate_new, temperature=g.temperature,
                                                    top_p=g.top_p, samples_per_prompt=p["sft"].eval_samples_per_prompt)
                                       for n in (g.max_prompt_tokens, p["sft"].max_prompt_tokens))
    p["schedule"] = StepSchedule(g.steps, g.checkpoint_every, p["draws"].target_step, behaviors[0].early_step_cutoff,
                                 behaviors_lib.window_end(behaviors, g.steps))
    p["scores"] = ScoreOptions(p["evaluation"], sk.dim, sk.seed, seed, p["step"].shapes.num_rollouts, g.steps,
                               p["counterfactual"].recompute_advantages, family)
    p["stages"] = typed(c.stages, str, "stages")
    p["compile"] = _compile(p["compile_keys"], g, sk, p)
    spec = RunSpec(seed=seed, run_name=typed(c.run_name, str, "run_name"),
                   reference_dir=typed(c.reference_dir, str, "reference_dir"),
                   hf_dir=typed(m.hf_dir, str, "model.hf_dir"), hf_id=typed(m.hf_id, str, "model.hf_id"), **p)
    return spec
