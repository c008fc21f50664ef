"""A whole GPU handed to a virtual machine through VFIO (docs/gpu-facts.md, "GPUs for virtual
machines"; the order of operations is NVIDIA's, from its vGPU/passthrough documentation and the
kernel's vfio-pci ``driver_override`` interface).

Prepare (the kubelet plugin's ``effects`` drives it):

1. ``check``: no process may hold ``/dev/nvidia<minor>`` (the error names each pid and command);
   the GPU must have an IOMMU group, and every function of that group must be the GPU's own (same
   bus and device, any function: the GPU and its audio function); a foreign one is named and
   refused (VFIO hands over the whole group);
2. ``functions``: every function of the group with the driver it has now: the plan recorded
   durably (``PrepareStarted``) BEFORE anything changes;
3. persistence mode off (NVML), where the driver allows; ``handing`` told (telemetry stops
   reading the GPU);
4. ``take``: each function unbound (crash point ``after-vfio-unbind``) and bound to vfio-pci
   through its ``driver_override`` (crash point ``after-vfio-bind``). Each step is idempotent and
   readable again from sysfs, so a crash anywhere is repaired by ``give_back`` from the record.
   Then ``handed`` is told (the inventory is read again: the GPU left NVML, whose indexes
   shifted).

Unprepare and rollback (``give_back``): each function back to the driver it had (unbound from
vfio-pci: crash point ``after-unprepare-vfio-unbind``, the function on no driver), its override
cleared; then the GPU must be seen by NVML again (polled, bounded by ``timeout_s``, on an
injected clock and sleep), and ``rebound`` is told its BDF so that the inventory is read again
and the GPU advertised for containers again.

**One GPU leaves or rejoins nvidia at a time.** Finding a GPU in NVML's enumeration (for
persistence mode, and to see it back) reads every index, and the indexes shift while another
GPU leaves or rejoins the nvidia driver: a batch handing several GPUs over at once read a
neighbour mid-unbind as lost and failed its claim (the crash matrix's
``passthrough/after-started/batch``). So the scans and the nvidia unbinds and binds hold one
lock (``enumeration``); the rest (vfio-pci binds, the other functions) runs in parallel.

The start (``strays``): a GPU of the node's VM devices bound to vfio-pci with
``driver_override`` ``vfio-pci`` that no claim records goes back to nvidia (its other functions
are released from vfio-pci; the driver they had is not known).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from agent.errors import TesseraError
from agent.logs import fields_
from agent.pcihost.vm_types import NVIDIA, VFIO_PCI
from dra_driver.errors import SharingError
from dra_driver.vm.host_tools import Binding, FindHolders

CrashHook = Callable[[str], None]


def same_device(bdf: str, gpu: str) -> bool:
    """Whether ``bdf`` is a function of the same PCI device as ``gpu`` (``0000:1b:00.1`` of
    ``0000:1b:00.0``): domain, bus and device equal."""
    return bdf.rsplit(".", 1)[0] == gpu.rsplit(".", 1)[0]


class Passthrough:
    """Binds a GPU's IOMMU group to vfio-pci and back (see the module docstring)."""

    def __init__(
        self,
        *,
        binding: Binding,
        holders: FindHolders,
        proc_root: Path,
        dev_root: Path,
        sys_root: Path,
        persistence_off: Callable[[str], None],
        visible: Callable[[str], bool],
        rebound: Callable[[str], None],
        log: logging.Logger,
        crash_hook: CrashHook = lambda point: None,
        handing: Callable[[str], None] = lambda bus_id: None,
        handed: Callable[[str], None] = lambda bus_id: None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        timeout_s: float = 60.0,
        poll_s: float = 0.5,
    ) -> None:
        """``holders(proc_root, paths)`` finds the processes that hold a device node;
        ``dev_root`` holds ``dev/nvidia<minor>`` as the host's processes open it;
        ``persistence_off(bus_id)`` turns the GPU's persistence mode off (a no-op where the
        driver does not support it); ``visible(bus_id)`` says whether NVML enumerates the GPU;
        ``rebound(bus_id)`` is told a GPU given back to nvidia (the inventory is read again);
        ``handing(bus_id)`` is told before a GPU's functions leave their drivers (telemetry stops
        reading it: its reads fail from then on, and that is no loss) and ``handed(bus_id)``
        once they are on vfio-pci (the inventory is read again: NVML's indexes shifted)."""
        self._binding = binding
        self._holders = holders
        self._proc_root = proc_root
        self._dev_root = dev_root
        self._sys_root = sys_root
        self._persistence_off = persistence_off
        self._visible = visible
        self._rebound = rebound
        self._handing = handing
        self._handed = handed
        self._log = log
        self._crash = crash_hook
        self._clock = clock
        self._sleep = sleep
        self._timeout_s = timeout_s
        self._poll_s = poll_s
        self._enumeration = threading.Lock()
        """Held while NVML's enumeration is read or changed (see the module docstring)."""

    # -- prepare ---------------------------------------------------------------------------
    def functions(self, device: str, bus_id: str, minor: int) -> tuple[tuple[str, str], ...]:
        """What prepare will rebind: (BDF, driver it has now, "" for none) of every function of
        the GPU's IOMMU group, the GPU first; the GPU itself is recorded as nvidia's whatever it
        has now (a leftover vfio-pci binding goes back to nvidia). Raises SharingError when a
        process holds the GPU (``gpu_in_use``), the GPU has no IOMMU group (``no_iommu``) or
        the group holds a foreign function (``iommu_group_shared``)."""
        node = self._dev_root / "dev" / f"nvidia{minor}"
        try:
            found = list(self._holders(self._proc_root, [node]))
            group = self._binding.iommu_group(bus_id)
            members = self._binding.group_members(bus_id) if group is not None else ()
            drivers = {m: self._binding.driver(m) or "" for m in members}
        except (TesseraError, OSError) as exc:
            raise SharingError(f"{device}: cannot read GPU {bus_id}: {exc}", "vfio_error") from exc
        if found:
            who = ", ".join(f"pid {h.pid} ({h.name})" for h in found)
            raise SharingError(
                f"{device}: GPU {bus_id} is in use by {who} holding {node}; stop them (or"
                " their pods) before the GPU can be handed to a virtual machine",
                "gpu_in_use",
            )
        if group is None:
            raise SharingError(
                f"{device}: GPU {bus_id} has no IOMMU group (the IOMMU is off: boot with"
                " intel_iommu=on or amd_iommu=on); VFIO cannot hand it to a virtual machine",
                "no_iommu",
            )
        foreign = [m for m in members if not same_device(m, bus_id)]
        if foreign:
            raise SharingError(
                f"{device}: IOMMU group {group} of GPU {bus_id} also holds {', '.join(foreign)},"
                " which is not a function of the GPU; VFIO hands over the whole group, so the"
                " GPU cannot be handed to a virtual machine (move the device or enable ACS)",
                "iommu_group_shared",
            )
        others = sorted(m for m in members if m != bus_id)
        had = drivers.get(bus_id, "")
        gpu = NVIDIA if had in ("", VFIO_PCI) else had
        return ((bus_id, gpu), *((m, drivers[m]) for m in others))

    def take(self, device: str, bus_id: str, functions: Sequence[tuple[str, str]]) -> None:
        """Persistence mode off, then every function of ``functions`` bound to vfio-pci
        (idempotent: a function bound to it already is left). Raises SharingError."""
        try:
            with self._enumeration:
                self._persistence_off(bus_id)
            self._tell(self._handing, bus_id)
            for bdf, _ in functions:
                if self._binding.driver(bdf) == VFIO_PCI:
                    continue
                with self._enumeration:  # leaving nvidia shifts the indexes after it
                    self._binding.unbind(bdf)
                self._crash("after-vfio-unbind")
                self._binding.bind(bdf, VFIO_PCI)
                self._crash("after-vfio-bind")
        except (TesseraError, OSError) as exc:
            raise SharingError(
                f"{device}: cannot bind GPU {bus_id} to vfio-pci: {exc}", "vfio_error"
            ) from exc
        self._tell(self._handed, bus_id)
        self._log.info(
            "bound a GPU to vfio-pci for a virtual machine",
            extra=fields_(device=device, bus_id=bus_id, functions=[f for f, _ in functions]),
        )

    # -- unprepare, rollback ---------------------------------------------------------------
    def give_back(self, device: str, bus_id: str, functions: Sequence[tuple[str, str]]) -> None:
        """Every function back to the driver it had (none: unbound, its override cleared),
        then wait until NVML sees the GPU again and tell ``rebound``. Idempotent. Raises
        SharingError (``vfio_error``; ``gpu_not_back`` when NVML does not see it in time)."""
        if not functions:
            return  # recorded before its functions were: nothing was changed
        # the GPU comes back into NVML's enumeration: the indexes after it shift (as when it left)
        self._tell(self._handing, bus_id)
        try:
            for bdf, had in functions:
                now = self._binding.driver(bdf)
                if now != (had or None):
                    if now is not None:
                        self._binding.unbind(bdf)
                        self._crash("after-unprepare-vfio-unbind")
                    if had:
                        with self._enumeration:  # rejoining nvidia shifts the indexes
                            self._binding.bind(bdf, had)
                self._binding.release_override(bdf)  # also one a crash inside bind left
        except (TesseraError, OSError) as exc:
            raise SharingError(
                f"{device}: cannot bind GPU {bus_id} back to its drivers: {exc}", "vfio_error"
            ) from exc
        if dict(functions).get(bus_id) == NVIDIA:
            self._wait_visible(device, bus_id)
        self._tell(self._rebound, bus_id)
        self._log.info(
            "gave a GPU back to the host from a virtual machine",
            extra=fields_(device=device, bus_id=bus_id),
        )

    def _wait_visible(self, device: str, bus_id: str) -> None:
        deadline = self._clock() + self._timeout_s
        while True:
            try:
                with self._enumeration:
                    if self._visible(bus_id):
                        return
            except (TesseraError, OSError) as exc:
                self._log.info("NVML cannot list GPUs yet", extra=fields_(error=str(exc)))
            if self._clock() >= deadline:
                raise SharingError(
                    f"{device}: GPU {bus_id} is bound to nvidia again, but NVML does not see it"
                    f" after {self._timeout_s:g} s (check dmesg for the driver's errors; the"
                    " claim stays held and the kubelet's retry waits again)",
                    "gpu_not_back",
                )
            self._sleep(self._poll_s)

    def _tell(self, listener: Callable[[str], None], bus_id: str) -> None:
        try:
            listener(bus_id)
        except Exception:  # the binding is what it is; the next rediscovery reads it
            self._log.exception("telling a GPU's rebinding failed", extra=fields_(bus_id=bus_id))

    # -- start -----------------------------------------------------------------------------
    def override(self, bdf: str) -> str | None:
        """The function's ``driver_override`` (None when unset: Linux prints ``(null)``)."""
        path = self._sys_root / "bus" / "pci" / "devices" / bdf / "driver_override"
        try:
            value = path.read_text().strip()
        except OSError:
            return None
        return None if value in ("", "(null)") else value

    def stray(self, bus_id: str) -> bool:
        """Whether GPU ``bus_id`` is bound to vfio-pci through its override (a prepare's
        doing; a GPU an administrator bound to vfio-pci otherwise is left alone)."""
        try:
            return self._binding.driver(bus_id) == VFIO_PCI and self.override(bus_id) == VFIO_PCI
        except (TesseraError, OSError):
            return False

    def release_stray(self, bus_id: str) -> None:
        """Give a stray GPU back to nvidia; its other functions bound to vfio-pci through their
        override are released (left unbound: the driver they had is not recorded)."""
        try:
            members = self._binding.group_members(bus_id)
        except (TesseraError, OSError) as exc:
            raise SharingError(f"GPU {bus_id}: cannot read its IOMMU group: {exc}") from exc
        mine = [m for m in members if same_device(m, bus_id) and m != bus_id and self.stray(m)]
        self.give_back(f"stray GPU {bus_id}", bus_id, [(bus_id, NVIDIA), *((m, "") for m in mine)])
