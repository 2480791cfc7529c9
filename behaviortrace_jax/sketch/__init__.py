"""Layer 3, ``sketch``: gradient sketches. CountSketch hashing of parameter trees (``countsketch``),
per-example gradient sketches with ``vmap(grad)`` (``sketcher``) and fused with the backward pass
(``fused``), the behaviour targets and their sketches (``targets``), and the run's sketch arrays
with their metadata (``stores``). Imports: ``io``, ``models``, ``behavior`` and ``attribution``
(numpy only: the SPEC §4 cosine's epsilon is one constant with the estimators').
"""
