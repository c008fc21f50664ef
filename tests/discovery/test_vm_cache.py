"""vm-gpus.json: a GPU's lasting facts survive the round trip; passing state does not count as a
change (so a steady node never rewrites the file)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from agent.discovery.vm_cache import CacheUnreadable, decode, encode, lasting_facts, load, save
from agent.nvml.types import (
    GpuDevice,
    MemoryInfo,
    MigInstance,
    MigMode,
    MigProfile,
    NvLink,
    Placement,
    PowerLimits,
)

PROFILE = MigProfile(19, 0, "1g.18gb", 1, 18 << 30, 16, 1, 1, 0, 1, 0, 7, (Placement(0, 1),))
H200 = GpuDevice(
    index=2,
    minor=2,
    uuid="GPU-0b3c6f4e-0000-4000-8000-000000000002",
    name="NVIDIA H200",
    brand="NVIDIA",
    architecture="Hopper",
    compute_capability=(9, 0),
    pci_bus_id="0000:3b:00.0",
    pci_device_id=0x233510DE,
    serial="1650924060002",
    memory=MemoryInfo(total=141 << 30, free=100 << 30, used=41 << 30, reserved=512 << 20),
    mig_mode=MigMode(current=True, pending=True),
    mig_profiles=(PROFILE,),
    mig_instances=(MigInstance(1, 0, 19, "1g.18gb", Placement(0, 1), "MIG-1", 18 << 30, 16),),
    nvlinks=(NvLink(0, True, None, "switch"),),
    power_limits=PowerLimits(200_000, 700_000, 700_000),
)


def test_lasting_facts_round_trip_and_drop_what_only_holds_on_nvidia() -> None:
    back = decode(encode({H200.pci_bus_id: H200}))[H200.pci_bus_id]
    assert back == lasting_facts(H200)
    assert (back.index, back.mig_instances, back.nvlinks) == (-1, (), ())
    assert back.memory == MemoryInfo(141 << 30, 141 << 30, 0, 512 << 20)
    assert back.mig_profiles == (PROFILE,) and back.power_limits == H200.power_limits
    busy = replace(H200, index=0, memory=replace(H200.memory, used=1, free=2), mig_instances=())
    assert encode({H200.pci_bus_id: busy}) == encode({H200.pci_bus_id: H200})


def test_save_writes_only_a_change(tmp_path: Path) -> None:
    path = tmp_path / "state" / "vm-gpus.json"
    assert save(path, {H200.pci_bus_id: H200}) is True
    assert save(path, {H200.pci_bus_id: replace(H200, index=5)}) is False
    assert save(path, {H200.pci_bus_id: replace(H200, serial="x")}) is True
    assert load(path)[H200.pci_bus_id].serial == "x"
    assert load(tmp_path / "absent.json") == {}


@pytest.mark.parametrize(
    "data", [b"", b"[]", b'{"version": 2, "gpus": {}}', b'{"version": 1, "gpus": {"b": {}}}']
)
def test_anything_else_is_unreadable_never_half_trusted(data: bytes) -> None:
    with pytest.raises(CacheUnreadable):
        decode(data)
