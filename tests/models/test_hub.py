"""``config.model.hf_id``: a model found by name in a Hugging Face hub cache (models/hub.py)."""
import pathlib

import jax
import numpy as np
import pytest

import hf_fixtures
from hf_fixtures import save_random_qwen2

from behaviortrace_jax import pipeline
from behaviortrace_jax.models import hub
from behaviortrace_jax.models.loader import load_policy

HF_ID = "tiny-org/tiny-qwen2"
REVISION = hf_fixtures.HUB_REVISION


def hub_cache(root: pathlib.Path, model_dir: pathlib.Path, hf_id: str = HF_ID) -> pathlib.Path:
    """:func:`hf_fixtures.hub_cache` of ``model_dir`` as ``hf_id`` at :data:`REVISION`."""
    return hf_fixtures.hub_cache(root, model_dir, hf_id, revision=REVISION)


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    """``(cache folder, the model's own folder)``: the tiny random Qwen2 of hf_fixtures as :data:`HF_ID`."""
    tmp = tmp_path_factory.mktemp("hub")
    model = save_random_qwen2(tmp / "model")
    return hub_cache(tmp / "cache", model), model


def test_hf_id_resolves_to_the_snapshot_of_refs_main_under_hf_hub_cache(tiny_cache, monkeypatch):
    cache, model = tiny_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = hub.resolve_hf_id(HF_ID)
    assert path == cache / f"models--tiny-org--tiny-qwen2/snapshots/{REVISION}"
    by_id = load_policy(path)
    by_dir = load_policy(model)
    assert by_id.model_config == by_dir.model_config and len(by_id.tokenizer) == len(by_dir.tokenizer)
    for a, b in zip(jax.tree.leaves(by_id.params), jax.tree.leaves(by_dir.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_hf_home_is_honoured_when_hf_hub_cache_is_unset(tiny_cache, tmp_path, monkeypatch):
    cache, _ = tiny_cache
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "hub").symlink_to(cache, target_is_directory=True)
    env = {"HF_HOME": str(tmp_path / "home")}
    assert hub.hub_cache_dir(env) == tmp_path / "home" / "hub"
    assert hub.resolve_hf_id(HF_ID, environ=env).name == REVISION
    assert hub.hub_cache_dir({"HF_HUB_CACHE": str(cache), **env}) == cache  # HF_HUB_CACHE wins


def test_a_model_missing_from_the_cache_names_the_download_command(tiny_cache, monkeypatch):
    cache, _ = tiny_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(FileNotFoundError, match=r"`hf download other-org/absent`.*allow_download") as e:
        hub.resolve_hf_id("other-org/absent")
    assert str(cache) in str(e.value)
    assert hub.download_command("a/b") == "hf download a/b"  # huggingface_hub >= 0.34 ships `hf`
    with pytest.raises(ValueError, match="org/name"):
        hub.resolve_hf_id("no-slash")


def _config(**model):
    from configs import tiny

    c = tiny.get_config("smoke")
    for k, v in model.items():
        setattr(c.model, k, v)
    return c


def test_with_model_source_sets_hf_dir_and_refuses_both_keys(tiny_cache, monkeypatch):
    cache, _ = tiny_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    c = _config(hf_id=HF_ID)
    out = pipeline.with_model_source(c)
    assert out.model.hf_dir == str(cache / f"models--tiny-org--tiny-qwen2/snapshots/{REVISION}")
    assert out.model.hf_id == "" and c.model.hf_id == HF_ID  # the caller's config is unchanged
    assert pipeline.with_model_source(_config(hf_dir="/some/dir")).model.hf_dir == "/some/dir"
    with pytest.raises(ValueError, match=r"hf_id='tiny-org/tiny-qwen2' and config.model.hf_dir='/some/dir'"):
        pipeline.with_model_source(_config(hf_id=HF_ID, hf_dir="/some/dir"))
    missing = _config(hf_id="other-org/absent")
    with pytest.raises(FileNotFoundError, match="hf download other-org/absent"):
        pipeline.with_model_source(missing)
    assert pipeline.with_model_source(missing, strict=False).model.hf_id == "other-org/absent"  # status: no raise


def test_the_pipeline_loads_the_model_by_id(tiny_cache, tmp_path, monkeypatch, capsys):
    """``--config.model.hf_id=...`` end to end: the ``info`` stage loads the cached model and the
    run's digest hashes the snapshot's weights (the same bytes as the model's own folder)."""
    from behaviortrace_jax.io import files

    cache, model = tiny_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    c = _config(hf_id=HF_ID)
    c.stages = "info"
    c.grpo.max_prompt_tokens = 128  # + info.max_new_tokens within the tiny model's 256 positions (else refused)
    digest = pipeline.run(c, str(tmp_path / "w"))
    out = capsys.readouterr().out
    assert f"checkpoint: {cache / f'models--tiny-org--tiny-qwen2/snapshots/{REVISION}'}" in out
    assert digest["base_weights"] == files.sha256_file(model / "model.safetensors")


@pytest.mark.parametrize("state", sorted(hf_fixtures.HUB_CACHE_STATES))
def test_hub_cache_states_resolve_or_name_what_is_wrong(state, tmp_path, monkeypatch):
    """Each cache state of ``hf_fixtures.HUB_CACHE_STATES`` (huggingface_hub's layout: refs, snapshots,
    blobs, ``.incomplete`` blobs) resolves to its snapshot or fails naming the file and what it holds.
    A ref ending in a newline used to be "not in the cache"."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache, expected = hf_fixtures.hub_cache_state(tmp_path / "cache", state, HF_ID)
    snap = cache / f"models--tiny-org--tiny-qwen2/snapshots/{REVISION}"
    if expected is None:
        assert hub.resolve_hf_id(HF_ID, environ={"HF_HUB_CACHE": str(cache)}) == snap
        assert hub.resolve_hf_id(HF_ID, revision=REVISION, environ={"HF_HUB_CACHE": str(cache)}) == snap
    else:
        with pytest.raises((FileNotFoundError, ValueError), match=expected):
            hub.resolve_hf_id(HF_ID, environ={"HF_HUB_CACHE": str(cache)})
