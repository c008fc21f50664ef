"""What prepare needs of the host's PCI layer (:mod:`agent.pcihost`), as the shapes it codes
against: :class:`agent.pcihost.binding.PciBinding`, :class:`agent.pcihost.vgpu_host.VgpuHost`
and :func:`agent.pcihost.holders.holders` (docs/design of issue 24, section 4) satisfy them, and
the tests' hand-built sysfs trees with a fake ``KernelWrite`` do too."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from agent.pcihost.vm_types import Vgpu


class Binding(Protocol):
    """Which driver a PCI function is bound to, and changing it (``PciBinding``)."""

    def driver(self, bdf: str) -> str | None: ...

    def iommu_group(self, bdf: str) -> int | None: ...

    def group_members(self, bdf: str) -> tuple[str, ...]: ...

    def unbind(self, bdf: str) -> None:
        """Idempotent; for ``nvidia`` the unbind lock is taken first."""
        ...

    def bind(self, bdf: str, driver: str) -> None:
        """``driver_override`` then ``drivers/<driver>/bind``; idempotent."""
        ...

    def release_override(self, bdf: str) -> None: ...


class VgpuSysfs(Protocol):
    """The vGPU host driver's sysfs interfaces (``VgpuHost``)."""

    def creatable(self, function: str) -> dict[int, str]: ...

    def current_type(self, vf: str) -> int: ...

    def set_type(self, vf: str, type_id: int) -> None: ...

    def clear_type(self, vf: str) -> None: ...

    def create_mdev(self, parent: str, type_id: int, uuid: str) -> None: ...

    def remove_mdev(self, uuid: str) -> None: ...

    def mdev_group(self, uuid: str) -> int | None: ...

    def vgpus(self, gpu_bus_id: str) -> tuple[Vgpu, ...]: ...


class Holder(Protocol):
    """A process with a file descriptor open on a device node (``agent.pcihost.holders``)."""

    @property
    def pid(self) -> int: ...

    @property
    def name(self) -> str: ...


FindHolders = Callable[[Path, Sequence[Path]], Sequence[Holder]]
"""``holders(proc_root, device_paths)``."""
