"""A hand-built node for VM prepare tests: the sysfs tree of tests/vmhost.py with a passthrough
GPU (and its audio function), a vGPU GPU with SR-IOV VFs, an mdev vGPU GPU and the devices the
node advertises for them, and a preparer on it (``Agent``) with one armed crash point."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.pcihost.vm_types import NVIDIA, VFIO_PCI, VgpuType
from dra_driver.device_model import AdvertisedDevice, DeviceModel
from dra_driver.kubeletplugin.cdi import CdiWriter
from dra_driver.kubeletplugin.checkpoint import Checkpoint, CheckpointStore
from dra_driver.kubeletplugin.claims import ClaimKey
from dra_driver.kubeletplugin.effects import Effects
from dra_driver.kubeletplugin.prepare import Preparer
from dra_driver.vm.passthrough import Passthrough
from dra_driver.vm.tools import VmTools
from dra_driver.vm.vgpu import VgpuMaker
from tests.integration.daemon import DRIVER, claim_manifest
from tests.vmhost import Binding, Tree, VgpuHost

POOL = "node-a"
GPU0, AUDIO0 = "0000:1b:00.0", "0000:1b:00.1"  # passthrough GPU with its audio function
GPU1 = "0000:2a:00.0"  # vGPU GPU, SR-IOV VFs with per-VF vGPU types
VF1 = ("0000:2a:00.4", "0000:2a:00.5")
GPU2 = "0000:3c:00.0"  # vGPU GPU, mdev on the GPU itself
H200_35C = VgpuType(62, "NVIDIA H200X-35C", 35 * 2**30, 4)
H200_70C = VgpuType(63, "NVIDIA H200X-70C", 70 * 2**30, 2)
T4_4Q = VgpuType(230, "GRID T4-4Q", 4 * 2**30, 4)


class Crash(BaseException):
    """The agent dies here (nothing in the preparer may catch it)."""


def advertised(
    name: str, kind: str, minor: int, uuid: str, bus_id: str | None = None, **extra: Any
) -> AdvertisedDevice:
    fields: dict[str, Any] = dict(
        name=name, kind=kind, gpu_index=minor, gpu_minor=minor, parent_uuid=uuid, uuid=uuid,
        mig_profile_id=None, mig_placement_start=None, mig_placement_size=None,
        gpu_instance_id=None, compute_instance_id=None, attributes=(), capacity=(),
        bus_id=bus_id,
    )  # fmt: skip
    return AdvertisedDevice(**{**fields, **extra})


MODEL = DeviceModel(
    (
        advertised("gpu-0", "gpu", 0, "GPU-0"),
        advertised("gpu-0-vfio", "vfio", 0, "GPU-0", GPU0, iommu_group=12),
        advertised("gpu-1-vgpu-62-0", "vgpu", 1, "GPU-1", GPU1, vgpu_type=H200_35C),
        advertised("gpu-1-vgpu-62-1", "vgpu", 1, "GPU-1", GPU1, vgpu_type=H200_35C),
        advertised("gpu-1-vgpu-63-0", "vgpu", 1, "GPU-1", GPU1, vgpu_type=H200_70C),
        advertised("gpu-2-vgpu-230-0", "vgpu", 2, "GPU-2", GPU2, vgpu_type=T4_4Q),
    ),
    (),
)


@dataclass
class Holders:
    """``holders(proc_root, paths)``: the processes a test says hold each device node."""

    by_path: dict[Path, list[tuple[int, str]]] = field(default_factory=dict)

    def __call__(self, proc_root: Path, paths: Any) -> list[Any]:
        @dataclass(frozen=True)
        class Holder:
            pid: int
            name: str

        return [Holder(pid, name) for p in paths for pid, name in self.by_path.get(p, [])]


class Node:
    """The hand-built node: sysfs, its fake kernel, and what NVML sees."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.tree = Tree(tmp / "sys")
        self.tree.function(GPU0, NVIDIA, 12)
        self.tree.function(AUDIO0, "snd_hda_intel", 12)
        self.tree.function(GPU1, NVIDIA, 20)
        for n, vf in enumerate(VF1):
            self.tree.vf(GPU1, n, vf, 21 + n, {62: H200_35C.name, 63: H200_70C.name})
        self.tree.function(GPU2, NVIDIA, 30)
        self.tree.mdev_types(GPU2, {230: (T4_4Q.name, 4)})
        # a static MIG device of GPU 0 (gpu-0-mig): its capability files and nodes
        caps = tmp / "root" / "proc" / "driver" / "nvidia" / "capabilities" / "gpu0" / "mig"
        (caps / "gi1" / "ci0").mkdir(parents=True)
        (caps / "gi1" / "access").write_text("DeviceFileMinor: 21\n")
        (caps / "gi1" / "ci0" / "access").write_text("DeviceFileMinor: 22\n")
        (tmp / "root" / "dev" / "nvidia-caps").mkdir(parents=True)
        for minor in (21, 22):
            (tmp / "root" / "dev" / "nvidia-caps" / f"nvidia-cap{minor}").write_text("")
        self.holders = Holders()
        self.rebound: list[str] = []
        self.persistence: list[str] = []
        self.uuids = iter(f"00000000-0000-4000-8000-{i:012d}" for i in range(1, 100))
        self.preparers: list[Preparer] = []
        """Every preparer started on this node (closed when the test ends)."""

    def visible(self, bus_id: str) -> bool:
        return self.tree.driver(bus_id) == NVIDIA  # NVML lists only GPUs bound to nvidia

    def tools(self, crash: Any) -> VmTools:
        binding = Binding(self.tree)
        host = VgpuHost(self.tree)
        log = logging.getLogger("test.vm")
        return VmTools(
            passthrough=Passthrough(
                binding=binding, holders=self.holders, proc_root=self.tmp / "proc",
                dev_root=self.tmp / "root", sys_root=self.tree.root,
                persistence_off=self.persistence.append, visible=self.visible,
                rebound=self.rebound.append, log=log, crash_hook=crash,
                sleep=lambda s: None,
            ),
            vgpu=VgpuMaker(
                host=host, binding=binding, gpu=host.gpu, log=log, crash_hook=crash,
                new_uuid=lambda: next(self.uuids),
            ),
        )  # fmt: skip

    def state(self) -> dict[str, Any]:
        """What the node has now: each function's driver and override, the vGPUs."""
        functions = (GPU0, AUDIO0, GPU1, *VF1, GPU2)
        host = VgpuHost(self.tree)
        return {
            "drivers": {f: (self.tree.driver(f), self.tree.override(f)) for f in functions},
            "vgpus": sorted((v.function, v.type_id) for g in (GPU1, GPU2) for v in host.vgpus(g)),
            "mdevs": sorted(v.mdev_uuid or "" for v in host.vgpus(GPU2)),
        }


FREE = {
    "drivers": {
        GPU0: (NVIDIA, "(null)"), AUDIO0: ("snd_hda_intel", "(null)"), GPU1: (NVIDIA, "(null)"),
        VF1[0]: (NVIDIA, "(null)"), VF1[1]: (NVIDIA, "(null)"), GPU2: (NVIDIA, "(null)"),
    },
    "vgpus": [],
    "mdevs": [],
}  # fmt: skip


def expected(cp: Checkpoint) -> dict[str, Any]:
    """The node the checkpoint says there is: FREE, with what each recorded VM device holds."""
    state: dict[str, Any] = json.loads(json.dumps(FREE))
    state["drivers"] = {k: tuple(v) for k, v in state["drivers"].items()}
    for entry in cp.claims.values():
        for d in entry.devices:
            if d.kind == "vfio":
                for bdf, _ in d.vfio_functions:
                    state["drivers"][bdf] = (VFIO_PCI, VFIO_PCI)
            elif d.kind == "vgpu" and d.pci_bus_id is not None:
                state["vgpus"].append((d.pci_bus_id, d.vgpu_type_id))
                if d.mdev_uuid:
                    state["mdevs"].append(d.mdev_uuid)
    state["vgpus"].sort()
    state["mdevs"].sort()
    return state


class Claims:
    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}

    def add(self, name: str, *devices: str) -> ClaimKey:
        self.objects[name] = claim_manifest(
            name, f"uid-{name}", [("gpu", d) for d in devices], POOL
        )
        return ClaimKey("default", name, f"uid-{name}")

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        return self.objects[name]


class Agent:
    """A preparer on the node; ``crash_at`` arms one crash point; ``model`` is what the node
    advertises."""

    def __init__(
        self, node: Node, claims: Claims, vm: bool = True, model: DeviceModel = MODEL
    ) -> None:
        self.node, self.claims, self.vm, self.model = node, claims, vm, model
        self.crash_at: str | None = None
        self.preparer = self._start()

    def _hook(self, point: str) -> None:
        if point == self.crash_at:
            self.crash_at = None
            raise Crash(point)

    def _start(self) -> Preparer:
        log = logging.getLogger("test.vm")
        tmp = self.node.tmp
        effects = Effects(
            mig=None, settings=None, mps=None, devices=lambda: self.model, log=log,
            crash_hook=self._hook, vm=self.node.tools(self._hook) if self.vm else None,
        )  # fmt: skip
        preparer = Preparer(
            driver_name=DRIVER,
            pool=POOL,
            claims=self.claims,
            store=CheckpointStore(tmp / "checkpoint.json", "boot"),
            cdi=CdiWriter(tmp / "cdi", DRIVER, tmp / "root", "550.90.07"),
            devices=lambda: self.model,
            log=log,
            effects=effects,
            crash_hook=self._hook,
        )
        self.node.preparers.append(preparer)
        preparer.reconcile_on_start()
        return preparer

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
