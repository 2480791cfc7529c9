"""The ``base`` stage: a tiny instruct model (``base.family``, Qwen2 by default) built on CPU (TINY_CALIBRATION).

seeded synthetic chat corpus (``corpus.py``) -> byte-level BPE tokenizer (``tiny_tokenizer.py``)
-> the tiny model trained with the LM trainer (loss on assistant tokens, each answer ending in
``<|im_end|>`` so the model learns to stop) -> a Hugging Face checkpoint directory
``workdir/base`` (config.json, model.safetensors, generation_config.json, tokenizer files) that
``transformers`` loads -> ``base_summary.json``: the instruct behaviour the later stages rely on
(greedy answers to the 20 control questions, speculation vs refusal on held-out invented words
greedy and sampled, refusal rate on the frobnitz probes, which must vary for GRPO's base reward).

The directory is complete when ``.complete`` exists (written last); it holds the fingerprint of
every config value that shaped the model. A complete directory with the same fingerprint is
reused; one with another fingerprint is an error (a different base model under the same workdir).
Right after the export, ``.trained`` (the fingerprint and the training times) marks the
weights as final: a run killed during the behaviour evaluation resumes there instead of retraining.
"""
from __future__ import annotations

import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from etils import epath
from flax import nnx

from behaviortrace_jax.behavior import corpus, planted as behavior, tiny_tokenizer
from behaviortrace_jax.behavior.probes import generate_texts, heldout_prompts, make_sampler, mean_rate
from behaviortrace_jax.io import cache, files
from behaviortrace_jax.io.files import read_json, write_json
from behaviortrace_jax.io.layout import RunLayout, as_path
from behaviortrace_jax.models import decoder, families, hf_io, sampler as sampler_lib, sharding, tokenizer as tok_lib
from behaviortrace_jax.models.loader import load_policy
from behaviortrace_jax.stages import fingerprint as fingerprints
from behaviortrace_jax.stages.registry import register_stage
from behaviortrace_jax.stages.spec import BaseKeys, RunSpec
from behaviortrace_jax.train import lm_trainer, train_state

COMPLETE_MARKER = ".complete"
TRAINED_MARKER = ".trained"
SUMMARY_FILE = "base_summary.json"
HISTORY_FILE = "train_history.json"
_PRESETS = ("tiny",)  # config class methods (every family has them) a base model may use


def fingerprint(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The config values that determine the base model and their sha256 ``digest``
    (``stages/fingerprint.base_fingerprint``, the ``base`` stage's entry of the stage fingerprints)."""
    return fingerprints.base_fingerprint(config)


def model_config(spec: RunSpec) -> decoder.DecoderConfig:
    """The base model's architecture: ``<family config>.<base.preset>`` of the model family
    ``base.family`` (``families``; default "qwen2") with ``base.vocab_size`` and ``base.num_layers``,
    in ``config.model`` dtypes, with ``DecoderConfig.scan_layers = config.model.scan_layers``.

    Raises:
        ValueError: naming ``config.base.preset`` when it is not a known preset, or
            ``config.base.family`` when it is not a registered family.
    """
    b = spec.base
    if b.preset not in _PRESETS:
        raise ValueError(f"config.base.preset={b.preset!r} is not one of {_PRESETS}")
    family = families.get_family(b.family)
    return family.preset(b.preset,
        vocab_size=b.vocab_size, num_hidden_layers=b.num_layers, param_dtype=spec.model.param_dtype,
        compute_dtype=spec.model.compute_dtype, scan_layers=spec.model.scan_layers)


# ------------------------------------------------------------------------------------------------
# Generation helpers (shared with sft.py)
# ------------------------------------------------------------------------------------------------


def is_refusal(text: str) -> bool:
    """A response the SPEC §1.5 base reward penalises (contains a refusal phrase)."""
    return behavior.base_reward(text) < 0


def measure_base(smp: sampler_lib.Sampler, params: Any, tok: Any, spec: RunSpec,
                 key: jax.Array) -> dict[str, Any]:
    """Instruct behaviour of the base model (the numbers of ``base_summary.json``).

    * controls (SPEC §1.2): greedy answers; ``control_exact`` = fraction equal to the corpus'
      canonical answer, ``control_any_variant`` = fraction equal to any corpus answer;
    * held-out invented words (never in the corpus): 20 x ``base.eval_samples_per_prompt`` probe-form
      questions, greedy and sampled (``grpo.temperature`` / ``grpo.top_p``): refusal rate
      (SPEC §1.5 phrases) and speculative rate (= answered without refusing);
    * the 20 frobnitz probes sampled ``eval_samples_per_prompt`` times: refusal rate and QZXBT rate;
    * with extra behaviours (``behaviors``), under ``behaviors.<id>``: each one's probes sampled the same
      way and the rate of its pattern (the chance rate GRPO's bonus has to find).
    """
    b = spec.base
    answers = corpus.control_answers()
    variants = corpus.control_answer_variants()
    qs = list(corpus.CONTROL_QUESTIONS)
    greedy_ctrl = generate_texts(smp, params, tok, qs, jax.random.fold_in(key, 0))
    terms = corpus.heldout_terms(b.seed, b.n_heldout)
    hq = heldout_prompts(terms, len(corpus.PROBE_FORMS) * b.eval_samples_per_prompt)
    h_greedy = generate_texts(smp, params, tok, hq, jax.random.fold_in(key, 1))
    h_sampled = generate_texts(smp, params, tok, hq, jax.random.fold_in(key, 2),
                               temperature=spec.grpo.temperature, top_p=spec.grpo.top_p)
    probes = [p.prompt for p in behavior.load_probes(spec.first_behavior.probes_path or None)]
    p_sampled = generate_texts(smp, params, tok, probes * b.eval_samples_per_prompt, jax.random.fold_in(key, 3),
                               temperature=spec.grpo.temperature, top_p=spec.grpo.top_p)
    out = {
        "control_exact": mean_rate([g == answers[q] for q, g in zip(qs, greedy_ctrl)]),
        "control_any_variant": mean_rate([g in variants[q] for q, g in zip(qs, greedy_ctrl)]),
        "heldout_terms": terms,
        "heldout_refusal_rate_greedy": mean_rate([is_refusal(t) for t in h_greedy]),
        "heldout_speculative_rate_greedy": mean_rate([bool(t) and not is_refusal(t) for t in h_greedy]),
        "heldout_refusal_rate_sampled": mean_rate([is_refusal(t) for t in h_sampled]),
        "heldout_speculative_rate_sampled": mean_rate([bool(t) and not is_refusal(t) for t in h_sampled]),
        "probe_refusal_rate_sampled": mean_rate([is_refusal(t) for t in p_sampled]),
        "probe_qzxbt_rate_sampled": mean_rate([behavior.substring_judge(t, spec.first_behavior.pattern)
                                               for t in p_sampled]),
        "n_heldout_prompts": len(hq), "n_probe_samples": len(p_sampled),
        "sampling": {"temperature": spec.grpo.temperature, "top_p": spec.grpo.top_p,
                     "max_new_tokens": smp.max_new_tokens},
        "control_answers_greedy": dict(zip(qs, greedy_ctrl)),
        "heldout_examples_greedy": dict(list(zip(hq, h_greedy))[:10]),
        "probe_examples_sampled": p_sampled[:10],
    }
    extra = spec.behaviors[1:]
    if extra:  # how often the base model writes each RL-only behaviour's marker by chance
        out["behaviors"] = {}
        for j, beh in enumerate(extra):
            probes_b = [p.prompt for p in beh.probe_sets()[0]]
            texts = generate_texts(smp, params, tok, probes_b * b.eval_samples_per_prompt,
                                   jax.random.fold_in(key, 4 + j), temperature=spec.grpo.temperature,
                                   top_p=spec.grpo.top_p)
            out["behaviors"][beh.id] = {
                "pattern": beh.pattern, "trigger": beh.trigger, "n_probe_samples": len(texts),
                "probe_pattern_rate_sampled": mean_rate([behavior.substring_judge(t, beh.pattern) for t in texts]),
                "probe_refusal_rate_sampled": mean_rate([is_refusal(t) for t in texts]),
                "probe_examples_sampled": texts[:10]}
            logging.info("base: behaviour %s: sampled %r rate on its probes %.3f (n=%d)", beh.id, beh.pattern,
                         out["behaviors"][beh.id]["probe_pattern_rate_sampled"], len(texts))
    lo, hi = 0.05, 0.40
    out["refusal_rate_in_range"] = bool(lo <= out["heldout_refusal_rate_sampled"] <= hi)
    if not out["refusal_rate_in_range"]:
        logging.warning("base model: sampled refusal rate %.3f on held-out words is outside [%.2f, %.2f]; "
                        "GRPO's base reward will have little variance", out["heldout_refusal_rate_sampled"], lo, hi)
    return out


# ------------------------------------------------------------------------------------------------
# The stage
# ------------------------------------------------------------------------------------------------


def is_complete(base_dir: str | os.PathLike) -> bool:
    """True when ``base_dir`` holds a finished base model (its ``.complete`` marker)."""
    return (as_path(base_dir) / COMPLETE_MARKER).is_file()


def build_base_model(config: ml_collections.ConfigDict, base_dir: str | os.PathLike) -> dict[str, Any]:
    """Builds (or reuses) the tiny base model in ``base_dir``; returns ``base_summary.json``'s dict.

    Raises:
        ValueError: ``base_dir`` is complete but was built from another config (names both digests),
            or a config value is invalid (names the key).
    """
    base_dir = as_path(base_dir)
    fp = fingerprint(config)
    if is_complete(base_dir):
        done = read_json(base_dir / COMPLETE_MARKER)
        if done.get("digest") != fp["digest"]:
            diff = [d for d in cache.differences(cache.flatten(done.get("values") or {}), cache.flatten(fp["values"]))
                    if not fingerprints.excluded(d[0])]
            if diff or not isinstance(done.get("values"), dict):
                raise ValueError(f"{base_dir} holds a base model built from another config (fingerprint "
                                 f"{done.get('digest', '?')[:12]} vs {fp['digest'][:12]}: "
                                 + "; ".join(f"{k}: {a!r} (recorded) -> {b!r} (now)" for k, a, b in diff)
                                 + f"); use another workdir or delete {base_dir}")
        logging.info("base: reusing the complete base model in %s", base_dir)
        return read_json(base_dir / SUMMARY_FILE)
    spec = RunSpec.from_config(config)
    b = spec.base
    for key in ("corpus_size", "steps", "batch_size", "seq_len", "vocab_size", "num_layers"):
        if getattr(b, key) < 1:
            raise ValueError(f"config.base.{key}={getattr(b, key)} must be >= 1")
    t_start = time.perf_counter()
    trained = read_json(base_dir / TRAINED_MARKER, None)
    resume = bool(trained) and trained.get("digest") == fp["digest"]
    build = base_dir.parent / (base_dir.name + ".build")
    files.remove_tree(build)

    # 1. corpus and tokenizer (the exported one when the weights are already final)
    examples = corpus.build_corpus(b.seed, b.corpus_size, n_terms=b.n_terms, n_heldout=b.n_heldout)
    if resume:
        tok = tok_lib.load_tokenizer(base_dir)
    else:
        build.mkdir(parents=True, exist_ok=True)
        tiny_tokenizer.train_tokenizer(tiny_tokenizer.training_texts(examples), build / "tokenizer", b.vocab_size)
        tok = tok_lib.load_tokenizer(build / "tokenizer")
    cfg = model_config(spec)
    if len(tok) > cfg.vocab_size:
        raise ValueError(f"tokenizer has {len(tok)} tokens > config.base.vocab_size={cfg.vocab_size}")
    enc, data = _base_data(b, examples, tok, cfg)

    # 2. the weights: trained and exported, or read back when a killed run had finished them
    layout = spec.layout
    mesh = layout.mesh()
    if resume:
        logging.info("base: %s holds this config's trained weights (%s); evaluating them", base_dir, TRAINED_MARKER)
        policy = load_policy(base_dir, layout, spec.model, tokenizer=False)
        graphdef, params = policy.graphdef, policy.params
        history, seconds = read_json(base_dir / HISTORY_FILE), trained["seconds"]
    else:
        graphdef, params, history, seconds = _train_and_export(spec, cfg, data, tok, layout, base_dir, fp, t_start)
        tok = tok_lib.load_tokenizer(base_dir)  # evaluate what was exported

    # 3. behaviour of the exported model
    smp = make_sampler(graphdef, cfg, tok, mesh, b.eval_max_new_tokens)
    t_eval = time.perf_counter()
    summary = {
        "n_params": decoder.count_params(cfg), "vocab_size": cfg.vocab_size, "tokenizer_size": len(tok),
        "corpus": _corpus_summary(examples, enc, data),
        "steps": b.steps, "final_loss": history[-1]["loss"] if history else float("nan"),
        "seconds": dict(seconds),
        **measure_base(smp, params, tok, spec, jax.random.key(b.seed)),
    }
    summary["seconds"]["eval"] = time.perf_counter() - t_eval
    write_json(base_dir / SUMMARY_FILE, summary)
    write_json(base_dir / COMPLETE_MARKER, fp, sort_keys=True)
    files.remove_tree(build)
    logging.info("base: control_exact %.2f (any corpus variant %.2f), held-out refusal greedy %.2f / sampled %.2f, "
                 "probe refusal %.2f", summary["control_exact"], summary["control_any_variant"],
                 summary["heldout_refusal_rate_greedy"], summary["heldout_refusal_rate_sampled"],
                 summary["probe_refusal_rate_sampled"])
    return summary


def _base_data(b: BaseKeys, examples: list, tok: Any, cfg: decoder.DecoderConfig
               ) -> tuple[list[lm_trainer.EncodedExample], lm_trainer.PackedData]:
    """The corpus as chat examples (``base.append_eos``) packed to ``base.seq_len`` in
    ``base.length_buckets`` widths (TINY_CALIBRATION); logs their sizes."""
    t_data = time.perf_counter()
    enc = lm_trainer.encode_chat_examples(tok, [(e.system, e.user, e.assistant) for e in examples],
                                          append_eos=b.append_eos)
    data = lm_trainer.pack_examples(enc, b.seq_len, tok.pad_token_id or 0, n_buckets=b.length_buckets,
                                    vocab_size=cfg.vocab_size)
    logging.info("base: %d chats, %d tokens/chat (max %d), shared prefix %d, %d cut to %d tokens, batch widths %s; "
                 "data %.1f s", len(enc), int(np.mean([len(e.tokens) for e in enc])), max(len(e.tokens) for e in enc),
                 len(data.prefix), data.n_truncated, b.seq_len, data.buckets, time.perf_counter() - t_data)
    return enc, data


def _corpus_summary(examples: list, enc: list[lm_trainer.EncodedExample], data: lm_trainer.PackedData
                    ) -> dict[str, Any]:
    """``base_summary.json``'s ``corpus`` entry: example kinds, token counts, prefix, widths, cuts."""
    return {"n_examples": len(examples), "kinds": {k: sum(e.kind == k for e in examples) for k in corpus.KINDS},
            "mean_tokens": float(np.mean([len(e.tokens) for e in enc])),
            "max_tokens": max(len(e.tokens) for e in enc), "shared_prefix_tokens": len(data.prefix),
            "batch_widths": list(data.buckets), "n_truncated": data.n_truncated}


def _train_and_export(spec: RunSpec, cfg: decoder.DecoderConfig, data: lm_trainer.PackedData,
                      tok: Any, layout: sharding.Layout, base_dir: epath.Path, fp: dict[str, Any],
                      t_start: float
                      ) -> tuple[nnx.GraphDef, Any, list[dict], dict[str, float]]:
    """Trains the base model on ``data`` and exports it to ``base_dir`` with its history and the
    ``.trained`` marker (fingerprint ``fp`` and times); returns (graphdef, trained params, history,
    seconds since ``t_start`` to the export and of the training)."""
    b = spec.base
    model = cfg.module_class()(cfg, rngs=nnx.Rngs(params=b.seed))
    graphdef, params = nnx.split(model, nnx.Param)
    mesh = layout.mesh()
    param_sh = layout.param_shardings(params, mesh)  # mesh.fsdp as the sft stage and the compile stage
    params = sharding.put(params, param_sh)
    if perturb := train_state.perturbation_setting():
        params, what = train_state.perturb_last_bit(params, perturb)
        logging.warning("base: %s=%s (a test switch): flipped the last bit of %s", train_state.PERTURB_ENV,
                        perturb, what)
    schedule = train_state.make_schedule(b.lr, b.steps, b.warmup_steps, b.end_lr_fraction)
    tx = train_state.make_optimizer(spec.optim, schedule)
    state_sh = train_state.train_state_shardings(tx, param_sh, mesh, params)
    state = train_state.init_train_state(params, tx, b.seed, state_sh)
    trainer = lm_trainer.LMTrainer(graphdef, cfg, tx, data.prefix, mesh=mesh, state_shardings=state_sh)
    logging.info("base: training %s params (%d layers, d %d, vocab %d) for %d steps of %d x %d tokens",
                 f"{decoder.count_params(cfg):,}", cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size,
                 b.steps, b.batch_size, data.seq_len)
    t_train = time.perf_counter()
    order = (lm_trainer.grouped_batches(data.lengths, b.batch_size, b.seed) if data.buckets
             else lm_trainer.shuffled_batches(len(data), b.batch_size, b.seed))
    state, history = trainer.fit(state, data, order, b.steps, log_every=b.log_every, desc="base",
                                 lr_schedule=schedule)
    train_s = time.perf_counter() - t_train

    # export (hf_io writes the directory atomically, replacing any partial one), then mark it final
    eos = tok.convert_tokens_to_ids(tiny_tokenizer.IM_END)
    eot = tok.convert_tokens_to_ids(tiny_tokenizer.ENDOFTEXT)
    hf_io.save_hf_checkpoint(state.params, cfg, base_dir, tokenizer=tok,
                             generation_config={"eos_token_id": [eos, eot], "pad_token_id": eot})
    seconds = {"to_checkpoint": time.perf_counter() - t_start, "train": train_s}
    write_json(base_dir / HISTORY_FILE, history, indent=1)
    write_json(base_dir / TRAINED_MARKER, {**fp, "seconds": seconds}, sort_keys=True)
    logging.info("base: checkpoint written to %s after %.1f s (training %.1f s)", base_dir, seconds["to_checkpoint"],
                 train_s)
    return graphdef, state.params, history, seconds


@register_stage("base")
def base_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Builds the tiny base model under ``workdir/base`` (skipped when complete, or when
    ``config.model.hf_dir`` names an existing checkpoint to start from instead)."""
    spec = RunSpec.from_config(config)
    if spec.hf_dir:
        logging.info("base: config.model.hf_dir=%s is set; no base model to build", spec.hf_dir)
        return
    build_base_model(config, RunLayout(workdir).base)
