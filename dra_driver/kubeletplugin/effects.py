"""The side effects of a claim's plan: made in order at prepare, undone at unprepare and rollback,
swept and restored at start. Every step is idempotent and can be found again, so a crash between
any two steps is repaired by redoing or undoing the claim.

Order at prepare (each after the claim is recorded as ``PrepareStarted`` with its plan):

1. dynamic MIG devices are created (``DynamicMig.ensure``; crash points ``after-gi-create``,
   ``after-ci-create``), and the record gets their UUIDs and instance ids;
2. a whole GPU in dynamic mode is freed of MIG (``DynamicMig.free_whole_gpu``);
3. time-sliced GPUs get compute mode DEFAULT and their interval (crash point
   ``after-compute-policy``);
4. a claim that shares through MPS gets its control daemon (``MpsControl.start``), after its
   whole GPUs' compute mode: EXCLUSIVE_PROCESS when the claim holds them alone, DEFAULT for
   memory shares (several claims' MPS servers on one GPU); the record gets the daemon (crash
   point ``after-mps-start``);
5. a whole GPU the claim caps (``powerLimit``, held alone): its power limit now is read and
   recorded durably as the one to set back (a ``PrepareStarted`` commit; crash point
   ``after-power-recorded``), THEN the cap is set (crash point ``after-power-limit``). A crash
   between the two leaves a started record whose undo sets the limit found (a no-op); a crash
   after the cap, before the claim completes, is rolled back the same way at the next start.

A virtual machine's device (kinds ``vfio``, ``vgpu``) is made first, by
:class:`dra_driver.kubeletplugin.vm_steps.VmSteps` with the same pattern (what it will change
recorded durably first; crash points ``after-vfio-unbind``, ``after-vfio-bind``,
``after-vgpu-create``), undone (``after-unprepare-vfio-unbind``: a function off vfio-pci, not yet
back on its driver), swept and restored with the rest.

Undo (unprepare, rollback): the MPS daemon is stopped (its record, else found by its directory),
compute mode back to DEFAULT on a whole GPU no other MPS claim holds, the interval back to
Default on a GPU no other claim time-slices, a capped GPU's power limit set back to the one
recorded before the cap, dynamic MIG devices destroyed by placement. A power limit that cannot
be set back fails the undo: the claim keeps its record (and its GPU) and the kubelet's retry,
the next prepare of the claim or the next start tries again; it is never forgotten.

Start: dynamic MIG instances no claim owns are destroyed (dynamic mode only: a static node is
never touched), MPS directories no claim owns are stopped and removed; completed claims get their
dynamic MIG devices made again where they are gone (an unprepare that crashed after undoing and
before releasing the record: the kubelet's retry undoes them again), their time-slice intervals
set again, their power caps set again (a GPU reset or driver reload while the agent was down
resets the limit), and their MPS daemons adopted (same PID and start time) or, when gone,
started again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from agent.logs import fields_
from agent.nvml.types import MigInstance
from dra_driver.device_model import AdvertisedDevice, DeviceModel
from dra_driver.errors import SharingError
from dra_driver.kubeletplugin.cdi_spec import MpsEdits
from dra_driver.kubeletplugin.checkpoint import (
    PREPARE_COMPLETED,
    VM_KINDS,
    Checkpoint,
    ClaimEntry,
    MpsRecord,
    PreparedDevice,
)
from dra_driver.kubeletplugin.claims import ClaimKey
from dra_driver.kubeletplugin.plan import (
    MEMORY_SHARE,
    MPS,
    TIME_SLICING,
    ClaimPlan,
    PlannedDevice,
    limits,
)
from dra_driver.kubeletplugin.sweep import sweep_mig, sweep_mps
from dra_driver.kubeletplugin.vm_steps import VmSteps
from dra_driver.sharing.dynamic_mig import DynamicMig
from dra_driver.sharing.mps import MpsControl, MpsDaemon, MpsSettings
from dra_driver.sharing.power_cap import GpuPower
from dra_driver.sharing.timeslice import GpuSettings
from dra_driver.vm.tools import VmTools

T = TypeVar("T")
CrashHook = Callable[[str], None]
Save = Callable[[tuple[PreparedDevice, ...], MpsRecord | None], None]
"""Record progress: the claim's devices and MPS daemon so far (a ``PrepareStarted`` commit)."""


@dataclass(frozen=True)
class Applied:
    devices: tuple[PreparedDevice, ...]
    mps: MpsRecord | None


def mps_edits(record: MpsRecord | None) -> MpsEdits | None:
    """What the claim's CDI spec mounts for its MPS daemon."""
    return None if record is None else MpsEdits(record.pipe_dir, record.shm_dir)


def _daemon(key: str, r: MpsRecord) -> MpsDaemon:
    return MpsDaemon(key, r.pid, r.started_at, r.pipe_dir, r.log_dir, r.shm_dir, r.devices)


class Effects:
    """Applies and undoes the side effects of claims (see the module docstring)."""

    def __init__(
        self,
        *,
        mig: DynamicMig | None,
        settings: GpuSettings | None,
        mps: MpsControl | None,
        devices: Callable[[], DeviceModel],
        log: logging.Logger,
        crash_hook: CrashHook = lambda point: None,
        power: GpuPower | None = None,
        vm: VmTools | None = None,
    ) -> None:
        """``mig`` is None in static MIG mode (nothing is created or destroyed); ``settings``
        and ``mps`` are None where sharing is not available (their claims are refused);
        ``devices`` is what the node advertises now (where each GPU is, by UUID, and the
        placements of dynamic MIG); ``power`` sets GPUs' power limits (None: claims with
        ``powerLimit`` are refused); ``vm`` hands GPUs to virtual machines (None: their claims
        are refused)."""
        self.mig = mig
        self.settings = settings
        self.mps = mps
        self.power = power
        self.devices = devices
        self.log = log
        self.crash = crash_hook
        self.vm = VmSteps(vm, devices, log.getChild("vm"))

    def gpus(self) -> dict[str, int]:
        """Every GPU's UUID and NVML index, as the node advertises them now."""
        return {d.parent_uuid: d.gpu_index for d in self.devices().devices if d.gpu_index >= 0}

    # -- prepare -----------------------------------------------------------------------------
    def changes_node(self, plan: ClaimPlan) -> bool:
        """Whether ``apply`` changes anything on the node for ``plan`` that only its record can
        undo after a crash (a GPU's MIG mode, compute mode or time-slice set, an MPS daemon
        started, a power cap, a GPU handed to a VM): its start must then be recorded durably
        before. A dynamic MIG device is not such a change: a crash before its claim completes
        leaves an instance that no completed claim owns, which the start's sweep destroys by
        placement (``sweep_mig``), as the rollback of a durable start would have."""
        for p in plan.devices:
            if p.device.kind in VM_KINDS:
                return True
            if p.uses_mps or (p.sharing == TIME_SLICING and p.interval is not None):
                return True
            if p.power_limit_mw is not None:
                return True
            if p.device.kind == "gpu" and self.mig is not None and p.device.consumes_counters:
                return True
        return False

    def spec_only(self, plan: ClaimPlan) -> bool:
        """Whether ``apply`` does nothing for ``plan``: its prepare is its CDI spec alone."""
        return not plan.uses_mps and not any(
            p.device.kind in VM_KINDS
            or p.dynamic
            or (p.device.kind == "gpu" and self.mig is not None and p.device.consumes_counters)
            or p.sharing == TIME_SLICING
            or p.power_limit_mw is not None
            for p in plan.devices
        )

    @staticmethod
    def changes_node_of(entry: ClaimEntry) -> bool:
        """Whether ``undo`` of a recorded claim may change anything on the node (the claims of
        one GPU that do are undone one after the other)."""
        return entry.mps is not None or any(
            d.placement is not None
            or d.sharing is not None
            or d.power_restore_mw is not None
            or d.kind in VM_KINDS
            for d in entry.devices
        )

    def apply(
        self,
        claim: ClaimKey,
        plan: ClaimPlan,
        records: tuple[PreparedDevice, ...],
        save: Save,
    ) -> Applied:
        """Make the claim's side effects (the records say what is already done); raises
        SharingError. The caller rolls back with ``undo`` when this fails."""
        by_name = {r.device: r for r in records}

        def keep(d: PreparedDevice) -> None:
            by_name[d.device] = d
            save(tuple(by_name[r.device] for r in records), None)

        for p in plan.devices:
            if p.device.kind in VM_KINDS:
                by_name[p.device.name] = self.vm.apply(p, by_name[p.device.name], keep)
            elif p.dynamic:
                mig = self._need(self.mig, p, "dynamic MIG (--mig-mode dynamic)")
                inst = mig.ensure(p.device)
                by_name[p.device.name] = replace(
                    by_name[p.device.name],
                    mig_uuid=inst.uuid,
                    gpu_instance_id=inst.gpu_instance_id,
                    compute_instance_id=inst.compute_instance_id,
                )
            elif p.device.kind == "gpu" and self.mig is not None and p.device.consumes_counters:
                self.mig.free_whole_gpu(p.device)
        devices = tuple(by_name[r.device] for r in records)
        # The new MIG device's UUID and ids are not saved here: a crash before the claim is
        # completed is undone by the placement its started record holds, and the completed
        # record has them (one checkpoint write less per dynamic MIG prepare).
        for p in plan.devices:
            if p.sharing == TIME_SLICING and p.interval is not None:
                settings = self._need(self.settings, p, "time-slicing (nvidia-smi)")
                settings.compute_mode(p.device.parent_uuid, "DEFAULT")
                settings.timeslice(p.device.parent_uuid, p.interval)
                self.crash("after-compute-policy")
        record = None
        if plan.uses_mps:
            record = self._start_mps(claim, plan, devices)
            save(devices, record)
            self.crash("after-mps-start")
        devices = self._cap_power(plan, devices, record, save)
        return Applied(devices, record)

    def _cap_power(
        self,
        plan: ClaimPlan,
        devices: tuple[PreparedDevice, ...],
        record: MpsRecord | None,
        save: Save,
    ) -> tuple[PreparedDevice, ...]:
        """Step 5: record each capped GPU's limit now (durably), then set the caps."""
        capped = [(p, p.power_limit_mw) for p in plan.devices if p.power_limit_mw is not None]
        if not capped:
            return devices
        power = self._need(self.power, capped[0][0], "setting a GPU's power limit (NVML)")
        recorded = {d.device for d in devices if d.power_restore_mw is not None}
        found = {
            p.device.name: power.current(p.device.name, p.device.gpu_index)
            for p, _ in capped
            if p.device.name not in recorded
        }
        devices = tuple(
            replace(d, power_restore_mw=found[d.device]) if d.device in found else d
            for d in devices
        )
        if found:
            save(devices, record)  # the limit to set back is durable before the GPU changes
        self.crash("after-power-recorded")
        for p, limit in capped:
            power.set(p.device.name, p.device.gpu_index, limit, "cap")
        self.crash("after-power-limit")
        return devices

    def _need(self, tool: T | None, p: PlannedDevice, what: str) -> T:
        if tool is None:
            raise SharingError(
                f"{p.device.name}: {what} is not available on this node", "sharing_unavailable"
            )
        return tool

    def _uuid(self, p: PlannedDevice, devices: tuple[PreparedDevice, ...]) -> str:
        record = next(d for d in devices if d.device == p.device.name)
        uuid = record.mig_uuid if record.kind == "mig" else record.gpu_uuid
        if not uuid:
            raise SharingError(f"{p.device.name}: no UUID to give MPS")
        return uuid

    def _start_mps(
        self, claim: ClaimKey, plan: ClaimPlan, devices: tuple[PreparedDevice, ...]
    ) -> MpsRecord:
        shared = [p for p in plan.devices if p.uses_mps]
        control = self._need(self.mps, shared[0], "MPS (nvidia-cuda-mps-control)")
        uuids = {p.device.name: self._uuid(p, devices) for p in shared}
        for p in shared:
            if p.device.kind == "gpu" and self.settings is not None:
                # one process (the MPS server) when the claim holds the GPU alone; several
                # claims' servers side by side for memory shares
                mode = "DEFAULT" if p.sharing == MEMORY_SHARE else "EXCLUSIVE_PROCESS"
                self.settings.compute_mode(p.device.parent_uuid, mode)
        pinned = limits(shared, uuids)
        stale = control.found(claim.uid)  # a daemon a crash left before its record was saved
        if stale is not None:
            control.stop(stale)
        daemon = control.start(
            claim.uid,
            MpsSettings(
                devices=tuple(uuids[p.device.name] for p in shared),
                active_thread_percentage=plan.mps_thread_percentage,
                pinned_memory_limits=pinned,
            ),
        )
        return MpsRecord(
            pid=daemon.pid,
            started_at=daemon.started_at,
            pipe_dir=daemon.pipe_dir,
            log_dir=daemon.log_dir,
            shm_dir=daemon.shm_dir,
            devices=daemon.devices,
            thread_percentage=plan.mps_thread_percentage,
            pinned=tuple(sorted(pinned.items())),
        )

    # -- undo --------------------------------------------------------------------------------
    def undo(self, entry: ClaimEntry, remaining: Checkpoint) -> None:
        """Undo the side effects of ``entry`` (all of them, whatever it got to), given the
        claims that remain. Idempotent; raises SharingError when something cannot be undone."""
        others = [d for e in remaining.claims.values() if e.uid != entry.uid for d in e.devices]
        self.stop_mps(entry)
        for d in entry.devices:
            if d.kind in VM_KINDS:
                self.vm.undo(d)
            mps_users = [
                o for o in others if o.gpu_uuid == d.gpu_uuid and o.sharing in (MPS, MEMORY_SHARE)
            ]
            mps_gpu = d.kind == "gpu" and d.sharing in (MPS, MEMORY_SHARE)
            if mps_gpu and not mps_users and self.settings is not None:
                self.settings.compute_mode(d.gpu_uuid, "DEFAULT")
            if d.sharing == TIME_SLICING:
                sharers = [o for o in others if o.device == d.device and o.sharing == TIME_SLICING]
                if not sharers and self.settings is not None:
                    self.settings.timeslice(d.gpu_uuid, "Default")
            if d.power_restore_mw is not None:
                self._restore_power(d, d.power_restore_mw)
            if d.placement is not None and self.mig is not None:
                index = self.gpus().get(d.gpu_uuid)
                if index is not None:
                    profile, start, _ = d.placement
                    self.mig.release(d.device, index, profile, start)

    def mps_alive(self, entry: ClaimEntry) -> bool:
        """Whether the claim's recorded MPS daemon still runs (True when it has none)."""
        if self.mps is None or entry.mps is None:
            return True
        return self.mps.alive(_daemon(entry.uid, entry.mps))

    def stop_mps(self, entry: ClaimEntry) -> None:
        """Stop the claim's MPS daemon (the recorded one, else one its directory names) and
        remove its directories; the first step of ``undo``. Idempotent, and independent of every
        other claim's: the unprepare of a call stops all its claims' daemons at once
        (``Transactions.unprepare_batch``), since a wedged one takes ``stop_timeout_s`` or more."""
        if self.mps is None:
            return
        recorded = entry.mps
        daemon = _daemon(entry.uid, recorded) if recorded is not None else self.mps.found(entry.uid)
        if daemon is not None:
            self.mps.stop(daemon)  # and removes its directories and Pod
        elif self.mps.directory(entry.uid).exists():
            # what a crash left (a Pod is only made after its directory, and removed before
            # it): a claim that never had a daemon costs no API call
            self.mps.remove(entry.uid)

    def _restore_power(self, d: PreparedDevice, milliwatts: int) -> None:
        """Set a capped GPU's power limit back to ``milliwatts``, the one recorded before the
        cap; raises SharingError when it cannot (the claim keeps its record, and its GPU)."""
        if self.power is None:
            raise SharingError(
                f"{d.device}: its power limit was capped, and setting it back needs NVML, which"
                " this agent does not have",
                "power_limit_error",
            )
        index = self.gpus().get(d.gpu_uuid)
        if index is None:  # the GPU is gone: its limit went with it (a new one boots default)
            self.log.warning(
                "a capped GPU is gone; nothing to set back",
                extra=fields_(device=d.device, gpu_uuid=d.gpu_uuid),
            )
            return
        self.power.set(d.device, index, milliwatts, "restore")

    # -- what survives (rebuilding a lost checkpoint: dra_driver/kubeletplugin/rebuild.py)
    # ------------------
    def mig_instance(self, device: AdvertisedDevice) -> MigInstance | None:
        """The MIG device at a dynamic placement, if it exists (None in static mode)."""
        return None if self.mig is None else self.mig.found(device)

    def mps_daemon(self, uid: str) -> MpsDaemon | None:
        """Claim ``uid``'s MPS control daemon, if it still runs (its PID file, a live
        ``nvidia-cuda-mps-control`` process with that PID, and its start time)."""
        return None if self.mps is None else self.mps.found(uid)

    def mps_pipe_dir(self, uid: str) -> str | None:
        """Where claim ``uid``'s MPS daemon has its pipe directory (None: no MPS here)."""
        return None if self.mps is None else str(self.mps.directory(uid) / "pipe")

    # -- start -------------------------------------------------------------------------------
    def sweep(self, cp: Checkpoint) -> None:
        """Destroy what no claim of ``cp`` owns: dynamic MIG instances (dynamic mode only), MPS
        daemons (by directory), GPUs bound to vfio-pci and vGPUs (``VmSteps.sweep``)."""
        if self.mig is not None:
            sweep_mig(self.mig, self.gpus(), cp, self.log)
        if self.mps is not None:
            sweep_mps(self.mps, cp, self.log)
        self.vm.sweep(cp)

    def restore(self, entry: ClaimEntry) -> ClaimEntry:
        """Make a completed claim's partitions, settings and daemon what its record says (after
        a crash, a restart, or a change behind the agent's back); the entry as it is now (a MIG
        device made again has new ids, a daemon started again a new PID)."""
        if entry.state != PREPARE_COMPLETED:
            return entry
        devices = tuple(self._restore_mig(self.vm.restore(d)) for d in entry.devices)
        moved = devices != entry.devices
        entry = replace(entry, devices=tuple(self._recap(d) for d in devices))
        for d in entry.devices:
            if d.sharing == TIME_SLICING and d.interval is not None and self.settings is not None:
                self.settings.compute_mode(d.gpu_uuid, "DEFAULT")
                self.settings.timeslice(d.gpu_uuid, d.interval)
            if d.kind == "gpu" and d.sharing in (MPS, MEMORY_SHARE) and self.settings is not None:
                # as _start_mps sets it: an unprepare cut short after its undo, or a GPU reset
                # while the agent was down, left the GPU in another mode
                mode = "DEFAULT" if d.sharing == MEMORY_SHARE else "EXCLUSIVE_PROCESS"
                self.settings.compute_mode(d.gpu_uuid, mode)
        if entry.mps is None or self.mps is None:
            return entry
        daemon = _daemon(entry.uid, entry.mps)
        if self.mps.alive(daemon) and not moved:
            self.log.info(
                "adopted a running MPS daemon",
                extra=fields_(claim_uid=entry.uid, pid=entry.mps.pid),
            )
            return entry
        self.mps.stop(daemon)  # gone, or serving MIG devices that were made again
        uuids = tuple(
            (d.mig_uuid or d.gpu_uuid) for d in entry.devices if d.sharing in (MPS, MEMORY_SHARE)
        )
        renamed = dict(zip(entry.mps.devices, uuids, strict=False))
        pinned = {renamed.get(u, u): b for u, b in entry.mps.pinned}
        started = self.mps.start(
            entry.uid,
            MpsSettings(
                devices=uuids or entry.mps.devices,
                active_thread_percentage=entry.mps.thread_percentage,
                pinned_memory_limits=pinned,
            ),
        )
        self.log.warning(
            "started the MPS daemon of a prepared claim again (it was gone)",
            extra=fields_(claim_uid=entry.uid, pid=started.pid),
        )
        return replace(
            entry,
            mps=replace(
                entry.mps,
                pid=started.pid,
                started_at=started.started_at,
                devices=started.devices,
                pinned=tuple(sorted(pinned.items())),
            ),
        )

    def _recap(self, d: PreparedDevice) -> PreparedDevice:
        """A completed claim's power cap, set again if the GPU lost it (a GPU reset or driver
        reload while the agent was down). A record with no limit to set back (rebuilt after a
        lost checkpoint) gets NVML's default limit, the one the GPU boots with: the limit it
        had before the cap is not known any more (the cap may be what it has now)."""
        limit = d.power_limit_mw
        if limit is None or self.power is None:
            return d
        index = self.gpus().get(d.gpu_uuid)
        if index is None:
            return d
        if d.power_restore_mw is None:
            d = replace(d, power_restore_mw=self.power.default(d.device, index))
        if self.power.current(d.device, index) != limit:
            self.power.set(d.device, index, limit, "cap again")
            self.log.warning(
                "set the power cap of a prepared claim again (the GPU had lost it)",
                extra=fields_(device=d.device, gpu=index),
            )
        return d

    def _restore_mig(self, d: PreparedDevice) -> PreparedDevice:
        """A completed claim's dynamic MIG device, made again if it is gone."""
        if d.placement is None or self.mig is None:
            return d
        try:
            advertised = self.devices().device(d.device)
        except KeyError:
            raise SharingError(
                f"{d.device}: the node no longer advertises this placement; cannot make its MIG"
                " device again"
            ) from None
        inst = self.mig.ensure(advertised)
        if (inst.uuid, inst.gpu_instance_id, inst.compute_instance_id) == (
            d.mig_uuid,
            d.gpu_instance_id,
            d.compute_instance_id,
        ):
            return d
        self.log.warning(
            "made the MIG device of a prepared claim again (it was gone)",
            extra=fields_(device=d.device, uuid=inst.uuid),
        )
        return replace(
            d,
            mig_uuid=inst.uuid,
            gpu_instance_id=inst.gpu_instance_id,
            compute_instance_id=inst.compute_instance_id,
        )
