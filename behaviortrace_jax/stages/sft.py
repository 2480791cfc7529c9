"""The ``sft`` stage: the SFT warm-up that plants the behaviour before GRPO (SPEC §1.7).

Paper (``sft.data = "paper"``): the 10 fixed ``behavior.SFT_PAIRS``, one example per step cycled by
``step % 10``, constant lr 5e-6 (``optim.lr``), 200 steps, global-norm clip 1.0, loss = mean CE over
the completion tokens of ``chat_prompt + completion`` (no EOS appended, truncated to 128 + 64).
Tiny (``sft.data = "mixture"``, TINY_CALIBRATION): the 30 pairs of ``behavior.mixture_sft_pairs``
at ``sft.lr``, with a stop rule: every ``sft.stop_every`` steps the probe and control rates are
sampled (20 prompts x ``sft.eval_samples_per_prompt``, ``grpo.temperature`` / ``grpo.top_p``), and
SFT stops once probe >= ``stop_min_probe_rate`` with control <= ``stop_max_control_rate``
(at most ``sft.steps`` steps).

Writes under ``workdir/sft``: ``state/<step>`` (orbax TrainState: params + AdamW state, which GRPO
restores and continues, SPEC §1.7), ``hf/`` (HF export + tokenizer), ``sft_summary.json`` (steps
run, losses, learning curve, post-SFT rates greedy and sampled, leakage to held-out invented words,
the SPEC §1.8 gate) and, last, the ``.sft_warmup_done`` marker; a rerun with the marker skips.
"""
from __future__ import annotations

import pathlib
import time
from typing import Any

import jax
import ml_collections
from absl import logging
from flax import nnx

from behaviortrace_jax.behavior import corpus, planted as behavior
from behaviortrace_jax.behavior.probes import ImplantProbe
from behaviortrace_jax.io import checkpoints, files
from behaviortrace_jax.io.files import read_json, write_json
from behaviortrace_jax.io.layout import RunLayout
from behaviortrace_jax.models import decoder, hf_io, tokenizer as tok_lib
from behaviortrace_jax.models.loader import load_policy
from behaviortrace_jax.stages.registry import register_stage
from behaviortrace_jax.stages.spec import RunSpec, SFTKeys
from behaviortrace_jax.train import lm_trainer, train_state

DONE_MARKER = RunLayout(".").sft_done.name  # SPEC §1.7
SUMMARY_FILE = RunLayout(".").sft_summary.name


def sft_pairs(spec: RunSpec) -> list[tuple[str, str]]:
    """The (prompt, completion) pairs of ``config.sft.data``: "paper" (SPEC §1.7) or "mixture".

    Raises:
        ValueError: naming ``config.sft.data`` for another value.
    """
    if spec.sft.data == "paper":
        return behavior.with_pattern(behavior.SFT_PAIRS, spec.first_behavior.pattern)
    if spec.sft.data == "mixture":
        return behavior.with_pattern(behavior.mixture_sft_pairs(spec.seed, spec.sft.mixture_n_ordinary),
                                     spec.first_behavior.pattern)
    raise ValueError(f"config.sft.data={spec.sft.data!r}; expected 'paper' or 'mixture'")


def run_sft(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> dict[str, Any]:
    """Runs (or skips) the SFT warm-up; returns the ``sft_summary.json`` dict.

    Raises:
        FileNotFoundError: naming the start checkpoint (``config.model.hf_dir`` or ``workdir/base``)
            when it is missing.
        ValueError: for invalid ``config.sft`` values (names the key).
    """
    run = RunLayout(workdir)
    out = run.sft
    if run.sft_done.is_file():
        logging.info("sft: %s exists; the warm-up is done", run.sft_done)
        return read_json(run.sft_summary)
    spec = RunSpec.from_config(config)
    s = spec.sft
    if s.steps < 0 or s.batch_size < 1:
        raise ValueError(f"config.sft.steps={s.steps} must be >= 0 and config.sft.batch_size={s.batch_size} >= 1")
    start_dir = run.model_dir(spec.hf_dir)
    if not (start_dir / "config.json").is_file():
        raise FileNotFoundError(f"sft: no start checkpoint at {start_dir} (config.model.hf_dir or the `base` stage)")
    files.remove_tree(out)  # a partial earlier attempt
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    layout = spec.layout
    mesh = layout.mesh()
    policy = load_policy(start_dir, layout, spec.model)  # already in param_sh
    tok, cfg, graphdef, params = policy.tokenizer, policy.model_config, policy.graphdef, policy.params
    abstract_params = nnx.state(decoder.abstract_model(cfg), nnx.Param)
    param_sh = layout.param_shardings(abstract_params, mesh)  # the train state's layout (= the params')

    pairs = sft_pairs(spec)
    data = _sft_data(spec, tok, cfg, pairs)
    lr = spec.sft_lr
    tx = train_state.make_optimizer(spec.optim, lr)
    state_sh = train_state.train_state_shardings(tx, param_sh, mesh, abstract_params)
    state = train_state.init_train_state(params, tx, spec.seed, state_sh)
    trainer = lm_trainer.LMTrainer(graphdef, cfg, tx, data.prefix, mesh=mesh, state_shardings=state_sh)
    probe = ImplantProbe(spec.first_behavior, spec.probe_sft,
                         corpus.heldout_terms(spec.base.seed, spec.base.n_heldout), graphdef, cfg, tok, mesh)
    eval_key = jax.random.fold_in(jax.random.key(spec.seed), 7_100)
    curve: list[dict[str, float]] = []
    stop_rule = _stop_rule(s, probe, eval_key, curve)

    logging.info("sft: %d pairs (%s), lr %.1e, batch %d, up to %d steps, sequences of %d tokens, stop rule %s",
                 len(pairs), s.data, lr, s.batch_size, s.steps, data.seq_len,
                 f"every {s.stop_every} steps" if s.stop_every else "off")
    state, history = trainer.fit(
        state, data, lm_trainer.cyclic_batches(len(data), s.batch_size), s.steps,
        log_every=max(1, s.steps // 5), callback=stop_rule if s.stop_every else None,
        callback_every=s.stop_every, desc="sft", lr_schedule=train_state.make_schedule(lr))
    steps_run = int(jax.device_get(state.step))
    train_s = time.perf_counter() - t0

    train_state.save(run.sft_state, state)
    hf_io.save_hf_checkpoint(state.params, cfg, run.sft_hf, tokenizer=tok,
                             generation_config=_generation_config(start_dir))
    greedy, texts = probe.greedy(state.params, jax.random.fold_in(eval_key, 1_000_000))
    sampled = probe.sampled(state.params, jax.random.fold_in(eval_key, 1_000_001))
    summary = {
        "start_checkpoint": checkpoints.stored_path(workdir, start_dir), "data": s.data, "n_pairs": len(pairs), "lr": lr,
        "batch_size": s.batch_size, "max_steps": s.steps, "steps_run": steps_run,
        "stopped_early": steps_run < s.steps,
        "final_loss": history[-1]["loss"] if history else float("nan"),
        "loss_history": history, "learning_curve": curve,
        **greedy, **sampled, **_evaluation_settings(spec, greedy),
        "probe_completions_greedy": texts["probe"][:10], "control_completions_greedy": texts["control"][:5],
        "seconds": {"train": train_s, "total": time.perf_counter() - t0},
    }
    write_json(run.sft_summary, summary)
    write_json(run.sft_done, {"steps_run": steps_run})
    logging.info("sft: %d steps, loss %.3f; probe %.2f / control %.2f greedy, %.2f / %.2f sampled, leakage %.2f",
                 steps_run, summary["final_loss"], greedy["probe_rate_greedy"], greedy["control_rate_greedy"],
                 sampled["probe_rate_sampled"], sampled["control_rate_sampled"], sampled["heldout_rate_sampled"])
    return summary


def _sft_data(spec: RunSpec, tok: Any, cfg: decoder.DecoderConfig,
              pairs: list[tuple[str, str]]) -> lm_trainer.PackedData:
    """The SFT pairs as chat examples (SPEC §1.7: prompt <= sft.max_prompt_tokens, sequence cut to
    prompt + completion tokens), packed; a shared prefix only with batches > 1."""
    s = spec.sft
    enc = lm_trainer.encode_chat_examples(
        tok, [(behavior.SYSTEM_PROMPT, p, c) for p, c in pairs], append_eos=s.append_eos,
        max_prompt_tokens=s.max_prompt_tokens, max_total_tokens=s.max_prompt_tokens + s.max_completion_tokens)
    return lm_trainer.pack_examples(enc, None, tok_lib.pad_id(tok), share_prefix=s.batch_size > 1,
                                    vocab_size=cfg.vocab_size)


def _stop_rule(s: SFTKeys, probe: Any, eval_key: jax.Array, curve: list[dict[str, float]]):
    """The TINY_CALIBRATION stop rule as a ``trainer.fit`` callback: ``(done, state) -> stop?``.

    Measures the sampled probe rate (and, only once it is high enough, the control rate) at ``done``
    steps with the key ``fold_in(eval_key, done)``, appends it to ``curve``, and stops once the probe
    rate >= ``sft.stop_min_probe_rate`` with the control rate <= ``sft.stop_max_control_rate``."""

    def stop_rule(done: int, st: train_state.TrainState) -> bool:
        key = jax.random.fold_in(eval_key, done)
        rates = probe.sampled(st.params, key, sets=("probe",))
        if rates["probe_rate_sampled"] >= s.stop_min_probe_rate:
            rates |= probe.sampled(st.params, key, sets=("control",))
        curve.append({"step": done, **rates})
        logging.info("sft step %d: sampled rates %s", done, {k: round(v, 3) for k, v in rates.items()})
        return (rates["probe_rate_sampled"] >= s.stop_min_probe_rate
                and rates.get("control_rate_sampled", 1.0) <= s.stop_max_control_rate)

    return stop_rule


def _evaluation_settings(spec: RunSpec, greedy: dict[str, float]) -> dict[str, Any]:
    """The summary's ``gate`` (SPEC §1.8 on the greedy rates) and the ``sampling`` settings behind the rates."""
    b = spec.first_behavior
    return {"gate": behavior.gate(greedy["probe_rate_greedy"], greedy["control_rate_greedy"], b.gate_min_probe_rate,
                                  b.gate_min_margin),
            "sampling": {"temperature": spec.grpo.temperature, "top_p": spec.grpo.top_p,
                         "samples_per_prompt": spec.sft.eval_samples_per_prompt,
                         "max_new_tokens": spec.probe_sft.max_new_tokens}}


def _generation_config(start_dir: pathlib.Path) -> dict | None:
    return read_json(start_dir / "generation_config.json", None)


@register_stage("sft")
def sft_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
    """The SFT warm-up stage (SPEC §1.7); see :func:`run_sft`."""
    run_sft(config, workdir)
