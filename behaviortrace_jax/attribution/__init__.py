"""Layer 1 (beside ``models``), ``attribution``: scoring and judging, numpy/scipy/matplotlib only,
never jax. Attribution estimators (``estimators``), precision/recall/bootstrap metrics
(``metrics``), result tables, verdicts and results_table.csv (``evaluation``), the report and
figures (``report``) and the release-format readers/writers the ``reproduce`` and ``evaluate``
stages share (``release``). Imports: only ``io.files`` and ``io.layout`` (no jax there);
``tests/test_layers.py`` checks that importing this package never loads jax.
"""
