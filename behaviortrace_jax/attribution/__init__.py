"""Layer 1 (beside ``models``), ``attribution``: scoring and judging, numpy/scipy/matplotlib only,
never jax. Attribution estimators (``estimators``: their API, the rollout-level ones and the runners;
the registry and shared similarities in ``estimator_registry``, the step-level estimators in
``step_estimators``, the log controls in ``controls``) and the per-rollout scores of a run read from
its sketch stores (``scores``), precision/recall/bootstrap metrics (``metrics``), the result files
(``formats``: results_table.csv, score files, ground truth, minimal-pair rows, rollout ids), the
step, which-rollout and rollout-level tables (``tables``), the decision rules and checklist
(``verdicts``), specificity across behaviours (``specificity``), the report and figures
(``report``) and the release format the ``reproduce`` and ``evaluate`` stages share (``release``);
the replay plans and their estimators (``replay_plans``, ``replay_estimators``), the counterfactual
tables and report section (``counterfactual_tables``, ``counterfactual_report``) and the tables and
sections stages own (``stage_outputs``).
Imports: only the jax-free ``io.cache``, ``io.files``, ``io.layout``, ``io.machine``, ``io.replay_request``,
``io.rollout_log`` and ``io.sketch_store``. ``tests/repo/test_layers.py`` checks that importing this
package never loads jax.
"""
