"""Layer 4, ``train``: optimisation. Train state and optimizer (``train_state``), the packed-LM
trainer used by the base and SFT stages (``lm_trainer``), GRPO losses and advantages
(``grpo_loss``), the jitted, sharded GRPO train step with its in-step sketches (``grpo_step``), one
step's sample -> reward -> batch (``rollouts``), the counterfactual replay (``replay``), the causal
ground truth's replays (``causal``), the metagradient (``metagradient``)
and the non-finite guard of every trainer (``nonfinite``).
Imports: ``io``, ``models``, ``behavior`` and ``sketch``.
"""
