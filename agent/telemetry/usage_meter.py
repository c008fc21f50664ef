"""The sampler's feed of the usage ledger (:mod:`agent.usage.counters`): each tick, every held
device's weight, busy GPUs and energy since the tick before.

- **Weight**: :func:`agent.usage.weights.weights` of the claims holding devices, found again only
  when the holders or the GPUs change (the checkpoint's records are immutable: the same objects
  mean the same holdings).
- **Busy GPUs**: for a device on a whole GPU, the GPU's utilization (0-1) x the share of it the
  device got in the interval (``ClaimUsage.share``: 1 for a device held alone, else the split of
  the telemetry's attribution, by its processes' SM utilization where NVML reports it); for a MIG
  device held alone, the MIG device's SM utilization (GPM, Hopper and later) x its weight.
  Unknown otherwise (no utilization read, a shared MIG device): counted as unobserved.
- **Energy**: the increase of the device's ``tessera_claim_energy_joules`` counter since the
  tick before (the attribution of :mod:`agent.telemetry.energy`), so the ledger and the metric
  never disagree about a joule while the agent runs.

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
from typing import Any

from agent.logs import Throttle, fields_
from agent.nvml.samples import GpuSample, MigSample
from agent.telemetry.attribution import ClaimHolder, HeldDevice
from agent.telemetry.gpuinfo import GpuInfo
from agent.telemetry.snapshot import ClaimUsage
from agent.usage.buckets import report_buckets
from agent.usage.counters import Counters, Gap, HoldingKey, Interval, UsageLedger
from agent.usage.weights import Holding, weights

WRITE_WARNING_INTERVAL_S = 60.0


@dataclass(frozen=True)
class _Held:
    """One holding as every tick needs it (found when the holders change): its key, the
    :class:`Interval`'s fields that stay the same while it is held, and how its busy time is
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
        write_interval: float = 5.0,
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
        self._energy: dict[HoldingKey, ClaimUsage] = {}
        """Each device's usage (its ``energy_joules_total``) at the last tick counted."""
        self._plan: tuple[tuple[object, ...], tuple[_Held, ...]] = ((), ())
        """(the holders and GPUs it was found for, the holdings with their weights)."""
        self._unweighed: set[HoldingKey] = set()
        self._closed: str | None = None
        """None while counting; at a stop ``saved``, or ``unsaved`` (nothing to report)."""

    def counters(self) -> dict[HoldingKey, Counters]:
        """Every holding's counters now (any thread)."""
        with self._lock:
            return {} if self._ledger is None else self._ledger.counters()

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
            if ledger is None or ledger.counted_through is None:
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
        with self._lock:
            if self._ledger is None or self._ledger.through is None or self._closed == "unsaved":
                return None
            through, buckets = self._ledger.report(write=self._closed is None)
            return through, report_buckets(buckets, max_bytes)

    def acknowledge(self, through: float) -> int:
        """Drop the closed buckets starting before ``through`` (the cluster folded them; any
        thread); how many."""
        with self._lock:
            return 0 if self._ledger is None else self._ledger.acknowledge(through)

    def close(self) -> None:
        """At a clean stop (the sampler has stopped): write and fsync what was counted since
        the ledger's last write, so a clean restart or a rolling update loses no busy time.
        Releases after the last tick are seen by the next agent's first one."""
        with self._lock:
            if self._ledger is None:
                return
            self._closed = "unsaved"  # never written again: the directory may be another's
            try:
                self._ledger.sync()
                self._closed = "saved"  # what a last report carries is on disk
            except OSError as exc:
                self._log.warning(
                    "cannot write the usage ledger at stop; the next start counts from its"
                    " last write",
                    extra=fields_(path=str(self.path), error=str(exc.strerror or exc)),
                )

    def tick(
        self,
        now: float,
        samples: Sequence[GpuSample],
        gpus: Sequence[GpuInfo],
        holders: Sequence[ClaimHolder] | None,
        claims: Sequence[ClaimUsage],
    ) -> None:
        """Account the interval since the last tick counted, ending at monotonic ``now``."""
        if holders is None:
            return
        with self._lock:
            self._tick(now, samples, gpus, holders, claims)

    def _tick(
        self,
        now: float,
        samples: Sequence[GpuSample],
        gpus: Sequence[GpuInfo],
        holders: Sequence[ClaimHolder],
        claims: Sequence[ClaimUsage],
    ) -> None:
        wall = self._wall()
        held = self._held(holders, gpus)
        energy_now = {(c.uid, c.pool, c.device): c for c in claims}
        counters = {u.uuid: u.energy_joules for u in samples if not u.lost}
        if self._ledger is None:
            self._ledger = UsageLedger(
                self.path,
                self.boot_id,
                log=self._log,
                retention=self._retention,
                write_interval=self._write_interval,
            )
            self._continue(self._ledger.credit_gap(wall, [h.key for h in held], counters))
            seconds = 0.0
            self._energy = dict(energy_now)  # the baselines: their past is in the ledger
        else:
            assert self._last is not None
            seconds = max(0.0, now - self._last)
        intervals = self._intervals(held, samples, energy_now)
        self._last = now
        self._energy.update(energy_now)
        try:
            self._ledger.account(wall, seconds, intervals, counters)
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

    def _held(self, holders: Sequence[ClaimHolder], gpus: Sequence[GpuInfo]) -> tuple[_Held, ...]:
        """The holdings with their weights, found again only when the holders or GPUs change."""
        # the same objects (kept alive by the plan, so an id is never another's) mean the same
        # holdings: the checkpoint's records are immutable
        seen, plan_for = self._plan[0], (*holders, None, *gpus)
        if len(seen) == len(plan_for) and all(map(operator.is_, seen, plan_for)):
            return self._plan[1]
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
            busy = "gpu" if device.kind != "mig" else None
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
        self._plan = (plan_for, tuple(plan))
        return self._plan[1]

    def _intervals(
        self,
        held: Sequence[_Held],
        samples: Sequence[GpuSample],
        energy_now: Mapping[HoldingKey, ClaimUsage],
    ) -> list[Interval]:
        # the sampler's hottest loop with accounting on (``python -m bench telemetry``): one
        # pass per holding, the fields that do not change taken from the plan, the tuple made
        # without the named tuple's Python-level __new__
        util = {s.uuid: s.utilization_gpu for s in samples if not s.lost}
        migs: dict[tuple[str, int | None], MigSample] = {
            (s.uuid, m.gpu_instance_id): m for s in samples if not s.lost for m in s.mig
        }
        last = self._energy
        make = tuple.__new__
        out = []
        for h in held:
            key = h.key
            c = energy_now.get(key)
            joules = 0.0
            if c is not None:  # negatives: ignored by the ledger
                before = last.get(key)
                joules = c.energy_joules_total - (
                    0.0 if before is None else before.energy_joules_total
                )
            busy: float | None = None
            if h.busy == "gpu":
                u = util.get(h.gpu_uuid)
                if u is not None and c is not None and c.share is not None:
                    busy = u * c.share
            elif h.busy == "mig":
                mig = migs.get(h.mig_key)
                if mig is not None and mig.utilization is not None:
                    busy = mig.utilization * h.weight
            out.append(
                make(
                    Interval,
                    (
                        key,
                        h.namespace,
                        h.claim,
                        h.gpu_uuid,
                        h.weight,
                        h.rule,
                        joules,
                        busy,
                        h.product,
                        h.mig_profile,
                        h.device.device_class,
                    ),
                )
            )
        return out
