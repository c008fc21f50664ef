"""The node's usage counters per claim and device, durable and counted exactly once.

For every (claim UID, pool, device) the ledger keeps four monotonic counters:

- ``allocatedGpuSeconds``: seconds held x the device's weight (:mod:`agent.usage.weights`);
- ``busyGpuSeconds``: seconds x the GPUs' worth the holding kept busy (utilization-integrated;
  a share of a GPU's memory or time can keep more of it busy than it holds);
- ``energyJoules``: the energy attributed to it (as the telemetry apportions it);
- ``unobservedSeconds``: seconds it was held while nothing could measure its busy time (the
  agent was down, or the GPU gave no utilization): what ``busyGpuSeconds`` may lack.

Cost is not stored: it is derived from these counters and a price table.

**Exactly once.** The state file holds the counters together with ``through``, the wall-clock
second up to which they count, and each GPU's last energy-counter reading, and is replaced
atomically (temporary file, rename): a crash (``kill -9``) at any moment leaves either the file
before a write or the file after it, never half of one, and since the counters and ``through``
are in one file, no second is counted twice. :meth:`UsageLedger.account` counts every interval
in memory and writes the file when a holding came or went (or its weight changed), else every
``write_interval`` seconds (15 by default, the ``sync_interval``: every write is then fsynced):
a write (about 0.5-0.7 ms of CPU for 56 devices, mostly the file system's) costs the sampler
about as much as counting a second, so writing every second, or every 5, was most of the
accounting's cost (``python -m bench telemetry``). The file and its directory are fsynced every
``sync_interval`` seconds (15): a process's crash loses nothing the kernel was given, and a
power loss, which reboots the node (and so ends the claims), may bring back a file up to that
old.

**What a crash loses.** The start after a crash, a restart or a rolling update's handover
continues from the file: :meth:`UsageLedger.credit_gap` counts the seconds from the file's
``through`` to the first interval of the new agent for every holding held before and after (no
prepare or unprepare can happen while no agent holds the state directory: the kubelet's calls
wait at the new agent's gate), at the weight it had; the energy of that gap is the difference of
each GPU's energy counter (the driver's, since it was loaded), split between those holdings by
weight. Because the file is written whenever who holds what changes, the holdings in it are the
ones held since its ``through``, so allocated GPU-seconds and energy are exact across the
crash. Busy time is not: what was counted in memory since the last write is lost, and the gap,
which nothing measured, is ``unobservedSeconds`` (at most ``write_interval`` seconds of busy
time is lost, plus the downtime, which is reported). The gap is not credited after a reboot
(another boot id: the claims are gone and the time they were held is not known), and a driver
reload during the gap loses the gap's energy before the reload (the counter restarted; the
energy since the reload is counted when plausible).

**Released claims** keep their final counters for ``retention`` seconds after they were first
seen gone (so that whoever exports them, the cluster record or a scrape, sees the last value);
a claim that comes back continues its counters.

**Buckets.** Every interval's counters are also split across 15-minute UTC buckets
(:mod:`agent.usage.buckets`), per claim, device class, product and MIG profile, and kept in the
same file (so the same write that counts a second counts it in its bucket, and a crash loses or
keeps both together); the gap credited after a restart is split the same way. A bucket is
closed once ``through`` passed its end; :meth:`UsageLedger.acknowledge` drops the closed ones
the cluster's controller has folded (:meth:`UsageLedger.report` is what a report carries: the
file as just written). Version 1 files (before buckets) are read as having none.

Times: ``account`` takes the interval's length (from the sampler's monotonic clock) and the
wall-clock time it ends at; ``through`` is wall-clock so that it means the same after a restart.
A step of the wall clock while the agent is down moves the gap by that step; a gap that would be
negative counts nothing.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from agent.errors import DecodeError
from agent.fsutil import atomic_write, move_aside
from agent.logs import fields_
from agent.usage.buckets import Buckets, EntryKey, Share, Usage
from agent.usage.holdings import ZERO, Held, Record
from agent.usage.ledger_file import KIND, VERSION, Counters, HoldingKey, decode, decode_state

__all__ = ["Counters", "Gap", "Held", "HoldingKey", "Interval", "UsageLedger", "decode"]
from agent.usage.joules import MAX_WATTS, Reading, energy_delta


class Interval(NamedTuple):
    """One holding's use over one interval, as the sampler measured it (a named tuple: one is
    made per held device every tick)."""

    key: HoldingKey
    namespace: str
    claim: str
    gpu_uuid: str
    weight: float
    """The share of the physical GPU the device holds (0-1)."""
    rule: str
    energy_joules: float
    busy_gpus: float | None
    """GPUs' worth it kept busy on average (0 to 1); None: not measured."""
    product: str = ""
    """The GPU's product name (what a price table matches)."""
    mig_profile: str | None = None
    """A MIG device's profile (``1g.10gb``, what a price table matches); None for a GPU."""
    device_class: str = ""
    """The DeviceClass its claim's request named ("" when not known)."""


@dataclass(frozen=True)
class Gap:
    """What :meth:`UsageLedger.credit_gap` counted."""

    seconds: float
    holdings: int
    energy_joules: float
    reason: str
    """``credited``, ``no-state`` (a first start), ``rebooted`` or ``clock-behind``."""


class UsageLedger:
    """The counters of one node's state directory (see the module docstring). One thread."""

    def __init__(
        self,
        path: Path,
        boot_id: str,
        *,
        log: logging.Logger | None = None,
        retention: float = 3600.0,
        max_watts: float = MAX_WATTS,
        write_interval: float = 15.0,
        sync_interval: float = 15.0,
    ) -> None:
        self.path = Path(path)
        self.boot_id = boot_id
        self.retention = retention
        self.max_watts = max_watts
        self.write_interval = write_interval
        self.sync_interval = sync_interval
        self._log = log or logging.getLogger(__name__)
        self._through: float | None = None
        self._stored_boot: str | None = None
        self._energy: dict[str, float] = {}
        """GPU UUID -> the driver's energy counter at ``through``."""
        self._records: dict[HoldingKey, Record] = {}
        self._held: tuple[tuple[Held, ...], list[Record]] | None = None
        """The last :meth:`account_held`'s holdings and their records."""
        self._released: list[HoldingKey] = []
        """The records released (kept for ``retention``), as :meth:`_hold` last found them."""
        self._entry_cache: tuple[dict[EntryKey, Usage], tuple[Held, ...], list[Usage]] | None = None
        self._buckets = Buckets()
        self._gap_pending = False
        self._written: float | None = None
        """``through`` of the last write; None: none yet, or the last one failed."""
        self._written_through: float | None = None
        """``through`` as the file holds it (what a start after a crash continues from)."""
        self._synced_at: float | None = None
        self._load()

    # -- reading -----------------------------------------------------------------------------

    @property
    def through(self) -> float | None:
        """The wall-clock second the file's counters count up to (None before the first)."""
        return self._written_through

    @property
    def counted_through(self) -> float | None:
        """The wall-clock second the counters in memory count up to (ahead of :attr:`through`
        by less than ``write_interval``; None before the first interval)."""
        return self._through

    def counters(self) -> dict[HoldingKey, Counters]:
        """Every holding's counters now (in memory: ahead of the file by less than
        ``write_interval``)."""
        return {k: r.frozen() for k, r in self._records.items()}

    @property
    def buckets(self) -> Buckets:
        """The buckets in memory (the caller does not change them)."""
        return self._buckets

    def report(self, *, write: bool = True) -> tuple[float, Buckets]:
        """(``through``, the buckets) as the file holds them: writes the file first (and
        fsyncs it), so that what a report carries can never be lost by a crash afterwards
        (``write=False``: the caller knows the file holds them, e.g. after :meth:`sync` at a
        stop, when the state directory may be another agent's already). Raises OSError when
        the write fails (nothing should be reported then), ValueError before the first
        interval."""
        if self._through is None:
            raise ValueError("the usage ledger has counted nothing yet")
        if write:
            self._save(sync=True)
        return self._through, self._buckets

    def acknowledge(self, through: float) -> int:
        """Drop the closed buckets that start before ``through`` (the cluster folded them);
        how many. The next write stores it; a crash before then only reports them again."""
        return self._buckets.acknowledge(through)

    # -- counting ----------------------------------------------------------------------------

    def credit_gap(
        self, now: float, held: Sequence[HoldingKey], gpu_energy: Mapping[str, float | None]
    ) -> Gap:
        """At a start: count the time since ``through`` (the last interval the file holds) up
        to ``now`` for every holding in the file that is in ``held`` too, and the energy the
        GPUs' counters (``gpu_energy``, joules since the driver loaded) say was used meanwhile,
        split by weight. Written before it returns. Once per ledger; later calls count nothing."""
        if not self._gap_pending:
            return Gap(0.0, 0, 0.0, "no-state")
        self._gap_pending = False
        if self._through is None:
            return Gap(0.0, 0, 0.0, "no-state")
        if self._stored_boot != self.boot_id:
            for r in self._records.values():
                if r.released_at is None:
                    r.released_at = now
            self._held = None  # found again at the next interval
            self._through, self._energy = now, {}
            self._buckets.add(now, now, ())
            self._save(sync=True)
            return Gap(0.0, 0, 0.0, "rebooted")
        seconds = now - self._through
        if seconds <= 0:
            return Gap(0.0, 0, 0.0, "clock-behind")
        kept = [k for k in held if k in self._records and self._records[k].released_at is None]
        energy = self._gap_energy(seconds, gpu_energy)
        total = 0.0
        shares = []
        for key in kept:
            r = self._records[key]
            used, weights = energy.get(r.gpu_uuid, (0.0, 0.0))
            joules = used * r.weight / weights if weights > 0 else 0.0
            total += joules
            r.allocated += r.weight * seconds
            r.unobserved += seconds
            r.energy += joules
            shares.append(r.share(key[0], r.weight * seconds, 0.0, joules, seconds))
        self._buckets.add(self._through, now, shares)
        self._through = now
        self._energy.update(_readings(gpu_energy))
        self._save(sync=True)
        return Gap(seconds, len(kept), total, "credited")

    def _gap_energy(
        self, seconds: float, gpu_energy: Mapping[str, float | None]
    ) -> dict[str, tuple[float, float]]:
        """GPU UUID -> (joules used in the gap, the weights held on it throughout)."""
        weights: dict[str, float] = {}
        for r in self._records.values():
            if r.released_at is None:
                weights[r.gpu_uuid] = weights.get(r.gpu_uuid, 0.0) + r.weight
        out: dict[str, tuple[float, float]] = {}
        for uuid, now_j in gpu_energy.items():
            before = self._energy.get(uuid)
            if before is None or now_j is None or not _finite(now_j):
                continue
            # the telemetry's counter rules: a reset (driver reload) counts the new reading
            used, _ = energy_delta(
                Reading(0.0, before, None), Reading(seconds, now_j, None), self.max_watts
            )
            out[uuid] = (used * min(1.0, weights.get(uuid, 0.0)), weights.get(uuid, 0.0))
        return out

    def account(
        self,
        now: float,
        seconds: float,
        intervals: Sequence[Interval],
        gpu_energy: Mapping[str, float | None],
    ) -> bool:
        """Add one interval of ``seconds`` ending at wall-clock ``now``: each held device's
        ``intervals`` entry; holdings not in it are released. The file is replaced when a
        holding came or went (so that a start after a crash knows exactly who held what), and
        otherwise every ``write_interval`` seconds; True when it was. Raises OSError when the
        write fails: the counts stay in memory and the next interval writes them."""
        held = tuple(
            Held(iv.key, iv.namespace, iv.claim, iv.gpu_uuid, iv.weight, iv.rule, iv.product,
                 iv.mig_profile, iv.device_class)
            for iv in intervals
        )  # fmt: skip
        joules = [iv.energy_joules for iv in intervals]
        busy, idle = [], []
        for iv in intervals:
            b = iv.busy_gpus
            busy.append(0.0 if b is None or not b > 0 else min(b, 1.0) * seconds)
            idle.append(seconds if b is None else 0.0)
        return self.account_held(now, seconds, held, joules, busy, idle, gpu_energy)

    def account_held(
        self,
        now: float,
        seconds: float,
        held: tuple[Held, ...],
        joules: Sequence[float],
        busy: Sequence[float],
        unobserved: Sequence[float],
        gpu_energy: Mapping[str, float | None],
        *,
        write: bool = True,
    ) -> bool:
        """:meth:`account` as the sampler's meter calls it, for an interval that may span many
        of its ticks: what stays the same while held (``held``, the same tuple while nobody
        comes or goes: the records and bucket entries it counts into are found once per
        tuple) and, in the same order, each one's energy (joules), busy GPU-seconds and
        unobserved seconds in the interval (each at most ``seconds``). ``write=False``: count
        only (a read between two writes); the next interval writes when due."""
        self._gap_pending = False
        seconds = max(0.0, seconds)
        changed = False
        cached = self._held
        if cached is None or cached[0] is not held:
            records, changed = self._hold(now, held)
        else:
            records = cached[1]
        if self._released:
            changed = self._expire(now) or changed
        single = self._buckets.single(now - seconds, now)  # every interval but one a quarter hour
        usages = None if single is None else self._entries(single, held)
        shares: list[Share] = []
        inf = math.inf
        for i, r in enumerate(records):
            j, b, idle = joules[i], busy[i], unobserved[i]
            allocated = r.weight * seconds
            if not 0.0 < j < inf:  # negative (a reset), NaN or infinite: nothing
                j = 0.0
            if not 0.0 < b <= seconds:
                b = seconds if b > seconds else 0.0
            if not 0.0 < idle <= seconds:
                idle = seconds if idle > seconds else 0.0
            r.allocated += allocated
            r.energy += j
            r.unobserved += idle
            r.busy += b
            if usages is None:
                shares.append(r.share(held[i].key[0], allocated, b, j, idle))
                continue
            u = usages[i]
            u.allocated += allocated
            u.busy += b
            u.energy += j
            u.unobserved += idle
        if single is None:
            self._buckets.add(now - seconds, now, shares)
        self._through = now
        self._energy.update(_readings(gpu_energy))
        due = self._written is None or now - self._written >= self.write_interval
        if not write or not (changed or due):
            return False
        self._save()
        return True

    def _hold(self, now: float, held: tuple[Held, ...]) -> tuple[list[Record], bool]:
        """Find ``held``'s records (made or held again as needed), release the others: (the
        records, in ``held``'s order; whether a holding came, went or changed weight)."""
        records = self._records
        changed = False
        found = []
        for h in held:
            r = records.get(h.key)
            if r is None:
                r = records[h.key] = Record(ZERO)
            if r.released_at is not None:
                changed = True
            changed = r.hold(h) or changed
            found.append(r)
        keys = {h.key for h in held}
        for key, r in records.items():
            if key not in keys and r.released_at is None:
                r.released_at, changed = now, True
        self._held = (held, found)
        self._entry_cache = None
        self._released = [k for k, r in records.items() if r.released_at is not None]
        return found, changed

    def _expire(self, now: float) -> bool:
        """Forget the released holdings kept past ``retention``; True when one was."""
        gone = []
        for key in self._released:
            at = self._records[key].released_at
            if at is not None and now - at > self.retention:
                gone.append(key)
        for key in gone:
            del self._records[key]
        if gone:
            self._released = [k for k in self._released if k in self._records]
        return bool(gone)

    def _entries(self, start: int, held: tuple[Held, ...]) -> list[Usage]:
        """The entries of the bucket at ``start`` that ``held`` counts into, in its order
        (found once per bucket and ``held``)."""
        entries = self._buckets.entries(start)
        cached = self._entry_cache
        if cached is not None and cached[0] is entries and cached[1] is held:
            return cached[2]
        usages = []
        for h in held:
            key = h.entry_key
            u = entries.get(key)
            if u is None:
                u = entries[key] = Usage(h.namespace, h.claim)
            usages.append(u)
        self._entry_cache = (entries, held, usages)
        return usages

    # -- the file ----------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return {
            "kind": KIND,
            "version": VERSION,
            "bootID": self.boot_id,
            "through": self._through,
            "gpuEnergyJoules": dict(sorted(self._energy.items())),
            "holdings": [
                {
                    "uid": key[0],
                    "pool": key[1],
                    "device": key[2],
                    "namespace": r.namespace,
                    "claim": r.claim,
                    "gpuUUID": r.gpu_uuid,
                    "product": r.product,
                    "migProfile": r.mig_profile,
                    "deviceClass": r.device_class,
                    "weight": r.weight,
                    "rule": r.rule,
                    "allocatedGpuSeconds": r.allocated,
                    "busyGpuSeconds": r.busy,
                    "energyJoules": r.energy,
                    "unobservedSeconds": r.unobserved,
                    "releasedAt": r.released_at,
                }
                for key, r in sorted(self._records.items())
            ],
            "buckets": self._buckets.state(),
        }

    def _save(self, *, sync: bool = False) -> None:
        """Replace the file; fsync it (and its directory) when ``sync``, or when the last
        fsynced write is ``sync_interval`` seconds old."""
        # orjson: the file is rewritten every ``write_interval`` (5 s) by the sampler's thread,
        # and the stdlib's encoder took 1 ms of the sampler's 2.3 ms tick for 56 MIG devices
        # (``python -m bench telemetry``); orjson writes the same JSON in 0.1 ms. Every number
        # in the state is finite (``account`` keeps them so): orjson would write null for one
        # that is not, which the decoder refuses.
        data = orjson.dumps(self._state())  # in order already
        now = self._through or 0.0
        sync = sync or self._synced_at is None or now - self._synced_at >= self.sync_interval
        self._written = None
        atomic_write(self.path, data + b"\n", mode=0o600, sync=sync)
        self._written = self._written_through = self._through
        if sync:
            self._synced_at = now

    def sync(self) -> None:
        """Write the file and fsync it now (at a clean stop)."""
        if self._through is not None:
            self._save(sync=True)

    def _load(self) -> None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return
        try:
            boot, through, energy, counters, buckets = decode_state(raw)
        except (DecodeError, ValueError) as exc:
            moved = move_aside(self.path, self._through or 0.0)
            self._log.error(
                "usage ledger is corrupt; moved aside, counting starts again from zero",
                extra=fields_(path=str(self.path), moved_to=str(moved), reason=str(exc)),
            )
            return
        self._stored_boot, self._through, self._energy = boot, through, energy
        self._written_through = through
        self._records = {k: Record(c) for k, c in counters.items()}
        self._buckets = buckets
        self._gap_pending = True


def _readings(gpu_energy: Mapping[str, float | None]) -> dict[str, float]:
    return {u: e for u, e in gpu_energy.items() if e is not None and _finite(e)}


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x >= 0
