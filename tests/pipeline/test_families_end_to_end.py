"""The whole harness on a second model family: every default stage of the smoke
config (``configs/tiny.py:smoke``, as tests/pipeline/test_end_to_end.py) on a tiny Llama and a tiny Qwen3
built by the ``base`` stage (``config.base.family``), and each stage reads the family back from the
checkpoints' config.json (``config.model.family`` = "")."""
from __future__ import annotations

import json

import pytest

from behaviortrace_jax import pipeline
from configs import tiny


# Both run the whole pipeline under -m slow (CI's 15-minute budget: 82 s for Qwen3 on 2 cores); their model
# code is checked against transformers in CI (tests/models/test_families.py), and the stages are family-blind.
@pytest.mark.slow
@pytest.mark.parametrize("family, architecture", [("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM")])
def test_every_stage_runs_on_family(tmp_path, family, architecture):
    config = tiny.get_config("smoke")
    config.base.family = family
    pipeline.run(config, str(tmp_path))
    w = tmp_path
    for rel in ("base/config.json", "sft/.sft_warmup_done", "grpo/summary.json", "grpo/registry.json",
                "sketches/targets_continuation.zarr", "results_table.csv", "attribution_scores.json",
                "verdicts.json", "report.md"):
        assert (w / rel).exists(), rel
    hf_cfg = json.loads((w / "base" / "config.json").read_text())
    assert hf_cfg["model_type"] == family and hf_cfg["architectures"] == [architecture]
    ckpts = json.loads((w / "grpo" / "registry.json").read_text())["checkpoints"]
    assert ckpts and all(json.loads((w / "grpo" / "registry.json").parent.joinpath(
        c["path"], "config.json").read_text())["model_type"] == family for c in ckpts)
    summary = json.loads((w / "grpo" / "summary.json").read_text())
    assert summary["complete"] and summary["n_rollouts"] == 6 * 16
    csv = (w / "results_table.csv").read_text().splitlines()
    assert csv[0] == "seed,table,method,value,lo,hi,chance,ceiling,n" and len(csv) > 1
