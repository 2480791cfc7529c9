"""Per-example gradient sketcher (SPEC §3.2): vmap(grad) + CountSketch, chunking, memory, sharding."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from behaviortrace_jax.sketch.countsketch import numpy_countsketch, sketch_tree
from behaviortrace_jax.sketch.param_layout import ParamLayout
from behaviortrace_jax.sketch.sketcher import (PerExampleSketcher, flat_params, sketch_vector, tree_param_order)

DIM = 2**12


def _mlp_params(d_in=16, d_h=32, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    return {"layer1": {"w": jax.random.normal(k[0], (d_in, d_h)) / 4, "b": 0.1 * jax.random.normal(k[1], (d_h,))},
            "layer2": {"w": jax.random.normal(k[2], (d_h, 1)) / 4}}


def _mlp_loss(p, ex):
    h = jnp.tanh(ex["x"] @ p["layer1"]["w"] + p["layer1"]["b"])
    return jnp.mean((h @ p["layer2"]["w"] - ex["y"]) ** 2)


def _batch(b, d_in=16, seed=1):
    rng = np.random.default_rng(seed)
    return {"x": jnp.asarray(rng.standard_normal((b, 3, d_in)), jnp.float32),
            "y": jnp.asarray(rng.standard_normal((b, 3, 1)), jnp.float32)}


def _rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def test_matches_loop_of_single_example_gradients():
    params, batch = _mlp_params(), _batch(7)
    sk = PerExampleSketcher(_mlp_loss, params, dim=DIM, seed=5, chunk_size=3)  # 7 = 3 + 3 + 1 (+2 padding)
    assert sk.layout.names == ("layer1.b", "layer1.w", "layer2.w")
    assert sk.group_names == ("layer1", "layer2")
    out = sk(params, batch)
    assert out.sketches.shape == (7, DIM) and out.sketches.dtype == jnp.float32
    assert out.norms.shape == (7,) and out.group_norms.shape == (7, 2)
    for i in range(7):
        ex = jax.tree.map(lambda x: x[i], batch)
        g = jax.grad(_mlp_loss)(params, ex)
        flat = [np.asarray(g["layer1"]["b"]), np.asarray(g["layer1"]["w"]), np.asarray(g["layer2"]["w"])]
        vec = np.concatenate([f.ravel() for f in flat])
        assert _rel(out.sketches[i], numpy_countsketch(vec, DIM, 5)) < 1e-5
        np.testing.assert_allclose(out.norms[i], np.linalg.norm(vec), rtol=1e-5)
        layer1 = np.concatenate([flat[0].ravel(), flat[1].ravel()])
        np.testing.assert_allclose(out.group_norms[i], [np.linalg.norm(layer1), np.linalg.norm(flat[2])], rtol=1e-5)


def test_chunk_size_and_tables_do_not_change_results():
    params, batch = _mlp_params(), _batch(10)
    ref = PerExampleSketcher(_mlp_loss, params, dim=DIM, chunk_size=1)(params, batch)
    for c, tables in ((4, False), (10, False), (32, False), (3, True)):
        out = PerExampleSketcher(_mlp_loss, params, dim=DIM, chunk_size=c, use_tables=tables)(params, batch)
        np.testing.assert_allclose(out.sketches, ref.sketches, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out.norms, ref.norms, rtol=1e-6)
        np.testing.assert_allclose(out.group_norms, ref.group_norms, rtol=1e-6)


def test_peak_memory_bounded_by_chunk_not_batch():
    """Compiled temp memory grows with chunk_size, not with the batch size (params = 256 x 256)."""
    params = _mlp_params(d_in=256, d_h=256)

    def temp(b, c):
        sk = PerExampleSketcher(_mlp_loss, params, dim=DIM, chunk_size=c)
        return sk.lower(params, _batch(b, d_in=256)).compile().memory_analysis().temp_size_in_bytes

    grad_bytes = 4 * sum(x.size for x in jax.tree.leaves(params))
    small, big_b, full = temp(8, 2), temp(64, 2), temp(64, 64)
    assert big_b < small + 8 * grad_bytes  # 8x the batch, about the same memory
    assert full > big_b + 30 * grad_bytes  # chunk 64 holds ~64 per-example gradients


def test_sharded_params_give_same_sketches():
    devs = np.array(jax.devices())
    if devs.size < 8:
        pytest.skip("needs the 8 fake CPU devices of tests/conftest.py")
    params, batch = _mlp_params(d_in=16, d_h=32), _batch(12)
    sk = PerExampleSketcher(_mlp_loss, params, dim=DIM, chunk_size=4)
    ref = sk(params, batch)
    mesh = Mesh(devs.reshape(2, 4), ("data", "model"))
    specs = {"layer1": {"w": P(None, "model"), "b": P("model")}, "layer2": {"w": P("model", None)}}
    sharded = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
    sbatch = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("data"))), batch)
    out = sk(sharded, sbatch)
    np.testing.assert_allclose(out.sketches, ref.sketches, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.norms, ref.norms, rtol=1e-6)
    replicated = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), params)
    np.testing.assert_allclose(sk(replicated, batch).sketches, ref.sketches, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tables,model", [(False, 1), (True, 1), (False, 2)])
def test_shard_map_over_data_axis_gives_same_sketches(tables, model):
    """mesh= runs the chunked loop per device under jax.shard_map (batch P('data'), params P());
    examples are independent, so sketches and norms equal the one-device ones (to float rounding)."""
    devs = np.array(jax.devices())
    if devs.size < 8:
        pytest.skip("needs the 8 fake CPU devices of tests/conftest.py")
    params, batch = _mlp_params(d_in=16, d_h=32), _batch(12)
    ref = PerExampleSketcher(_mlp_loss, params, dim=DIM, chunk_size=2)(params, batch)
    mesh = Mesh(devs[:4 * model].reshape(4, model), ("data", "model"))
    sk = PerExampleSketcher(_mlp_loss, params, dim=DIM, chunk_size=2, use_tables=tables, mesh=mesh)
    assert sk.mesh is mesh
    text = sk.lower(params, batch).as_text()
    assert "shard_map" in text or "manual" in text.lower()
    out = sk(params, batch)
    np.testing.assert_allclose(out.sketches, ref.sketches, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.norms, ref.norms, rtol=1e-6)
    np.testing.assert_allclose(out.group_norms, ref.group_norms, rtol=1e-6)
    # a batch the data axis does not divide runs the plain loop
    odd = jax.tree.map(lambda x: x[:7], batch)
    np.testing.assert_allclose(sk(params, odd).sketches, ref.sketches[:7], rtol=1e-5, atol=1e-6)


def test_sketch_vector_tree_and_list():
    params = _mlp_params()
    g = jax.grad(_mlp_loss)(params, jax.tree.map(lambda x: x[0], _batch(1)))
    order = tree_param_order(params)
    a = jax.jit(lambda g: sketch_vector(g, order, DIM, 3))(g)
    arrs = order.arrays(g)
    b = sketch_vector(arrs, ParamLayout(order.names, tuple(x.shape for x in arrs)), DIM, 3)
    np.testing.assert_allclose(a, b, rtol=1e-6)
    ref = numpy_countsketch(np.concatenate([np.asarray(x).ravel() for x in arrs]), DIM, 3)
    assert _rel(a, ref) < 1e-6
    np.testing.assert_allclose(b, sketch_tree(arrs, order.layout(params), DIM, 3), rtol=1e-6)


def test_bad_inputs_raise():
    params = _mlp_params()
    with pytest.raises(ValueError, match="chunk_size"):
        PerExampleSketcher(_mlp_loss, params, chunk_size=0)
    with pytest.raises(ValueError, match="power of two"):
        PerExampleSketcher(_mlp_loss, params, dim=1000)
    sk = PerExampleSketcher(_mlp_loss, params, dim=DIM)
    with pytest.raises(ValueError, match="leading"):
        sk(params, {"x": jnp.ones((4, 3, 16)), "y": jnp.ones((5, 3, 1))})
    order = tree_param_order(params)
    with pytest.raises(KeyError, match="layer2"):
        order.arrays({"layer1": params["layer1"]})
    with pytest.raises(ValueError, match="outside the parameter order"):
        order.arrays({**params, "extra": jnp.ones(3)})
    with pytest.raises(ValueError, match="ParamOrder"):
        sketch_vector(params, order.layout(params), DIM)


def test_flat_params_of_nnx_state_drops_value_attribute():
    from flax import nnx

    class M(nnx.Module):
        def __init__(self):
            self.dense = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

    _, state = nnx.split(M(), nnx.Param)
    assert set(flat_params(state)) == {("dense", "kernel"), ("dense", "bias")}


@pytest.mark.parametrize("tie,fused", [(True, True), (True, False), pytest.param(False, True, marks=pytest.mark.slow),
                                      pytest.param(False, False, marks=pytest.mark.slow)])
def test_qwen2_per_rollout_sketch_matches_pytorch(tmp_path, tie, fused):
    """JAX per-example sketches of -(masked mean completion log-prob) of a tiny Qwen2 equal the numpy
    CountSketch of transformers' per-example gradients in HF ``model.parameters()`` order (SPEC §3.2),
    on both sketcher paths (the fused one-backward sketcher and vmap(grad))."""
    torch = pytest.importorskip("torch")
    from flax import nnx
    from transformers import AutoModelForCausalLM

    from behaviortrace_jax.models import hf_io
    from behaviortrace_jax.sketch.sketcher import completion_loss, hf_param_order
    from tests.hf_fixtures import save_random_qwen2

    hf_dir = save_random_qwen2(tmp_path / "hf", tie=tie, tokenizer=False)
    model = hf_io.load_hf_checkpoint(hf_dir)
    graphdef, params = nnx.split(model, nnx.Param)
    eos, b, t, p_len = 2, 3, 16, 6
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 320, (b, t))
    am = np.ones((b, t), np.int64)
    am[1, :2] = 0  # left padding on rollout 1
    ids[1, :2] = eos
    ids[0, 12:] = eos  # rollout 0 stops early: EOS then EOS padding (mask = token != eos)
    ids[2, 9] = eos  # an EOS inside a completion is masked too
    loss_mask = ((np.arange(t) >= p_len)[None] & (ids != eos)).astype(np.float32)
    batch = {"input_ids": jnp.asarray(ids, jnp.int32), "attention_mask": jnp.asarray(am, jnp.int32),
             "loss_mask": jnp.asarray(loss_mask)}
    order = hf_param_order(model.config)
    sk = PerExampleSketcher(completion_loss(graphdef), params, dim=2**14, chunk_size=2, param_order=order,
                            fused=fused)
    assert sk.fused == fused
    out = sk(params, batch)

    tm = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").float().eval()
    named = list(tm.named_parameters())
    assert [n for n, _ in named] == list(sk.layout.names)
    assert [tuple(p.shape) for _, p in named] == list(sk.layout.shapes)
    pos = np.maximum(np.cumsum(am, axis=1) - 1, 0)
    for i in range(b):
        tm.zero_grad(set_to_none=True)
        logits = tm(input_ids=torch.tensor(ids[i:i + 1]), attention_mask=torch.tensor(am[i:i + 1]),
                    position_ids=torch.tensor(pos[i:i + 1])).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, torch.tensor(ids[i:i + 1, 1:, None]))[..., 0]
        m = torch.tensor(loss_mask[i:i + 1, 1:])
        (-(logp * m).sum() / m.sum()).backward()
        vec = np.concatenate([p.grad.detach().numpy().ravel() for _, p in named])
        assert _rel(out.sketches[i], numpy_countsketch(vec, 2**14, 0)) < 1e-4
        np.testing.assert_allclose(out.norms[i], np.linalg.norm(vec), rtol=1e-4)
        emb = np.linalg.norm(dict(named)["model.embed_tokens.weight"].grad.numpy())
        np.testing.assert_allclose(out.group_norms[i, sk.group_names.index("model.embed_tokens")], emb, rtol=1e-4)
    assert sk.group_names[:2] == ("model.embed_tokens", "model.layers.0")
    assert sk.group_names[-1] == ("model.norm" if tie else "lm_head")


def _tiny_decoder(family: str, scan: bool, layers: int = 3):
    from flax import nnx

    from behaviortrace_jax.models import decoder, families

    cfg = families.preset("tiny", family, vocab_size=80, num_hidden_layers=layers, scan_layers=scan)
    graphdef, params = nnx.split(decoder.init_model(cfg.replace(scan_layers=False), seed=3), nnx.Param)
    if scan:
        graphdef, _ = nnx.split(decoder.abstract_model(cfg), nnx.Param)
    return cfg, graphdef, params


def _rollout_batch(b=6, t=12, vocab=80):
    rng = np.random.default_rng(4)
    am = np.ones((b, t), np.int32)
    am[1, :3] = 0
    return {"input_ids": jnp.asarray(rng.integers(0, vocab, (b, t)), jnp.int32), "attention_mask": jnp.asarray(am),
            "loss_mask": jnp.asarray((np.arange(t) >= 5)[None].repeat(b, 0), jnp.float32)}


@pytest.mark.parametrize("family,fused", [pytest.param("qwen2", False, marks=pytest.mark.slow), ("qwen2", True),
                                          pytest.param("llama", False, marks=pytest.mark.slow),
                                          pytest.param("qwen3", False, marks=pytest.mark.slow)])
def test_scan_layers_sketches_equal_unrolled(family, fused):
    """model.scan_layers: the decoder scans over its layers and the sketcher differentiates with
    respect to the stacked layers and sketches them in a lax.scan (traced per-layer offsets; fused:
    inside the scan's own backward); the sketches equal the unrolled sketcher's (same hashes;
    gradients to fp32 rounding) and the numpy CountSketch of the per-example gradients."""
    from behaviortrace_jax.sketch.sketcher import completion_loss, hf_param_order

    cfg, gd, params = _tiny_decoder(family, False)
    cfg_s, gd_s, _ = _tiny_decoder(family, True)
    batch = _rollout_batch()
    ref_sk = PerExampleSketcher(completion_loss(gd), params, dim=DIM, chunk_size=4, param_order=hf_param_order(cfg),
                                fused=fused)
    sk = PerExampleSketcher(completion_loss(gd_s), params, dim=DIM, chunk_size=4, param_order=hf_param_order(cfg_s),
                            fused=fused)
    assert sk.scan_layers and not ref_sk.scan_layers and sk.layout == ref_sk.layout
    assert "while" in sk.lower(params, batch).as_text()
    ref, out = ref_sk(params, batch), sk(params, batch)
    assert _rel(out.sketches, np.asarray(ref.sketches)) < 2e-6  # the gradients differ by fp32 rounding only
    np.testing.assert_allclose(out.sketches, ref.sketches, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.norms, ref.norms, rtol=1e-6)
    np.testing.assert_allclose(out.group_norms, ref.group_norms, rtol=1e-6)
    loss = completion_loss(gd)
    for i in (0, 1):
        g = jax.grad(loss)(params, jax.tree.map(lambda x: x[i], batch))
        vec = np.concatenate([np.asarray(a).ravel() for a in hf_param_order(cfg).arrays(g)])
        assert _rel(out.sketches[i], numpy_countsketch(vec, DIM, 0)) < 1e-5
    # the same gradients sketched both ways are bit-identical (same hashes, same scatter order)
    g = jax.grad(loss)(params, jax.tree.map(lambda x: x[0], batch))
    a = jax.jit(lambda g: sketch_vector(g, hf_param_order(cfg), DIM, 0))(g)
    b = jax.jit(lambda g: sketch_vector(g, hf_param_order(cfg_s), DIM, 0))(g)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_scan_layers_sketch_and_sum_and_shard_map():
    """sketch_and_sum with scan_layers: the summed gradient comes back in the parameters' own
    (unstacked) structure and equals the unrolled one; under shard_map over a data mesh of fake CPU
    devices the sketches equal the one-device ones. The reference is the unrolled vmap(grad) path,
    the scanned sketcher the fused one."""
    from behaviortrace_jax.sketch.sketcher import completion_loss, hf_param_order

    devs = np.array(jax.devices())
    if devs.size < 8:
        pytest.skip("needs the 8 fake CPU devices of tests/conftest.py")
    cfg, gd, params = _tiny_decoder("qwen2", False, layers=2)
    cfg_s, gd_s, _ = _tiny_decoder("qwen2", True, layers=2)
    batch = _rollout_batch(b=8)
    ref_sk = PerExampleSketcher(completion_loss(gd), params, dim=DIM, chunk_size=1, param_order=hf_param_order(cfg),
                                fused=False)
    ref, ref_sum, ref_vals = jax.jit(ref_sk.sketch_and_sum)(params, batch)
    mesh = Mesh(devs[:4].reshape(4, 1), ("data", "model"))
    on_mesh = jax.device_put(params, NamedSharding(mesh, P()))
    for m, p in ((None, params), (mesh, on_mesh)):
        sk = PerExampleSketcher(completion_loss(gd_s), params, dim=DIM, chunk_size=1,
                                param_order=hf_param_order(cfg_s), mesh=m)
        out, gsum, vals = jax.jit(sk.sketch_and_sum)(p, batch)
        assert jax.tree.structure(gsum) == jax.tree.structure(ref_sum)
        for x, y in zip(jax.tree.leaves(gsum), jax.tree.leaves(ref_sum)):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(vals, ref_vals, rtol=1e-6)
        np.testing.assert_allclose(out.sketches, ref.sketches, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(sk(p, batch).sketches, ref.sketches, rtol=1e-5, atol=1e-6)
    text = sk.lower(on_mesh, batch).as_text()
    assert "shard_map" in text or "manual" in text.lower()
    with pytest.raises(ValueError, match="use_tables"):
        PerExampleSketcher(completion_loss(gd_s), params, dim=DIM, param_order=hf_param_order(cfg_s), use_tables=True,
                           fused=False)


def test_sketch_and_sum_acc_dtype():
    """sketch_and_sum(acc_dtype=bfloat16): the gradient sum in bf16 (half the memory), equal to the
    float32 sum to bf16 rounding; the sketches do not depend on it."""
    params, batch = _mlp_params(), _batch(6)
    sk = PerExampleSketcher(_mlp_loss, params, dim=DIM, chunk_size=2)
    out32, g32, v32 = jax.jit(sk.sketch_and_sum)(params, batch)
    out16, g16, v16 = jax.jit(lambda p, b: sk.sketch_and_sum(p, b, acc_dtype=jnp.bfloat16))(params, batch)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(g32))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(g16))
    for x, y in zip(jax.tree.leaves(g32), jax.tree.leaves(g16)):
        np.testing.assert_allclose(np.asarray(y, np.float32), x, rtol=2e-2, atol=2e-2 * float(jnp.max(jnp.abs(x))))
    np.testing.assert_array_equal(out16.sketches, out32.sketches)
    np.testing.assert_array_equal(v16, v32)


def test_sketch_and_sum_coefficients():
    """sketch_and_sum(coefficients=w): the sum is sum_i w_i grad loss_i (a padded last chunk included,
    and per device under shard_map), while sketches and losses stay the unweighted ones."""
    params, batch = _mlp_params(), _batch(6)
    w = jnp.asarray([0.5, -2.0, 0.0, 1.0, 3.0, 0.25], jnp.float32)
    per = [jax.grad(_mlp_loss)(params, jax.tree.map(lambda x: x[i], batch)) for i in range(6)]
    want = jax.tree.map(lambda *g: sum(float(w[i]) * g[i] for i in range(6)), *per)
    devs = np.array(jax.devices())
    meshes = [None] + ([Mesh(devs[:2].reshape(2, 1), ("data", "model"))] if devs.size >= 2 else [])
    plain = PerExampleSketcher(_mlp_loss, params, dim=DIM, chunk_size=4)
    ref, _, ref_vals = jax.jit(plain.sketch_and_sum)(params, batch)
    for mesh in meshes:
        sk = PerExampleSketcher(_mlp_loss, params, dim=DIM, chunk_size=4, mesh=mesh)  # 6 = 4 + a padded 2
        out, gsum, vals = jax.jit(lambda p, b, w: sk.sketch_and_sum(p, b, coefficients=w))(params, batch, w)
        for x, y in zip(jax.tree.leaves(gsum), jax.tree.leaves(want)):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out.sketches, ref.sketches, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(vals, ref_vals, rtol=1e-6)
    with pytest.raises(ValueError, match="coefficients of shape"):
        plain.sketch_and_sum(params, batch, coefficients=jnp.ones(5))
