"""The sampler's feed of the usage ledger (:mod:`agent.usage.counters`): each tick, every held
device's weight, busy GPUs and energy since the tick before.

- **Weight**: :func:`agent.usage.weights.weights` of the claims holding devices now.
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
the file's last interval (:meth:`UsageLedger.credit_gap`) and makes the baselines; every later
tick adds the time since the last tick that was written. A tick whose holders cannot be read, or
whose write fails, advances nothing: the next written tick covers its time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from agent.logs import Throttle, fields_
from agent.nvml.samples import GpuSample
from agent.telemetry.attribution import ClaimHolder
from agent.telemetry.gpuinfo import GpuInfo
from agent.telemetry.snapshot import ClaimUsage
from agent.usage.counters import Counters, HoldingKey, Interval, UsageLedger
from agent.usage.weights import Holding, Weight, weights

WRITE_WARNING_INTERVAL_S = 60.0


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
    ) -> None:
        self.path = path
        self.boot_id = boot_id
        self._log = log
        self._wall = wall
        self._retention = retention
        self._throttle = Throttle(log, WRITE_WARNING_INTERVAL_S)
        self._ledger: UsageLedger | None = None
        self._last: float | None = None
        """The monotonic time of the last tick that was written."""
        self._energy: dict[HoldingKey, float] = {}
        """Each device's ``energy_joules_total`` at the last written tick."""
        self._unweighed: set[HoldingKey] = set()

    def counters(self) -> Mapping[HoldingKey, Counters]:
        return {} if self._ledger is None else self._ledger.counters()

    @property
    def through(self) -> float | None:
        """The wall-clock second the written counters count up to."""
        return None if self._ledger is None else self._ledger.through

    def tick(
        self,
        now: float,
        samples: Sequence[GpuSample],
        gpus: Sequence[GpuInfo],
        holders: Sequence[ClaimHolder] | None,
        claims: Sequence[ClaimUsage],
    ) -> None:
        """Account the interval since the last written tick, ending at monotonic ``now``."""
        if holders is None:
            return
        wall = self._wall()
        held = self._weights(holders, gpus)
        energy_now = {(c.uid, c.pool, c.device): c.energy_joules_total for c in claims}
        counters = {u.uuid: u.energy_joules for u in samples if not u.lost}
        if self._ledger is None:
            self._ledger = UsageLedger(
                self.path, self.boot_id, log=self._log, retention=self._retention
            )
            gap = self._ledger.credit_gap(wall, [_key(w) for w in held], counters)
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
            seconds = 0.0
            self._energy = dict(energy_now)  # the baselines: their past is in the ledger
        else:
            assert self._last is not None
            seconds = max(0.0, now - self._last)
        intervals = self._intervals(held, samples, gpus, holders, claims, energy_now)
        try:
            self._ledger.account(wall, seconds, intervals, counters)
        except OSError as exc:
            self._throttle(
                logging.WARNING,
                "write",
                "cannot write the usage ledger; the next tick written covers this one",
                path=str(self.path),
                error=str(exc.strerror or exc),
            )
            return
        self._last = now
        self._energy.update(energy_now)

    def _weights(self, holders: Sequence[ClaimHolder], gpus: Sequence[GpuInfo]) -> list[Weight]:
        capacities = [g.capacity for g in gpus if g.capacity is not None]
        found, unknown = weights(
            [Holding(h.uid, d) for h in holders for d in h.devices], capacities
        )
        for h in unknown:
            key = (h.claim_uid, h.device.pool, h.device.device)
            if key not in self._unweighed:
                self._unweighed.add(key)
                self._log.warning(
                    "prepared device cannot be weighed (no known GPU or MIG profile);"
                    " its usage is not counted",
                    extra=fields_(claim_uid=key[0], pool=key[1], device=key[2]),
                )
        return list(found)

    def _intervals(
        self,
        held: Sequence[Weight],
        samples: Sequence[GpuSample],
        gpus: Sequence[GpuInfo],
        holders: Sequence[ClaimHolder],
        claims: Sequence[ClaimUsage],
        energy_now: Mapping[HoldingKey, float],
    ) -> list[Interval]:
        by_uuid = {s.uuid: s for s in samples}
        names = {h.uid: (h.namespace, h.name) for h in holders}
        devices = {(h.uid, d.pool, d.device): d for h in holders for d in h.devices}
        shares = {(c.uid, c.pool, c.device): c.share for c in claims}
        out = []
        for w in held:
            key = _key(w)
            total = energy_now.get(key)
            joules = 0.0 if total is None else max(0.0, total - self._energy.get(key, 0.0))
            device = devices[key]
            sample = by_uuid.get(w.gpu_uuid)
            busy: float | None = None
            if sample is not None and not sample.lost:
                if device.kind != "mig":
                    share = shares.get(key)
                    if sample.utilization_gpu is not None and share is not None:
                        busy = sample.utilization_gpu * share
                elif device.sharing in (None, "MPS"):
                    mig = next(
                        (m for m in sample.mig if m.gpu_instance_id == device.gpu_instance_id),
                        None,
                    )
                    if mig is not None and mig.utilization is not None:
                        busy = mig.utilization * w.weight
            namespace, name = names.get(w.claim_uid, ("", ""))
            out.append(Interval(key, namespace, name, w.gpu_uuid, w.weight, w.rule, joules, busy))
        return out


def _key(w: Weight) -> HoldingKey:
    return (w.claim_uid, w.pool, w.device)
