"""Layer 5 (between ``train`` and ``stages``), ``aot``: ahead-of-time compilation of a run's jitted
programs, the library the ``compile`` stage orchestrates. The programs of a config built by the
run's own constructors on its mesh (``builders``), the target's devices and memory and a compiled
program's per-chip bytes (``memory``), XLA's cost analysis with every loop trip counted (``cost``)
and the report's rows and files (``report``).
Imports: ``models``, ``sketch`` and ``train``.
"""
