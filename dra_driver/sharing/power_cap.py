"""A whole GPU's power limit for the claim that holds it alone (``powerLimit`` in a GpuConfig):
read before prepare changes it, set, and set back, through NVML (``agent.nvml.power``).

Every call is idempotent (setting a limit the GPU already has changes nothing), so a prepare or
an unprepare that crashed half way simply sets it again. The order that makes a crash safe (the
limit found is recorded durably before the GPU is changed) is the caller's:
``dra_driver.kubeletplugin.effects``. NVML's facts (root only, the range, NOT_SUPPORTED, kept
until the driver unloads): docs/gpu-facts.md, "Power limits".
"""

from __future__ import annotations

import logging

from agent.logs import fields_
from agent.nvml.errors import NvmlError
from agent.nvml.power import PowerControl
from dra_driver.errors import SharingError

REASON = "power_limit_error"
"""The failure's reason (metrics, the kubelet's answer)."""


def _watts(milliwatts: int) -> float:
    return milliwatts / 1000


class GpuPower:
    """Reads and sets the power limit of whole GPUs (see the module docstring)."""

    def __init__(self, control: PowerControl, log: logging.Logger) -> None:
        self.control = control
        self.log = log

    def current(self, device: str, index: int) -> int:
        """GPU ``index``'s power limit now (milliwatts). ``device`` names it in errors."""
        try:
            return self.control.limit(index)
        except NvmlError as exc:
            raise SharingError(f"{device}: cannot read the power limit: {exc}", REASON) from exc

    def default(self, device: str, index: int) -> int:
        """The limit GPU ``index`` boots with (milliwatts)."""
        try:
            return self.control.default_limit(index)
        except NvmlError as exc:
            raise SharingError(
                f"{device}: cannot read the default power limit: {exc}", REASON
            ) from exc

    def set(self, device: str, index: int, milliwatts: int, why: str) -> None:
        """Set GPU ``index``'s power limit; ``why`` says so in the log (``cap``, ``restore``)."""
        try:
            self.control.set_limit(index, milliwatts)
        except NvmlError as exc:
            raise SharingError(
                f"{device}: cannot set the power limit to {_watts(milliwatts):g}W ({why}): {exc}",
                REASON,
            ) from exc
        self.log.info(
            "set a GPU's power limit",
            extra=fields_(device=device, gpu=index, watts=_watts(milliwatts), why=why),
        )
