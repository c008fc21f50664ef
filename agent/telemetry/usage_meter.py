"""The sampler's feed of the usage ledger (:mod:`agent.usage.counters`): each tick, every held
device's weight, busy GPUs and energy since the tick before, handed to the ledger as one
interval per write.

- **Weight**: :func:`agent.usage.weights.weights` of the claims holding devices, found again only
  when the holders or the GPUs change (the checkpoint's records are immutable: the same objects
  mean the same holdings).
- **Busy GPUs**: for a device on a whole GPU, the GPU's utilization (0-1) x the share of it the
  device got in the interval (``ClaimUsage.share``: 1 for a device held alone, else the split of
  the telemetry's attribution, by its processes' SM utilization where NVML reports it); for a MIG
  device held alone, the MIG device's SM utilization (GPM, Hopper and later) x its weight.
  Unknown otherwise (no utilization read, a shared MIG device, a device used inside a virtual
  machine: ``vfio``, whose GPU the host cannot read, and ``vgpu``, whose GPU's utilization is
  every vGPU's together): counted as unobserved.
- **Energy**: the increase of the device's ``tessera_claim_energy_joules`` counter since the
  tick before (the attribution of :mod:`agent.telemetry.energy`), so the ledger and the metric
  never disagree about a joule while the agent runs.

**One interval per write.** Each tick integrates only what varies from tick to tick: the seconds,
and each holding's busy GPU-seconds (or unobserved seconds). The ledger gets them, with the
energy counters' rise since the last interval, as one interval when it is due to write
(``write_interval``), at once when a holding comes or goes (so the file says who holds what, as
the ledger's exactly-once rule needs), before a 15-minute bucket boundary (so every second's busy
time and energy lands in its own bucket), and before any read (counters, a claim's totals, a
report, a stop), so nothing anyone reads lags the last tick. What a crash loses is unchanged:
what was counted since the last write. Why: a per-tick pass over every holding, in the meter
and again in the ledger, was most of the accounting's CPU (``python -m bench telemetry``).

**Transitions.** A holding that came or went since the last tick is counted from or to the
moment its claim did (the preparer's checkpoint commit: ``changed``, claim UID -> monotonic
time): the tick splits its interval there, so a late tick or a long interval moves no
GPU-second; its samples stand for every part's busy time. A change minutes old (no longer
kept) counts from or to the tick; a claim that came and went between two ticks is not counted.
A stop counts up to itself with the last tick's readings (:meth:`UsageMeter.close`).

The ledger is opened at the first tick (the agent holds its state directory by then: during a
rolling update's handover only the agent that holds it writes). That tick counts the time since
the file's last interval (:meth:`UsageLedger.credit_gap`) and makes the baselines. A tick whose
holders cannot be read counts nothing; the next one covers its time. Scrapes read the counters
through :meth:`UsageMeter.counters` (thread-safe), not through the per-tick snapshot: building
them every tick would cost more than counting them.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from agent.logs import Throttle, fields_
from agent.nvml.samples import GpuSample, MigSample
from agent.telemetry.attribution import ClaimHolder, HeldDevice
from agent.telemetry.gpuinfo import GpuInfo
from agent.telemetry.snapshot import ClaimUsage
from agent.usage.buckets import bucket_start, report_buckets
from agent.usage.counters import Counters, Gap, Held, HoldingKey, UsageLedger
from agent.usage.weights import VM_KINDS, Holding, weights

WRITE_WARNING_INTERVAL_S = 60.0
_NONE: Mapping[str, float] = MappingProxyType({})


@dataclass(frozen=True)
class _Held:
    """One holding as every tick needs it (found when the holders change): its key, the
    ledger's :class:`Held` (what stays the same while it is held), and how its busy time is
    read (``busy``: ``gpu`` for a device on a whole GPU, ``mig`` for a MIG device held alone or
    through MPS, None: never measured), so each tick only reads the numbers."""

    key: HoldingKey
    namespace: str
    claim: str
    gpu_uuid: str
    weight: float
    rule: str
    device: HeldDevice
    product: str
    mig_profile: str | None
    busy: str | None
    mig_key: tuple[str, int | None]
    """(GPU UUID, GPU instance ID): the MIG sample the busy time is read from."""


class _Pending:
    """The ticks since the ledger's last interval, for one set of holdings (``statics``): their
    seconds and, in the same order, each holding's busy GPU-seconds and unobserved seconds;
    with the latest tick's wall-clock time, claims' counters and GPUs' energy readings."""

    __slots__ = ("busy", "claims", "gpu_energy", "idle", "seconds", "start", "statics", "wall")

    def __init__(
        self,
        statics: tuple[Held, ...],
        wall: float,
        claims: Sequence[ClaimUsage],
        gpu_energy: Mapping[str, float | None],
    ) -> None:
        self.statics = statics
        self.start = self.wall = wall
        self.seconds = 0.0
        self.busy = [0.0] * len(statics)
        self.idle = [0.0] * len(statics)
        self.claims, self.gpu_energy = claims, gpu_energy


class UsageMeter:
    """Feeds one ledger from the sampler's thread (see the module docstring)."""

    def __init__(
        self,
        path: Path,
        boot_id: str,
        log: logging.Logger,
        *,
        wall: Callable[[], float] = time.time,
        retention: float = 3600.0,
        write_interval: float = 15.0,
    ) -> None:
        self.path = path
        self._write_interval = write_interval
        self.boot_id = boot_id
        self._log = log
        self._wall = wall
        self._retention = retention
        self._throttle = Throttle(log, WRITE_WARNING_INTERVAL_S)
        self._lock = threading.Lock()
        self._ledger: UsageLedger | None = None
        self._last: float | None = None
        """The monotonic time of the last tick counted."""
        self._energy: dict[HoldingKey, float] = {}
        """Each device's ``energy_joules_total`` at the end of the ledger's last interval."""
        self._pending: _Pending | None = None
        """What the ticks since the ledger's last interval counted."""
        self._flushed = 0.0
        """The wall-clock time of the last interval handed to the ledger by a tick."""
        self._plan: tuple[tuple[object, ...], tuple[_Held, ...], tuple[Held, ...]] = ((), (), ())
        """(the holders and GPUs it was found for, the holdings with their weights, what the
        ledger keeps of them: the same tuple every tick while nobody comes or goes)."""
        self._unweighed: set[HoldingKey] = set()
        self._closed: str | None = None
        """None while counting; at a stop ``saved``, or ``unsaved`` (nothing to report)."""
        self._last_tick: (
            tuple[Sequence[GpuSample], Sequence[GpuInfo], Sequence[ClaimUsage]] | None
        ) = None
        """The last tick's readings (what :meth:`close` counts the time since it with)."""

    def counters(self) -> dict[HoldingKey, Counters]:
        """Every holding's counters now (any thread)."""
        with self._lock:
            if self._ledger is None:
                return {}
            self._flush(write=False)
            return self._ledger.counters()

    @property
    def through(self) -> float | None:
        """The wall-clock second the counters on disk count up to."""
        with self._lock:
            return None if self._ledger is None else self._ledger.through

    def claim_totals(self, uid: str) -> tuple[float, dict[tuple[str, str], Counters]] | None:
        """One claim's counters by (pool, device), in memory, and the wall-clock second they
        count up to (any thread); None before the ledger's first tick. A released claim's stay
        for the ledger's retention (an hour)."""
        with self._lock:
            ledger = self._ledger
            if ledger is None:
                return None
            self._flush(write=False)
            if ledger.counted_through is None:
                return None
            return ledger.counted_through, {
                (k[1], k[2]): c for k, c in ledger.counters().items() if k[0] == uid
            }

    def report(self, max_bytes: int) -> tuple[float, list[dict[str, Any]]] | None:
        """What the node's ``GpuUsageReport`` carries (any thread): the ledger's ``through`` and
        its buckets in the report's form, the oldest first, up to about ``max_bytes``; None
        before the ledger's first tick. The ledger is written (and fsynced) first, so a report
        never carries what a crash could still take back; after :meth:`close` it is not (it
        was, and the state directory may be the next agent's). Raises OSError when the write
        fails."""
        if self._closed == "unsaved":  # also when a stop could not wait for the lock
            return None
        with self._lock:
            if self._ledger is None or self._ledger.through is None or self._closed == "unsaved":
                return None
            if self._closed is None:
                self._flush(write=False)  # the report's own write (fsynced) stores it
            through, buckets = self._ledger.report(write=self._closed is None)
            return through, report_buckets(buckets, max_bytes)

    def acknowledge(self, through: float) -> int:
        """Drop the closed buckets starting before ``through`` (the cluster folded them; any
        thread); how many."""
        with self._lock:
            return 0 if self._ledger is None else self._ledger.acknowledge(through)

    def close(
        self,
        now: float | None = None,
        holders: Sequence[ClaimHolder] | None = None,
        changed: Mapping[str, float] = _NONE,
        *,
        timeout: float = -1,
    ) -> None:
        """At a clean stop (the sampler has stopped): count up to monotonic ``now`` with the
        last tick's readings (when the ``holders`` now are known), then write and fsync what
        was counted since the ledger's last write, so a clean restart or a rolling update loses
        no time. Without ``holders``, releases after the last tick are seen by the next agent's
        first one. When the counters stay busy for ``timeout`` seconds (a tick stuck in a
        write; -1: waits), nothing is saved or reported: the next start counts from the last
        write."""
        if not self._lock.acquire(timeout=timeout):
            self._closed = "unsaved"  # what :meth:`report` reads before it waits for the lock
            self._log.warning(
                "the usage ledger is still being written at the stop; the next start counts"
                " from its last write",
                extra=fields_(path=str(self.path), waited_seconds=timeout),
            )
            return
        try:
            self._close(now, holders, changed)
        finally:
            self._lock.release()

    def _close(
        self, now: float | None, holders: Sequence[ClaimHolder] | None, changed: Mapping[str, float]
    ) -> None:
        if self._ledger is None:
            return
        if now is not None and holders is not None and self._last_tick is not None:
            samples, gpus, claims = self._last_tick
            self._tick(now, samples, gpus, holders, claims, changed)
        self._flush(write=False)  # the sync below writes it
        self._closed = "unsaved"  # never written again: the directory may be another's
        try:
            self._ledger.sync()
            self._closed = "saved"  # what a last report carries is on disk
        except OSError as exc:
            self._log.warning(
                "cannot write the usage ledger at stop; the next start counts from its last write",
                extra=fields_(path=str(self.path), error=str(exc.strerror or exc)),
            )

    def tick(
        self,
        now: float,
        samples: Sequence[GpuSample],
        gpus: Sequence[GpuInfo],
        holders: Sequence[ClaimHolder] | None,
        claims: Sequence[ClaimUsage],
        changed: Mapping[str, float] = _NONE,
    ) -> None:
        """Account the interval since the last tick counted, ending at monotonic ``now`` (when
        ``holders`` were read). ``changed``: claim UID -> when it last came or went (monotonic;
        read after the holders, so it has the time of every change they show): a holding that
        came or went since the last tick is counted from or to then, not from or to a tick."""
        if holders is None:
            return
        with self._lock:
            self._last_tick = (samples, gpus, claims)
            self._tick(now, samples, gpus, holders, claims, changed)

    def _tick(
        self,
        now: float,
        samples: Sequence[GpuSample],
        gpus: Sequence[GpuInfo],
        holders: Sequence[ClaimHolder],
        claims: Sequence[ClaimUsage],
        changed: Mapping[str, float],
    ) -> None:
        wall = self._wall()
        before = self._plan[1]
        held, statics = self._held(holders, gpus)
        gpu_energy = {u.uuid: u.energy_joules for u in samples if not u.lost}
        p = self._pending
        if p is None:  # the first tick
            self._ledger = UsageLedger(
                self.path,
                self.boot_id,
                log=self._log,
                retention=self._retention,
                write_interval=self._write_interval,
            )
            self._continue(self._ledger.credit_gap(wall, [h.key for h in statics], gpu_energy))
            self._energy = _totals(claims)  # the baselines: their past is in the ledger
            p = self._pending = _Pending(statics, wall, claims, gpu_energy)
            seconds, come_or_gone = 0.0, True
        else:
            assert self._last is not None
            seconds = max(0.0, now - self._last)
            come_or_gone = p.statics is not statics
            if come_or_gone and changed:
                p, seconds = self._up_to_changes(p, before, held, changed, now, samples, claims)
            if come_or_gone or bucket_start(wall) != bucket_start(p.start):
                # what came before ends here: with the holdings that held it, in its bucket
                self._flush()
                p = self._pending = _Pending(statics, p.wall, p.claims, p.gpu_energy)
        self._last = now
        self._count(p, held, seconds, samples, claims)
        p.wall, p.claims, p.gpu_energy = wall, claims, gpu_energy
        if come_or_gone or wall - self._flushed >= self._write_interval:
            self._flush()

    def _up_to_changes(
        self,
        p: _Pending,
        before: Sequence[_Held],
        held: Sequence[_Held],
        changed: Mapping[str, float],
        now: float,
        samples: Sequence[GpuSample],
        claims: Sequence[ClaimUsage],
    ) -> tuple[_Pending, float]:
        """Count the time since the last tick up to the last change of who holds what in it,
        one part per change: a holding that came is held from its claim's change on, one that
        went up to it (without a change in the interval: from the tick before, or to it). This
        tick's samples stand for every part. The pending count of the last part, and the
        seconds left, which the holdings held now take."""
        assert self._last is not None
        last = self._last
        was, now_held = {h.key for h in before}, {h.key for h in held}
        at = {
            h.key: t
            for h in (*before, *held)
            if (h.key in was) != (h.key in now_held)
            and (t := changed.get(h.key[0])) is not None
            and last < t < now
        }
        start = last
        for cut in sorted(set(at.values())):
            members = {  # held from ``start``: come by then, or gone only after it
                h.key: h
                for h in (*before, *held)
                if (at.get(h.key, last) <= start) == (h.key in now_held)
            }
            if set(members) != {s.key for s in p.statics}:
                self._flush()  # what came before, with the holdings that held it
                statics = tuple(_static(h) for h in members.values())
                p = self._pending = _Pending(statics, p.wall, p.claims, p.gpu_energy)
            self._count(p, [members[s.key] for s in p.statics], cut - start, samples, claims)
            p.wall += cut - start
            start = cut
        return p, max(0.0, now - start)

    def _flush(self, *, write: bool = True) -> None:
        """Hand the ledger what the ticks since its last interval counted, as one interval
        ending at the last tick (``write=False``: a read; the ledger does not write)."""
        p, ledger = self._pending, self._ledger
        if p is None or ledger is None or (p.seconds == 0.0 and not write):
            return
        totals = _totals(p.claims)
        last = self._energy
        joules = [
            0.0 if (t := totals.get(h.key)) is None else t - last.get(h.key, 0.0) for h in p.statics
        ]
        self._energy = totals
        self._pending = _Pending(p.statics, p.wall, p.claims, p.gpu_energy)
        if write:
            self._flushed = p.wall
        try:
            ledger.account_held(
                p.wall, p.seconds, p.statics, joules, p.busy, p.idle, p.gpu_energy, write=write
            )
        except OSError as exc:
            self._throttle(
                logging.WARNING,
                "write",
                "cannot write the usage ledger; counting goes on in memory and the next write"
                " catches up",
                path=str(self.path),
                error=str(exc.strerror or exc),
            )

    def _continue(self, gap: Gap) -> None:
        if gap.reason != "no-state":
            self._log.info(
                "usage ledger continued",
                extra=fields_(
                    reason=gap.reason,
                    gap_seconds=round(gap.seconds, 3),
                    holdings=gap.holdings,
                    gap_energy_joules=round(gap.energy_joules, 3),
                ),
            )

    def _held(
        self, holders: Sequence[ClaimHolder], gpus: Sequence[GpuInfo]
    ) -> tuple[tuple[_Held, ...], tuple[Held, ...]]:
        """The holdings with their weights, and what the ledger keeps of them (the same tuple
        while they stay the same), found again only when the holders or GPUs change."""
        # the same objects (kept alive by the plan, so an id is never another's) mean the same
        # holdings: the checkpoint's records are immutable
        seen, plan_for = self._plan[0], (*holders, None, *gpus)
        if len(seen) == len(plan_for) and all(map(operator.is_, seen, plan_for)):
            return self._plan[1], self._plan[2]
        capacities = [g.capacity for g in gpus if g.capacity is not None]
        devices = {(h.uid, d.pool, d.device): (h, d) for h in holders for d in h.devices}
        found, unknown = weights(
            [Holding(h.uid, d) for h in holders for d in h.devices], capacities
        )
        for u in unknown:
            key = (u.claim_uid, u.device.pool, u.device.device)
            if key not in self._unweighed:
                self._unweighed.add(key)
                self._log.warning(
                    "prepared device cannot be weighed (no known GPU or MIG profile);"
                    " its usage is not counted",
                    extra=fields_(claim_uid=key[0], pool=key[1], device=key[2]),
                )
        by_uuid = {g.uuid: g for g in gpus}
        plan = []
        for w in found:
            key = (w.claim_uid, w.pool, w.device)
            holder, device = devices[key]
            gpu = by_uuid[w.gpu_uuid]
            profile = None
            if device.kind == "mig" and gpu.capacity is not None:
                profile = gpu.capacity.mig_profile_name(device.device, device.gpu_instance_id)
            busy = "gpu" if device.kind not in ("mig", *VM_KINDS) else None
            if device.kind == "mig" and device.sharing in (None, "MPS"):
                busy = "mig"
            plan.append(
                _Held(
                    key,
                    holder.namespace,
                    holder.name,
                    w.gpu_uuid,
                    w.weight,
                    w.rule,
                    device,
                    gpu.name,
                    profile,
                    busy,
                    (w.gpu_uuid, device.gpu_instance_id),
                )
            )
        statics = tuple(map(_static, plan))
        self._plan = (plan_for, tuple(plan), statics)
        return self._plan[1], self._plan[2]

    def _count(
        self,
        p: _Pending,
        held: Sequence[_Held],
        seconds: float,
        samples: Sequence[GpuSample],
        claims: Sequence[ClaimUsage],
    ) -> None:
        """Add one tick to ``p``: its seconds, and each holding's busy GPU-seconds (or, not
        measured, unobserved seconds): the sampler's hottest loop with accounting on
        (``python -m bench telemetry``)."""
        p.seconds += seconds
        if seconds <= 0.0:
            return
        util = {s.uuid: s.utilization_gpu for s in samples if not s.lost}
        migs: dict[tuple[str, int | None], MigSample] = {
            (s.uuid, m.gpu_instance_id): m for s in samples if not s.lost for m in s.mig
        }
        shares: dict[HoldingKey, float | None] | None = None
        busy, idle = p.busy, p.idle
        for i, h in enumerate(held):
            b: float | None = None
            if h.busy == "gpu":
                u = util.get(h.gpu_uuid)
                if u is not None:
                    if shares is None:
                        shares = {(c.uid, c.pool, c.device): c.share for c in claims}
                    share = shares.get(h.key)
                    if share is not None:
                        b = u * share
            elif h.busy == "mig":
                mig = migs.get(h.mig_key)
                if mig is not None and mig.utilization is not None:
                    b = mig.utilization * h.weight
            if b is None:
                idle[i] += seconds
            elif b > 0.0:
                busy[i] += (b if b < 1.0 else 1.0) * seconds


def _static(h: _Held) -> Held:
    """What the ledger keeps of a holding."""
    return Held(h.key, h.namespace, h.claim, h.gpu_uuid, h.weight, h.rule, h.product,
                h.mig_profile, h.device.device_class)  # fmt: skip


def _totals(claims: Sequence[ClaimUsage]) -> dict[HoldingKey, float]:
    """Each claim device's energy counter (``tessera_claim_energy_joules``)."""
    return {(c.uid, c.pool, c.device): c.energy_joules_total for c in claims}
