"""The budget controller's plumbing (``tessera budgets``, docs/budgets.md "The controller"): a
file per question.

- :mod:`~dra_driver.budgets.api_paths`: where each object the controller reads and writes lives;
- :mod:`~dra_driver.budgets.view`: the cluster read into the planner's ``ClusterView``;
- :mod:`~dra_driver.budgets.budget_events`: a ``BudgetEvent`` as the core/v1 Event written;
- :mod:`~dra_driver.budgets.execute`: a ``Plan`` written in the contract's order, stopping at the
  first failed write;
- :mod:`~dra_driver.budgets.budget_metrics`: the controller's Prometheus metrics;
- :mod:`~dra_driver.budgets.controller`: the loop: leader election, reconcile, never crash.

The planner itself is pure and lives in ``agent.usage.budget_plan``; the Lease in
``dra_driver.cluster.lease``.
"""
