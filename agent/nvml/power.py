"""A whole GPU's power limit through the facade: read and set (``nvmlDeviceGetPowerManagement*``,
``nvmlDeviceSetPowerManagementLimit``), in milliwatts.

The NVML facts this relies on (docs/gpu-facts.md, "Power limits"): setting a limit needs root and
a limit within ``nvmlDeviceGetPowerManagementLimitConstraints`` (else
NVML_ERROR_INVALID_ARGUMENT); a GPU without power management answers NVML_ERROR_NOT_SUPPORTED; a
limit set stays until the driver unloads (a reboot or driver reload), not across them. Power
limits belong to the physical GPU, never to a MIG device.

Every call goes through ``Nvml.api(device)``, so failures are ``agent.nvml.errors`` naming the
call and the GPU. The caller serializes changes to one GPU.
"""

from __future__ import annotations

from agent.nvml.facade import Nvml


class PowerControl:
    """Reads and sets the power limit of the node's GPUs, by NVML index."""

    def __init__(self, nvml: Nvml) -> None:
        self._nvml = nvml

    def limit(self, index: int) -> int:
        """GPU ``index``'s power limit now, in milliwatts."""
        return self._nvml.api(str(index)).nvmlDeviceGetPowerManagementLimit(
            self._nvml.handle(index)
        )

    def default_limit(self, index: int) -> int:
        """The limit GPU ``index`` boots with, in milliwatts."""
        return self._nvml.api(str(index)).nvmlDeviceGetPowerManagementDefaultLimit(
            self._nvml.handle(index)
        )

    def set_limit(self, index: int, milliwatts: int) -> None:
        """Set GPU ``index``'s power limit (idempotent)."""
        self._nvml.api(str(index)).nvmlDeviceSetPowerManagementLimit(
            self._nvml.handle(index), milliwatts
        )
