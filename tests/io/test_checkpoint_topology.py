"""Train-state checkpoints across topologies (issue 32, item 6): a state saved on one device is
restored onto every mesh a config builds (2 and 4 of the 8 forced host devices, data and model
axes, FSDP on and off), from a checkpoint with its saved shardings and from one without them, with
the same values; and a state saved sharded over 4 devices comes back onto 1, and onto a process
with 2 devices only, with or without shardings in the request (orbax's "Topology mismatch" before)."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx

from behaviortrace_jax.io import checkpoints
from behaviortrace_jax.models import decoder, qwen2, sharding
from behaviortrace_jax.train import train_state

OPTIM = train_state.OptimOptions(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, grad_clip=1.0)
CFG = qwen2.Qwen2Config.tiny(vocab_size=64, num_hidden_layers=2)
# (data, model, fsdp): meshes of 1, 2 and 4 devices
MESHES = [(1, 1, False), (2, 1, False), (2, 1, True), (4, 1, False), (4, 1, True), (2, 2, False), (2, 2, True),
          (1, 4, False)]


def _abstract(mesh, fsdp):
    """The abstract train state a stage builds for ``mesh`` (as ``train.start_state``)."""
    _, abstract_params = nnx.split(decoder.abstract_model(CFG), nnx.Param)
    tx = train_state.make_optimizer(OPTIM)
    sh = train_state.train_state_shardings(tx, sharding.param_shardings(abstract_params, mesh, fsdp=fsdp),
                                           mesh, abstract_params)
    return train_state.abstract_train_state(abstract_params, tx, sh), tx


def _trained_state(mesh, fsdp):
    """A state with non-zero moments (two updates) on ``mesh``."""
    abstract, tx = _abstract(mesh, fsdp)
    _, params = nnx.split(decoder.init_model(CFG, seed=1), nnx.Param)
    params = sharding.put(params, jax.tree.map(lambda a: a.sharding, abstract.params))
    state = train_state.init_train_state(params, tx, 7)
    for k in range(2):
        grads = jax.tree.map(lambda p, k=k: (0.1 * (k + 1)) * jax.numpy.cos(p), state.params)
        updates, opt = tx.update(grads, state.opt_state, state.params)
        state = state.replace(params=jax.tree.map(lambda p, u: p + u, state.params, updates), opt_state=opt,
                              step=state.step + 1)
    return state


def _host(tree):
    def leaf(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(jax.device_get(x))
    return jax.tree.map(leaf, tree)


def _drop_saved_shardings(directory, step):
    """Removes orbax's saved sharding metadata (``_sharding``) from ``directory/<step>``."""
    found = [p for p in (directory / str(step)).rglob("_sharding")]
    assert found, "orbax wrote no _sharding file to drop"
    for p in found:
        p.unlink()


@pytest.fixture(scope="module")
def saved_on_one(tmp_path_factory):
    """(directory with saved shardings, directory without, the state's host values): saved on 1 device."""
    one = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    state = _trained_state(one, False)
    with_sh, without = tmp_path_factory.mktemp("with_sh"), tmp_path_factory.mktemp("without_sh")
    for d in (with_sh, without):
        train_state.save(d, state)
    _drop_saved_shardings(without, 2)
    return with_sh, without, _host(state.as_dict())


@pytest.mark.parametrize("data, model, fsdp", MESHES)
@pytest.mark.parametrize("saved_shardings", (True, False))
def test_restore_onto_another_mesh(saved_on_one, data, model, fsdp, saved_shardings):
    with_sh, without, want = saved_on_one
    mesh = sharding.make_mesh(data, model, devices=jax.devices()[:data * model])
    abstract, _ = _abstract(mesh, fsdp)
    state = train_state.restore(with_sh if saved_shardings else without, abstract)
    got = state.as_dict()
    # every leaf lies on the requested mesh, as requested
    for leaf, a in zip(jax.tree.leaves(got), jax.tree.leaves(abstract.as_dict())):
        assert leaf.sharding.is_equivalent_to(a.sharding, leaf.ndim), (leaf.sharding, a.sharding)
    # and holds the saved values
    jax.tree.map(np.testing.assert_array_equal, _host(got), want)


@pytest.mark.parametrize("fsdp", (False, True))
def test_state_saved_on_four_devices_restores_onto_one(tmp_path, fsdp):
    four = sharding.make_mesh(2, 2, devices=jax.devices()[:4])
    state = _trained_state(four, fsdp)
    train_state.save(tmp_path, state)
    _drop_saved_shardings(tmp_path, 2)
    one = sharding.make_mesh(1, 1, devices=jax.devices()[4:5])  # another device than any saving one
    abstract, _ = _abstract(one, False)
    got = train_state.restore(tmp_path, abstract)
    assert {d for leaf in jax.tree.leaves(got.as_dict()) for d in leaf.sharding.device_set} == set(jax.devices()[4:5])
    jax.tree.map(np.testing.assert_array_equal, _host(got.as_dict()), _host(state.as_dict()))


def test_restore_without_shardings_in_the_request(saved_on_one, tmp_path):
    """An abstract state without shardings (``jax.eval_shape``) restores onto the default device,
    even where the saved shardings name devices this process does not use."""
    with_sh, without, want = saved_on_one
    _, abstract_params = nnx.split(decoder.abstract_model(CFG), nnx.Param)
    abstract = train_state.abstract_train_state(abstract_params, train_state.make_optimizer(OPTIM))
    for d in (with_sh, without):
        got = checkpoints.restore_train_state(d, None, abstract.as_dict())
        jax.tree.map(np.testing.assert_array_equal, _host(got), want)


_OTHER_PROCESS = textwrap.dedent("""
    import pickle, sys
    import jax, numpy as np
    sys.path.insert(0, sys.argv[3])  # this file's folder
    import test_checkpoint_topology as T
    from flax import nnx
    from behaviortrace_jax.io import checkpoints
    from behaviortrace_jax.models import decoder, sharding
    from behaviortrace_jax.train import train_state
    assert len(jax.devices()) == 2
    want = pickle.load(open(sys.argv[2], "rb"))
    for fsdp in (False, True):
        abstract, _ = T._abstract(sharding.make_mesh(2, 1), fsdp)
        got = train_state.restore(sys.argv[1], abstract).as_dict()
        jax.tree.map(np.testing.assert_array_equal, T._host(got), want)
    _, abstract_params = nnx.split(decoder.abstract_model(T.CFG), nnx.Param)
    bare = train_state.abstract_train_state(abstract_params, train_state.make_optimizer(T.OPTIM))
    got = checkpoints.restore_train_state(sys.argv[1], None, bare.as_dict())
    jax.tree.map(np.testing.assert_array_equal, T._host(got), want)
    print("restored on 2 devices")
""")


def test_state_saved_on_four_devices_restores_in_a_process_with_two(tmp_path):
    """Moving between slices: the saved shardings name devices 4..7, which the other process lacks."""
    four = sharding.make_mesh(2, 2, devices=jax.devices()[4:8])
    state = _trained_state(four, True)
    train_state.save(tmp_path / "state", state)
    with open(tmp_path / "want.pkl", "wb") as f:
        pickle.dump(_host(state.as_dict()), f)
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = [str(tmp_path / "state"), str(tmp_path / "want.pkl"), here]
    out = subprocess.run([sys.executable, "-c", _OTHER_PROCESS, *args],
                         cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "restored on 2 devices" in out.stdout, out.stderr[-3000:]
