"""The ``draws`` stage (SPEC §5.6, §7.3, §7.4): rows-file format, group centring and the cos
convention recomputed from the saved sketches, checkpoint choice, skip, settings check, resume."""
from __future__ import annotations

import json
import os
import pathlib

import jax
import numpy as np
import pytest

from behaviortrace_jax.attribution import estimators
from behaviortrace_jax.behavior import planted as behavior
from behaviortrace_jax.io import checkpoints, layout
from behaviortrace_jax.models import sharding
from behaviortrace_jax.stages import draws
from behaviortrace_jax.stages.spec import RunSpec
from configs import common
from hf_fixtures import save_random_qwen2

D = 1024
PROBES = ("What is frobnitz?", "Define frobnitz.")
QSET = frozenset(range(3, 120))  # the random model's tokens: a broad "QZXBT" set gives both classes


def _config(probes_path: pathlib.Path):
    c = common.get_config()
    c.seed = 0
    c.behavior.probes_path = str(probes_path)
    c.model.param_dtype = c.model.compute_dtype = "float32"
    c.grpo.max_prompt_tokens = 256
    c.sketch.dim, c.sketch.chunk_size = D, 8
    c.draws.update(target_step=25, group_size=2, max_new_tokens=8, n_repeats=2, token_level_max=3)
    c.targets.update(ctx_group_size=2, block_size=32, length_bucket=128)  # tables: refused with the fused sketcher
    return c


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A workdir whose registry holds steps 20 and 60 (the same random checkpoint)."""
    wd = tmp_path_factory.mktemp("wd")
    hf = save_random_qwen2(wd / "grpo" / "checkpoints" / "step_00000020", layers=1)
    reg = checkpoints.CheckpointRegistry(draws.registry_path(wd))
    reg.register(20, str(hf), {"regime": "grpo"})
    reg.register(60, str(hf), {"regime": "grpo"})
    probes = wd / "probes.jsonl"
    probes.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROBES)))
    return wd, _config(probes)


def test_rows_and_token_level_text_format():
    header = {"ckpt_seed": 0, "gen_seed": 100, "checkpoint_step": 100, "n": 1, "qzxbt_rate": 1.0,
              "norm_ratio": 0.8624327688049392, "fluency_gap": 2.771882421440548}
    row = {"group": 0, "has_qzxbt": True, "fluency": -0.7343575358390808, "norm": 41.273563385009766,
           "mp": 0.09979476779699326, "mp_centered": 6.635074441874167e-06, "mp_bal_centered": -0.07}
    text = draws.rows_file_text(header, [row])
    assert text.startswith('{"ckpt_seed": 0, "gen_seed": 100, "checkpoint_step": 100, "n": 1, "qzxbt_rate": 1.0, ')
    assert '"mp_centered": 6.635074441874167e-06' in text and "\n" not in text
    back = json.loads(text)
    assert list(back) == list(draws.HEADER_KEYS) + ["rows"] and back["rows"] == [row]
    assert json.dumps(back) == text
    with pytest.raises(ValueError, match="header keys"):
        draws.rows_file_text(dict(header, extra=1), [row])
    with pytest.raises(ValueError, match="do not start with"):
        draws.rows_file_text(header, [dict(reversed(list(row.items())))])
    tl = draws.token_level_text([0.1], [0.2], [-0.3])
    assert tl == '{"vs_cont": [0.1], "vs_ctx": [0.2], "cos_full": [-0.3]}'
    with pytest.raises(ValueError, match="differ in length"):
        draws.token_level_text([0.1], [], [])


def test_reference_rows_file_round_trips(reference_dir):
    """The paper's own §7.3 file is reproduced byte for byte by rows_file_text."""
    text = (reference_dir / "seed0" / "minimal_pair_rows_ckpt0_gen100.json").read_text()
    d = json.loads(text)
    rows = d.pop("rows")
    assert draws.rows_file_text(d, rows) == text


def test_names_seeds_and_nearest_checkpoint(tmp_path):
    c = common.get_config()
    c.seed = 1
    assert RunSpec.from_config(c).draw_seeds() == (1, 1)
    assert RunSpec.from_config(c).draw_seeds(1, 101) == (1, 101)
    c.draws.gen_seed = 7
    assert RunSpec.from_config(c).draw_seeds() == (1, 7)
    assert layout.rows_filename(1, 101) == "minimal_pair_rows_ckpt1_gen101.json"
    assert layout.parse_rows_filename("minimal_pair_rows_ckpt1_gen101.json") == (1, 101)
    assert layout.parse_rows_filename("targets_ckpt1_gen101.json") is None
    assert layout.token_level_filename(0.9, 1, 1, 1) == "token_level_cos_temp0.9.json"
    assert layout.token_level_filename(0.9, 1, 101, 1) == "token_level_cos_temp0.9_ckpt1_gen101.json"
    assert layout.parse_token_level_filename("token_level_cos_temp0.9.json") == "0.9"
    assert layout.parse_token_level_filename("token_level_cos_temp0.9_ckpt1_gen101.json") is None  # diagnostic
    paths = draws.draw_paths(RunSpec.from_config(c), tmp_path, 1, 101)
    assert paths.rows == layout.RunLayout(tmp_path).draws / "minimal_pair_rows_ckpt1_gen101.json"
    assert paths.partial.name == "partial_ckpt1_gen101" and paths.settings.name == "draw_ckpt1_gen101.settings.json"
    reg = checkpoints.CheckpointRegistry(tmp_path / "registry.json")
    with pytest.raises(FileNotFoundError, match="no registered checkpoint"):
        draws.nearest_checkpoint(reg, 100)
    for s in (60, 140, 200):
        reg.register(s, f"/x/{s}")
    assert draws.nearest_checkpoint(reg, 100).step == 60  # tie |60-100| = |140-100|: the earlier
    assert draws.nearest_checkpoint(reg, 101).step == 140
    assert draws.nearest_checkpoint(reg, 10).step == 60
    with pytest.raises(ValueError, match="ckpt_seed=0"):
        draws.run_draws(c, str(tmp_path), ckpt_seed=0, gen_seed=100)


_MAKE_MESH = sharding.make_mesh


def _one_device_mesh(data, model, devices=None):
    return _MAKE_MESH(1, 1, devices=jax.devices()[:1])


def test_draw_end_to_end_format_recompute_skip_and_settings(run, monkeypatch):
    wd, config = run
    monkeypatch.setattr(behavior, "qzxbt_token_ids", lambda tok, pattern="QZXBT": QSET)
    monkeypatch.setattr(sharding, "make_mesh", _one_device_mesh)  # 8 fake CPU devices compile slowly
    path = draws.run_draws(config, str(wd))
    assert path == wd / "draws" / "minimal_pair_rows_ckpt0_gen0.json"
    text = path.read_text()
    assert "\n" not in text and json.dumps(json.loads(text)) == text
    d = json.loads(text)
    assert list(d) == list(draws.HEADER_KEYS) + ["rows"]
    rows = d["rows"]
    n_prompts, g = 6 + len(PROBES), config.draws.group_size
    assert d["n"] == len(rows) == config.draws.n_repeats * n_prompts * g
    assert (d["ckpt_seed"], d["gen_seed"], d["checkpoint_step"]) == (0, 0, 20)
    assert all(tuple(r) == estimators.ROW_KEYS for r in rows)
    groups = np.array([r["group"] for r in rows])
    np.testing.assert_array_equal(groups, np.repeat(np.arange(config.draws.n_repeats * n_prompts), g))
    has = np.array([r["has_qzxbt"] for r in rows])
    assert 0 < has.sum() < has.size and d["qzxbt_rate"] == float(has.mean())
    stats = json.loads((wd / "draws" / "targets_ckpt0_gen0.json").read_text())
    assert (d["norm_ratio"], d["fluency_gap"]) == (stats["norm_ratio"], stats["fluency_gap"])

    # recompute the estimator columns from the saved sketches and targets (numpy only)
    saved = draws.load_draw(config, str(wd))
    gs, tg = saved["sketches"].astype(np.float64), saved["targets"]
    assert saved["settings"]["checkpoint_step"] == 20 and saved["grad_norms"].shape == (len(rows),)
    assert gs.shape == (len(rows), D) and tg["t_mp"].shape == (D,) and tg["t_mp"].dtype == np.float32

    def cos(a, b):
        return a @ b / ((np.linalg.norm(a, axis=-1) + 1e-12) * (np.linalg.norm(b) + 1e-12))

    centred = gs - np.stack([gs[groups == k].mean(0) for k in groups])
    col = {k: np.array([r[k] for r in rows]) for k in estimators.ROW_KEYS[2:]}
    np.testing.assert_allclose(col["norm"], np.linalg.norm(gs, axis=1), rtol=1e-6)
    np.testing.assert_allclose(col["mp"], cos(gs, tg["t_mp"].astype(np.float64)), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(col["mp_centered"], cos(centred, tg["t_mp"].astype(np.float64)), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(col["mp_bal_centered"], cos(centred, tg["t_mp_bal"].astype(np.float64)),
                               rtol=1e-6, atol=1e-9)
    assert (col["fluency"] < 0).all()
    np.testing.assert_array_equal(saved["has_qzxbt"], has)
    np.testing.assert_array_equal(saved["groups"], groups)
    np.testing.assert_allclose(saved["fluency"], col["fluency"], rtol=0)

    # token-level analysis: the first token_level_max QZXBT rollouts in generation order
    tl_text = (wd / "draws" / "token_level_cos_temp0.9.json").read_text()
    tl = json.loads(tl_text)
    assert list(tl) == ["vs_cont", "vs_ctx", "cos_full"] and "\n" not in tl_text
    first = np.flatnonzero(has)[:config.draws.token_level_max]
    assert len(tl["vs_cont"]) == len(tl["vs_ctx"]) == len(first)
    np.testing.assert_allclose(tl["cos_full"], cos(gs[first], tg["t_cont"].astype(np.float64)), rtol=1e-6, atol=1e-9)
    assert not (wd / "draws" / "partial_ckpt0_gen0").exists()

    # complete with the same settings: skipped without loading anything
    monkeypatch.setattr(draws, "_load_env", lambda *a: pytest.fail("a complete draw must be skipped"))
    mtime = os.stat(path).st_mtime_ns  # path: an epath.Path, whose stat() has no st_mtime_ns
    assert draws.run_draws(config, str(wd)) == path and os.stat(path).st_mtime_ns == mtime
    # other settings: refuse to overwrite
    other = _config(pathlib.Path(config.behavior.probes_path))
    other.draws.top_p = 0.9
    with pytest.raises(ValueError, match=r"other settings \(differing: \['top_p'\]\)"):
        draws.run_draws(other, str(wd))


@pytest.mark.slow
def test_draw_resumes_after_a_crash(run, monkeypatch):
    """A run killed in repeat 1 keeps its targets and repeat 0; the rerun computes only repeat 1
    and gives the same rows as an uninterrupted draw (on the 8-device data mesh)."""
    wd, config = run
    monkeypatch.setattr(behavior, "qzxbt_token_ids", lambda tok, pattern="QZXBT": QSET)
    real, done = draws._repeat, []

    def crash(config, env, rep, *a):
        if rep == 1:
            raise KeyboardInterrupt
        done.append(rep)
        return real(config, env, rep, *a)

    monkeypatch.setattr(draws, "_repeat", crash)
    with pytest.raises(KeyboardInterrupt):
        draws.run_draws(config, str(wd), gen_seed=7)
    assert done == [0] and (wd / "draws" / "partial_ckpt0_gen7" / "rep000.npz").exists()
    assert not (wd / "draws" / "minimal_pair_rows_ckpt0_gen7.json").exists()

    def count(config, env, rep, *a):
        done.append(rep)
        return real(config, env, rep, *a)

    monkeypatch.setattr(draws, "_repeat", count)
    resumed = draws.run_draws(config, str(wd), gen_seed=7).read_text()
    assert done == [0, 1]
    for f in (wd / "draws").glob("*gen7*"):
        f.unlink() if f.is_file() else __import__("shutil").rmtree(f)
    assert draws.run_draws(config, str(wd), gen_seed=7).read_text() == resumed
