"""``tessera budgets``: the budget controller (docs/budgets.md "The controller"). Two replicas run
in the tessera-system Deployment; the one holding the Lease folds the nodes' usage reports into
summaries, writes each GpuBudget's status, raises Events and evicts for Terminate budgets. Logs
are JSON lines; SIGTERM releases the Lease (the other replica takes over at once) and stops.
"""

from __future__ import annotations

from agent.cli.foreground import failed, stop_on_signals
from agent.cli.framework import Command, Invocation, Uses
from agent.config import BudgetsSettings


def cmd_budgets(inv: Invocation) -> int:
    from agent.daemon.budgets_compose import build_budgets
    from agent.logs import configure_logging

    settings = inv.get(BudgetsSettings)
    log = configure_logging(settings.log_format, settings.log_level)
    stop = stop_on_signals(log)
    try:
        return build_budgets(settings, log).run(stop)
    except Exception as exc:
        return failed(inv, log, "budget controller", exc)


COMMAND = Command(
    "budgets",
    "run the budget controller (GPU-hour, energy and cost budgets; a Deployment)",
    cmd_budgets,
    (Uses(BudgetsSettings),),
    description="The budget controller: elects a leader on a Lease; the leader folds the"
    " nodes' GpuUsageReports into GpuUsageSummaries, writes every GpuBudget's status, raises"
    " Events at thresholds and exhaustion, and evicts the pods of an exhausted Terminate budget"
    " (docs/budgets.md). Serves /metrics, /healthz and /readyz on --metrics-address.",
)
