"""``tessera sim fault`` actions about GPUs for virtual machines (the tree is in
:mod:`agent.cli.sim`)::

    tessera sim fault --state-dir DIR iommu-off | iommu-on
    tessera sim fault --state-dir DIR vfio-unloaded | vfio-loaded
    tessera sim fault --state-dir DIR foreign-in-group --gpu N
    tessera sim fault --state-dir DIR hold-gpu --gpu N

``iommu-off`` is a node booted without an IOMMU (``kernel/iommu_groups`` empty, no
``iommu_group`` links, no ``/dev/vfio/<N>``); ``vfio-unloaded`` is ``modprobe -r vfio-pci``
(``bus/pci/drivers/vfio-pci`` and ``/dev/vfio`` gone); both are refused, as the kernel refuses
``rmmod`` of a module in use, while a function is bound to vfio-pci. ``foreign-in-group`` puts a
function that is not the GPU's (an NVMe drive at ``<GPU bus>:1f.0``, bound to ``nvme``) into the
GPU's IOMMU group, as a board without ACS isolation would. ``hold-gpu`` starts a sleeping process
with the GPU's ``/dev/nvidia<minor>`` (under the simulated driver root) open and prints its pid:
the NVIDIA unbind lock is not taken while it lives and the simulated ``/proc`` shows its ``fd/0``
(resolving to the node it holds, as a real ``/proc`` fd link does: :mod:`agent.sim.procfs`), so
the agent's holder scan names it; end it with ``kill PID``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from agent.cli.framework import Command, Invocation, Uses
from agent.config import REQUIRED, non_negative_int, setting
from agent.errors import ConfigError

if TYPE_CHECKING:
    from agent.sim.model import GpuSlot
    from agent.sim.nvml import FakeNvml
    from agent.sim.pcikernel import SimPciKernel
    from agent.sim.vmstate import VmState


@dataclass(frozen=True, kw_only=True)
class VmGpuOptions:
    gpu: int = setting(
        REQUIRED,
        "GPU index in the node model (its /dev/nvidia<minor>; NVML's index while every GPU is on"
        " the nvidia driver).",
        metavar="N",
        parse=non_negative_int,
    )


OpenSimulator = Callable[[Invocation], "FakeNvml"]
"""How a command opens the simulator of its ``--state-dir`` (``agent.cli.sim``'s)."""


def _kernel(open_sim: OpenSimulator, inv: Invocation) -> SimPciKernel:
    """The simulated node's kernel (its ``fake`` is the simulator)."""
    from agent.sim.pcikernel import SimPciKernel

    fake = open_sim(inv)
    return SimPciKernel(fake, fake.state_dir / "sys", fake.state_dir / "driver-root")


def _change(kernel: SimPciKernel, change: Callable[[VmState], VmState]) -> None:
    """One state update and the rewrite of the trees, as the simulated kernel makes them."""
    kernel.apply(lambda s: (change(s), []))


def _on_vfio(state: VmState) -> list[str]:
    return [f.bus for f in state.functions if f.driver == "vfio-pci"] + [
        m.uuid for m in state.mdevs
    ]


def _switch(
    open_sim: OpenSimulator,
    inv: Invocation,
    turn: Callable[[VmState], VmState],
    in_use: Callable[[VmState], list[str]],
    refusal: str,
    done: str,
) -> int:
    """Turn an IOMMU or driver switch of the simulated node, refused (``refusal`` naming what
    ``in_use`` finds) while something uses what it takes away."""
    kernel = _kernel(open_sim, inv)

    def change(s: VmState) -> VmState:
        users = in_use(s)
        if users:
            raise ConfigError(refusal.format(users=", ".join(users)))
        return turn(s)

    _change(kernel, change)
    inv.out.write(done + "\n")
    return 0


def _none(state: VmState) -> list[str]:
    return []


def _vfio_bound(state: VmState) -> list[str]:
    return [f.bus for f in state.functions if f.driver == "vfio-pci"]


def fault_iommu_off(open_sim: OpenSimulator, inv: Invocation) -> int:
    return _switch(
        open_sim,
        inv,
        lambda s: replace(s, iommu=False),
        _on_vfio,
        "cannot turn the IOMMU off: {users} use VFIO; unbind them from vfio-pci (remove the"
        " mdevs) first",
        "IOMMU off",
    )


def fault_iommu_on(open_sim: OpenSimulator, inv: Invocation) -> int:
    return _switch(open_sim, inv, lambda s: replace(s, iommu=True), _none, "", "IOMMU on")


def fault_vfio_unloaded(open_sim: OpenSimulator, inv: Invocation) -> int:
    return _switch(
        open_sim,
        inv,
        lambda s: replace(s, vfio_loaded=False),
        _vfio_bound,
        "cannot unload vfio-pci: it is in use by {users} (as rmmod refuses); unbind them first",
        "vfio-pci unloaded",
    )


def fault_vfio_loaded(open_sim: OpenSimulator, inv: Invocation) -> int:
    return _switch(
        open_sim, inv, lambda s: replace(s, vfio_loaded=True), _none, "", "vfio-pci loaded"
    )


def _gpu(fake: FakeNvml, index: int) -> GpuSlot:
    if index >= len(fake.model.gpus):
        raise ConfigError(
            f"GPU index {index} does not exist; model {fake.model.name} has GPUs"
            f" 0..{len(fake.model.gpus) - 1}"
        )
    return fake.model.gpus[index]


def fault_foreign_in_group(open_sim: OpenSimulator, inv: Invocation) -> int:
    from agent.sim.vmstate import FOREIGN_DRIVER, FunctionState, foreign_bus

    kernel = _kernel(open_sim, inv)
    gpu = _gpu(kernel.fake, inv.get(VmGpuOptions).gpu)
    bus = foreign_bus(gpu.bus)

    def change(s: VmState) -> VmState:
        if s.function(bus) is not None:
            return s
        s = s.with_function(FunctionState(bus, FOREIGN_DRIVER))
        return replace(s, foreign=(*s.foreign, (bus, gpu.bus)))

    _change(kernel, change)
    inv.out.write(f"NVMe drive {bus} (nvme) is in the IOMMU group of GPU {gpu.bus}\n")
    return 0


def fault_hold_gpu(open_sim: OpenSimulator, inv: Invocation) -> int:
    from agent.sim.procfs import process_alive
    from agent.sim.vmstate import Holder

    def alive(holders: tuple[Holder, ...]) -> tuple[Holder, ...]:
        return tuple(h for h in holders if process_alive(h.pid))

    kernel = _kernel(open_sim, inv)
    gpu = _gpu(kernel.fake, inv.get(VmGpuOptions).gpu)
    node = kernel.driver_root / "dev" / f"nvidia{gpu.index}"
    if not node.is_file():
        raise ConfigError(f"no device node {node} (start the simulated node first)")
    # posix_spawn, not subprocess: the sleeper outlives this command (a Popen object would
    # warn that its child still runs); its stdin is the node (one open descriptor, as a CUDA
    # process keeps one), its stdout/stderr /dev/null so no caller waits on our pipes
    pid = os.posix_spawnp(
        "sleep",
        ["sleep", "infinity"],
        os.environ,
        file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, str(node), os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
            (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
        ],
        setsid=True,
    )
    holder = Holder(pid, gpu.index)
    # the records of holders that ended go (their pids may come again for other processes)
    _change(kernel, lambda s: replace(s, holders=(*alive(s.holders), holder)))
    kernel.fake.refresh_proc()
    inv.out.write(f"{pid}\n")
    inv.err.write(f"process {pid} holds /dev/nvidia{gpu.index} (end it: kill {pid})\n")
    return 0


def vm_faults(open_sim: OpenSimulator) -> tuple[Command, ...]:
    """The VM fault commands, opening the simulator with ``open_sim`` (given, not imported:
    ``agent.cli.sim`` imports this module)."""

    def run(handler: Callable[[OpenSimulator, Invocation], int]) -> Callable[[Invocation], int]:
        return functools.partial(handler, open_sim)

    gpu = (Uses(VmGpuOptions),)
    return (
        Command("iommu-off", "the node has no IOMMU (no IOMMU groups, no VFIO)",
                run(fault_iommu_off)),
        Command("iommu-on", "the IOMMU is back (undo iommu-off)", run(fault_iommu_on)),
        Command("vfio-unloaded", "unload vfio-pci (refused while in use)",
                run(fault_vfio_unloaded)),
        Command("vfio-loaded", "load vfio-pci again", run(fault_vfio_loaded)),
        Command("foreign-in-group", "put an NVMe drive into a GPU's IOMMU group",
                run(fault_foreign_in_group), gpu),
        Command("hold-gpu",
                "start a process holding a GPU's /dev/nvidia<minor> open (its PID is printed)",
                run(fault_hold_gpu), gpu),
    )  # fmt: skip
