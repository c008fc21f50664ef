"""`tessera doctor` and `tessera explain` on simulated VM hosts (issue 24): doctor's VM checks pass
on a passthrough and a vGPU host and each simulator fault fails the matching check with its fix;
explain answers the VM DeviceClasses and the KubeVirt examples' claim templates on models with and
without vGPU, and on a node without --virtualization says why they do not fit."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.cli import main
from tests.k8sschema import VERSIONS, validate

ROOT = Path(__file__).resolve().parents[2]
CLASSES = ROOT / "deploy" / "daemonset" / "deviceclasses.yaml"
KUBEVIRT = ROOT / "deploy" / "daemonset" / "examples" / "kubevirt"
VM_CHECKS = ("iommu", "vfio-pci", "iommu-group", "sriov", "vgpu-types")
PASSTHROUGH = ("dgx-h100", "--virtualization", "passthrough")
VGPU_H200 = ("vgpu-h200", "--virtualization", "vgpu")
VGPU_T4 = ("vgpu-t4", "--virtualization", "vgpu")


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), {}, out, err)
    return code, out.getvalue(), err.getvalue()


def doctor(state: Path, node: tuple[str, ...]) -> list[dict[str, Any]]:
    """Doctor's VM checks on the simulated node ``node`` kept in ``state``."""
    model, *flags = node
    code, out, err = run(
        "doctor", "--simulate", model, *flags, "--state-dir", str(state), "--no-kube", "-o", "json"
    )
    assert code in (0, 1), err
    return [c for c in json.loads(out)["checks"] if c["check"] in VM_CHECKS]


def fault(state: Path, *args: str) -> None:
    code, _, err = run("sim", "fault", "--state-dir", str(state), *args)
    assert code == 0, err


@pytest.mark.parametrize(
    ("node", "checks"),
    [
        (PASSTHROUGH, {"iommu", "vfio-pci", "iommu-group"}),
        (VGPU_H200, {"iommu", "sriov", "vgpu-types"}),
        (VGPU_T4, {"iommu", "vgpu-types"}),
    ],
)
def test_doctor_passes_the_vm_checks_of_a_vm_host(tmp_path, node, checks):
    found = doctor(tmp_path, node)
    assert {c["check"] for c in found if c["status"] == "ok"} >= checks, found
    # a vGPU host binds nothing to vfio-pci: that check is skipped there, saying why
    skipped = [c["check"] for c in found if c["status"] == "skip"]
    assert skipped == ([] if node == PASSTHROUGH else ["vfio-pci"]), found
    assert [c for c in found if c["status"] not in ("ok", "skip")] == []


def test_doctor_runs_no_vm_check_without_virtualization(tmp_path):
    assert doctor(tmp_path, ("dgx-h100",)) == []


@pytest.mark.parametrize(
    ("faults", "check", "detail", "fix"),
    [
        (["iommu-off"], "iommu", "the IOMMU is off or absent", "intel_iommu=on"),
        (["vfio-unloaded"], "vfio-pci", "vfio-pci", "modprobe vfio-pci"),
        (["foreign-in-group", "--gpu", "2"], "iommu-group", "0000:52:1f.0", "ACS"),
    ],
)
def test_each_fault_fails_its_doctor_check_with_a_fix(tmp_path, faults, check, detail, fix):
    assert [c for c in doctor(tmp_path, PASSTHROUGH) if c["status"] != "ok"] == []
    fault(tmp_path, *faults)
    failed = [c for c in doctor(tmp_path, PASSTHROUGH) if c["status"] == "fail"]
    assert failed and {c["check"] for c in failed} <= {check, "iommu-group"}, failed
    (first,) = [c for c in failed if c["check"] == check][:1]
    assert detail in first["detail"] and fix in first["fix"], first


def explain(state: Path, claim: Path, node: tuple[str, ...]) -> tuple[int, dict[str, Any]]:
    model, *flags = node
    code, out, err = run(
        "explain", str(claim), "--class", str(CLASSES), "--simulate", model, *flags,
        "--state-dir", str(state), "-o", "json",
    )  # fmt: skip
    assert code in (0, 1), err
    answer: dict[str, Any] = json.loads(out)
    assert answer["fits"] == (code == 0)
    return code, answer


def claim_file(path: Path, cls: str) -> Path:
    obj = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "vm-gpu", "namespace": "vms"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": cls}}]}},
    }
    for version in VERSIONS:
        validate(obj, version)
    path.write_text(yaml.safe_dump(obj))
    return path


def example(name: str) -> Path:
    """A KubeVirt example; its ResourceClaimTemplate checked against the schemas (the
    VirtualMachine is KubeVirt's: tests/deploy/test_kubevirt_examples.py checks it)."""
    path = KUBEVIRT / f"{name}.yaml"
    (template,) = [d for d in yaml.safe_load_all(path.read_text()) if d["kind"] != "VirtualMachine"]
    for version in VERSIONS:
        validate(template, version)
    return path


def chosen(answer: dict[str, Any]) -> list[str]:
    ((node,),) = [answer["nodes"]]
    ((c,),) = [node["claims"]]
    return [r["device"] for r in c["allocation"]["devices"]["results"]]


def reason(answer: dict[str, Any]) -> str:
    ((node,),) = [answer["nodes"]]
    text: str = node["reason"]
    return text


FITS = [
    ("vfio.gpu.tessera.dev", PASSTHROUGH, "gpu-0-vfio"),
    ("vgpu.gpu.tessera.dev", VGPU_H200, "gpu-0-vgpu-"),
    ("vgpu.gpu.tessera.dev", VGPU_T4, "gpu-0-vgpu-"),
    ("vm-passthrough-gpu", PASSTHROUGH, "gpu-0-vfio"),
    ("vm-vgpu", VGPU_H200, "gpu-0-vgpu-"),
]
MISFITS = [
    ("vfio.gpu.tessera.dev", ("dgx-h100",), "class selector false"),
    ("vgpu.gpu.tessera.dev", ("dgx-h100",), "class selector false"),
    ("vfio.gpu.tessera.dev", VGPU_H200, "class selector false"),
    ("vgpu.gpu.tessera.dev", PASSTHROUGH, "class selector false"),
    ("vm-passthrough-gpu", ("dgx-h100",), "class selector false"),
    ("vm-vgpu", ("dgx-h100",), "class selector false"),
    ("vm-vgpu", VGPU_T4, "request selector false"),  # T4 offers no H200X-35C
    ("vm-passthrough-gpu", VGPU_T4, "class selector false"),
]


def claim_of(tmp_path: Path, what: str) -> Path:
    return claim_file(tmp_path / "c.yaml", what) if what.endswith(".dev") else example(what)


@pytest.mark.parametrize(("what", "node", "device"), FITS)
def test_explain_fits_vm_claims_where_the_node_offers_them(tmp_path, what, node, device):
    code, answer = explain(tmp_path, claim_of(tmp_path, what), node)
    assert code == 0 and answer["fittingNodes"] == [node[0]], answer
    (got,) = chosen(answer)
    assert got.startswith(device)


@pytest.mark.parametrize(("what", "node", "why"), MISFITS)
def test_explain_says_why_vm_claims_do_not_fit_elsewhere(tmp_path, what, node, why):
    code, answer = explain(tmp_path, claim_of(tmp_path, what), node)
    assert code == 1 and answer["fittingNodes"] == []
    assert "0 candidates" in reason(answer) and why in reason(answer), reason(answer)
