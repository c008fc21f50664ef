"""A simulated node as a ``NodeSource``: the fake NVML, a written sysfs tree and driver root, the
simulated ``/proc`` of its GPU processes, and a boot id that lives in the simulator's state
directory."""

from __future__ import annotations

import uuid
from pathlib import Path

from agent.driverfiles.discover import NVML_SONAME
from agent.fsutil import atomic_write
from agent.node import NodeSource
from agent.nvml.api import NvmlApi
from agent.nvml.facade import Nvml
from agent.nvml.loader import NvmlLibrary, find_nvml
from agent.sim.driverroot import layout_of, write_driver_root
from agent.sim.model import load_model
from agent.sim.nvml import FakeNvml
from agent.sim.pcikernel import SimPciKernel
from agent.sim.sysfs import write_sysfs
from agent.sim.udev import removed_buses


def simulated_node(
    model_name: str,
    state_dir: Path,
    *,
    mig_layout: str | None = None,
    node_name: str | None = None,
    sysfs_root: Path | None = None,
    driver_root: Path | None = None,
    proc_root: Path | None = None,
    driver_layout: str | None = None,
    host_driver_root: Path | None = None,
) -> NodeSource:
    """Open the simulated ``model_name`` whose state lives in ``<state_dir>/sim`` (NVML is not
    yet initialized). The sysfs tree and driver root (in ``driver_layout``, see
    :mod:`agent.sim.driverroot`) are written there unless given; the processes' ``/proc`` is the
    simulator's (``<state_dir>/sim/proc``) unless given. The host sees the driver root at
    ``host_driver_root``, by default where the layout's host has it (``/``, or
    ``/run/nvidia/driver`` for the containerized driver): never where the simulator wrote it,
    so every CDI path is translated as on a real node. ``pci_write`` is the simulator's kernel
    (:class:`agent.sim.pcikernel.SimPciKernel`): writes to the tree's driver, SR-IOV and vGPU
    attributes change the node as Linux would."""
    model = load_model(model_name)
    sim_dir = state_dir / "sim"
    fake = FakeNvml(model, sim_dir, mig_layout=mig_layout)
    if sysfs_root is None:
        sysfs_root = sim_dir / "sys"
        write_sysfs(model, sysfs_root, removed_buses(fake), fake.vm_state)
    api: NvmlApi = fake  # mypy proves that the simulator has the NVML surface the agent uses
    layout = layout_of(driver_layout)
    kernel = SimPciKernel(fake, sysfs_root, driver_root or sim_dir / "driver-root")
    if driver_root is None:
        driver_root = sim_dir / "driver-root"
        write_driver_root(
            model, driver_root, state_dir=sim_dir, model_ref=model_name, layout=layout.name
        )
        kernel.rewrite_driver_root()
    nvml_file = find_nvml(driver_root)
    return NodeSource(
        nvml=Nvml(api),
        sysfs_root=sysfs_root,
        hostname=node_name or model.hostname,
        model=model.name,
        driver_root=driver_root,
        boot_id=simulated_boot_id(sim_dir),
        boot_time=(sim_dir / "boot_id").stat().st_mtime,
        sim=fake,
        proc_root=proc_root or fake.proc_root,
        host_driver_root=host_driver_root or Path(layout.host_root),
        pci_write=kernel.write,
        nvml_library=NvmlLibrary(
            None,  # nothing is loaded: the simulator answers NVML
            f"simulated node: NVML is the simulator; the driver root's file, {nvml_file}, is"
            " not loaded"
            if nvml_file
            else f"simulated node: no {NVML_SONAME} under the driver root {driver_root}",
        ),
    )


def simulated_boot_id(sim_dir: Path) -> str:
    """The simulated node's boot id: made once per simulator state directory (a "reboot" of the
    simulated node is deleting this file; the file's time is the simulated boot's time)."""
    path = sim_dir / "boot_id"
    if not path.exists():
        atomic_write(path, (str(uuid.uuid4()) + "\n").encode())
    return path.read_text().strip()
