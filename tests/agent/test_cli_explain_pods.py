"""`tessera explain` of a pod with several claims: allocated together, as the scheduler's
DynamicResources plugin hands them to ``Allocate`` (kubernetes
``pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go``), and a pod's claim that
is allocated already held, not allocated again (docs/explain.md, "Pods with several claims")."""

import itertools

from tests.agent.test_cli_explain import (
    CLASSES,
    as_json,
    claim,
    explain,
    gpus,
    pod,
    results,
    template,
    write,
)
from tests.integration.daemon import DRIVER
from tests.k8sschema import VERSIONS
from tests.k8sschema import validate as validate_k8s

NUMA0 = 'device.attributes["resource.kubernetes.io"].numaNode == 0'


def test_a_pods_two_claims_are_allocated_together_not_one_after_another(tmp_path):
    # dynamicresources.go Filter hands Allocate the pod's claims together, and its search
    # backtracks into the first claim when the second cannot be placed: "one" alone would take
    # gpu-0 first and starve "pair", which needs both GPUs of NUMA node 0
    pair = gpus("gpus", 2) | {}
    pair["exactly"] = pair["exactly"] | {"selectors": [{"cel": {"expression": NUMA0}}]}
    docs = [
        template("one", gpus("gpu")),
        template("pair", pair),
        pod("trainer", one=("one", True), pair=("pair", True)),
    ]
    for obj, version in itertools.product(docs, VERSIONS):
        validate_k8s(obj, version)
    f = write(tmp_path / "pod.yaml", *docs)
    code, answer = as_json(f, "--class", CLASSES, "--simulate", "l40s-pcie")
    assert code == 0, answer["nodes"][0]["reason"]
    for c, version in itertools.product(answer["nodes"][0]["claims"], VERSIONS):
        name = c["claim"].split("/")[1]
        claim_obj = claim(name, gpus("gpu")) | {"status": {"allocation": c["allocation"]}}
        validate_k8s(claim_obj, version)  # an AllocationResult the API server takes
    got = {c["claim"]: results(c["allocation"]) for c in answer["nodes"][0]["claims"]}
    assert got == {
        "default/trainer-one": [("gpu", "l40s-pcie", "gpu-2")],
        "default/trainer-pair": [("gpus", "l40s-pcie", "gpu-0"), ("gpus", "l40s-pcie", "gpu-1")],
    }
    code, out, _ = explain(f, "--class", CLASSES, "--simulate", "l40s-pcie")
    assert code == 0 and "trainer-one" in out and "gpu -> gpu-2" in out
    # three GPUs of NUMA node 0 fit in no allocation: the text names the claim and says the
    # claims were allocated together
    pair["exactly"]["count"] = 3
    docs[1] = template("pair", pair)
    for version in VERSIONS:
        validate_k8s(docs[1], version)
    f = write(tmp_path / "pod3.yaml", *docs)
    code, out, _ = explain(f, "--class", CLASSES, "--simulate", "l40s-pcie")
    assert code == 1
    assert "claims default/trainer-one, default/trainer-pair on node l40s-pcie: does not fit" in out
    assert "default/trainer-one (pod default/trainer, claim one from template one):\n" in out
    assert "  not allocated: default/trainer-pair does not fit on this node, with or" in out
    assert "  does not fit: request gpus needs 3, 2 candidates" in out
    code, answer = as_json(f, "--class", CLASSES, "--simulate", "l40s-pcie")
    node = answer["nodes"][0]
    assert node["blockedClaim"] == "default/trainer-pair"
    assert [c["status"] for c in node["claims"]] == ["placed", "blocked"]


def held_claim(name, device, node):
    """A claim allocated already (gpu ``device`` of the simulated node ``node``'s pool)."""
    allocation = {
        "devices": {
            "results": [{"request": "gpu", "driver": DRIVER, "pool": "l40s-pcie", "device": device}]
        },
        "nodeSelector": {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
            ]
        },
    }
    return claim(name, gpus("gpu")) | {"status": {"allocation": allocation}}


def test_a_pods_allocated_claim_is_held_not_allocated_again(tmp_path):
    # dynamicresources.go PreFilter: only claims without an allocation go to Allocate; an
    # allocated claim's devices are taken, and its nodeSelector must match the node (Filter)
    docs = [
        held_claim("held", "gpu-0", "l40s-pcie"),
        template("one", gpus("gpu")),
        pod("trainer", held=("held", False), one=("one", True)),
    ]
    for obj, version in itertools.product(docs, VERSIONS):
        validate_k8s(obj, version)
    f = write(tmp_path / "pod.yaml", *docs)
    code, answer = as_json(f, "--class", CLASSES, "--simulate", "l40s-pcie")
    assert code == 0
    node = answer["nodes"][0]
    assert [c["claim"] for c in node["claims"]] == ["default/trainer-one"]
    assert results(node["claims"][0]["allocation"]) == [("gpu", "l40s-pcie", "gpu-1")]
    assert any(
        n.startswith("default/held (pod default/trainer, claim held) is allocated")
        for n in answer["notes"]
    )
    docs[0] = held_claim("held", "gpu-0", "another-node")
    f = write(tmp_path / "pod.yaml", *docs)
    code, out, _ = explain(f, "--class", CLASSES, "--simulate", "l40s-pcie")
    assert code == 1
    assert "default/held is allocated already, for other nodes: its nodeSelector" in out
