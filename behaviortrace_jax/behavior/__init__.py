"""Layer 2, ``behavior``: the planted behaviour and the data around it. The pattern, judges,
rewards and probe/control sets (``planted``), the contaminator that plants bonus rewards and logs
the ground truth (``contaminator``), the tiny base model's synthetic corpus and tokenizer
(``corpus``, ``tiny_tokenizer``), and measuring the behaviour with a policy (``probes``).
Imports: ``io`` and ``models``.
"""
