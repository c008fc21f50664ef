"""Where node facts come from: a ``NodeSource`` is an NVML facade, a sysfs root and the node's
identity. ``real_node`` opens this machine (pynvml and ``/sys``); the simulator builds the same
value for a node model (``agent.sim.node``); the composition root chooses. Everything above sees
a ``NodeSource`` and cannot tell the difference.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.bootid import read_boot_id, read_boot_time
from agent.discovery.build import build_inventory
from agent.discovery.inventory import NodeInventory
from agent.discovery.sysfs import read_sysfs
from agent.nvml.facade import Nvml
from agent.nvml.loader import NvmlLibrary, load_nvml


@dataclass(frozen=True)
class NodeSource:
    nvml: Nvml
    sysfs_root: Path
    hostname: str
    model: str | None
    """Simulated model name, None on real hardware."""
    driver_root: Path
    """Where the NVIDIA driver's files are visible to the agent (libraries, binaries,
    /proc/driver/nvidia): every path the agent opens is under it."""
    boot_id: str
    """Changes when the node reboots (prepared state does not survive a reboot)."""
    boot_time: float
    """When this boot started (unix seconds): files written before it are from an earlier boot."""
    sim: Any = None
    """The simulator object (FakeNvml) when simulating, for simulator controls."""
    proc_root: Path = Path("/proc")
    """Where the processes NVML reports (by host PID) are: ``<proc_root>/<pid>/cgroup``."""
    host_driver_root: Path | None = None
    """Where the same driver files are on the host, which CDI specs name (the container
    runtime reads them there). None: the same as ``driver_root``."""
    nvml_library: NvmlLibrary | None = None
    """Which ``libnvidia-ml.so.1`` NVML uses and why (None: not decided yet)."""

    @property
    def host_root(self) -> Path:
        """The host's view of the driver root (``host_driver_root``, else ``driver_root``)."""
        return self.driver_root if self.host_driver_root is None else self.host_driver_root


def real_node(
    *,
    node_name: str | None,
    sysfs_root: Path | None,
    driver_root: Path | None,
    proc_root: Path | None = None,
    host_driver_root: Path | None = None,
) -> NodeSource:
    """This machine: pynvml (not yet initialized, its library loaded from the driver root when
    found there), ``/sys`` and ``/proc`` unless told otherwise."""
    import pynvml

    root = driver_root or Path("/")
    return NodeSource(
        nvml=Nvml(pynvml),
        sysfs_root=sysfs_root or Path("/sys"),
        hostname=node_name or socket.gethostname(),
        model=None,
        driver_root=root,
        boot_id=read_boot_id(),
        boot_time=read_boot_time(),
        proc_root=proc_root or Path("/proc"),
        host_driver_root=host_driver_root,
        nvml_library=load_nvml(pynvml, root),
    )


def discover(source: NodeSource) -> NodeInventory:
    """Read NVML and sysfs once and build the node inventory. NVML must be initialized."""
    return build_inventory(
        hostname=source.hostname,
        system=source.nvml.system(),
        gpus=source.nvml.devices(),
        sysfs=read_sysfs(source.sysfs_root),
    )
