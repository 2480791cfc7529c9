"""Layer 3, ``sketch``: gradient sketches. CountSketch hashing of parameter trees (``countsketch``),
per-example gradient sketches with ``vmap(grad)`` (``sketcher``), the behaviour targets and their
sketches (``targets``), and the run's sketch arrays with their metadata (``stores``).
Imports: ``io``, ``models`` and ``behavior``.
"""
