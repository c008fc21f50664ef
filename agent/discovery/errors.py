"""Errors of the discovery layer (``agent.discovery``)."""

from __future__ import annotations

from agent.errors import TesseraError


class DiscoveryError(TesseraError):
    """The node could not be discovered (sysfs unreadable or inconsistent with NVML)."""
