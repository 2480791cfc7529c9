"""The fused one-backward per-example sketcher (sketch/fused.py) pinned against the vmap(grad) path and
numpy: every family, tied and untied heads, scanned and unscanned layers, remat, 1 and 3 devices, a
model axis, bfloat16, and the weighted gradient sum. (transformers' gradients: tests/sketch/test_sketcher.py.)"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from behaviortrace_jax.models import decoder, families, sharding
from behaviortrace_jax.sketch import fused
from behaviortrace_jax.sketch.countsketch import numpy_countsketch
from behaviortrace_jax.sketch.sketcher import PerExampleSketcher, completion_loss, hf_param_order

DIM = 2**12
VOCAB = 80


def _decoder(family, tie, scan=False, remat=False, dtype="float32"):
    """(config, graphdef, params): a 2-layer tiny decoder; the parameters are the unscanned model's
    (the same values whatever ``scan``), the graphdef the requested one."""
    cfg = families.preset("tiny", family, vocab_size=VOCAB, num_hidden_layers=2, tie_word_embeddings=tie,
                          param_dtype=dtype, compute_dtype=dtype)
    _, params = nnx.split(decoder.init_model(cfg, seed=3), nnx.Param)
    cfg = cfg.replace(scan_layers=scan)
    graphdef, _ = nnx.split(decoder.abstract_model(cfg, remat=remat), nnx.Param)
    return cfg, graphdef, params


def _batch(b=5, t=12, seed=4):
    """Left padding on row 1, repeated tokens on row 2 (a tied embedding's rows add up), a row with
    no scored token (row 4: zero loss, zero gradient)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, (b, t))
    ids[2, 4:9] = 7
    am = np.ones((b, t), np.int32)
    am[1, :3] = 0
    lm = np.broadcast_to(np.arange(t) >= 5, (b, t)).astype(np.float32).copy()
    lm[4] = 0
    return {"input_ids": jnp.asarray(ids, jnp.int32), "attention_mask": jnp.asarray(am), "loss_mask": jnp.asarray(lm)}


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _flat(cfg, grads) -> np.ndarray:
    return np.concatenate([np.asarray(a, np.float64).ravel() for a in hf_param_order(cfg).arrays(grads)])


CASES = [("qwen2", True, False), ("llama", False, True), ("qwen3", False, False)]  # each family, tied/untied, scan/not
SLOW = [(f, t, s) for f in ("qwen2", "llama", "qwen3") for t in (True, False) for s in (False, True)
        if (f, t, s) not in CASES]


def _per_example_grads(gd, params, batch):
    """jax.grad of each example's loss (one jitted vmap), float64 numpy [B, P] in HF order."""
    g = jax.jit(jax.vmap(jax.grad(completion_loss(gd)), in_axes=(None, 0)))(params, batch)
    return g


@pytest.mark.parametrize("family,tie,scan", CASES + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW])
def test_fused_equals_vmap_grad_and_numpy(family, tie, scan):
    """Sketches, norms and group norms of the fused path equal the numpy CountSketch and norms of
    each example's gradient (jax.grad, unscanned model) and the weighted sum equals sum_i c_i grad_i;
    the first case also against the vmap(grad) sketcher (the current implementation). Small row
    tiles exercise the tiling."""
    cfg, gd, params = _decoder(family, tie)
    cfg_f, gd_f, _ = _decoder(family, tie, scan=scan)
    batch = _batch()
    order = hf_param_order(cfg)
    sk = PerExampleSketcher(completion_loss(gd_f), params, dim=DIM, chunk_size=5, param_order=hf_param_order(cfg_f),
                            tile_elements=3000)
    assert sk.fused and sk.scan_layers == scan
    coef = jnp.asarray([0.5, -1.0, 2.0, 0.25, 3.0], jnp.float32)
    out, gsum, vals = jax.jit(lambda p, b: sk.sketch_and_sum(p, b, coefficients=coef))(params, batch)
    grads = _per_example_grads(gd, params, batch)
    arrs = [np.asarray(a, np.float64).reshape(5, -1) for a in order.arrays(grads)]
    vecs = np.concatenate(arrs, axis=1)
    names, gidx = sk.group_names, sk._group_idx
    for i in range(5):
        ref = numpy_countsketch(vecs[i], DIM, 0)
        assert _rel(out.sketches[i], ref) < 1e-5 or not np.any(ref)
        np.testing.assert_allclose(float(out.norms[i]), np.linalg.norm(vecs[i]), rtol=1e-5, atol=1e-7)
        groups = [np.sqrt(sum(np.sum(arrs[k][i] ** 2) for k in range(len(arrs)) if gidx[k] == j))
                  for j in range(len(names))]
        np.testing.assert_allclose(np.asarray(out.group_norms[i]), groups, rtol=1e-5, atol=1e-7)
    assert float(out.norms[4]) == 0 and not np.any(np.asarray(out.sketches[4]))
    assert _rel(_flat(cfg, gsum), np.asarray(coef, np.float64) @ vecs) < 1e-5
    loss = completion_loss(gd)
    np.testing.assert_allclose(vals, jax.vmap(loss, in_axes=(None, 0))(params, batch), rtol=1e-6)
    if (family, tie, scan) == CASES[0]:
        ref_sk = PerExampleSketcher(completion_loss(gd), params, dim=DIM, chunk_size=2, param_order=order, fused=False)
        ref = ref_sk(params, batch)
        np.testing.assert_allclose(out.sketches, ref.sketches, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out.norms, ref.norms, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(out.group_norms, ref.group_norms, rtol=1e-5, atol=1e-7)


def test_tied_embedding_norm_is_the_norm_of_the_sum():
    """A tied embedding/lm_head is one parameter with two uses: its group norm is the norm of the
    sum of the head part H_i and the embedding rows E_i (repeated tokens summed), which differs from
    sqrt(|H_i|^2 + |E_i|^2): the two parts are measured apart in an untied copy whose lm_head holds
    the same weights."""
    cfg, gd, params = _decoder("qwen2", True)
    batch = _batch()
    sk = PerExampleSketcher(completion_loss(gd), params, dim=DIM, chunk_size=5, param_order=hf_param_order(cfg))
    out = sk(params, batch)
    col = sk.group_names.index("model.embed_tokens")
    cfg_u = cfg.replace(tie_word_embeddings=False)
    gd_u, _ = nnx.split(decoder.abstract_model(cfg_u), nnx.Param)
    flat = list(nnx.to_flat_state(params))
    emb = dict(flat)[("model", "embed_tokens", "weight")]
    params_u = nnx.from_flat_state(flat + [(("lm_head", "weight"), emb)])
    for i in (0, 2):
        ex = jax.tree.map(lambda x: x[i], batch)
        tied = np.asarray(jax.grad(completion_loss(gd))(params, ex)["model"]["embed_tokens"]["weight"][...], np.float64)
        gu = jax.grad(completion_loss(gd_u))(params_u, ex)
        rows = np.asarray(gu["model"]["embed_tokens"]["weight"][...], np.float64)
        head = np.asarray(gu["lm_head"]["weight"][...], np.float64)
        np.testing.assert_allclose(tied, rows + head, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(float(out.group_norms[i, col]), np.linalg.norm(tied), rtol=1e-5)
        apart = np.sqrt(np.sum(rows ** 2) + np.sum(head ** 2))
        assert abs(apart - np.linalg.norm(tied)) > 1e-3 * np.linalg.norm(tied)  # the cross term matters
    assert len(set(np.asarray(batch["input_ids"][2]).tolist())) < 12  # row 2 repeats a token


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_remat_does_not_change_fused_sketches(scan):
    cfg, gd, params = _decoder("qwen2", False, scan=scan)
    _, gd_r, _ = _decoder("qwen2", False, scan=scan, remat=True)
    batch = _batch()
    order = hf_param_order(cfg)
    a = PerExampleSketcher(completion_loss(gd), params, dim=DIM, chunk_size=5, param_order=order)(params, batch)
    b = PerExampleSketcher(completion_loss(gd_r), params, dim=DIM, chunk_size=5, param_order=order)(params, batch)
    np.testing.assert_allclose(b.sketches, a.sketches, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b.norms, a.norms, rtol=1e-6)


@pytest.mark.parametrize("scan,model", [(False, 2), pytest.param(True, 1, marks=pytest.mark.slow)])
def test_fused_on_3_devices_equals_one_device(scan, model):
    """shard_map over a data axis of 3 devices (and a model axis of 2 with the parameters split by
    the partition rules): the same sketches, norms and gradient sum as one device."""
    devs = np.array(jax.devices())
    if devs.size < 6:
        pytest.skip("needs the 8 fake CPU devices of tests/conftest.py")
    cfg, gd, params = _decoder("qwen3", True, scan=scan)
    batch = _batch(b=6, seed=9)
    order = hf_param_order(cfg)
    one = PerExampleSketcher(completion_loss(gd), params, dim=DIM, chunk_size=2, param_order=order)
    ref, ref_sum, _ = jax.jit(one.sketch_and_sum)(params, batch)
    mesh = Mesh(devs[:3 * model].reshape(3, model), ("data", "model"))
    on_mesh = jax.device_put(params, sharding.param_shardings(params, mesh))
    sk = PerExampleSketcher(completion_loss(gd), params, dim=DIM, chunk_size=2, param_order=order, mesh=mesh)
    assert sk.mesh is mesh and sk.fused
    sbatch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    out, gsum, _ = jax.jit(sk.sketch_and_sum)(on_mesh, sbatch)
    np.testing.assert_allclose(out.sketches, ref.sketches, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.norms, ref.norms, rtol=1e-5)
    np.testing.assert_allclose(out.group_norms, ref.group_norms, rtol=1e-5, atol=1e-7)
    assert _rel(_flat(cfg, gsum), _flat(cfg, ref_sum)) < 1e-5


def test_bfloat16_fused_sketches_track_float32():
    """bf16 parameters and compute (the paper dtype): the fused sketches of the bf16 model equal
    the float32 sketches of the same (bf16-rounded) weights to bf16 precision, no worse than the
    vmap(grad) path's (which forms bf16 per-example gradients; the fused path forms them in float32)."""
    cfg16, gd16, p16 = _decoder("qwen2", True, dtype="bfloat16")
    cfg32 = cfg16.replace(param_dtype="float32", compute_dtype="float32")
    gd32, _ = nnx.split(decoder.abstract_model(cfg32), nnx.Param)
    p32 = jax.tree.map(lambda x: x.astype(jnp.float32), p16)
    batch = _batch()
    order = hf_param_order(cfg16)
    ref = PerExampleSketcher(completion_loss(gd32), p32, dim=DIM, chunk_size=5, param_order=order)(p32, batch)
    out = PerExampleSketcher(completion_loss(gd16), p16, dim=DIM, chunk_size=5, param_order=order)(p16, batch)
    old = PerExampleSketcher(completion_loss(gd16), p16, dim=DIM, chunk_size=5, param_order=order,
                             fused=False)(p16, batch)
    for i in range(4):
        err, err_old = _rel(out.sketches[i], ref.sketches[i]), _rel(old.sketches[i], ref.sketches[i])
        assert err < 0.05 and err < 2 * err_old + 1e-3, (i, err, err_old)
    np.testing.assert_allclose(out.norms[:4], ref.norms[:4], rtol=0.05)


def test_decoder_loss_and_bad_inputs():
    cfg, gd, params = _decoder("llama", True)
    batch = _batch()
    loss = completion_loss(gd)
    assert isinstance(loss, fused.DecoderLoss)
    ex = jax.tree.map(lambda x: x[0], batch)
    # A batch of one and row 0 of a batch of B: the same loss up to the matmul kernels' blocking, which
    # XLA:CPU picks by batch size and CPU type (1 ulp apart on an AMD EPYC, equal on an Intel Xeon).
    np.testing.assert_allclose(loss(params, ex), loss.per_example(params, batch, None)[0], rtol=1e-6)

    def generic(p, e):
        return loss(p, e)

    with pytest.raises(ValueError, match="DecoderLoss"):
        PerExampleSketcher(generic, params, dim=DIM, param_order=hf_param_order(cfg), fused=True)
    assert not PerExampleSketcher(generic, params, dim=DIM, param_order=hf_param_order(cfg)).fused
    sk = PerExampleSketcher(loss, params, dim=DIM, param_order=hf_param_order(cfg), use_tables=True)
    assert sk.fused and not sk.use_tables and sk.tables is None  # the fused path hashes on the fly
    with pytest.raises(ValueError, match="coefficients"):
        sk.sketch_and_sum(params, batch, coefficients=jnp.ones(3))
    with pytest.raises(ValueError, match="cache"):
        model = nnx.merge(gd, params)
        model(batch["input_ids"], decoder.positions_from_mask(batch["attention_mask"]), batch["attention_mask"],
              cache=decoder.init_cache(cfg, 5, 12), cache_index=0, taps=object())
