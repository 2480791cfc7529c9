"""Two behaviours in one tiny run (issue 16): the SFT-implanted frobnitz -> QZXBT and one planted by RL alone.

    python main.py --config=configs/tiny_two_behaviors.py --workdir=runs/two

The tiny default (configs/tiny.py) plus a second behaviour, `config.behaviors.plonkwit`: prompts about
the invented word "plonkwit" earn a bonus when the answer contains "glows". It has no SFT implant;
the tiny base model writes the marker by chance (base/base_summary.json, `behaviors.plonkwit`), and GRPO's
bonus has to find and amplify it. The two behaviours' GRPO prompt pools are interleaved (every step
has prompts of both), their bonuses add, and each has its own hash stream, window, ground-truth log
(grpo/ground_truth_<id>.jsonl), release folder (release/<id>/seed0/), targets and draws.

What to expect (2-core CPU, ~15 min): the same stages and files as configs/tiny.py plus, per extra
behaviour, its gate in grpo/summary.json (`behaviors`), its tables as `<table>@<id>` rows of
results_table.csv, and the specificity rows `spec_p_*` / `spec_delta_*` (step level and "which
rollout" level; attribution/specificity.py) with verdicts in verdicts.json (`specificity`) and a
report section with figures/specificity.png. Calibration of the second behaviour's constants:
docs/two_behaviors.md.
"""
import pathlib

import ml_collections

from configs import tiny

THIRD_PARTY = pathlib.Path(__file__).resolve().parents[1] / "third_party" / "behaviortrace"

# The RL-only behaviour (calibrated on CPU; docs/two_behaviors.md).
ID = "plonkwit"
TRIGGER = "plonkwit"
PATTERN = "glows"


def second_behavior() -> ml_collections.ConfigDict:
    """The RL-only behaviour's config entry (keys: behavior/behaviors.py EXTRA_KEYS)."""
    return ml_collections.ConfigDict({
        "trigger": TRIGGER,
        "pattern": PATTERN,
        "probes_path": str(THIRD_PARTY / f"probes_{TRIGGER}.jsonl"),  # provenance: third_party/behaviortrace/README.md
        "controls_path": str(THIRD_PARTY / "controls.jsonl"),  # the paper's 20 factual controls
        "token_judge": "sequence",  # the tiny tokenizer spells the marker in pieces
        "bonus_reward": 8.0,
        "fraction": 0.5,
        "early_step_cutoff": 40,
        "implant": "none",
        "gate_min_probe_rate": 0.3,
        "gate_min_margin": 0.2,
        "explicit_prompts": True,
    })


def get_config(variant: str = ""):
    """The tiny two-behaviour run; ``variant="smoke"`` shrinks it to seconds (CI)."""
    if variant not in ("", "smoke"):
        raise ValueError(f"configs/tiny_two_behaviors.py: unknown variant {variant!r}; known: '' (default), 'smoke'")
    c = tiny.get_config()
    c.run_name = "tiny_two_behaviors__grpo__seed0"
    c.behaviors[ID] = second_behavior()
    if variant == "smoke":
        c = tiny.shrink_to_smoke(c)
        b = c.behaviors[ID]
        b.pattern = "a"  # as the first behaviour's "e": a letter an untrained model writes, so GT is non-empty
        b.fraction, b.early_step_cutoff = 1.0, 4
    return c
