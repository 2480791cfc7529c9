"""The scatter-free block hash family (``sketch.hash = "block"``, sketch/block_hash.py) against its
plain-numpy reference: random vectors, the tiny decoder's per-example gradients through the vmap(grad)
and the fused sketcher (tied and untied heads, scanned and unscanned layers), its unbiasedness and
variance over hash seeds, the config key, and the sketch stores' hash family."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from behaviortrace_jax.io import sketch_store
from behaviortrace_jax.sketch import block_hash as bh, countsketch as cs, splitmix64 as sm
from behaviortrace_jax.sketch.hash_families import hash_family
from behaviortrace_jax.sketch.param_layout import ParamLayout
from behaviortrace_jax.sketch.hash_tables import layout_tables
from behaviortrace_jax.sketch.sketcher import PerExampleSketcher, completion_loss, hf_param_order, sketch_vector
from behaviortrace_jax.stages.spec import RunSpec
from test_fused_sketcher import DIM, _batch, _decoder, _per_example_grads, _rel

BLOCK = hash_family("block")  # the family by its config name, as the config resolves it
SHAPES = [(5, 30), (64,), (3,), (7, 20, 2), (129,)]  # partial last blocks, an exact block, a tiny one


def _arrays(rng, shapes=SHAPES, batch=()):
    return [rng.standard_normal(batch + s).astype(np.float32) for s in shapes]


def test_block_reference_equals_jax_on_random_vectors():
    """sketch_tree / sketch_batch / sketch_vector with the block family equal numpy_sketch (an
    explicit per-coordinate bucket + bincount); block_sketch_at equals it for a traced, unaligned
    first coordinate and a parameter offset across 2**32; index_bucket_sign is bit-exact."""
    rng = np.random.default_rng(0)
    dim = 64
    layout = ParamLayout.from_entries([(f"p{k}", s) for k, s in enumerate(SHAPES)])
    grads = _arrays(rng, batch=(3,))
    for seed in (0, 12345):
        ref = np.stack([cs.numpy_sketch([g[c] for g in grads], dim, seed, BLOCK) for c in range(3)])
        batch = jax.jit(lambda gs: cs.sketch_batch(gs, layout, dim, seed, hash_family=BLOCK))(grads)
        np.testing.assert_allclose(batch, ref, rtol=1e-5, atol=1e-5)
        one = jax.jit(lambda gs: cs.sketch_tree(gs, layout, dim, seed, hash_family=BLOCK))([g[1] for g in grads])
        np.testing.assert_allclose(one, ref[1], rtol=1e-5, atol=1e-5)
        vec = sketch_vector([g[2] for g in grads], layout, dim, seed, hash_family=BLOCK)
        np.testing.assert_allclose(vec, ref[2], rtol=1e-5, atol=1e-5)
    offset, first, n = 2**32 - 100, 70, 300
    g = rng.standard_normal((2, n)).astype(np.float32)
    hi, lo = sm.split_u64([offset])
    got = jax.jit(lambda g, f: bh.block_sketch_at(g, hi[0], lo[0], f, dim, 5))(g, jnp.uint32(first))
    local = np.arange(first, first + n, dtype=np.uint64)
    bucket, sign = bh.numpy_block_bucket_sign(local, offset, dim, 5)
    np.testing.assert_allclose(got, [np.bincount(bucket, sign * r, minlength=dim) for r in g], rtol=1e-5, atol=1e-5)
    jb, js = BLOCK.index_bucket_sign(hi[0], lo[0], jnp.asarray(local.astype(np.uint32)), dim, 5)
    assert np.array_equal(np.asarray(jb), bucket) and np.array_equal(np.asarray(js), sign)
    _, sm_sign = sm.numpy_bucket_sign(local + np.uint64(offset), dim, 5)
    assert np.array_equal(sign, sm_sign)  # the signs are the splitmix64 family's
    whole = bh.numpy_block_bucket_sign(np.arange(128, dtype=np.uint64), offset, dim, 5)[0]
    assert sorted(whole[64:]) == list(range(dim))  # a whole block: its coordinates never collide


@pytest.mark.parametrize("family,tie,scan", [("qwen2", True, False), ("llama", False, True)])
def test_block_sketches_of_tiny_decoder_gradients(family, tie, scan):
    """The vmap(grad) and the fused sketcher with the block family equal numpy_sketch(.., BLOCK) of
    each example's jax.grad gradient (tied and untied heads, scanned and unscanned layers; small
    row tiles make the fused path sketch unaligned tiles), and differ from the splitmix64 sketch."""
    cfg, gd, params = _decoder(family, tie)
    cfg_s, gd_s, _ = _decoder(family, tie, scan=scan)
    batch = _batch()
    grads = _per_example_grads(gd, params, batch)
    arrs = [np.asarray(a) for a in hf_param_order(cfg).arrays(grads)]
    refs = [cs.numpy_sketch([a[i] for a in arrs], DIM, 0, BLOCK) for i in range(4)]
    for fused in (True, False):
        sk = PerExampleSketcher(completion_loss(gd_s), params, dim=DIM, chunk_size=5, param_order=hf_param_order(cfg_s),
                                tile_elements=3000, fused=fused, hash_family=BLOCK)
        out = sk(params, batch)
        for i in range(4):
            assert _rel(out.sketches[i], refs[i]) < 1e-5, (fused, i)
        assert not np.any(np.asarray(out.sketches[4]))  # no scored token: zero gradient
    assert _rel(cs.numpy_sketch([a[0] for a in arrs], DIM, 0), refs[0]) > 0.5


def test_block_inner_products_are_unbiased_with_the_stated_variance():
    """Over 3000 random hash seeds the block family's <S a, S b> averages to <a, b> (within 4 standard
    errors), its variance is block_pair_variance (within 15 %), which is at most the splitmix64
    bound (|a|^2 |b|^2 + <a, b>^2) / D, and the splitmix64 family's own variance stays below that bound."""
    rng = np.random.default_rng(1)
    dim = 32
    a = _arrays(rng)
    b = [0.6 * x + rng.standard_normal(x.shape).astype(np.float32) for x in a]
    fa, fb = (np.concatenate([x.ravel() for x in v]).astype(np.float64) for v in (a, b))
    exact = float(fa @ fb)
    bound = (float(fa @ fa) * float(fb @ fb) + exact ** 2) / dim
    var = bh.block_pair_variance(a, b, dim)
    assert 0.5 * bound < var <= bound
    seeds = [int(s) for s in rng.integers(0, 2**63, 3000, dtype=np.uint64)]
    for name in ("block", "splitmix64"):
        est = np.array([float(np.dot(cs.numpy_sketch(a, dim, s, hash_family(name)).astype(np.float64),
                                     cs.numpy_sketch(b, dim, s, hash_family(name)).astype(np.float64))) for s in seeds])
        assert abs(est.mean() - exact) < 4 * np.sqrt(bound / len(seeds)), name
        if name == "block":
            assert 0.85 * var < est.var() < 1.15 * var
        else:
            assert est.var() < 1.15 * bound


def test_hash_config_key_tables_and_store_family(tmp_path):
    """sketch.hash is checked (the error names the key); the block family takes no hash tables; the
    draw settings name it (a finished splitmix64 draw is not skipped); the stores record its family
    and refuse to reopen under the other."""
    from behaviortrace_jax.behavior import behaviors
    from behaviortrace_jax.io import checkpoints
    from behaviortrace_jax.sketch import stores
    from behaviortrace_jax.stages import draws
    from behaviortrace_jax.train import grpo_step
    from configs import tiny

    assert hash_family("splitmix64").metadata_name == "splitmix64-countsketch-v3"  # what earlier stores recorded
    assert BLOCK.metadata_name == "splitmix64-block-countsketch-v1"
    config = tiny.get_config("smoke")
    config.sketch.hash = "blocks"
    with pytest.raises(ValueError, match=r"sketch\.hash='blocks'"):
        RunSpec.from_config(config).step
    config.sketch.hash = "block"
    assert RunSpec.from_config(config).step.sketch_hash is BLOCK
    entry, beh = checkpoints.CheckpointEntry(20, "ckpt"), RunSpec.from_config(config).first_behavior
    block_draw = draws.draw_settings(RunSpec.from_config(config), 0, 0, entry, beh)
    config.sketch.hash = "splitmix64"
    default_draw = draws.draw_settings(RunSpec.from_config(config), 0, 0, entry, beh)
    assert block_draw.pop("sketch_hash") == "block" and block_draw == default_draw  # a finished draw is not reused
    config.sketch.hash = "block"
    cfg, gd, params = _decoder("qwen2", True)
    with pytest.raises(ValueError, match="targets.use_tables"):
        PerExampleSketcher(completion_loss(gd), params, dim=DIM, param_order=hf_param_order(cfg), use_tables=True,
                           hash_family=BLOCK)
    layout = ParamLayout.from_entries([("w", (4,))])
    with pytest.raises(ValueError, match="in_run_tables"):
        cs.sketch_tree([jnp.ones(4)], layout, 64, tables=layout_tables(layout, 64), hash_family=BLOCK)
    meta = stores.sketch_metadata(RunSpec.from_config(config).sketch, cfg, "targets_continuation")
    assert meta["hash_family"] == BLOCK.metadata_name
    sketch_store.SketchStore.open_or_create(tmp_path / "s.zarr", (2, DIM), 1, meta)
    config.sketch.hash = "splitmix64"
    with pytest.raises(ValueError, match="hash_family"):
        sketch_store.SketchStore.open_or_create(tmp_path / "s.zarr", (2, DIM), 1,
                                                stores.sketch_metadata(RunSpec.from_config(config).sketch, cfg,
                                                                       "targets_continuation"))


@pytest.mark.slow
def test_smoke_grpo_and_sketch_stages_with_the_block_hash(smoke_sft, tmp_path):
    """The smoke run's sketch-producing stages (grpo with in-run sketches, sketch) run with
    sketch.hash="block"; every store they write records the block family, and the sketch stage
    refuses to resume them under splitmix64 (the pipeline already, by the stage fingerprints)."""
    from behaviortrace_jax import pipeline
    from behaviortrace_jax.stages.registry import STAGES
    from conftest import copy_start

    config, start = smoke_sft
    config = config.copy_and_resolve_references()
    config.stages, config.sketch.hash, config.targets.use_tables = "grpo,sketch", "block", False
    w = copy_start(start, tmp_path)
    pipeline.run(config, str(w))
    metas = sorted((w / "sketches").glob("*.zarr"))
    names = {p.stem for p in metas}
    assert {"rollout_sketches", "step_sketches", "targets_continuation", "checkpoint_rollout_sketches"} <= names
    for p in metas:
        assert sketch_store.SketchStore.open(p).metadata["hash_family"] == BLOCK.metadata_name, p
    step = sketch_store.SketchStore.open(w / "sketches" / "step_sketches.zarr").read()
    assert np.all(np.isfinite(step)) and np.any(step)
    config.stages, config.sketch.hash = "sketch", "splitmix64"
    with pytest.raises(ValueError, match=r"sketch\.hash: 'block' \(recorded\) -> 'splitmix64' \(now\)"):
        pipeline.run(config, str(w))  # the stage fingerprints (stages/fingerprint.py), before any stage runs
    with pytest.raises(ValueError, match="hash_family"):
        STAGES["sketch"](config, str(w))  # the stage itself: its stores' metadata
