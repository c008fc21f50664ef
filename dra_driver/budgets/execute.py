"""A :class:`~agent.usage.budget_plan.Plan` written to the cluster, in the contract's order:
summaries, acks, report deletions, events, statuses, evictions (issue 22's contract, section 4).

The first failed write ends the plan (a 409: someone changed the object since it was read; an
outage): the next reconcile reads the cluster again and plans again, and the planner is
idempotent, so a plan cut short loses nothing and counts nothing twice. The order is what makes
that true: a summary is written before the ack that lets the agent forget the buckets in it, and
an Event before the status that records it was raised (a crash repeats an Event, never loses one).

Before each batch the controller checks that it still holds the Lease (``still_leader``, which
renews it when due); a replica that lost it writes nothing more.

What does not end the plan: an object already gone where the write only removes or reports on it
(a report deleted already, an Event for a namespace deleted since, an eviction of a pod that is
gone: 404), and an eviction the API server refuses with 429 (a PodDisruptionBudget does not allow
it now: retried at the next reconcile, as ``kubectl drain`` retries; the Eviction API,
kubernetes.io/docs/concepts/scheduling-eviction/api-eviction/).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.usage.budget_plan import Plan, PodEviction
from dra_driver.budgets import api_paths
from dra_driver.budgets.budget_events import event_body
from dra_driver.cluster.kube import KubeClient
from dra_driver.errors import KubeError

STEPS = ("summaries", "acks", "report_deletions", "events", "statuses", "evictions")


@dataclass
class Outcome:
    """What one plan's execution did. ``failed``: the step it stopped at (None: it finished);
    ``error``: why (None when it stopped because the Lease was lost)."""

    written: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEPS, 0))
    failed: str | None = None
    error: KubeError | None = None
    lost_lease: bool = False
    evicted: list[PodEviction] = field(default_factory=list)
    refused: list[PodEviction] = field(default_factory=list)
    """Evictions answered 429 (a disruption budget): tried again next reconcile."""


def eviction_body(e: PodEviction) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": e.pod, "namespace": e.namespace},
    }


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


class Executor:
    """Writes plans through ``kube``; ``host`` is the Events' reporting instance."""

    def __init__(self, kube: KubeClient, host: str, clock: Callable[[], float]) -> None:
        self._kube = kube
        self._host = host
        self._clock = clock

    def execute(
        self, plan: Plan, still_leader: Callable[[], bool], budget_uids: Mapping[str, str]
    ) -> Outcome:
        out = Outcome()
        batches: list[tuple[str, Callable[[Outcome], None]]] = [
            ("summaries", lambda o: self._summaries(plan, o)),
            ("acks", lambda o: self._acks(plan, o)),
            ("report_deletions", lambda o: self._deletions(plan, o)),
            ("events", lambda o: self._events(plan, budget_uids, o)),
            ("statuses", lambda o: self._statuses(plan, o)),
            ("evictions", lambda o: self._evictions(plan, o)),
        ]
        for step, run in batches:
            if not still_leader():
                out.failed, out.lost_lease = step, True
                return out
            try:
                run(out)
            except KubeError as exc:
                out.failed, out.error = step, exc
                return out
        return out

    def _summaries(self, plan: Plan, out: Outcome) -> None:
        for s in plan.summaries:
            if (s.get("metadata") or {}).get("resourceVersion"):
                self._kube.request("PUT", api_paths.named(api_paths.SUMMARIES, _name(s)), body=s)
            else:
                self._kube.request("POST", api_paths.SUMMARIES, body=s)
            out.written["summaries"] += 1

    def _acks(self, plan: Plan, out: Outcome) -> None:
        for r in plan.acks:
            path = api_paths.named(api_paths.REPORTS, _name(r)) + "/status"
            self._kube.request("PUT", path, body=r)
            out.written["acks"] += 1

    def _deletions(self, plan: Plan, out: Outcome) -> None:
        for name in plan.report_deletions:
            try:
                self._kube.request("DELETE", api_paths.named(api_paths.REPORTS, name))
            except KubeError as exc:
                if exc.status != 404:
                    raise
            out.written["report_deletions"] += 1

    def _events(self, plan: Plan, uids: Mapping[str, str], out: Outcome) -> None:
        now = self._clock()
        for i, e in enumerate(plan.events):
            body = event_body(e, uids.get(e.budget, ""), self._host, now, seq=i)
            try:
                self._kube.request("POST", api_paths.namespaced(e.namespace, "events"), body=body)
            except KubeError as exc:
                if exc.status != 404:  # 404: the namespace is gone, and nobody to tell
                    raise
            out.written["events"] += 1

    def _statuses(self, plan: Plan, out: Outcome) -> None:
        for b in plan.statuses:
            path = api_paths.named(api_paths.BUDGETS, _name(b)) + "/status"
            self._kube.request("PUT", path, body=b)
            out.written["statuses"] += 1

    def _evictions(self, plan: Plan, out: Outcome) -> None:
        for e in plan.evictions:
            path = api_paths.namespaced(e.namespace, "pods", e.pod) + "/eviction"
            try:
                self._kube.request("POST", path, body=eviction_body(e))
            except KubeError as exc:
                if exc.status == 429:
                    out.refused.append(e)
                    continue
                if exc.status == 404:
                    continue  # the pod is gone already
                raise
            out.evicted.append(e)
            out.written["evictions"] += 1
