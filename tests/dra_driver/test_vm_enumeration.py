"""Handing several GPUs to virtual machines at once (dra_driver/vm/passthrough.py, "One GPU
leaves or rejoins nvidia at a time"): finding a GPU in NVML's enumeration reads every index,
and those shift while another GPU leaves the nvidia driver, so no scan overlaps an unbind.
The crash matrix's ``passthrough/after-started/batch`` failed a claim this way: its scan read a
neighbour mid-unbind as lost."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from agent.pcihost.binding import PciBinding
from agent.pcihost.vm_types import NVIDIA, VFIO_PCI
from dra_driver.vm.passthrough import Passthrough
from tests.pcihost.sysfstree import FakeKernel, SysTree

A, B = "0000:1b:00.0", "0000:2b:00.0"


class SlowUnbind(PciBinding):
    """A's unbind from nvidia waits until the test lets it finish (a driver tearing down)."""

    def __init__(self, tree: SysTree) -> None:
        super().__init__(tree.sys, tree.driver_root, FakeKernel(tree).write)
        self.unbinding = threading.Event()
        self.finish = threading.Event()

    def unbind(self, bdf: str) -> None:
        if bdf == A:
            self.unbinding.set()
            assert self.finish.wait(30)
        super().unbind(bdf)
        if bdf == A:
            self.unbinding.clear()


def test_no_gpu_is_looked_up_in_nvml_while_another_leaves_nvidia(tmp_path: Path) -> None:
    tree = SysTree(tmp_path)
    tree.add_driver(VFIO_PCI)
    tree.add_function(A, group=12)
    tree.add_function(B, group=13)
    binding = SlowUnbind(tree)
    scanned_during_unbind: list[str] = []
    b_scanned = threading.Event()

    def persistence_off(bus_id: str) -> None:  # finds the GPU by reading every NVML index
        if binding.unbinding.is_set():
            scanned_during_unbind.append(bus_id)
        if bus_id == B:
            b_scanned.set()

    tool = Passthrough(
        binding=binding, holders=lambda root, paths: [], proc_root=tmp_path / "proc",
        dev_root=tmp_path, sys_root=tree.sys, persistence_off=persistence_off,
        visible=lambda b: True, rebound=lambda b: None, log=logging.getLogger("test.vm"),
    )  # fmt: skip
    takes = [
        threading.Thread(target=tool.take, args=(f"gpu-{n}-vfio", bdf, ((bdf, NVIDIA),)))
        for n, bdf in enumerate((A, B))
    ]
    takes[0].start()
    try:
        assert binding.unbinding.wait(10)  # A is leaving nvidia
        takes[1].start()
        # B's lookup waits for A's unbind (a bounded look: it never comes while A is unbinding)
        assert not b_scanned.wait(0.3)
    finally:
        binding.finish.set()
        for t in takes:
            if t.ident is not None:  # started
                t.join(10)
    assert b_scanned.is_set() and scanned_during_unbind == []
    assert [tree.driver_of(f) for f in (A, B)] == [VFIO_PCI, VFIO_PCI]
