"""``model.scan_layers`` reaches the run stages: the smoke config (``configs/tiny.py:smoke``
with 2 layers, so the scan has something to scan) run through base, sft, grpo and sketch with the
switch on traces the scanned model (``DecoderForCausalLM._scan_layers``) inside every one of those
stages and builds only scanned sketchers (GRPO in-run sketches, the sketch stage's target and
rollout sketchers), and its results match the unscanned run's. (The draws stage loads its policy
the same way but adds ~1 min, so it is left out.) Two pipeline runs, ~2.5 min on 2 shared cores:
``slow``; CI keeps the scan's numerics (tests/models/test_scan_layers.py: forward and gradients equal the unrolled
model's; the scan cases of tests/sketch/test_sketcher.py: sketches equal the unrolled ones).

The scan only reorders float operations: the base weights are not bit-identical (different
digests), so losses, log-probs and sketches are compared to fp32 tolerance (measured: base / SFT loss
histories equal as logged, completion log-probs within 1e-6, step / rollout / target sketches within
7e-7 of their max). The sampled tokens, and with them ground truth, come out identical here (a few
4-token completions per step: a 1e-6 difference near a sampling threshold could flip one, which
this seed does not hit). Both runs set ``targets.use_tables = False``: hash tables are refused with
the scan (sketch/sketcher.py).
"""
from __future__ import annotations

import json
import pathlib
import traceback

import numpy as np
import pytest

from behaviortrace_jax import pipeline
from behaviortrace_jax.io import rollout_log, sketch_store
from behaviortrace_jax.models import decoder
from behaviortrace_jax.sketch import sketcher
from configs import tiny


def _config(scan: bool):
    c = tiny.get_config("smoke")
    c.base.num_layers = 2
    c.targets.use_tables = False
    c.model.scan_layers = scan
    c.stages = "base,sft,grpo,sketch"
    return c


def _stages_on_stack() -> set[str]:
    """The stage modules (``behaviortrace_jax/stages/<name>.py``) in the current call stack."""
    return {pathlib.Path(f.filename).stem for f in traceback.extract_stack()
            if pathlib.Path(f.filename).parent.name == "stages"}


@pytest.mark.slow
def test_run_stages_use_scan_and_match_unscanned(tmp_path, monkeypatch):
    traced, sketchers = set(), []
    scan_fn, init_fn = decoder.DecoderForCausalLM._scan_layers, sketcher.PerExampleSketcher.__init__

    def spy_scan(self, *a, **k):
        traced.update(_stages_on_stack())
        return scan_fn(self, *a, **k)

    def spy_init(self, *a, **k):
        init_fn(self, *a, **k)
        sketchers.append((self.scan_layers, tuple(sorted(_stages_on_stack()))))

    monkeypatch.setattr(decoder.DecoderForCausalLM, "_scan_layers", spy_scan)
    monkeypatch.setattr(sketcher.PerExampleSketcher, "__init__", spy_init)
    pipeline.run(_config(False), str(tmp_path / "plain"))
    assert not traced and sketchers and not any(s for s, _ in sketchers)
    sketchers.clear()
    pipeline.run(_config(True), str(tmp_path / "scan"))
    assert traced >= {"base", "sft", "grpo", "sketch"}, traced  # each stage's model is the scanned one
    # GRPO in-run sketches, the sketch stage's target / rollout sketchers: all scanned
    assert {st for _, sts in sketchers for st in sts} >= {"grpo", "sketch"} and all(s for s, _ in sketchers), sketchers

    plain, scan = tmp_path / "plain", tmp_path / "scan"
    for rel, key in (("base/train_history.json", None), ("sft/sft_summary.json", "loss_history")):
        ha, hb = (json.loads((w / rel).read_text()) for w in (plain, scan))
        ha, hb = (h if key is None else h[key] for h in (ha, hb))
        assert len(ha) == len(hb) > 0, rel
        np.testing.assert_allclose([h["loss"] for h in hb], [h["loss"] for h in ha], rtol=1e-5, err_msg=rel)
    ra, rb = (list(rollout_log.read_rollouts(w / "grpo" / "rollouts")) for w in (plain, scan))
    assert len(ra) == len(rb) == 6 * 16
    assert [r.completion_token_ids for r in rb] == [r.completion_token_ids for r in ra]
    np.testing.assert_allclose(np.concatenate([r.completion_logprobs for r in rb]),
                               np.concatenate([r.completion_logprobs for r in ra]), atol=1e-5)
    assert (plain / "grpo" / "ground_truth.jsonl").read_text() == (scan / "grpo" / "ground_truth.jsonl").read_text()
    for name in ("step_sketches", "rollout_sketches", "targets_continuation"):
        sa, sb = (sketch_store.SketchStore.open(w / "sketches" / f"{name}.zarr").read() for w in (plain, scan))
        sa, sb = np.asarray(sa, np.float64), np.asarray(sb, np.float64)
        assert sa.shape == sb.shape and np.abs(sa).max() > 0, name
        np.testing.assert_allclose(sb, sa, rtol=1e-5, atol=1e-5 * np.abs(sa).max(), err_msg=name)
