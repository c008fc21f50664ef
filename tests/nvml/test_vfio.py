"""NVML's part in handing a GPU to a VM: the GPU found by its bus id, persistence mode off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pynvml

from agent.nvml.facade import Nvml
from agent.nvml.vfio import index_of, persistence_off
from agent.sim.model import load_model
from agent.sim.nvml import FakeNvml


class Persistence:
    """The simulator's NVML with ``nvmlDeviceSetPersistenceMode`` recorded (the simulator has
    no persistence mode of its own yet) or answering NOT_SUPPORTED."""

    def __init__(self, inner: Any, supported: bool = True) -> None:
        self._inner = inner
        self.supported = supported
        self.set: list[tuple[int, int]] = []

    def nvmlDeviceSetPersistenceMode(self, handle: Any, mode: int) -> None:
        if not self.supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self.set.append((self._inner.nvmlDeviceGetIndex(handle), mode))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def nvml(tmp_path: Path, supported: bool = True) -> tuple[Nvml, Persistence]:
    api = Persistence(FakeNvml(load_model("dgx-h100"), tmp_path), supported)
    nv = Nvml(api)  # type: ignore[arg-type]
    nv.init()
    return nv, api


def test_a_gpu_is_found_by_its_sysfs_bus_id_and_absent_is_none(tmp_path: Path) -> None:
    nv, _ = nvml(tmp_path)
    third = nv.device(2)
    assert index_of(nv, third.pci_bus_id) == 2
    assert index_of(nv, "0000:ff:1f.7") is None


def test_persistence_mode_is_turned_off_where_supported(tmp_path: Path) -> None:
    nv, api = nvml(tmp_path)
    assert persistence_off(nv, nv.device(1).pci_bus_id)
    assert api.set == [(1, pynvml.NVML_FEATURE_DISABLED)]
    unsupported, _ = nvml(tmp_path / "b", supported=False)
    assert not persistence_off(unsupported, unsupported.device(0).pci_bus_id)
    assert not persistence_off(nv, "0000:ff:1f.7")  # not listed: nothing to turn off
