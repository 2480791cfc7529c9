"""Layer 4, ``train``: optimisation. Train state and optimizer (``train_state``), the packed-LM
trainer used by the base and SFT stages (``lm_trainer``), GRPO losses and advantages
(``grpo_loss``), the jitted, sharded GRPO train step with its in-step sketches (``grpo_step``), one
step's sample -> reward -> batch (``rollouts``), the parts of a GRPO run that the ``grpo`` stage
orchestrates (its behaviours ``grpo_tracks``, its update ``grpo_updater``, its logs ``grpo_logs``,
its checkpoints and resume ``grpo_checkpoint``), the counterfactual replay (``replay``), the causal
ground truth's replays (``causal``), the metagradient (``metagradient``)
and the non-finite guard of every trainer (``nonfinite``).
Imports: ``io``, ``models``, ``behavior`` and ``sketch``.
"""
