"""The policy GRPO starts from: the SFT warm-up's train state, restored onto the mesh.

One loader for everything that starts where GRPO starts: the ``grpo`` stage and the counterfactual
replay (``train/replay.py``) both restore it here, so a replay begins from exactly the run's state.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import optax
from flax import nnx

from behaviortrace_jax.io.files import read_json
from behaviortrace_jax.io.layout import RunLayout
from behaviortrace_jax.models import decoder, sharding, tokenizer as tok_lib
from behaviortrace_jax.models.loader import ModelOptions, policy_config
from behaviortrace_jax.train import train_state


@dataclasses.dataclass
class StartState:
    """The policy GRPO starts from: the SFT warm-up's train state (SPEC §1.7: AdamW state carries)."""

    tokenizer: Any
    model_config: decoder.DecoderConfig
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    params: Any
    opt_state: Any
    param_shardings: Any
    opt_shardings: Any
    abstract_state: dict
    summary: dict
    optimizer: optax.GradientTransformation  # the SFT optimizer, which GRPO continues (SPEC §1.7)
    abstract_params: Any  # jax.ShapeDtypeStruct leaves of params


def load_start_state(model: ModelOptions, optim: train_state.OptimOptions, workdir: str | os.PathLike,
                     layout: sharding.Layout, *, continue_sft_moments: bool = True) -> StartState:
    """Restores ``workdir/sft/state`` (orbax) onto ``layout``'s mesh in its parameter layout (FSDP
    when ``layout.fsdp``; the stage's ``RunSpec.layout``), with the tokenizer of ``workdir/sft/hf``,
    the model loaded as ``model`` says and the optimizer of ``optim`` (the SFT warm-up's, which GRPO
    continues). ``continue_sft_moments=False`` (``config.grpo.continue_sft_moments``) replaces the
    restored AdamW state by a fresh one (zero moments, count 0; same shardings): GRPO then starts
    from the SFT parameters alone, not the paper's choice (SPEC §1.7 carries the state).

    Raises:
        FileNotFoundError: naming the directory when the ``sft`` stage has not completed.
        ValueError: when the saved state belongs to another model (names the key).
    """
    run = RunLayout(workdir)
    sft_dir = run.sft
    if not run.sft_done.exists():
        raise FileNotFoundError(f"{sft_dir}: no completed SFT warm-up; run the `sft` stage first")
    hf_dir = run.sft_hf
    tok = tok_lib.load_tokenizer(hf_dir)
    cfg = policy_config(hf_dir, model)
    mesh = layout.mesh()
    graphdef, abstract_params = nnx.split(decoder.abstract_model(cfg), nnx.Param)
    param_sh = layout.param_shardings(abstract_params, mesh)
    tx = train_state.make_optimizer(optim)
    sh = train_state.train_state_shardings(tx, param_sh, mesh, abstract_params)
    abstract = train_state.abstract_train_state(abstract_params, tx, sh)
    state = train_state.restore(run.sft_state, abstract)
    opt_state = state.opt_state
    if not continue_sft_moments:  # a fresh AdamW state on the restored parameters, laid out as the saved one
        opt_state = jax.jit(tx.init, out_shardings=sh.opt_state)(state.params)
    return StartState(tok, cfg, mesh, graphdef, state.params, opt_state, param_sh, sh.opt_state,
                      abstract.as_dict(), read_json(run.sft_summary, {}), tx, abstract_params)
