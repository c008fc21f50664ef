"""What the allocator's search says: why a device is not used or a request cannot be allocated
(``Reason``), each request's analysis before the search (``Analysis``), the devices picked
(``Pick``), the deepest failed state per request (``Attempt``) and the whole answer
(``Outcome``), which ``explanation`` renders."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dra_driver.quantity import Quantity
from dra_driver.scheduler.domain import AttributeValue, Constraint, Device, DeviceClass, Request


@dataclass(frozen=True)
class Reason:
    """Why a device is not used for a request, or why a request or the claim cannot be
    allocated. ``kind`` is a stable word (see ``explain`` for the list), ``text`` one line."""

    kind: str
    text: str
    details: Mapping[str, Any] = field(default_factory=dict)


class GaveUp(Exception):
    pass


class Fatal(Exception):
    """Allocation on this node stops: upstream's Allocate returns an error, which the
    scheduler's DynamicResources plugin returns from Filter as an error status (kubernetes
    ``pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go``, Filter: "Return an
    error to abort scheduling of it"). The pod's scheduling attempt ends with that error; the
    scheduler does not go on to other nodes. ``reason.details["upstream"]`` is upstream's
    message where it has one."""

    def __init__(self, reason: Reason) -> None:
        self.reason = reason
        super().__init__(reason.text)


@dataclass
class Analysis:
    """One request or subrequest against the node's devices."""

    request: Request
    device_class: DeviceClass | None
    rejections: dict[int, Reason] = field(default_factory=dict)
    """Device index -> first static reason it cannot be used."""
    candidates: list[int] = field(default_factory=list)
    matched: int = 0
    """Devices that satisfy the class's and the request's selectors."""
    consumed: dict[int, dict[str, Quantity]] = field(default_factory=dict)
    """Per candidate: the capacity it would consume (every capacity of the device)."""
    constraint_values: list[tuple[Constraint, int, dict[int, AttributeValue]]] = field(
        default_factory=list
    )
    """(constraint, its index in the claim, candidate -> attribute value) for constraints that
    apply to this request."""
    all_devices: list[int] = field(default_factory=list)
    """allocationMode All: every device upstream's validateDeviceRequest collects, in order
    (selected by the class and the request, the capacity it asks for fits; allocated, tainted or
    short of counters or not). ``candidates`` are those of them free to take."""
    selected_as: str | None = None
    """Set when the devices were selected with another subrequest's class and selectors (the
    second subrequest of firstAvailable after an All one: see ``search``)."""
    cel_error: Reason | None = None
    problem: Reason | None = None
    """Why this request cannot be allocated at all, known before the search."""


@dataclass(frozen=True)
class Pick:
    request: Request
    device: Device
    consumed: Mapping[str, Quantity] | None
    """Set for devices that allow multiple allocations (the result's consumedCapacity)."""
    share_id: str | None


@dataclass
class Attempt:
    """The deepest failed state of one request: what was placed and why the rest did not fit."""

    placed: list[Pick]
    rejections: dict[int, Reason]
    reason: Reason | None = None
    """A reason for the request as a whole (too few candidates, too many results)."""


@dataclass
class Outcome:
    ok: bool
    picks: list[Pick]
    selected: dict[int, int]
    """Request group index -> chosen alternative."""
    analyses: list[list[Analysis]]
    attempts: dict[tuple[int, int], Attempt]
    blocker: tuple[int, int] | None
    fatal: Reason | None
    gave_up: bool
    steps: int
