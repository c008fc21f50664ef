"""The doctor's checks for GPUs handed to VMs, on hand-built sysfs trees laid out as Linux lays
them out (docs/gpu-facts.md, "GPUs for virtual machines"): each check passes on a ready node and
fails, with its fix, on the node an admin gets wrong."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.doctor import Facts, diagnose
from agent.doctor.verdict import Verdict
from agent.doctor.vm_checks import (
    check_iommu,
    check_iommu_group,
    check_sriov,
    check_vfio_pci,
    check_vgpu_types,
    nvidia_gpus,
    virtualization_checks,
)
from agent.sim.node import simulated_node

GPU = "0000:1b:00.0"
AUDIO = "0000:1b:00.1"


class Sysfs:
    """A sysfs tree under ``root``: functions under ``devices/pci0000:00`` with their
    ``bus/pci/devices`` links, IOMMU groups, drivers, SR-IOV and vGPU files."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "bus" / "pci" / "devices").mkdir(parents=True)
        (root / "bus" / "pci" / "drivers").mkdir(parents=True)

    def function(
        self,
        bdf: str,
        *,
        vendor: str = "0x10de",
        device: str = "0x2335",
        pci_class: str = "0x030200",
        driver: str | None = "nvidia",
        group: int | None = None,
        physfn: str | None = None,
    ) -> Path:
        where = self.root / "devices" / "pci0000:00" / bdf
        where.mkdir(parents=True)
        (where / "vendor").write_text(vendor + "\n")
        (where / "device").write_text(device + "\n")
        (where / "class").write_text(pci_class + "\n")
        os.symlink(f"../../../devices/pci0000:00/{bdf}", self.root / "bus/pci/devices" / bdf)
        if driver is not None:
            self.driver(driver)
            os.symlink(f"../../../bus/pci/drivers/{driver}", where / "driver")
        if group is not None:
            members = self.root / "kernel" / "iommu_groups" / str(group) / "devices"
            members.mkdir(parents=True, exist_ok=True)
            os.symlink(f"../../../../devices/pci0000:00/{bdf}", members / bdf)
            os.symlink(f"../../../kernel/iommu_groups/{group}", where / "iommu_group")
        if physfn is not None:
            os.symlink(f"../{physfn}", where / "physfn")
        return where

    def driver(self, name: str) -> None:
        (self.root / "bus" / "pci" / "drivers" / name).mkdir(exist_ok=True)

    def sriov(self, pf: str, total: int, vfs: int) -> list[Path]:
        """The PF's SR-IOV files and ``vfs`` enabled virtual functions (``virtfn<N>``)."""
        where = self.root / "bus" / "pci" / "devices" / pf
        (where / "sriov_totalvfs").write_text(f"{total}\n")
        (where / "sriov_numvfs").write_text(f"{vfs}\n")
        bus = pf.rsplit(":", 1)[0]
        made = []
        for n in range(vfs):
            vf = f"{bus}:{(n + 4) // 8:02x}.{(n + 4) % 8}"
            vf_dir = self.function(vf, device="0x2336", group=100 + n, physfn=pf)
            os.symlink(f"../{vf}", where / f"virtfn{n}")
            made.append(vf_dir)
        return made


def vgpu_files(vf: Path, creatable: str, current: int = 0) -> None:
    (vf / "nvidia").mkdir()
    (vf / "nvidia" / "creatable_vgpu_types").write_text(creatable)
    (vf / "nvidia" / "current_vgpu_type").write_text(f"{current}\n")


@pytest.fixture
def sysfs(tmp_path: Path) -> Sysfs:
    return Sysfs(tmp_path / "sys")


def by_check(verdicts: list[Verdict]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for v in verdicts:
        out.setdefault(v.check, []).append(v.status)
    return out


# -- the IOMMU and vfio-pci ---------------------------------------------------------------------


def test_iommu_groups_present_pass(sysfs):
    sysfs.function(GPU, group=12)
    v = check_iommu(sysfs.root)
    assert v.status == "ok" and "1 IOMMU groups" in v.detail


@pytest.mark.parametrize("empty_dir", [True, False])
def test_no_iommu_groups_fail_naming_the_kernel_parameters(sysfs, empty_dir):
    sysfs.function(GPU)
    if empty_dir:
        (sysfs.root / "kernel" / "iommu_groups").mkdir(parents=True)
    v = check_iommu(sysfs.root)
    assert v.status == "fail"
    assert ("is empty" if empty_dir else "does not exist") in v.detail
    for word in ("VT-d", "AMD-Vi", "intel_iommu=on", "iommu=pt", "reboot"):
        assert word in v.fix


def test_vfio_pci_loaded_passes_by_its_driver_directory_or_its_module(sysfs):
    assert check_vfio_pci(sysfs.root, "passthrough").status == "fail"
    (sysfs.root / "module" / "vfio_pci").mkdir(parents=True)
    assert check_vfio_pci(sysfs.root, "passthrough").status == "ok"
    sysfs.driver("vfio-pci")
    v = check_vfio_pci(sysfs.root, "passthrough")
    assert v.status == "ok" and "drivers/vfio-pci" in v.detail


def test_vfio_pci_missing_fails_with_modprobe(sysfs):
    v = check_vfio_pci(sysfs.root, "passthrough")
    assert v.status == "fail"
    assert v.fix.startswith("modprobe vfio-pci")
    assert "modules-load.d" in v.fix


def test_vfio_pci_is_not_asked_for_on_a_vgpu_node(sysfs):
    assert check_vfio_pci(sysfs.root, "vgpu").status == "skip"


# -- the GPU's IOMMU group (passthrough) ---------------------------------------------------------


def test_a_group_of_the_gpu_and_its_audio_function_passes(sysfs):
    sysfs.function(GPU, group=12)
    sysfs.function(AUDIO, pci_class="0x040300", driver="snd_hda_intel", group=12)
    v = check_iommu_group(sysfs.root, GPU)
    assert v.status == "ok" and v.subject == f"GPU {GPU}"
    assert f"{GPU}, {AUDIO}" in v.detail


def test_a_foreign_function_in_the_group_fails_naming_it(sysfs):
    sysfs.function(GPU, group=12)
    sysfs.function("0000:1a:00.0", vendor="0x8086", device="0x1234", pci_class="0x010802",
                   driver="nvme", group=12)  # fmt: skip
    v = check_iommu_group(sysfs.root, GPU)
    assert v.status == "fail"
    assert "0000:1a:00.0 (0x8086:0x1234, class 0x010802, nvme)" in v.detail
    assert "ACS" in v.fix and "--virtualization-gpus" in v.fix


def test_a_gpu_without_a_group_fails(sysfs):
    sysfs.function(GPU)
    v = check_iommu_group(sysfs.root, GPU)
    assert v.status == "fail" and "no IOMMU group" in v.detail
    assert "intel_iommu=on" in v.fix


# -- SR-IOV and the vGPU host driver (vgpu) -----------------------------------------------------


def test_virtual_functions_enabled_pass(sysfs):
    sysfs.function(GPU, group=12)
    sysfs.sriov(GPU, total=16, vfs=2)
    v = check_sriov(sysfs.root, GPU)
    assert v.status == "ok" and v.detail == "2 of 16 virtual functions enabled"


def test_virtual_functions_off_fail_with_sriov_manage(sysfs):
    sysfs.function(GPU, group=12)
    sysfs.sriov(GPU, total=16, vfs=0)
    v = check_sriov(sysfs.root, GPU)
    assert v.status == "fail" and "sriov_numvfs 0 of 16" in v.detail
    assert v.fix.startswith(f"/usr/lib/nvidia/sriov-manage -e {GPU}")


def test_sriov_is_not_needed_for_mediated_devices_on_the_gpu(sysfs):
    gpu = sysfs.function(GPU, group=12)
    (gpu / "mdev_supported_types" / "nvidia-222").mkdir(parents=True)
    assert check_sriov(sysfs.root, GPU).status == "ok"
    plain = "0000:3b:00.0"
    sysfs.function(plain, group=13)
    assert check_sriov(sysfs.root, plain).status == "skip"


def test_vf_vgpu_types_pass_and_a_vf_holding_a_vgpu_counts(sysfs):
    sysfs.function(GPU, group=12)
    vf0, vf1 = sysfs.sriov(GPU, total=16, vfs=2)
    vgpu_files(vf0, "", current=1428)  # in use: creatable is empty on it
    vgpu_files(vf1, "1428 : NVIDIA H200X-141C\n")
    v = check_vgpu_types(sysfs.root, GPU)
    assert v.status == "ok"
    assert "2 virtual functions: 1 offer vGPU types, 1 hold a vGPU" in v.detail
    assert "1428 : NVIDIA H200X-141C" in v.detail


def test_mdev_types_on_the_gpu_or_its_vfs_pass(sysfs):
    gpu = sysfs.function(GPU, group=12)
    (gpu / "mdev_supported_types" / "nvidia-222").mkdir(parents=True)
    assert check_vgpu_types(sysfs.root, GPU).status == "ok"
    ampere = "0000:3b:00.0"
    sysfs.function(ampere, group=13)
    (vf,) = sysfs.sriov(ampere, total=16, vfs=1)
    (vf / "mdev_supported_types" / "nvidia-692").mkdir(parents=True)
    v = check_vgpu_types(sysfs.root, ampere)
    assert v.status == "ok" and "nvidia-692" in v.detail


def test_the_data_centre_driver_offers_no_types_and_the_fix_names_the_vgpu_host_driver(sysfs):
    sysfs.function(GPU, group=12)
    v = check_vgpu_types(sysfs.root, GPU)
    assert v.status == "fail" and "not NVIDIA's vGPU host driver" in v.detail
    assert "vGPU host driver" in v.fix


def test_vfs_off_fail_the_types_with_sriov_manage(sysfs):
    sysfs.function(GPU, group=12)
    sysfs.sriov(GPU, total=16, vfs=0)
    v = check_vgpu_types(sysfs.root, GPU)
    assert v.status == "fail" and "not enabled" in v.detail
    assert v.fix.startswith(f"/usr/lib/nvidia/sriov-manage -e {GPU}")


def test_a_gpu_bound_to_another_driver_offers_no_types(sysfs):
    sysfs.function(GPU, driver="vfio-pci", group=12)
    v = check_vgpu_types(sysfs.root, GPU)
    assert v.status == "fail" and "bound to vfio-pci" in v.detail


# -- all together -------------------------------------------------------------------------------


def test_only_gpu_physical_functions_are_checked(sysfs):
    sysfs.function(GPU, group=12)
    sysfs.function(AUDIO, pci_class="0x040300", driver="snd_hda_intel", group=12)
    sysfs.function("0000:1a:00.0", vendor="0x8086", pci_class="0x010802", driver="nvme")
    sysfs.sriov(GPU, total=16, vfs=2)
    assert nvidia_gpus(sysfs.root) == [GPU]


def test_none_runs_no_check(sysfs):
    assert virtualization_checks(sysfs.root, "none") == []


def test_a_ready_passthrough_node_passes_every_check(sysfs):
    sysfs.driver("vfio-pci")
    sysfs.function(GPU, group=12)
    sysfs.function(AUDIO, pci_class="0x040300", driver="snd_hda_intel", group=12)
    sysfs.function("0000:3b:00.0", group=13)
    verdicts = virtualization_checks(sysfs.root, "passthrough")
    assert by_check(verdicts) == {
        "iommu": ["ok"], "vfio-pci": ["ok"], "iommu-group": ["ok", "ok"],
    }  # fmt: skip


def test_a_ready_vgpu_node_passes_and_an_unready_gpu_fails_alone(sysfs):
    sysfs.function(GPU, group=12)
    (vf,) = sysfs.sriov(GPU, total=16, vfs=1)
    vgpu_files(vf, "1414 : NVIDIA H200X-1-18C\n")
    sysfs.function("0000:3b:00.0", group=13)
    sysfs.sriov("0000:3b:00.0", total=16, vfs=0)
    verdicts = virtualization_checks(sysfs.root, "vgpu")
    assert by_check(verdicts) == {
        "iommu": ["ok"], "vfio-pci": ["skip"], "sriov": ["ok", "fail"],
        "vgpu-types": ["ok", "fail"],
    }  # fmt: skip
    assert [v.subject for v in verdicts if v.status == "fail"] == ["GPU 0000:3b:00.0"] * 2


def test_a_node_without_gpus_warns(sysfs):
    (v,) = [v for v in virtualization_checks(sysfs.root, "passthrough") if v.status == "warn"]
    assert v.check == "iommu-group" and "no NVIDIA GPU" in v.detail


# -- in diagnose ---------------------------------------------------------------------------------


def diagnosed(tmp_path: Path, mode: str) -> list[Verdict]:
    """``diagnose`` of a simulated dgx-h100 in standalone mode with ``--virtualization mode``."""
    state = tmp_path / "state"
    source = simulated_node("dgx-h100", state)
    facts = Facts(
        source=source,
        host_root=tmp_path / "host",
        state_dir=state,
        registry_dir=tmp_path / "registry",
        plugins_dir=tmp_path / "plugins",
        cdi_root=tmp_path / "cdi",
        mig_mode="static",
        connect=None,
        stand_in_nodes=True,
        virtualization=mode,
    )
    return diagnose(facts)


def test_diagnose_checks_the_node_for_vms_only_when_asked(tmp_path):
    vm_checks = {"iommu", "vfio-pci", "iommu-group", "sriov", "vgpu-types"}
    assert not vm_checks & {v.check for v in diagnosed(tmp_path / "a", "none")}
    passthrough = diagnosed(tmp_path / "b", "passthrough")
    checks = [v.check for v in passthrough]
    assert {"iommu", "vfio-pci", "iommu-group"} <= set(checks)
    assert checks.index("iommu") > checks.index("device-nodes")  # after the GPU checks
    # every GPU of the node's sysfs is looked at: the model's eight
    assert len([v for v in passthrough if v.check == "iommu-group"]) == 8
    assert {"sriov", "vgpu-types"} <= {v.check for v in diagnosed(tmp_path / "c", "vgpu")}
