"""Where node facts come from: the real NVML and /sys, or a simulated node model.

``open_node`` is the single place that decides; everything above it sees an ``Nvml`` facade and a
sysfs root and cannot tell the difference.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.config import Config
from agent.discovery.build import build_inventory
from agent.discovery.inventory import NodeInventory
from agent.discovery.sysfs import read_sysfs
from agent.nvml.facade import Nvml


@dataclass(frozen=True)
class NodeSource:
    nvml: Nvml
    sysfs_root: Path
    hostname: str
    model: str | None
    """Simulated model name, None on real hardware."""
    sim: Any = None
    """The simulator object (FakeNvml) when simulating, for simulator controls."""


def open_node(config: Config, state_dir: Path) -> NodeSource:
    """Build the NVML facade and pick the sysfs root for this run (does not call nvmlInit)."""
    if config.simulate:
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
        hostname = config.node_name or model.hostname
        return NodeSource(Nvml(fake), sysfs_root, hostname, model.name, fake)
    import pynvml

    hostname = config.node_name or socket.gethostname()
    return NodeSource(Nvml(pynvml), config.sysfs_root or Path("/sys"), hostname, None)


def discover(source: NodeSource) -> NodeInventory:
    """Read NVML and sysfs once and build the node inventory. NVML must be initialized."""
    return build_inventory(
        hostname=source.hostname,
        system=source.nvml.system(),
        gpus=source.nvml.devices(),
        sysfs=read_sysfs(source.sysfs_root),
    )
