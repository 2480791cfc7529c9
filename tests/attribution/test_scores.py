"""The in-run rollout sketch stores read both ways (sketch/stores.py, attribution/scores.py): weighted =
clip_s * c_i * direction_i for a loss with rollout coefficients, clip_s * term_i without them."""
from __future__ import annotations

import numpy as np
import pytest

from behaviortrace_jax.io import sketch_store
from behaviortrace_jax.io.layout import RunLayout
from behaviortrace_jax.models import qwen2
from behaviortrace_jax.attribution import scores
from behaviortrace_jax.sketch import stores
from behaviortrace_jax.stages.spec import RunSpec
from configs import tiny


def _open(config, paths, kind):
    """The in-run stores as the grpo stage opens them for ``config`` (16 rollouts per step)."""
    g = config.grpo
    return stores.open_sketch_stores(RunSpec.from_config(config).sketch, qwen2.Qwen2Config.tiny(), paths,
                                     steps=g.steps, rollouts_per_step=g.prompts_per_step * g.group_size,
                                     in_run_rollouts=config.sketch.in_run_rollouts, rollout_sketch=kind)


def _write(config, paths, kind, rng):
    st = _open(config, paths, kind)
    steps, n, d = config.grpo.steps, 16, config.sketch.dim
    data = {"rollout_sketches": rng.normal(size=(steps * n, d)).astype(np.float32),
            "step_clip_factors": rng.uniform(0.2, 1.0, steps).astype(np.float32),
            "rollout_coefficients": rng.normal(size=steps * n).astype(np.float32) / 16}
    for name, x in data.items():
        if name in st:
            st[name].write_rows(0, x)
            st[name].flush()
    return st, data


@pytest.mark.parametrize("kind", ["direction", "term"])
def test_rollout_sketches_weighted_and_direction(tmp_path, kind):
    config = tiny.get_config("smoke")
    paths = RunLayout(tmp_path)
    st, data = _write(config, paths, kind, np.random.default_rng(0))
    assert ("rollout_coefficients" in st) == (kind == "direction")
    assert st["rollout_sketches"].metadata["rollout_sketch"] == kind
    rs = scores.read_rollout_sketches(RunSpec.from_config(config).scores, paths)
    clip = data["step_clip_factors"][np.arange(96) // 16]
    scale = clip * data["rollout_coefficients"] if kind == "direction" else clip
    np.testing.assert_allclose(rs.weighted, scale[:, None] * data["rollout_sketches"], rtol=1e-6)
    if kind == "direction":
        np.testing.assert_array_equal(rs.direction, data["rollout_sketches"])
        options = RunSpec.from_config(config).scores
        np.testing.assert_allclose(scores.rollout_scales(options, paths, 20), scale[:20], rtol=1e-6)
    else:  # a loss without rollout coefficients (grpo_clip): no advantage-free direction
        assert rs.direction is None and scores.rollout_scales(RunSpec.from_config(config).scores, paths, 20) is None
    with pytest.raises(ValueError, match="rollout_sketch"):  # the other kind cannot reopen these stores ...
        _open(config, paths, "term" if kind == "direction" else "direction")
    made = (paths.sketch_store("rollout_coefficients") / "metadata.json").exists()
    assert made == (kind == "direction")  # ... nor add a store to them


def test_rollout_sketches_of_an_older_run_are_refused(tmp_path):
    config = tiny.get_config("smoke")
    paths = RunLayout(tmp_path)
    meta = stores.sketch_metadata(RunSpec.from_config(config).sketch, qwen2.Qwen2Config.tiny(), "rollout_sketches")
    old = sketch_store.SketchStore.open_or_create(paths.sketch_store("rollout_sketches"), (96, 256), 16, meta)
    old.write_rows(0, np.zeros((96, 256), np.float32))
    old.flush()
    with pytest.raises(ValueError, match="predates advantage-free rollout sketches"):
        scores.read_rollout_sketches(RunSpec.from_config(config).scores, paths)
    with pytest.raises(ValueError, match="rollout_sketch="):
        _open(config, paths, "weighted")
