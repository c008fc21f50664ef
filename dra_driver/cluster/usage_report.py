"""The node's usage record in the cluster: one ``GpuUsageReport`` (tessera.dev/v1alpha1,
cluster-scoped, named after the node), written by this node's agent every
``--usage-report-interval`` (docs/budgets.md, "Usage in the cluster").

Each report is a full replacement of ``spec``: the usage ledger's ``through`` and its 15-minute
buckets not yet acknowledged, the oldest first up to :data:`MAX_REPORT_BYTES` (the rest wait for
the next report), with the Node's labels as last read (energy prices are per node pool). The
ledger is written to disk before its buckets are reported (:meth:`UsageMeter.report`), so the
cluster never sees a count that a crash could take back.

**Writes.** One per interval, whatever the number of claims: a PUT with the resourceVersion of
the object the last write returned (a GET first only when none is known), a create on a 404, one
retry after a fresh GET on a 409 (someone else wrote it: the controller's ack goes through the
status subresource, which moves the resourceVersion too). The GET of the Node for its labels is a
read. A failed or lost write loses nothing: the next one carries the same buckets again.

**Acknowledgement.** ``status.acknowledgedThrough`` (written by the budget controller once it
folded the report's closed buckets before it) is read from every object the API server returns;
the ledger then drops the closed buckets that start before it.

**The CRD missing** (a 404 on a create: the resource itself is not served) is logged once, as
a warning that says what to apply (budgets are optional: a cluster without them has no CRD);
the report is tried again every interval and the buckets wait in the ledger meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from agent.logs import fields_
from agent.usage.buckets import rfc3339
from dra_driver.errors import KubeConflict, KubeError

if TYPE_CHECKING:  # the kubernetes client is imported where kube mode starts
    from dra_driver.cluster.kube import KubeClient

API_VERSION = "tessera.dev/v1alpha1"
KIND = "GpuUsageReport"
REPORTS_PATH = "/apis/tessera.dev/v1alpha1/gpuusagereports"
NODE_LABEL = "tessera.dev/node"
MAX_REPORT_BYTES = 1024 * 1024
"""About this much JSON of buckets per report: well under the API server's 1.5 MiB request
limit (etcd's default ``--max-request-bytes``), with room for the rest of the object."""
CRD_FILE = "deploy/daemonset/budgets/gpuusagereport-crd.yaml"


class UsageSource(Protocol):
    """The node's usage ledger as the report needs it (:class:`agent.telemetry.usage_meter.
    UsageMeter` satisfies it)."""

    def report(self, max_bytes: int) -> tuple[float, list[dict[str, Any]]] | None: ...
    def acknowledge(self, through: float) -> int: ...


@dataclass
class ReportStats:
    """For /metrics (read from another thread: plain attribute reads)."""

    last_success: float | None = None
    """Wall-clock second of the last report the API server accepted."""
    errors: int = 0
    """Reports that failed (the API server refused or did not answer, the CRD is missing, the
    ledger could not be written)."""
    writes: int = 0
    """Creates and updates sent."""


class _CrdMissing(Exception):
    pass


class UsageReporter:
    """Writes this node's ``GpuUsageReport`` (see the module docstring). ``run`` is one loop's
    thread; :meth:`final` is called once that loop stopped."""

    def __init__(
        self,
        kube: KubeClient,
        node: str,
        source: UsageSource,
        log: logging.Logger,
        *,
        interval: float,
        wall: Callable[[], float] = time.time,
        max_bytes: int = MAX_REPORT_BYTES,
        timeout: tuple[float, float] = (5.0, 30.0),
    ) -> None:
        self.kube = kube
        self.node = node
        self.source = source
        self.log = log
        self.interval = interval
        self.stats = ReportStats()
        self._wall = wall
        self._max_bytes = max_bytes
        self._timeout = timeout
        self._current: Mapping[str, Any] | None = None
        """The report as the API server last returned it (its resourceVersion is the next
        write's precondition); None: read it first."""
        self._labels: dict[str, str] = {}
        self._crd_missing_logged = False

    def run(self, stop: threading.Event) -> None:
        """Report every ``interval`` seconds until ``stop`` is set."""
        while not stop.wait(self.interval):
            self.report_once()

    def final(self, timeout: float) -> None:
        """At a clean stop, once counting stopped: one last report within ``timeout`` seconds
        (what was counted since the last one is in the cluster before the agent is gone)."""
        if timeout > 0:
            self.report_once((min(self._timeout[0], timeout), timeout))

    def report_once(self, timeout: tuple[float, float] | None = None) -> bool:
        """Write the report now; True when the API server accepted it. Failures are counted and
        logged, never raised."""
        try:
            got = self.source.report(self._max_bytes)
        except OSError as exc:
            self.stats.errors += 1
            self.log.warning(
                "usage report skipped: the usage ledger cannot be written first",
                extra=fields_(error=str(exc.strerror or exc)),
            )
            return False
        if got is None:
            return False  # nothing counted yet
        through, buckets = got
        timeout = timeout or self._timeout
        try:
            written = self._write(self._object(through, buckets, timeout), timeout)
        except _CrdMissing:
            self.stats.errors += 1
            if not self._crd_missing_logged:
                self._crd_missing_logged = True
                self.log.warning(
                    "the GpuUsageReport resource is not served (its CRD is not installed):"
                    " usage stays in the node's ledger and is reported once it is",
                    extra=fields_(resource=REPORTS_PATH, apply=CRD_FILE),
                )
            return False
        except KubeError as exc:
            self.stats.errors += 1
            self.log.warning(
                "usage report failed; the next one carries the same usage",
                extra=fields_(node=self.node, error=str(exc), next_in_s=self.interval),
            )
            return False
        self._crd_missing_logged = False
        self.stats.last_success = self._wall()
        self._acknowledge(written)
        return True

    # -- the object -------------------------------------------------------------------------

    def _object(
        self, through: float, buckets: list[dict[str, Any]], timeout: tuple[float, float]
    ) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": self.node, "labels": {NODE_LABEL: self.node}},
            "spec": {
                "nodeName": self.node,
                "nodeLabels": self._node_labels(timeout),
                "through": rfc3339(through),
                "buckets": buckets,
            },
        }

    def _node_labels(self, timeout: tuple[float, float]) -> dict[str, str]:
        """The Node's labels (a read); the last ones read when the read fails."""
        try:
            node = self.kube.request("GET", f"/api/v1/nodes/{self.node}", timeout=timeout)
        except KubeError as exc:
            self.log.debug(
                "cannot read the Node's labels; the report carries the last ones read",
                extra=fields_(error=str(exc)),
            )
            return self._labels
        labels = (node.get("metadata") or {}).get("labels") or {}
        if isinstance(labels, dict):
            self._labels = {str(k): str(v) for k, v in labels.items()}
        return self._labels

    # -- the writes -------------------------------------------------------------------------

    def _write(self, obj: dict[str, Any], timeout: tuple[float, float]) -> dict[str, Any]:
        """Create or replace the report; the object the API server returned."""
        current = self._current
        if current is None:
            current = self._get(timeout)
        if current is None:
            try:
                return self._send("POST", REPORTS_PATH, obj, timeout)
            except KubeConflict:  # created meanwhile (another agent of this node): replace it
                current = self._get(timeout)
                if current is None:
                    raise
            except KubeError as exc:
                if exc.status == 404:
                    raise _CrdMissing from exc
                raise
        try:
            return self._send("PUT", self._path, self._replacing(current, obj), timeout)
        except KubeConflict:
            fresh = self._get(timeout)  # one retry, from what is there now
            if fresh is None:
                return self._send("POST", REPORTS_PATH, obj, timeout)
            return self._send("PUT", self._path, self._replacing(fresh, obj), timeout)

    @property
    def _path(self) -> str:
        return f"{REPORTS_PATH}/{self.node}"

    def _get(self, timeout: tuple[float, float]) -> dict[str, Any] | None:
        try:
            got = self.kube.request("GET", self._path, timeout=timeout)
        except KubeError as exc:
            if exc.status == 404:
                self._current = None
                return None
            raise
        self._current = got
        self._acknowledge(got)
        return got

    def _send(
        self, method: str, path: str, body: dict[str, Any], timeout: tuple[float, float]
    ) -> dict[str, Any]:
        self.stats.writes += 1
        try:
            got = self.kube.request(method, path, body=body, timeout=timeout)
        except KubeError:
            self._current = None  # read it again before the next write
            raise
        self._current = got
        return got

    @staticmethod
    def _replacing(current: Mapping[str, Any], obj: dict[str, Any]) -> dict[str, Any]:
        """``obj`` as a replacement of ``current``: its metadata (resourceVersion, uid, labels
        others set) kept, our label set, ``spec`` ours; ``status`` as read (the API server
        ignores it on this path: it is the controller's, through the status subresource)."""
        meta = dict(current.get("metadata") or {})
        meta["labels"] = {**(meta.get("labels") or {}), **obj["metadata"]["labels"]}
        out = {**obj, "metadata": meta}
        if "status" in current:
            out["status"] = current["status"]
        return out

    def _acknowledge(self, obj: Mapping[str, Any]) -> None:
        """Drop from the ledger what ``status.acknowledgedThrough`` says was folded."""
        status = obj.get("status")
        raw = status.get("acknowledgedThrough") if isinstance(status, Mapping) else None
        if raw is None:
            return
        try:
            when = datetime.fromisoformat(str(raw))
            if when.tzinfo is None:
                raise ValueError("no time zone")
        except ValueError:
            self.log.warning(
                "GpuUsageReport status.acknowledgedThrough is not an RFC 3339 time; ignored",
                extra=fields_(node=self.node, value=str(raw)[:60]),
            )
            return
        dropped = self.source.acknowledge(when.timestamp())
        if dropped:
            self.log.debug(
                "usage buckets acknowledged",
                extra=fields_(acknowledged_through=str(raw), dropped=dropped),
            )
