"""The Pallas kernel of the per-example sketch of a matmul weight use (sketch/pallas_sketch.py), in
interpret mode on CPU, against numpy's block-family CountSketch of the explicit per-example
gradients and the XLA fused sketcher (sketch/fused.py); and its TPU compile for v5e:2x4 with libtpu."""
from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from behaviortrace_jax.models import decoder, families
from behaviortrace_jax.sketch import fused, hash_families, pallas_sketch
from behaviortrace_jax.sketch.sketcher import PerExampleSketcher, completion_loss, hf_param_order
from behaviortrace_jax.sketch.splitmix64 import split_u64

BLOCK, SPLITMIX64 = hash_families.BLOCK, hash_families.SPLITMIX64


def _numpy_block_sketch(g: np.ndarray, offset: int, dim: int, seed: int) -> np.ndarray:
    """float64 [dim]: the block family's CountSketch of one flattened gradient at global ``offset``
    (an explicit bucket per coordinate, bincount)."""
    v = np.asarray(g, np.float64).reshape(-1)
    bucket, sign = BLOCK.numpy_bucket_sign(np.arange(v.size, dtype=np.uint64), offset, dim, seed)
    return np.bincount(bucket, sign * v, minlength=dim)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# (B, N tokens, out, in, D, offset, tile_target, token_tile): rows and tokens that do not divide the
# tiles (40 rows in tiles of 16; 37 tokens in chunks of 128 past a token tile of 16), several blocks
# per tile and tiles that start inside a block, an offset past 2**32 (the (hi, lo) carry)
SHAPES = [(3, 37, 40, 256, 1024, 123_457, 4096, 16),
          (2, 5, 20, 384, 2048, (1 << 32) - 1000, 1 << 19, 512),
          (4, 9, 7, 128, 1024, 77, 2048, 512)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_equals_numpy_and_xla_fused(shape, dtype):
    bsz, n, out, inn, dim, offset, tile_target, token_tile = shape
    rng = np.random.default_rng(sum(shape[:4]))
    x = jnp.asarray(rng.standard_normal((bsz, n, inn)), dtype)
    dy = jnp.asarray(rng.standard_normal((bsz, n, out)), dtype)
    coef = jnp.asarray(rng.standard_normal(bsz), jnp.float32)
    hi, lo = (jnp.asarray(a[0]) for a in split_u64([offset]))
    acc0 = jnp.asarray(rng.standard_normal((bsz, dim)), jnp.float32)  # the kernel adds to what it is given
    acc, sq, dw = pallas_sketch.matmul_sketch(acc0, x, dy, coef, hi, lo, dim, seed=5, interpret=True,
                                              tile_target=tile_target, token_tile=token_tile)
    g = np.einsum("bnr,bni->bri", np.asarray(dy, np.float64), np.asarray(x, np.float64))  # explicit dW_b
    want = np.stack([_numpy_block_sketch(g[b], offset, dim, 5) for b in range(bsz)]) + np.asarray(acc0)
    assert _rel(acc, want) < 1e-5
    np.testing.assert_allclose(sq, np.sum(g * g, axis=(1, 2)), rtol=1e-5)
    np.testing.assert_allclose(dw, np.einsum("b,bri->ri", np.asarray(coef, np.float64), g), rtol=1e-4, atol=1e-4)
    # the XLA fused sketcher's own tiles (fused._matrix_grads, block family) give the same
    cfg = fused._Cfg(dim, 5, 1, 1 << 12, True, dtype=dtype, hash_family=BLOCK)
    where = (hi, lo, jnp.int32(0))
    sq0 = jnp.zeros((bsz, 1), jnp.float32)
    xla = fused._matrix_grads(cfg, acc0, sq0, dy, x, coef, where, (out, inn))
    assert _rel(acc, xla[0]) < 1e-5
    np.testing.assert_allclose(sq, xla[1][:, 0], rtol=1e-5)
    np.testing.assert_allclose(dw, xla[2], rtol=1e-4, atol=1e-4)
    # sketches only (no weight cotangent)
    acc2, sq2, none = pallas_sketch.matmul_sketch(acc0, x, dy, None, hi, lo, dim, seed=5, interpret=True,
                                                  tile_target=tile_target, token_tile=token_tile)
    assert none is None and _rel(acc2, want) < 1e-5 and _rel(sq2, sq) < 1e-6


def test_kernel_refusals():
    assert pallas_sketch.check_kernel("pallas", BLOCK) == "pallas"
    with pytest.raises(ValueError, match="sketch.hash='block'"):
        pallas_sketch.check_kernel("pallas", SPLITMIX64)
    with pytest.raises(ValueError, match="sketch.kernel='cuda'"):
        pallas_sketch.check_kernel("cuda", BLOCK)
    assert not pallas_sketch.kernel_supported((64, 100), 4096)  # in not a multiple of 128: XLA path
    assert not pallas_sketch.kernel_supported((64, 128), 512)  # D below 1024
    with pytest.raises(ValueError, match="kernel_supported"):
        pallas_sketch.matmul_sketch(jnp.zeros((1, 512)), jnp.zeros((1, 3, 128)), jnp.zeros((1, 3, 8)), None,
                                    0, 0, 512, interpret=True)


@pytest.mark.parametrize("tie", [False, True])
def test_fused_sketcher_with_kernel_equals_xla_and_numpy(tie):
    """A 1-layer qwen2 decoder (every kind of matmul weight once; each one's in is a multiple of 128:
    all go through the kernel; the untied head too): the fused sketcher with the kernel gives the XLA block path's
    sketches, norms and weighted sum, and numpy's sketch of each example's jax.grad."""
    dim = 4096
    cfg = families.preset("tiny", "qwen2", vocab_size=80, num_hidden_layers=1, tie_word_embeddings=tie)
    _, params = nnx.split(decoder.init_model(cfg, seed=3), nnx.Param)
    gd, _ = nnx.split(decoder.abstract_model(cfg), nnx.Param)
    rng = np.random.default_rng(0)
    batch = {"input_ids": jnp.asarray(rng.integers(0, 80, (3, 10)), jnp.int32),
             "attention_mask": jnp.ones((3, 10), jnp.int32),
             "loss_mask": jnp.asarray(np.arange(10) >= 4, jnp.float32)[None].repeat(3, 0)}
    coef = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)
    order = hf_param_order(cfg)
    run = {}
    for kernel in ("interpret", "xla"):
        sk = PerExampleSketcher(completion_loss(gd), params, dim=dim, chunk_size=3, param_order=order,
                                hash_family=BLOCK, kernel=kernel)
        run[kernel] = jax.jit(lambda p, b, sk=sk: sk.sketch_and_sum(p, b, coefficients=coef))(params, batch)
    (out_k, sum_k, _), (out_x, sum_x, _) = run["interpret"], run["xla"]
    assert _rel(out_k.sketches, out_x.sketches) < 1e-5
    np.testing.assert_allclose(out_k.group_norms, out_x.group_norms, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(sum_k), jax.tree.leaves(sum_x)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-4, atol=1e-6)
    grads = jax.jit(jax.vmap(jax.grad(completion_loss(gd)), in_axes=(None, 0)))(params, batch)
    arrays = order.arrays(grads)
    offsets = order.layout(params).offsets
    for b in range(3):
        want = sum(_numpy_block_sketch(np.asarray(a[b]), off, dim, 0) for a, off in zip(arrays, offsets))
        assert _rel(out_k.sketches[b], want) < 1e-4


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed (pip install -e '.[tpu]')")
def test_kernel_compiles_for_tpu_v5e():
    """The Mosaic (TPU) kernel lowers and compiles for a v5e chip of v5e:2x4, on CPU with libtpu,
    and declares its cost (pl.CostEstimate: XLA counts its FLOPs and bytes)."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    dev = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4").devices[0]
    sds = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=SingleDeviceSharding(dev))  # noqa: E731
    bsz, n, out, inn, dim = 2, 600, 300, 1536, 65536
    fn = jax.jit(lambda acc, x, dy, c, h, l: pallas_sketch.matmul_sketch(acc, x, dy, c, h, l, dim))
    compiled = fn.lower(sds((bsz, dim), jnp.float32), sds((bsz, n, inn), jnp.bfloat16),
                        sds((bsz, n, out), jnp.bfloat16), sds((bsz,), jnp.float32), sds((), jnp.uint32),
                        sds((), jnp.uint32)).compile()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    assert ca["flops"] >= 2 * bsz * n * out * inn  # the declared per-example matmuls are counted
    assert 0 < ca["bytes accessed"] < 1e9
    # the compile report's loop-counted cost (host CPU cost model) adds what the kernel declares
    from behaviortrace_jax.aot.cost import loop_counted_cost

    counted = loop_counted_cost(compiled)
    assert abs(counted["flops"] / ca["flops"] - 1) < 0.01


def test_auto_choice_per_backend_and_explicit_choices():
    """sketch.hash / sketch.kernel "auto": CPU -> splitmix64 on the XLA path, TPU -> block + the
    Pallas kernel, GPU -> block on the XLA path; explicit choices are kept; a kernel the family
    cannot take is refused naming sketch.kernel."""
    choose = hash_families.choose_sketch
    assert choose("auto", "auto", "cpu") == (SPLITMIX64, "xla")
    assert choose("auto", "auto", "tpu") == (BLOCK, "pallas")
    assert choose("auto", "auto", "gpu") == (BLOCK, "xla")
    assert choose("splitmix64", "auto", "tpu") == (SPLITMIX64, "xla")
    assert choose("block", "auto", "cpu") == (BLOCK, "xla")
    assert choose("block", "interpret", "cpu") == (BLOCK, "interpret")
    assert choose("auto", "xla", "tpu") == (BLOCK, "xla")
    assert choose("auto", "auto") == choose("auto", "auto", jax.default_backend())
    with pytest.raises(ValueError, match=r"sketch\.kernel='pallas'.*sketch\.hash='block'"):
        choose("splitmix64", "pallas", "tpu")
    with pytest.raises(ValueError, match=r"sketch\.hash='blocks'"):
        choose("blocks", "auto", "tpu")


def test_auto_choice_through_the_config_and_the_stores(tmp_path):
    """The default config ("auto") keeps splitmix64 / XLA on CPU (stores' metadata as before: no
    sketch_kernel key), takes block + kernel for TPU in every constructor that reads the config
    (RunSpec.from_config(config, platform): its SketchOptions, GRPOStepSpec and compile variants,
    ForcedSketchOptions), records both in the stores' metadata, and a
    store of one backend's family is refused by the other's options (never compared)."""
    from behaviortrace_jax.io import sketch_store
    from behaviortrace_jax.sketch import stores, targets
    from behaviortrace_jax.stages.spec import RunSpec
    from configs import tiny

    config = tiny.get_config("smoke")
    assert (config.sketch.hash, config.sketch.kernel) == ("auto", "auto")
    cpu_spec, tpu_spec = RunSpec.from_config(config, "cpu"), RunSpec.from_config(config, "tpu")
    cpu, tpu = cpu_spec.sketch, tpu_spec.sketch
    assert (cpu.hash_family, cpu.kernel, tpu.hash_family, tpu.kernel) == (SPLITMIX64, "xla", BLOCK, "pallas")
    spec = tpu_spec.step
    assert (spec.sketch_hash, spec.sketch_kernel) == (BLOCK, "pallas")
    assert cpu_spec.step.sketch_hash is SPLITMIX64
    assert all(s.sketch_hash is BLOCK for s in tpu_spec.compile.step_variants)
    cfg = families.preset("tiny", "qwen2", vocab_size=80, num_hidden_layers=1)
    gd, abstract = nnx.split(decoder.abstract_model(cfg), nnx.Param)
    fs = targets.ForcedSketcher.from_options(tpu_spec.forced, gd, cfg, abstract, pad_id=0)
    assert fs.sketcher.hash_family is BLOCK and fs.sketcher._plan.kernel == "pallas"
    meta_cpu = stores.sketch_metadata(cpu, cfg, "targets_continuation")
    meta_tpu = stores.sketch_metadata(tpu, cfg, "targets_continuation")
    assert meta_cpu["hash_family"] == SPLITMIX64.metadata_name and "sketch_kernel" not in meta_cpu
    assert meta_tpu["hash_family"] == BLOCK.metadata_name and meta_tpu["sketch_kernel"] == "pallas"
    stores.open_store(cpu, tmp_path / "s.zarr", (2, 64), 1, meta_cpu)
    with pytest.raises(ValueError, match="two hash families cannot be compared"):
        stores.open_store(tpu, tmp_path / "s.zarr", (2, 64), 1, meta_tpu)
    with sketch_store.SketchStore.open_or_create(tmp_path / "s.zarr", (2, 64), 1, meta_cpu) as store:
        store.write_rows(0, np.ones((2, 64), np.float32))
    assert stores.read_store(cpu, tmp_path / "s.zarr").read().sum() == 128
    with pytest.raises(ValueError, match="two hash families cannot be compared"):
        stores.read_store(tpu, tmp_path / "s.zarr")
