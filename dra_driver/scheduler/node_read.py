"""What a claim is allocated against (the DeviceClasses, one node's ResourceSlices, the claims
allocated already), read as the modelled scheduler version reads it: the common start of
``explanation.explain`` (one claim) and ``joint.explain_pod`` (a pod's claims). Pure."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dra_driver.scheduler.domain import (
    Allocated,
    DeviceClass,
    Node,
    QuantityReader,
    parse_allocated,
    parse_classes,
    parse_slices,
)
from dra_driver.scheduler.versions import CONSUMABLE_CAPACITY, Scheduler


@dataclass(frozen=True)
class NodeRead:
    """What a claim is allocated against, read as the modelled scheduler reads it."""

    scheduler: Scheduler
    quantities: QuantityReader
    classes: dict[str, DeviceClass]
    node: Node
    allocated: Allocated


def read_node(
    classes: Sequence[Mapping[str, Any]],
    slices: Sequence[Mapping[str, Any]],
    allocated: Sequence[Mapping[str, Any]],
    in_use: Iterable[tuple[str, str, str]],
    scheduler: Scheduler | None,
) -> NodeRead:
    """The classes, one node's slices and the allocated claims (and ``in_use`` devices) as
    ``scheduler`` (default: the newest) reads them, for ``explain`` and ``joint.explain_pod``;
    InputError for malformed input."""
    scheduler = scheduler or Scheduler.of()
    q = QuantityReader()
    shares = scheduler.enabled(CONSUMABLE_CAPACITY)
    return NodeRead(
        scheduler,
        q,
        parse_classes(classes),
        parse_slices(slices, q, scheduler),
        parse_allocated(allocated, in_use, q, shares=shares),
    )
