"""GPUs for virtual machines prepared and unprepared through the preparer (Transactions, Effects,
the checkpoint and CDI) on a hand-built sysfs tree whose fake kernel does what Linux does
(tests/vmhost.py): the binding before and after, the CDI result, the exclusion of containers and
VMs on one GPU, and every new crash point repaired by the next start."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.pcihost.vm_types import NVIDIA, VFIO_PCI
from dra_driver.device_model import DeviceModel
from dra_driver.kubeletplugin.checkpoint import PREPARE_COMPLETED
from dra_driver.vm.passthrough import Passthrough
from dra_driver.vm.vgpu import VgpuMaker
from tests.fakeclock import FakeClock
from tests.integration.daemon import DRIVER
from tests.vmhost import Binding, VgpuHost
from tests.vmnode import (
    AUDIO0,
    FREE,
    GPU0,
    GPU1,
    GPU2,
    MODEL,
    VF1,
    Agent,
    Claims,
    Crash,
    Node,
    advertised,
    expected,
)


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


def test_telemetry_is_told_before_the_unbind_and_the_inventory_after_the_bind(node: Node) -> None:
    """``handing`` comes while the GPU is still on nvidia (telemetry stops reading it before
    its reads fail), ``handed`` once its whole group is on vfio-pci (the inventory is read
    again), ``rebound`` once it is back on nvidia."""
    told: list[tuple[str, str, str | None, str | None]] = []

    def tell(what: str) -> Callable[[str], None]:
        def note(bdf: str) -> None:
            told.append((what, bdf, node.tree.driver(GPU0), node.tree.driver(AUDIO0)))

        return note

    tool = Passthrough(
        binding=Binding(node.tree), holders=node.holders, proc_root=node.tmp, dev_root=node.tmp,
        sys_root=node.tree.root, persistence_off=lambda b: None, visible=lambda b: True,
        rebound=tell("rebound"), handing=tell("handing"), handed=tell("handed"),
        log=logging.getLogger("test.vm"), sleep=lambda s: None,
    )  # fmt: skip
    functions = tool.functions("gpu-0-vfio", GPU0, 0)
    tool.take("gpu-0-vfio", GPU0, functions)
    tool.give_back("gpu-0-vfio", GPU0, functions)
    assert told == [
        ("handing", GPU0, NVIDIA, "snd_hda_intel"),
        ("handed", GPU0, VFIO_PCI, VFIO_PCI),
        ("rebound", GPU0, NVIDIA, "snd_hda_intel"),
    ]


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
        agent.preparer.close(0)
        agent = Agent(node, claims, model=model)
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


def test_each_vgpu_made_or_removed_is_told(node: Node) -> None:
    """The inventory is read again after each (a homogeneous GPU then offers only the type it
    hosts): ``changed`` gets the VF, or the mdev parent, once the vGPU is there / gone."""
    told: list[tuple[str, list[tuple[str, int]]]] = []
    host = VgpuHost(node.tree)

    def changed(function: str) -> None:
        told.append((function, sorted((v.function, v.type_id) for v in host.vgpus(GPU1))))

    maker = VgpuMaker(
        host=host, binding=Binding(node.tree), gpu=host.gpu, log=logging.getLogger("test.vm"),
        changed=changed,
    )  # fmt: skip
    vf, no_mdev = maker.choose("gpu-1-vgpu-62-0", GPU1, 62)
    maker.make("gpu-1-vgpu-62-0", vf, 62, no_mdev)
    maker.remove("gpu-1-vgpu-62-0", vf, no_mdev)
    assert told == [(VF1[0], [(VF1[0], 62)]), (VF1[0], [])]


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
