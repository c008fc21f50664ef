"""A planner's :class:`~agent.usage.budget_plan.BudgetEvent` as the core/v1 Event written: in the
namespace it is about (``kubectl get events -n team-a`` shows the team its budget), its
``involvedObject`` the GpuBudget, named as client-go's
recorder names events (``<involvedObject.name>.<hex of the time in nanoseconds>``, ``tools/record/
event.go`` ``makeEvent``), timestamps as :mod:`dra_driver.cluster.core_event` writes them.

The reference carries the Event's namespace although a GpuBudget is cluster-scoped: the API
server refuses (422) a core/v1 Event outside ``default`` whose ``involvedObject.namespace`` is
empty or differs from its own (Kubernetes ``pkg/apis/core/validation/events.go``,
``legacyValidateEvent``; the emulator checks the same rule). So ``kubectl describe gpubudget``
does not list these Events; ``kubectl get events -n <ns> --field-selector
involvedObject.kind=GpuBudget`` does.

Each is a new Event (no count patching): a budget's events are rare (a threshold, an exhaustion,
a restore, one per evicted pod), and a repeat after a crash is a second Event, never a lost one.
"""

from __future__ import annotations

from typing import Any

from agent.usage.budget_plan import BudgetEvent
from dra_driver.budgets.api_paths import TESSERA_API_VERSION
from dra_driver.cluster.core_event import timestamp

COMPONENT = "tessera-budgets"


def event_body(
    event: BudgetEvent, budget_uid: str, host: str, now: float, seq: int = 0
) -> dict[str, Any]:
    """The Event object a create sends; ``seq`` (its place in the plan) keeps the names of
    Events made at the same instant apart."""
    nanos = int(now * 1e9) + seq
    involved: dict[str, Any] = {
        "kind": "GpuBudget",
        "apiVersion": TESSERA_API_VERSION,
        "name": event.budget,
        "namespace": event.namespace,
    }
    if budget_uid:
        involved["uid"] = budget_uid
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{event.budget}.{nanos:x}", "namespace": event.namespace},
        "involvedObject": involved,
        "type": event.type,
        "reason": event.reason,
        "message": event.message,
        "source": {"component": COMPONENT, "host": host},
        "reportingComponent": COMPONENT,
        "reportingInstance": host,
        "count": 1,
        "firstTimestamp": timestamp(now),
        "lastTimestamp": timestamp(now),
    }
