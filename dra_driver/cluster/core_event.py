"""One core/v1 Event about the Node, as written (or to be written): the object a create sends
and the patch that counts a repeated one (client-go ``tools/record/event.go`` ``makeEvent``; see
:mod:`dra_driver.cluster.node_events`, "Identity")."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

NAMESPACE = "default"
"""Where Events about cluster-scoped objects live (client-go ``makeEvent``)."""


def timestamp(t: float) -> str:
    """RFC 3339 in seconds, as ``metav1.Time`` is written."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class NodeRef:
    name: str
    uid: str


@dataclass(frozen=True)
class NodeEvent:
    """One core/v1 Event about the Node, as written (or to be written)."""

    name: str
    node: NodeRef
    component: str
    """``source.component`` and ``reportingComponent``."""
    host: str
    """``source.host`` and ``reportingInstance``."""
    type: str
    reason: str
    message: str
    count: int
    first_timestamp: float
    last_timestamp: float
    resource_version: str = ""

    def body(self) -> dict[str, Any]:
        """The Event object a create sends."""
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": self.name, "namespace": NAMESPACE},
            "involvedObject": {
                "kind": "Node",
                "apiVersion": "v1",
                "name": self.node.name,
                "uid": self.node.uid,
            },
            "type": self.type,
            "reason": self.reason,
            "message": self.message,
            "source": {"component": self.component, "host": self.host},
            "reportingComponent": self.component,
            "reportingInstance": self.host,
            "count": self.count,
            "firstTimestamp": timestamp(self.first_timestamp),
            "lastTimestamp": timestamp(self.last_timestamp),
        }

    def patch(self) -> dict[str, Any]:
        """The strategic merge patch of a repeated event (what client-go's two-way patch of the
        event against itself with count, lastTimestamp and message cleared comes to)."""
        return {
            "count": self.count,
            "lastTimestamp": timestamp(self.last_timestamp),
            "message": self.message,
        }
