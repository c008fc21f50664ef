"""The allocator (dra_driver.scheduler): claims x devices with the allocations and the reasons a
user reads, one behaviour of the scheduler's structured allocator per case."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from dra_driver.scheduler.celenv import CelEnvironment
from dra_driver.scheduler.domain import InputError
from dra_driver.scheduler.explanation import Explanation, explain
from tests.dra_driver.allocator_helpers import (
    DRIVER,
    GPU,
    MIG,
    MIG_COUNTERS,
    MIGS,
    A,
    allocated,
    claim,
    dev,
    exact,
    first_available,
    klass,
    rslice,
)
from tests.dra_driver.fakecel import FakeCel
from tests.fakeclock import FakeClock

NIC = klass("nic", f'{A}.type == "nic"')
ANY = klass("any", "true")


def gpus(n: int, **attrs: Any) -> list[dict[str, Any]]:
    return [dev(f"gpu-{i}", attrs={"type": "gpu", **attrs}) for i in range(n)]


def run(
    c: dict[str, Any],
    slices: list[dict[str, Any]],
    classes: list[dict[str, Any]] | None = None,
    allocs: list[dict[str, Any]] | None = None,
    **kw: Any,
) -> Explanation:
    return explain(
        c, classes or [GPU, NIC, MIG, ANY], slices, allocs or [], cel=CelEnvironment(), **kw
    )


def picked(e: Explanation) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in e.allocation()["devices"]["results"]:
        out.setdefault(r["request"], []).append(r["device"])
    return out


def reason_of(
    e: Explanation, device: str, alternative: int = 0, request: int = 0
) -> dict[str, Any]:
    alt = e.to_json()["requests"][request]["alternatives"][alternative]
    return next(d["reason"] for d in alt["devices"] if d["device"] == device)


@dataclass
class Case:
    id: str
    claim: dict[str, Any]
    slices: list[dict[str, Any]]
    fits: dict[str, list[str]] | None = None
    """Request -> devices, when the claim fits."""
    reason: tuple[str, ...] = ()
    """Substrings of first_reason() when it does not."""
    rejected: dict[str, str] = field(default_factory=dict)
    """Device -> reason kind (first alternative of the first request)."""
    allocs: list[dict[str, Any]] = field(default_factory=list)
    classes: list[dict[str, Any]] | None = None
    in_use: tuple[tuple[str, str, str], ...] = ()


CLIQUES = [
    dev("gpu-0", attrs={"type": "gpu", "clique": "a"}),
    dev("gpu-1", attrs={"type": "gpu", "clique": "b"}),
    dev("gpu-2", attrs={"type": "gpu", "clique": "b"}),
    dev("gpu-3", attrs={"type": "gpu"}),
]
MEMORY_POLICY = {"default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}
SHARED = [
    dev(
        "gpu-0",
        attrs={"type": "gpu"},
        multi=True,
        capacity={"memory": {"value": "80Gi", "requestPolicy": MEMORY_POLICY}},
    )
]

CASES = [
    Case(
        "exact-count-first-fit",
        claim(exact("gpus", count=2)),
        [rslice(gpus(3))],
        fits={"gpus": ["gpu-0", "gpu-1"]},
    ),
    Case("count-defaults-to-one", claim(exact("gpu")), [rslice(gpus(2))], fits={"gpu": ["gpu-0"]}),
    Case(
        "results-in-request-order",
        claim(exact("nic", "nic"), exact("gpu")),
        [rslice([*gpus(1), dev("nic-0", attrs={"type": "nic"})])],
        fits={"nic": ["nic-0"], "gpu": ["gpu-0"]},
    ),
    Case(
        "class-selector-false",
        claim(exact("g", count=2)),
        [rslice([*gpus(1), dev("nic-0", attrs={"type": "nic"})])],
        reason=("request g needs 2, 1 candidate", "1 class selector false"),
        rejected={"nic-0": "class-selector"},
    ),
    Case(
        "request-selector-false",
        claim(exact("g", selectors=(f'{A}.model == "h100"',))),
        [rslice(gpus(2, model="a100"))],
        reason=("needs 1, 0 candidates", "2 request selector false"),
        rejected={"gpu-0": "request-selector"},
    ),
    Case(
        "cel-runtime-error-stops-the-node",
        claim(exact("g", selectors=(f'{A}.model == "h100"',))),
        [
            rslice(
                [
                    dev("gpu-0", attrs={"type": "gpu", "model": "h100"}),
                    dev("gpu-1", attrs={"type": "gpu"}),
                ]
            )
        ],
        reason=(
            "device gpu-1",
            "CEL runtime error",
            "no such key: model",
            "stops allocating on this node",
        ),
    ),
    Case(
        "cel-error-on-allocated-device-not-reached",
        claim(exact("g", selectors=(f'{A}.model == "h100"',))),
        [
            rslice(
                [
                    dev("gpu-0", attrs={"type": "gpu", "model": "h100"}),
                    dev("gpu-1", attrs={"type": "gpu"}),
                ]
            )
        ],
        allocs=[allocated("other", {"device": "gpu-1"})],
        fits={"g": ["gpu-0"]},
    ),
    Case(
        "unknown-class",
        claim(exact("g", "gpus.example.com")),
        [rslice(gpus(1))],
        reason=("request g: DeviceClass 'gpus.example.com' not found", "known: any, gpu"),
    ),
    Case(
        "all-takes-every-match",
        claim(exact("g", mode="All")),
        [rslice([*gpus(3), dev("nic-0", attrs={"type": "nic"})])],
        fits={"g": ["gpu-0", "gpu-1", "gpu-2"]},
    ),
    Case(
        "all-fails-when-one-is-allocated",
        claim(exact("g", mode="All")),
        [rslice(gpus(3))],
        allocs=[allocated("other", {"device": "gpu-1"})],
        reason=(
            "allocationMode All",
            "needs every matching device",
            "gpu-1",
            "allocated to claim default/other",
        ),
    ),
    Case(
        "all-with-admin-access-ignores-allocations",
        claim(exact("g", mode="All", admin=True)),
        [rslice(gpus(2))],
        allocs=[allocated("other", {"device": "gpu-1"})],
        fits={"g": ["gpu-0", "gpu-1"]},
    ),
    Case(
        "all-needs-at-least-one",
        claim(exact("g", "nic", mode="All")),
        [rslice(gpus(1))],
        reason=("asks for all matching devices, and none matches",),
    ),
    Case(
        "all-refuses-an-incomplete-pool",
        claim(exact("g", mode="All")),
        [rslice(gpus(1)), rslice([dev("x", attrs={"type": "gpu"})], pool="other", count=2)],
        reason=("asks for all devices", "pool gpu.tessera.dev/other is incomplete"),
    ),
    Case(
        "first-available-second-subrequest",
        claim(
            first_available(
                "g",
                exact("big", selectors=(f'{A}.model == "h100"',)),
                exact("small", selectors=(f'{A}.model == "a100"',)),
            )
        ),
        [rslice(gpus(1, model="a100"))],
        fits={"g/small": ["gpu-0"]},
    ),
    Case(
        "first-available-first-wins",
        claim(first_available("g", exact("two", count=2), exact("one"))),
        [rslice(gpus(2))],
        fits={"g/two": ["gpu-0", "gpu-1"]},
    ),
    Case(
        "match-attribute-backtracks-past-the-first-gpu",
        claim(exact("gpus", count=2), constraints=[{"matchAttribute": f"{DRIVER}/clique"}]),
        [rslice(CLIQUES)],
        fits={"gpus": ["gpu-1", "gpu-2"]},
    ),
    Case(
        "match-attribute-missing-attribute-fails-the-constraint",
        claim(exact("gpus", count=3), constraints=[{"matchAttribute": f"{DRIVER}/clique"}]),
        [rslice(CLIQUES)],
        reason=(
            "needs 3, 3 candidates, but no 3 of them fit together",
            "matchAttribute",
            "clique: b, but gpu-0 has a",
        ),
        rejected={"gpu-3": "constraint"},
    ),
    Case(
        "distinct-attribute",
        claim(exact("gpus", count=2), constraints=[{"distinctAttribute": f"{DRIVER}/clique"}]),
        [rslice([CLIQUES[1], CLIQUES[2], CLIQUES[0]])],
        fits={"gpus": ["gpu-1", "gpu-0"]},
    ),
    Case(
        "distinct-attribute-conflict",
        claim(exact("gpus", count=2), constraints=[{"distinctAttribute": f"{DRIVER}/clique"}]),
        [rslice([CLIQUES[1], CLIQUES[2]])],
        reason=("no 2 of them fit together", "distinctAttribute", "b is already taken by gpu-1"),
    ),
    Case(
        "constraint-across-requests-with-requests-list",
        claim(
            exact("gpu"),
            exact("nic", "nic"),
            constraints=[
                {"requests": ["gpu", "nic"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}
            ],
        ),
        [
            rslice(
                [
                    dev("gpu-0", attrs={"type": "gpu", "resource.kubernetes.io/pcieRoot": "p0"}),
                    dev("gpu-1", attrs={"type": "gpu", "resource.kubernetes.io/pcieRoot": "p1"}),
                    dev("nic-1", attrs={"type": "nic", "resource.kubernetes.io/pcieRoot": "p1"}),
                ]
            )
        ],
        fits={"gpu": ["gpu-1"], "nic": ["nic-1"]},
    ),
    Case(
        "constraint-names-a-subrequest",
        claim(
            first_available(
                "g",
                exact("a", selectors=(f'{A}.clique == "a"',)),
                exact("b", selectors=(f'{A}.clique == "b"',)),
            ),
            exact("h"),
            constraints=[{"requests": ["g/b", "h"], "matchAttribute": f"{DRIVER}/clique"}],
        ),
        [rslice(CLIQUES[1:3])],
        fits={"g/b": ["gpu-1"], "h": ["gpu-2"]},
    ),
    Case(
        "counters-first-mig-placement-blocks-the-second-request",
        claim(
            exact("small", "mig", selectors=(f'{A}.profile == "1g"',)),
            exact("big", "mig", selectors=(f'{A}.profile == "3g"',)),
        ),
        [
            rslice([], name="counters", count=2, counters=MIG_COUNTERS),
            rslice(MIGS, name="devices", count=2),
        ],
        fits={"small": ["mig-1g-3"], "big": ["mig-3g-0"]},
    ),
    Case(
        "counters-exhausted-within-the-claim",
        claim(
            exact("m", "mig", count=2, selectors=(f'{A}.profile == "3g"',)),
            exact("s", "mig", count=2, selectors=(f'{A}.profile == "1g"',)),
        ),
        [
            rslice([], name="counters", count=2, counters=MIG_COUNTERS),
            rslice(MIGS, name="devices", count=2),
        ],
        reason=("request m needs 2, 1 candidate",),
    ),
    Case(
        "counters-used-by-an-allocated-claim",
        claim(exact("big", "mig", selectors=(f'{A}.profile == "3g"',))),
        [
            rslice([], name="counters", count=2, counters=MIG_COUNTERS),
            rslice(MIGS, name="devices", count=2),
        ],
        allocs=[allocated("train", {"device": "mig-1g-0"})],
        reason=("needs 1, 0 candidates", "1 counters exhausted"),
        rejected={"mig-3g-0": "counters", "mig-1g-0": "request-selector"},
    ),
    Case(
        "shared-device-capacity-rounded-up",
        claim(exact("g", capacity={"memory": "8.5Gi"})),
        [rslice(SHARED)],
        fits={"g": ["gpu-0"]},
    ),
    Case(
        "shared-device-capacity-left-by-others",
        claim(exact("g", capacity={"memory": "8Gi"})),
        [rslice(SHARED)],
        allocs=[
            allocated(
                "a", {"device": "gpu-0", "shareID": "s1", "consumedCapacity": {"memory": "75Gi"}}
            )
        ],
        reason=("needs 1, 0 candidates",),
        rejected={"gpu-0": "capacity"},
    ),
    Case(
        "two-requests-share-one-device",
        claim(exact("a", capacity={"memory": "40Gi"}), exact("b", capacity={"memory": "40Gi"})),
        [rslice(SHARED)],
        fits={"a": ["gpu-0"], "b": ["gpu-0"]},
    ),
    Case(
        "two-shares-too-big-together",
        claim(exact("a", capacity={"memory": "41Gi"}), exact("b", capacity={"memory": "40Gi"})),
        [rslice(SHARED)],
        reason=(
            "request b needs 1, 1 candidate, but none fits with the rest of the claim",
            "capacity memory too small",
            "available 39Gi",
        ),
    ),
    Case(
        "exclusive-device-capacity-request-too-big",
        claim(exact("g", capacity={"memory": "48Gi"})),
        [
            rslice(
                [
                    dev("gpu-0", attrs={"type": "gpu"}, capacity={"memory": "40Gi"}),
                    dev("gpu-1", attrs={"type": "gpu"}, capacity={"memory": "80Gi"}),
                ]
            )
        ],
        fits={"g": ["gpu-1"]},
    ),
    Case(
        "capacity-the-device-does-not-have",
        claim(exact("g", capacity={"cores": "4"})),
        [rslice(SHARED)],
        reason=("0 candidates",),
        rejected={"gpu-0": "capacity"},
    ),
    Case(
        "allocated-to-another-claim",
        claim(exact("g", count=2)),
        [rslice(gpus(2))],
        allocs=[allocated("job", {"device": "gpu-0"}, namespace="team")],
        reason=("needs 2, 1 candidate", "1 allocated"),
        rejected={"gpu-0": "allocated"},
    ),
    Case(
        "in-use-devices-are-excluded",
        claim(exact("g")),
        [rslice(gpus(2))],
        in_use=((DRIVER, "node-a", "gpu-0"),),
        fits={"g": ["gpu-1"]},
    ),
    Case(
        "admin-access-results-do-not-block",
        claim(exact("g")),
        [rslice(gpus(1))],
        allocs=[allocated("monitor", {"device": "gpu-0", "adminAccess": True})],
        fits={"g": ["gpu-0"]},
    ),
    Case(
        "admin-access-may-use-allocated-devices",
        claim(exact("g", admin=True)),
        [rslice(gpus(1))],
        allocs=[allocated("job", {"device": "gpu-0"})],
        fits={"g": ["gpu-0"]},
    ),
    Case(
        "admin-access-not-twice-in-one-claim",
        claim(exact("a", admin=True), exact("b", admin=True)),
        [rslice(gpus(1))],
        reason=(
            "request b needs 1, 1 candidate, but none fits with the rest of the claim",
            "already chosen for request a of this claim",
        ),
    ),
    Case(
        "taint-not-tolerated",
        claim(exact("g")),
        [
            rslice(
                [
                    dev(
                        "gpu-0",
                        attrs={"type": "gpu"},
                        taints=[
                            {
                                "key": f"{DRIVER}/unhealthy",
                                "value": "xid-79",
                                "effect": "NoSchedule",
                            }
                        ],
                    )
                ]
            )
        ],
        reason=("0 candidates", "1 tainted"),
        rejected={"gpu-0": "tainted"},
    ),
    Case(
        "taint-tolerated-exists",
        claim(exact("g", tolerations=[{"key": f"{DRIVER}/unhealthy", "operator": "Exists"}])),
        [
            rslice(
                [
                    dev(
                        "gpu-0",
                        attrs={"type": "gpu"},
                        taints=[
                            {"key": f"{DRIVER}/unhealthy", "value": "x", "effect": "NoExecute"}
                        ],
                    )
                ]
            )
        ],
        fits={"g": ["gpu-0"]},
    ),
    Case(
        "taint-toleration-wrong-value",
        claim(exact("g", tolerations=[{"key": "k", "value": "other", "effect": "NoSchedule"}])),
        [
            rslice(
                [
                    dev(
                        "gpu-0",
                        attrs={"type": "gpu"},
                        taints=[{"key": "k", "value": "v", "effect": "NoSchedule"}],
                    )
                ]
            )
        ],
        reason=("1 tainted",),
    ),
    Case(
        "taint-effect-none-is-ignored",
        claim(exact("g")),
        [
            rslice(
                [
                    dev(
                        "gpu-0",
                        attrs={"type": "gpu"},
                        taints=[{"key": "k", "value": "v", "effect": "None"}],
                    )
                ]
            )
        ],
        fits={"g": ["gpu-0"]},
    ),
    Case(
        "newest-generation-only",
        claim(exact("g")),
        [
            rslice([dev("old", attrs={"type": "gpu"})], generation=1),
            rslice([dev("new", attrs={"type": "gpu"})], generation=2),
        ],
        fits={"g": ["new"]},
    ),
    Case(
        "incomplete-pool-is-skipped",
        claim(exact("g")),
        [rslice(gpus(1), count=2)],
        reason=("0 candidates", "pool unusable"),
        rejected={"gpu-0": "pool"},
    ),
    Case(
        "invalid-pool-duplicate-device",
        claim(exact("g")),
        [rslice(gpus(1), name="s1", count=2), rslice(gpus(1), name="s2", count=2)],
        reason=("0 candidates",),
        rejected={"gpu-0": "pool"},
    ),
    Case(
        "pools-in-driver-and-name-order",
        claim(exact("g")),
        [
            rslice([dev("z", attrs={"type": "gpu"})], pool="zz"),
            rslice([dev("a", attrs={"type": "gpu"})], pool="aa"),
        ],
        fits={"g": ["a"]},
    ),
    Case("no-requests-fits", claim(), [rslice(gpus(1))], fits={}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_allocation_table(case: Case) -> None:
    e = run(case.claim, case.slices, case.classes, case.allocs, in_use=case.in_use)
    if case.fits is not None:
        assert e.ok, e.text()
        assert picked(e) == case.fits
        assert e.first_reason() == "fits"
    else:
        assert not e.ok
        for part in case.reason:
            assert part in e.first_reason(), e.text()
    for device, kind in case.rejected.items():
        assert reason_of(e, device)["kind"] == kind
    json.dumps(e.to_json())  # always serialisable


# -- what the results carry ---------------------------------------------------------------------


def test_shared_result_has_share_id_and_rounded_consumed_capacity() -> None:
    e = run(claim(exact("g", capacity={"memory": "8.5Gi"})), [rslice(SHARED)])
    (result,) = e.allocation()["devices"]["results"]
    assert result["consumedCapacity"] == {"memory": "9Gi"}
    assert result["shareID"]
    again = run(claim(exact("g", capacity={"memory": "8.5Gi"})), [rslice(SHARED)])
    assert again.allocation() == e.allocation()  # deterministic: the same input, the same IDs
    assert "gpu-0 shared: memory 9Gi" in e.text()


def test_shared_request_without_capacity_gets_the_default() -> None:
    e = run(claim(exact("g")), [rslice(SHARED)])
    assert e.allocation()["devices"]["results"][0]["consumedCapacity"] == {"memory": "1Gi"}


def test_exclusive_device_has_no_share() -> None:
    e = run(claim(exact("g")), [rslice(gpus(1))])
    (result,) = e.allocation()["devices"]["results"]
    assert result == {"request": "g", "driver": DRIVER, "pool": "node-a", "device": "gpu-0"}
    assert e.allocation()["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == [
        "node-a"
    ]


def test_admin_access_and_tolerations_are_in_the_result() -> None:
    tol = [{"key": "k", "operator": "Exists"}]
    e = run(claim(exact("g", admin=True, tolerations=tol)), [rslice(gpus(1))])
    (result,) = e.allocation()["devices"]["results"]
    assert result["adminAccess"] is True
    assert result["tolerations"] == [{"key": "k", "operator": "Exists"}]


@pytest.mark.parametrize(
    ("policy", "wanted", "consumed"),
    [
        ({"validValues": ["10Gi", "20Gi", "40Gi"]}, "11Gi", "20Gi"),
        ({"validValues": ["10Gi", "20Gi"]}, "20Gi", "20Gi"),
        ({"validRange": {"min": "4Gi", "step": "2Gi"}}, "1Gi", "4Gi"),
        ({"validRange": {"min": "4Gi", "step": "2Gi"}}, "5Gi", "6Gi"),
        ({"validRange": {"min": "4Gi"}}, "5Gi", "5Gi"),
        (None, "3Gi", "3Gi"),
    ],
)
def test_request_policy_rounds_up(
    policy: dict[str, Any] | None, wanted: str, consumed: str
) -> None:
    cap: dict[str, Any] = {"value": "80Gi"}
    if policy:
        cap["requestPolicy"] = policy
    d = dev("gpu-0", attrs={"type": "gpu"}, multi=True, capacity={"memory": cap})
    e = run(claim(exact("g", capacity={"memory": wanted})), [rslice([d])])
    assert e.allocation()["devices"]["results"][0]["consumedCapacity"] == {"memory": consumed}


@pytest.mark.parametrize(
    ("policy", "wanted"),
    [
        ({"validValues": ["10Gi", "20Gi"]}, "30Gi"),
        ({"validRange": {"min": "4Gi", "max": "16Gi"}}, "17Gi"),
    ],
)
def test_request_policy_violations(policy: dict[str, Any], wanted: str) -> None:
    d = dev(
        "gpu-0",
        attrs={"type": "gpu"},
        multi=True,
        capacity={"memory": {"value": "80Gi", "requestPolicy": policy}},
    )
    e = run(claim(exact("g", capacity={"memory": wanted})), [rslice([d])])
    r = reason_of(e, "gpu-0")
    assert r["kind"] == "capacity"
    assert "not allowed by its request policy" in r["text"]


def test_capacity_reason_names_requested_rounded_and_available() -> None:
    e = run(
        claim(exact("g", capacity={"memory": "7.5Gi"})),
        [rslice(SHARED)],
        allocs=[
            allocated(
                "a", {"device": "gpu-0", "shareID": "s", "consumedCapacity": {"memory": "75Gi"}}
            )
        ],
    )
    r = reason_of(e, "gpu-0")
    assert (r["requested"], r["rounded"], r["available"]) == ("7680Mi", "8Gi", "5Gi")


def test_counters_reason_names_the_set_the_counter_and_the_holder() -> None:
    e = run(
        claim(exact("big", "mig", selectors=(f'{A}.profile == "3g"',))),
        [
            rslice([], name="counters", count=2, counters=MIG_COUNTERS),
            rslice(MIGS, name="devices", count=2),
        ],
        allocs=[allocated("train", {"device": "mig-1g-0"})],
    )
    r = reason_of(e, "mig-3g-0")
    assert (r["counterSet"], r["counter"]) == ("gpu-0-set", "s0")
    assert "mig-1g-0 (claim default/train)" in r["text"]


def test_shared_device_consumes_its_counters_once() -> None:
    """A device allowing multiple allocations consumes its counters with its first share only
    (allocateDevice: skipCounterCheck)."""
    d = dev(
        "gpu-0",
        attrs={"type": "gpu"},
        multi=True,
        consumes={"set": {"c": 1}},
        capacity={"memory": {"value": "80Gi", "requestPolicy": MEMORY_POLICY}},
    )
    e = run(
        claim(exact("a", capacity={"memory": "8Gi"}), exact("b", capacity={"memory": "8Gi"})),
        [
            rslice([], name="counters", count=2, counters={"set": {"c": 1}}),
            rslice([d], name="devices", count=2),
        ],
        allocs=[],
    )
    assert picked(e) == {"a": ["gpu-0"], "b": ["gpu-0"]}


def test_claim_config_and_class_config_are_copied() -> None:
    gpu = klass("gpu", f'{A}.type == "gpu"')
    gpu["spec"]["config"] = [{"opaque": {"driver": DRIVER, "parameters": {"kind": "A"}}}]
    opaque = {"driver": DRIVER, "parameters": {"kind": "B"}}
    e = run(
        claim(exact("a"), exact("n", "nic"), config=[{"requests": ["a"], "opaque": opaque}]),
        [rslice([*gpus(1), dev("nic-0", attrs={"type": "nic"})])],
        classes=[gpu, NIC],
    )
    assert e.allocation()["devices"]["config"] == [
        {"source": "FromClass", "requests": ["a"], "opaque": gpu["spec"]["config"][0]["opaque"]},
        {"source": "FromClaim", "requests": ["a"], "opaque": opaque},
    ]


# -- explanation --------------------------------------------------------------------------------


def test_text_on_success_is_one_line() -> None:
    e = run(claim(exact("gpus", count=2)), [rslice(gpus(2))])
    assert e.text() == "fits: gpus -> gpu-0, gpu-1 (pool node-a)"


def test_text_on_failure_names_candidates_and_reasons() -> None:
    e = run(claim(exact("gpus", count=4, selectors=(f'{A}.clique == "b"',))), [rslice(CLIQUES[:3])])
    text = e.text()
    assert text.splitlines()[0].startswith("does not fit: request gpus needs 4, 2 candidates")
    assert "candidates: gpu-1, gpu-2" in text
    assert f'gpu-0: request gpus selector #0 is false: {A}.clique == "b"' in text
    assert 'saw device.attributes["gpu.tessera.dev"].clique="a"' in text
    assert len(text.splitlines()) <= 8


def test_request_selector_reason_carries_the_values_it_saw() -> None:
    e = run(claim(exact("g", selectors=(f'{A}.model == "h100"',))), [rslice(gpus(1, model="a100"))])
    r = reason_of(e, "gpu-0")
    assert r["expression"] == f'{A}.model == "h100"'
    assert r["seen"] == {'device.attributes["gpu.tessera.dev"].model': '"a100"'}


def test_class_selector_reason_names_the_class() -> None:
    e = run(claim(exact("g", "nic")), [rslice(gpus(1))])
    r = reason_of(e, "gpu-0")
    assert (r["kind"], r["class"], r["selector"]) == ("class-selector", "nic", 0)


def test_many_rejections_are_summarised() -> None:
    e = run(claim(exact("g", "nic")), [rslice(gpus(50))])
    text = e.text()
    assert "50 class selector false: gpu-0, gpu-1, gpu-2 and 47 more" in text
    assert len(text.splitlines()) <= 4


def test_json_shape() -> None:
    e = run(claim(first_available("g", exact("x", "nic"), exact("y"))), [rslice(gpus(2))])
    j = e.to_json()
    assert set(j) == {
        "claim",
        "fits",
        "gaveUp",
        "reason",
        "error",
        "fatal",
        "allocation",
        "requests",
        "pools",
        "ignored",
        "scheduler",
        "steps",
    }
    (req,) = j["requests"]
    assert (req["name"], req["firstAvailable"], req["selected"]) == ("g", True, "g/y")
    x, y = req["alternatives"]
    assert x["request"] == "g/x" and x["candidates"] == 0 and x["rejected"] == {"class-selector": 2}
    assert y["chosen"] == [{"driver": DRIVER, "pool": "node-a", "device": "gpu-0"}]
    assert [d["status"] for d in y["devices"]] == ["chosen", "candidate"]
    assert j["pools"] == [
        {
            "driver": DRIVER,
            "pool": "node-a",
            "generation": 1,
            "slices": 1,
            "resourceSliceCount": 1,
            "devices": 2,
            "problem": None,
        }
    ]


def test_failure_json_records_the_best_attempt() -> None:
    clique_c = dev("gpu-4", attrs={"type": "gpu", "clique": "c"})
    e = run(
        claim(exact("gpus", count=3), constraints=[{"matchAttribute": f"{DRIVER}/clique"}]),
        [rslice([*CLIQUES, clique_c])],
    )
    alt = e.to_json()["requests"][0]["alternatives"][0]
    assert [p["device"] for p in alt["failure"]["placed"]] == ["gpu-1", "gpu-2"]
    gpu0 = next(d for d in alt["devices"] if d["device"] == "gpu-0")
    assert gpu0["status"] == "candidate"
    assert gpu0["reason"]["kind"] == "constraint"
    assert gpu0["reason"]["conflictsWith"] == {"gpu-1": "b", "gpu-2": "b"}
    assert reason_of(e, "gpu-3")["kind"] == "constraint"  # no clique at all
    assert "best attempt: gpu-1, gpu-2; then" in e.text()


def test_too_many_devices_for_one_claim() -> None:
    # Allocate (structured/internal/incubating/allocator_incubating.go): an error of the claim
    e = run(claim(exact("g", count=33)), [rslice(gpus(40))])
    assert e.error is not None
    assert "number of requested devices 33 exceeds the claim limit of 32" in e.first_reason()


# -- time limit ---------------------------------------------------------------------------------


def test_gives_up_at_the_time_limit() -> None:
    # 16 devices in 16 cliques, 8 must match: no allocation, and a fake clock that advances a
    # second per look runs out long before the search does
    devices = [dev(f"gpu-{i}", attrs={"type": "gpu", "clique": f"c{i}"}) for i in range(16)]
    c = claim(
        exact("g", count=8), constraints=[{"distinctAttribute": f"{DRIVER}/clique"}], name="big"
    )
    c["spec"]["devices"]["constraints"] = [{"matchAttribute": f"{DRIVER}/clique"}]
    e = run(c, [rslice(devices)], time_limit_s=2, clock=FakeClock(0.0, step=1.0))
    assert e.gave_up and not e.ok
    assert e.first_reason().startswith("gave up after 2 s")
    assert e.to_json()["gaveUp"] is True


def test_enough_time_finds_the_answer() -> None:
    e = run(
        claim(exact("gpus", count=2), constraints=[{"matchAttribute": f"{DRIVER}/clique"}]),
        [rslice(CLIQUES)],
        time_limit_s=1000,
        clock=FakeClock(0.0, step=1.0),
    )
    assert e.ok and not e.gave_up


# -- work done once -----------------------------------------------------------------------------


def test_each_selector_is_evaluated_once_per_device() -> None:
    cel = FakeCel()
    c = claim(
        exact("a"),
        exact("b"),
        exact("c", count=2),
        first_available("d", exact("x", count=9), exact("y")),
    )
    fake_gpu = klass("gpu", 'type == "gpu"')  # the stand-in counts evaluations
    e = explain(c, [fake_gpu], [rslice(gpus(6))], [], cel=cel)  # type: ignore[arg-type]
    assert e.ok
    assert cel.views == 6
    assert cel.calls[0] == 6  # the class's one selector on six devices, shared by every request


# -- malformed input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mutate", "path", "message"),
    [
        (
            lambda c: c["spec"]["devices"]["requests"][0]["exactly"].update(count=0),
            "spec.devices.requests[0].exactly.count",
            "must be >= 1, got 0",
        ),
        (
            lambda c: c["spec"]["devices"]["requests"][0].update(deviceClassName="gpu"),
            "spec.devices.requests[0].deviceClassName",
            "v1beta1",
        ),
        (
            lambda c: c["spec"]["devices"]["requests"][0].update(firstAvailable=[]),
            "spec.devices.requests[0]",
            "exactly one of",
        ),
        (
            lambda c: c["spec"]["devices"]["requests"][0]["exactly"].update(allocationMode="Some"),
            "spec.devices.requests[0].exactly.allocationMode",
            "ExactCount or All",
        ),
        (
            lambda c: c["spec"]["devices"].update(
                constraints=[{"requests": ["nope"], "matchAttribute": "a/b"}]
            ),
            "spec.devices.constraints[0].requests[0]",
            "no request 'nope'",
        ),
        (
            lambda c: c["spec"]["devices"].update(constraints=[{"matchAttribute": "bare"}]),
            "spec.devices.constraints[0].matchAttribute",
            "fully qualified",
        ),
        (
            lambda c: c["spec"]["devices"]["requests"][0]["exactly"].update(
                capacity={"requests": {"memory": "lots"}}
            ),
            "spec.devices.requests[0].exactly.capacity.requests.memory",
            "not a quantity",
        ),
        (
            lambda c: c["spec"]["devices"]["requests"][0]["exactly"].update(
                selectors=[{"cel": {"expression": "@@"}}]
            ),
            "spec.devices.requests[0].exactly.selectors[0].cel.expression",
            "compilation failed",
        ),
        (
            lambda c: c["spec"]["devices"]["requests"].append(exact("g")),
            "spec.devices.requests[1].name",
            "used twice",
        ),
    ],
)
def test_malformed_claim(mutate: Callable[[dict[str, Any]], None], path: str, message: str) -> None:
    c = claim(exact("g"))
    mutate(c)
    with pytest.raises(InputError) as err:
        run(c, [rslice(gpus(1))])
    assert err.value.path == path
    assert message in err.value.message
    assert str(err.value).startswith(f"{path}: ")


def test_malformed_slice_names_the_slice_and_field() -> None:
    bad = rslice([dev("gpu-0", attrs={"type": "gpu"}, capacity={"memory": "x"})], name="s1")
    with pytest.raises(InputError) as err:
        run(claim(exact("g")), [bad])
    assert err.value.path == "ResourceSlice s1.spec.devices[0].capacity.memory.value"


def test_malformed_class_selector_names_the_class() -> None:
    with pytest.raises(InputError) as err:
        run(claim(exact("g")), [rslice(gpus(1))], classes=[klass("gpu", "@@")])
    assert err.value.path == "DeviceClass gpu.spec.selectors[0].cel.expression"


def test_malformed_allocated_claim() -> None:
    a = allocated("x", {"device": "gpu-0"})
    del a["status"]["allocation"]["devices"]["results"][0]["driver"]
    with pytest.raises(InputError) as err:
        run(claim(exact("g")), [rslice(gpus(1))], allocs=[a])
    assert err.value.path == "claim default/x: status.allocation.devices.results[0].driver"
