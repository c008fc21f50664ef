"""Telemetry's view of who holds what, as plain values (the driver's checkpoint records satisfy
the same protocol; telemetry tests need no driver)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Held:
    pool: str
    device: str
    kind: str
    gpu_uuid: str
    gpu_minor: int
    gpu_instance_id: int | None = None
    sharing: str | None = None
    memory_bytes: int | None = None
    device_class: str = ""
    vgpu_type_id: int | None = None


@dataclass(frozen=True)
class Claim:
    uid: str
    namespace: str
    name: str
    devices: tuple[Held, ...]
    pods: tuple[str, ...] = ()
