"""The simulated node's kernel for sysfs writes: :class:`SimPciKernel`, whose :meth:`write` is a
:data:`agent.pcihost.vm_types.KernelWrite` doing what Linux (and NVIDIA's driver) do.

Each write is one atomic update of the VM state (:mod:`agent.sim.vmstate`, under its lock: a
``kill -9`` leaves it done or not done), then the sysfs tree and the driver root's VM entries are
rewritten from the state (:mod:`agent.sim.sysfs_vm`; a node opened again rewrites them too) and
the uevents the kernel sends for a driver's unbind/bind go to the simulated udev
(:func:`agent.sim.udev.emit_events`). Errors are ``OSError`` with the errno Linux answers:

* ``drivers/<drv>/bind`` (drivers/base/bus.c ``bind_store``): ENODEV when no such device or the
  driver does not match it (PCI matching honours ``driver_override``: with it set only that
  driver matches; without it ``nvidia`` matches NVIDIA GPUs, ``vfio-pci`` nothing, as it has no
  static id table); EBUSY when a driver is bound already (``__driver_probe_device``).
* ``drivers/<drv>/unbind`` (``unbind_store``): ENODEV unless the device is bound to ``drv``.
  ``nvidia`` on a GPU refuses (EBUSY) until its unbind lock is taken. The real driver does not
  fail the write: the driver core's remove callback cannot, and NVIDIA's ``nv_pci_remove``
  (open-gpu-kernel-modules ``kernel-open/nvidia/nv-pci.c``) waits, logging "Attempting to remove
  device ... with non-zero usage count", until the GPU's clients close; the unbind lock (taken
  only while no client has the GPU open, NVIDIA's ``unbind_from_driver.sh`` reads it back) is
  how callers avoid that wait. A write cannot block in the simulator, so it refuses instead.
* ``<driver root>/proc/driver/nvidia/gpus/<BDF>/unbindLock``: ``1`` takes the lock unless a
  process holds ``/dev/nvidia<minor>`` (then it stays ``0``: callers read it back), ``0``
  releases it, anything else EINVAL.
* ``driver_override`` (sysfs-bus-pci): the text without its newline; empty clears it; it does
  not bind or unbind anything.
* ``drivers_probe``: an unbound device gets the driver that matches it (ENODEV: no device).
* ``sriov_numvfs`` (sysfs-bus-pci; drivers/pci/iov.c ``sriov_numvfs_store``): EINVAL for a
  non-number, ERANGE above ``sriov_totalvfs``, ENOENT with no driver bound, EBUSY from a
  non-zero count to another non-zero one (write 0 first). Enabling makes the VFs (on
  ``nvidia``); disabling removes them, their vGPUs with them.
* ``nvidia/current_vgpu_type`` of a VF (NVIDIA vGPU 17+): EINVAL for a non-number or a type not
  in ``creatable_vgpu_types`` (which follows the homogeneous rule and the instance counts);
  EBUSY for a type on a VF that has one (clear it with ``0`` first: unverified whether the real
  driver accepts the same type again).
* ``mdev_supported_types/nvidia-<id>/create`` (sysfs-bus-vfio-mdev; drivers/vfio/mdev/
  mdev_core.c): EINVAL for a non-UUID, EEXIST for a UUID in use, EUSERS when the type has no
  available instance; ``bus/mdev/devices/<uuid>/remove``: ``1`` removes it (EINVAL: not a
  number; ``0``: nothing).
* A path the simulator does not know: EACCES (a read-only attribute); a file that does not exist
  now (a driver not loaded, a VF not enabled): ENOENT.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import uuid as uuidlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from agent.sim.model import GpuSlot
from agent.sim.nvml import FakeNvml
from agent.sim.pcifunction import SimFunction
from agent.sim.procfs import process_alive
from agent.sim.sysfs import pci_functions, rewrite_vm_part, write_sysfs
from agent.sim.sysfs_vm import UUID_RE, iommu_groups, next_group, vm_functions, write_vm_driver_root
from agent.sim.udev import emit_events, removed_buses
from agent.sim.vmstate import (
    FOREIGN_DRIVER,
    NVIDIA_DRIVER,
    VFIO_DRIVER,
    FunctionState,
    Mdev,
    VmState,
    available,
    creatable,
    parent_of_vf,
    sriov_total,
    vf_bus,
    vfs_of,
)

TREE_LOCK = "vm-tree.lock"
TREE_WRITING = "vm-tree.writing"
Change = Callable[[VmState], tuple[VmState, list[tuple[str, str, str]]]]
"""A pure change of the VM state, returning the uevents it causes: (action, bus, driver)."""


def _fail(code: int, path: Path, why: str) -> OSError:
    return OSError(code, f"{os.strerror(code)} ({why})", str(path))


class SimPciKernel:
    """The simulated kernel's answer to sysfs writes on one simulated node (see the module
    docstring). ``sysfs_root`` and ``driver_root`` are the trees it rewrites."""

    def __init__(self, fake: FakeNvml, sysfs_root: Path, driver_root: Path) -> None:
        self.fake = fake
        self.model = fake.model
        self.sysfs_root = Path(sysfs_root)
        self.driver_root = Path(driver_root)
        self._static = [f.bus for f in pci_functions(self.model)]
        own = fake.state_dir / "sys"
        self._own_tree = os.path.realpath(self.sysfs_root) == os.path.realpath(own)
        """The simulator's own tree, which every kernel of this node writes (the agent's, ``tessera
        sim fault``'s): only then is the tree known to be the last state's, and a write may
        change just its part (another root is rewritten whole, as a given tree may be any)."""

    # -- the trees -------------------------------------------------------------------------------
    def groups(self, state: VmState) -> dict[str, int]:
        return iommu_groups(self.model, state, self._static)

    def rewrite(self) -> None:
        """Rewrite the sysfs tree and the driver root's VM entries from the state now."""
        self.rewrite_sysfs()
        self.rewrite_driver_root()

    def rewrite_sysfs(self) -> None:
        write_sysfs(self.model, self.sysfs_root, removed_buses(self.fake), self.fake.vm_state)

    def rewrite_driver_root(self) -> None:
        """The unbind locks and ``/dev/vfio`` nodes under the driver root."""
        state = self.fake.vm_state
        write_vm_driver_root(self.driver_root, self.model, state, self.groups(state))

    def apply(self, change: Change) -> None:
        """One atomic state update, then the trees and the uevents it causes; under
        ``<sim dir>/vm-tree.lock`` so that the trees of concurrent writers end as the last
        state (the state's own lock covers only the update). The sysfs tree gets only what the
        change decides (:func:`agent.sim.sysfs.rewrite_vm_part`); ``<sim dir>/vm-tree.writing``
        stands while the trees are behind the state, so that the write after one that did not
        finish (a process killed in it) rewrites the whole tree."""
        seen: list[VmState] = []

        def recorded(s: VmState) -> tuple[VmState, list[tuple[str, str, str]]]:
            after, events = change(s)
            seen[:] = [s, after]
            return after, events

        with self._tree_lock():
            marker = self.fake.state_dir / TREE_WRITING
            behind = marker.exists()
            marker.touch()
            try:
                events = self.fake.update_vm(recorded)
            except BaseException:
                if not seen and not behind:
                    marker.unlink()  # refused: the state, and so the trees, did not change
                raise
            if behind or not seen or not self._own_tree:
                self.rewrite_sysfs()
            else:
                before, after = seen
                rewrite_vm_part(
                    self.model, self.sysfs_root, removed_buses(self.fake), before, after
                )
            self.rewrite_driver_root()
            marker.unlink()
        if events:
            emit_events(self.fake.state_dir, [self._uevent(*e) for e in events])

    @contextlib.contextmanager
    def _tree_lock(self) -> Iterator[None]:
        self.fake.state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.fake.state_dir / TREE_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    def _uevent(self, action: str, bus: str, driver: str) -> dict[str, str]:
        fn = self._function(bus)
        return {
            "ACTION": action,
            "SUBSYSTEM": "pci",
            "DEVPATH": "/devices/" + fn.rel_path,
            "PCI_ID": f"{fn.vendor:04X}:{fn.device:04X}",
            "PCI_SLOT_NAME": bus,
            "PCI_CLASS": f"{fn.pci_class:X}",
            "DRIVER": driver,
        }

    def _function(self, bus: str, state: VmState | None = None) -> SimFunction:
        state = state if state is not None else self.fake.vm_state
        removed = removed_buses(self.fake)
        for fn in (*pci_functions(self.model, removed), *vm_functions(self.model, state, removed)):
            if fn.bus == bus:
                return fn
        raise KeyError(bus)

    # -- the write ---------------------------------------------------------------------------------
    def write(self, path: Path, value: str) -> None:
        """Write ``value`` to the attribute at ``path`` as ``echo -n value > path`` would."""
        text = value[:-1] if value.endswith("\n") else value
        p = Path(os.path.abspath(path))
        real = Path(os.path.realpath(p))  # bus/pci/devices/<BDF>/..., bus/mdev/devices/<uuid>/...
        for root, handler in (
            (self.driver_root, self._driver_root_write),
            (self.sysfs_root, self._sysfs_write),
        ):
            base = Path(os.path.realpath(root))
            if real.is_relative_to(base):
                return handler(p, real.relative_to(base).parts, text)
        raise _fail(errno.EACCES, p, "not under the simulated sysfs tree or driver root")

    def _driver_root_write(self, path: Path, parts: tuple[str, ...], text: str) -> None:
        if (
            len(parts) == 6
            and parts[:4] == ("proc", "driver", "nvidia", "gpus")
            and (parts[5] == "unbindLock")
        ):
            return self._unbind_lock(path, parts[4], text)
        raise _fail(errno.EACCES, path, "not a writable attribute of the simulated driver")

    def _sysfs_write(self, path: Path, real: tuple[str, ...], text: str) -> None:
        if real[:3] == ("bus", "pci", "drivers") and len(real) == 5:
            return self._driver_file(path, real[3], real[4], text)
        if real == ("bus", "pci", "drivers_probe"):
            return self._probe(path, text)
        if real[:1] == ("devices",) and len(real) >= 3:
            if real[-1] == "driver_override":
                return self._override(path, real[-2], text)
            if real[-1] == "sriov_numvfs":
                return self._numvfs(path, real[-2], text)
            if real[-2:] == ("nvidia", "current_vgpu_type"):
                return self._vgpu_type(path, real[-3], text)
            if real[-1] == "create" and real[-3] == "mdev_supported_types":
                return self._mdev_create(path, real[-4], real[-2], text)
            if real[-1] == "remove" and UUID_RE.match(real[-2]):
                return self._mdev_remove(path, real[-2], text)
        if not Path(os.path.realpath(path)).exists():
            raise _fail(errno.ENOENT, path, "no such attribute now")
        raise _fail(errno.EACCES, path, "a read-only attribute")

    # -- drivers ---------------------------------------------------------------------------------
    def _loaded(self, state: VmState) -> set[str]:
        loaded = {NVIDIA_DRIVER} | ({VFIO_DRIVER} if state.vfio_loaded else set())
        return loaded | ({FOREIGN_DRIVER} if state.foreign else set())

    def _matches(self, s: VmState, fn: FunctionState, driver: str) -> bool:
        if fn.override is not None:
            return fn.override == driver
        if driver == NVIDIA_DRIVER:
            return (
                fn.bus in {g.bus for g in self.model.gpus}
                or parent_of_vf(self.model, fn.bus) is not None
            )
        return driver == FOREIGN_DRIVER and fn.bus in {b for b, _ in s.foreign}

    def _state(self) -> VmState:
        return self.fake.vm_state

    def _present(self, state: VmState, bus: str) -> FunctionState | None:
        fn = state.function(bus)
        if fn is None or bus in removed_buses(self.fake):
            return None
        return fn

    def _driver_file(self, path: Path, driver: str, name: str, bus: str) -> None:
        if name not in ("bind", "unbind"):
            raise _fail(errno.EACCES, path, "a read-only attribute")
        if driver not in self._loaded(self._state()):
            raise _fail(errno.ENOENT, path, f"driver {driver} is not loaded")
        if name == "bind":
            self.apply(lambda s: self._bind(s, path, driver, bus))
        else:
            self.apply(lambda s: self._unbind(s, path, driver, bus))

    def _bind(
        self, s: VmState, path: Path, driver: str, bus: str
    ) -> tuple[VmState, list[tuple[str, str, str]]]:
        fn = self._present(s, bus)
        if fn is None or not self._matches(s, fn, driver):
            raise _fail(errno.ENODEV, path, f"no device {bus!r} that {driver} matches")
        if fn.driver is not None:
            raise _fail(errno.EBUSY, path, f"{bus} is bound to {fn.driver}")
        return s.with_function(replace(fn, driver=driver)), [("bind", bus, driver)]

    def _unbind(
        self, s: VmState, path: Path, driver: str, bus: str
    ) -> tuple[VmState, list[tuple[str, str, str]]]:
        fn = self._present(s, bus)
        if fn is None or fn.driver != driver:
            raise _fail(errno.ENODEV, path, f"{bus!r} is not bound to {driver}")
        gpu = self._gpu(bus)
        if driver == NVIDIA_DRIVER and gpu is not None:
            if not fn.unbind_lock:
                raise _fail(errno.EBUSY, path, f"the unbind lock of {bus} is not taken")
            s = self._disable_vfs(s, gpu)  # the PF's driver disables SR-IOV on its way out
            s = replace(s, mdevs=tuple(m for m in s.mdevs if m.parent != bus))
        unbound = replace(fn, driver=None, unbind_lock=False, vgpu_type=0)
        return s.with_function(unbound), [("unbind", bus, driver)]

    def _probe(self, path: Path, bus: str) -> None:
        def change(s: VmState) -> tuple[VmState, list[tuple[str, str, str]]]:
            fn = self._present(s, bus)
            if fn is None:
                raise _fail(errno.ENODEV, path, f"no device {bus!r}")
            if fn.driver is not None:
                return s, []
            for driver in sorted(self._loaded(s)):
                if self._matches(s, fn, driver):
                    return s.with_function(replace(fn, driver=driver)), [("bind", bus, driver)]
            return s, []

        self.apply(change)

    def _override(self, path: Path, bus: str, text: str) -> None:
        def change(s: VmState) -> tuple[VmState, list[tuple[str, str, str]]]:
            fn = s.function(bus)
            if fn is None:
                raise _fail(errno.EACCES, path, f"the simulator manages no override of {bus}")
            return s.with_function(replace(fn, override=text or None)), []

        self.apply(change)

    def _gpu(self, bus: str) -> GpuSlot | None:
        return next((g for g in self.model.gpus if g.bus == bus), None)

    def _unbind_lock(self, path: Path, bus: str, text: str) -> None:
        gpu = self._gpu(bus)
        if text not in ("0", "1"):
            raise _fail(errno.EINVAL, path, f"unbindLock takes 0 or 1, got {text!r}")

        def change(s: VmState) -> tuple[VmState, list[tuple[str, str, str]]]:
            fn = s.function(bus)
            if gpu is None or fn is None or fn.driver != NVIDIA_DRIVER:
                raise _fail(errno.ENOENT, path, f"{bus} is not a GPU on the nvidia driver")
            take = text == "1" and not self.held(s, gpu)
            return s.with_function(replace(fn, unbind_lock=take)), []

        self.apply(change)

    def held(self, s: VmState, gpu: GpuSlot) -> bool:
        """Whether a live process holds ``/dev/nvidia<minor>`` of ``gpu`` (the simulator gives
        GPU ``i`` minor ``i``)."""
        return any(h.minor == gpu.index and process_alive(h.pid) for h in s.holders)

    # -- SR-IOV and vGPUs -----------------------------------------------------------------------
    def _disable_vfs(self, s: VmState, gpu: GpuSlot) -> VmState:
        return s.without_functions(set(vfs_of(self.model, s, gpu))).with_num_vfs(gpu.bus, 0)

    def _numvfs(self, path: Path, bus: str, text: str) -> None:
        gpu = self._gpu(bus)
        if gpu is None or not sriov_total(self.model, gpu):
            raise _fail(errno.EACCES, path, f"{bus} has no SR-IOV")
        try:
            n = int(text)
        except ValueError:
            raise _fail(errno.EINVAL, path, f"not a number: {text!r}") from None
        total = sriov_total(self.model, gpu)

        def change(s: VmState) -> tuple[VmState, list[tuple[str, str, str]]]:
            fn = self._present(s, bus)
            if n < 0 or n > total:
                raise _fail(errno.ERANGE, path, f"{n} VFs; sriov_totalvfs is {total}")
            if fn is None or fn.driver is None:
                raise _fail(errno.ENOENT, path, f"no driver bound to {bus}")
            now = s.num_vfs(bus)
            if n == now:
                return s, []
            if now and n:
                raise _fail(errno.EBUSY, path, f"{now} VFs already enabled; write 0 first")
            if n == 0:
                return self._disable_vfs(s, gpu), []
            s = s.with_num_vfs(bus, n)
            for i in range(n):
                s = s.with_function(FunctionState(vf_bus(bus, i), NVIDIA_DRIVER))
            return s, []

        self.apply(change)

    def _vgpu_type(self, path: Path, vf: str, text: str) -> None:
        try:
            type_id = int(text)
        except ValueError:
            raise _fail(errno.EINVAL, path, f"not a vGPU type id: {text!r}") from None

        def change(s: VmState) -> tuple[VmState, list[tuple[str, str, str]]]:
            fn = s.function(vf)
            if fn is None or fn.driver != NVIDIA_DRIVER or parent_of_vf(self.model, vf) is None:
                raise _fail(errno.ENOENT, path, f"{vf} is not a VF on the nvidia driver")
            if type_id == 0:
                return s.with_function(replace(fn, vgpu_type=0)), []
            if fn.vgpu_type:
                raise _fail(errno.EBUSY, path, f"{vf} has vGPU type {fn.vgpu_type}; write 0 first")
            allowed = [t.type_id for t in creatable(self.model, s, vf)]
            if type_id not in allowed:
                raise _fail(errno.EINVAL, path, f"type {type_id} is not creatable: {allowed}")
            return s.with_function(replace(fn, vgpu_type=type_id)), []

        self.apply(change)

    def _mdev_create(self, path: Path, parent: str, type_dir: str, text: str) -> None:
        gpu = self._gpu(parent)
        types = gpu.spec.vgpu_types if gpu is not None else ()
        t = next((t for t in types if f"nvidia-{t.type_id}" == type_dir), None)
        if gpu is None or t is None or self.model.vgpu_interface != "mdev":
            raise _fail(errno.ENOENT, path, f"no mdev type {type_dir} on {parent}")
        try:
            uuid = str(uuidlib.UUID(text))
        except ValueError:
            raise _fail(errno.EINVAL, path, f"not a UUID: {text!r}") from None

        def change(s: VmState) -> tuple[VmState, list[tuple[str, str, str]]]:
            fn = s.function(parent)
            if fn is None or fn.driver != NVIDIA_DRIVER:
                raise _fail(errno.ENOENT, path, f"{parent} is not on the nvidia driver")
            if any(m.uuid == uuid for m in s.mdevs):
                raise _fail(errno.EEXIST, path, f"mdev {uuid} exists")
            if available(self.model, s, gpu, t) <= 0:
                raise _fail(errno.EUSERS, path, f"no {t.name} instance available on {parent}")
            mdev = Mdev(uuid, parent, t.type_id, next_group(self.model, s, self._static))
            return replace(s, mdevs=(*s.mdevs, mdev)), []

        self.apply(change)

    def _mdev_remove(self, path: Path, uuid: str, text: str) -> None:
        try:
            remove = int(text)
        except ValueError:
            raise _fail(errno.EINVAL, path, f"not a number: {text!r}") from None

        def change(s: VmState) -> tuple[VmState, list[tuple[str, str, str]]]:
            if not any(m.uuid == uuid for m in s.mdevs):
                raise _fail(errno.ENOENT, path, f"no mdev {uuid}")
            if not remove:
                return s, []
            return replace(s, mdevs=tuple(m for m in s.mdevs if m.uuid != uuid)), []

        self.apply(change)
