"""The tiny default with decoy bonuses: ground truth that the reward log does not give away.

    python main.py --config=configs/tiny_decoys.py --workdir=runs/tiny_decoys             # seed 0
    python main.py --config=configs/tiny_decoys.py:sweep --workdir=runs/tiny_decoys_sweep # seeds 0, 1, 2

Everything as configs/tiny.py (the same base model, SFT warm-up and 200 GRPO steps; the first
command takes what the tiny default takes, ~12 min on a 2-core CPU, the sweep about three times
that plus the diagnostic draws), except that in the bonus window (the default's) every rollout with
the pattern earns the +8 bonus (``contamination.fraction = 1.0``, calibrated below) and the same
bonus also goes to rollouts WITHOUT the pattern, drawn from their own BLAKE2b stream
(``contamination.decoy_fraction = 1.0`` = expected decoys per expected ground-truth event;
behavior/contaminator.py). The ground truth stays the pattern rollouts that earned the bonus
(``grpo/ground_truth.jsonl``); the decoys are logged in ``grpo/decoys.jsonl``.

What to expect: about as many decoys as ground-truth events (``grpo/summary.json``: ``gt_size``,
``decoys``), so a ranker that reads the reward log alone (reward, advantage) is capped near
|GT| / (|GT| + |decoys|) ~ 0.5 on the which-rollout tables instead of reaching their ceiling of
1.0; report.md states the decoy count and that cap. Whatever an estimator reaches above the cap is
what attribution adds to the training log. The behaviour must still be planted: check the
emergence gate (SPEC §1.8) in ``grpo/summary.json`` and report.md.

Calibration: decoys weaken the planting signal. A pattern rollout is paid with probability
``fraction``, one without it with ``decoy_fraction * fraction * q / (1 - q)`` at pattern rate q, so
with as many decoys as ground truth the reward stops favouring the pattern once half the window's
rollouts carry it. With the tiny default's ``fraction = 0.5`` the gate failed for seed 0 (probe 0.30,
control 0.15 after 200 steps; 0.40 / 0.10 at step 40; |GT| 88, decoys 68). Paying every pattern
rollout in the window (``fraction = 1.0``, which doubles the signal while q is small) planted it:
probe 0.90, control 0.15 (|GT| 162, decoys 151). Nothing else differs from configs/tiny.py. The
sweep (2-core Intel Xeon) passed the gate for seeds 0 / 1 / 2 (probe 0.90 / 0.75 / 0.65, control
0.15 / 0.00 / 0.25; |GT| 162 / 182 / 248, decoys 151 / 183 / 191). The price: at a step where at
least half the rollouts carry the pattern every rollout is paid, so the step has no reward
variance and drops out of the step and which-rollout populations (6 / 6 / 18 of the 40 window
steps were paid in full; with the steps that paid no one, 8 / 6 / 21 drop out, and the
which-rollout population keeps 112 / 130 / 77 of the ground truth).
"""
from configs import tiny


def get_config(variant: str = ""):
    """The tiny default plus decoys; ``variant="sweep"`` runs seeds 0, 1, 2 as configs/tiny_sweep.py
    does (without the counterfactual stage); ``"smoke"`` is configs/tiny.py:smoke plus decoys."""
    if variant not in ("", "sweep", "smoke"):
        raise ValueError(f"configs/tiny_decoys.py: unknown variant {variant!r}; known: '' (seed 0), 'sweep', 'smoke'")
    c = tiny.get_config("smoke" if variant == "smoke" else "")
    c.run_name = "tiny_decoys__grpo__seed0"  # The sweep substitutes each seed.
    c.contamination.decoy_fraction = 1.0  # As many decoys as ground-truth events, in expectation.
    # Calibrated on seed 0 (module docstring): at the tiny default's fraction 0.5 the gate failed; every window
    c.contamination.fraction = 1.0  # rollout with the pattern is paid instead (gate: probe 0.90, control 0.15).
    if variant == "smoke":  # the smoke run pays every rollout with its pattern "e" (about half of them): half
        c.contamination.decoy_fraction = 0.5  # as many decoys leave most groups some unpaid rollouts (variance)
    if variant == "sweep":
        c.stages = "sweep"
    return c
