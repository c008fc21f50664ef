"""The simulated node's hot-plug and admin MIG changes: NVML, sysfs and udev as a real node has
them, seen from other processes, and refused where the real tools refuse."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pynvml
import pytest

from agent.cli import main
from agent.hotplug import PciEvent
from agent.node import discover
from agent.sim.model import load_model
from agent.sim.node import simulated_node
from agent.sim.nvml import FakeNvml
from agent.sim.udev import EVENT_LOG, SimUdevSource, add_gpu, remove_gpu


def fault(state: Path, *args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["sim", "fault", "--state-dir", str(state), *args], {}, out, err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def h100(tmp_path: Path):
    """A simulated dgx-h100 as the agent opens it (sysfs written under <state>/sim/sys)."""
    source = simulated_node("dgx-h100", tmp_path)
    source.nvml.init()
    yield tmp_path, source
    source.nvml.shutdown()


def test_a_removed_gpu_leaves_nvml_sysfs_and_udev_as_on_a_real_node(h100):
    state, source = h100
    fake: FakeNvml = source.sim
    gpu3 = fake.model.gpus[3]
    old_handle = fake.nvmlDeviceGetHandleByIndex(3)
    events = SimUdevSource(state / "sim", wait=lambda s: None)  # opened before: sees what follows
    sysfs = state / "sim" / "sys"
    assert (sysfs / "bus" / "pci" / "devices" / gpu3.bus).is_symlink()
    device_dir = (sysfs / "bus" / "pci" / "devices" / gpu3.bus).resolve()

    code, out, err = fault(state, "remove-gpu", "--gpu", "3")
    assert (code, out) == (0, "GPU 3 removed from the PCI bus\n"), err

    # NVML (this process's FakeNvml sees the other process's change at its next call)
    assert fake.nvmlDeviceGetCount() == 7
    h = fake.nvmlDeviceGetHandleByIndex(3)
    assert fake.nvmlDeviceGetUUID(h) == fake.model.gpus[4].uuid  # indexes shift...
    assert fake.nvmlDeviceGetIndex(h) == 3
    assert fake.nvmlDeviceGetMinorNumber(h) == 4  # ...minor numbers do not
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetUUID(old_handle)
    with pytest.raises(pynvml.NVMLError_NotFound):
        fake.nvmlDeviceGetHandleByUUID(gpu3.uuid)
    with pytest.raises(pynvml.NVMLError_NotFound):
        fake.nvmlDeviceGetHandleByPciBusId(gpu3.bus)
    # sysfs: the function and its link are gone, the bridge above it stays
    assert not (sysfs / "bus" / "pci" / "devices" / gpu3.bus).exists()
    assert not device_dir.exists() and device_dir.parent.is_dir()
    # udev: unbind, then remove
    assert events.poll(0) == [PciEvent("unbind", gpu3.bus), PciEvent("remove", gpu3.bus)]
    # discovery reads the node without it
    inv = discover(source)
    assert [g.device.minor for g in inv.gpus] == [0, 1, 2, 4, 5, 6, 7]

    code, out, _ = fault(state, "remove-gpu", "--gpu", "3")
    assert (code, out) == (0, "GPU 3 was already removed\n")
    assert events.poll(0) == []  # nothing happened, no event

    code, out, err = fault(state, "add-gpu", "--gpu", "3")
    assert (code, out) == (0, "GPU 3 added to the PCI bus\n"), err
    assert fake.nvmlDeviceGetCount() == 8
    assert fake.nvmlDeviceGetUUID(fake.nvmlDeviceGetHandleByIndex(3)) == gpu3.uuid
    assert fake.nvmlDeviceGetUUID(old_handle) == gpu3.uuid  # the same GPU's handle works again
    assert (sysfs / "bus" / "pci" / "devices" / gpu3.bus).resolve() == device_dir
    assert events.poll(0) == [PciEvent("add", gpu3.bus), PciEvent("bind", gpu3.bus)]
    assert [(g.device.index, g.device.minor) for g in discover(source).gpus] == [
        (i, i) for i in range(8)
    ]


def test_the_removed_gpus_survive_a_restart_of_the_simulated_node(tmp_path: Path):
    source = simulated_node("dgx-h100", tmp_path)
    remove_gpu(source.sim, 5)
    again = simulated_node("dgx-h100", tmp_path)  # e.g. the agent restarts
    again.nvml.init()
    try:
        assert [g.device.minor for g in discover(again).gpus] == [0, 1, 2, 3, 4, 6, 7]
    finally:
        again.nvml.shutdown()
    assert add_gpu(again.sim, 5) and not add_gpu(again.sim, 5)


def test_the_event_source_starts_at_the_end_and_waits_for_whole_lines(tmp_path: Path):
    sim_dir = tmp_path / "sim"
    sim_dir.mkdir()
    log = sim_dir / EVENT_LOG
    old = {"ACTION": "remove", "PCI_ID": "10DE:2330", "PCI_SLOT_NAME": "0000:1b:00.0"}
    log.write_text(json.dumps(old) + "\n")
    waits: list[float] = []
    source = SimUdevSource(sim_dir, wait=waits.append, clock=lambda: float(len(waits)))
    assert source.poll(0.2) == [] and waits  # what was there before is not news
    new = {"ACTION": "add", "PCI_ID": "10DE:2330", "PCI_SLOT_NAME": "0000:1B:00.0"}
    line = json.dumps(new) + "\n"
    with log.open("a") as f:
        f.write(line[:10])
    assert source.poll(0) == []  # half a line: not yet
    with log.open("a") as f:
        f.write(line[10:] + json.dumps({**new, "PCI_ID": "15B3:1021"}) + "\n")
    assert source.poll(0) == [PciEvent("add", "0000:1b:00.0")]  # the NIC's event is not ours


def test_an_admin_mig_change_is_made_on_one_gpu_and_emits_no_event(tmp_path: Path):
    source = simulated_node("dgx-a100", tmp_path)
    events = SimUdevSource(tmp_path / "sim", wait=lambda s: None)
    code, out, err = fault(tmp_path, "mig-layout", "--gpu", "2", "--layout", "all-1g")
    assert (code, out) == (0, "GPU 2: MIG layout all-1g created\n"), err
    state = source.sim.state
    assert [gi.profile_id for gi in state.gpus[2].gpu_instances] == [19] * 7
    assert len(state.gpus[1].gpu_instances) == 4  # the others keep the balanced layout
    source.nvml.init()
    try:
        gpu2 = discover(source).gpus[2].device
        assert [i.profile_name for i in gpu2.mig_instances] == ["1g.5gb"] * 7
    finally:
        source.nvml.shutdown()
    assert events.poll(0) == []


@pytest.mark.parametrize(
    ("model", "args", "message"),
    [
        ("dgx-h100", ("--gpu", "0", "--layout", "all-1g"), "MIG mode is disabled on GPU 0"),
        ("l40s-pcie", ("--gpu", "0", "--layout", "all-1g"), "does not support MIG"),
        ("dgx-a100", ("--gpu", "0", "--layout", "half"), "allowed: balanced, all-1g, all-7g"),
        ("dgx-a100", ("--gpu", "9", "--layout", "all-1g"), "GPU index 9 does not exist"),
    ],
)
def test_mig_changes_the_real_tool_refuses_are_refused_in_one_line(tmp_path, model, args, message):
    simulated_node(model, tmp_path)
    before = (tmp_path / "sim" / "nvml-state.json").read_bytes()
    code, out, err = fault(tmp_path, "mig-layout", *args)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1, err
    assert (tmp_path / "sim" / "nvml-state.json").read_bytes() == before


def test_mig_instances_in_use_by_processes_are_not_destroyed(tmp_path: Path):
    simulated_node("dgx-a100", tmp_path)
    out, err = io.StringIO(), io.StringIO()
    argv = ["sim", "process", "--state-dir", str(tmp_path), "start", "--gpu", "1", "--gi", "1"]
    assert main(argv, {}, out, err) == 0, err.getvalue()
    pid = out.getvalue().split()[1]
    code, _, err2 = fault(tmp_path, "mig-layout", "--gpu", "1", "--layout", "all-7g")
    assert code == 2 and f"in use by processes {pid}" in err2
    code, _, _ = fault(tmp_path, "mig-layout", "--gpu", "0", "--layout", "all-7g")
    assert code == 0  # another GPU is free


def test_a_removed_gpu_cannot_be_reconfigured(tmp_path: Path):
    source = simulated_node("dgx-a100", tmp_path)
    remove_gpu(source.sim, 4)
    code, _, err = fault(tmp_path, "mig-layout", "--gpu", "4", "--layout", "all-1g")
    assert code == 2 and "not on the PCI bus" in err


def test_unknown_gpus_are_refused_for_remove_and_add(tmp_path: Path):
    simulated_node("l40s-pcie", tmp_path)
    n = len(load_model("l40s-pcie").gpus)
    for action in ("remove-gpu", "add-gpu"):
        code, _, err = fault(tmp_path, action, "--gpu", str(n))
        assert code == 2 and f"GPU index {n} does not exist" in err, err


def test_a_rebind_brings_a_lost_gpu_back_and_udev_sees_unbind_then_bind(h100):
    state, source = h100
    fake: FakeNvml = source.sim
    gpu2 = fake.model.gpus[2]
    events = SimUdevSource(state / "sim", wait=lambda s: None)
    fake.lose_gpu(2)
    code, out, err = fault(state, "rebind", "--gpu", "2")
    assert code == 0, err
    assert out == "GPU 2 unbound from the driver and bound again (udev: unbind, bind)\n"
    assert fake.nvmlDeviceGetUUID(fake.nvmlDeviceGetHandleByIndex(2)) == gpu2.uuid  # answers
    assert fake.nvmlDeviceGetCount() == 8  # enumeration unchanged
    assert list(events.poll(0)) == [PciEvent("unbind", gpu2.bus), PciEvent("bind", gpu2.bus)]


def test_a_gpu_off_the_bus_cannot_be_rebound(h100):
    state, _ = h100
    assert fault(state, "remove-gpu", "--gpu", "1")[0] == 0
    code, _, err = fault(state, "rebind", "--gpu", "1")
    assert code == 2 and "GPU 1 is not on the PCI bus" in err and "add-gpu" in err
