"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go's ``tools/leaderelection``
decides it (``leaderelection.go`` ``tryAcquireOrRenew`` and ``release``; ``resourcelock/
leaselock.go`` for the fields):

- **Absent**: create it with ``holderIdentity`` us, ``leaseDurationSeconds``, ``acquireTime`` and
  ``renewTime`` now, ``leaseTransitions`` 0. A 409 (AlreadyExists) means another candidate won.
- **Held by another**: it is expired only when the record has not changed for
  ``leaseDurationSeconds`` *as this process observed it*: client-go keeps the time it last saw the
  record change (``observedTime``, its own clock) instead of trusting the holder's
  ``renewTime``, so clock skew between replicas cannot steal a live lease. A fresh candidate
  therefore waits one full duration after its first look. An empty ``holderIdentity`` (a
  released lease) may be taken at once.
- **Taking over**: ``acquireTime`` now and ``leaseTransitions`` + 1; **renewing** our own: only
  ``renewTime`` (and the duration) change. Every write is an update with the
  ``resourceVersion`` read (optimistic concurrency): a 409 means someone else wrote first, and we
  do not hold it.
- **Leading**: the holder counts itself leader only until ``renew_deadline_s`` after its last
  successful renewal (client-go's ``RenewDeadline``, shorter than the lease), so it stops acting
  before another replica can take over.
- **Release** (a clean stop, client-go's ``ReleaseOnCancel``): write ``holderIdentity`` "" with
  ``leaseDurationSeconds`` 1, so the other replica takes over at its next try.

The API's errors are the caller's to log: :meth:`LeaseElector.try_acquire_or_renew` raises
``KubeError`` for anything but a lost race.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from dra_driver.cluster.kube import KubeClient
from dra_driver.errors import KubeConflict, KubeError

API = "/apis/coordination.k8s.io/v1"


def micro_time(t: float) -> str:
    """``metav1.MicroTime`` as the API server writes it (RFC 3339 with microseconds)."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class LeaseTiming:
    """client-go's defaults are 15 s, 10 s and 2 s (``LeaseDuration``, ``RenewDeadline``,
    ``RetryPeriod``); the controller renews every ``renew_period_s``."""

    duration_s: float = 15.0
    renew_period_s: float = 5.0
    retry_period_s: float = 2.0
    renew_deadline_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.renew_period_s < self.renew_deadline_s < self.duration_s:
            raise ValueError(
                f"lease timing: need 0 < renew period ({self.renew_period_s} s) < renew deadline"
                f" ({self.renew_deadline_s} s) < lease duration ({self.duration_s} s)"
            )
        if self.retry_period_s <= 0:
            raise ValueError(f"lease timing: retry period {self.retry_period_s} s is not > 0")

    @property
    def duration_seconds(self) -> int:
        """The Lease's whole-second ``leaseDurationSeconds`` (at least 1)."""
        return max(1, round(self.duration_s))


@dataclass(frozen=True)
class _Observed:
    """The record as last seen, and when (our monotonic clock) it last changed."""

    holder: str
    renew_time: str
    duration_s: float
    seen_at: float


class LeaseElector:
    """One candidate for one Lease. ``clock`` is Unix time (what ``renewTime`` says);
    ``monotonic`` measures expiry and the renew deadline. Not thread-safe: one loop drives it."""

    def __init__(
        self,
        kube: KubeClient,
        namespace: str,
        name: str,
        identity: str,
        timing: LeaseTiming,
        clock: Callable[[], float],
        monotonic: Callable[[], float],
    ) -> None:
        self._kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.timing = timing
        self._clock = clock
        self._monotonic = monotonic
        self._observed: _Observed | None = None
        self._renewed_at: float | None = None
        """Monotonic time of our last successful acquire or renew; None: not leading."""

    @property
    def path(self) -> str:
        return f"{API}/namespaces/{self.namespace}/leases/{self.name}"

    @property
    def holder(self) -> str:
        """The holder as last observed ("" for none or not yet read)."""
        return "" if self._observed is None else self._observed.holder

    def is_leader(self) -> bool:
        """Whether we hold the lease now: renewed within the renew deadline."""
        if self._renewed_at is None:
            return False
        return self._monotonic() - self._renewed_at < self.timing.renew_deadline_s

    def try_acquire_or_renew(self) -> bool:
        """One attempt (client-go ``tryAcquireOrRenew``); whether we hold the lease after it.
        A lost race (409) is False; any other failure raises KubeError and leaves the renew
        deadline running (a leader that cannot renew stops leading at the deadline)."""
        try:
            lease: dict[str, Any] | None = self._kube.request("GET", self.path)
        except KubeError as exc:
            if exc.status != 404:
                raise
            lease = None
        now = self._clock()
        if lease is None:
            return self._write("POST", self._body(None, now, taking_over=True))
        self._observe(lease)
        spec = lease.get("spec") or {}
        holder = str(spec.get("holderIdentity") or "")
        observed = self._observed
        assert observed is not None
        ours = holder == self.identity
        if holder and not ours:
            self._renewed_at = None
            if self._monotonic() < observed.seen_at + observed.duration_s:
                return False  # held by another and not expired (by our own observation)
        return self._write("PUT", self._body(lease, now, taking_over=not ours))

    def release(self) -> bool:
        """Give the lease up if we hold it (client-go ``release``): True when released."""
        if not self.is_leader():
            return False
        try:
            lease = self._kube.request("GET", self.path)
        except KubeError:
            self._renewed_at = None
            return False
        spec = lease.get("spec") or {}
        if spec.get("holderIdentity") != self.identity:
            self._renewed_at = None
            return False
        now = micro_time(self._clock())
        body = {
            **lease,
            "spec": {
                "holderIdentity": "",
                "leaseDurationSeconds": 1,
                "acquireTime": now,
                "renewTime": now,
                "leaseTransitions": int(spec.get("leaseTransitions") or 0),
            },
        }
        self._renewed_at = None
        try:
            self._kube.request("PUT", self.path, body=body)
        except KubeError:
            return False  # it expires on its own
        return True

    def _body(self, lease: dict[str, Any] | None, now: float, taking_over: bool) -> dict[str, Any]:
        spec = {} if lease is None else dict(lease.get("spec") or {})
        transitions = int(spec.get("leaseTransitions") or 0)
        if lease is not None and taking_over:
            transitions += 1
        new_spec = {
            **spec,
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.timing.duration_seconds,
            "renewTime": micro_time(now),
            "leaseTransitions": transitions,
        }
        if taking_over or "acquireTime" not in spec:
            new_spec["acquireTime"] = micro_time(now)
        if lease is None:
            return {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": new_spec,
            }
        return {**lease, "spec": new_spec}  # metadata carries the resourceVersion read

    def _write(self, method: str, body: dict[str, Any]) -> bool:
        path = self.path if method == "PUT" else f"{API}/namespaces/{self.namespace}/leases"
        try:
            written = self._kube.request(method, path, body=body)
        except KubeConflict:
            self._renewed_at = None
            return False
        self._renewed_at = self._monotonic()
        self._observe(written)
        return True

    def _observe(self, lease: dict[str, Any]) -> None:
        spec = lease.get("spec") or {}
        holder = str(spec.get("holderIdentity") or "")
        renew = str(spec.get("renewTime") or "")
        duration = spec.get("leaseDurationSeconds")
        duration_s = float(duration) if isinstance(duration, int) and duration > 0 else 0.0
        old = self._observed
        if old is not None and (old.holder, old.renew_time) == (holder, renew):
            return  # unchanged: expiry counts from when we first saw this record
        self._observed = _Observed(holder, renew, duration_s, self._monotonic())
