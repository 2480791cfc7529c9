"""Layer 0, ``io``: what a run writes to disk and reads back. Atomic files and JSON (``files``),
the rollout log and its rollout ids (``rollout_log``), a running GRPO loop's ``progress.json``
(``progress``), tensorstore sketch arrays (``sketch_store``), orbax train-state checkpoints and
their registry (``checkpoints``), the machine a run ran on (``machine``), and
:class:`layout.RunLayout`, the path of every stage's outputs under a workdir, with the draws' file
names (``layout``), and keyed result files (``cache``: every file a stage reuses).
Imports: nothing from the package (the bottom layer). ``cache``, ``files``,
``layout``, ``machine``, ``rollout_log`` and ``sketch_store`` never import jax, so the numpy-only
``attribution`` layer may use them; ``checkpoints`` does (orbax).
"""
