"""Devices that allow multiple allocations (KEP-5075, consumable capacity), as the scheduler
allocates them: one device picked more than once in a claim and across claims, a share ID per
pick, the capacity each share takes counted against what the device has left.

Each row names the upstream code it follows, in k8s.io/dynamic-resource-allocation release-1.35
``structured/internal/experimental/`` (the variant the scheduler runs when DRAConsumableCapacity
is on; the stable and incubating variants do not know multiple allocations):

- ``allocateOne``: every device position of a request tries the pool's devices from the first
  one; a device in use is skipped, and a device that allows multiple allocations is never in
  use (``deviceInUse``), so it is tried again at the next position;
- ``allocateDevice``: such a device is not marked allocating for the claim, takes a share
  (``GenerateNewShareID``) and its consumed capacity (``GetConsumedCapacityFromRequest``);
- ``CmpRequestOverCapacity`` (consumable_capacity.go): the share must fit in what the device
  has left after the allocated claims (``AggregatedCapacity``) and this allocation's earlier
  picks (``allocatingCapacity``), rounded up per the request policy;
- ``distinctAttributeConstraint`` (constraint.go): keeps one value per *request* (the last one
  added), so it tells apart the devices of different requests, while the devices of one request
  are only compared with the previous request's value and its own last pick.

The memory-share rows use the slices the driver publishes for a simulated dgx-h100 under
``--sharing memory-shares`` (80 GB GPUs, shares of 1Gi steps, default 1Gi).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from dra_driver.scheduler.celenv import CelEnvironment
from dra_driver.scheduler.explanation import Explanation, explain
from tests.dra_driver.allocator_helpers import DRIVER, allocated, claim, dev, exact, klass, rslice
from tests.dra_driver.conftest import Inventory
from tests.dra_driver.test_allocator_models import CLASSES, slices

A = f'device.attributes["{DRIVER}"]'
ANY = klass("any", "true")
RANGE = {"default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}


def shared(name: str, memory: str = "4Gi", **attrs: Any) -> dict[str, Any]:
    """A device that allows multiple allocations, with ``memory`` to share in 1Gi steps."""
    return dev(
        name,
        attrs={"uuid": f"uuid-{name}", **attrs},
        capacity={"memory": {"value": memory, "requestPolicy": RANGE}},
        multi=True,
    )


def req(name: str, count: int = 1, memory: str | None = "2Gi", **kw: Any) -> dict[str, Any]:
    return exact(
        name, "any", count=count, capacity=None if memory is None else {"memory": memory}, **kw
    )


def distinct(attribute: str, *requests: str) -> dict[str, Any]:
    out: dict[str, Any] = {"distinctAttribute": f"{DRIVER}/{attribute}"}
    if requests:
        out["requests"] = list(requests)
    return out


def run(c: dict[str, Any], node: list[dict[str, Any]], allocs: list[dict[str, Any]]) -> Explanation:
    return explain(c, [ANY, *CLASSES], node, allocs, cel=CelEnvironment())


def chosen(e: Explanation) -> list[tuple[str, str]]:
    return [(r["request"], r["device"]) for r in e.allocation()["devices"]["results"]]


@dataclass
class Case:
    id: str
    upstream: str
    """The upstream function (release-1.35 structured/internal/experimental/) the row follows."""
    claim: dict[str, Any]
    devices: list[dict[str, Any]]
    fits: list[tuple[str, str]] | None
    """(request, device) in result order, or None when the claim does not fit."""
    allocs: list[dict[str, Any]] = field(default_factory=list)


CASES = [
    Case(
        "one-shared-device-twice-in-one-request",
        "allocator_experimental.go allocateOne, allocateDevice (no allocatingDevices entry)",
        claim(req("r", 2)),
        [shared("d0"), shared("d1")],
        [("r", "d0"), ("r", "d0")],
    ),
    Case(
        "shares-until-the-capacity-is-used-then-the-next-device",
        "consumable_capacity.go CmpRequestOverCapacity (allocatingCapacity of this claim)",
        claim(req("r", 3)),
        [shared("d0"), shared("d1")],
        [("r", "d0"), ("r", "d0"), ("r", "d1")],
    ),
    Case(
        "more-shares-than-the-devices-have-does-not-fit",
        "consumable_capacity.go CmpRequestOverCapacity",
        claim(req("r", 5)),
        [shared("d0"), shared("d1")],
        None,
    ),
    Case(
        "fewer-devices-than-the-count-still-fit",
        "allocator_experimental.go allocateOne (no count-versus-candidates shortcut)",
        claim(req("r", 2, memory=None)),
        [shared("d0")],
        [("r", "d0"), ("r", "d0")],
    ),
    Case(
        "no-capacity-request-takes-the-policy-default",
        "consumable_capacity.go GetConsumedCapacityFromRequest, calculateConsumedCapacity",
        claim(req("r", 4, memory=None)),
        [shared("d0", "3Gi"), shared("d1")],
        [("r", "d0"), ("r", "d0"), ("r", "d0"), ("r", "d1")],
    ),
    Case(
        "exclusive-then-shared-in-device-order",
        "allocator_experimental.go allocateOne, deviceInUse",
        claim(req("r", 3, memory=None)),
        [dev("x0"), shared("d1")],
        [("r", "x0"), ("r", "d1"), ("r", "d1")],
    ),
    Case(
        "two-requests-share-one-device",
        "allocator_experimental.go allocateOne (deviceInUse is false for a shared device)",
        claim(req("a"), req("b")),
        [shared("d0"), shared("d1")],
        [("a", "d0"), ("b", "d0")],
    ),
    Case(
        "an-allocated-share-leaves-room-for-one-more",
        "consumable_capacity.go CmpRequestOverCapacity (allocatedState.AggregatedCapacity)",
        claim(req("r", 2)),
        [shared("d0"), shared("d1")],
        [("r", "d0"), ("r", "d1")],
        [
            allocated(
                "other",
                {
                    "device": "d0",
                    "shareID": "1b4e28ba-2fa1-11d2-883f-0016d3cca427",
                    "consumedCapacity": {"memory": "2Gi"},
                },
            )
        ],
    ),
    Case(
        "distinct-across-requests-gives-two-devices",
        "constraint.go distinctAttributeConstraint.add (allocator_testing.go"
        " distinct-constraint-two-multi-allocatable-devices-with-distinct-constraint)",
        claim(req("a"), req("b"), constraints=[distinct("uuid")]),
        [shared("d0"), shared("d1")],
        [("a", "d0"), ("b", "d1")],
    ),
    Case(
        "distinct-across-requests-on-one-device-does-not-fit",
        "constraint.go distinctAttributeConstraint.add (allocator_testing.go"
        " distinct-constraint-one-multi-allocatable-device-with-distinct-constraint)",
        claim(req("a"), req("b"), constraints=[distinct("uuid")]),
        [shared("d0")],
        None,
    ),
    Case(
        "distinct-in-one-request-of-two-gives-two-devices",
        "constraint.go distinctAttributeConstraint.matchesAttribute",
        claim(req("r", 2), constraints=[distinct("uuid")]),
        [shared("d0"), shared("d1"), shared("d2")],
        [("r", "d0"), ("r", "d1")],
    ),
    Case(
        "distinct-in-one-request-of-four-keeps-only-the-last-value",
        "constraint.go distinctAttributeConstraint.add (attributes[requestName] is overwritten)",
        claim(req("r", 4, memory="1Gi"), constraints=[distinct("uuid")]),
        [shared("d0"), shared("d1"), shared("d2"), shared("d3")],
        [("r", "d0"), ("r", "d1"), ("r", "d0"), ("r", "d1")],
    ),
    Case(
        "distinct-on-exclusive-devices-of-one-request-keeps-only-the-last-value",
        "constraint.go distinctAttributeConstraint.add, allocateOne (device order)",
        claim(exact("r", "any", count=3), constraints=[distinct("numa")]),
        [dev("x0", attrs={"numa": 0}), dev("x1", attrs={"numa": 1}), dev("x2", attrs={"numa": 0})],
        [("r", "x0"), ("r", "x1"), ("r", "x2")],
    ),
    Case(
        "distinct-applies-to-the-named-requests-only",
        "constraint.go distinctAttributeConstraint.matches (allocator_testing.go"
        " with-distinct-constraints-with-subrequests)",
        claim(req("a"), req("b"), req("c"), constraints=[distinct("uuid", "a", "b")]),
        [shared("d0"), shared("d1")],
        [("a", "d0"), ("b", "d1"), ("c", "d0")],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_multiple_allocations(case: Case) -> None:
    e = run(case.claim, [rslice(case.devices)], case.allocs)
    if case.fits is None:
        assert not e.ok, e.text()
        return
    assert e.ok, e.text()
    assert chosen(e) == case.fits, case.upstream


def test_every_share_has_its_own_id() -> None:
    """allocateDevice: GenerateNewShareID per pick, so two shares of one device in one claim
    are two results (the API server refuses two results with one device and share ID)."""
    e = run(claim(req("r", 3)), [rslice([shared("d0", "8Gi")])], [])
    results = e.allocation()["devices"]["results"]
    assert [r["device"] for r in results] == ["d0", "d0", "d0"]
    assert len({r["shareID"] for r in results}) == 3
    assert all(r["consumedCapacity"] == {"memory": "2Gi"} for r in results)
    again = run(claim(req("r", 3)), [rslice([shared("d0", "8Gi")])], [])
    assert again.allocation() == e.allocation()  # the same input, the same answer


def test_the_text_names_each_share() -> None:
    e = run(claim(req("r", 2)), [rslice([shared("d0")])], [])
    assert "r -> d0, d0" in e.text()


# -- the memory-shares node the driver publishes --------------------------------------------------
MEMORY = 'device.capacity["gpu.tessera.dev"].memory'


def gpu_claim(count: int, *selectors: str, memory: str | None = "8Gi") -> dict[str, Any]:
    body: dict[str, Any] = {"deviceClassName": "gpu.tessera.dev", "count": count}
    if selectors:
        body["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    if memory is not None:
        body["capacity"] = {"requests": {"memory": memory}}
    return {
        "metadata": {"name": "c", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": body}]}},
    }


@pytest.mark.parametrize(
    ("count", "memory", "expected"),
    [
        (2, "8Gi", ["gpu-0", "gpu-0"]),
        (4, "8Gi", ["gpu-0"] * 4),
        (2, "40Gi", ["gpu-0", "gpu-1"]),  # two 40Gi shares exceed an 80 GB GPU's 79.6Gi
        (2, None, ["gpu-0", "gpu-0"]),  # the node's --memory-share-min, 1Gi each
    ],
)
def test_memory_share_gpus_are_shared_within_a_claim(
    inventory: Inventory, count: int, memory: str | None, expected: list[str]
) -> None:
    """Issue 26: a capacity request with a selector comparing the GPU's memory with a quantity
    (once a traceback in the CEL memo), and the scheduler's answer: shares of gpu-0."""
    node = slices(inventory, "dgx-h100", sharing="memory-shares")
    c = gpu_claim(count, f'{MEMORY}.compareTo(quantity("40Gi")) >= 0', memory=memory)
    e = explain(c, CLASSES, node, [], cel=CelEnvironment())
    assert e.ok, e.text()
    assert [d for _, d in chosen(e)] == expected
