"""Which driver a PCI function is bound to, and changing it, as NVIDIA's own scripts do.

Sources (docs/gpu-facts.md, "GPUs for virtual machines"):
- sysfs-bus-pci (Documentation/ABI/testing/sysfs-bus-pci): ``driver_override`` lets only the
  named driver bind, does not unbind the current one, and an empty write clears it;
  ``drivers/<drv>/bind`` and ``unbind`` take the function's ``DDDD:BB:DD.F`` address.
- vfio.rst (Documentation/driver-api/vfio.rst): the IOMMU group is VFIO's unit; its members are
  ``kernel/iommu_groups/<N>/devices``.
- NVIDIA/k8s-dra-driver-gpu ``scripts/unbind_from_driver.sh``: before unbinding ``nvidia`` take
  ``/proc/driver/nvidia/gpus/<BDF>/unbindLock`` (write 1, read back 1), 5 tries, waiting
  ``attempt`` seconds after a failed one; a GPU without that file is unbound at once.
  ``scripts/bind_to_driver.sh``: write the driver to ``driver_override``, then the address to
  ``drivers/<drv>/bind``; clear the override again when the bind fails.

Every write goes through the :data:`KernelWrite` given (the real kernel's or the simulator's);
reads go to ``sys_root`` and ``driver_root`` directly."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from agent.pcihost import attrs
from agent.pcihost.errors import PciHostError, kernel_answer, write_failed
from agent.pcihost.vm_types import NVIDIA, VFIO_PCI, KernelWrite

UNBIND_LOCK_TRIES = 5
"""As NVIDIA's ``unbind_from_driver.sh``."""
CLEAR_OVERRIDE = "\n"
"""What clears ``driver_override``: an empty line (``echo > driver_override``)."""


class PciBinding:
    """Read and change the driver binding of PCI functions.

    ``driver_root`` is where the NVIDIA driver's ``/proc/driver/nvidia`` is seen; ``sleep`` waits
    between unbind-lock tries (a test passes a fake)."""

    def __init__(
        self,
        sys_root: Path,
        driver_root: Path,
        write: KernelWrite,
        *,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.sys_root = sys_root
        self.driver_root = driver_root
        self._write = write
        self._sleep = sleep

    def driver(self, bdf: str) -> str | None:
        """The driver bound to ``bdf`` now, None when unbound."""
        return attrs.bound_driver(self.sys_root, bdf)

    def override(self, bdf: str) -> str | None:
        """``bdf``'s ``driver_override``, None when unset."""
        return attrs.driver_override(self.sys_root, bdf)

    def iommu_group(self, bdf: str) -> int | None:
        """``bdf``'s IOMMU group, None without an IOMMU."""
        return attrs.iommu_group(self.sys_root, bdf)

    def group_members(self, bdf: str) -> tuple[str, ...]:
        """Every function of ``bdf``'s IOMMU group (``bdf`` included), sorted; empty without
        an IOMMU."""
        group = self.iommu_group(bdf)
        return () if group is None else attrs.group_devices(self.sys_root, group)

    def unbind_lock_path(self, bdf: str) -> Path:
        return self.driver_root / "proc" / "driver" / "nvidia" / "gpus" / bdf / "unbindLock"

    def unbind(self, bdf: str) -> None:
        """Unbind ``bdf`` from the driver it has; nothing when it has none (idempotent). From
        ``nvidia``, NVIDIA's unbind lock is taken first (module docstring); PciHostError when
        it cannot be (a process still uses the GPU) or the kernel refuses the unbind."""
        current = self.driver(bdf)
        if current is None:
            return
        if current == NVIDIA:
            self._take_unbind_lock(bdf)
        path = self.sys_root / "bus" / "pci" / "drivers" / current / "unbind"
        try:
            self._write(path, bdf)
        except OSError as exc:
            raise write_failed(path, bdf, exc, f"unbind {bdf} from {current}") from exc

    def _take_unbind_lock(self, bdf: str) -> None:
        lock = self.unbind_lock_path(bdf)
        if not lock.exists():  # as NVIDIA's script: a driver without the lock file
            return
        answer = ""
        for attempt in range(1, UNBIND_LOCK_TRIES + 1):
            try:
                self._write(lock, "1")
                value = attrs.read_text(lock)
                if value == "1":
                    return
                answer = f"read back {value!r}, not '1'"
            except OSError as exc:
                answer = f"the kernel answered {kernel_answer(exc)}"
            if attempt < UNBIND_LOCK_TRIES:
                self._sleep(attempt)
        raise PciHostError(
            f"cannot take NVIDIA's unbind lock of GPU {bdf}: writing '1' to {lock}"
            f" {UNBIND_LOCK_TRIES} times, the last {answer}; a process still uses the GPU"
            " (nvidia-persistenced, a monitoring agent, a container)",
            path=lock,
            value="1",
        )

    def bind(self, bdf: str, driver: str) -> None:
        """Bind the unbound function ``bdf`` to ``driver`` through ``driver_override`` (module
        docstring); nothing when it is bound to ``driver`` already (idempotent). The override
        stays set after the bind, so that no other driver takes the function at a re-probe
        (:meth:`release_override` clears it); a failed bind clears it again.

        PciHostError when ``bdf`` is bound to another driver (:meth:`unbind` first), when
        ``driver`` is not loaded (no ``bus/pci/drivers/<driver>``), or when the kernel refuses."""
        current = self.driver(bdf)
        if current == driver:
            return
        if current is not None:
            raise PciHostError(
                f"cannot bind {bdf} to {driver}: it is bound to {current}; unbind it first",
                value=driver,
            )
        drivers = self.sys_root / "bus" / "pci" / "drivers" / driver
        if not drivers.is_dir():
            hint = " (modprobe vfio-pci on the host)" if driver == VFIO_PCI else ""
            raise PciHostError(
                f"cannot bind {bdf} to {driver}: the driver is not loaded, {drivers} does not"
                f" exist{hint}",
                path=drivers,
                value=driver,
            )
        override = attrs.function_dir(self.sys_root, bdf) / "driver_override"
        try:
            self._write(override, driver)
        except OSError as exc:
            raise write_failed(override, driver, exc, f"let only {driver} bind {bdf}") from exc
        bind = drivers / "bind"
        try:
            self._write(bind, bdf)
        except OSError as exc:
            self._clear_override_after_failure(bdf)
            raise write_failed(
                bind, bdf, exc, f"bind {bdf} to {driver}; its driver_override was cleared again"
            ) from exc
        now = self.driver(bdf)
        if now != driver:
            self._clear_override_after_failure(bdf)
            raise PciHostError(
                f"writing {bdf!r} to {bind} succeeded but {bdf} is bound to"
                f" {now or 'no driver'}, not {driver}; its driver_override was cleared again",
                path=bind,
                value=bdf,
            )

    def _clear_override_after_failure(self, bdf: str) -> None:
        path = attrs.function_dir(self.sys_root, bdf) / "driver_override"
        try:
            self._write(path, CLEAR_OVERRIDE)
        except OSError:  # the bind's error is the one to report; the override is read again
            return

    def release_override(self, bdf: str) -> None:
        """Clear ``bdf``'s ``driver_override`` (an empty write, sysfs-bus-pci); nothing when it
        is unset (idempotent). The binding itself does not change."""
        if self.override(bdf) is None:
            return
        path = attrs.function_dir(self.sys_root, bdf) / "driver_override"
        try:
            self._write(path, CLEAR_OVERRIDE)
        except OSError as exc:
            raise write_failed(path, CLEAR_OVERRIDE, exc, f"clear {bdf}'s override") from exc
