"""Errors of the NVML layer (``agent.nvml``)::

TesseraError
├── DriverNotFoundError      no NVIDIA driver / libnvidia-ml on this machine
└── NvmlError                an NVML call failed (call name, device and NVML code kept)
    ├── NvmlNotSupported     the device does not support the call (optional fields: "absent")
    ├── NvmlNotFound         the thing asked for does not exist
    ├── NvmlGpuLost          the GPU fell off the bus
    └── NvmlInsufficientResources / NvmlInUse / NvmlInvalidArgument
"""

from __future__ import annotations

from agent.errors import TesseraError


class DriverNotFoundError(TesseraError):
    """NVML (libnvidia-ml.so.1) could not be loaded: no NVIDIA driver on this machine."""


class NvmlError(TesseraError):
    """An NVML call failed.

    ``call`` is the pynvml function name, ``device`` the GPU (index or bus id) when there is one,
    ``code`` the NVML return code.
    """

    def __init__(self, call: str, code: int, message: str, device: str | None = None) -> None:
        self.call = call
        self.code = code
        self.device = device
        where = f" on GPU {device}" if device is not None else ""
        super().__init__(f"{call}{where} failed: {message} (NVML code {code})")


class NvmlNotSupported(NvmlError):
    """The device does not support this call."""


class NvmlNotFound(NvmlError):
    """The object asked for does not exist."""


class NvmlGpuLost(NvmlError):
    """The GPU is lost (fell off the bus)."""

    temporary = False


class NvmlInsufficientResources(NvmlError):
    """Not enough resources (e.g. no room for a MIG instance)."""


class NvmlInUse(NvmlError):
    """The object is in use (e.g. a GPU instance that still has compute instances)."""


class NvmlInvalidArgument(NvmlError):
    """NVML rejected an argument."""
