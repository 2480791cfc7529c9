"""Adding a hash family, step by step as docs/architecture.md ("Add a hash family") says, from this
file: a new family (splitmix64 with its seed XORed by a salt, ``SALTED``) is defined and registered
here, resolved from ``sketch.hash`` like the built-in ones, sketched through the public sketcher
API (fused, ``vmap(grad)`` with and without hash tables, ``sketch_vector``) and checked against a
plain-numpy CountSketch with that family's hash; a store written with it refuses to be reopened,
read or compared under another family, naming both."""
from __future__ import annotations

import numpy as np
import pytest

from behaviortrace_jax.sketch import hash_families, splitmix64, stores
from behaviortrace_jax.sketch.countsketch import numpy_countsketch, numpy_sketch
from behaviortrace_jax.sketch.hash_families import HashFamily, hash_family, register_hash_family
from behaviortrace_jax.sketch.sketcher import PerExampleSketcher, completion_loss, hf_param_order, sketch_vector
from behaviortrace_jax.stages.spec import RunSpec
from test_fused_sketcher import DIM, _batch, _decoder, _per_example_grads, _rel

SALT = 0x5A17_5EED_0000_0001  # the new family's hash = splitmix64's with seed ^ SALT
SEED = 3


# Step 1: the JAX hash and its bit-exact numpy reference, with the signatures HashFamily documents.
def salted_index_bucket_sign(offset_hi, offset_lo, local, dim, seed):
    return splitmix64.index_bucket_sign(offset_hi, offset_lo, local, dim, seed ^ SALT)


def salted_numpy_bucket_sign(local, offset, dim, seed):
    return splitmix64.numpy_index_bucket_sign(local, offset, dim, seed ^ SALT)


# Step 2: register it (a config name and a versioned metadata name); no block_sketch: it scatters.
SALTED = register_hash_family(HashFamily(
    name="test-salted-splitmix64", metadata_name="test-salted-splitmix64-v1",
    index_bucket_sign=salted_index_bucket_sign, numpy_bucket_sign=salted_numpy_bucket_sign))


def _config(name: str):
    from configs import tiny

    config = tiny.get_config("smoke")
    config.sketch.hash = name
    return config


def test_registry_resolves_the_new_family_from_the_config_and_refuses_unknown_names():
    from behaviortrace_jax.train import grpo_step

    assert hash_family("test-salted-splitmix64") is SALTED and SALTED.takes_tables and not SALTED.scatter_free
    assert "test-salted-splitmix64" in hash_families.hash_family_names()
    config = _config("test-salted-splitmix64")
    assert RunSpec.from_config(config).step.sketch_hash is SALTED
    assert RunSpec.from_config(config).sketch.hash_family is SALTED
    config.sketch.hash = "salted"
    with pytest.raises(ValueError, match=r"sketch\.hash='salted': expected one of .*'test-salted-splitmix64'"):
        RunSpec.from_config(config).sketch
    assert register_hash_family(SALTED) is SALTED  # the same object again: a no-op
    with pytest.raises(ValueError, match="already registered"):
        register_hash_family(HashFamily("test-salted-splitmix64", "other-v1", salted_index_bucket_sign,
                                        salted_numpy_bucket_sign))
    with pytest.raises(ValueError, match="metadata_name 'splitmix64-countsketch-v3' is 'splitmix64'"):
        register_hash_family(HashFamily("copy", "splitmix64-countsketch-v3", salted_index_bucket_sign,
                                        salted_numpy_bucket_sign))
    with pytest.raises(TypeError, match="block_sketch must be callable"):
        HashFamily("bad", "bad-v1", salted_index_bucket_sign, salted_numpy_bucket_sign, block_sketch=3)


def test_new_family_through_the_sketcher_equals_plain_numpy_countsketch():
    """Fused (scanned layers), vmap(grad) (scanned: the layer scan; unscanned: with hash tables) and
    sketch_vector with the new family equal numpy_countsketch at seed ^ SALT of each example's
    jax.grad gradient (and numpy_sketch with the family), and differ from the default family's."""
    cfg, gd, params = _decoder("llama", False)
    cfg_s, gd_s, _ = _decoder("llama", False, scan=True)
    batch = _batch()
    grads = _per_example_grads(gd, params, batch)
    arrs = [np.asarray(a) for a in hf_param_order(cfg).arrays(grads)]
    refs = [numpy_countsketch(np.concatenate([a[i].ravel() for a in arrs]), DIM, SEED ^ SALT) for i in range(4)]
    for i in range(4):
        assert _rel(numpy_sketch([a[i] for a in arrs], DIM, SEED, SALTED), refs[i]) < 1e-6
    runs = [(gd_s, cfg_s, True, False), (gd_s, cfg_s, False, False), (gd, cfg, False, True)]
    for g, c, fused, tables in runs:
        sk = PerExampleSketcher(completion_loss(g), params, dim=DIM, seed=SEED, chunk_size=5,
                                param_order=hf_param_order(c), tile_elements=3000, fused=fused, use_tables=tables,
                                hash_family=SALTED)
        out = sk(params, batch)
        for i in range(4):
            assert _rel(out.sketches[i], refs[i]) < 1e-5, (fused, tables, i)
    one = sketch_vector([a[1] for a in arrs], hf_param_order(cfg).layout(params), DIM, SEED, hash_family=SALTED)
    assert _rel(one, refs[1]) < 1e-5
    default = sketch_vector([a[1] for a in arrs], hf_param_order(cfg).layout(params), DIM, SEED)
    assert _rel(default, numpy_countsketch(np.concatenate([a[1].ravel() for a in arrs]), DIM, SEED)) < 1e-5
    assert _rel(default, refs[1]) > 0.5


def test_a_store_of_one_family_is_refused_under_another_naming_both(tmp_path):
    from behaviortrace_jax.attribution.scores import check_same_sketch

    cfg, _, _ = _decoder("llama", False)
    salted, default = (RunSpec.from_config(_config(n)).sketch for n in ("test-salted-splitmix64", "splitmix64"))
    made = {}
    for name, options in (("salted", salted), ("default", default)):
        meta = stores.sketch_metadata(options, cfg, "targets_continuation")
        assert meta["hash_family"] == options.hash_family.metadata_name
        made[name] = stores.open_store(options, tmp_path / f"{name}.zarr", (2, DIM), 1, meta)
        made[name].write_rows(0, np.ones((2, DIM), np.float32))
        made[name].flush()
    assert stores.read_store(salted, tmp_path / "salted.zarr").metadata["hash_family"] == "test-salted-splitmix64-v1"
    meta = stores.sketch_metadata(default, cfg, "targets_continuation")
    attempts = [lambda: stores.open_store(default, tmp_path / "salted.zarr", (2, DIM), 1, meta),
                lambda: stores.read_store(default, tmp_path / "salted.zarr"),
                lambda: stores.read_store(salted, tmp_path / "default.zarr")]
    for attempt in attempts:
        with pytest.raises(ValueError, match="hash_family") as err:
            attempt()
        assert "hash family 'test-salted-splitmix64'" in str(err.value), str(err.value)
        assert "hash family 'splitmix64'" in str(err.value), str(err.value)
    with pytest.raises(ValueError, match="'test-salted-splitmix64-v1' vs 'splitmix64-countsketch-v3'"):
        check_same_sketch(made["salted"], made["default"])
