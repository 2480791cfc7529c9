"""The ``draws`` stage: rollout-level draws at one checkpoint and their rows files (SPEC §5.6, §10.2).

At the GRPO checkpoint nearest ``draws.target_step`` (``min |step - target|``; registry
``workdir/grpo/registry.json``), with generation seed ``gen_seed``:

1. targets (SPEC §5): ``t_cont`` (§5.2), ``t_mp`` / ``t_mp_bal`` (§5.4) and ``t_ctx`` /
   ``t_contrast`` (§5.3, sampled with the second half of ``split(key(gen_seed))``);
2. for rep in 0..n_repeats-1 the 26 prompts (6 explicit, then the probes) are sampled G = 8 times
   each (temperature 0.9, top_p 0.95) in one batch with key ``fold_in(split(key(gen_seed))[0], rep)``;
   group = rep * 26 + prompt index; rows in generation order;
3. per response: whole-response sketch g of ``-(masked mean log-prob)`` (mask: generated, != EOS),
   fluency (that mean log-prob), ``has_qzxbt`` (token judge), norm |g|; the rows
   ``{group, has_qzxbt, fluency, norm, mp, mp_centered, mp_bal_centered}`` come from
   ``estimators.score_rollout_rows`` (cos with +1e-12 per norm, centring on the group mean);
4. token-level analysis (§5.5): for the first ``token_level_max`` QZXBT rollouts (generation
   order) the in-context QZXBT-token sketch st gives ``vs_cont = cos(st, t_cont)``,
   ``vs_ctx = cos(st, t_ctx)`` and ``cos_full = cos(g, t_cont)``.

Outputs under ``workdir/draws/`` (atomic writes):

* ``minimal_pair_rows_ckpt{C}_gen{G}.json``: the §7.3 format (one line, default separators, no
  trailing newline; header ``ckpt_seed, gen_seed, checkpoint_step, n, qzxbt_rate, norm_ratio,
  fluency_gap`` then ``rows``);
* ``token_level_cos_temp{T}.json`` (§7.4) for the pre-registered draw (C = G = config.seed), else
  ``token_level_cos_temp{T}_ckpt{C}_gen{G}.json``;
* ``targets_ckpt{C}_gen{G}.npz`` (t_cont, t_ctx, t_contrast, t_mp, t_mp_bal, the per-probe and
  per-pair sketches) and ``targets_ckpt{C}_gen{G}.json`` (their statistics);
* ``sketches_ckpt{C}_gen{G}.zarr`` / ``grad_norms_ckpt{C}_gen{G}.zarr`` (sketch_store) and
  ``rollouts_ckpt{C}_gen{G}.npz`` (tokens, groups, has_qzxbt, fluency), so estimators can be rerun;
* ``draw_ckpt{C}_gen{G}.settings.json``: the settings the outputs were made with.

Resume: each finished repeat is kept in ``partial_ckpt{C}_gen{G}/rep{r:03d}.npz``, so a killed run
continues at the next repeat. A complete draw whose settings match is skipped; one whose settings
differ raises (outputs are never overwritten; delete them to redo the draw).
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from etils import epath

from behaviortrace_jax.attribution import estimators
from behaviortrace_jax.behavior import behaviors as behaviors_lib, planted as behavior, target_texts
from behaviortrace_jax.io import checkpoints
from behaviortrace_jax.io import files
from behaviortrace_jax.io.files import atomic_write_text, read_json, write_json
from behaviortrace_jax.models import decoder, sampler as sampler_lib, tokenizer as tok_lib
from behaviortrace_jax.sketch import targets
from behaviortrace_jax.io.layout import DrawPaths, RunLayout, as_path
from behaviortrace_jax.models.loader import load_policy
from behaviortrace_jax.sketch.hash_families import SPLITMIX64
from behaviortrace_jax.sketch.stores import open_store, read_store, sketch_metadata
from behaviortrace_jax.stages.registry import register_stage
from behaviortrace_jax.stages.spec import RunSpec

HEADER_KEYS = ("ckpt_seed", "gen_seed", "checkpoint_step", "n", "qzxbt_rate", "norm_ratio", "fluency_gap")
TOKEN_LEVEL_KEYS = ("vs_cont", "vs_ctx", "cos_full")


# --------------------------------------------------------------------------------------------
# names, seeds, settings
# --------------------------------------------------------------------------------------------
def registry_path(workdir: str | os.PathLike) -> epath.Path:
    """The GRPO stage's checkpoint registry: ``workdir/grpo/registry.json`` (SPEC §2.4)."""
    return RunLayout(workdir).registry


def nearest_checkpoint(registry: checkpoints.CheckpointRegistry, target_step: int) -> checkpoints.CheckpointEntry:
    """The entry minimising ``|step - target_step|`` (the earlier step on a tie; SPEC §3.2).

    Raises:
        FileNotFoundError: naming the registry file when it has no checkpoint.
    """
    entries = registry.list()
    if not entries:
        raise FileNotFoundError(f"{registry.path}: no registered checkpoint (run the grpo stage first)")
    return min(entries, key=lambda e: (abs(e.step - int(target_step)), e.step))


def _explicit(beh: behaviors_lib.Behavior) -> tuple[str, ...] | None:
    """The explicit prompts of the draw's behaviour: None (``planted.EXPLICIT_PROMPTS``, SPEC §5.3)
    for the first, :meth:`Behavior.explicit` for another."""
    return None if beh.first else beh.explicit()


def _prompts(beh: behaviors_lib.Behavior) -> list[str]:
    """The draw's prompts of ``beh`` (SPEC §5.6): its explicit prompts, then its probes."""
    return target_texts.context_prompts(beh.probe_sets()[0], _explicit(beh))


def draw_settings(spec: RunSpec, ckpt_seed: int, gen_seed: int,
                  entry: checkpoints.CheckpointEntry, beh: behaviors_lib.Behavior,
                  workdir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Everything the draw of ``beh`` depends on (compared on resume / skip); the checkpoint's path
    relative to ``workdir`` when it lies inside it (a moved workdir keeps its settings)."""
    d, t = spec.draws, spec.targets
    prompts = _prompts(beh)
    return {
        "ckpt_seed": ckpt_seed, "gen_seed": gen_seed, "checkpoint_step": entry.step,
        "checkpoint_path": str(entry.path) if workdir is None else checkpoints.stored_path(workdir, entry.path),
        "target_step": int(d.target_step),
        "group_size": int(d.group_size), "temperature": float(d.temperature), "top_p": float(d.top_p),
        "max_new_tokens": int(d.max_new_tokens), "n_repeats": int(d.n_repeats),
        "token_level_max": int(d.token_level_max), "max_prompt_tokens": int(spec.grpo.max_prompt_tokens),
        "sketch_dim": int(spec.sketch.dim), "sketch_seed": int(spec.sketch.seed),
        "ctx_group_size": int(t.ctx_group_size), "ctx_temperature": float(t.ctx_temperature),
        "ctx_top_p": float(t.ctx_top_p), "ctx_max_new_tokens": spec.ctx_max_new_tokens,
        "param_dtype": str(spec.model.param_dtype), "compute_dtype": str(spec.model.compute_dtype),
        "prompts_sha256": hashlib.sha256("\n".join(prompts).encode()).hexdigest(),
        # the hash family, recorded unless it is splitmix64, the only family before the key existed
        # (so earlier draws still match)
        **({"sketch_hash": f.name} if (f := spec.sketch.hash_family) is not SPLITMIX64 else {}),
    }


def draw_paths(spec: RunSpec, workdir: str | os.PathLike, ckpt_seed: int,
               gen_seed: int, beh: behaviors_lib.Behavior | None = None) -> DrawPaths:
    """The :class:`io.layout.DrawPaths` of draw (ckpt_seed, gen_seed) of ``workdir`` for behaviour
    ``beh`` (None = the run's first, under ``draws/``; another's is under ``draws/<id>/``)."""
    behavior_id = "" if beh is None or beh.first else beh.id
    return RunLayout(workdir).draw(ckpt_seed, gen_seed, temperature=spec.draws.temperature,
                                   run_seed=spec.seed, behavior_id=behavior_id)


# --------------------------------------------------------------------------------------------
# file formats
# --------------------------------------------------------------------------------------------
def rows_file_text(header: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """SPEC §7.3 text: ``HEADER_KEYS`` in order, then ``rows``; ``json.dumps`` default separators,
    one line, no trailing newline.

    Raises:
        ValueError: naming a missing or extra header key, or a row whose first keys are not
            ``estimators.ROW_KEYS`` in order.
    """
    if list(header) != list(HEADER_KEYS):
        raise ValueError(f"rows header keys {list(header)} != {list(HEADER_KEYS)}")
    for i, r in enumerate(rows):
        if tuple(r)[:len(estimators.ROW_KEYS)] != estimators.ROW_KEYS:
            raise ValueError(f"row {i} keys {list(r)} do not start with {list(estimators.ROW_KEYS)}")
    return json.dumps(dict(header, rows=rows))


def token_level_text(vs_cont: list[float], vs_ctx: list[float], cos_full: list[float]) -> str:
    """SPEC §7.4 text: ``{"vs_cont": [...], "vs_ctx": [...], "cos_full": [...]}``, one line, no
    trailing newline."""
    if not len(vs_cont) == len(vs_ctx) == len(cos_full):
        raise ValueError(f"token-level lists differ in length: {len(vs_cont)}, {len(vs_ctx)}, {len(cos_full)}")
    return json.dumps({"vs_cont": [float(x) for x in vs_cont], "vs_ctx": [float(x) for x in vs_ctx],
                       "cos_full": [float(x) for x in cos_full]})


def _atomic_npz(path: epath.Path, **arrays: np.ndarray) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write_text(path, buf.getvalue())


def _load_npz(path: epath.Path) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(as_path(path).read_bytes())) as z:  # a gs:// file too
        return {k: z[k] for k in z.files}


# --------------------------------------------------------------------------------------------
# the draw
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Env:
    """The loaded checkpoint and the jitted machinery of a draw."""

    model_cfg: decoder.DecoderConfig
    params: Any
    tokenizer: Any
    sampler: sampler_lib.Sampler
    ctx_sampler: sampler_lib.Sampler
    sketcher: targets.ForcedSketcher
    eos_ids: tuple[int, ...]  # the sampler's stop set (tokenizer.eos_ids)
    mask_eos_ids: tuple[int, ...]  # masked out of response losses (tokenizer.mask_eos_ids)


def _load_env(spec: RunSpec, hf_dir: epath.Path) -> _Env:
    policy = load_policy(hf_dir, spec.layout, spec.model)
    mesh = policy.mesh  # the params on it as mesh.fsdp says, as the compile stage lowers the draws' programs
    tok, cfg, graphdef, params = policy.tokenizer, policy.model_config, policy.graphdef, policy.params
    eos, pad = tuple(tok_lib.eos_ids(tok)), int(tok_lib.pad_id(tok))

    def make_sampler(n_new: int) -> sampler_lib.Sampler:
        return sampler_lib.Sampler(graphdef, cfg, max_prompt_tokens=spec.grpo.max_prompt_tokens,
                                   max_new_tokens=n_new, eos_ids=eos, pad_id=pad, mesh=mesh)

    s = make_sampler(spec.draws.max_new_tokens)
    n_ctx = spec.ctx_max_new_tokens
    ctx = s if n_ctx == spec.draws.max_new_tokens else make_sampler(n_ctx)
    sk = targets.ForcedSketcher.from_options(spec.forced, graphdef, cfg, params, pad_id=pad, mesh=mesh)
    return _Env(cfg, params, tok, s, ctx, sk, eos, tok_lib.mask_eos_ids(tok, spec.rollouts.mask_eos))


def _targets(spec: RunSpec, env: _Env, key: jax.Array, paths: DrawPaths,
             beh: behaviors_lib.Behavior) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Computes (or reloads) the targets of the draw of ``beh``: (arrays, statistics)."""
    if paths.targets_npz.exists() and paths.targets_json.exists():
        return _load_npz(paths.targets_npz), read_json(paths.targets_json)
    probes = beh.probe_sets()[0]
    pattern = beh.pattern
    cont = targets.continuation_target(env.sketcher, env.params, env.tokenizer, probes, pattern=pattern)
    mp = targets.minimal_pair_target(env.sketcher, env.params, env.tokenizer, pattern=pattern, trigger=beh.trigger)
    t = spec.targets
    ctx = targets.context_target(env.sketcher, env.params, env.ctx_sampler, env.tokenizer, probes, key,
                                 fallback=cont.target, eos_ids=env.mask_eos_ids, group_size=t.ctx_group_size,
                                 temperature=t.ctx_temperature, top_p=t.ctx_top_p,
                                 token_judge=beh.token_judge, pattern=pattern, explicit=_explicit(beh))
    arrays = {"t_cont": cont.target, "t_ctx": ctx.t_ctx, "t_contrast": ctx.t_contrast, "t_mp": mp.target_mp,
              "t_mp_bal": mp.target_mp_bal, "cont_per_probe": cont.per_probe, "ctx_token_sketches": ctx.token_sketches,
              "mp_s_pos": mp.s_pos, "mp_s_neg": mp.s_neg, "mp_ml_pos": mp.ml_pos, "mp_ml_neg": mp.ml_neg}
    stats = {"cont_self_consistency": cont.self_consistency, "fluency_gap": mp.fluency_gap,
             "norm_ratio": mp.norm_ratio, "n_pairs": mp.n_pairs, "ctx_fallback": ctx.ctx_fallback,
             "contrast_fallback": ctx.contrast_fallback, "n_ctx": ctx.n_ctx, "n_contrast": ctx.n_contrast,
             "cos_ctx_cont": targets.cos(ctx.t_ctx, cont.target), "cos_mp_cont": targets.cos(mp.target_mp, cont.target),
             "cos_mp_ctx": targets.cos(mp.target_mp, ctx.t_ctx)}
    _atomic_npz(paths.targets_npz, **arrays)
    write_json(paths.targets_json, stats)
    return arrays, stats


def _repeat(spec: RunSpec, env: _Env, rep: int, key: jax.Array, tg: dict[str, np.ndarray],
            n_token_level: int, beh: behaviors_lib.Behavior) -> dict[str, np.ndarray]:
    """Generates and sketches one repeat of the draw of ``beh`` (26 groups x G); returns its arrays
    (see ``rep*.npz``)."""
    d = spec.draws
    users = _prompts(beh)
    qset = behavior.QzxbtTokenMatcher(env.tokenizer, beh.pattern, beh.token_judge)
    prompt_ids = targets.chat_prompt_ids(env.tokenizer, users, env.sampler.max_prompt_tokens)
    rows = [ids for ids in prompt_ids for _ in range(d.group_size)]
    out = env.sampler.sample(env.params, rows, key, temperature=d.temperature, top_p=d.top_p)
    whole, token, has = [], [], []
    for r, ids in enumerate(rows):
        w, t, h = targets.response_examples(ids, out.tokens[r], out.lengths[r], env.mask_eos_ids, qset)
        whole.append(w)
        has.append(h)
        if h and len(token) < n_token_level:
            token.append((r, t))
    res = env.sketcher(env.params, whole + [t for _, t in token])
    g, st = res.sketches[:len(whole)], res.sketches[len(whole):]
    tl = np.array([[targets.cos(st[i], tg["t_cont"]), targets.cos(st[i], tg["t_ctx"]),
                    targets.cos(g[r], tg["t_cont"])] for i, (r, _) in enumerate(token)], np.float64).reshape(-1, 3)
    groups = rep * len(users) + np.repeat(np.arange(len(users)), d.group_size)
    return {"sketches": g, "grad_norms": res.grad_norms[:len(whole)], "fluency": res.mean_logprob[:len(whole)],
            "has_qzxbt": np.asarray(has, bool), "groups": groups.astype(np.int64), "tokens": out.tokens,
            "lengths": out.lengths, "token_level": tl}


def _check_settings(paths: DrawPaths, settings: dict[str, Any]) -> bool:
    """True if the draw is complete with ``settings``; clears stale partial state; raises on a
    complete draw made with other settings."""
    old = read_json(paths.settings, None)
    complete = paths.rows.exists() and paths.token_level.exists()
    if old == settings:
        return complete
    if complete or (old is None and paths.rows.exists()):
        diff = sorted(k for k in set(settings) | set(old or {}) if (old or {}).get(k) != settings.get(k))
        raise ValueError(f"{paths.rows} exists but was made with other settings (differing: {diff}); "
                         "delete the draw's files under workdir/draws to redo it")
    for p in (paths.targets_npz, paths.targets_json, paths.rollouts):
        files.remove_file(p)
    for p in (paths.partial, paths.sketches, paths.grad_norms):
        files.remove_tree(p)
    paths.root.mkdir(parents=True, exist_ok=True)
    write_json(paths.settings, settings, sort_keys=True)
    return False


def _save_sketches(spec: RunSpec, env: _Env, paths: DrawPaths, cat: dict[str, np.ndarray],
                   settings: dict[str, Any]) -> None:
    """Writes the draw's sketches / grad norms (sketch_store, one chunk per repeat) and rollouts."""
    options = spec.sketch
    rows_per_rep = len(cat["groups"]) // int(spec.draws.n_repeats)
    for path, arr, kind in ((paths.sketches, cat["sketches"], "draw_sketches"),
                            (paths.grad_norms, cat["grad_norms"], "draw_grad_norms")):
        meta = dict(sketch_metadata(options, env.model_cfg, kind), ckpt_seed=settings["ckpt_seed"],
                    gen_seed=settings["gen_seed"], checkpoint_step=settings["checkpoint_step"])
        store = open_store(options, path, arr.shape, rows_per_rep, meta)
        store.write_rows(0, np.asarray(arr, np.float32))
        store.flush()
    _atomic_npz(paths.rollouts, tokens=cat["tokens"], lengths=cat["lengths"], groups=cat["groups"],
                has_qzxbt=cat["has_qzxbt"], fluency=cat["fluency"])


def load_draw(config: ml_collections.ConfigDict, workdir: str | os.PathLike, ckpt_seed: int | None = None,
              gen_seed: int | None = None, beh: behaviors_lib.Behavior | None = None) -> dict[str, Any]:
    """Reads back a finished draw (of behaviour ``beh``; None = the run's first) so estimators can
    be rerun without the model.

    Returns:
        ``{"sketches": float32 [R, D], "grad_norms": float32 [R], "groups": int64 [R],
        "has_qzxbt": bool [R], "fluency": float32 [R], "tokens": int32 [R, N], "lengths": int32 [R],
        "targets": {t_cont, t_ctx, t_contrast, t_mp, t_mp_bal: float32 [D], ...},
        "target_stats": dict, "settings": dict}``.
    Raises:
        FileNotFoundError: naming the missing file (the draw did not finish, or
            ``draws.save_sketches`` was off). ValueError: the draw's sketch stores were written with
            another hash family than ``sketch.hash`` (naming both, ``stores.read_store``).
    """
    spec = RunSpec.from_config(config)
    c_seed, g_seed = spec.draw_seeds(ckpt_seed, gen_seed)
    paths = draw_paths(spec, workdir, c_seed, g_seed, beh)
    for p in (paths.rows, paths.sketches / "metadata.json", paths.grad_norms / "metadata.json", paths.rollouts,
              paths.targets_npz, paths.targets_json, paths.settings):
        if not p.exists():
            raise FileNotFoundError(f"draw file not found: {p}")
    out: dict[str, Any] = dict(_load_npz(paths.rollouts))
    options = spec.sketch
    out["sketches"] = read_store(options, paths.sketches).read()
    out["grad_norms"] = read_store(options, paths.grad_norms).read()
    out["targets"] = _load_npz(paths.targets_npz)
    out["target_stats"] = read_json(paths.targets_json)
    out["settings"] = read_json(paths.settings)
    return out


def run_draws(config: ml_collections.ConfigDict, workdir: str | os.PathLike, ckpt_seed: int | None = None,
              gen_seed: int | None = None, beh: behaviors_lib.Behavior | None = None) -> epath.Path:
    """Runs draw (ckpt_seed, gen_seed) of the run in ``workdir`` (SPEC §5.6, §10.2); see the module doc.

    Args:
        config: the run's config; ``ckpt_seed`` / ``gen_seed`` default to ``config.draws.*``
            (-1 -> ``config.seed``). The checkpoint is read from ``workdir``'s registry, so
            ``ckpt_seed`` must be that run's seed (``config.seed``).
        beh: the behaviour whose prompts, probes and targets the draw uses (None = the run's
            first, ``RunSpec.first_behavior``; another's draw goes under ``draws/<id>/``).
    Returns:
        The path of ``minimal_pair_rows_ckpt{C}_gen{G}.json``.
    Raises:
        ValueError: ``ckpt_seed != config.seed``; a complete draw with other settings exists.
        FileNotFoundError: no registry / checkpoint.
    """
    spec = RunSpec.from_config(config)
    c_seed, g_seed = spec.draw_seeds(ckpt_seed, gen_seed)
    if c_seed != spec.seed:
        raise ValueError(f"draws: ckpt_seed={c_seed} but workdir {workdir} holds the run of seed {spec.seed}; "
                         "pass that run's config and workdir")
    beh = spec.first_behavior if beh is None else beh
    paths = draw_paths(spec, workdir, c_seed, g_seed, beh)
    entry = nearest_checkpoint(checkpoints.CheckpointRegistry(registry_path(workdir)), spec.draws.target_step)
    hf_dir = as_path(entry.path)
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory of step {entry.step} not found: {hf_dir}")
    settings = draw_settings(spec, c_seed, g_seed, entry, beh, workdir)
    if _check_settings(paths, settings):
        logging.info("draws: %s is complete, skipping", paths.rows)
        return paths.rows
    logging.info("draws: ckpt_seed=%d gen_seed=%d at checkpoint step %d (%s)", c_seed, g_seed, entry.step, hf_dir)
    env = _load_env(spec, hf_dir)
    k_rollouts, k_ctx = jax.random.split(jax.random.key(g_seed))
    tg, stats = _targets(spec, env, k_ctx, paths, beh)
    reps, n_tl = [], 0
    for rep in range(int(spec.draws.n_repeats)):
        if paths.rep(rep).exists():
            part = _load_npz(paths.rep(rep))
        else:
            part = _repeat(spec, env, rep, jax.random.fold_in(k_rollouts, rep), tg,
                           int(spec.draws.token_level_max) - n_tl, beh)
            _atomic_npz(paths.rep(rep), **part)
        n_tl += len(part["token_level"])
        reps.append(part)
        logging.info("draws: repeat %d/%d done (pattern rate %.3f)", rep + 1, spec.draws.n_repeats,
                     part["has_qzxbt"].mean())
    cat = {k: np.concatenate([p[k] for p in reps]) for k in reps[0]}
    if spec.draws.save_sketches:
        _save_sketches(spec, env, paths, cat, settings)
    rows = estimators.score_rollout_rows(cat["sketches"], cat["groups"], cat["has_qzxbt"],
                                         {"mp": tg["t_mp"], "mp_bal": tg["t_mp_bal"]}, fluency=cat["fluency"])
    header = {"ckpt_seed": c_seed, "gen_seed": g_seed, "checkpoint_step": entry.step, "n": len(rows),
              "qzxbt_rate": float(np.mean(cat["has_qzxbt"])), "norm_ratio": float(stats["norm_ratio"]),
              "fluency_gap": float(stats["fluency_gap"])}
    tl = cat["token_level"]
    atomic_write_text(paths.token_level, token_level_text(tl[:, 0].tolist(), tl[:, 1].tolist(), tl[:, 2].tolist()))
    atomic_write_text(paths.rows, rows_file_text(header, rows))
    files.remove_tree(paths.partial)
    logging.info("draws: wrote %s (%d rows, pattern rate %.3f)", paths.rows, len(rows), header["qzxbt_rate"])
    return paths.rows


@register_stage("draws")
def draws_stage(config: ml_collections.ConfigDict, workdir: str) -> None:
    """The pre-registered draw (``config.draws.ckpt_seed`` / ``gen_seed``, -1 = ``config.seed``), and
    the same draw for every other behaviour of the run under ``draws/<id>/``."""
    for beh in RunSpec.from_config(config).behaviors:
        run_draws(config, workdir, beh=beh)
