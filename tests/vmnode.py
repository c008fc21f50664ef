"""A simulated node whose agent hands GPUs to virtual machines, for the VM prepare tests and the
VM state machine: the simulator's node (``agent.sim.node.simulated_node``: its sysfs tree, its
kernel ``SimPciKernel`` behind ``NodeSource.pci_write``, its NVML that loses a GPU bound away from
nvidia and finds it again), the agent's own VM tools over it as the daemon builds them
(``agent.daemon.vm_wiring.vm_tools``: ``PciBinding``, ``VgpuHost``, ``holders``), the devices the
agent advertises from its own discovery (``discover`` with ``vm_discovery``, then
``advertised_devices``), and a preparer on it (:class:`Agent`) with one armed crash point.

:meth:`VmNode.state` is the simulated node's truth (the simulator's VM state: every function's
driver, ``driver_override`` and vGPU type, the mediated devices); :func:`expected` is what a
checkpoint says it must be."""

from __future__ import annotations

import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.cli import main
from agent.daemon.vm_wiring import vm_tools
from agent.discovery.vm import vm_discovery
from agent.node import NodeSource, discover
from agent.nvml.vfio import index_of
from agent.pcihost.binding import PciBinding
from agent.pcihost.vgpu_host import VgpuHost
from agent.pcihost.vm_types import NVIDIA, VFIO_PCI, KernelWrite
from agent.sim.node import simulated_node
from dra_driver.device_model import DeviceModel, advertised_devices
from dra_driver.device_types import DevicePolicy
from dra_driver.kubeletplugin.cdi import CdiWriter
from dra_driver.kubeletplugin.checkpoint import Checkpoint, CheckpointStore
from dra_driver.kubeletplugin.claims import ClaimKey
from dra_driver.kubeletplugin.effects import Effects
from dra_driver.kubeletplugin.prepare import Preparer
from dra_driver.vm.tools import VmTools
from tests.integration.daemon import DRIVER, claim_manifest

LOG = logging.getLogger("tessera.test.vm")
PASSTHROUGH_MODEL = "mixed"
"""2x A100 (MIG-capable: under ``all-7g`` each is one MIG device for containers) and 2x L4
(whole GPUs for containers, or for one VM each through VFIO); the smallest such model."""
VF_MODEL = "vgpu-h200"
"""2x H200 under the vGPU 17+ host driver: SR-IOV VFs, a vGPU type per VF."""
MDEV_MODEL = "vgpu-t4"
"""2x T4 under an older vGPU host driver: mediated devices on the GPU."""
NODES = {
    "passthrough": (PASSTHROUGH_MODEL, "passthrough", "all-7g"),
    "vf": (VF_MODEL, "vgpu", None),
    "mdev": (MDEV_MODEL, "vgpu", None),
}
"""The kinds of VM node the tests use: (model, --virtualization, MIG layout)."""


def fault(state_dir: Path, *args: str) -> str:
    """``tessera sim fault`` on the simulated node whose state is under ``state_dir`` (as
    ``simulated_node`` was given it); its standard output. AssertionError with its error
    output when it fails."""
    out, err = io.StringIO(), io.StringIO()
    code = main(["sim", "fault", "--state-dir", str(state_dir), *args], {}, out, err)
    assert code == 0, err.getvalue()
    return out.getvalue()


class Crash(BaseException):
    """The agent dies here (nothing in the preparer may catch it)."""


@dataclass(frozen=True)
class NodeState:
    """What the simulated node has: (driver, driver_override, vGPU type) per managed function
    (GPUs, VFs, foreign functions), and the mediated devices (uuid, parent, type)."""

    functions: dict[str, tuple[str | None, str | None, int]]
    mdevs: frozenset[tuple[str, str, int]]


class VmNode:
    """One simulated node of ``model`` whose agent runs ``--virtualization mode``."""

    def __init__(self, tmp: Path, model: str, mode: str, *, mig_layout: str | None = None) -> None:
        self.tmp = tmp
        self.mode = mode
        self.source: NodeSource = simulated_node(model, tmp / "node", mig_layout=mig_layout)
        self.source.nvml.init()
        self.free = self.state()
        """The node as it booted: every GPU on nvidia, no vGPU."""
        self.rebound: list[str] = []
        """BDFs the agent was told are back on nvidia (the inventory is read again)."""
        self.preparers: list[Preparer] = []
        """Every preparer started on this node (closed by :meth:`close`)."""

    @classmethod
    def of(cls, tmp: Path, kind: str) -> VmNode:
        """A node of ``kind`` (:data:`NODES`) under ``tmp/<kind>``."""
        model, mode, layout = NODES[kind]
        return cls(tmp / kind, model, mode, mig_layout=layout)

    @property
    def write(self) -> KernelWrite:
        assert self.source.pci_write is not None
        return self.source.pci_write

    def binding(self) -> PciBinding:
        return PciBinding(self.source.sysfs_root, self.source.driver_root, self.write)

    def vgpu_host(self) -> VgpuHost:
        return VgpuHost(self.source.sysfs_root, self.write)

    def fault(self, *args: str) -> str:
        """``tessera sim fault`` on this node; its standard output."""
        return fault(self.tmp / "node", *args)

    def bus(self, index: int) -> str:
        """The BDF of the model's GPU ``index``."""
        bus: str = self.source.sim.model.gpus[index].bus
        return bus

    def tools(self, crash: Any, reread: Any = lambda bus: None) -> VmTools | None:
        """The daemon's VM tools; ``reread(bus)`` is told what the daemon rediscovers after: a
        GPU back on nvidia or now on vfio-pci, a vGPU made or removed."""

        def rebound(bus: str) -> None:
            self.rebound.append(bus)
            reread(bus)

        return vm_tools(
            self.mode,
            self.source,
            kernel_write=self.source.pci_write,
            rebound=rebound,
            log=LOG,
            crash=crash,
            handing=lambda bus: None,
            handed=reread,
        )

    def devices(self) -> DeviceModel:
        """What the agent advertises now, from its own discovery of the node."""
        vm = vm_discovery(self.mode, self.tmp / "state", self.source.nvml, LOG)
        inventory = discover(self.source, vm)
        return advertised_devices(inventory, DevicePolicy(virtualization=self.mode))

    def state(self) -> NodeState:
        vm = self.source.sim.vm_state
        return NodeState(
            functions={f.bus: (f.driver, f.override, f.vgpu_type) for f in vm.functions},
            mdevs=frozenset((m.uuid, m.parent, m.type_id) for m in vm.mdevs),
        )

    def nvml_buses(self) -> set[str]:
        """The GPUs NVML enumerates now (by BDF), looked up as the agent looks them up."""
        gpus = [self.bus(i) for i in range(len(self.source.sim.model.gpus))]
        return {bus for bus in gpus if index_of(self.source.nvml, bus) is not None}

    def close(self) -> None:
        for preparer in self.preparers:
            preparer.close(0)
        self.source.nvml.shutdown()


def expected(node: VmNode, cp: Checkpoint) -> NodeState:
    """The node the checkpoint says there is: as it booted, with what each recorded VM device
    holds (a GPU's group on vfio-pci through its override, a VF's type, an mdev)."""
    functions = dict(node.free.functions)
    mdevs = set(node.free.mdevs)
    for entry in cp.claims.values():
        for d in entry.devices:
            if d.kind == "vfio":
                for bdf, _ in d.vfio_functions:
                    functions[bdf] = (VFIO_PCI, VFIO_PCI, 0)
            elif d.kind == "vgpu" and d.pci_bus_id is not None and d.vgpu_type_id is not None:
                if d.mdev_uuid:
                    mdevs.add((d.mdev_uuid, d.pci_bus_id, d.vgpu_type_id))
                else:
                    functions[d.pci_bus_id] = (NVIDIA, None, d.vgpu_type_id)
    return NodeState(functions, frozenset(mdevs))


def lent(state: NodeState) -> set[str]:
    """The functions of ``state`` not on nvidia."""
    return {bus for bus, (driver, _, _) in state.functions.items() if driver != NVIDIA}


class Claims:
    """The API server's ResourceClaims as the preparer reads them (allocated on ``pool``)."""

    reads_block = True

    def __init__(self, pool: str) -> None:
        self.pool = pool
        self.objects: dict[str, dict[str, Any]] = {}

    def add(self, name: str, *devices: str) -> ClaimKey:
        self.objects[name] = claim_manifest(
            name, f"uid-{name}", [("gpu", d) for d in devices], self.pool
        )
        return ClaimKey("default", name, f"uid-{name}")

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        return self.objects[name]


class Agent:
    """A preparer on ``node`` (``vm=False``: ``--virtualization none``); ``crash_at`` arms one
    crash point. Each start discovers the node and advertises what it finds, and so does each
    rediscovery the VM tools ask for (a GPU back on nvidia, a vGPU made or removed), as the
    daemon does."""

    def __init__(self, node: VmNode, claims: Claims, vm: bool = True) -> None:
        self.node, self.claims, self.vm = node, claims, vm
        self.crash_at: str | None = None
        self.preparer = self._start()

    def _hook(self, point: str) -> None:
        if point == self.crash_at:
            self.crash_at = None
            raise Crash(point)

    def _start(self) -> Preparer:
        node = self.node
        self.model = node.devices()
        effects = Effects(
            mig=None, settings=None, mps=None, devices=self.devices, log=LOG,
            crash_hook=self._hook, vm=node.tools(self._hook, self._reread) if self.vm else None,
        )  # fmt: skip
        preparer = Preparer(
            driver_name=DRIVER,
            pool=self.claims.pool,
            claims=self.claims,
            store=CheckpointStore(node.tmp / "checkpoint.json", node.source.boot_id),
            cdi=CdiWriter(
                node.tmp / "cdi",
                DRIVER,
                node.source.driver_root,
                node.source.nvml.system().driver_version,
                host_driver_root=node.source.host_root,
            ),
            devices=self.devices,
            log=LOG,
            effects=effects,
            crash_hook=self._hook,
        )
        node.preparers.append(preparer)
        preparer.reconcile_on_start()
        return preparer

    def devices(self) -> DeviceModel:
        """What the agent advertises now."""
        return self.model

    def _reread(self, bus: str) -> None:
        """As the daemon's rediscovery after a GPU came back or a vGPU changed."""
        self.model = self.node.devices()

    def restart(self) -> None:
        self.preparer.close(0)
        self.preparer = self._start()

    def prepare(self, key: ClaimKey) -> Any:
        (result,) = self.preparer.prepare([key]).values()
        return result

    def unprepare(self, key: ClaimKey) -> Any:
        (result,) = self.preparer.unprepare([key]).values()
        return result

    def spec(self, key: ClaimKey) -> dict[str, Any]:
        spec: dict[str, Any] = json.loads(self.preparer.cdi.path(key.uid).read_text())
        return spec
