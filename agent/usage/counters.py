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
second up to which they count, and each GPU's last energy-counter reading; every
:meth:`UsageLedger.account` adds one interval and replaces the file atomically (temporary file,
fsync, rename, fsync of the directory) before it returns. A crash (``kill -9``, power) at any
moment leaves either the file before the interval or the file after it: an interval is never
half-counted, and none is counted twice, because the counters and ``through`` are written in one
file.

**Nothing lost but the interval in flight.** The start after a crash, a restart or a rolling
update's handover continues from the file: :meth:`UsageLedger.credit_gap` counts the seconds from
``through`` to the first interval of the new agent for every holding held before and after (no
prepare or unprepare can happen while no agent holds the state directory: the kubelet's calls
wait at the new agent's gate), at the weight it had; the energy of that gap is the difference of
each GPU's energy counter (the driver's, since it was loaded), split between those holdings by
weight; its busy time, which nothing measured, is ``unobservedSeconds``. So allocated
GPU-seconds and energy are exact across an agent's downtime; what a crash loses is the interval
being measured when it struck (at most one sampling interval of every counter). The gap is not
credited after a reboot (another boot id: the claims are gone and the time they were held is
not known), and a driver reload during the gap loses the gap's energy before the reload (the
counter restarted; the energy since the reload is counted when plausible).

**Released claims** keep their final counters for ``retention`` seconds after they were first
seen gone (so that whoever exports them, the cluster record or a scrape, sees the last value);
a claim that comes back continues its counters.

Times: ``account`` takes the interval's length (from the sampler's monotonic clock) and the
wall-clock time it ends at; ``through`` is wall-clock so that it means the same after a restart.
A step of the wall clock while the agent is down moves the gap by that step; a gap that would be
negative counts nothing.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from agent.decode import fields, load_json
from agent.errors import DecodeError
from agent.fsutil import atomic_write, move_aside
from agent.logs import fields_

KIND = "TesseraUsageLedger"
VERSION = 1
MAX_BYTES = 64 * 1024 * 1024
MAX_WATTS = 2000.0
"""Above any GPU's power draw: an energy-counter difference larger than this x seconds is not
believed (the counter restarted, or a bad read)."""

HoldingKey = tuple[str, str, str]
"""(claim UID, pool, device)."""


@dataclass(frozen=True)
class Interval:
    """One holding's use over one interval, as the sampler measured it."""

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


@dataclass(frozen=True)
class Counters:
    """One holding's counters, as stored."""

    namespace: str
    claim: str
    gpu_uuid: str
    weight: float
    """Its weight in the latest interval: what the gap after a restart is counted with."""
    rule: str
    allocated_gpu_seconds: float = 0.0
    busy_gpu_seconds: float = 0.0
    energy_joules: float = 0.0
    unobserved_seconds: float = 0.0
    released_at: float | None = None
    """Wall-clock second it was first seen gone; None while held."""


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
    ) -> None:
        self.path = Path(path)
        self.boot_id = boot_id
        self.retention = retention
        self.max_watts = max_watts
        self._log = log or logging.getLogger(__name__)
        self._through: float | None = None
        self._stored_boot: str | None = None
        self._energy: dict[str, float] = {}
        """GPU UUID -> the driver's energy counter at ``through``."""
        self._counters: dict[HoldingKey, Counters] = {}
        self._gap_pending = False
        self._load()

    # -- reading -----------------------------------------------------------------------------

    @property
    def through(self) -> float | None:
        """The wall-clock second the counters count up to (None before the first interval)."""
        return self._through

    def counters(self) -> Mapping[HoldingKey, Counters]:
        return dict(self._counters)

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
            self._counters = {k: _released(c, now) for k, c in self._counters.items()}
            self._through, self._energy = now, {}
            self._save()
            return Gap(0.0, 0, 0.0, "rebooted")
        seconds = now - self._through
        if seconds <= 0:
            return Gap(0.0, 0, 0.0, "clock-behind")
        kept = [k for k in held if k in self._counters and self._counters[k].released_at is None]
        energy = self._gap_energy(seconds, gpu_energy)
        total = 0.0
        for key in kept:
            c = self._counters[key]
            joules = energy.get(c.gpu_uuid, (0.0, 0.0))
            share = c.weight / joules[1] if joules[1] > 0 else 0.0
            total += joules[0] * share
            self._counters[key] = replace(
                c,
                allocated_gpu_seconds=c.allocated_gpu_seconds + c.weight * seconds,
                unobserved_seconds=c.unobserved_seconds + seconds,
                energy_joules=c.energy_joules + joules[0] * share,
            )
        self._through = now
        self._energy.update(_readings(gpu_energy))
        self._save()
        return Gap(seconds, len(kept), total, "credited")

    def _gap_energy(
        self, seconds: float, gpu_energy: Mapping[str, float | None]
    ) -> dict[str, tuple[float, float]]:
        """GPU UUID -> (joules used in the gap, the weights held on it throughout)."""
        weights: dict[str, float] = {}
        for c in self._counters.values():
            if c.released_at is None:
                weights[c.gpu_uuid] = weights.get(c.gpu_uuid, 0.0) + c.weight
        out: dict[str, tuple[float, float]] = {}
        for uuid, now_j in gpu_energy.items():
            before = self._energy.get(uuid)
            if before is None or now_j is None or not _finite(now_j):
                continue
            limit = self.max_watts * seconds
            used = now_j - before
            if not 0 <= used <= limit:  # the counter restarted (a driver reload), or a bad read
                used = now_j if 0 <= now_j <= limit else 0.0
            out[uuid] = (used * min(1.0, weights.get(uuid, 0.0)), weights.get(uuid, 0.0))
        return out

    def account(
        self,
        now: float,
        seconds: float,
        intervals: Sequence[Interval],
        gpu_energy: Mapping[str, float | None],
    ) -> None:
        """Add one interval of ``seconds`` ending at wall-clock ``now``: each held device's
        ``intervals`` entry; holdings not in it are released. Written (atomically) before it
        returns; raises OSError when it cannot be, and then counts nothing: the caller's next
        interval covers this one too (or the next start's gap does)."""
        self._gap_pending = False
        seconds = max(0.0, seconds)
        counters = dict(self._counters)
        seen = set()
        for iv in intervals:
            seen.add(iv.key)
            c = counters.get(iv.key) or Counters(
                iv.namespace, iv.claim, iv.gpu_uuid, iv.weight, iv.rule
            )
            busy = None if iv.busy_gpus is None else min(max(iv.busy_gpus, 0.0), 1.0)
            counters[iv.key] = replace(
                c,
                namespace=iv.namespace,
                claim=iv.claim,
                gpu_uuid=iv.gpu_uuid,
                weight=iv.weight,
                rule=iv.rule,
                allocated_gpu_seconds=c.allocated_gpu_seconds + iv.weight * seconds,
                busy_gpu_seconds=c.busy_gpu_seconds + (busy or 0.0) * seconds,
                energy_joules=c.energy_joules + max(0.0, iv.energy_joules),
                unobserved_seconds=c.unobserved_seconds + (seconds if busy is None else 0.0),
                released_at=None,
            )
        for key, c in list(counters.items()):
            if key in seen:
                continue
            if c.released_at is None:
                counters[key] = replace(c, released_at=now)
            elif now - c.released_at > self.retention:
                del counters[key]
        energy = dict(self._energy)
        energy.update(_readings(gpu_energy))
        previous = (self._counters, self._through, self._energy)
        self._counters, self._through, self._energy = counters, now, energy
        try:
            self._save()
        except OSError:
            self._counters, self._through, self._energy = previous
            raise

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
                    "namespace": c.namespace,
                    "claim": c.claim,
                    "gpuUUID": c.gpu_uuid,
                    "weight": c.weight,
                    "rule": c.rule,
                    "allocatedGpuSeconds": c.allocated_gpu_seconds,
                    "busyGpuSeconds": c.busy_gpu_seconds,
                    "energyJoules": c.energy_joules,
                    "unobservedSeconds": c.unobserved_seconds,
                    "releasedAt": c.released_at,
                }
                for key, c in sorted(self._counters.items())
            ],
        }

    def _save(self) -> None:
        data = json.dumps(self._state(), sort_keys=True, separators=(",", ":")).encode()
        atomic_write(self.path, data + b"\n", mode=0o600)

    def _load(self) -> None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return
        try:
            boot, through, energy, counters = decode(raw)
        except (DecodeError, ValueError) as exc:
            moved = move_aside(self.path, self._now_for_names())
            self._log.error(
                "usage ledger is corrupt; moved aside, counting starts again from zero",
                extra=fields_(path=str(self.path), moved_to=str(moved), reason=str(exc)),
            )
            return
        self._stored_boot, self._through, self._energy, self._counters = (
            boot,
            through,
            energy,
            counters,
        )
        self._gap_pending = True

    def _now_for_names(self) -> float:
        return self._through or 0.0


def _released(c: Counters, now: float) -> Counters:
    return c if c.released_at is not None else replace(c, released_at=now)


def _readings(gpu_energy: Mapping[str, float | None]) -> dict[str, float]:
    return {u: e for u, e in gpu_energy.items() if e is not None and _finite(e)}


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x >= 0


def _weight(value: object, path: str) -> float:
    w = fields.number(value, path, low=0)
    if w > 1:
        raise fields.FieldError(path, f"must be <= 1 (a share of one GPU), got {w:g}")
    return w


def decode(
    raw: bytes,
) -> tuple[str, float | None, dict[str, float], dict[HoldingKey, Counters]]:
    """(boot id, through, GPU energy readings, counters) of a ledger file; pure. Raises
    ValueError (a FieldError naming the field) or DecodeError."""
    obj = fields.obj(load_json(raw, "usage ledger", MAX_BYTES), "usage ledger")
    if obj.get("kind") != KIND:
        raise ValueError(f"not a {KIND} object")
    if obj.get("version") != VERSION:
        raise ValueError(f"unsupported version {obj.get('version')!r}")
    boot = fields.text(obj.get("bootID"), "bootID")
    raw_through = obj.get("through")
    through = None if raw_through is None else fields.number(raw_through, "through", low=0)
    energy = {
        uuid: fields.number(v, f"gpuEnergyJoules[{uuid!r}]", low=0)
        for uuid, v in fields.obj(obj.get("gpuEnergyJoules"), "gpuEnergyJoules").items()
    }
    counters: dict[HoldingKey, Counters] = {}
    for i, h in enumerate(fields.objects(obj.get("holdings"), "holdings", required=True)):
        p = f"holdings[{i}]"
        key = (
            fields.text(h.get("uid"), f"{p}.uid"),
            fields.text(h.get("pool"), f"{p}.pool"),
            fields.text(h.get("device"), f"{p}.device"),
        )
        released = h.get("releasedAt")
        counters[key] = Counters(
            namespace=fields.text(h.get("namespace"), f"{p}.namespace"),
            claim=fields.text(h.get("claim"), f"{p}.claim"),
            gpu_uuid=fields.text(h.get("gpuUUID"), f"{p}.gpuUUID"),
            weight=_weight(h.get("weight"), f"{p}.weight"),
            rule=fields.text(h.get("rule"), f"{p}.rule"),
            allocated_gpu_seconds=fields.number(
                h.get("allocatedGpuSeconds"), f"{p}.allocatedGpuSeconds", low=0
            ),
            busy_gpu_seconds=fields.number(h.get("busyGpuSeconds"), f"{p}.busyGpuSeconds", low=0),
            energy_joules=fields.number(h.get("energyJoules"), f"{p}.energyJoules", low=0),
            unobserved_seconds=fields.number(
                h.get("unobservedSeconds"), f"{p}.unobservedSeconds", low=0
            ),
            released_at=None
            if released is None
            else fields.number(released, f"{p}.releasedAt", low=0),
        )
    return boot, through, energy, counters
