"""The stages' own config sections, typed: one frozen dataclass per section of ``configs/common.py`` that
no library option object covers, one field per key (its type that of the key's default).

``stages/spec.py`` reads them (``read_section``) into :class:`~behaviortrace_jax.stages.spec.RunSpec`
(``RunSpec.grpo``, ``RunSpec.sft``, ...) and re-exports them; a stage reads them there. Split from
``spec.py`` for length; it reads no config itself (``tests/test_config_boundary.py``).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GRPOKeys:
    """``config.grpo`` (SPEC §2.1; comments in configs/common.py)."""

    steps: int
    prompts_per_step: int
    group_size: int
    max_prompt_tokens: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    loss: str
    clip_eps: float
    kl_beta: float
    inner_iterations: int
    adv_std_floor: float
    continue_sft_moments: bool
    checkpoint_every: int
    log_shard_size: int
    on_nonfinite: str


@dataclasses.dataclass(frozen=True)
class SketchKeys:
    """``config.sketch`` (SPEC §3)."""

    dim: int
    seed: int
    hash: str
    kernel: str
    chunk_size: int
    fused: bool
    in_run_rollouts: bool
    in_run_tables: bool
    rollout_checkpoints: str
    rollout_scope: str


@dataclasses.dataclass(frozen=True)
class SFTKeys:
    """``config.sft`` (SPEC §1.7)."""

    steps: int
    batch_size: int
    data: str
    max_prompt_tokens: int
    max_completion_tokens: int
    lr: float
    append_eos: bool
    mixture_n_ordinary: int
    stop_every: int
    stop_min_probe_rate: float
    stop_max_control_rate: float
    eval_samples_per_prompt: int


@dataclasses.dataclass(frozen=True)
class BaseKeys:
    """``config.base`` (the tiny base model, TINY_CALIBRATION)."""

    seed: int
    corpus_size: int
    n_terms: int
    n_heldout: int
    vocab_size: int
    family: str
    preset: str
    num_layers: int
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int
    end_lr_fraction: float
    length_buckets: int
    append_eos: bool
    log_every: int
    eval_samples_per_prompt: int
    eval_max_new_tokens: int


@dataclasses.dataclass(frozen=True)
class DrawsKeys:
    """``config.draws`` (SPEC §5.6, §10.2)."""

    target_step: int
    group_size: int
    temperature: float
    top_p: float
    max_new_tokens: int
    n_repeats: int
    ckpt_seed: int
    gen_seed: int
    token_level_max: int
    save_sketches: bool


@dataclasses.dataclass(frozen=True)
class TargetsKeys:
    """``config.targets`` (SPEC §5)."""

    ctx_group_size: int
    ctx_temperature: float
    ctx_top_p: float
    ctx_max_new_tokens: int
    block_size: int
    length_bucket: int
    use_tables: bool


@dataclasses.dataclass(frozen=True)
class SweepKeys:
    """``config.sweep`` (SPEC §10.2)."""

    seeds: str
    diagnostic_draws: str
    stages: str


@dataclasses.dataclass(frozen=True)
class CompileKeys:
    """``config.compile`` (the ``compile`` stage)."""

    target: str
    model: str
    num_layers: int
    losses: str
    both_sketch_variants: bool
    stages: str
    programs: str


@dataclasses.dataclass(frozen=True)
class CounterfactualKeys:
    """``config.counterfactual`` (the ``counterfactual`` stage)."""

    k_fractions: str
    methods: str
    random_seeds: int
    lds_subsets: int
    lds_fractions: str
    lds_small_subsets: int
    measure: str
    sampled: int
    rates: bool
    recompute_advantages: bool
    topk_recomputed: bool
    intervention: str
    rollouts: str
    causal: str
    topk: bool
    causal_units: str
    causal_block_steps: int
    causal_streams: int
    causal_regenerated: str
    causal_k: float
    causal_interventions: str
    measures: str
    table_measures: str
    plans: str
    plan_subsets: int
    plan_rollouts: str


@dataclasses.dataclass(frozen=True)
class CauseKeys:
    """``config.cause`` (the ``cause`` stage: the causal gate)."""

    streams: int
    measures: str
    primary: str
    measure_step: str
    samples: int


@dataclasses.dataclass(frozen=True)
class MetagradientKeys:
    """``config.metagradient`` (the ``metagradient`` stage)."""

    advantages: str
    checkpoint_every: int
    remat: str


@dataclasses.dataclass(frozen=True)
class InfoKeys:
    """``config.info`` (the ``info`` stage)."""

    max_new_tokens: int
