"""The opaque device configuration API: what claims and classes may pass to this driver.

Versioned like a Kubernetes API (``apiVersion`` + ``kind``), decoded strictly (unknown fields are
errors naming the path), and checked by one ``validate()`` that prepare (and any future webhook
or `explain`) share. Kinds in ``gpu.tessera.dev/v1alpha1``:

``GpuConfig`` (whole GPUs) and ``MigDeviceConfig`` (MIG devices)::

    {"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig",
     "sharing": {"strategy": "Exclusive"}}

``sharing.strategy`` is ``Exclusive`` (the default: one claim per device). Time-slicing, MPS and
memory shares arrive with the sharing modes; until then other strategies are refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dra_driver.errors import ParamsError

API_VERSION = "gpu.tessera.dev/v1alpha1"
KINDS = ("GpuConfig", "MigDeviceConfig")
STRATEGIES = ("Exclusive",)
MAX_PARAMETERS_BYTES = 10 * 1024


@dataclass(frozen=True)
class DeviceConfig:
    """A validated configuration for one kind of device."""

    kind: str
    sharing_strategy: str = "Exclusive"

    def applies_to(self, device_kind: str) -> bool:
        """``GpuConfig`` configures whole GPUs, ``MigDeviceConfig`` MIG devices."""
        return (self.kind == "GpuConfig") == (device_kind == "gpu")


def _fields(obj: Any, path: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ParamsError(f"{path}: expected an object, got {json.dumps(obj)}")
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise ParamsError(
            f"{path}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}"
        )
    return obj


def validate(parameters: Any, path: str = "parameters") -> DeviceConfig:
    """Decode and check one opaque ``parameters`` object. Pure; raises ParamsError."""
    try:
        size = len(json.dumps(parameters, separators=(",", ":"), allow_nan=False))
    except (TypeError, ValueError, RecursionError) as exc:  # a YAML date, NaN, endless nesting
        raise ParamsError(f"{path}: not JSON data: {exc}") from exc
    if size > MAX_PARAMETERS_BYTES:
        raise ParamsError(f"{path}: {size} bytes, more than the {MAX_PARAMETERS_BYTES} allowed")
    obj = _fields(parameters, path, ("apiVersion", "kind", "sharing"))
    version = obj.get("apiVersion")
    if version != API_VERSION:
        raise ParamsError(f"{path}.apiVersion: {version!r} is not supported; use {API_VERSION!r}")
    kind = obj.get("kind")
    if kind not in KINDS:
        raise ParamsError(f"{path}.kind: {kind!r} is not one of {', '.join(KINDS)}")
    strategy = "Exclusive"
    if "sharing" in obj:
        sharing = _fields(obj["sharing"], f"{path}.sharing", ("strategy",))
        strategy = sharing.get("strategy", "Exclusive")
        if strategy not in STRATEGIES:
            raise ParamsError(
                f"{path}.sharing.strategy: {strategy!r} is not supported by this driver version;"
                f" allowed: {', '.join(STRATEGIES)}"
            )
    return DeviceConfig(kind=str(kind), sharing_strategy=str(strategy))
