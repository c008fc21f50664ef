"""`tessera explain` over many nodes evaluates one node per group of look-alikes and renames the
answer for the others: every node's answer (fits, reason, allocation, the explanation's text and
JSON) must be exactly the one it gets when evaluated alone on its own slices, whatever the claim
reads (identity attributes in selectors and constraints, shared counters, shared devices) and
however the nodes differ."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from agent.cli.explain_answer import Inputs, NodeAnswer, answer
from dra_driver.scheduler import node_reach
from dra_driver.scheduler.celenv import CelEnvironment
from dra_driver.scheduler.inputs import Subject
from dra_driver.scheduler.lookalike import SliceIndex, plan, reads_of
from tests.dra_driver.allocator_helpers import DRIVER, allocated, claim, dev, exact, klass, rslice

A = f'device.attributes["{DRIVER}"]'
CLASSES = [klass("gpu", f'device.driver == "{DRIVER}"'), klass("everything", "true")]
SELECTORS = [
    "true",
    f'{A}.model == "a100"',
    f'{A}.uuid == "GPU-n1-0"',
    f'{A}.pciBusID.startsWith("0000:0")',
    f"{A}.memory >= 40",
    # reads the device as a whole: nothing may be set aside
    f'{A}.exists(k, k == "spare")',
]
CONSTRAINTS = [
    None,
    ("matchAttribute", f"{DRIVER}/uuid"),
    ("matchAttribute", f"{DRIVER}/model"),
    ("distinctAttribute", f"{DRIVER}/pciBusID"),
    ("matchAttribute", f"{DRIVER}/parent"),
]

# drawn with these weights: claims that read nothing of a node's identity (most), and some
# that read it, so that both grouping and standing alone are exercised
SELECTORS_DRAWN = [*SELECTORS[:2] * 3, SELECTORS[4], *SELECTORS]
CONSTRAINTS_DRAWN = [None, None, CONSTRAINTS[2], *CONSTRAINTS]


def alone(data: Inputs, name: str | None) -> NodeAnswer:
    """What explain answers without grouping: the node's own slices, each pod's claims
    allocated together (``_evaluate``)."""
    from agent.cli.explain_answer import _evaluate

    node = data.nodes.get(name or "", {"metadata": {"name": name}})
    slices = data.slices if name is None else node_reach.node_slices(data.slices, node)
    return _evaluate(name, slices, data, CelEnvironment(), 10.0)


def same(a: NodeAnswer, b: NodeAnswer) -> None:
    assert (a.node, a.fits, a.reason) == (b.node, b.fits, b.reason)
    assert len(a.claims) == len(b.claims)
    for x, y in zip(a.claims, b.claims, strict=True):
        assert x.allocation == y.allocation
        assert x.explanation.text() == y.explanation.text()
        assert (x.text(), x.status) == (y.text(), y.status)
        assert x.explanation.to_json() == y.explanation.to_json()


def gpus(node: str, layout: str, bus: int) -> list[dict[str, Any]]:
    """A node's devices: two whole GPUs, or one GPU split in two MIG-like shares of its
    counters; each with its own uuid and PCI bus ID (identity), and a model and memory."""
    if layout == "whole":
        return [
            dev(
                f"gpu-{i}",
                attrs={
                    "uuid": f"GPU-{node}-{i}",
                    "pciBusID": f"0000:{bus + i:02x}:00.0",
                    "model": "a100",
                    "memory": 40 * (i + 1),
                    "parent": f"GPU-{node}-{i}",
                },
            )
            for i in range(2)
        ]
    return [
        dev(
            f"gpu-0-mig-{i}",
            attrs={
                "uuid": f"MIG-{node}-{i}",
                "pciBusID": f"0000:{bus:02x}:00.0",
                "model": "a100" if layout == "mig" else "h100",
                "memory": 20,
                "parent": f"GPU-{node}-0",
            },
            consumes={"gpu-0": {"memory": 20}},
            multi=i == 1,
            capacity={"memory": "20"} if i == 1 else None,
        )
        for i in range(2)
    ]


@st.composite
def clusters(draw: st.DrawFn) -> Inputs:
    n = draw(st.integers(1, 6))
    slices: list[dict[str, Any]] = []
    nodes: dict[str, dict[str, Any]] = {}
    held: list[dict[str, Any]] = []
    layouts = st.sampled_from(["whole", "mig", "other"])
    buses = st.sampled_from([0, 16])
    usual = (draw(layouts), draw(st.booleans()), draw(buses))  # most nodes look like this
    for i in range(n):
        name = f"n{i}"
        nodes[name] = {"metadata": {"name": name, "labels": {"zone": f"z{i % 2}"}}}
        odd = draw(st.integers(0, 3)) == 0
        layout, whole_slice, bus = (
            (draw(layouts), draw(st.booleans()), draw(buses)) if odd else usual
        )
        devices = gpus(name, layout, bus)
        pool = draw(st.sampled_from([name, f"{name}-gpus"]))
        generation = draw(st.integers(1, 3))
        counters = {"gpu-0": {"memory": 40}} if layout != "whole" else None
        if whole_slice:  # one slice, or the devices split over two
            slices.append(
                rslice(devices, pool=pool, node=name, generation=generation, counters=counters)
            )
        else:
            incomplete = draw(st.integers(0, 5)) == 0
            for j, part in enumerate((devices[:1], devices[1:])):
                if incomplete and j == 1:
                    continue
                s = rslice(
                    part,
                    pool=pool,
                    node=name,
                    name=f"{pool}-s{j}",
                    generation=generation,
                    count=2,
                    counters=counters if j == 0 else None,
                )
                slices.append(s)
        if draw(st.integers(0, 5)) == 0:
            held.append(allocated(f"held-{i}", {"device": devices[0]["name"], "pool": pool}))
    if draw(st.integers(0, 5)) == 0:  # a network-attached device every node in zone z0 sees
        shared = rslice([dev("fabric", attrs={"model": "a100"})], pool="fabric", name="fabric")
        del shared["spec"]["nodeName"]
        shared["spec"]["nodeSelector"] = {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z0"]}]}
            ]
        }
        slices.append(shared)
    subjects = []
    for k in range(draw(st.integers(1, 2))):
        requests = [
            exact(
                f"r{j}",
                draw(st.sampled_from(["gpu", "everything"])),
                count=draw(st.integers(1, 2)),
                selectors=(draw(st.sampled_from(SELECTORS_DRAWN)),),
            )
            for j in range(draw(st.integers(1, 2)))
        ]
        constraint = draw(st.sampled_from(CONSTRAINTS_DRAWN))
        constraints = (
            [{constraint[0]: constraint[1], "requests": [r["name"] for r in requests]}]
            if constraint
            else None
        )
        c = claim(*requests, constraints=constraints, name=f"c{k}")
        subjects.append(Subject(f"default/c{k}", c))
    order = draw(st.permutations(list(range(len(slices)))))
    return Inputs(
        subjects,
        [],
        {str(c["metadata"]["name"]): c for c in CLASSES},
        [slices[i] for i in order],
        nodes,
        held,
    )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters())
def test_every_node_gets_the_answer_it_gets_alone(data: Inputs) -> None:
    event(f"nodes answered by renaming: {sum(len(g) - 1 for g in groups_of(data))}")
    grouped = answer(copy.deepcopy(data), 10.0, CelEnvironment())
    names = sorted(set(data.nodes) | set(node_reach.slice_nodes(data.slices)))
    assert [a.node for a in grouped] == names
    for got, name in zip(grouped, names, strict=True):
        same(got, alone(data, name))


def look_alike_cluster(nodes: int) -> Inputs:
    slices = [rslice(gpus(f"n{i}", "whole", 0), pool=f"n{i}", node=f"n{i}") for i in range(nodes)]
    one = claim(exact("r0", "gpu", count=1, selectors=(f'{A}.model == "a100"',)))
    return Inputs(
        [Subject("default/c", one)],
        [],
        {"gpu": CLASSES[0]},
        slices,
        {f"n{i}": {"metadata": {"name": f"n{i}"}} for i in range(nodes)},
    )


def groups_of(data: Inputs) -> list[list[str]]:
    cel = CelEnvironment()
    index = SliceIndex(reads_of([s.claim for s in data.subjects], list(data.classes.values()), cel))
    for s in data.slices:
        index.add(s)
    return [g.members for g in plan(index, sorted(data.nodes), data.nodes, data.allocated)]


def test_nodes_that_differ_only_in_identity_form_one_group_and_name_their_own_devices() -> None:
    data = look_alike_cluster(4)
    assert groups_of(data) == [["n0", "n1", "n2", "n3"]]
    got = answer(data, 10.0, CelEnvironment())
    allocations = [a.claims[0].allocation or {} for a in got]
    assert [a["devices"]["results"][0]["pool"] for a in allocations] == ["n0", "n1", "n2", "n3"]
    where = allocations[2]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]
    assert where["values"] == ["n2"]
    assert "pool n2" in got[2].claims[0].explanation.text()


def test_a_claim_that_reads_the_uuid_is_not_grouped_on_it() -> None:
    data = look_alike_cluster(3)
    data.subjects = [
        Subject("default/c", claim(exact("r0", "gpu", selectors=(f'{A}.uuid == "GPU-n1-0"',))))
    ]
    assert groups_of(data) == [["n0"], ["n1"], ["n2"]]
    assert [a.fits for a in answer(data, 10.0, CelEnvironment())] == [False, True, False]


def test_a_constraint_on_the_pci_bus_id_is_not_grouped_on_it() -> None:
    data = look_alike_cluster(2)
    data.slices[1]["spec"]["devices"][1]["attributes"]["pciBusID"]["string"] = "0000:00:00.0"
    both = exact("r0", "gpu", count=2)
    distinct = [{"distinctAttribute": f"{DRIVER}/pciBusID", "requests": ["r0"]}]
    data.subjects = [Subject("default/c", claim(both, constraints=distinct))]
    assert groups_of(data) == [["n0"], ["n1"]]
    assert [a.fits for a in answer(data, 10.0, CelEnvironment())] == [True, False]


def test_a_node_with_another_layout_is_its_own_group() -> None:
    data = look_alike_cluster(3)
    data.slices[1] = rslice(
        gpus("n1", "mig", 0), pool="n1", node="n1", counters={"gpu-0": {"memory": 40}}
    )
    assert groups_of(data) == [["n0", "n2"], ["n1"]]
