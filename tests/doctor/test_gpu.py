"""The doctor's NVML checks: the driver, the NVML file, versions and libraries, MIG mode against
--mig-mode, device nodes; on the simulator's GPUs and on a driver that is not there."""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
from pathlib import Path

import pynvml
import pytest

from agent.doctor.gpu import (
    check_device_nodes,
    check_driver,
    check_mig,
    check_nvml_library,
    check_versions,
    loaded_nvml,
    mapped_file,
)
from agent.node import NodeSource
from agent.nvml.facade import Nvml
from agent.nvml.loader import NvmlLibrary
from agent.nvml.types import GpuDevice, MigMode
from agent.sim.hostroot import write_host_root
from agent.sim.model import load_model
from agent.sim.node import simulated_node
from agent.sim.nvml import FakeNvml


@pytest.fixture
def a100(tmp_path: Path) -> NodeSource:
    return simulated_node("dgx-a100", tmp_path / "state")


def gpus(source: NodeSource) -> tuple[GpuDevice, ...]:
    with source.nvml:
        return source.nvml.devices()


def test_the_simulated_driver_initializes(a100):
    assert check_driver(a100).status == "ok"
    a100.nvml.shutdown()


class NoDriver(FakeNvml):
    def nvmlInit(self) -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)


class Mismatch(FakeNvml):
    def nvmlInit(self) -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH)


def test_no_driver_fails_and_says_where_the_driver_root_should_point(a100, tmp_path):
    source = dataclasses.replace(a100, nvml=Nvml(NoDriver(load_model("dgx-a100"), tmp_path)))
    v = check_driver(source)
    assert v.status == "fail" and "libnvidia-ml.so.1 could not be loaded" in v.detail
    assert "--driver-root" in v.fix and "/run/nvidia/driver" in v.fix
    source = dataclasses.replace(a100, nvml=Nvml(Mismatch(load_model("dgx-a100"), tmp_path)))
    v = check_driver(source)
    assert v.status == "fail" and "NVML code 18" in v.detail and "reboot" in v.fix


def test_the_loaded_nvml_file_is_read_from_the_process_maps():
    libc = ctypes.util.find_library("c")
    assert libc is not None
    ctypes.CDLL(libc)
    found = mapped_file(Path("/proc/self/maps").read_text(), "libc.so")
    assert found is not None and Path(found).is_file()
    maps = "7f0-7f1 r-xp 00000000 fd:01 42  /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.90.07\n"
    assert mapped_file(maps, "libnvidia-ml.so") == (
        "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.90.07"
    )
    assert mapped_file("7f0-7f1 rw-p 00000000 00:00 0 \n", "libnvidia-ml.so") is None


@dataclasses.dataclass(frozen=True)
class ChosenNvml:
    """A node source that says which NVML file it loaded (as the driver-root loader does)."""

    nvml_library: NvmlLibrary
    driver_root: Path
    model: str | None = None


def chosen(path: str, root: Path) -> ChosenNvml:
    return ChosenNvml(NvmlLibrary(path, f"found under the driver root {root}"), root)


def test_a_source_that_names_its_nvml_file_is_believed(tmp_path):
    source = chosen("/driver-root/usr/lib64/libnvidia-ml.so.550.90.07", Path("/driver-root"))
    assert loaded_nvml(source) == source.nvml_library.path
    v = check_nvml_library(source, source.nvml_library.path)
    assert v.status == "ok" and source.nvml_library.path in v.detail


def test_an_nvml_file_outside_the_driver_root_warns(tmp_path):
    source = chosen("/usr/lib/libnvidia-ml.so.1", tmp_path)
    v = check_nvml_library(source, source.nvml_library.path)
    assert v.status == "warn" and "--driver-root" in v.fix


def test_versions_and_the_driver_libraries_under_the_driver_root(a100):
    with a100.nvml:
        system = a100.nvml.system()
    v = check_versions(a100, system)
    assert v.status == "ok" and "driver 550.90.07, CUDA 12.4" in v.detail
    lib = next(a100.driver_root.rglob(f"libcuda.so.{system.driver_version}"))
    lib.unlink()
    v = check_versions(a100, system)
    assert v.status == "fail" and f"libcuda.so.{system.driver_version}" in v.detail
    assert "--driver-root" in v.fix


def mig(gpu: GpuDevice, current: bool, pending: bool, instances: bool = True) -> GpuDevice:
    return dataclasses.replace(
        gpu,
        mig_mode=MigMode(current=current, pending=pending),
        mig_instances=gpu.mig_instances if instances else (),
    )


def test_mig_mode_against_static(a100):
    gpu = gpus(a100)[0]  # an A100 with the model's MIG layout
    assert check_mig(gpu, "static").status == "ok"
    v = check_mig(mig(gpu, True, True, instances=False), "static")
    assert v.status == "warn" and "advertises nothing" in v.detail
    assert "--mig-mode dynamic" in v.fix
    assert check_mig(mig(gpu, False, False, instances=False), "static").status == "ok"
    assert check_mig(dataclasses.replace(gpu, mig_mode=None), "static").detail.endswith(
        "no MIG; advertised whole"
    )


def test_a_pending_mig_mode_warns_with_the_reset_to_apply_it(a100):
    v = check_mig(mig(gpus(a100)[3], False, True, instances=False), "static")
    assert v.status == "warn" and v.subject == "GPU 3"
    assert "pending" in v.detail and "nvidia-smi -r -i 3" in v.fix


def test_dynamic_needs_mig_on_where_switching_takes_a_reset(a100):
    ampere = mig(gpus(a100)[0], False, False, instances=False)
    v = check_mig(ampere, "dynamic")
    assert v.status == "warn" and "only the whole GPU" in v.detail
    hopper = dataclasses.replace(ampere, architecture="Hopper")
    assert check_mig(hopper, "dynamic").status == "ok"  # prepare switches the mode itself


def test_device_nodes_of_the_simulated_host_and_one_missing(a100, tmp_path):
    host = tmp_path / "host"
    write_host_root(load_model("dgx-a100"), host, cdi_dirs=[], kubelet_dirs=[])
    found = gpus(a100)
    assert check_device_nodes(host, a100.driver_root, found, stand_in=True).status == "ok"
    v = check_device_nodes(host, a100.driver_root, found, stand_in=False)
    assert v.status == "fail" and "/dev/nvidiactl not a character device" in v.detail
    (host / "dev" / "nvidia5").unlink()
    inst = found[0].mig_instances[0]
    gi_access = (
        a100.driver_root
        / f"proc/driver/nvidia/capabilities/gpu0/mig/gi{inst.gpu_instance_id}/access"
    )
    minor = gi_access.read_text().split()[1]
    (host / "dev" / "nvidia-caps" / f"nvidia-cap{minor}").unlink()
    v = check_device_nodes(host, a100.driver_root, found, stand_in=True)
    assert v.status == "fail"
    assert "/dev/nvidia5 missing" in v.detail
    assert f"/dev/nvidia-caps/nvidia-cap{minor} missing" in v.detail
    assert "nvidia-modprobe" in v.fix and "--host-root" in v.fix
