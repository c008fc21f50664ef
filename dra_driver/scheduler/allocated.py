"""What other claims hold on the node (``Allocated``), read from their ``status.allocation``
(``parse_allocated``): whole devices and the shares of devices that allow multiple
allocations. Pure."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.decode import fields
from dra_driver.quantity import Quantity
from dra_driver.scheduler.pools import InputError, QuantityReader


@dataclass
class Allocated:
    """What other claims hold: whole devices (owner text per device key), shares of devices
    that allow multiple allocations (consumed capacity added up per device key)."""

    owners: dict[tuple[str, str, str], str] = field(default_factory=dict)
    shared: dict[tuple[str, str, str], dict[str, Quantity]] = field(default_factory=dict)
    share_owners: dict[tuple[str, str, str], list[str]] = field(default_factory=dict)

    def holds(self, key: tuple[str, str, str]) -> bool:
        """internal.IsDeviceAllocated (structured/internal/allocatedstate.go): whole or shared."""
        return key in self.owners or key in self.shared


def parse_allocated(
    claims: Sequence[Mapping[str, Any]],
    in_use: Iterable[tuple[str, str, str]],
    q: QuantityReader,
    *,
    shares: bool = True,
) -> Allocated:
    """``shares`` False (DRAConsumableCapacity off): a result with a shareID holds its whole
    device too (foreachAllocatedDevice calls the shared callback only with the gate on)."""
    out = Allocated()
    for i, obj in enumerate(claims):
        base = f"allocated[{i}]"
        obj = fields.obj(obj, base)
        meta = fields.obj(obj.get("metadata"), f"{base}.metadata", optional=True)
        ns = fields.opt_text(meta.get("namespace"), f"{base}.metadata.namespace") or ""
        name = (fields.opt_text(meta.get("name"), f"{base}.metadata.name") or "") or f"#{i}"
        owner = f"claim {ns}/{name}" if ns else f"claim {name}"
        status = fields.obj(obj.get("status"), f"{base}.status", optional=True)
        allocation = status.get("allocation")
        if allocation is None:
            continue  # not allocated: holds nothing
        base = f"{owner}: status.allocation"
        devices = fields.obj(
            fields.obj(allocation, base).get("devices"), f"{base}.devices", optional=True
        )
        for j, r in enumerate(fields.items(devices.get("results"), f"{base}.devices.results")):
            rp = f"{base}.devices.results[{j}]"
            r = fields.obj(r, rp)
            key = (
                fields.text(r.get("driver"), f"{rp}.driver", nonempty=True),
                fields.text(r.get("pool"), f"{rp}.pool", nonempty=True),
                fields.text(r.get("device"), f"{rp}.device", nonempty=True),
            )
            if fields.flag(r.get("adminAccess"), f"{rp}.adminAccess"):
                continue  # "Is not considered as allocated" (foreachAllocatedDevice)
            if r.get("shareID") is not None and shares:
                fields.text(r.get("shareID"), f"{rp}.shareID", nonempty=True)
                total = out.shared.setdefault(key, {})
                consumed = fields.obj(
                    r.get("consumedCapacity"), f"{rp}.consumedCapacity", optional=True
                )
                for cname, value in consumed.items():
                    qty = q(value, f"{rp}.consumedCapacity.{cname}")
                    prev = total.get(cname)
                    total[cname] = (
                        qty if prev is None else Quantity(prev.nanos + qty.nanos, qty.format)
                    )
                out.share_owners.setdefault(key, []).append(owner)
                continue
            out.owners.setdefault(key, owner)
    for i, item in enumerate(in_use):
        if not (
            isinstance(item, tuple | list)
            and len(item) == 3
            and all(isinstance(x, str) for x in item)
        ):
            raise InputError(
                f"in_use[{i}]", f"must be (driver, pool, device), got {fields.shown(item)}"
            )
        key = (item[0], item[1], item[2])
        out.owners.setdefault(key, "in use on the node")
    return out
