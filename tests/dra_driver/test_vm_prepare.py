"""GPUs for virtual machines prepared and unprepared through the preparer (Transactions, Effects,
the checkpoint and CDI) on simulated nodes (tests/vmnode.py: the simulator's sysfs, kernel and
NVML; the agent's own VM tools, discovery and advertised devices): the binding before and after,
what NVML sees, the CDI result, the exclusion of containers and VMs on one GPU, and every new
crash point repaired by the next start."""

from __future__ import annotations

import functools
import logging
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.pcihost.holders import holders
from agent.pcihost.vm_types import NVIDIA, VFIO_PCI
from agent.sim.vmstate import vf_bus
from dra_driver.kubeletplugin.checkpoint import PREPARE_COMPLETED
from dra_driver.vm.passthrough import Passthrough
from tests.fakeclock import FakeClock
from tests.integration.daemon import DRIVER
from tests.pcihost.sysfstree import FakeKernel, SysTree
from tests.simnode import sharing
from tests.vmnode import PASSTHROUGH_MODEL, Agent, Claims, Crash, VmNode, expected

L4 = 2
"""The model's index (and minor) of the first L4 of the passthrough node: a whole GPU for
containers (``gpu-2``) or a VM (``gpu-2-vfio``); the A100s are MIG devices (``all-7g``)."""
H200_35C, H200_70C = 1430, 1429
T4_1Q = 230
NODE_OF = {"gpu-2-vfio": "passthrough", "gpu-0-vgpu-1430-0": "vf", "gpu-0-vgpu-230-0": "mdev"}


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[dict[str, VmNode]]:
    """Simulated nodes, opened on first use."""
    opened: dict[str, VmNode] = {}

    class Lazy(dict[str, VmNode]):
        def __missing__(self, kind: str) -> VmNode:
            opened[kind] = VmNode.of(tmp_path, kind)
            return opened[kind]

    yield Lazy()
    for node in opened.values():
        node.close()


def spec_nodes(agent: Agent, key: object) -> list[str]:
    (device,) = agent.spec(key)["devices"]  # type: ignore[arg-type]
    return [n["path"] for n in device["containerEdits"]["deviceNodes"]]


# -- passthrough -------------------------------------------------------------------------------
def test_passthrough_binds_the_gpu_to_vfio_and_gives_it_back(nodes: dict[str, VmNode]) -> None:
    node = nodes["passthrough"]
    gpu = node.bus(L4)
    group = node.binding().iommu_group(gpu)
    claims = Claims(node.source.hostname)
    agent = Agent(node, claims)
    key = claims.add("vm", "gpu-2-vfio")
    assert gpu in node.nvml_buses()
    result = agent.prepare(key)
    assert result.error == ""
    assert node.state().functions[gpu] == (VFIO_PCI, VFIO_PCI, 0)
    assert node.binding().driver(gpu) == VFIO_PCI  # sysfs, read as production reads it
    assert gpu not in node.nvml_buses()  # NVML lost the GPU
    (d,) = result.devices
    assert d.kind == "vfio" and d.pci_bus_id == gpu and d.iommu_group == group is not None
    assert d.vfio_functions == ((gpu, NVIDIA),)
    # no NVIDIA node, no driver files: the VM gets VFIO's container and the group's node
    assert d.cdi_device_ids == (f"k8s.{DRIVER}/claim=uid-vm-gpu-2-vfio",)
    assert spec_nodes(agent, key) == ["/dev/vfio/vfio", f"/dev/vfio/{group}"]
    assert (node.source.driver_root / "dev" / "vfio" / str(group)).exists()
    assert agent.preparer.checkpoint.claims["uid-vm"].devices == (d,)

    assert agent.unprepare(key).error == ""
    assert node.state() == node.free  # back on nvidia, its override cleared
    assert gpu in node.nvml_buses()  # NVML sees it again
    assert node.rebound == [gpu]  # the inventory is read again: advertised for containers
    modes = sharing(node.source.sim.state_dir, PASSTHROUGH_MODEL).gpus
    assert modes[L4].persistence_mode == 0  # turned off for the VM


def test_passthrough_binds_every_function_of_the_gpu_and_gives_each_its_driver(
    tmp_path: Path,
) -> None:
    """A GPU with an audio function (``.1``) in its IOMMU group: both go to vfio-pci and each
    back to the driver it had. The simulated boards have no audio function, so this one runs
    on the hand-built tree and fake kernel of tests/pcihost. The daemon is told ``handing``
    while the GPU is still on nvidia (telemetry stops reading it before its reads fail),
    ``handed`` once its whole group is on vfio-pci (the inventory is read again), ``handing``
    again before it is given back and ``rebound`` once it is back on nvidia."""
    from agent.pcihost.binding import PciBinding

    gpu, audio = "0000:1b:00.0", "0000:1b:00.1"
    tree = SysTree(tmp_path)
    tree.add_driver(VFIO_PCI)
    tree.add_function(gpu, group=12)
    tree.add_function(audio, device=0x22BA, driver="snd_hda_intel", group=12)
    binding = PciBinding(tree.sys, tree.driver_root, FakeKernel(tree).write)
    off: list[str] = []
    told: list[tuple[str, str, str | None, str | None]] = []

    def tell(what: str) -> Callable[[str], None]:
        return lambda bdf: told.append((what, bdf, tree.driver_of(gpu), tree.driver_of(audio)))

    tool = Passthrough(
        binding=binding, holders=holders, proc_root=tmp_path / "proc", dev_root=tmp_path,
        sys_root=tree.sys, persistence_off=off.append, visible=lambda b: True,
        rebound=tell("rebound"), handing=tell("handing"), handed=tell("handed"),
        log=logging.getLogger("test.vm"),
    )  # fmt: skip
    functions = tool.functions("gpu-0-vfio", gpu, 0)
    assert functions == ((gpu, NVIDIA), (audio, "snd_hda_intel"))
    tool.take("gpu-0-vfio", gpu, functions)
    assert [(tree.driver_of(f), tree.override_of(f)) for f in (gpu, audio)] == [
        (VFIO_PCI, VFIO_PCI)
    ] * 2
    assert off == [gpu]
    tool.give_back("gpu-0-vfio", gpu, functions)
    assert [(tree.driver_of(f), tree.override_of(f)) for f in (gpu, audio)] == [
        (NVIDIA, "(null)"),
        ("snd_hda_intel", "(null)"),
    ]
    assert told == [
        ("handing", gpu, NVIDIA, "snd_hda_intel"),
        ("handed", gpu, VFIO_PCI, VFIO_PCI),
        ("handing", gpu, VFIO_PCI, VFIO_PCI),  # on its way back: NVML's indexes shift again
        ("rebound", gpu, NVIDIA, "snd_hda_intel"),
    ]


def test_passthrough_is_refused_while_a_process_holds_the_gpu(nodes: dict[str, VmNode]) -> None:
    node = nodes["passthrough"]
    pid = int(node.fault("hold-gpu", "--gpu", str(L4)))
    try:
        claims = Claims(node.source.hostname)
        agent = Agent(node, claims)
        result = agent.prepare(claims.add("vm", "gpu-2-vfio"))
        assert f"pid {pid} (sleep)" in result.error and f"/dev/nvidia{L4}" in result.error
        assert node.state() == node.free
        assert agent.preparer.checkpoint.claims == {}
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_group_with_a_foreign_function_is_refused_naming_it(nodes: dict[str, VmNode]) -> None:
    node = nodes["passthrough"]
    node.fault("foreign-in-group", "--gpu", str(L4))  # an NVMe drive in the GPU's group
    (nvme,) = set(node.state().functions) - set(node.free.functions)
    before = node.state()
    claims = Claims(node.source.hostname)
    agent = Agent(node, claims)
    result = agent.prepare(claims.add("vm", "gpu-2-vfio"))
    group = node.binding().iommu_group(node.bus(L4))
    assert nvme in result.error and f"IOMMU group {group}" in result.error
    assert node.binding().driver(nvme) == "nvme"
    assert node.state() == before


def test_unprepare_waits_bounded_until_nvml_sees_the_gpu(nodes: dict[str, VmNode]) -> None:
    """The GPU bound back to nvidia is polled until NVML lists it, on an injected clock; never
    seen, the unprepare fails saying so and keeps the claim (the kubelet retries)."""
    node = nodes["passthrough"]
    gpu = node.bus(L4)
    seen = iter([False, False, True])
    clock, sleeps = FakeClock(step=1.0), list[float]()
    passthrough = functools.partial(
        Passthrough,
        binding=node.binding(), holders=holders, proc_root=node.source.proc_root,
        dev_root=node.source.driver_root, sys_root=node.source.sysfs_root,
        persistence_off=lambda b: None, rebound=node.rebound.append,
        log=logging.getLogger("test.vm"), timeout_s=10.0,
    )  # fmt: skip
    tool = passthrough(visible=lambda b: next(seen), clock=clock, sleep=sleeps.append, poll_s=0.5)
    functions = tool.functions("gpu-2-vfio", gpu, L4)
    tool.take("gpu-2-vfio", gpu, functions)
    tool.give_back("gpu-2-vfio", gpu, functions)
    assert sleeps == [0.5, 0.5]
    tool.take("gpu-2-vfio", gpu, functions)
    never = passthrough(visible=lambda b: False, clock=FakeClock(step=1.0), sleep=lambda s: None)
    with pytest.raises(Exception, match="NVML does not see it after 10 s") as info:
        never.give_back("gpu-2-vfio", gpu, functions)
    assert getattr(info.value, "reason", "") == "gpu_not_back"


def test_a_vm_claim_is_refused_clearly_without_virtualization(nodes: dict[str, VmNode]) -> None:
    node = nodes["passthrough"]
    claims = Claims(node.source.hostname)
    agent = Agent(node, claims, vm=False)
    result = agent.prepare(claims.add("vm", "gpu-2-vfio"))
    assert "--virtualization passthrough" in result.error
    assert node.state() == node.free


# -- vGPU --------------------------------------------------------------------------------------
def test_a_vgpu_on_a_free_vf_is_made_and_cleared(nodes: dict[str, VmNode]) -> None:
    node = nodes["vf"]
    claims = Claims(node.source.hostname)
    agent = Agent(node, claims)
    a = claims.add("a", f"gpu-0-vgpu-{H200_35C}-0")
    b = claims.add("b", f"gpu-0-vgpu-{H200_35C}-1")
    ra, rb = agent.prepare(a), agent.prepare(b)
    assert ra.error == rb.error == ""
    vfs = [vf_bus(node.bus(0), n) for n in (0, 1)]
    assert [d.pci_bus_id for d in (*ra.devices, *rb.devices)] == vfs  # one VF each
    state = node.state()
    assert [state.functions[vf] for vf in vfs] == [(NVIDIA, None, H200_35C)] * 2
    assert [node.vgpu_host().current_type(vf) for vf in vfs] == [H200_35C] * 2  # sysfs
    group = node.binding().iommu_group(vfs[0])
    assert spec_nodes(agent, a) == ["/dev/vfio/vfio", f"/dev/vfio/{group}"]  # the VF's group
    assert agent.unprepare(a).error == agent.unprepare(b).error == ""
    assert node.state() == node.free


def test_a_homogeneous_gpu_offers_and_takes_one_vgpu_type_at_a_time(
    nodes: dict[str, VmNode],
) -> None:
    """Once a vGPU exists on a GPU, the agent advertises only its type there (read again at
    once, not at the next periodic rediscovery), and every type again once it is gone; a claim
    the scheduler allocated from the slice before is refused, naming the type there."""
    node = nodes["vf"]
    claims = Claims(node.source.hostname)
    agent = Agent(node, claims)

    def offered() -> set[int]:
        return {
            d.vgpu_type.type_id
            for d in agent.devices().devices
            if d.vgpu_type is not None and d.bus_id == node.bus(0)
        }

    every = offered()
    assert {H200_35C, H200_70C} <= every
    before_any = agent.model
    a = claims.add("a", f"gpu-0-vgpu-{H200_35C}-0")
    b = claims.add("b", f"gpu-0-vgpu-{H200_70C}-0")
    assert agent.prepare(a).error == ""
    assert offered() == {H200_35C}
    state = node.state()
    assert "is not advertised" in agent.prepare(b).error
    agent.model = before_any  # the slice the scheduler allocated ``b`` from
    result = agent.prepare(b)
    assert f"type {H200_35C}" in result.error and "one type" in result.error
    assert node.state() == state
    assert agent.unprepare(a).error == ""
    assert offered() == every
    assert agent.prepare(b).error == ""


def test_an_mdev_vgpu_is_created_with_a_recorded_uuid_and_removed(
    nodes: dict[str, VmNode],
) -> None:
    node = nodes["mdev"]
    claims = Claims(node.source.hostname)
    agent = Agent(node, claims)
    key = claims.add("t4", f"gpu-0-vgpu-{T4_1Q}-0")
    result = agent.prepare(key)
    assert result.error == ""
    (d,) = result.devices
    assert d.mdev_uuid is not None and d.pci_bus_id == node.bus(0)
    assert node.state().mdevs == {(d.mdev_uuid, node.bus(0), T4_1Q)}
    group = node.vgpu_host().mdev_group(d.mdev_uuid)
    assert d.iommu_group == group is not None
    assert spec_nodes(agent, key) == ["/dev/vfio/vfio", f"/dev/vfio/{group}"]
    assert agent.unprepare(key).error == ""
    assert node.state() == node.free


# -- containers and VMs never share a GPU ------------------------------------------------------
@pytest.mark.parametrize(("first", "second"), [("gpu-2", "gpu-2-vfio"), ("gpu-2-vfio", "gpu-2")])
def test_a_gpu_serves_vms_or_containers_whatever_the_order(
    nodes: dict[str, VmNode], first: str, second: str
) -> None:
    """(A vGPU node advertises no whole GPU for containers: tests/dra_driver/test_vm_devices.)"""
    node = nodes["passthrough"]
    claims = Claims(node.source.hostname)
    agent = Agent(node, claims)
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
        ("gpu-2-vfio", "after-started"),
        ("gpu-2-vfio", "after-vfio-unbind"),
        ("gpu-2-vfio", "after-vfio-bind"),
        ("gpu-2-vfio", "after-cdi"),
        ("gpu-2-vfio", "after-completed"),
        ("gpu-0-vgpu-1430-0", "after-vgpu-create"),
        ("gpu-0-vgpu-1430-0", "after-cdi"),
        ("gpu-0-vgpu-230-0", "after-vgpu-create"),
        ("gpu-0-vgpu-230-0", "after-completed"),
    ],
)
def test_a_crash_in_prepare_leaves_the_node_equal_to_the_checkpoint_after_the_start(
    nodes: dict[str, VmNode], device: str, point: str
) -> None:
    node = nodes[NODE_OF[device]]
    claims = Claims(node.source.hostname)
    agent = Agent(node, claims)
    key = claims.add("vm", device)
    agent.crash_at = point
    with pytest.raises(Crash):
        agent.prepare(key)
    agent.restart()
    cp = agent.preparer.checkpoint
    assert node.state() == expected(node, cp)
    completed = point == "after-completed"
    assert (key.uid in cp.claims) == completed  # a started claim is rolled back
    assert agent.prepare(key).error == ""  # the kubelet's retry
    assert node.state() == expected(node, agent.preparer.checkpoint) != node.free
    assert agent.unprepare(key).error == ""
    assert node.state() == node.free


@pytest.mark.parametrize("device", sorted(NODE_OF))
@pytest.mark.parametrize("point", ["after-unprepare-undo", "after-unprepare-commit"])
def test_a_crash_in_unprepare_is_repaired_by_the_start_and_the_retry(
    nodes: dict[str, VmNode], device: str, point: str
) -> None:
    node = nodes[NODE_OF[device]]
    claims = Claims(node.source.hostname)
    agent = Agent(node, claims)
    key = claims.add("vm", device)
    assert agent.prepare(key).error == ""
    agent.crash_at = point
    with pytest.raises(Crash):
        agent.unprepare(key)
    agent.restart()  # after the undo, still recorded: made whole again until the retry
    assert node.state() == expected(node, agent.preparer.checkpoint)
    assert agent.unprepare(key).error == ""
    assert node.state() == node.free


def test_the_start_gives_back_what_no_claim_records(nodes: dict[str, VmNode]) -> None:
    """A GPU bound to vfio-pci through its override and vGPUs (a VF's type, an mdev), with no
    claim (a lost checkpoint): the start gives them back; a GPU an administrator bound to
    vfio-pci without an override is left alone. The agent ran on each node before (so its
    discovery's cache knows the GPU NVML no longer lists)."""
    pt, vf, mdev = nodes["passthrough"], nodes["vf"], nodes["mdev"]
    for node in (pt, vf, mdev):
        Agent(node, Claims(node.source.hostname)).preparer.close(0)
    binding, gpu = pt.binding(), pt.bus(L4)
    binding.unbind(gpu)
    binding.bind(gpu, VFIO_PCI)
    vf.vgpu_host().set_type(vf_bus(vf.bus(1), 3), H200_70C)
    mdev.vgpu_host().create_mdev(mdev.bus(1), T4_1Q, "00000000-0000-4000-8000-00000000beef")
    for node in (pt, vf, mdev):
        assert node.state() != node.free
        Agent(node, Claims(node.source.hostname))
        assert node.state() == node.free
    binding.unbind(gpu)
    binding.bind(gpu, VFIO_PCI)
    binding.release_override(gpu)  # bound by hand, not by a prepare
    Agent(pt, Claims(pt.source.hostname))
    assert pt.binding().driver(gpu) == VFIO_PCI


def test_a_completed_claim_is_bound_again_at_start_if_its_gpu_was_taken_back(
    nodes: dict[str, VmNode],
) -> None:
    node = nodes["passthrough"]
    claims = Claims(node.source.hostname)
    agent = Agent(node, claims)
    key = claims.add("vm", "gpu-2-vfio")
    assert agent.prepare(key).error == ""
    node.binding().unbind(node.bus(L4))  # behind the agent's back
    agent.restart()
    assert agent.preparer.checkpoint.claims[key.uid].state == PREPARE_COMPLETED
    assert node.state() == expected(node, agent.preparer.checkpoint)
