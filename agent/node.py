"""Where node facts come from: the real NVML and /sys, or a simulated node model.

``open_node`` is the single place that decides; everything above it sees an ``Nvml`` facade and a
sysfs root and cannot tell the difference.
"""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.config import Config
from agent.discovery.build import build_inventory
from agent.discovery.inventory import NodeInventory
from agent.discovery.sysfs import read_sysfs
from agent.fsutil import atomic_write
from agent.nvml.facade import Nvml


@dataclass(frozen=True)
class NodeSource:
    nvml: Nvml
    sysfs_root: Path
    hostname: str
    model: str | None
    """Simulated model name, None on real hardware."""
    driver_root: Path
    """Where the NVIDIA driver's files are (libraries, /proc/driver/nvidia)."""
    boot_id: str
    """Changes when the node reboots (prepared state does not survive a reboot)."""
    sim: Any = None
    """The simulator object (FakeNvml) when simulating, for simulator controls."""


def open_node(config: Config, state_dir: Path) -> NodeSource:
    """Build the NVML facade and pick the sysfs root for this run (does not call nvmlInit)."""
    if config.simulate:
        from agent.sim.driverroot import write_driver_root
        from agent.sim.model import load_model
        from agent.sim.nvml import FakeNvml
        from agent.sim.sysfs import write_sysfs

        model = load_model(config.simulate)
        sim_dir = state_dir / "sim"
        sysfs_root = config.sysfs_root
        if sysfs_root is None:
            sysfs_root = sim_dir / "sys"
            write_sysfs(model, sysfs_root)
        fake = FakeNvml(model, sim_dir, mig_layout=config.sim_mig_layout)
        driver_root = config.driver_root
        if driver_root is None:
            driver_root = sim_dir / "driver-root"
            write_driver_root(model, driver_root)
        return NodeSource(
            nvml=Nvml(fake),
            sysfs_root=sysfs_root,
            hostname=config.node_name or model.hostname,
            model=model.name,
            driver_root=driver_root,
            boot_id=simulated_boot_id(sim_dir),
            sim=fake,
        )
    import pynvml

    from dra_driver.checkpoint import read_boot_id

    return NodeSource(
        nvml=Nvml(pynvml),
        sysfs_root=config.sysfs_root or Path("/sys"),
        hostname=config.node_name or socket.gethostname(),
        model=None,
        driver_root=config.driver_root or Path("/"),
        boot_id=read_boot_id(),
    )


def simulated_boot_id(sim_dir: Path) -> str:
    """The simulated node's boot id: made once per simulator state directory (a "reboot" of the
    simulated node is deleting this file)."""
    path = sim_dir / "boot_id"
    if not path.exists():
        atomic_write(path, (str(uuid.uuid4()) + "\n").encode())
    return path.read_text().strip()


def discover(source: NodeSource) -> NodeInventory:
    """Read NVML and sysfs once and build the node inventory. NVML must be initialized."""
    return build_inventory(
        hostname=source.hostname,
        system=source.nvml.system(),
        gpus=source.nvml.devices(),
        sysfs=read_sysfs(source.sysfs_root),
    )
