"""``allocationMode: All`` as the scheduler's structured allocator runs it, in Kubernetes 1.34
and 1.35 alike. Every row names the upstream code it follows, in
k8s.io/dynamic-resource-allocation (branches release-1.34 and release-1.35; the variants
``stable``, ``incubating`` and ``experimental`` agree on every row):

- ``structured/internal/<variant>/allocator_<variant>.go``, ``Allocate``: the claim's minimum
  number of devices (an All request counts every device ``validateDeviceRequest`` collected; a
  firstAvailable request its smallest subrequest) over ``AllocationResultsMaxSize`` (32) is an
  error: "claim NS/NAME: number of requested devices N exceeds the claim limit of 32".
- ``validateDeviceRequest``: "all" is every device of the node's pools that the class and the
  request select (with consumable capacity: whose capacity the request still fits), allocated,
  tainted or short of counters or not; an incomplete or invalid pool is an error ("asks for all
  devices, but resource pool P is currently being updated" / "currently invalid").
- ``allocateOne``: All takes its devices in that order through ``allocateDevice(must=true)``;
  the first device that is in use, short of counters, tainted or short of capacity ends the
  request without an error ("If we couldn't get all of them, then there is no solution");
  over the limit during the search (``errAllocationResultMaxSizeExceeded``) the next
  subrequest is tried.
- ``allocateDevice``: with ``must`` a constraint the device would break is an error: "claim
  NS/NAME, request R: cannot add device D because a claim constraint would not be satisfied".

An error of the claim is not "does not fit": the scheduler's DynamicResources plugin returns it
from Filter as an error status (kubernetes ``pkg/scheduler/framework/plugins/dynamicresources/
dynamicresources.go``, ``Filter``: "Return an error to abort scheduling of it"), so the pod's
scheduling attempt stops with that error instead of going on to the next node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from dra_driver.scheduler.celenv import CelEnvironment
from dra_driver.scheduler.explanation import Explanation, explain
from tests.dra_driver.allocator_helpers import (
    DRIVER,
    GPU,
    MIG,
    MIG_COUNTERS,
    A,
    allocated,
    claim,
    dev,
    exact,
    first_available,
    rslice,
)
from tests.dra_driver.conftest import Inventory
from tests.dra_driver.test_allocator_models import CLASSES, slices
from tests.fakeclock import FakeClock

ALLOCATOR = "structured/internal/incubating/allocator_incubating.go"


def gpus(n: int, **attrs: Any) -> list[dict[str, Any]]:
    return [dev(f"gpu-{i}", attrs={"type": "gpu", **attrs}) for i in range(n)]


NUMA = [
    dev("gpu-0", attrs={"type": "gpu", "numa": 0}),
    dev("gpu-1", attrs={"type": "gpu", "numa": 0}),
    dev("gpu-2", attrs={"type": "gpu", "numa": 1}),
]
SAME_NUMA = [{"matchAttribute": f"{DRIVER}/numa"}]
# a GPU's MIG placements sharing its memory slices: the 3g one overlaps the first 1g one
MIGS = [
    dev("mig-1g-0", attrs={"type": "mig"}, consumes={"gpu-0-set": {"s0": 1}}),
    dev("mig-3g-0", attrs={"type": "mig"}, consumes={"gpu-0-set": {"s0": 1, "s1": 1, "s2": 1}}),
]

# a device of another class on memory slice 1, allocated to another claim
OTHER_1G = dev("other-1g-1", attrs={"type": "x"}, consumes={"gpu-0-set": {"s1": 1}})


@dataclass
class Row:
    id: str
    upstream: str
    """The upstream function the row follows (file: function, what it does)."""
    claim: dict[str, Any]
    slices: list[dict[str, Any]]
    fits: dict[str, list[str]] | None = None
    """Request -> devices, when the claim fits."""
    error: tuple[str, ...] = ()
    """Substrings of the error's text, when the allocator returns an error for the claim."""
    no_fit: tuple[str, ...] = ()
    """Substrings of first_reason(), when it does not fit (and is no error)."""
    allocs: list[dict[str, Any]] = field(default_factory=list)


ROWS = [
    Row(
        "all-takes-every-selected-device",
        f"{ALLOCATOR}: validateDeviceRequest collects allDevices; allocateOne takes them",
        claim(exact("g", mode="All")),
        [rslice([*gpus(3), dev("mig-0", attrs={"type": "mig"})])],
        fits={"g": ["gpu-0", "gpu-1", "gpu-2"]},
    ),
    Row(
        "all-constraint-that-would-fail-is-an-error",
        f"{ALLOCATOR}: allocateDevice(must=true), 'cannot add device ... because a claim"
        " constraint would not be satisfied'",
        claim(exact("g", mode="All"), constraints=SAME_NUMA),
        [rslice(NUMA)],
        error=(
            "claim default/c, request g: cannot add device gpu.tessera.dev/node-a/gpu-2"
            " because a claim constraint would not be satisfied",
            "matchAttribute gpu.tessera.dev/numa",
        ),
    ),
    Row(
        "all-device-without-the-constrained-attribute-is-an-error",
        f"{ALLOCATOR}: allocateDevice(must=true); matchAttributeConstraint.add fails on a"
        " device without the attribute",
        claim(exact("g", mode="All"), constraints=SAME_NUMA),
        [rslice([*NUMA[:2], dev("gpu-9", attrs={"type": "gpu"})])],
        error=("cannot add device gpu.tessera.dev/node-a/gpu-9", "no attribute"),
    ),
    Row(
        "all-constraint-with-an-earlier-request-is-an-error",
        f"{ALLOCATOR}: allocateDevice(must=true) checks the claim's constraints against the"
        " devices of earlier requests too",
        claim(
            exact("one", selectors=(f"{A}.numa == 1",)),
            exact("g", mode="All", selectors=(f"{A}.numa == 0",)),
            constraints=SAME_NUMA,
        ),
        [rslice(NUMA)],
        error=("request g: cannot add device gpu.tessera.dev/node-a/gpu-0",),
    ),
    Row(
        "all-allocated-device-before-the-conflict-is-no-error",
        f"{ALLOCATOR}: allocateDevice returns false (no error) for a device in use, before"
        " the constraints; allocateOne then stops the request",
        claim(exact("g", mode="All"), constraints=SAME_NUMA),
        [rslice(NUMA)],
        allocs=[allocated("other", {"device": "gpu-1"})],
        no_fit=("needs every matching device", "gpu-1", "allocated to claim default/other"),
    ),
    Row(
        "all-device-short-of-counters-is-no-error",
        f"{ALLOCATOR}: allocateDevice, checkAvailableCounters false: 'Insufficient counters',"
        " no error",
        claim(exact("g", "mig", mode="All")),
        [
            rslice([], name="counters", count=2, counters=MIG_COUNTERS),
            rslice(MIGS, name="devices", count=2),
        ],
        no_fit=("needs every matching device", "mig-3g-0", "gpu-0-set"),
    ),
    Row(
        "all-device-short-of-counters-by-an-allocation-is-no-error",
        f"{ALLOCATOR}: allocateDevice, checkAvailableCounters subtracts what allocated devices"
        " consume",
        claim(exact("g", "mig", mode="All")),
        [
            rslice([], name="counters", count=2, counters=MIG_COUNTERS),
            rslice([MIGS[1], OTHER_1G], name="devices", count=2),
        ],
        allocs=[allocated("other", {"device": "other-1g-1"})],
        no_fit=("needs every matching device", "mig-3g-0", "gpu-0-set"),
    ),
    Row(
        "all-tainted-device-is-no-error",
        f"{ALLOCATOR}: allocateDevice, taintPreventsAllocation: false, no error",
        claim(exact("g", mode="All")),
        [
            rslice(
                [
                    *gpus(1),
                    dev(
                        "gpu-1",
                        attrs={"type": "gpu"},
                        taints=[{"key": "broken", "effect": "NoSchedule"}],
                    ),
                ]
            )
        ],
        no_fit=("needs every matching device", "gpu-1", "tainted"),
    ),
    Row(
        "all-over-the-claim-limit-is-an-error",
        f"{ALLOCATOR}: Allocate, 'number of requested devices %d exceeds the claim limit"
        " of %d' (AllocationResultsMaxSize 32)",
        claim(exact("g", mode="All")),
        [rslice(gpus(40))],
        error=("claim default/c: number of requested devices 40 exceeds the claim limit of 32",),
    ),
    Row(
        "all-counts-allocated-devices-toward-the-limit",
        f"{ALLOCATOR}: validateDeviceRequest's allDevices skips no allocated device, so"
        " numDevices counts them",
        claim(exact("g", mode="All")),
        [rslice(gpus(34))],
        allocs=[allocated("other", *({"device": f"gpu-{i}"} for i in range(4)))],
        error=("number of requested devices 34 exceeds the claim limit of 32",),
    ),
    Row(
        "all-plus-exact-count-over-the-limit-is-an-error",
        f"{ALLOCATOR}: Allocate sums the minimum of every request",
        claim(exact("one"), exact("g", mode="All", selectors=(f'{A}.kind == "x"',))),
        [
            rslice(
                [
                    *gpus(1, kind="y"),
                    *(dev(f"x-{i}", attrs={"type": "gpu", "kind": "x"}) for i in range(32)),
                ]
            )
        ],
        error=("number of requested devices 33 exceeds the claim limit of 32",),
    ),
    Row(
        "all-over-the-limit-in-first-available-tries-the-next-subrequest",
        f"{ALLOCATOR}: Allocate counts a firstAvailable request's smallest subrequest;"
        " allocateOne skips a subrequest on errAllocationResultMaxSizeExceeded",
        claim(first_available("g", exact("every", mode="All"), exact("two", count=2))),
        [rslice(gpus(40))],
        fits={"g/two": ["gpu-0", "gpu-1"]},
    ),
    Row(
        "all-with-an-incomplete-pool-is-an-error",
        f"{ALLOCATOR}: validateDeviceRequest, 'asks for all devices, but resource pool %s is"
        " currently being updated'",
        claim(exact("g", mode="All")),
        [rslice(gpus(1)), rslice([dev("x", attrs={"type": "gpu"})], pool="other", count=2)],
        error=("claim default/c, request g: asks for all devices", "other", "being updated"),
    ),
    Row(
        "exact-count-with-an-incomplete-pool-is-no-error",
        f"{ALLOCATOR}: allocateOne skips incomplete and invalid pools for ExactCount",
        claim(exact("g")),
        [rslice(gpus(1)), rslice([dev("x", attrs={"type": "gpu"})], pool="other", count=2)],
        fits={"g": ["gpu-0"]},
    ),
    Row(
        "all-in-the-first-subrequest-is-as-on-its-own",
        f"{ALLOCATOR}: allocateOne, subrequest 0 keeps its own index",
        claim(
            first_available(
                "g", exact("h", mode="All", selectors=(f'{A}.model == "h100"',)), exact("one")
            )
        ),
        [rslice([*gpus(1, model="a100"), dev("gpu-7", attrs={"type": "gpu", "model": "h100"})])],
        fits={"g/h": ["gpu-7"]},
    ),
    Row(
        "all-after-all-selects-with-the-first-subrequests-selectors",
        f"{ALLOCATOR}: Allocate sets requestKey.subRequestIndex only after"
        " validateDeviceRequest, so subrequest 1 reads subrequest 0's cached isSelectable"
        " verdicts (1.34 and 1.35; fixed upstream by kubernetes commit 3caaccc0, 1.36)",
        claim(
            first_available(
                "g",
                exact("h", mode="All", selectors=(f'{A}.model == "h100"',)),
                exact("a", mode="All", selectors=(f'{A}.model == "a100"',)),
            )
        ),
        [rslice(gpus(2, model="a100"))],
        no_fit=("asks for all matching devices, and none matches",),
    ),
    Row(
        "all-after-exact-count-continues-with-the-first-subrequest",
        f"{ALLOCATOR}: allocateOne, All recurses with deviceIndices without subRequestIndex,"
        " so after its first device subrequest 0 continues (1.34 and 1.35; fixed in 1.36)",
        claim(
            first_available(
                "g",
                exact("two", count=2, selectors=(f'{A}.model == "h100"',)),
                exact("every", mode="All"),
            )
        ),
        [rslice([*gpus(3, model="a100"), dev("gpu-9", attrs={"type": "gpu", "model": "h100"})])],
        fits={"g/every": ["gpu-0"], "g/two": ["gpu-9"]},
    ),
    Row(
        "all-after-exact-count-one-takes-one-device",
        f"{ALLOCATOR}: allocateOne, after device 0 the index is past subrequest 0's count 1,"
        " so the request is done (1.34 and 1.35)",
        claim(
            first_available(
                "g",
                exact("one", selectors=(f'{A}.model == "h100"',)),
                exact("every", mode="All"),
            )
        ),
        [rslice(gpus(3, model="a100"))],
        fits={"g/every": ["gpu-0"]},
    ),
    Row(
        "all-after-exact-count-fails-where-the-first-subrequest-has-no-devices",
        f"{ALLOCATOR}: allocateOne continues subrequest 0 (count 2) at device 1 and finds"
        " none of its devices (1.34 and 1.35)",
        claim(
            first_available(
                "g",
                exact("two", count=2, selectors=(f'{A}.model == "h100"',)),
                exact("every", mode="All"),
            )
        ),
        [rslice(gpus(3, model="a100"))],
        no_fit=("g/every",),
    ),
]


def run(row: Row) -> Explanation:
    return explain(row.claim, [GPU, MIG], row.slices, row.allocs, cel=CelEnvironment())


def picked(e: Explanation) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in e.allocation()["devices"]["results"]:
        out.setdefault(r["request"], []).append(r["device"])
    return out


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_all_mode_as_upstream(row: Row) -> None:
    e = run(row)
    if row.fits is not None:
        assert e.ok, e.text()
        assert e.error is None
        assert picked(e) == row.fits
        return
    assert not e.ok
    if row.error:
        assert e.error is not None, e.text()
        for part in row.error:
            assert part in e.error.text, (part, e.error.text)
        return
    assert e.error is None, e.error.text
    reason = e.first_reason()
    for part in row.no_fit:
        assert part in reason, (part, reason)


def _constraint_error() -> Explanation:
    return explain(
        claim(exact("g", mode="All"), constraints=SAME_NUMA),
        [GPU],
        [rslice(NUMA)],
        [],
        cel=CelEnvironment(),
    )


def test_an_error_says_so_in_the_text() -> None:
    first, *rest = _constraint_error().text().splitlines()
    assert first.startswith("error: ")
    assert "the scheduler stops scheduling the pod with this error" in first
    assert any("gpu-2" in line for line in rest)


def test_an_error_in_json_carries_the_upstream_message() -> None:
    j = _constraint_error().to_json()
    assert j["fits"] is False
    assert j["error"] == j["fatal"]["text"]
    assert j["fatal"]["kind"] == "constraint"
    assert j["fatal"]["upstream"] == (
        "claim default/c, request g: cannot add device gpu.tessera.dev/node-a/gpu-2"
        " because a claim constraint would not be satisfied"
    )
    assert j["fatal"]["device"] == "gpu-2"


def test_does_not_fit_is_no_error_in_json() -> None:
    e = explain(claim(exact("g", count=2)), [GPU], [rslice(gpus(1))], [], cel=CelEnvironment())
    j = e.to_json()
    assert (j["fits"], j["error"], j["fatal"]) == (False, None, None)


def test_the_second_subrequests_all_reads_the_first_subrequests_selectors() -> None:
    e = run(next(r for r in ROWS if r.id.startswith("all-after-all-selects")))
    alt = e.to_json()["requests"][0]["alternatives"][1]
    assert alt["candidates"] == 0
    assert "subrequest g/h's class and selectors" in alt["failure"]["reason"]
    assert "1.34 and 1.35" in alt["failure"]["reason"]


def test_all_in_first_available_on_a_time_slicing_node(inventory: Inventory) -> None:
    """The case of issue 26 on `tessera slices --simulate dgx-h100 --sharing time-slicing`:
    a GPU that allows multiple allocations, the first subrequest asking more memory than a
    GPU has, the second for all GPUs. 1.34 and 1.35 take the first GPU for the All
    subrequest and then look for the first subrequest's second device, which does not exist
    (allocateOne's All path drops the subrequest index), so the claim does not fit."""
    node = slices(inventory, "dgx-h100", sharing="time-slicing")
    big = exact("big", "gpu.tessera.dev", count=2, capacity={"memory": "100Gi"})
    every = exact("every", "gpu.tessera.dev", mode="All")
    e = explain(claim(first_available("g", big, every)), CLASSES, node, [], cel=CelEnvironment())
    assert not e.ok, e.text()
    assert e.error is None
    # with one GPU of memory asked, the first subrequest finds its second GPU: one of each
    fits = exact("big", "gpu.tessera.dev", count=2, capacity={"memory": "40Gi"})
    fits = {
        **fits,
        "exactly": {**fits["exactly"], "selectors": [{"cel": {"expression": f"{A}.index == 7"}}]},
    }
    e = explain(claim(first_available("g", fits, every)), CLASSES, node, [], cel=CelEnvironment())
    assert e.ok, e.text()
    assert picked(e) == {"g/every": ["gpu-0"], "g/big": ["gpu-7"]}
    assert e.text().startswith("fits: g/every -> gpu-0, gpu-7 (as g/big) (pool dgx-h100;")


def test_an_unknown_class_does_not_fit_and_is_no_error() -> None:
    """The scheduler's PreFilter answers a missing DeviceClass before any allocator runs:
    unschedulable, "request R: device class C does not exist" (kubernetes
    pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go, validateDeviceClass),
    and the pod waits for the class; no error."""
    e = explain(claim(exact("g", "nope")), [GPU], [rslice(gpus(1))], [], cel=CelEnvironment())
    assert not e.ok
    assert e.error is None
    assert "DeviceClass 'nope' not found" in e.first_reason()
    assert e.text().startswith("does not fit: ")
    assert e.to_json()["error"] is None


def test_over_the_limit_goes_straight_to_the_next_subrequest() -> None:
    """allocateOne returns errAllocationResultMaxSizeExceeded when a request would take the
    claim over 32 devices, and every caller passes it up without trying its other devices
    until a firstAvailable request's loop tries its next subrequest
    (structured/internal/incubating/allocator_incubating.go, allocateOne). So 20 GPUs for
    the first subrequest and then 20 more are refused at once and the second subrequest
    fits; a search that tried every other choice of the 20 first would not end (a fake clock
    of 1 ms a look gives it 10,000 looks)."""
    c = claim(
        first_available("a", exact("many", count=20), exact("one")),
        exact("b", count=20),
    )
    e = explain(
        c, [GPU], [rslice(gpus(40))], [], cel=CelEnvironment(), clock=FakeClock(0.0, step=0.001)
    )
    assert e.ok, e.text()
    assert picked(e) == {"a/one": ["gpu-0"], "b": [f"gpu-{i}" for i in range(1, 21)]}
    assert e.outcome.steps < 100


def test_over_the_limit_on_every_path_is_an_error() -> None:
    """errAllocationResultMaxSizeExceeded from every subrequest of the first request reaches
    Allocate, which returns it: "allocation max size exceeded", an error of the claim. One
    claim meets it only through 1.34/1.35's All quirk: the All subrequest continues as the
    first one (32 devices), and the next request's one device is the 33rd."""
    c = claim(
        first_available(
            "a",
            exact("many", count=32),
            exact("every", mode="All", selectors=(f'"nic" in {A}',)),
        ),
        exact("b"),
    )
    slices = [rslice([*gpus(40), dev("nic-0", attrs={"type": "gpu", "nic": True})])]
    e = explain(c, [GPU], slices, [], cel=CelEnvironment(), clock=FakeClock(0.0, step=0.001))
    assert not e.ok
    assert e.error is not None, e.text()
    assert e.error.details["upstream"] == "allocation max size exceeded"


def test_all_mig_placements_of_a_dynamic_mig_node_are_an_error(inventory: Inventory) -> None:
    """`tessera slices --simulate dgx-a100 --mig-mode dynamic` publishes 200 MIG placements:
    All of them is over the claim limit before any search (Allocate), an error of the claim."""
    node = slices(inventory, "dgx-a100", mig_mode="dynamic")
    e = explain(
        claim(exact("mig", "mig.gpu.tessera.dev", mode="All")),
        CLASSES,
        node,
        [],
        cel=CelEnvironment(),
    )
    assert e.error is not None and not e.ok
    assert e.error.details["upstream"] == (
        "claim default/c: number of requested devices 200 exceeds the claim limit of 32"
    )
    assert e.to_json()["error"].startswith(e.error.details["upstream"])
