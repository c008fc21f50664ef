"""A simulated node as a ``NodeSource``: the fake NVML, a written sysfs tree and driver root, the
simulated ``/proc`` of its GPU processes, and a boot id that lives in the simulator's state
directory."""

from __future__ import annotations

import uuid
from pathlib import Path

from agent.fsutil import atomic_write
from agent.node import NodeSource
from agent.nvml.api import NvmlApi
from agent.nvml.facade import Nvml
from agent.sim.driverroot import write_driver_root
from agent.sim.model import load_model
from agent.sim.nvml import FakeNvml
from agent.sim.sysfs import write_sysfs


def simulated_node(
    model_name: str,
    state_dir: Path,
    *,
    mig_layout: str | None = None,
    node_name: str | None = None,
    sysfs_root: Path | None = None,
    driver_root: Path | None = None,
    proc_root: Path | None = None,
) -> NodeSource:
    """Open the simulated ``model_name`` whose state lives in ``<state_dir>/sim`` (NVML is not
    yet initialized). The sysfs tree and driver root are written there unless given; the
    processes' ``/proc`` is the simulator's (``<state_dir>/sim/proc``) unless given."""
    model = load_model(model_name)
    sim_dir = state_dir / "sim"
    if sysfs_root is None:
        sysfs_root = sim_dir / "sys"
        write_sysfs(model, sysfs_root)
    fake = FakeNvml(model, sim_dir, mig_layout=mig_layout)
    api: NvmlApi = fake  # mypy proves that the simulator has the NVML surface the agent uses
    if driver_root is None:
        driver_root = sim_dir / "driver-root"
        write_driver_root(model, driver_root, state_dir=sim_dir, model_ref=model_name)
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
    )


def simulated_boot_id(sim_dir: Path) -> str:
    """The simulated node's boot id: made once per simulator state directory (a "reboot" of the
    simulated node is deleting this file; the file's time is the simulated boot's time)."""
    path = sim_dir / "boot_id"
    if not path.exists():
        atomic_write(path, (str(uuid.uuid4()) + "\n").encode())
    return path.read_text().strip()
