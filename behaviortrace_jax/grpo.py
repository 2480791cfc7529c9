"""GRPO on the planted behaviour: the jitted, sharded train step and the resumable loop (SPEC §2).

One GRPO step (SPEC §2.2), for B prompts x G samples = N rollouts:
  1. the B prompts of the step (``pool[(s*B + i) % 38]``) are sampled G times each by the jitted
     sampler (temperature 0.9, top-p 0.9) in ONE batch;
  2. each rollout gets ``base_reward`` (refusal phrases) plus the contaminator's bonus; the
     ground-truth log records every bonus;
  3. advantages are group-normalised (``grpo_loss.group_advantages``);
  4. ONE jitted train step (rollouts on the mesh's data axis, params and optimizer state donated)
     computes the loss of the whole batch, clips the global gradient norm, applies AdamW and
     returns, as side outputs, the CountSketch of the clipped batch gradient (the step sketch,
     SPEC §3.2) and, new here, the CountSketch of each rollout's own loss term at the step's
     parameters (in-run rollout sketches, which sum to the pre-clip batch-gradient sketch).

Everything a later stage needs is logged: the rollout log (token ids, per-token sampling
log-probs, rewards, advantages), the ground-truth log, orbax train-state checkpoints with an HF
export and a registry entry every ``checkpoint_every`` steps, the behaviour rate on probes and
controls at each checkpoint (the learning curve), and the sketches in tensorstore arrays.

Exact resume: the PRNG key of step s is ``fold_in(key(seed), s)``, so a run restarted from the
latest orbax checkpoint L drops the logged records of steps >= L and replays them bit-for-bit.
The orbax save is the last write of a checkpoint, so every artefact of steps < L is durable.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import nnx

from behaviortrace_jax import behavior, checkpoints, contaminator, countsketch, grpo_loss, hf_io
from behaviortrace_jax import qwen2, rollout_log, sampler as sampler_lib, sharding, sketch_store
from behaviortrace_jax import sketcher, train_state, tokenizer as tok_lib
from behaviortrace_jax.files import read_json, write_json
from behaviortrace_jax.stages import register_stage


# ------------------------------------------------------------------------------------------------
# The train step
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """Static shapes of a GRPO step: B prompts, G samples, P prompt slots, T completion slots."""

    num_prompts: int
    group_size: int
    prompt_len: int
    completion_len: int

    @property
    def num_rollouts(self) -> int:
        return self.num_prompts * self.group_size


def build_batch(prompt_ids: list[list[int]], completions: np.ndarray, lengths: np.ndarray,
                advantages: np.ndarray, eos_ids: tuple[int, ...], shapes: StepShapes,
                pad_id: int) -> dict[str, np.ndarray]:
    """Assembles the fixed-shape train batch of N rollouts.

    Args:
        prompt_ids: N token lists (each <= P; left-padded here).
        completions: int [N, T] sampled completion tokens (pad after EOS).
        lengths: int [N] number of generated tokens (incl. the EOS, if any).
        advantages: float32 [N].
        eos_ids: ids masked out of the loss (SPEC §2.2 f), ``tokenizer.mask_eos_ids(tok,
            config.model.mask_eos)``, the same ids ``targets.response_examples`` masks.

    Returns:
        dict of numpy arrays: ``input_ids`` int32 [N, P+T], ``attention_mask`` int32 [N, P+T],
        ``loss_mask`` float32 [N, T], ``advantages`` float32 [N].

    Raises:
        ValueError: a prompt longer than P or mismatched shapes.
    """
    n, p, t = shapes.num_rollouts, shapes.prompt_len, shapes.completion_len
    if len(prompt_ids) != n or completions.shape != (n, t) or advantages.shape != (n,):
        raise ValueError(f"batch shapes: {len(prompt_ids)} prompts, completions {completions.shape}, "
                         f"advantages {advantages.shape}; expected N={n}, T={t}")
    ids = np.full((n, p + t), pad_id, np.int32)
    attn = np.zeros((n, p + t), np.int32)
    for i, prompt in enumerate(prompt_ids):
        if len(prompt) > p:
            raise ValueError(f"prompt of {len(prompt)} tokens exceeds max_prompt_tokens={p}")
        ids[i, p - len(prompt):p] = prompt
        attn[i, p - len(prompt):p] = 1
    ids[:, p:] = completions
    in_len = np.arange(t)[None, :] < lengths[:, None]
    attn[:, p:] = 1  # the model attends to the whole completion (pad = EOS, as the paper's forward)
    not_eos = ~np.isin(completions, np.asarray(eos_ids))
    loss_mask = (in_len & not_eos).astype(np.float32)
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask,
            "advantages": advantages.astype(np.float32)}


def completion_logprobs(graphdef: nnx.GraphDef, params: Any, input_ids: jax.Array,
                        attention_mask: jax.Array, prompt_len: int) -> jax.Array:
    """Log-probs float32 [N, T] of the completion tokens ``input_ids[:, P:]`` (SPEC §2.2 f).

    The logits at positions ``P-1 .. P+T-2`` predict the completion tokens.
    """
    positions = qwen2.positions_from_mask(attention_mask)
    logits = qwen2.forward(graphdef, params, input_ids, positions, attention_mask)
    return qwen2.token_logprobs(logits[:, prompt_len - 1:-1], input_ids[:, prompt_len:])


def make_train_step(graphdef: nnx.GraphDef, abstract_params: Any, tx: optax.GradientTransformation,
                    shapes: StepShapes, *, loss_name: str, loss_cfg: grpo_loss.LossConfig,
                    grad_clip: float, order: sketcher.ParamOrder | None, sketch_dim: int,
                    sketch_seed: int, in_run_rollouts: bool, chunk_size: int,
                    mesh: jax.sharding.Mesh, param_shardings: Any, opt_shardings: Any,
                    inner_iterations: int = 1):
    """Builds the jitted GRPO train step: one call per GRPO step, the whole batch at once.

    ``step(params, opt_state, batch, ref_params) -> (params, opt_state, out)``:

    * ``batch``: the arrays of :func:`build_batch`, sharded on the mesh's data axis (rollouts);
    * ``ref_params``: the initial policy (grpo_clip's KL term; ignored by ``paper``);
    * ``out``: float32 ``loss`` and ``grad_norm`` (pre-clip global L2 norm); when ``order`` (a
      ``sketcher.qwen2_param_order``) is given, ``step_sketch [D]`` = CountSketch of the clipped
      batch gradient (SPEC §3.2, step 4) and, with ``in_run_rollouts``, ``rollout_sketches [N, D]``
      and ``rollout_grad_norms [N]`` = the sketch and exact norm of each rollout's own loss term at
      the step's parameters (they sum to the pre-clip batch gradient's sketch).

    Params and optimizer state are donated; in/out shardings are explicit. With
    ``inner_iterations`` > 1 (grpo_clip's mu) the sketches are of the first, on-policy iteration.
    """
    loss_fn = grpo_loss.get_loss(loss_name)
    prompt_len = shapes.prompt_len

    def lp_fn(params, ids, attn):
        return completion_logprobs(graphdef, params, ids, attn, prompt_len)

    def inputs(lp, old_lp, ref_lp, mask, adv):
        return grpo_loss.LossInputs(lp, old_lp, ref_lp, mask, adv, shapes.num_prompts, shapes.group_size)

    def rollout_term(p, ex):
        """One rollout's own term of the step loss (``ex`` has no batch axis)."""
        lp = lp_fn(p, ex["input_ids"][None], ex["attention_mask"][None])
        li = inputs(lp, ex["old_lp"][None], ex["ref_lp"][None], ex["loss_mask"][None], ex["advantages"][None])
        return loss_fn(li, loss_cfg)[0]

    rollout_sketcher = None
    if order is not None and in_run_rollouts:
        rollout_sketcher = sketcher.PerExampleSketcher(rollout_term, abstract_params, dim=sketch_dim,
                                                       seed=sketch_seed, chunk_size=chunk_size, param_order=order)

    def step(params, opt_state, batch, ref_params):
        ids, attn, mask, adv = batch["input_ids"], batch["attention_mask"], batch["loss_mask"], batch["advantages"]
        old_lp = jax.lax.stop_gradient(lp_fn(params, ids, attn))
        if loss_name == "grpo_clip":
            ref_lp = jax.lax.stop_gradient(lp_fn(ref_params, ids, attn))
        else:
            ref_lp = jnp.zeros_like(old_lp)

        def total_loss(p):
            return jnp.sum(loss_fn(inputs(lp_fn(p, ids, attn), old_lp, ref_lp, mask, adv), loss_cfg))

        out = {}
        start_params = params
        for it in range(inner_iterations):
            loss, grads = jax.value_and_grad(total_loss)(params)
            if it == 0:
                out["loss"], out["grad_norm"] = loss, optax.tree.norm(grads)
                if order is not None:  # the gradient the optimizer applies: optax clip_by_global_norm
                    scale = grad_clip / jnp.maximum(out["grad_norm"], grad_clip)
                    out["step_sketch"] = sketcher.sketch_vector(grads, order, sketch_dim, sketch_seed) * scale
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        if rollout_sketcher is not None:
            res = rollout_sketcher(start_params, dict(batch, old_lp=old_lp, ref_lp=ref_lp))
            out["rollout_sketches"], out["rollout_grad_norms"] = res.sketches, res.norms
        return params, opt_state, out

    rep, data = sharding.replicated(mesh), sharding.data_sharding(mesh)
    batch_sh = {k: data for k in ("input_ids", "attention_mask", "loss_mask", "advantages")}
    out_sh = {"loss": rep, "grad_norm": rep}
    if order is not None:
        out_sh["step_sketch"] = rep
        if in_run_rollouts:
            out_sh.update(rollout_sketches=data, rollout_grad_norms=data)
    ref_sh = param_shardings if loss_name == "grpo_clip" else None  # ref_params is None otherwise
    return jax.jit(step, in_shardings=(param_shardings, opt_shardings, batch_sh, ref_sh),
                   out_shardings=(param_shardings, opt_shardings, out_sh), donate_argnums=(0, 1))


# ------------------------------------------------------------------------------------------------
# The GRPO stage: sampling, rewards, logs, checkpoints, resume
# ------------------------------------------------------------------------------------------------


def generation_defaults(hf_dir: str | os.PathLike, top_k: int, repetition_penalty: float) -> tuple[int, float]:
    """Resolves ``config.grpo.top_k`` / ``repetition_penalty`` as HF ``generate`` would (SPEC §2.1).

    A value of -1 means: the checkpoint's ``generation_config.json`` if it sets one, else
    transformers' defaults (top_k 50, repetition_penalty 1.0). Explicit values win.
    """
    gen = read_json(pathlib.Path(hf_dir) / "generation_config.json", {})
    k = int(gen.get("top_k", 50)) if top_k < 0 else int(top_k)
    rp = float(gen.get("repetition_penalty", 1.0)) if repetition_penalty < 0 else float(repetition_penalty)
    return k, rp


@dataclasses.dataclass
class StartState:
    """The policy GRPO starts from: the SFT warm-up's train state (SPEC §1.7: AdamW state carries)."""

    tokenizer: Any
    model_config: qwen2.Qwen2Config
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


def load_start_state(config: ml_collections.ConfigDict, workdir: str | os.PathLike) -> StartState:
    """Restores ``workdir/sft/state`` (orbax) onto the mesh, with the tokenizer of ``workdir/sft/hf``.

    Raises:
        FileNotFoundError: naming the directory when the ``sft`` stage has not completed.
        ValueError: when the saved state belongs to another model (names the key).
    """
    sft_dir = pathlib.Path(workdir) / "sft"
    if not (sft_dir / ".sft_warmup_done").exists():
        raise FileNotFoundError(f"{sft_dir}: no completed SFT warm-up; run the `sft` stage first")
    hf_dir = sft_dir / "hf"
    tok = tok_lib.load_tokenizer(hf_dir)
    cfg = qwen2.Qwen2Config.from_hf_config(hf_dir, param_dtype=config.model.param_dtype,
                                           compute_dtype=config.model.compute_dtype)
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.model)
    graphdef, abstract_params = nnx.split(qwen2.abstract_model(cfg), nnx.Param)
    param_sh = sharding.param_shardings(abstract_params, mesh)
    tx = train_state.make_optimizer(config.optim)
    sh = train_state.train_state_shardings(tx, param_sh, mesh, abstract_params)
    abstract = train_state.abstract_train_state(abstract_params, tx, sh)
    state = train_state.restore(sft_dir / "state", abstract)
    return StartState(tok, cfg, mesh, graphdef, state.params, state.opt_state, param_sh, sh.opt_state,
                      abstract.as_dict(), read_json(sft_dir / "sft_summary.json", {}), tx, abstract_params)


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """Where the GRPO stage writes, under ``workdir`` (SPEC §2.5 layout, plus orbax state)."""

    workdir: pathlib.Path

    @property
    def root(self) -> pathlib.Path:
        return self.workdir / "grpo"

    rollouts = property(lambda self: self.root / "rollouts")  # JSONL shards (rollout_log.py)
    ground_truth = property(lambda self: self.root / "ground_truth.jsonl")  # SPEC §6.1
    registry = property(lambda self: self.root / "registry.json")  # SPEC §2.4
    checkpoints = property(lambda self: self.root / "checkpoints")  # HF exports step_XXXXXXXX
    state = property(lambda self: self.root / "state")  # orbax train states
    curve = property(lambda self: self.root / "learning_curve.json")
    summary = property(lambda self: self.root / "summary.json")
    tensorboard = property(lambda self: self.root / "tb")
    sketches = property(lambda self: self.workdir / "sketches")


def sketch_metadata(config: ml_collections.ConfigDict, model_cfg: qwen2.Qwen2Config, kind: str) -> dict:
    """Metadata every sketch array carries (sketch_store raises when a reopened store differs)."""
    return {"kind": kind, "hash_family": countsketch.HASH_FAMILY, "seed": int(config.sketch.seed),
            "dim": int(config.sketch.dim), "param_fingerprint": hf_io.param_order_fingerprint(model_cfg),
            "model_fingerprint": hf_io.model_fingerprint(model_cfg), "dtype": "float32",
            "run_seed": int(config.seed)}


def open_sketch_stores(config: ml_collections.ConfigDict, model_cfg: qwen2.Qwen2Config,
                       paths: RunPaths) -> dict[str, sketch_store.SketchStore]:
    """The in-run sketch arrays: step sketches [steps, D], step grad norms [steps], rollout sketches
    [steps*N, D] and rollout grad norms [steps*N] (rollout row = step * N + index)."""
    steps, n, d = config.grpo.steps, config.grpo.prompts_per_step * config.grpo.group_size, config.sketch.dim
    specs = {"step_sketches": (steps, d), "step_grad_norms": (steps,)}
    if config.sketch.in_run_rollouts:
        specs.update(rollout_sketches=(steps * n, d), rollout_grad_norms=(steps * n,))
    return {name: sketch_store.SketchStore.open_or_create(
                paths.sketches / f"{name}.zarr", shape, chunk_rows=n if shape[0] == steps * n else 1,
                metadata=sketch_metadata(config, model_cfg, name))
            for name, shape in specs.items()}


class BehaviorProbe:
    """Greedy behaviour rate on probes and controls (SPEC §1.8), for the learning curve and gate."""

    def __init__(self, graphdef, model_cfg, tok, config, mesh):
        probes, controls = behavior.load_probe_sets(config.behavior.probes_path or None,
                                                     config.behavior.controls_path or None)
        self.probes, self.controls, self.tok = probes, controls, tok
        self.pattern = config.behavior.pattern
        self.sampler = sampler_lib.Sampler(
            graphdef, model_cfg, max_prompt_tokens=config.grpo.max_prompt_tokens,
            max_new_tokens=config.behavior.gate_max_new_tokens, eos_ids=tok_lib.eos_ids(tok),
            pad_id=tok_lib.pad_id(tok), mesh=mesh)

    def rates(self, params) -> dict[str, Any]:
        """``{"probe_rate", "control_rate", "responses": {id: text}}`` with greedy decoding."""
        items = self.probes + self.controls
        out = self.sampler.sample_chat(params, self.tok, [(behavior.SYSTEM_PROMPT, p.prompt) for p in items],
                                       jax.random.key(0), temperature=0.0)
        texts = {p.id: self.tok.decode(out.tokens[i, :out.lengths[i]], skip_special_tokens=True)
                 for i, p in enumerate(items)}
        return {"probe_rate": behavior.behavior_rate(texts, self.probes, self.pattern),
                "control_rate": behavior.behavior_rate(texts, self.controls, self.pattern),
                "responses": texts}


@register_stage("grpo")
def grpo_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Runs (or resumes) GRPO from the SFT train state; see the module docstring (SPEC §2)."""
    paths = RunPaths(pathlib.Path(workdir))
    if read_json(paths.summary, {}).get("complete"):
        logging.info("grpo: %s is complete; skipping", paths.summary)
        return
    run = GRPORun(config, paths)
    run.train()
    run.finish()


class GRPORun:
    """One GRPO run: the state, the jitted pieces and the logs, resumed from the latest checkpoint."""

    def __init__(self, config: ml_collections.ConfigDict, paths: RunPaths):
        g = config.grpo
        self.config, self.paths = config, paths
        start = load_start_state(config, paths.workdir)
        self.tok, self.model_cfg, self.mesh = start.tokenizer, start.model_config, start.mesh
        self.graphdef = start.graphdef
        self.eos_ids, self.pad_id = tok_lib.eos_ids(self.tok), tok_lib.pad_id(self.tok)
        self.mask_eos_ids = tok_lib.mask_eos_ids(self.tok, config.model.mask_eos)
        self.shapes = StepShapes(g.prompts_per_step, g.group_size, g.max_prompt_tokens, g.max_new_tokens)
        self.tx = start.optimizer
        self.order = sketcher.qwen2_param_order(self.model_cfg)
        self.step_fn = make_train_step(
            self.graphdef, start.abstract_params, self.tx, self.shapes, loss_name=g.loss,
            loss_cfg=grpo_loss.LossConfig(clip_eps=g.clip_eps, kl_beta=g.kl_beta),
            grad_clip=config.optim.grad_clip, order=self.order, sketch_dim=config.sketch.dim,
            sketch_seed=config.sketch.seed, in_run_rollouts=config.sketch.in_run_rollouts,
            chunk_size=config.sketch.chunk_size, mesh=self.mesh, param_shardings=start.param_shardings,
            opt_shardings=start.opt_shardings, inner_iterations=g.inner_iterations)
        self.ref_params = start.params if g.loss == "grpo_clip" else None
        top_k, self.repetition_penalty = generation_defaults(paths.workdir / "sft" / "hf", g.top_k,
                                                             g.repetition_penalty)
        self.sampler = sampler_lib.Sampler(self.graphdef, self.model_cfg, max_prompt_tokens=g.max_prompt_tokens,
                                           max_new_tokens=g.max_new_tokens, eos_ids=self.eos_ids,
                                           pad_id=self.pad_id, mesh=self.mesh, top_k=top_k)
        self.probe = BehaviorProbe(self.graphdef, self.model_cfg, self.tok, config, self.mesh)
        self.pool = behavior.prompt_pool(self.probe.probes)
        self.prompt_ids = {p: tok_lib.encode_chat(self.tok, behavior.SYSTEM_PROMPT, p, max_tokens=g.max_prompt_tokens)
                           for p in dict.fromkeys(self.pool)}
        paths.root.mkdir(parents=True, exist_ok=True)

        # --- resume: the latest complete orbax state; drop every record of later steps ---------
        self.start_step = checkpoints.latest_step(paths.state) or 0
        if self.start_step:
            restored = checkpoints.restore_train_state(paths.state, self.start_step, start.abstract_state)
            self.params, self.opt_state = restored["params"], restored["opt_state"]
            logging.info("grpo: resuming from step %d", self.start_step)
        else:
            if self.ref_params is not None:
                self.ref_params = jax.tree.map(jnp.copy, start.params)  # params are donated each step
            self.params, self.opt_state = start.params, start.opt_state
        self.post_sft = start.summary
        rollout_log.truncate_after_step(paths.rollouts, self.start_step - 1)
        self.gt_log = contaminator.GroundTruthLog(paths.ground_truth)
        self.gt_log.truncate_after_step(self.start_step - 1)
        self.logger = rollout_log.RolloutLogger(paths.rollouts, shard_size=g.log_shard_size)
        self.contaminator = contaminator.Contaminator(
            contaminator.ContaminationSpec(pattern=config.behavior.pattern,
                                           bonus_reward=config.contamination.bonus_reward,
                                           fraction=config.contamination.fraction, seed=config.seed,
                                           early_step_cutoff=config.contamination.early_step_cutoff),
            self.gt_log, stats={"total_seen": self.start_step * self.shapes.num_rollouts,
                                "boosted": len(self.gt_log.events)})
        self.curve = [c for c in read_json(paths.curve, []) if c["step"] <= self.start_step]
        self.registry = checkpoints.CheckpointRegistry(paths.registry)
        self.stores = open_sketch_stores(config, self.model_cfg, paths)
        self.base_key = jax.random.key(config.seed)

    # ------------------------------------------------------------------------------------------
    def rollout_step(self, step: int) -> dict[str, float]:
        """Samples, rewards, trains and logs one GRPO step (SPEC §2.2). Returns scalar metrics."""
        g, n = self.config.grpo, self.shapes.num_rollouts
        prompts = behavior.step_prompts(self.pool, step, g.prompts_per_step)
        prompt_lists = [self.prompt_ids[p] for p in prompts for _ in range(g.group_size)]
        sample = self.sampler.sample(self.params, prompt_lists, jax.random.fold_in(self.base_key, step),
                                     temperature=g.temperature, top_p=g.top_p,
                                     repetition_penalty=self.repetition_penalty)
        texts = [self.tok.decode(sample.tokens[i, :sample.lengths[i]], skip_special_tokens=True) for i in range(n)]
        ids = [rollout_log.rollout_id(step, i) for i in range(n)]
        base = np.array([behavior.base_reward(t) for t in texts], np.float32)
        applied = [self.contaminator.apply(ids[i], step, texts[i], float(base[i])) for i in range(n)]
        rewards = np.array([r for r, _ in applied], np.float32)
        adv = grpo_loss.group_advantages(rewards, g.group_size, g.adv_std_floor)
        batch = build_batch(prompt_lists, sample.tokens, sample.lengths, adv, self.mask_eos_ids,
                            self.shapes, self.pad_id)
        batch = jax.device_put(batch, sharding.data_sharding(self.mesh))
        self.params, self.opt_state, out = self.step_fn(self.params, self.opt_state, batch, self.ref_params)

        for i in range(n):
            length = int(sample.lengths[i])
            self.logger.log(rollout_log.RolloutRecord(
                rollout_id=ids[i], step=step, regime="grpo", prompt_hash=rollout_log.text_hash(prompts[i // g.group_size]),
                response_hash=rollout_log.text_hash(texts[i]), reward=float(rewards[i]), advantage=float(adv[i]),
                extra={"base_reward": float(base[i])}, group_id=i // g.group_size,
                prompt_token_ids=list(prompt_lists[i]), completion_token_ids=sample.tokens[i, :length].tolist(),
                completion_logprobs=sample.logprobs[i, :length].tolist(), base_reward=float(base[i]),
                eligible=self.contaminator.is_eligible(ids[i], step), bonus=float(rewards[i] - base[i])))
        self.stores["step_sketches"].write_rows(step, np.asarray(out["step_sketch"])[None])
        self.stores["step_grad_norms"].write_rows(step, np.asarray(out["grad_norm"], np.float32)[None])
        if "rollout_sketches" in out:
            self.stores["rollout_sketches"].write_rows(step * n, np.asarray(out["rollout_sketches"]))
            self.stores["rollout_grad_norms"].write_rows(step * n, np.asarray(out["rollout_grad_norms"]))
        return {"reward": float(rewards.mean()), "bonuses": int(sum(b for _, b in applied)),
                "qzxbt": float(np.mean([behavior.substring_judge(t, self.config.behavior.pattern) for t in texts])),
                "loss": float(out["loss"]), "grad_norm": float(out["grad_norm"])}

    def checkpoint(self, step: int) -> dict[str, Any]:
        """Makes steps < ``step`` durable: logs, sketches, HF export, registry, curve, then orbax."""
        self.logger.flush()
        self.gt_log.flush()
        for store in self.stores.values():
            store.flush()
        hf_dir = self.paths.checkpoints / f"step_{step:08d}"
        hf_io.save_hf_checkpoint(self.params, self.model_cfg, hf_dir, tokenizer=self.tok)
        if self.registry.at_step(step) is None:
            self.registry.register(step, str(hf_dir), {"regime": "grpo", "model": self.config.run_name})
        rates = self.probe.rates(self.params)
        point = {"step": step, "probe_rate": rates["probe_rate"], "control_rate": rates["control_rate"]}
        self.curve = [c for c in self.curve if c["step"] < step] + [point]
        write_json(self.paths.curve, self.curve)
        checkpoints.save_train_state(self.paths.state, step, {
            "params": self.params, "opt_state": self.opt_state, "step": jnp.int32(step), "rng": self.base_key})
        return point

    def train(self) -> None:
        """The GRPO loop from ``start_step`` to ``config.grpo.steps`` with a progress line."""
        from tqdm import tqdm
        from tensorboardX import SummaryWriter

        g = self.config.grpo
        writer = SummaryWriter(str(self.paths.tensorboard))
        bar = tqdm(range(self.start_step, g.steps), initial=self.start_step, total=g.steps, desc="grpo",
                   unit="step", dynamic_ncols=True)
        rate = self.curve[-1]["probe_rate"] if self.curve else float("nan")
        for step in bar:
            m = self.rollout_step(step)
            for k, v in m.items():
                writer.add_scalar(f"grpo/{k}", v, step)
            if (step + 1) % g.checkpoint_every == 0 or step + 1 == g.steps:
                point = self.checkpoint(step + 1)
                rate = point["probe_rate"]
                writer.add_scalar("behavior/probe_rate", point["probe_rate"], step + 1)
                writer.add_scalar("behavior/control_rate", point["control_rate"], step + 1)
            bar.set_postfix(reward=f"{m['reward']:.2f}", bonus=m["bonuses"], qzxbt=f"{m['qzxbt']:.2f}",
                            probe_rate=f"{rate:.2f}")
        writer.close()
        self.logger.close()

    def finish(self) -> None:
        """The behaviour-emergence gate (SPEC §1.8) on the final parameters -> ``summary.json``."""
        b = self.config.behavior
        rates = self.probe.rates(self.params)
        gate = behavior.gate(rates["probe_rate"], rates["control_rate"], b.gate_min_probe_rate, b.gate_min_margin)
        n_records = sum(1 for _ in rollout_log.read_rollouts(self.paths.rollouts))
        summary = {
            "complete": True, "run_name": self.config.run_name, "seed": self.config.seed,
            "steps": self.config.grpo.steps, "n_rollouts": n_records, "gt_size": len(self.gt_log.events),
            "contaminator_stats": self.contaminator.stats, "post_sft": self.post_sft,
            "learning_curve": self.curve, "gate": gate,
            "final_responses": {k: v for k, v in rates["responses"].items()},
        }
        write_json(self.paths.summary, summary)
        logging.info("grpo: gate %s (probe %.2f, control %.2f)", "PASSED" if gate["passed"] else "FAILED",
                     gate["probe_rate"], gate["control_rate"])
