"""The checkpoint's format migrations: version N -> N+1, each pure, each a fixed fact about two
formats (so a migration names the values of its target version, never the current ones).
:func:`dra_driver.kubeletplugin.checkpoint.decode` applies them in turn; the formats are
described in that module's docstring."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agent.decode import fields


def _v0_to_v1(obj: dict[str, Any]) -> dict[str, Any]:
    """Convert the pre-release shape (see the module docstring) to version 1. Pure."""
    claims: dict[str, Any] = {}
    prepared = fields.objects(obj.get("preparedClaims"), "preparedClaims", required=True)
    for i, c in enumerate(prepared):
        where = f"preparedClaims[{i}]"
        uid = fields.text(c.get("uid"), f"{where}.uid")
        if uid in claims:
            raise fields.FieldError(where, f"claim {uid!r} appears twice")
        devices = []
        for j, d in enumerate(fields.objects(c.get("devices"), f"{where}.devices", required=True)):
            dw = f"{where}.devices[{j}]"
            devices.append(
                {
                    "requestNames": list(
                        fields.texts(d.get("requests"), f"{dw}.requests", required=True)
                    ),
                    "pool": fields.text(d.get("pool"), f"{dw}.pool"),
                    "device": fields.text(d.get("device"), f"{dw}.device"),
                    "cdiDeviceIDs": list(
                        fields.texts(d.get("cdiDevices"), f"{dw}.cdiDevices", required=True)
                    ),
                    "kind": fields.text(d.get("type"), f"{dw}.type"),
                    "gpuUUID": fields.text(d.get("uuid"), f"{dw}.uuid"),
                    "gpuMinor": fields.integer(d.get("minor"), f"{dw}.minor"),
                    "migUUID": fields.opt_text(d.get("migUuid"), f"{dw}.migUuid"),
                    "gpuInstanceID": fields.opt_integer(d.get("giId"), f"{dw}.giId"),
                    "computeInstanceID": fields.opt_integer(d.get("ciId"), f"{dw}.ciId"),
                }
            )
        claims[uid] = {
            "uid": uid,
            "namespace": fields.text(c.get("namespace"), f"{where}.namespace"),
            "name": fields.text(c.get("name"), f"{where}.name"),
            "state": fields.text(c.get("status"), f"{where}.status"),
            "devices": devices,
            "updatedAt": 0.0,
        }
    return {
        "apiVersion": "tessera.dev/v1",  # version 1's, whatever later versions name
        "kind": "Checkpoint",
        "version": 1,
        "bootID": fields.text(obj.get("bootId"), "checkpoint.bootId"),
        "claims": claims,
    }


def _v1_to_v2(obj: dict[str, Any]) -> dict[str, Any]:
    """Version 2 only adds optional fields (sharing, dynamic MIG, MPS daemons, pods). Pure."""
    return {**obj, "version": 2}


def _v2_to_v3(obj: dict[str, Any]) -> dict[str, Any]:
    """Version 3 only adds optional fields (a device's power limit). Pure."""
    return {**obj, "version": 3}


def _v3_to_v4(obj: dict[str, Any]) -> dict[str, Any]:
    """Version 4 only adds optional fields and device kinds (GPUs handed to VMs). Pure."""
    return {**obj, "version": 4}


MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
    0: _v0_to_v1,
    1: _v1_to_v2,
    2: _v2_to_v3,
    3: _v3_to_v4,
}
"""Format version N -> a version N+1 object (no checksum needed: it is checked on the input)."""
