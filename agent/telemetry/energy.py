"""Energy and usage accounting: monotonic energy per GPU, energy and GPU-seconds per claim.

``EnergyAccounting.update`` is fed every sampler tick with each GPU's sample and the claims that
hold devices (a read-only view of the driver's checkpoint, :class:`attribution.ClaimHolder`). It
keeps two kinds of counters, both monotonic: the energy of each GPU and, for every (claim,
prepared device), the energy and GPU-seconds attributed to it.

**GPU energy.** Each interval's energy comes from the driver's total-energy counter when two
consecutive readings have it: the delta is the difference. The counter restarts at 0 when the
driver reloads, so a difference that is negative (the counter went backwards) or larger than the
GPU could draw in the interval (``max_watts`` x seconds, 2000 W by default: above every current
GPU's power limit) is treated as a reset, and the new reading itself is the delta (the energy
since the reset) when it is plausible; when it is not (a garbage read), the interval is integrated
from power as below, or counts nothing. A delta is never negative. When either reading lacks
the counter (the GPU does not support it, or the call failed), the interval is integrated from
``power_watts`` with the trapezoid rule (the mean of the two readings' power, or the one that is
known, x seconds). A reading with neither counter nor power (a lost GPU, a failed read) accounts
nothing and leaves the baseline where it was, so the next good reading covers the gap. The first
reading after the agent starts is only a baseline: energy used while the agent was down is not
counted, by the GPUs or by the claims. Totals never decrease.

**GPUs handed to virtual machines.** A GPU bound to vfio-pci (``GpuInfo.passthrough``) is not
read: the sampler passes a sample with nothing in it, so it accounts no energy, and its baseline
is dropped every tick it is passed through: the first reading after it is bound to nvidia again
is only a baseline, so energy a virtual machine used (the counter may or may not have restarted
meanwhile) is never counted, by the GPU or by whoever holds it next. Its claims (a ``vfio``
device holds the whole GPU: ``exclusive``) keep accruing GPU-seconds and get no energy.

**Which GPU a device is on.** A held device's GPU is found by its ``gpu_uuid`` (stable across
reboots and index renumbering); only a device with no recorded UUID is placed by its
``gpu_minor``. A device whose GPU no longer has its UUID (lost, replaced, or the node's model
changed) is on no known GPU, whatever GPU has its minor number now: it is ignored (logged once)
and nothing is attributed to it. Only claims whose prepare completed are holders (the driver's
view passes only those: a claim still being prepared runs no workload yet). The holders read at
the end of an interval own the whole interval.

**Attribution.** Each holder of a GPU gets a share of the GPU's energy delta and of the interval's
elapsed seconds (its GPU-seconds, which accrue while a claim holds the device, even when the GPU
is lost or idle). Every holding has one ``rule``, fixed by how its device was prepared (the
checkpoint's ``sharing``), never by who else holds the unit at the moment, so the ``rule`` of its
``ClaimUsage`` (and the ``rule`` label of its counters) stays the same while it is held: a label
that changed would start a new Prometheus series for the same counter.

- ``exclusive``: a whole GPU prepared for one claim (no sharing, or the claim's own MPS daemon)
  gets 100 %. A whole GPU held for 10 s is 10 GPU-seconds.
- ``mig-sm-share``: a MIG device prepared for one claim gets its profile's SMs / the SMs of the
  whole GPU as MIG divides it (the largest profile, ``7g``): on an A100 a ``1g.5gb`` gets 14/98
  of the GPU's energy, and 10 s of it are 10 x 14/98 = 1.43 GPU-seconds. The profile comes from
  the device name's profile id (``gpu-0-mig-1g5gb-19-0``), else the GPU instance's SMs. The share
  of idle slices (MIG devices no claim holds, and SMs no profile combination covers: seven H100
  ``1g`` devices are 7 x 16 of 132 SMs) is attributed to no one; so is a MIG device whose SMs are
  unknown.
- ``vgpu-framebuffer``: a vGPU (device kind ``vgpu``) gets its type's framebuffer over the GPU's
  memory (``GpuCapacity.vgpu_fraction``), the usage weight's rule (:mod:`agent.usage.weights`):
  an ``H200X-35C`` (35 GiB) of a 140 GiB H200 gets 1/4 of the GPU's energy and time. The host
  sees no process inside a VM, so nothing finer is known; on a GPU of one vGPU type the
  fraction is 1 / max instances, the GPU time each vGPU gets under NVIDIA's fixed-share
  scheduler (https://docs.nvidia.com/vgpu/knowledge-base/latest/vgpu-features.html, "vGPU
  Schedulers"). Framebuffer no vGPU holds is attributed to no one, as idle MIG slices
  are; a vGPU whose type the GPU does not list gets nothing.
- ``shared``: a device prepared to be shared with other claims (``TimeSlicing``,
  ``MemoryShare``). The holdings of its unit (the whole GPU, or one MIG device as above) split
  the unit by the SM utilization of each claim's processes when NVML reports any
  (``ProcessSample.sm_utilization``), else evenly. A process is a claim's when it runs in one of
  the claim's pods: the injected ``process_pod(pid) -> pod uid`` (in the agent
  :class:`agent.telemetry.owners.ProcessPods`, from the process's cgroup) matched against the
  claim's ``pods`` (its ``status.reservedFor``); a process of a pod that several holders of the
  unit are reserved for counts evenly for each; processes of other MIG devices do not count. A
  claim that ran nothing gets 0; a claim with several devices on the unit splits its part
  evenly. When no holder's processes report utilization (their pods are unknown, ``process_pod``
  is not given, or NVML has no per-process samples), the holdings split the unit evenly. A shared
  device held alone gets the whole unit.

Several claims holding a unit prepared exclusive (only a malformed checkpoint does that) are split
the same way; each keeps its own rule. Shares on one GPU never sum to more than 1 (they are
scaled down if a malformed checkpoint made them). With the GPU fully held, the claims' energy sums
to the GPU's energy for the same window.

**The latest share.** ``ClaimUsage.share`` is the fraction (0-1) of its GPU's energy and time a
held device got in the latest interval (None once the claim is released, and until its first
interval after a restart): how a shared unit was split, without a label that changes.

**Earlier rules.** Builds before the stable rules named the latest interval's split instead
(``process-utilization`` or ``even``), and called a shared device that held its GPU alone
``exclusive``; a state file with the old names is read as ``shared``, and the holding's rule is
its own again from the first interval. The counters continue from their stored values, under the
new label: a series that had an old label ends once, at the upgrade.

**Persistence and retention.** GPU totals (by UUID) and claim counters are written to
``state_file`` (JSON, atomically) at most every ``persist_interval`` seconds (15 by default) and
on ``close()``, and read back at start, so a restart after a clean shutdown never moves a counter
backwards; after a crash, the increments since the last write (at most ``persist_interval``
seconds' worth) are lost once. A corrupt state file is moved aside
(``<name>.corrupt-<UTC timestamp>``) and accounting starts from zero. A claim that is no longer
prepared keeps its final counters (it is still listed, frozen) for ``retention`` seconds (1 hour
by default) after it was first seen gone, so Prometheus sees the counter's last value instead of
a vanishing series; a claim that comes back (same UID and device) continues from its counters.
When the holders cannot be read (``holders`` is None) nothing is attributed or released.

Times: sample timestamps (monotonic) measure intervals; ``clock`` (unix seconds) times the
persistence interval and retention, which must survive a restart.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.decode import fields, load_json
from agent.errors import DecodeError
from agent.fsutil import atomic_write, move_aside
from agent.logs import fields_
from agent.nvml.samples import GpuSample
from agent.telemetry.attribution import (
    LEGACY_RULES,
    ClaimHolder,
    Holding,
    HoldingKey,
    ProcessPod,
    holdings,
    shares,
)
from agent.telemetry.gpuinfo import GpuInfo
from agent.telemetry.snapshot import ClaimUsage, PreparedDevice
from agent.usage.joules import COUNTER, MAX_WATTS, Reading, energy_delta

STATE_KIND = "TesseraEnergyState"
STATE_VERSION = 1
MAX_STATE_BYTES = 64 * 1024 * 1024


@dataclass
class _Gpu:
    energy_joules: float = 0.0
    known: bool = False
    """A reading or a stored total exists: the total is meaningful."""
    index: int | None = None
    baseline: Reading | None = None
    last_timestamp: float | None = None


@dataclass
class _Usage:
    namespace: str
    claim: str
    gpu_index: int
    gpu_uuid: str
    rule: str
    energy_joules: float = 0.0
    gpu_seconds: float = 0.0
    released_at: float | None = None
    """Unix seconds when the claim was first seen gone; None while it is prepared."""
    share: float | None = None
    """The latest interval's share (0-1); None while released or not yet accounted (not
    persisted)."""


@dataclass(frozen=True)
class Accounted:
    """The accounting's answer to one update."""

    gpu_energy: Mapping[int, float | None]
    """GPU index -> monotonic energy total (None before any energy reading); GPUs handed to
    virtual machines are not in it."""
    claims: tuple[ClaimUsage, ...]
    prepared: tuple[PreparedDevice, ...]
    """The devices held now, on known GPUs."""


class EnergyAccounting:
    """Monotonic energy and usage counters (see the module docstring). Thread-safe."""

    def __init__(
        self,
        state_file: Path,
        clock: Callable[[], float] = time.time,
        *,
        log: logging.Logger | None = None,
        persist_interval: float = 15.0,
        retention: float = 3600.0,
        max_watts: float = MAX_WATTS,
        process_pod: ProcessPod | None = None,
        load: bool = True,
    ) -> None:
        """``load``: read the state file now; False: at :meth:`load` (an agent that waits for
        its state directory); nothing is written before it has been read."""
        self.state_file = Path(state_file)
        self._clock = clock
        self._log = log or logging.getLogger(__name__)
        self.persist_interval = persist_interval
        self.retention = retention
        self.max_watts = max_watts
        self._process_pod = process_pod
        self._lock = threading.Lock()
        self._gpus: dict[str, _Gpu] = {}
        self._usage: dict[HoldingKey, _Usage] = {}
        self._warned: set[HoldingKey] = set()
        self._loaded = False
        if load:
            self.load()
        self._saved_at = clock()

    def load(self) -> None:
        """Read the state file (once; later calls do nothing)."""
        with self._lock:
            if not self._loaded:
                self._load()
                self._loaded = True

    # -- accounting ------------------------------------------------------------------------------

    def update(
        self,
        samples: Sequence[GpuSample],
        gpus: Sequence[GpuInfo],
        holders: Sequence[ClaimHolder] | None,
    ) -> Accounted:
        """Account one tick: ``samples`` (one per GPU), ``gpus`` (their identities) and the
        claims holding devices (None: unknown this tick)."""
        with self._lock:
            now = self._clock()
            by_uuid = {g.uuid: g for g in gpus}
            held = None
            if holders is not None:
                held, unknown = holdings(holders, gpus)
                self._warn_unknown(unknown)
            for g in gpus:
                if g.passthrough:  # what the VM used is never counted after it comes back
                    self._gpus.setdefault(g.uuid, _Gpu()).baseline = None
            for sample in samples:
                self._account(sample, by_uuid.get(sample.uuid), held)
            if held is not None:
                self._release(now, {h.key for h in held})
            if now - self._saved_at >= self.persist_interval:
                self._save(now)
            prepared = tuple(
                PreparedDevice(
                    h.pool, h.device, h.gpu_index, h.namespace, h.claim, h.uid, h.gpu_instance_id
                )
                for h in held or ()
            )
            energy = {
                g.index: (st.energy_joules if st.known else None)
                for g in gpus
                if not g.passthrough  # not in the telemetry (and all at index -1)
                for st in [self._gpus.get(g.uuid, _Gpu())]
            }
            return Accounted(energy, self._claims(), prepared)

    def _account(
        self, sample: GpuSample, gpu: GpuInfo | None, held: Sequence[Holding] | None
    ) -> None:
        st = self._gpus.setdefault(sample.uuid, _Gpu())
        st.index = sample.index
        elapsed = None
        if st.last_timestamp is not None and sample.timestamp > st.last_timestamp:
            elapsed = sample.timestamp - st.last_timestamp
        st.last_timestamp = sample.timestamp
        delta = 0.0
        if not sample.lost and (sample.energy_joules is not None or sample.power_watts is not None):
            reading = Reading(sample.timestamp, sample.energy_joules, sample.power_watts)
            st.known = True
            if st.baseline is None or reading.timestamp <= st.baseline.timestamp:
                st.baseline = reading
            else:
                delta, source = energy_delta(st.baseline, reading, self.max_watts)
                both = None not in (reading.energy_joules, st.baseline.energy_joules)
                if both and source != COUNTER:
                    self._log.warning(
                        "GPU energy counter went backwards or jumped implausibly (driver reset?)",
                        extra=fields_(
                            gpu=sample.index,
                            previous=st.baseline.energy_joules,
                            current=reading.energy_joules,
                            used=source,
                            joules=round(delta, 3),
                        ),
                    )
                st.baseline = reading
                st.energy_joules += delta
        if gpu is None or held is None:
            return
        members = [h for h in held if h.gpu_uuid == gpu.uuid]
        for s in shares(gpu, members, sample, self._process_pod):
            h = next(m for m in members if m.key == s.key)
            u = self._usage.get(s.key)
            if u is None:
                u = self._usage[s.key] = _Usage(h.namespace, h.claim, gpu.index, gpu.uuid, s.rule)
            u.namespace, u.claim, u.rule, u.released_at = h.namespace, h.claim, s.rule, None
            u.share = s.share
            u.gpu_index, u.gpu_uuid = gpu.index, gpu.uuid
            u.energy_joules += delta * s.share
            if elapsed is not None:
                u.gpu_seconds += elapsed * s.share

    def _release(self, now: float, current: set[HoldingKey]) -> None:
        for key in list(self._usage):
            u = self._usage[key]
            if key in current:
                continue
            u.share = None
            if u.released_at is None:
                u.released_at = now
            elif now - u.released_at > self.retention:
                del self._usage[key]

    def _warn_unknown(self, unknown: Sequence[HoldingKey]) -> None:
        for key in unknown:
            if key not in self._warned:
                self._warned.add(key)
                self._log.warning(
                    "prepared device is on no known GPU; not attributed",
                    extra=fields_(claim_uid=key[0], pool=key[1], device=key[2]),
                )

    def _claims(self) -> tuple[ClaimUsage, ...]:
        out = [
            ClaimUsage(
                namespace=u.namespace,
                claim=u.claim,
                uid=key[0],
                pool=key[1],
                device=key[2],
                gpu_index=u.gpu_index,
                rule=u.rule,
                energy_joules_total=u.energy_joules,
                gpu_seconds_total=u.gpu_seconds,
                share=u.share,
            )
            for key, u in self._usage.items()
        ]
        return tuple(sorted(out, key=lambda c: (c.namespace, c.claim, c.uid, c.pool, c.device)))

    def usage(self) -> tuple[ClaimUsage, ...]:
        """Every claim-device's counters, prepared or retained."""
        with self._lock:
            return self._claims()

    def gpu_energy(self, uuid: str) -> float | None:
        """The GPU's energy total; None before any reading or stored total."""
        with self._lock:
            st = self._gpus.get(uuid)
            return st.energy_joules if st is not None and st.known else None

    # -- persistence -----------------------------------------------------------------------------

    def save(self) -> None:
        """Write the state file now (errors are logged, not raised)."""
        with self._lock:
            self._save(self._clock())

    def close(self) -> None:
        """Write the state file a last time (the sampler has stopped)."""
        self.save()

    def _state(self, now: float) -> dict[str, Any]:
        return {
            "kind": STATE_KIND,
            "version": STATE_VERSION,
            "savedAt": now,
            "gpus": {
                uuid: {"index": st.index, "energyJoules": st.energy_joules}
                for uuid, st in sorted(self._gpus.items())
                if st.known
            },
            "claims": [
                {
                    "uid": key[0],
                    "pool": key[1],
                    "device": key[2],
                    "namespace": u.namespace,
                    "claim": u.claim,
                    "gpuIndex": u.gpu_index,
                    "gpuUUID": u.gpu_uuid,
                    "rule": u.rule,
                    "energyJoules": u.energy_joules,
                    "gpuSeconds": u.gpu_seconds,
                    "releasedAt": u.released_at,
                }
                for key, u in sorted(self._usage.items())
            ],
        }

    def _save(self, now: float) -> None:
        self._saved_at = now
        if not self._loaded:  # never replace a state file we have not read
            return
        data = json.dumps(self._state(now), sort_keys=True, indent=1).encode() + b"\n"
        try:
            atomic_write(self.state_file, data, mode=0o600)
        except OSError as exc:
            self._log.warning(
                "cannot write the energy state file; counters would restart from the last one",
                extra=fields_(path=str(self.state_file), error=str(exc.strerror or exc)),
            )

    def _load(self) -> None:
        try:
            raw = self.state_file.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            self._log.error(
                "cannot read the energy state file; counters start from zero",
                extra=fields_(path=str(self.state_file), error=str(exc.strerror or exc)),
            )
            return
        try:
            gpus, usage = decode_state(raw)
        except (DecodeError, ValueError, TypeError, KeyError) as exc:
            moved = self._move_aside()
            self._log.error(
                "energy state file is corrupt; moved aside, counters start from zero",
                extra=fields_(path=str(self.state_file), moved_to=str(moved), reason=str(exc)),
            )
            return
        self._gpus, self._usage = gpus, usage

    def _move_aside(self) -> Path | None:
        try:
            return move_aside(self.state_file, self._clock())
        except OSError:
            return None


def decode_state(raw: bytes) -> tuple[dict[str, _Gpu], dict[HoldingKey, _Usage]]:
    """The GPU totals and claim counters stored in a state file, read with
    :mod:`agent.decode.fields` (unknown fields ignored). Pure; raises ValueError (a FieldError
    naming the field) on anything malformed, DecodeError on bytes that are not JSON within the
    limits."""
    obj = fields.obj(load_json(raw, "energy state", MAX_STATE_BYTES), "energy state")
    if obj.get("kind") != STATE_KIND:
        raise ValueError(f"not a {STATE_KIND} object")
    if obj.get("version") != STATE_VERSION:
        raise ValueError(f"unsupported version {obj.get('version')!r}")
    gpus: dict[str, _Gpu] = {}
    for uuid, g in fields.obj(obj.get("gpus"), "gpus").items():
        p = f"gpus[{uuid!r}]"
        g = fields.obj(g, p)
        gpus[uuid] = _Gpu(
            energy_joules=fields.number(g.get("energyJoules"), f"{p}.energyJoules", low=0),
            known=True,
            index=fields.opt_integer(g.get("index"), f"{p}.index"),
        )
    usage: dict[HoldingKey, _Usage] = {}
    for i, c in enumerate(fields.objects(obj.get("claims"), "claims", required=True)):
        p = f"claims[{i}]"
        released = c.get("releasedAt")
        index = fields.opt_integer(c.get("gpuIndex"), f"{p}.gpuIndex")
        rule = fields.text(c.get("rule"), f"{p}.rule")
        key = tuple(fields.text(c.get(k), f"{p}.{k}") for k in ("uid", "pool", "device"))
        usage[(key[0], key[1], key[2])] = _Usage(
            namespace=fields.text(c.get("namespace"), f"{p}.namespace"),
            claim=fields.text(c.get("claim"), f"{p}.claim"),
            gpu_index=-1 if index is None else index,
            gpu_uuid=fields.text(c.get("gpuUUID"), f"{p}.gpuUUID"),
            rule=LEGACY_RULES.get(rule, rule),
            energy_joules=fields.number(c.get("energyJoules"), f"{p}.energyJoules", low=0),
            gpu_seconds=fields.number(c.get("gpuSeconds"), f"{p}.gpuSeconds", low=0),
            released_at=None
            if released is None
            else fields.number(released, f"{p}.releasedAt", low=0),
        )
    return gpus, usage
