"""Fixtures for discovery tests: GPUs straight from a node model, a written sysfs tree, inventories.

``gpu_devices`` builds the NVML facade's values from the model directly, so these tests do not
depend on the NVML simulator.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from agent.discovery.build import build_inventory
from agent.discovery.inventory import NodeInventory
from agent.discovery.sysfs import read_sysfs
from agent.nvml.types import GpuDevice, MemoryInfo, MigMode, NvLink, SystemInfo
from agent.sim.model import NodeModel, load_model
from agent.sim.sysfs import write_sysfs

ARCHITECTURES = {7: "Ampere", 8: "Ada Lovelace", 9: "Hopper", 10: "Blackwell"}
BRANDS = {2: "Tesla", 14: "NVIDIA"}


def _links(model: NodeModel, bus: str, nvlinks: int) -> tuple[NvLink, ...]:
    if model.nvlink_kind == "nvswitch":
        switches = [s.bus for s in model.nvswitches]
        return tuple(
            NvLink(
                link=i,
                active=True,
                remote_pci_bus_id=switches[i % len(switches)],
                remote_device_type="switch",
            )
            for i in range(nvlinks)
        )
    if model.nvlink_kind == "bridge":
        for bridge in model.bridges:
            if bus in bridge.gpus:
                peer = bridge.gpus[1] if bridge.gpus[0] == bus else bridge.gpus[0]
                return tuple(
                    NvLink(link=i, active=True, remote_pci_bus_id=peer, remote_device_type="gpu")
                    for i in range(bridge.links)
                )
    return ()


def gpu_devices(model: NodeModel) -> tuple[GpuDevice, ...]:
    """What NVML would report for the model's GPUs (no MIG details)."""
    devices = []
    for g in model.gpus:
        spec = g.spec
        devices.append(
            GpuDevice(
                index=g.index,
                minor=g.index,
                uuid=g.uuid,
                name=spec.name,
                brand=BRANDS.get(spec.brand, str(spec.brand)),
                architecture=ARCHITECTURES.get(spec.architecture, str(spec.architecture)),
                compute_capability=spec.compute_capability,
                pci_bus_id=g.bus,
                pci_device_id=spec.pci_device_id,
                serial=g.serial,
                memory=MemoryInfo(total=spec.memory_bytes, free=spec.memory_bytes, used=0),
                mig_mode=MigMode(current=False, pending=False) if spec.mig_capable else None,
                nvlinks=_links(model, g.bus, spec.nvlinks),
            )
        )
    return tuple(devices)


def system_info(model: NodeModel) -> SystemInfo:
    v = model.cuda_driver_version
    return SystemInfo(
        driver_version=model.driver_version,
        cuda_driver_version=f"{v // 1000}.{v % 1000 // 10}",
    )


def inventory_of(model: NodeModel, root: Path) -> NodeInventory:
    """Write the model's sysfs tree under ``root``, read it back and build the inventory."""
    write_sysfs(model, root)
    return build_inventory(
        hostname=model.hostname,
        system=system_info(model),
        gpus=gpu_devices(model),
        sysfs=read_sysfs(root),
    )


@pytest.fixture(scope="session")
def inventory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str], NodeInventory]:
    """``inventory("dgx-h100")``: the inventory of a bundled model (built once per session)."""
    cache: dict[str, NodeInventory] = {}

    def get(name: str) -> NodeInventory:
        if name not in cache:
            cache[name] = inventory_of(load_model(name), tmp_path_factory.mktemp(name))
        return cache[name]

    return get
