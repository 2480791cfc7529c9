"""Two behaviours in one tiny run: the SFT-implanted frobnitz -> QZXBT and one planted by RL alone.

    python main.py --config=configs/tiny_two_behaviors.py --workdir=runs/two

The tiny default (configs/tiny.py) plus a second behaviour, `config.behaviors.plonkwit`: prompts about
the invented word "plonkwit" earn a bonus when the answer contains "glows". It has no SFT implant;
the tiny base model writes the marker by chance (base/base_summary.json, `behaviors.plonkwit`), and GRPO's
bonus has to find and amplify it. The two behaviours' GRPO prompt pools are interleaved (every step
has prompts of both: A's pool as configs/tiny.py's, B's 20 probes), each behaviour's bonus is paid only
on rollouts of its own prompts (8.0; A in the tiny default's window, on half of them, as the paper; B in
steps 0-39, on all of them), and each has its
own hash stream, ground-truth log (grpo/ground_truth_<id>.jsonl), release folder
(release/<id>/seed0/), targets and draws.

What to expect: the same stages and files as configs/tiny.py plus, per extra behaviour, its chance
rate in base/base_summary.json, its gate and learning curve in grpo/summary.json (`behaviors`), its
tables as `<table>@<id>` rows of results_table.csv, and the specificity rows `spec_p_*` /
`spec_delta_*` (step level and "which rollout" level; attribution/specificity.py) with verdicts in
verdicts.json (`specificity`), report sections and figures/specificity.png. Time: 5 min 38 s, 2.0 GB
peak, for the command above from a fresh clone on an idle 2-core AMD EPYC VM (commit cad8bb9; base
1.5 min, SFT 0.5, GRPO 2.0, sketch 0.5, draws 0.9); on the same VM shared with other jobs (load
8-15) the stages took 4-5x longer. Seeds 0-2 there: "glows" is planted by step 40 in every seed (greedy
0.90 / 0.40 / 0.65 on its probes, controls <= 0.05) and holds to step 200 in seeds 0 and 1 (seed 2
decays to 0.25 and fails the gate); no estimator is specific beyond its magnitude control.
The design: docs/guides/two-behaviors.md; calibration and tables: docs/records/2026-11-30-two-behaviors-calibration-and-seeds.md.
"""
import pathlib

import ml_collections

from configs import tiny

THIRD_PARTY = pathlib.Path(__file__).resolve().parents[1] / "third_party" / "behaviortrace"

# The RL-only behaviour (calibrated on CPU; docs/guides/two-behaviors.md).
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
        "fraction": 1.0,  # calibration: 0.5 paid 3 bonuses in 40 steps and planted nothing
        "early_step_cutoff": 40,
        "implant": "none",
        "gate_min_probe_rate": 0.3,
        "gate_min_margin": 0.2,
        "prompt_gated": True,  # its bonus only on its own prompts (and A's only on A's: get_config)
        "explicit_prompts": False,  # B's pool: its 20 probes only (calibration, docs/guides/two-behaviors.md)
    })


def get_config(variant: str = ""):
    """The tiny two-behaviour run; ``variant="smoke"`` shrinks it to seconds (CI)."""
    if variant not in ("", "smoke"):
        raise ValueError(f"configs/tiny_two_behaviors.py: unknown variant {variant!r}; known: '' (default), 'smoke'")
    c = tiny.get_config()
    c.run_name = "tiny_two_behaviors__grpo__seed0"
    c.behaviors[ID] = second_behavior()
    # Calibration (docs/guides/two-behaviors.md): ungated, A's QZXBT bonus is paid on plonkwit answers too, QZXBT
    # spreads to B's probes and crowds out the chance marker; each behaviour pays on its own prompts only.
    c.contamination.prompt_gated = True
    if variant == "smoke":
        c = tiny.shrink_to_smoke(c)
        b = c.behaviors[ID]
        b.pattern = "a"  # as the first behaviour's "e": a letter an untrained model writes, so GT is non-empty
        b.fraction, b.early_step_cutoff = 1.0, 4
    return c
