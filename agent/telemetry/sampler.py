"""The telemetry sampler: one round of reads per interval, published as an immutable ``Snapshot``.

Each tick reads every GPU through the injected ``read(index, now)`` (the NVML facade's reader in
production, anything in tests), drains the XID events seen since the last tick, feeds the energy
accounting with the samples and the claims holding devices, and publishes a ``Snapshot``:

- ``latest`` is a plain reference swapped after the snapshot is complete, so readers (scrapes, the
  gRPC stream, ``tessera top``) never block the sampler and never see a half-built tick;
- ``subscribe()`` gives a bounded, latest-wins queue: a slow consumer misses intermediate
  snapshots, and publishing never waits for it.

A read that raises (anything) never stops the others: that GPU's sample for the tick is
``lost=True`` with the error in ``errors``. Failures are logged when a GPU starts and stops failing,
not every tick.

**Health** (rules in :mod:`agent.telemetry.gpu_health`, kept per GPU UUID): a GPU is unhealthy while
its reads fail (``gpu-lost``) and after a fatal XID (``xid-<n>``) until a recovery is observed
(it answers again after failed reads, or ``observe_reset(uuid)``) and a probe of a few good reads
passes. Application XIDs (the built-in ones plus the configured list) and XIDs in neither set
are counted but keep the GPU healthy. ``on_health_change(GpuHealth)`` is called on every change
of health or cause (every GPU starts healthy, as the plugin's health board does).

**GPUs handed to virtual machines** (``GpuInfo.passthrough``: bound to vfio-pci or to no driver)
are not read, have no XIDs and no health evaluated: the host cannot see them, and a GPU a VM
holds is neither lost nor faulty for that. The snapshot lists them in ``passthrough`` (their
``tessera_gpu_passthrough`` series) and in none of ``gpus``, so no series of theirs goes stale.
The accounting gets a sample with nothing in it for each (no energy, no utilization), so the
claims holding them keep their GPU-seconds. Once the inventory says a GPU is bound to nvidia
again, it is read from the next tick on. A prepare tells the sampler before it unbinds a GPU
(``hand_over``), so the reads that would fail until the inventory is read again are not made.

**Schedule.** ``run`` ticks at fixed slots ``start + k * interval`` (no drift: the next slot is the
previous slot plus the interval, whatever the tick took). A tick that starts late records
``lag_seconds``; when a tick overran whole slots, they are skipped (counted in ``missed_ticks``)
and the sampler ticks at the latest slot already due. ``tick_duration_seconds`` is the wall time
of the whole tick (reads, XIDs, holders, accounting), everything it costs the agent.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from agent.logs import fields_
from agent.nvml.samples import GpuSample, XidEvent
from agent.telemetry.attribution import ClaimHolder, Holders
from agent.telemetry.energy import EnergyAccounting
from agent.telemetry.gpu_health import (
    APPLICATION_XIDS,
    FATAL_XIDS,
    PROBE_READS,
    GpuHealth,
    HealthTracker,
    xid_kind,
)
from agent.telemetry.gpuinfo import GpuInfo
from agent.telemetry.snapshot import ClaimUsage, GpuTelemetry, PassthroughGpu, Snapshot
from agent.telemetry.subscription import Subscription
from agent.telemetry.usage_meter import UsageMeter

__all__ = ["APPLICATION_XIDS", "FATAL_XIDS", "Sampler", "Subscription"]
STALE_INTERVALS = 3
"""``fresh()``: the latest snapshot is younger than this many intervals."""
UNREAD = "not read: handed to a virtual machine (not bound to nvidia)"
"""The error of the empty sample the accounting gets for a GPU handed to a VM."""
REBIND_MAX_S = 30.0
"""The longest a GPU's hand-over to a VM (or back) keeps the sampler from reading by index."""


class Sampler:
    """Samples every GPU each interval and publishes ``Snapshot`` values (module docstring)."""

    def __init__(
        self,
        *,
        node: str,
        read: Callable[[int, float], GpuSample],
        gpus: Sequence[GpuInfo],
        holders: Holders,
        accounting: EnergyAccounting,
        log: logging.Logger,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        xids: Callable[[], list[XidEvent]] | None = None,
        on_health_change: Callable[[GpuHealth], None] | None = None,
        application_xids: frozenset[int] = APPLICATION_XIDS,
        probe_reads: int = PROBE_READS,
        usage: UsageMeter | None = None,
        holders_changed: Callable[[], Mapping[str, float]] = dict,
    ) -> None:
        """``holders_changed``: claim UID -> when it last came into ``holders`` or left (on
        ``clock``), so that the usage meter counts a holding from its prepare and to its
        unprepare, not from or to a tick."""
        if interval <= 0:
            raise ValueError("interval must be positive")
        self.node = node
        self.interval = interval
        self._read = read
        self._gpus = tuple(gpus)
        self._holders = holders
        self._holders_changed = holders_changed
        self._accounting = accounting
        self._usage = usage
        """Feeds the usage ledger each tick (None: no usage accounting, as in unit tests)."""
        self._log = log
        self._clock = clock
        self._wall = wall
        self._xids = xids
        self._on_health_change = on_health_change
        """Called with every change of a GPU's health or cause (from the sampler's thread)."""
        self._application_xids = application_xids
        self._latest: Snapshot | None = None
        self._subs: list[Subscription] = []
        self._subs_lock = threading.Lock()
        self._tick_lock = threading.Lock()
        self._ticks = 0
        self._xid_counts: dict[str, collections.Counter[int]] = {}
        self._health = HealthTracker(probe_reads)
        self._failing: dict[str, str] = {}
        self._handed: set[str] = set()
        """UUIDs of the GPUs handed to virtual machines at the last tick (logged when it
        changes)."""
        self._handing: frozenset[str] = frozenset()
        """PCI bus ids of GPUs a prepare is handing to a virtual machine that the inventory
        does not show handed over yet (:meth:`hand_over`): not read meanwhile."""
        self._handing_lock = threading.Lock()
        self._handing_since: dict[str, float] = {}
        """When each GPU of ``_handing`` began to leave or rejoin nvidia (monotonic clock)."""
        self._probe_notes: dict[str, str | None] = {}
        self.missed_ticks = 0
        """Schedule slots skipped because a tick overran them."""

    # -- public ----------------------------------------------------------------------------------

    @property
    def latest(self) -> Snapshot | None:
        """The latest snapshot (None before the first tick). Never blocks."""
        return self._latest

    @property
    def gpus(self) -> tuple[GpuInfo, ...]:
        return self._gpus

    def set_gpus(self, gpus: Sequence[GpuInfo]) -> None:
        """The inventory changed (MIG reconfigured, a GPU added or gone): read these from the
        next tick on. XID counts and health stay with the GPU's UUID, whatever its index."""
        with self._handing_lock:
            self._gpus = tuple(gpus)
            self._handing -= {g.pci_bus_id for g in gpus if g.passthrough}

    def _rebinding(self) -> bool:
        """A GPU is being handed to a VM or given back, within :data:`REBIND_MAX_S` (a prepare
        that failed half way is rolled back through the same hooks; the bound keeps a hook
        that never came from stopping the reads for good). Call with ``_handing_lock`` held."""
        now = self._clock()
        self._handing_since = {b: t for b, t in self._handing_since.items() if b in self._handing}
        return any(now - t < REBIND_MAX_S for t in self._handing_since.values())

    def hand_over(self, pci_bus_id: str) -> None:
        """A prepare is about to unbind the GPU ``pci_bus_id`` from nvidia for a virtual
        machine: it is not read from now on, as if the inventory said it is handed over
        (which the rediscovery after the binding says, :meth:`set_gpus`). Without this its
        reads fail between the unbind and that rediscovery, and the GPU would be reported lost
        (unhealthy, its devices withdrawn, a Node event) while a VM gets it. Also told before
        a GPU is given back. Until the inventory is read again no GPU is read at all (the tick
        keeps the last snapshot): the GPUs after it in PCI order change their NVML index when
        it leaves or rejoins nvidia. Safe from any thread."""
        with self._handing_lock:
            self._handing |= {pci_bus_id}
            self._handing_since[pci_bus_id] = self._clock()

    def handed_back(self, pci_bus_id: str) -> None:
        """The GPU ``pci_bus_id`` is bound to nvidia again (an unprepare, or a prepare's
        rollback): read it again once the inventory says it is not handed over. Safe from any
        thread."""
        with self._handing_lock:
            self._handing -= {pci_bus_id}

    def observe_reset(self, uuid: str) -> None:
        """A reset or re-bind of the GPU ``uuid`` was observed (udev, an operator): a fatal XID
        no longer holds it unhealthy; it becomes healthy once the probe passes (the next
        ticks' reads). Safe from any thread."""
        self._health.observe_reset(uuid)
        self._log.info("GPU reset observed; probing it", extra=fields_(uuid=uuid))

    def sticky_faults(self) -> dict[str, tuple[int, float]]:
        """The fatal XIDs holding GPUs unhealthy now: UUID -> (XID, since)."""
        return self._health.sticky()

    def restore_faults(self, faults: Mapping[str, tuple[int, float]]) -> None:
        """Fatal XIDs an earlier agent saw and no recovery cleared (UUID -> (XID, since)):
        those GPUs are unhealthy from the first tick on, until a recovery is observed."""
        for uuid, (xid, since) in faults.items():
            self._health.restore(uuid, xid, since)

    def subscribe(self, maxsize: int = 1) -> Subscription:
        """A queue that receives every snapshot published from now on (latest-wins)."""
        sub = Subscription(maxsize, self._unsubscribe)
        with self._subs_lock:
            self._subs.append(sub)
        return sub

    def fresh(self, max_age: float | None = None) -> bool:
        """The latest snapshot is younger than ``max_age`` seconds (default: 3 intervals)."""
        snap = self._latest
        limit = STALE_INTERVALS * self.interval if max_age is None else max_age
        return snap is not None and self._clock() - snap.monotonic < limit

    def readiness_checks(self) -> list[tuple[str, Callable[[], tuple[bool, str]]]]:
        """/readyz's check of the sampler: a recent sample exists."""
        return [("sampler", self._recent)]

    def _recent(self) -> tuple[bool, str]:
        fresh = self.fresh()
        return fresh, "fresh" if fresh else "no recent sample"

    def tick(self) -> Snapshot:
        """One round: read, account, publish. Returns the published snapshot."""
        return self._tick(0.0)

    def run(self, stop: threading.Event) -> None:
        """Tick at fixed slots every ``interval`` seconds until ``stop`` is set."""
        due = self._clock()
        while not stop.is_set():
            lag = max(0.0, self._clock() - due)
            self._tick(lag)
            due += self.interval
            now = self._clock()
            if now - due >= self.interval:
                skipped = int((now - due) // self.interval)
                self.missed_ticks += skipped
                due += skipped * self.interval
                self._log.warning(
                    "telemetry tick overran its interval; skipped slots",
                    extra=fields_(skipped=skipped, interval=self.interval),
                )
            stop.wait(max(0.0, due - now))

    # -- one tick --------------------------------------------------------------------------------

    def _tick(self, lag: float) -> Snapshot:
        with self._tick_lock:
            started = self._clock()
            with self._handing_lock:
                rebinding = self._rebinding()
                gpus = tuple(
                    replace(g, passthrough=True) if g.pci_bus_id in self._handing else g
                    for g in self._gpus
                )
            if rebinding and self._latest is not None:
                # a GPU is leaving or joining NVML's enumeration: every GPU after it in PCI
                # order changes its NVML index until the inventory is read again, so no index
                # is read now (a read would fail, or read a neighbour, and report it lost)
                return self._latest
            read = [g for g in gpus if not g.passthrough]
            handed = [g for g in gpus if g.passthrough]
            self._note_handed(gpus, handed)
            samples = [self._read_one(g) for g in read]
            self._drain_xids(read)
            holders = self._read_holders()
            now = self._clock()
            changed = self._holders_changed()  # after: it has every change the holders show
            unread = [GpuSample(g.index, g.uuid, now, errors=(UNREAD,)) for g in handed]
            accounted = self._accounting.update([*samples, *unread], gpus, holders)
            if self._usage is not None:
                self._feed_usage(now, [*samples, *unread], gpus, holders, accounted.claims, changed)
            telemetry = tuple(
                GpuTelemetry(
                    sample=s,
                    name=g.name,
                    pci_bus_id=g.pci_bus_id,
                    minor=g.minor,
                    energy_joules_total=accounted.gpu_energy.get(g.index),
                    xid_counts=tuple(sorted(self._xid_counts.get(g.uuid, {}).items())),
                    healthy=self._evaluate(g, s),
                    mig_profiles=g.mig_profiles,
                )
                for g, s in zip(read, samples, strict=True)
            )
            self._ticks += 1
            finished = self._clock()
            snap = Snapshot(
                node=self.node,
                tick=self._ticks,
                wall_time=self._wall(),
                monotonic=finished,
                interval_seconds=self.interval,
                gpus=telemetry,
                claims=accounted.claims,
                prepared=accounted.prepared,
                tick_duration_seconds=finished - started,
                lag_seconds=lag,
                passthrough=tuple(
                    PassthroughGpu(g.uuid, g.name, g.pci_bus_id, g.minor) for g in handed
                ),
            )
            self._publish(snap)
            return snap

    def _note_handed(self, gpus: Sequence[GpuInfo], handed: Sequence[GpuInfo]) -> None:
        """Log a GPU handed to a VM, and one bound to nvidia again, once each."""
        now = {g.uuid for g in handed}
        if now == self._handed:
            return
        for g in gpus:
            if g.uuid in now and g.uuid not in self._handed:
                self._failing.pop(g.uuid, None)  # not failing: not read at all
                self._log.info(
                    "GPU handed to a virtual machine; not sampled until it is bound to nvidia"
                    " again",
                    extra=fields_(gpu=g.minor, uuid=g.uuid, pci_bus_id=g.pci_bus_id),
                )
                # the reads that failed while it was unbound were no loss
                self._changed(g, self._health.handed_over(g.uuid, g.index, self._wall()))
            elif g.uuid in self._handed and g.uuid not in now:
                self._log.info(
                    "GPU bound to nvidia again; sampled again",
                    extra=fields_(gpu=g.minor, uuid=g.uuid, index=g.index),
                )
        self._handed = now

    def _read_one(self, gpu: GpuInfo) -> GpuSample:
        try:
            sample = self._read(gpu.index, self._clock())
        except Exception as exc:
            error = f"read: {type(exc).__name__}: {exc}"
            if self._failing.get(gpu.uuid) != error:
                self._log.warning(
                    "GPU read failed; reported as lost",
                    extra=fields_(gpu=gpu.index, uuid=gpu.uuid, error=error),
                )
            self._failing[gpu.uuid] = error
            return GpuSample(
                index=gpu.index, uuid=gpu.uuid, timestamp=self._clock(), lost=True, errors=(error,)
            )
        if self._failing.pop(gpu.uuid, None) is not None:
            self._log.info("GPU read works again", extra=fields_(gpu=gpu.index, uuid=gpu.uuid))
        return sample

    def _drain_xids(self, gpus: Sequence[GpuInfo]) -> None:
        if self._xids is None:
            return
        try:
            events = self._xids()
        except Exception as exc:
            self._log.warning(
                "reading XID events failed; retried next tick",
                extra=fields_(error=f"{type(exc).__name__}: {exc}"),
            )
            return
        uuids = {g.index: g.uuid for g in gpus}
        for ev in events:
            uuid = uuids.get(ev.gpu_index)
            if uuid is None:
                self._log.warning(
                    "XID for an unknown GPU ignored", extra=fields_(gpu=ev.gpu_index, xid=ev.xid)
                )
                continue
            self._xid_counts.setdefault(uuid, collections.Counter())[ev.xid] += 1
            kind = xid_kind(ev.xid, self._application_xids)
            if kind == "fatal":
                self._health.fatal_xid(uuid, ev.xid)
            log = {"fatal": self._log.error, "application": self._log.info}.get(
                kind, self._log.warning
            )
            log(
                "XID event",
                extra=fields_(
                    gpu=ev.gpu_index,
                    uuid=uuid,
                    xid=ev.xid,
                    kind=kind,
                    gpu_instance=ev.gpu_instance_id,
                    compute_instance=ev.compute_instance_id,
                    fatal=kind == "fatal",
                ),
            )

    def _feed_usage(
        self,
        now: float,
        samples: Sequence[GpuSample],
        gpus: Sequence[GpuInfo],
        holders: Sequence[ClaimHolder] | None,
        claims: Sequence[ClaimUsage],
        changed: Mapping[str, float],
    ) -> None:
        """Usage accounting must never stop the telemetry and health it rides on: a failure (a
        bug; a failed write is handled inside) is logged, and that tick's usage may be lost."""
        assert self._usage is not None
        try:
            self._usage.tick(now, samples, gpus, holders, claims, changed)
        except Exception as exc:
            self._log.error(
                "usage accounting failed this tick",
                exc_info=exc,
                extra=fields_(error=f"{type(exc).__name__}: {exc}"),
            )

    def finish_usage(self, timeout: float) -> None:
        """At a stop, once the ticks have ended: count usage up to now with the last tick's
        readings (so a claim unprepared since then is counted to its unprepare) and save it
        (:meth:`UsageMeter.close`). A tick still running after ``timeout`` seconds (stuck in a
        read) is not waited for: what the ticks before it counted is saved."""
        if self._usage is None:
            return
        if not self._tick_lock.acquire(timeout=timeout):
            self._log.warning(
                "a telemetry tick is still running at the stop; usage is saved as the ticks"
                " before it counted",
                extra=fields_(waited_seconds=timeout),
            )
            self._usage.close(timeout=0)  # free unless the stuck tick is in it
            return
        try:
            holders = self._read_holders()
            now = self._clock()
            self._usage.close(now, holders, self._holders_changed(), timeout=timeout)
        finally:
            self._tick_lock.release()

    def _read_holders(self) -> Sequence[ClaimHolder] | None:
        try:
            return self._holders()
        except Exception as exc:
            self._log.warning(
                "reading the prepared claims failed; no attribution this tick",
                extra=fields_(error=f"{type(exc).__name__}: {exc}"),
            )
            return None

    def _evaluate(self, gpu: GpuInfo, sample: GpuSample) -> bool:
        change = self._health.evaluate(gpu.uuid, gpu.index, sample, self._wall())
        note = self._health.probe_note(gpu.uuid)
        if note != self._probe_notes.get(gpu.uuid) and note is not None:
            self._log.warning(
                "GPU answers but its health probe fails; still unhealthy",
                extra=fields_(gpu=gpu.index, uuid=gpu.uuid, reason=note),
            )
        self._probe_notes[gpu.uuid] = note
        if change is None:
            return self._health.current(gpu.uuid, gpu.index).healthy
        self._changed(gpu, change)
        return change.healthy

    def _changed(self, gpu: GpuInfo, change: GpuHealth | None) -> None:
        """Log a change of the GPU's health and tell ``on_health_change``."""
        if change is None:
            return
        self._log.warning(
            "GPU health changed",
            extra=fields_(gpu=gpu.index, uuid=gpu.uuid, healthy=change.healthy, cause=change.cause),
        )
        hook = self._on_health_change
        if hook is not None:
            try:
                hook(change)
            except Exception:
                self._log.exception(
                    "health change hook failed", extra=fields_(gpu=gpu.index, uuid=gpu.uuid)
                )

    def _publish(self, snap: Snapshot) -> None:
        self._latest = snap
        with self._subs_lock:
            subs = list(self._subs)
        for sub in subs:
            sub.put(snap)

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._subs_lock:
            if sub in self._subs:
                self._subs.remove(sub)
