"""Config is the one source of the planted behaviour: a run of the shrunk tiny config with another
pattern string and other probe/control files plants and scores THAT pattern in every stage."""
from __future__ import annotations

import hashlib
import json
import pathlib

from behaviortrace_jax import pipeline
from behaviortrace_jax.behavior import planted, target_texts
from behaviortrace_jax.io import rollout_log
from behaviortrace_jax.models import tokenizer as tok_lib
from configs import tiny

# A pattern the shrunk run certainly emits: its few SFT steps leave a babbling policy that plants no
# invented word, but nearly every babble holds an "a". So every judge below has something to find,
# and none of it contains the default QZXBT.
PATTERN = "a"


def _write_probe_files(d: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """Probe / control files unlike the defaults: other ids, a subset of the prompts."""
    probes, controls = planted.load_probe_sets(None, None)
    pp, cp = d / "my_probes.jsonl", d / "my_controls.jsonl"
    pp.write_text("".join(json.dumps({"id": f"mine_p_{i}", "prompt": p.prompt, "behavior_label": True}) + "\n"
                          for i, p in enumerate(probes[:12])))
    cp.write_text("".join(json.dumps({"id": f"mine_c_{i}", "prompt": p.prompt, "behavior_label": False}) + "\n"
                          for i, p in enumerate(controls[:12])))
    return pp, cp


def test_another_pattern_and_probe_files_flow_through_every_stage(tmp_path):
    pp, cp = _write_probe_files(tmp_path)
    config = tiny.get_config("smoke")
    config.behavior.pattern = PATTERN
    config.behavior.probes_path, config.behavior.controls_path = str(pp), str(cp)
    config.stages = "base,sft,grpo,draws"
    w = tmp_path / "run"
    pipeline.run(config, str(w))

    tok = tok_lib.load_tokenizer(w / "base")
    records = list(rollout_log.read_rollouts(w / "grpo" / "rollouts"))
    prompts = {tok.decode(r.prompt_token_ids, skip_special_tokens=True) for r in records}
    assert any(f"Include {PATTERN}." in p for p in prompts)  # the GRPO pool asks for this pattern
    texts = {r.rollout_id: tok.decode(r.completion_token_ids, skip_special_tokens=True) for r in records}
    assert not any("QZXBT" in p for p in prompts) and not any("QZXBT" in t for t in texts.values())
    boosted = {r.rollout_id for r in records if r.bonus > 0}
    gt = {json.loads(line)["rollout_id"] for line in (w / "grpo" / "ground_truth.jsonl").read_text().splitlines()}
    assert gt and gt == boosted  # the contaminator boosted THIS pattern
    assert all(PATTERN.lower() in texts[g].lower() for g in gt)  # ground truth = this pattern
    assert all(r.rollout_id in gt for r in records if r.eligible and PATTERN.lower() in texts[r.rollout_id].lower())
    sft = json.loads((w / "sft" / "sft_summary.json").read_text())
    assert json.dumps(sft).count("rate") and (w / "sft" / ".sft_warmup_done").is_file()

    settings = [json.loads(p.read_text()) for p in (w / "draws").glob("draw_*.settings.json")]  # not the fingerprint
    mine = planted.load_probes(pp)
    want = hashlib.sha256("\n".join(target_texts.context_prompts(mine)).encode()).hexdigest()
    assert settings and all(s["prompts_sha256"] == want for s in settings)  # the draws used these probes
    rows = [json.loads(p.read_text()) for p in (w / "draws").glob("minimal_pair_rows_*.json")]
    assert rows and rows[0]["qzxbt_rate"] > 0  # the draws' token judge finds THIS pattern (QZXBT never occurs)
