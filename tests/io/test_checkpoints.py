"""checkpoints.py: JSON v1 registry (SPEC §2.4, §9 test_checkpoint_registry) and orbax train states."""
from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from behaviortrace_jax.io import checkpoints as ck
from behaviortrace_jax.io.checkpoints import CheckpointRegistry


# ---------------------------------------------------------------- registry
def test_empty_registry(tmp_path):
    reg = CheckpointRegistry(tmp_path / "registry.json")
    assert reg.list() == [] and reg.latest() is None and reg.at_step(100) is None
    assert reg.nearest_at_or_before(10**6) is None


def test_register_persists_sorted_and_queries(tmp_path):
    path = tmp_path / "run" / "registry.json"
    reg = CheckpointRegistry(path)
    for step in (500, 100, 250):
        reg.register(step, f"/ckpt/step_{step:08d}", {"regime": "grpo", "model": "Qwen/Qwen2.5-1.5B-Instruct"})
    again = CheckpointRegistry(path)
    assert [e.step for e in again.list()] == [100, 250, 500]
    assert again.latest().step == 500 and again.at_step(250).path == "/ckpt/step_00000250"
    assert again.at_step(300) is None and again.at_step(250).metadata["regime"] == "grpo"
    assert [getattr(again.nearest_at_or_before(s), "step", None) for s in (99, 100, 300, 750, 10000)] == \
        [None, 100, 250, 500, 500]
    with pytest.raises(ValueError, match="already registered"):
        again.register(250, "/elsewhere")
    data = json.loads(path.read_text())
    assert path.read_text() == json.dumps(data, indent=2, sort_keys=True)
    assert data["version"] == 1 and [c["step"] for c in data["checkpoints"]] == [100, 250, 500]
    assert set(data["checkpoints"][0]) == {"step", "path", "metadata"}
    assert sorted(p.name for p in path.parent.iterdir()) == ["registry.json"]  # no .tmp left


def test_registry_bad_input(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"version": 999, "checkpoints": []}))
    with pytest.raises(ValueError, match=r"r\.json: registry version mismatch"):
        CheckpointRegistry(tmp_path / "r.json")
    (tmp_path / "r.json").write_text("{")
    with pytest.raises(ValueError, match="invalid JSON"):
        CheckpointRegistry(tmp_path / "r.json")
    (tmp_path / "r.json").write_text(json.dumps({"version": 1, "checkpoints": [{"path": "x"}]}))
    with pytest.raises(ValueError, match="malformed"):
        CheckpointRegistry(tmp_path / "r.json")


# ---------------------------------------------------------------- orbax train states
def _state(hidden: int = 8, layers: int = 2, seed: int = 0):
    k = jax.random.key(seed)
    params = {f"layer{i}": {"w": jax.random.normal(jax.random.fold_in(k, i), (hidden, 4)),
                            "b": jnp.full((hidden,), 0.5, jnp.bfloat16)} for i in range(layers)}
    opt = optax.adamw(1e-3)
    opt_state = opt.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = opt.update(grads, opt_state, params)
    return {"params": params, "opt_state": opt_state, "step": jnp.asarray(7, jnp.int32), "rng": jax.random.key(42)}


def _assert_equal(a, b):
    ka, kb = a.pop("rng"), b.pop("rng")
    assert jnp.array_equal(jax.random.key_data(ka), jax.random.key_data(kb))
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb and all(x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def test_train_state_round_trip_latest_and_sharding(tmp_path):
    state = _state()
    ck.save_train_state(tmp_path, 7, state)
    ck.save_train_state(tmp_path, 14, jax.tree.map(lambda x: x, state))
    assert ck.latest_step(tmp_path) == 14 and ck.complete_steps(tmp_path) == [7, 14]
    with pytest.raises(ValueError, match="already exists"):
        ck.save_train_state(tmp_path, 7, state)
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    abstract = jax.eval_shape(lambda: _state())
    sharding = NamedSharding(mesh, P("data"))
    abstract["params"]["layer0"]["w"] = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=sharding)
    restored = ck.restore_train_state(tmp_path, None, abstract)
    assert restored["params"]["layer0"]["w"].sharding == sharding
    assert jax.dtypes.issubdtype(restored["rng"].dtype, jax.dtypes.prng_key)
    _assert_equal(restored, _state())
    with pytest.raises(FileNotFoundError, match="no complete train-state checkpoint"):
        ck.restore_train_state(tmp_path, 21, abstract)
    assert ck.latest_step(tmp_path / "absent") is None


def test_half_written_step_dirs_are_ignored(tmp_path):
    state = _state()
    ck.save_train_state(tmp_path, 5, state)
    # what a killed save leaves: orbax's tmp dir (renamed only when complete) ...
    shutil.copytree(tmp_path / "5", tmp_path / "9.orbax-checkpoint-tmp-1234")
    (tmp_path / "9.orbax-checkpoint-tmp-1234" / ck.COMMIT_FILE).unlink()
    # ... or a step dir that never received orbax's commit marker
    shutil.copytree(tmp_path / "5", tmp_path / "12")
    (tmp_path / "12" / ck.COMMIT_FILE).unlink()
    assert ck.latest_step(tmp_path) == 5
    with pytest.raises(FileNotFoundError):
        ck.restore_train_state(tmp_path, 12, jax.eval_shape(_state))
    _assert_equal(ck.restore_train_state(tmp_path, None, jax.eval_shape(_state)), _state())
    ck.save_train_state(tmp_path, 12, state)  # the resumed run re-saves that step over the debris
    assert ck.complete_steps(tmp_path) == [5, 12]
    _assert_equal(ck.restore_train_state(tmp_path, 12, jax.eval_shape(_state)), _state())


def test_checkpoint_of_a_different_model_raises(tmp_path):
    ck.save_train_state(tmp_path, 3, _state(hidden=8))
    mismatch = r"shape mismatch: opt_state/0/mu/layer0/b: stored \(8,\) vs requested \(16,\)"
    with pytest.raises(ValueError, match=mismatch):
        ck.restore_train_state(tmp_path, 3, jax.eval_shape(lambda: _state(hidden=16)))
    with pytest.raises(ValueError, match=r"missing in checkpoint: \['opt_state/0/mu/layer2/b'"):
        ck.restore_train_state(tmp_path, 3, jax.eval_shape(lambda: _state(layers=3)))
    with pytest.raises(ValueError, match=r"not in the requested state: \['opt_state/0/mu/layer1/b'"):
        ck.restore_train_state(tmp_path, 3, jax.eval_shape(lambda: _state(layers=1)))


def test_train_state_accepts_relative_and_home_paths(tmp_path, monkeypatch):
    """orbax refuses relative paths; the library resolves them (the README's relative --workdir)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    state = {"w": jnp.arange(3.0), "step": jnp.int32(1)}
    for directory in ("rel/state", "~/state"):
        ck.save_train_state(directory, 1, state)
        assert ck.latest_step(directory) == 1
        np.testing.assert_array_equal(ck.restore_train_state(directory, 1, state)["w"], state["w"])
    assert (tmp_path / "rel" / "state" / "1").is_dir() and (tmp_path / "home" / "state" / "1").is_dir()
