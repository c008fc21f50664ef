"""Each claim's final usage in its ResourceClaim's ``status.devices[].data``, written once when
the claim is unprepared (kube mode; docs/budgets.md, "The per-claim summary").

**What.** For every device of the claim, the ``status.devices`` entry keyed by (this driver, pool,
device, shareID when the allocation has one) gets ``data``::

    {"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "ClaimUsage",
     "allocatedGpuHours": "0.250000", "busyGpuHours": "0.121000", "energyKWh": "0.087500",
     "through": "2026-12-04T12:07:31.250000Z"}

the device's counters in the node's usage ledger (decimal strings with six decimals, never an
exponent) and the wall-clock time they count up to. Read when the write is made, after the
unprepare: they may lack the last sampling interval the claim was held (the holding is released
before the sampler's next tick counts it); ``through`` says how far they count.

**When.** Only at unprepare, never in steady state, so the node's steady-state API writes stay
at one per minute (docs/budgets.md, "API writes"): at most one GET and one PUT per unprepared
claim (two of each on a 409).

**Off the kubelet's path.** :meth:`ClaimUsageStatusWriter.submit` only queues (a bounded queue;
a full one drops the claim, logged and counted); one thread (:meth:`run`, under the agent's
supervisor) writes: GET the claim, merge its entries into ``status.devices`` (other drivers'
entries, and the ``conditions`` and ``networkData`` of its own, are kept), PUT ``/status`` with
the resourceVersion read; one retry from a fresh GET on a 409. A 404 (the claim is gone: its pod
was deleted with its template claim) is fine and logged at debug, as is a claim no longer
allocated (the API server accepts device status only for allocated devices, and clears it with
the allocation). Any other failure is logged with the claim and counted
(``tessera_claim_usage_status_errors_total``); nothing is retried later: the record budgets use
is the node's ``GpuUsageReport`` (:mod:`dra_driver.cluster.usage_report`), and this is a
summary for the claim's owner.

**Upstream.** ``AllocatedDeviceStatus`` (k8s.io/api resource/v1 types.go): "The combination of
Driver, Pool, Device, and ShareID must match the corresponding key in Status.Allocation.Devices";
``data`` at most 10 Ki. It needs the ``DRAResourceClaimDeviceStatus`` feature gate (beta, on by
default from 1.33; with it off the API server drops ``status.devices``) and ``update`` on
``resourceclaims/status`` (deploy/daemonset/rbac.yaml).

**Shutdown.** :meth:`close` (once ``run`` returned) writes what is still queued within a bounded
time and drops the rest, logging which claims.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from agent.logs import fields_
from agent.usage.buckets import rfc3339
from agent.usage.ledger_file import Counters
from dra_driver.errors import KubeConflict, KubeError

if TYPE_CHECKING:  # the kubernetes client is imported where kube mode starts
    from dra_driver.cluster.kube import KubeClient

DATA_API_VERSION = "gpu.tessera.dev/v1alpha1"
DATA_KIND = "ClaimUsage"
QUEUE_SIZE = 1000
"""Claims waiting to be written; more unprepares than this between two writes drop the rest."""
POLL_S = 0.5
"""How often the writer's thread looks at the stop flag while the queue is empty."""

DeviceKey = tuple[str, str, str | None]
"""(pool, device, shareID or None): one allocated device of this driver."""


@dataclass(frozen=True)
class UnpreparedClaim:
    """A claim whose devices were just unprepared on this node."""

    namespace: str
    name: str
    uid: str
    devices: tuple[DeviceKey, ...]

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


class _OutOfTime(Exception):
    """The shutdown bound passed before a request could start."""


class ClaimTotals(Protocol):
    """The node's usage ledger as the writer needs it (:class:`agent.telemetry.usage_meter.
    UsageMeter` satisfies it)."""

    def claim_totals(self, uid: str) -> tuple[float, dict[tuple[str, str], Counters]] | None: ...


@dataclass
class StatusStats:
    """For /metrics (read from another thread: plain attribute reads)."""

    writes: int = 0
    """PUTs of a claim's status sent."""
    errors: int = 0
    """Claims whose status could not be written (refused, no answer, queue full, dropped at
    shutdown); a claim gone or no longer allocated is not an error."""


def _decimal(value: float) -> str:
    """A counter as a decimal string (six decimals: 3.6 ms of a GPU-hour, 3.6 J of a kWh)."""
    return f"{max(value, 0.0):.6f}"


def usage_data(totals: Sequence[Counters], through: float) -> dict[str, str]:
    """The ``data`` of one device's entry: the sum of ``totals`` (the device's counters; none:
    zero) counted up to ``through``."""
    return {
        "apiVersion": DATA_API_VERSION,
        "kind": DATA_KIND,
        "allocatedGpuHours": _decimal(sum(c.allocated_gpu_seconds for c in totals) / 3600.0),
        "busyGpuHours": _decimal(sum(c.busy_gpu_seconds for c in totals) / 3600.0),
        "energyKWh": _decimal(sum(c.energy_joules for c in totals) / 3.6e6),
        "through": rfc3339(through),
    }


def _allocated(claim: Mapping[str, Any], driver: str) -> set[DeviceKey]:
    """This driver's devices in the claim's ``status.allocation`` (empty: not allocated)."""
    status = claim.get("status") or {}
    allocation = status.get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    return {
        (str(r.get("pool")), str(r.get("device")), r.get("shareID"))
        for r in results
        if isinstance(r, Mapping) and r.get("driver") == driver
    }


def merged_status(
    claim: Mapping[str, Any], driver: str, data: Mapping[DeviceKey, Mapping[str, str]]
) -> dict[str, Any] | None:
    """``claim`` with ``data`` in its ``status.devices`` entries, or None when none of the
    devices is allocated any more. Other drivers' entries, and every field but ``data`` of this
    driver's, are kept; an entry is added for a device that has none."""
    allocated = _allocated(claim, driver)
    wanted = {k: v for k, v in data.items() if k in allocated}
    if not wanted:
        return None
    out = dict(claim)
    status = dict(out.get("status") or {})
    entries: list[Any] = []
    done: set[DeviceKey] = set()
    for entry in status.get("devices") or []:
        if isinstance(entry, Mapping) and entry.get("driver") == driver:
            key = (str(entry.get("pool")), str(entry.get("device")), entry.get("shareID"))
            if key in wanted:
                entry = {**entry, "data": dict(wanted[key])}
                done.add(key)
        entries.append(entry)
    for (pool, device, share), body in sorted(wanted.items(), key=lambda kv: str(kv[0])):
        if (pool, device, share) in done:
            continue
        entry = {"driver": driver, "pool": pool, "device": device, "data": dict(body)}
        if share is not None:
            entry["shareID"] = share
        entries.append(entry)
    status["devices"] = entries
    out["status"] = status
    return out


class ClaimUsageStatusWriter:
    """Writes unprepared claims' usage into their status (see the module docstring)."""

    def __init__(
        self,
        kube: KubeClient,
        driver: str,
        totals: ClaimTotals,
        log: logging.Logger,
        *,
        queue_size: int = QUEUE_SIZE,
        timeout: tuple[float, float] = (3.0, 5.0),
        poll: float = POLL_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.driver = driver
        self.totals = totals
        self.log = log
        self.stats = StatusStats()
        self._queue: queue.Queue[UnpreparedClaim] = queue.Queue(maxsize=queue_size)
        self._timeout = timeout
        self._poll = poll
        self._monotonic = monotonic

    def submit(self, claim: UnpreparedClaim) -> bool:
        """Queue a claim just unprepared; False when the queue was full (dropped, logged,
        counted). Never blocks."""
        try:
            self._queue.put_nowait(claim)
        except queue.Full:
            self.stats.errors += 1
            self.log.warning(
                "claim usage status queue full; this claim's status gets no usage summary",
                extra=fields_(claim=str(claim), queue_size=self._queue.maxsize),
            )
            return False
        return True

    def run(self, stop: threading.Event) -> None:
        """Write claims as they are queued until ``stop`` is set."""
        while not stop.is_set():
            try:
                claim = self._queue.get(timeout=self._poll)
            except queue.Empty:
                continue
            self.write(claim)

    def close(self, timeout: float) -> list[str]:
        """Once ``run`` returned: write what is still queued for at most ``timeout`` seconds
        (each request's connect and read timeouts together are at most what is left of it),
        then drop the rest, logging which claims; the claims dropped."""
        end = self._monotonic() + max(timeout, 0.0)
        while end - self._monotonic() > 0:
            try:
                claim = self._queue.get_nowait()
            except queue.Empty:
                return []
            self.write(claim, end)
        dropped: list[str] = []
        while True:
            try:
                dropped.append(str(self._queue.get_nowait()))
            except queue.Empty:
                break
        if dropped:
            self.stats.errors += len(dropped)
            self.log.warning(
                "claims' usage status not written before shutdown",
                extra=fields_(claims=dropped),
            )
        return dropped

    # -- one claim ---------------------------------------------------------------------------

    def write(self, claim: UnpreparedClaim, end: float | None = None) -> bool:
        """Write one claim's usage into its status now, its requests done by monotonic ``end``
        when given; True when the API server took it. Never raises: failures (and running out
        of time) are logged and counted."""
        try:
            got = self.totals.claim_totals(claim.uid)
            if got is None:
                self.log.debug(
                    "no usage counted yet; claim status not written",
                    extra=fields_(claim=str(claim)),
                )
                return False
            through, counters = got
            data = {
                key: usage_data([c for k, c in counters.items() if k == key[:2]], through)
                for key in claim.devices
            }
            return self._put(claim, data, end)
        except _OutOfTime:
            self._failed(claim, "no time left before shutdown")
        except KubeError as exc:
            if exc.status == 404:
                self.log.debug(
                    "claim gone; its usage status is not written", extra=fields_(claim=str(claim))
                )
                return False
            self._failed(claim, str(exc))
        except Exception as exc:  # a bug here must never take the agent (and GPUs) down
            self._failed(claim, f"{type(exc).__name__}: {exc}")
        return False

    def _failed(self, claim: UnpreparedClaim, error: str) -> None:
        self.stats.errors += 1
        self.log.warning(
            "cannot write the claim's usage into its status",
            extra=fields_(claim=str(claim), error=error),
        )

    def _request(
        self, method: str, path: str, end: float | None, body: Any = None
    ) -> dict[str, Any]:
        """One request, its timeouts cut so that it ends by ``end`` (connect and read half of
        what is left each)."""
        timeout = self._timeout
        if end is not None:
            left = end - self._monotonic()
            if left <= 0:
                raise _OutOfTime
            timeout = (min(timeout[0], left / 2), min(timeout[1], left / 2))
        got: dict[str, Any] = self.kube.request(method, path, body=body, timeout=timeout)
        return got

    def _path(self, claim: UnpreparedClaim) -> str:
        return f"/apis/resource.k8s.io/v1/namespaces/{claim.namespace}/resourceclaims/{claim.name}"

    def _put(
        self,
        claim: UnpreparedClaim,
        data: Mapping[DeviceKey, Mapping[str, str]],
        end: float | None,
    ) -> bool:
        for attempt in (1, 2):
            current = self._request("GET", self._path(claim), end)
            if (current.get("metadata") or {}).get("uid") != claim.uid:
                self.log.debug(
                    "claim replaced by another of the same name; its usage status is not written",
                    extra=fields_(claim=str(claim)),
                )
                return False
            body = merged_status(current, self.driver, data)
            if body is None:
                self.log.debug(
                    "claim no longer allocated; its usage status is not written",
                    extra=fields_(claim=str(claim)),
                )
                return False
            self.stats.writes += 1
            try:
                self._request("PUT", self._path(claim) + "/status", end, body)
            except KubeConflict:
                if attempt == 2:
                    raise
                continue  # changed since read (e.g. its reservedFor): once more from a fresh GET
            return True
        return False  # not reached: the second conflict raised
