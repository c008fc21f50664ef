"""The KubeVirt examples (deploy/daemonset/examples/kubevirt/): each VirtualMachine is accepted by
KubeVirt v1.9.0's own CRD schema as the API server applies it (strict field validation, as
``kubectl apply`` asks, then the structural schema and its CEL rules: the API-server emulator's
CRD checks), and each ResourceClaimTemplate by the upstream Kubernetes schemas (1.34, 1.35).
The VM's GPU names a claim and request that exist, of the DeviceClass the example is for.

The CRD: tests/deploy/schemas/kubevirt.io-v1.9.0-virtualmachines-crd.json (its README says
where it comes from)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.sim.apiserver_crd import violations
from tests.k8sschema import VERSIONS
from tests.k8sschema import validate as validate_k8s

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "daemonset" / "examples" / "kubevirt"
CRD: dict[str, Any] = json.loads(
    (
        Path(__file__).with_name("schemas") / "kubevirt.io-v1.9.0-virtualmachines-crd.json"
    ).read_text()
)
CLASS_OF = {
    "vm-passthrough-gpu.yaml": "vfio.gpu.tessera.dev",
    "vm-vgpu.yaml": "vgpu.gpu.tessera.dev",
}


def objects(name: str) -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs) == 2, name
    return by_kind


def test_every_example_is_here():
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(CLASS_OF)


@pytest.mark.parametrize("name", sorted(CLASS_OF))
def test_the_virtual_machine_is_accepted_by_kubevirts_crd(name):
    assert violations(CRD, objects(name)["VirtualMachine"]) == []


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", sorted(CLASS_OF))
def test_the_claim_template_validates_against_kubernetes(name, version):
    validate_k8s(objects(name)["ResourceClaimTemplate"], version)


@pytest.mark.parametrize("name", sorted(CLASS_OF))
def test_the_vms_gpu_names_its_claims_request_of_the_class(name):
    objs = objects(name)
    template = objs["ResourceClaimTemplate"]
    vm = objs["VirtualMachine"]["spec"]["template"]["spec"]
    (gpu,) = vm["domain"]["devices"]["gpus"]
    (claim,) = [c for c in vm["resourceClaims"] if c["name"] == gpu["claimName"]]
    assert claim["resourceClaimTemplateName"] == template["metadata"]["name"]
    assert objs["VirtualMachine"]["metadata"]["namespace"] == template["metadata"]["namespace"]
    (request,) = [
        r
        for r in template["spec"]["spec"]["devices"]["requests"]
        if r["name"] == gpu["requestName"]
    ]
    assert request["exactly"]["deviceClassName"] == CLASS_OF[name]


def wrong(vm: dict[str, Any], field: str) -> dict[str, Any]:
    """The VM with one mistake: ``field`` says which."""
    bad = copy.deepcopy(vm)
    spec = bad["spec"]["template"]["spec"]
    (gpu,) = spec["domain"]["devices"]["gpus"]
    if field == "claimRequest":  # the Go struct's name, not its JSON: ClaimRequest is inline
        gpu["claimRequest"] = {
            "claimName": gpu.pop("claimName"),
            "requestName": gpu.pop("requestName"),
        }
    elif field == "deviceClassName":  # a claim's field on the VM's claim reference
        spec["resourceClaims"][0]["deviceClassName"] = "vfio.gpu.tessera.dev"
    elif field == "gpus.name":  # required
        del gpu["name"]
    elif field == "resourceClaims.name":  # the list's map key
        del spec["resourceClaims"][0]["name"]
    return bad


@pytest.mark.parametrize(
    "field, said",
    [
        ("claimRequest", 'unknown field "spec.template.spec.domain.devices.gpus[0].claimRequest"'),
        ("deviceClassName", 'unknown field "spec.template.spec.resourceClaims[0].deviceClassName"'),
        ("gpus.name", "spec.template.spec.domain.devices.gpus[0].name: Required value"),
        ("resourceClaims.name", "spec.template.spec.resourceClaims[0].name: Required value"),
    ],
)
def test_a_wrong_field_is_refused(field, said):
    vm = objects("vm-passthrough-gpu.yaml")["VirtualMachine"]
    found = violations(CRD, wrong(vm, field))
    assert said in found, found
