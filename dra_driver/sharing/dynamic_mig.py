"""Dynamic MIG: the MIG device a claim was allocated is created when it is prepared, at exactly
the allocated placement, and destroyed when it is unprepared.

The placement device (``gpu-<minor>-mig-<profile>-<id>-<start>``) names the GPU, the profile and
the placement start. Creating it (``ensure``):

1. MIG mode on: an Ampere GPU needs a reset for that (the claim is refused, saying so; such a
   GPU does not advertise placements while MIG is off), a Hopper or newer one switches now;
2. the GPU instance at the placement, unless one of the profile is already there (a prepare that
   crashed after creating it): it is adopted; crash point ``after-gi-create``;
3. its default compute instance, unless it has one; crash point ``after-ci-create``;
4. the MIG device's UUID and the instance ids, for the CDI spec and the checkpoint.

Every step can be found again by placement, so a crash between any two leaves nothing that the
next prepare (or the start's sweep) does not find. A whole GPU handed out in dynamic mode must
have no MIG instances (``free_whole_gpu``); on Hopper and newer MIG mode is turned off when idle.

Every change to a GPU's MIG devices or mode (made, destroyed, switched, also when a later step
fails) is told to ``changed`` with the GPU's NVML index before the call returns: the composition
root re-reads that GPU, so telemetry and the inventory see the new MIG devices from the next
sampler tick, not only at the next rediscovery.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from agent.logs import fields_
from agent.nvml.errors import NvmlError
from agent.nvml.mig import MigControl, mode_switch_needs_reset
from agent.nvml.types import MigInstance
from dra_driver.device_model import AdvertisedDevice
from dra_driver.errors import SharingError

CrashHook = Callable[[str], None]
Changed = Callable[[int], None]
"""Told the NVML index of a GPU whose MIG devices or MIG mode this module changed."""


def _architecture(device: AdvertisedDevice) -> str:
    value = dict(device.attributes).get("architecture", {}).get("string")
    return str(value or "")


class DynamicMig:
    """Creates and destroys the MIG devices of dynamic placements (see the module docstring)."""

    def __init__(
        self,
        control: MigControl,
        log: logging.Logger,
        crash_hook: CrashHook = lambda point: None,
        changed: Changed = lambda index: None,
    ) -> None:
        self.control = control
        self.log = log
        self.crash = crash_hook
        self._changed = changed

    def _tell(self, index: int) -> None:
        """``changed(index)``; its failure is logged: the MIG change itself has been made."""
        try:
            self._changed(index)
        except Exception:
            self.log.exception("telling a MIG change failed", extra=fields_(gpu=index))

    def ensure(self, device: AdvertisedDevice) -> MigInstance:
        """The MIG device of placement ``device``, created if it does not exist. Raises
        SharingError (reason ``mig_reset_required``, ``mig_error``)."""
        profile, start, size = _placement(device)
        index = device.gpu_index
        changed = False
        try:
            changed = self._mig_on(device)
            found = self.control.find(index, profile, start)
            if found is None:
                changed = True  # from the call on: a failure may leave an instance made
                gi_id = self.control.create_gpu_instance(index, profile, start, size)
                self.crash("after-gi-create")
            else:
                gi_id = found.gpu_instance_id
            # a GPU instance just made has no compute instance yet: nothing to look up
            existing = self.control.compute_instances(index, gi_id) if found else ()
            if existing:
                inst = existing[0]
            else:
                changed = True
                ci_id = self.control.create_compute_instance(index, gi_id)
                self.crash("after-ci-create")
                inst = self.control.mig_device(index, gi_id, ci_id)
        except NvmlError as exc:
            raise SharingError(
                f"{device.name}: cannot create the MIG device: {exc}", "mig_error"
            ) from exc
        finally:
            if changed:
                self._tell(index)
        self.log.info(
            "created MIG device",
            extra=fields_(
                device=device.name, gpu=index, gpu_instance=inst.gpu_instance_id, uuid=inst.uuid
            ),
        )
        return inst

    def _mig_on(self, device: AdvertisedDevice) -> bool:
        """MIG mode on for ``device``'s GPU; True when this call switched it."""
        mode = self.control.mode(device.gpu_index)
        if mode is None or mode.current:
            return False
        if mode_switch_needs_reset(_architecture(device)):
            raise SharingError(
                f"{device.name}: GPU {device.gpu_index} has MIG mode off, and turning it on"
                f" needs a GPU reset on {_architecture(device)} GPUs; enable MIG mode (and reset"
                " the GPU) first, or use the whole GPU",
                "mig_reset_required",
            )
        if not self.control.set_mode(device.gpu_index, True):
            raise SharingError(
                f"{device.name}: GPU {device.gpu_index} did not switch MIG mode on (pending a"
                " reset)",
                "mig_reset_required",
            )
        self.log.info("turned MIG mode on", extra=fields_(gpu=device.gpu_index))
        return True

    def found(self, device: AdvertisedDevice) -> MigInstance | None:
        """The MIG device at placement ``device`` if one exists (its GPU instance and that
        instance's first compute instance), else None; creates nothing. Raises SharingError."""
        profile, start, _ = _placement(device)
        try:
            gi = self.control.find(device.gpu_index, profile, start)
            if gi is None:
                return None
            existing = self.control.compute_instances(device.gpu_index, gi.gpu_instance_id)
        except NvmlError as exc:
            raise SharingError(f"{device.name}: cannot read its MIG device: {exc}") from exc
        return existing[0] if existing else None

    def release(self, name: str, gpu_index: int, profile: int, start: int) -> bool:
        """Destroy the MIG device of profile ``profile`` at placement ``start`` on GPU
        ``gpu_index`` (compute instances first); True if there was one. Idempotent. ``name``
        says whose it was, for the log and errors."""
        try:
            found = self.control.find(gpu_index, profile, start)
            if found is None:
                return False
            try:
                self.control.destroy(gpu_index, found.gpu_instance_id)
            finally:  # a failed destroy may have destroyed its compute instances
                self._tell(gpu_index)
        except NvmlError as exc:
            raise SharingError(
                f"{name}: cannot destroy the MIG device: {exc}", "mig_error"
            ) from exc
        self.log.info(
            "destroyed MIG device",
            extra=fields_(
                device=name,
                gpu=gpu_index,
                gpu_instance=found.gpu_instance_id,
                profile=profile,
                placement_start=start,
            ),
        )
        return True

    def free_whole_gpu(self, device: AdvertisedDevice) -> None:
        """Before a whole GPU is handed out in dynamic mode: no MIG instance may live on it
        (SharingError naming them); a Hopper or newer GPU in MIG mode leaves it."""
        index = device.gpu_index
        try:
            instances = self.control.gpu_instances(index)
            if instances:
                where = ", ".join(
                    f"profile {g.profile_id} at {g.placement.start}" for g in instances
                )
                raise SharingError(
                    f"{device.name}: GPU {index} still has MIG instances ({where}); a whole GPU"
                    " needs none",
                    "mig_in_use",
                )
            mode = self.control.mode(index)
            if mode is not None and mode.current:
                if mode_switch_needs_reset(_architecture(device)):
                    raise SharingError(
                        f"{device.name}: GPU {index} is in MIG mode and leaving it needs a GPU"
                        f" reset on {_architecture(device)} GPUs",
                        "mig_reset_required",
                    )
                try:
                    self.control.set_mode(index, False)
                finally:
                    self._tell(index)
                self.log.info("turned MIG mode off for a whole-GPU claim", extra=fields_(gpu=index))
        except NvmlError as exc:
            raise SharingError(f"{device.name}: cannot check MIG on GPU {index}: {exc}") from exc

    def strays(self, index: int, owned: set[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """GPU instances of GPU ``index`` no claim owns: (gpu instance id, profile, start), where
        ``owned`` holds the (profile, start) pairs that completed claims hold."""
        return [
            (g.gpu_instance_id, g.profile_id, g.placement.start)
            for g in self.control.gpu_instances(index)
            if (g.profile_id, g.placement.start) not in owned
        ]


def _placement(device: AdvertisedDevice) -> tuple[int, int, int]:
    if (
        device.kind != "mig"
        or device.mig_profile_id is None
        or device.mig_placement_start is None
        or device.mig_placement_size is None
    ):
        raise SharingError(f"{device.name} is not a dynamic MIG placement")
    return device.mig_profile_id, device.mig_placement_start, device.mig_placement_size
