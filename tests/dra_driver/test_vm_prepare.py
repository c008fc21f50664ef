"""GPUs for virtual machines prepared and unprepared through the preparer (Transactions, Effects,
the checkpoint and CDI) on a hand-built sysfs tree whose fake kernel does what Linux does
(tests/vmhost.py): the binding before and after, the CDI result, the exclusion of containers and
VMs on one GPU, and every new crash point repaired by the next start."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agent.pcihost.vm_types import NVIDIA, VFIO_PCI, VgpuType
from dra_driver.device_model import AdvertisedDevice, DeviceModel
from dra_driver.kubeletplugin.cdi import CdiWriter
from dra_driver.kubeletplugin.checkpoint import PREPARE_COMPLETED, Checkpoint, CheckpointStore
from dra_driver.kubeletplugin.claims import ClaimKey
from dra_driver.kubeletplugin.effects import Effects
from dra_driver.kubeletplugin.prepare import Preparer
from dra_driver.vm.passthrough import Passthrough
from dra_driver.vm.tools import VmTools
from dra_driver.vm.vgpu import VgpuMaker
from tests.fakeclock import FakeClock
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
    return AdvertisedDevice(
        name=name, kind=kind, gpu_index=minor, gpu_minor=minor, parent_uuid=uuid, uuid=uuid,
        mig_profile_id=None, mig_placement_start=None, mig_placement_size=None,
        gpu_instance_id=None, compute_instance_id=None, attributes=(), capacity=(),
        bus_id=bus_id, **extra,
    )  # fmt: skip


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
    """A preparer on the node; ``crash_at`` arms one crash point."""

    def __init__(self, node: Node, claims: Claims, vm: bool = True) -> None:
        self.node, self.claims, self.vm = node, claims, vm
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
            mig=None, settings=None, mps=None, devices=lambda: MODEL, log=log,
            crash_hook=self._hook, vm=self.node.tools(self._hook) if self.vm else None,
        )  # fmt: skip
        preparer = Preparer(
            driver_name=DRIVER,
            pool=POOL,
            claims=self.claims,
            store=CheckpointStore(tmp / "checkpoint.json", "boot"),
            cdi=CdiWriter(tmp / "cdi", DRIVER, tmp / "root", "550.90.07"),
            devices=lambda: MODEL,
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


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    yield n
    for preparer in n.preparers:
        preparer.close(0)


# -- passthrough -------------------------------------------------------------------------------
def test_passthrough_binds_the_whole_group_to_vfio_and_gives_it_back(node: Node) -> None:
    claims = Claims()
    agent = Agent(node, claims)
    key = claims.add("vm", "gpu-0-vfio")
    assert node.state() == FREE
    result = agent.prepare(key)
    assert result.error == ""
    assert node.state()["drivers"][GPU0] == (VFIO_PCI, VFIO_PCI)
    assert node.state()["drivers"][AUDIO0] == (VFIO_PCI, VFIO_PCI)  # the audio function too
    assert node.persistence == [GPU0]
    (d,) = result.devices
    assert d.kind == "vfio" and d.pci_bus_id == GPU0 and d.iommu_group == 12
    assert d.vfio_functions == ((GPU0, NVIDIA), (AUDIO0, "snd_hda_intel"))
    # no NVIDIA node, no driver files: the VM gets VFIO's container and the group's node
    assert d.cdi_device_ids == (f"k8s.{DRIVER}/claim=uid-vm-gpu-0-vfio",)
    (spec_device,) = agent.spec(key)["devices"]
    nodes = [n["path"] for n in spec_device["containerEdits"]["deviceNodes"]]
    assert nodes == ["/dev/vfio/vfio", "/dev/vfio/12"]
    assert agent.preparer.checkpoint.claims["uid-vm"].devices == (d,)

    assert agent.unprepare(key).error == ""
    assert node.state() == FREE  # each function back to the driver it had, overrides cleared
    assert node.rebound == [GPU0]  # the inventory is read again: advertised for containers


def test_passthrough_is_refused_while_a_process_holds_the_gpu(node: Node) -> None:
    node.holders.by_path[node.tmp / "root" / "dev" / "nvidia0"] = [(4242, "python3")]
    claims = Claims()
    agent = Agent(node, claims)
    result = agent.prepare(claims.add("vm", "gpu-0-vfio"))
    assert "pid 4242 (python3)" in result.error and "/dev/nvidia0" in result.error
    assert node.state() == FREE
    assert agent.preparer.checkpoint.claims == {}


def test_a_group_with_a_foreign_function_is_refused_naming_it(node: Node) -> None:
    node.tree.function("0000:1c:00.0", "nvme", 12)  # an NVMe drive in the GPU's group
    claims = Claims()
    agent = Agent(node, claims)
    result = agent.prepare(claims.add("vm", "gpu-0-vfio"))
    assert "0000:1c:00.0" in result.error and "IOMMU group 12" in result.error
    assert node.tree.driver("0000:1c:00.0") == "nvme"
    assert node.state() == FREE


def test_unprepare_waits_bounded_until_nvml_sees_the_gpu(node: Node) -> None:
    """The GPU bound back to nvidia is polled until NVML lists it, on an injected clock; never
    seen, the unprepare fails saying so and keeps the claim (the kubelet retries)."""
    seen = iter([False, False, True])
    clock, sleeps = FakeClock(step=1.0), list[float]()
    binding = Binding(node.tree)
    tool = Passthrough(
        binding=binding, holders=node.holders, proc_root=node.tmp, dev_root=node.tmp,
        sys_root=node.tree.root, persistence_off=lambda b: None, visible=lambda b: next(seen),
        rebound=node.rebound.append, log=logging.getLogger("test.vm"), clock=clock,
        sleep=sleeps.append, timeout_s=10.0, poll_s=0.5,
    )  # fmt: skip
    functions = tool.functions("gpu-0-vfio", GPU0, 0)
    tool.take("gpu-0-vfio", GPU0, functions)
    tool.give_back("gpu-0-vfio", GPU0, functions)
    assert sleeps == [0.5, 0.5]
    tool.take("gpu-0-vfio", GPU0, functions)
    never = Passthrough(
        binding=binding, holders=node.holders, proc_root=node.tmp, dev_root=node.tmp,
        sys_root=node.tree.root, persistence_off=lambda b: None, visible=lambda b: False,
        rebound=node.rebound.append, log=logging.getLogger("test.vm"), clock=FakeClock(step=1.0),
        sleep=lambda s: None, timeout_s=10.0,
    )  # fmt: skip
    with pytest.raises(Exception, match="NVML does not see it after 10 s") as info:
        never.give_back("gpu-0-vfio", GPU0, functions)
    assert getattr(info.value, "reason", "") == "gpu_not_back"


def test_a_vm_claim_is_refused_clearly_without_virtualization(node: Node) -> None:
    claims = Claims()
    agent = Agent(node, claims, vm=False)
    result = agent.prepare(claims.add("vm", "gpu-0-vfio"))
    assert "--virtualization passthrough" in result.error
    assert node.state() == FREE


# -- vGPU --------------------------------------------------------------------------------------
def test_a_vgpu_on_a_free_vf_is_made_and_cleared(node: Node) -> None:
    claims = Claims()
    agent = Agent(node, claims)
    a, b = claims.add("a", "gpu-1-vgpu-62-0"), claims.add("b", "gpu-1-vgpu-62-1")
    ra, rb = agent.prepare(a), agent.prepare(b)
    assert ra.error == rb.error == ""
    assert [d.pci_bus_id for d in (*ra.devices, *rb.devices)] == list(VF1)  # one VF each
    assert node.state()["vgpus"] == [(VF1[0], 62), (VF1[1], 62)]
    (spec_device,) = agent.spec(a)["devices"]
    nodes = [n["path"] for n in spec_device["containerEdits"]["deviceNodes"]]
    assert nodes == ["/dev/vfio/vfio", "/dev/vfio/21"]  # the VF's group
    assert agent.unprepare(a).error == agent.unprepare(b).error == ""
    assert node.state() == FREE


def test_a_homogeneous_gpu_refuses_a_second_vgpu_type(node: Node) -> None:
    claims = Claims()
    agent = Agent(node, claims)
    assert agent.prepare(claims.add("a", "gpu-1-vgpu-62-0")).error == ""
    result = agent.prepare(claims.add("b", "gpu-1-vgpu-63-0"))
    assert "type 62" in result.error and "one type" in result.error
    assert node.state()["vgpus"] == [(VF1[0], 62)]


def test_an_mdev_vgpu_is_created_with_a_recorded_uuid_and_removed(node: Node) -> None:
    claims = Claims()
    agent = Agent(node, claims)
    key = claims.add("t4", "gpu-2-vgpu-230-0")
    result = agent.prepare(key)
    assert result.error == ""
    (d,) = result.devices
    assert d.mdev_uuid == "00000000-0000-4000-8000-000000000001" and d.pci_bus_id == GPU2
    assert node.state()["mdevs"] == [d.mdev_uuid]
    (spec_device,) = agent.spec(key)["devices"]
    nodes = [n["path"] for n in spec_device["containerEdits"]["deviceNodes"]]
    assert nodes == ["/dev/vfio/vfio", f"/dev/vfio/{d.iommu_group}"]
    assert agent.unprepare(key).error == ""
    assert node.state() == FREE


# -- containers and VMs never share a GPU ------------------------------------------------------
@pytest.mark.parametrize(
    ("first", "second"),
    [("gpu-0", "gpu-0-vfio"), ("gpu-0-vfio", "gpu-0"), ("gpu-1-vgpu-62-0", "gpu-1-vfio-like")],
)
def test_a_gpu_serves_vms_or_containers_whatever_the_order(
    node: Node, first: str, second: str
) -> None:
    claims = Claims()
    agent = Agent(node, claims)
    if second == "gpu-1-vfio-like":  # a vGPU's GPU is not a container's either
        first, second = "gpu-1-vgpu-62-0", "gpu-1"
        model = DeviceModel((*MODEL.devices, advertised("gpu-1", "gpu", 1, "GPU-1")), ())
        agent.preparer.devices = lambda: model
        agent.preparer._transactions._devices = lambda: model
    assert agent.prepare(claims.add("one", first)).error == ""
    before = node.state()
    result = agent.prepare(claims.add("two", second))
    assert "claim default/one (uid-one)" in result.error
    assert "never both" in result.error
    assert node.state() == before
    assert set(agent.preparer.checkpoint.claims) == {"uid-one"}


# -- crash safety ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("device", "point"),
    [
        ("gpu-0-vfio", "after-started"),
        ("gpu-0-vfio", "after-vfio-unbind"),
        ("gpu-0-vfio", "after-vfio-bind"),
        ("gpu-0-vfio", "after-cdi"),
        ("gpu-0-vfio", "after-completed"),
        ("gpu-1-vgpu-62-0", "after-vgpu-create"),
        ("gpu-1-vgpu-62-0", "after-cdi"),
        ("gpu-2-vgpu-230-0", "after-vgpu-create"),
        ("gpu-2-vgpu-230-0", "after-completed"),
    ],
)
def test_a_crash_in_prepare_leaves_the_node_equal_to_the_checkpoint_after_the_start(
    node: Node, device: str, point: str
) -> None:
    claims = Claims()
    agent = Agent(node, claims)
    key = claims.add("vm", device)
    agent.crash_at = point
    with pytest.raises(Crash):
        agent.prepare(key)
    agent.restart()
    cp = agent.preparer.checkpoint
    assert node.state() == expected(cp)
    completed = point == "after-completed"
    assert (key.uid in cp.claims) == completed  # a started claim is rolled back
    assert agent.prepare(key).error == ""  # the kubelet's retry
    assert node.state() == expected(agent.preparer.checkpoint) != FREE
    assert agent.unprepare(key).error == ""
    assert node.state() == FREE


@pytest.mark.parametrize("device", ["gpu-0-vfio", "gpu-1-vgpu-62-0", "gpu-2-vgpu-230-0"])
@pytest.mark.parametrize("point", ["after-unprepare-undo", "after-unprepare-commit"])
def test_a_crash_in_unprepare_is_repaired_by_the_start_and_the_retry(
    node: Node, device: str, point: str
) -> None:
    claims = Claims()
    agent = Agent(node, claims)
    key = claims.add("vm", device)
    assert agent.prepare(key).error == ""
    agent.crash_at = point
    with pytest.raises(Crash):
        agent.unprepare(key)
    agent.restart()  # after the undo, still recorded: made whole again until the retry
    assert node.state() == expected(agent.preparer.checkpoint)
    assert agent.unprepare(key).error == ""
    assert node.state() == FREE


def test_the_start_gives_back_what_no_claim_records(node: Node) -> None:
    """A GPU bound to vfio-pci through its override and a vGPU, with no claim (a lost
    checkpoint): the start gives them back; a GPU an administrator bound to vfio-pci without an
    override is left alone."""
    binding, host = Binding(node.tree), VgpuHost(node.tree)
    binding.unbind(GPU0)
    binding.bind(GPU0, VFIO_PCI)
    host.set_type(VF1[1], 63)
    host.create_mdev(GPU2, 230, "00000000-0000-4000-8000-00000000beef")
    claims = Claims()
    Agent(node, claims)
    assert node.state() == FREE
    binding.unbind(GPU0)
    binding.bind(GPU0, VFIO_PCI)
    binding.release_override(GPU0)  # bound by hand, not by a prepare
    Agent(node, claims)
    assert node.tree.driver(GPU0) == VFIO_PCI


def test_a_completed_claim_is_bound_again_at_start_if_its_gpu_was_taken_back(node: Node) -> None:
    claims = Claims()
    agent = Agent(node, claims)
    key = claims.add("vm", "gpu-0-vfio")
    assert agent.prepare(key).error == ""
    Binding(node.tree).unbind(GPU0)  # behind the agent's back
    agent.restart()
    assert agent.preparer.checkpoint.claims[key.uid].state == PREPARE_COMPLETED
    assert node.state() == expected(agent.preparer.checkpoint)
