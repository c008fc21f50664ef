"""A pod's claims allocated together (dra_driver.scheduler.joint), as the scheduler's Filter
hands them to ``Allocate`` and its search backtracks across them. Each row cites the upstream
code it follows: ``allocator_incubating.go`` is k8s.io/dynamic-resource-allocation
``structured/internal/incubating/allocator_incubating.go`` (release-1.35; release-1.34 and the
stable and experimental variants chain claims the same way), ``dynamicresources.go`` is
kubernetes ``pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from dra_driver.scheduler.celenv import CelEnvironment
from dra_driver.scheduler.explanation import explain
from dra_driver.scheduler.joint import PodExplanation, explain_pod
from tests.dra_driver.allocator_helpers import (
    DRIVER,
    GPU,
    MIG,
    MIG_COUNTERS,
    MIGS,
    A,
    claim,
    dev,
    exact,
    first_available,
    rslice,
)
from tests.fakeclock import FakeClock

CLASSES = [GPU, MIG]
CEL = CelEnvironment()


def gpus(n: int, **attrs: Any) -> list[dict[str, Any]]:
    return [dev(f"gpu-{i}", attrs={"type": "gpu", **attrs}) for i in range(n)]


CLIQUES = [
    dev("gpu-0", attrs={"type": "gpu", "clique": "a"}),
    dev("gpu-1", attrs={"type": "gpu", "clique": "b"}),
    dev("gpu-2", attrs={"type": "gpu", "clique": "b"}),
]
CLIQUE_A = (f'{A}.clique == "a"',)


def named(name: str, *requests: dict[str, Any]) -> dict[str, Any]:
    return claim(*requests, name=name)


def one_after_another(claims: list[dict[str, Any]], slices: list[dict[str, Any]]) -> bool:
    """How explain allocated a pod's claims before: each alone, seeing the earlier ones'
    devices as allocated (no backtracking across claims)."""
    allocated: list[dict[str, Any]] = []
    for c in claims:
        e = explain(c, CLASSES, slices, allocated, cel=CEL)
        if not e.ok:
            return False
        allocated.append({**c, "status": {"allocation": e.allocation()}})
    return True


def picked(p: PodExplanation) -> dict[str, list[str]]:
    return {
        c.claim.name: [r["device"] for r in c.allocation()["devices"]["results"]] for c in p.claims
    }


@dataclass
class Case:
    id: str
    upstream: str
    """The upstream code the row follows."""
    claims: list[dict[str, Any]]
    slices: list[dict[str, Any]]
    fits: dict[str, list[str]] | None = None
    """Claim name -> devices, when the pod fits."""
    blocked: str | None = None
    """The claim that could not be placed, when it does not."""
    fits_alone: bool | None = None
    reason: tuple[str, ...] = ()
    greedy_fails: bool = False
    """One claim after another (no backtracking across claims) does not fit."""


CASES = [
    Case(
        "starved-by-a-taken-device",
        "allocator_incubating.go allocateOne: past a claim's last request the next claim"
        " (claimIndex + 1); its failure makes the earlier claim deallocate and try its next"
        " device",
        [named("any", exact("g")), named("clique-a", exact("g", selectors=CLIQUE_A))],
        [rslice(CLIQUES)],
        fits={"any": ["gpu-1"], "clique-a": ["gpu-0"]},
        greedy_fails=True,
    ),
    Case(
        "starved-by-counters",
        "allocator_incubating.go allocateDevice/checkAvailableCounters: consumedCounters is"
        " shared by every claim being allocated; allocateOne backtracks into the first claim",
        [
            named("small", exact("m", "mig")),
            named("big", exact("m", "mig", selectors=(f'{A}.profile == "3g"',))),
        ],
        [
            rslice([], name="counters", count=2, counters=MIG_COUNTERS),
            rslice(MIGS, name="devices", count=2),
        ],
        fits={"small": ["mig-1g-3"], "big": ["mig-3g-0"]},
        greedy_fails=True,
    ),
    Case(
        "backtracks-two-claims-back",
        "allocator_incubating.go allocateOne: the recursion runs through every claim, so a"
        " third claim's failure reaches the first claim's choices",
        [
            named("a", exact("g")),
            named("b", exact("g")),
            named("c", exact("g", selectors=CLIQUE_A)),
        ],
        [rslice(CLIQUES)],
        fits={"a": ["gpu-1"], "b": ["gpu-2"], "c": ["gpu-0"]},
        greedy_fails=True,
    ),
    Case(
        "claims-in-pod-order-first-fit",
        "dynamicresources.go Filter: claimsToAllocate in pod.spec.resourceClaims order"
        " (claimStore.toAllocate); allocator_incubating.go Allocate: the first full solution",
        [named("first", exact("g")), named("second", exact("g"))],
        [rslice(gpus(3))],
        fits={"first": ["gpu-0"], "second": ["gpu-1"]},
    ),
    Case(
        "claims-in-pod-order-reversed",
        "dynamicresources.go Filter: the order is the pod's, so the other order gives the"
        " other claim the first device",
        [named("second", exact("g")), named("first", exact("g"))],
        [rslice(gpus(3))],
        fits={"second": ["gpu-0"], "first": ["gpu-1"]},
    ),
    Case(
        "too-many-claims-for-the-node",
        "allocator_incubating.go allocateOne: every allocation of the earlier claims tried;"
        " Allocate returns no result (dynamicresources.go Filter: cannot allocate all claims)",
        [named(n, exact("g", count=2)) for n in ("a", "b", "c")],
        [rslice(gpus(4))],
        blocked="c",
        fits_alone=True,
        reason=(
            "default/c: fits alone, but not beside default/a, default/b",
            "already chosen for request g of claim default/a of this pod",
        ),
        greedy_fails=True,
    ),
    Case(
        "a-claim-that-fits-nowhere",
        "allocator_incubating.go allocateOne: the second claim has no candidate with any"
        " allocation of the first",
        [
            named("any", exact("g")),
            named("clique-z", exact("g", selectors=(f'{A}.clique == "z"',))),
        ],
        [rslice(CLIQUES)],
        blocked="clique-z",
        fits_alone=False,
        reason=("default/clique-z: ", "selector"),
        greedy_fails=True,
    ),
    Case(
        "the-first-claim-does-not-fit",
        "allocator_incubating.go allocateOne: the first claim fails, the later ones are never"
        " reached",
        [named("nine", exact("g", count=9)), named("one", exact("g"))],
        [rslice(gpus(4))],
        blocked="nine",
        reason=("default/nine: request g needs 9, 4 candidates",),
        greedy_fails=True,
    ),
    Case(
        "an-error-in-a-later-claim-stops-first",
        "allocator_incubating.go Allocate: validateDeviceRequest for every claim before"
        " allocateOne; an error stops allocation on the node even though an earlier claim"
        " does not fit either",
        [named("nine", exact("g", count=9)), named("unknown", exact("g", "no-such-class"))],
        [rslice(gpus(4))],
        blocked="unknown",
        reason=("default/unknown: ", "no-such-class", "not found"),
        greedy_fails=True,
    ),
    Case(
        "admin-access-may-share-another-claims-device",
        "allocator_incubating.go allocateDevice: a request with admin access is refused only a"
        " device its own claim is allocating (allocatingDeviceForClaim)",
        [named("user", exact("g")), named("monitor", exact("g", admin=True))],
        [rslice(gpus(1))],
        fits={"user": ["gpu-0"], "monitor": ["gpu-0"]},
    ),
    Case(
        "an-admin-access-pick-is-in-use-for-other-claims",
        "allocator_incubating.go deviceInUse/allocatingDeviceForAnyClaim: allocatingDevices"
        " holds admin-access picks too",
        [named("monitor", exact("g", admin=True)), named("user", exact("g"))],
        [rslice(gpus(2))],
        fits={"monitor": ["gpu-0"], "user": ["gpu-1"]},
    ),
    Case(
        "the-result-limit-is-per-claim",
        "allocator_incubating.go allocateOne: len(alloc.result[r.claimIndex].devices) against"
        " AllocationResultsMaxSize (32), one claim's results",
        [named("a", exact("g", count=20)), named("b", exact("g", count=20))],
        [rslice(gpus(40))],
        fits={"a": [f"gpu-{i}" for i in range(20)], "b": [f"gpu-{i}" for i in range(20, 40)]},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_pods_claims_are_allocated_together(case: Case) -> None:
    p = explain_pod(case.claims, CLASSES, case.slices, [], cel=CEL)
    assert one_after_another(case.claims, case.slices) is not case.greedy_fails
    if case.fits is not None:
        assert p.ok and p.first_reason() == "fits", p.first_reason()
        assert picked(p) == case.fits
        assert p.blocked is None
        return
    assert not p.ok
    assert p.blocked is not None and p.claims[p.blocked].claim.name == case.blocked
    assert p.fits_alone is case.fits_alone
    reason = p.first_reason()
    for part in case.reason:
        assert part in reason, reason
    assert all(not c.ok for c in p.claims)  # all or nothing


def test_the_claim_that_could_not_be_placed_names_who_took_its_devices() -> None:
    claims = [named(n, exact("g", count=2)) for n in ("a", "b", "c")]
    p = explain_pod(claims, CLASSES, [rslice(gpus(4))], [], cel=CEL)
    text = p.text(2)
    assert text.startswith("does not fit: fits alone, but not beside default/a, default/b")
    assert "already chosen for request g of claim default/" in text
    assert p.text(0).startswith("not allocated: it can be placed, but then default/c cannot")
    assert [p.status(i) for i in range(3)] == ["placed", "placed", "blocked"]
    devices = p.claims[2].to_json()["requests"][0]["alternatives"][0]["devices"]
    kinds = {d["device"]: (d["reason"]["kind"], d["reason"]["claim"]) for d in devices}
    assert kinds["gpu-0"] == ("taken-in-pod", "default/a")
    assert kinds["gpu-2"] == ("taken-in-pod", "default/b")
    nowhere = explain_pod(
        [named("any", exact("g")), named("nine", exact("g", count=9))],
        CLASSES,
        [rslice(gpus(4))],
        [],
        cel=CEL,
    )
    assert (
        nowhere.text(0)
        == "not allocated: default/nine does not fit on this node, with or without it"
    )
    later = explain_pod(
        [named("nine", exact("g", count=9)), named("one", exact("g"))],
        CLASSES,
        [rslice(gpus(4))],
        [],
        cel=CEL,
    )
    assert later.text(1) == "not tried: default/nine before it could not be placed"


def test_claims_already_allocated_hold_their_devices_for_the_pod() -> None:
    # dynamicresources.go PreFilter: an allocated claim's devices are in the allocated state
    # (ListAllAllocatedDevices); only the others are handed to Allocate
    held = {
        **named("held", exact("g")),
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "g", "driver": DRIVER, "pool": "node-a", "device": "gpu-0"}
                    ]
                }
            }
        },
    }
    p = explain_pod([named("new", exact("g"))], CLASSES, [rslice(gpus(2))], [held], cel=CEL)
    assert picked(p) == {"new": ["gpu-1"]}


def test_one_claim_answers_as_explain_does() -> None:
    c = named("one", exact("g", count=2, selectors=CLIQUE_A))
    alone = explain(c, CLASSES, [rslice(CLIQUES)], [], cel=CEL)
    p = explain_pod([c], CLASSES, [rslice(CLIQUES)], [], cel=CEL)
    assert not p.ok and p.first_reason() == alone.first_reason()
    assert p.claims[0].to_json() == alone.to_json()


def test_the_time_limit_bounds_the_whole_search() -> None:
    # 12 claims of one GPU each on 11 GPUs: every allocation of the first claims is tried
    claims = [named(f"c{i}", exact("g")) for i in range(12)]
    clock = FakeClock(step=0.001)
    p = explain_pod(claims, CLASSES, [rslice(gpus(11))], [], cel=CEL, time_limit_s=0.5, clock=clock)
    assert not p.ok and p.gave_up
    assert "gave up after 0.5 s" in p.first_reason()


def test_a_pod_is_allocated_under_the_scheduler_modelled() -> None:
    """The pod's claims go through the same version and gates as one claim (``explain``):
    with DRAPrioritizedList off, ``Allocate`` refuses a claim with ``firstAvailable`` before
    any search (allocator_incubating.go, validateDeviceRequest; the gate's check in
    ``gates.refusal``), so the pod stops at that claim's error; with the gate on it fits."""
    from dra_driver.scheduler.versions import PRIORITIZED_LIST, Scheduler

    claims = [
        named("plain", exact("gpus", count=1)),
        named("alternatives", first_available("gpus", exact("two", count=2), exact("one"))),
    ]
    slices = [rslice(gpus(2))]
    on = explain_pod(claims, CLASSES, slices, [], cel=CEL)
    assert on.ok and picked(on) == {"plain": ["gpu-0"], "alternatives": ["gpu-1"]}
    off = explain_pod(
        claims,
        CLASSES,
        slices,
        [],
        cel=CEL,
        scheduler=Scheduler.of(overrides={PRIORITIZED_LIST: False}),
    )
    assert not off.ok and off.blocked == 1
    assert off.claims[1].error is not None and "DRAPrioritizedList" in off.claims[1].error.text
    assert off.claims[1].scheduler.enabled(PRIORITIZED_LIST) is False
