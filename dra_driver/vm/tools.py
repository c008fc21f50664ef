"""The tools a node that hands GPUs to virtual machines prepares them with (built by the
composition root from ``--virtualization``; None where it is ``none``)."""

from __future__ import annotations

from dataclasses import dataclass

from dra_driver.vm.passthrough import Passthrough
from dra_driver.vm.vgpu import VgpuMaker


@dataclass(frozen=True)
class VmTools:
    passthrough: Passthrough | None
    """``--virtualization passthrough``: whole GPUs through VFIO."""
    vgpu: VgpuMaker | None
    """``--virtualization vgpu``: NVIDIA vGPUs."""
