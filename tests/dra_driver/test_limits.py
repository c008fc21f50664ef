"""check_slice / check_pool: each API limit, broken on purpose, is reported."""

from __future__ import annotations

import copy
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest

from dra_driver.advertise.slice_limits import check_pool, check_slice, is_semver, parse_quantity
from tests.k8sschema import validate as validate_k8s

Obj = dict[str, Any]


def device(name: str = "gpu-0", counter_set: str | None = None) -> Obj:
    dev: Obj = {
        "name": name,
        "attributes": {
            "type": {"string": "gpu"},
            "index": {"int": 0},
            "driverVersion": {"version": "550.90.7"},
            "resource.kubernetes.io/pcieRoot": {"string": "pci0000:16"},
        },
        "capacity": {"memory": {"value": "80Gi"}},
    }
    if counter_set:
        dev["consumesCounters"] = [
            {"counterSet": counter_set, "counters": {"memory-slice-0": {"value": "1"}}}
        ]
    return dev


def counter_set(name: str = "gpu-0-counter-set", n: int = 2) -> Obj:
    return {"name": name, "counters": {f"memory-slice-{i}": {"value": "1"} for i in range(n)}}


def base(layout: str, *, devices: list[Obj] | None = None, sets: list[Obj] | None = None) -> Obj:
    spec: Obj = {
        "driver": "gpu.tessera.dev",
        "nodeName": "node-a",
        "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
    }
    if devices is not None:
        spec["devices"] = devices
    if sets is not None:
        spec["sharedCounters"] = sets
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-a-gpu-tessera-dev-0"},
        "spec": spec,
    }


def good(layout: str) -> Obj:
    if layout == "1.34":
        return base(layout, devices=[device(counter_set="gpu-0-counter-set")], sets=[counter_set()])
    return base(layout, devices=[device()])


@pytest.mark.parametrize("layout", ["1.34", "1.35"], ids=str)
def test_good_slices_pass(layout: str) -> None:
    obj = good(layout)
    assert check_slice(obj, layout) == []
    validate_k8s(obj, f"{layout}.0")


def test_unknown_layout_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="layout"):
        check_slice(good("1.35"), "1.33")


def spec(o: Obj) -> Obj:
    return o["spec"]  # type: ignore[no-any-return]


def dev0(o: Obj) -> Obj:
    return spec(o)["devices"][0]  # type: ignore[no-any-return]


def many_attributes(o: Obj) -> None:
    dev0(o)["attributes"] |= {f"a{i}": {"int": i} for i in range(30)}


Mutation = Callable[[Obj], object]

# (id, layout, mutation, expected message fragment)
VIOLATIONS: list[tuple[str, str, Mutation, str]] = [
    ("kind", "1.35", lambda o: o.update(kind="Slice"), "apiVersion/kind"),
    ("slice-name", "1.35", lambda o: o["metadata"].update(name="Bad_Name"), "metadata.name"),
    ("driver-upper", "1.35", lambda o: spec(o).update(driver="GPU.example"), "spec.driver"),
    ("driver-long", "1.35", lambda o: spec(o).update(driver="a" * 64), "spec.driver"),
    ("pool-name", "1.35", lambda o: spec(o)["pool"].update(name="a//b"), "spec.pool.name"),
    ("generation", "1.35", lambda o: spec(o)["pool"].update(generation=-1), "generation"),
    ("slice-count", "1.35", lambda o: spec(o)["pool"].update(resourceSliceCount=0), "Count"),
    ("no-node", "1.35", lambda o: spec(o).pop("nodeName"), "exactly one of nodeName"),
    ("two-nodes", "1.35", lambda o: spec(o).update(allNodes=True), "exactly one of nodeName"),
    ("all-false", "1.35", lambda o: spec(o).update(allNodes=False), "must be unset"),
    ("node-name", "1.35", lambda o: spec(o).update(nodeName="Node_A"), "spec.nodeName"),
    (
        "both-135",
        "1.35",
        lambda o: spec(o).update(sharedCounters=[counter_set()]),
        "devices or sharedCounters, not both",
    ),
    (
        "devices-128",
        "1.35",
        lambda o: spec(o).update(devices=[device(f"d{i}") for i in range(129)]),
        "129 devices exceed the limit of 128",
    ),
    (
        "devices-64-with-counters",
        "1.35",
        lambda o: spec(o).update(devices=[device(f"d{i}", "cs") for i in range(65)]),
        "65 devices exceed the limit of 64",
    ),
    (
        "devices-64-with-taints",
        "1.35",
        lambda o: spec(o).update(
            devices=[
                {**device(f"d{i}"), "taints": [{"key": "k", "effect": "NoSchedule"}]}
                for i in range(65)
            ]
        ),
        "65 devices exceed the limit of 64",
    ),
    (
        "devices-128-134",
        "1.34",
        lambda o: spec(o).update(devices=[device(f"d{i}") for i in range(129)]),
        "129 devices exceed the limit of 128",
    ),
    ("device-name", "1.35", lambda o: dev0(o).update(name="GPU_0"), "must be a DNS label"),
    ("device-name-long", "1.35", lambda o: dev0(o).update(name="a" * 64), "must be a DNS label"),
    (
        "device-dup",
        "1.35",
        lambda o: spec(o)["devices"].append(device()),
        "'gpu-0' is not unique",
    ),
    ("attrs-32", "1.35", many_attributes, "exceed the limit of 32"),
    (
        "attr-name-long",
        "1.35",
        lambda o: dev0(o)["attributes"].update({"a" * 33: {"int": 1}}),
        "longer than 32",
    ),
    (
        "attr-name-c-id",
        "1.35",
        lambda o: dev0(o)["attributes"].update({"pci-root": {"int": 1}}),
        "not a C identifier",
    ),
    (
        "attr-domain",
        "1.35",
        lambda o: dev0(o)["attributes"].update({"Example.com/x": {"int": 1}}),
        "domain 'Example.com'",
    ),
    (
        "attr-domain-long",
        "1.35",
        lambda o: dev0(o)["capacity"].update({"a" * 64 + "/x": {"value": "1"}}),
        "DNS subdomain of at most 63",
    ),
    (
        "attr-two-values",
        "1.35",
        lambda o: dev0(o)["attributes"].update(x={"int": 1, "string": "a"}),
        "exactly one of",
    ),
    (
        "attr-string-long",
        "1.35",
        lambda o: dev0(o)["attributes"].update(x={"string": "s" * 65}),
        "string longer than 64",
    ),
    (
        "attr-version",
        "1.35",
        lambda o: dev0(o)["attributes"].update(x={"version": "550.90.07"}),
        "not semver",
    ),
    (
        "attr-version-long",
        "1.35",
        lambda o: dev0(o)["attributes"].update(x={"version": "1.2.3-" + "a" * 60}),
        "version longer than 64",
    ),
    (
        "attr-int-type",
        "1.35",
        lambda o: dev0(o)["attributes"].update(x={"int": "1"}),
        "not an integer",
    ),
    (
        "capacity-quantity",
        "1.35",
        lambda o: dev0(o)["capacity"].update(memory={"value": "80 GB"}),
        "not a Quantity",
    ),
    (
        "taints-134",
        "1.34",
        lambda o: dev0(o).update(
            taints=[{"key": f"k{i}", "effect": "NoSchedule"} for i in range(5)]
        ),
        "5 taints exceed the limit of 4",
    ),
    (
        "taints-135",
        "1.35",
        lambda o: dev0(o).update(
            taints=[{"key": f"k{i}", "effect": "NoSchedule"} for i in range(17)]
        ),
        "17 taints exceed the limit of 16",
    ),
    (
        "consumes-3",
        "1.35",
        lambda o: dev0(o).update(
            consumesCounters=[
                {"counterSet": f"s{i}", "counters": {"c": {"value": "1"}}} for i in range(3)
            ]
        ),
        "3 consumesCounters entries exceed the limit of 2",
    ),
    (
        "consumes-33",
        "1.35",
        lambda o: dev0(o).update(
            consumesCounters=[
                {"counterSet": "s", "counters": {f"c{i}": {"value": "1"} for i in range(33)}}
            ]
        ),
        "consumes 33 counters of 's'",
    ),
    (
        "consumes-set-name",
        "1.35",
        lambda o: dev0(o).update(
            consumesCounters=[{"counterSet": "S_1", "counters": {"c": {"value": "1"}}}]
        ),
        "consumed counterSet 'S_1' is not a DNS label",
    ),
    (
        "consumes-dup",
        "1.35",
        lambda o: dev0(o).update(
            consumesCounters=[{"counterSet": "s", "counters": {"c": {"value": "1"}}}] * 2
        ),
        "consumed more than once",
    ),
    (
        "consumes-empty",
        "1.35",
        lambda o: dev0(o).update(consumesCounters=[{"counterSet": "s", "counters": {}}]),
        "counters must be a non-empty map",
    ),
    (
        "counter-name",
        "1.35",
        lambda o: dev0(o).update(
            consumesCounters=[{"counterSet": "s", "counters": {"memorySlice": {"value": "1"}}}]
        ),
        "counter name 'memorySlice' is not a DNS label",
    ),
    (
        "sets-8",
        "1.35",
        lambda o: (
            spec(o).pop("devices"),
            spec(o).update(sharedCounters=[counter_set(f"s{i}") for i in range(9)]),
        ),
        "9 counter sets exceed the limit of 8",
    ),
    (
        "set-counters-32",
        "1.35",
        lambda o: (spec(o).pop("devices"), spec(o).update(sharedCounters=[counter_set(n=33)])),
        "33 counters exceed the limit of 32 per set",
    ),
    (
        "set-name",
        "1.35",
        lambda o: (spec(o).pop("devices"), spec(o).update(sharedCounters=[counter_set("Set.1")])),
        "counter set name 'Set.1' is not a DNS label",
    ),
    (
        "set-dup",
        "1.35",
        lambda o: (
            spec(o).pop("devices"),
            spec(o).update(sharedCounters=[counter_set(), counter_set()]),
        ),
        "is not unique in the slice",
    ),
    (
        "set-quantity",
        "1.35",
        lambda o: (
            spec(o).pop("devices"),
            spec(o).update(sharedCounters=[{"name": "s", "counters": {"c": {"value": "x"}}}]),
        ),
        "value 'x' is not a Quantity",
    ),
    (
        "shared-32-134",
        "1.34",
        lambda o: spec(o)["sharedCounters"].append(counter_set("other", n=31)),
        "33 counters in all counter sets exceed the 1.34 limit of 32",
    ),
    (
        "set-missing-134",
        "1.34",
        lambda o: dev0(o)["consumesCounters"][0].update(counterSet="elsewhere"),
        "consumed counterSet 'elsewhere' is not in this slice",
    ),
    (
        "counter-missing-134",
        "1.34",
        lambda o: dev0(o)["consumesCounters"][0]["counters"].update(
            {"memory-slice-5": {"value": "1"}}
        ),
        "counter 'memory-slice-5' is not in counterSet",
    ),
    (
        "device-counters-32-134",
        "1.34",
        lambda o: dev0(o).update(
            consumesCounters=[
                {"counterSet": f"s{j}", "counters": {f"c{i}": {"value": "1"} for i in range(17)}}
                for j in range(2)
            ]
        ),
        "consumes 34 counters in all, more than 32",
    ),
    (
        "slice-counters-1024-134",
        "1.34",
        lambda o: spec(o).update(
            devices=[
                {
                    **device(f"d{j}"),
                    "consumesCounters": [
                        {
                            "counterSet": "gpu-0-counter-set",
                            "counters": {
                                f"memory-slice-{i % 2}x{i}": {"value": "1"} for i in range(17)
                            },
                        }
                    ],
                }
                for j in range(61)
            ]
        ),
        "devices consume 1037 counters in all, more than the 1.34 limit of 1024",
    ),
    (
        "per-device-node",
        "1.35",
        lambda o: dev0(o).update(nodeName="node-a"),
        "set without spec.perDeviceNodeSelection",
    ),
]


@pytest.mark.parametrize(
    ("layout", "mutate", "fragment"),
    [v[1:] for v in VIOLATIONS],
    ids=[v[0] for v in VIOLATIONS],
)
def test_each_violation_is_reported(layout: str, mutate: Mutation, fragment: str) -> None:
    obj = copy.deepcopy(good(layout))
    mutate(obj)
    problems = check_slice(obj, layout)
    assert any(fragment in p for p in problems), problems


def test_messages_name_the_device() -> None:
    obj = good("1.35")
    dev0(obj)["attributes"]["x"] = {"string": "s" * 65}
    (problem,) = check_slice(obj, "1.35")
    assert "'gpu-0'" in problem and "64" in problem


def test_missing_spec() -> None:
    assert "spec is required" in check_slice({"apiVersion": "resource.k8s.io/v1"}, "1.35")


def test_134_allows_what_135_forbids() -> None:
    """Counters and devices together; 64..128 devices that consume counters."""
    obj = base(
        "1.34",
        devices=[device(f"d{i}", "gpu-0-counter-set") for i in range(100)],
        sets=[counter_set()],
    )
    assert check_slice(obj, "1.34") == []
    problems = check_slice(obj, "1.35")
    assert any("not both" in p for p in problems)
    assert any("100 devices exceed the limit of 64" in p for p in problems)


# --- pool-wide checks ------------------------------------------------------------------------


def pool(count: int, *slices: Obj) -> list[Obj]:
    out = []
    for i, s in enumerate(slices):
        s = copy.deepcopy(s)
        s["metadata"]["name"] = f"node-a-gpu-tessera-dev-{i}"
        s["spec"]["pool"]["resourceSliceCount"] = count
        out.append(s)
    return out


def test_pool_good() -> None:
    slices = pool(
        2,
        base("1.35", sets=[counter_set()]),
        base("1.35", devices=[device(counter_set="gpu-0-counter-set")]),
    )
    assert check_pool(slices, "1.35") == []


@pytest.mark.parametrize(
    ("slices", "fragment"),
    [
        (pool(3, good("1.35"), base("1.35", devices=[device("gpu-1")])), "but 2 slices"),
        (pool(2, good("1.35"), good("1.35")), "'gpu-0' appears 2 times in the pool"),
        (
            pool(2, base("1.35", sets=[counter_set()]), base("1.35", sets=[counter_set()])),
            "not unique in the pool",
        ),
        (pool(1, base("1.35", devices=[device(counter_set="nowhere")])), "'nowhere' not in pool"),
        (
            pool(
                2,
                base("1.35", sets=[counter_set(n=1)]),
                base(
                    "1.35",
                    devices=[
                        {
                            **device(),
                            "consumesCounters": [
                                {
                                    "counterSet": "gpu-0-counter-set",
                                    "counters": {"memory-slice-3": {"value": "1"}},
                                }
                            ],
                        }
                    ],
                ),
            ),
            "counter 'memory-slice-3' not in",
        ),
    ],
    ids=["slice-count", "device-dup", "set-dup", "set-missing", "counter-missing"],
)
def test_pool_violations(slices: list[Obj], fragment: str) -> None:
    problems = check_pool(slices, "1.35")
    assert any(fragment in p for p in problems), problems


def test_pool_generation_mismatch() -> None:
    a, b = pool(2, good("1.35"), base("1.35", devices=[device("gpu-1")]))
    b["spec"]["pool"]["generation"] = 2
    assert any("generation" in p for p in check_pool([a, b], "1.35"))


# --- value helpers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1", Decimal(1)),
        ("1000", Decimal(1000)),
        ("1k", Decimal(1000)),
        ("40Gi", Decimal(40 * 2**30)),
        ("100m", Decimal("0.1")),
        ("1.5", Decimal("1.5")),
        ("12e3", Decimal(12000)),
        ("80 GB", None),
        ("", None),
        ("Gi", None),
    ],
    ids=str,
)
def test_parse_quantity(text: str, value: Decimal | None) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("9.0.0", True),
        ("550.90.7", True),
        ("1.2.3-rc.1+b5", True),
        ("550.90.07", False),
        ("12.4", False),
    ],
    ids=str,
)
def test_is_semver(text: str, ok: bool) -> None:
    assert is_semver(text) == ok
