"""Layer 3, ``sketch``: gradient sketches. The hash families (``hash_families``: the registry of
``HashFamily`` objects; their hashes in ``splitmix64`` and ``block_hash``), the parameter layout in
HF order (``param_layout``), CountSketch of parameter trees (``countsketch``) and its hash tables (``tables``),
per-example gradient sketches with ``vmap(grad)`` (``sketcher``) and fused with the backward pass
(``fused``), the behaviour targets and their sketches (``targets``), and the run's sketch arrays
with their metadata (``stores``). Imports: ``io``, ``models``, ``behavior`` and ``attribution``
(numpy only: the SPEC §4 cosine's epsilon is one constant with the estimators').
"""
