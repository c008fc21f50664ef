"""One PCI function of the simulated node's tree (a value; the writers are :mod:`agent.sim.sysfs`
and :mod:`agent.sim.sysfs_vm`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SimFunction:
    """One PCI function the simulated tree contains (endpoint or bridge)."""

    bus: str
    parent: tuple[str, ...]
    """Root complex, then every bridge above this function."""
    numa: int
    vendor: int
    device: int
    pci_class: int

    @property
    def rel_path(self) -> str:
        """Path below ``devices/``: ``pci0000:16/0000:16:01.0/…/0000:1b:00.0``."""
        return "/".join((*self.parent, self.bus))
