"""The GpuUsageReport CRD (deploy/daemonset/budgets/gpuusagereport-crd.yaml): valid for the API
servers Tessera supports, the contract's example report accepted, broken reports refused."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.sim.apiserver_crd import violations
from tests.k8sschema import VERSIONS
from tests.k8sschema import validate as validate_k8s

ROOT = Path(__file__).resolve().parents[2]
CRD: dict[str, Any] = yaml.safe_load(
    (ROOT / "deploy" / "daemonset" / "budgets" / "gpuusagereport-crd.yaml").read_text()
)

EXAMPLE: dict[str, Any] = yaml.safe_load(
    """
apiVersion: tessera.dev/v1alpha1
kind: GpuUsageReport
metadata:
  name: gpu-node-1
  labels: {tessera.dev/node: gpu-node-1}
spec:
  nodeName: gpu-node-1
  nodeLabels: {tessera.dev/pool: reserved}
  through: "2026-12-04T12:07:31.250000Z"
  buckets:
    - start: "2026-12-04T12:00:00Z"
      closed: false
      usage:
        - namespace: team-a
          claim: train-1
          claimUID: 7d0c0d9a-6b5e-4c2f-8e1d-9a8b7c6d5e4f
          deviceClass: gpu.tessera.dev
          product: NVIDIA H100 80GB HBM3
          migProfile: 3g.40gb
          allocatedGpuSeconds: 412.5
          busyGpuSeconds: 201.0
          energyJoules: 90210.0
          unobservedSeconds: 0.0
status:
  acknowledgedThrough: "2026-12-04T12:00:00Z"
"""
)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_crd_is_a_valid_customresourcedefinition(version):
    validate_k8s(CRD, version)


def test_the_contracts_example_is_accepted():
    assert violations(CRD, EXAMPLE) == []
    whole = copy.deepcopy(EXAMPLE)
    del whole["spec"]["buckets"][0]["usage"][0]["migProfile"]  # a whole GPU
    whole["spec"]["nodeLabels"] = {}
    assert violations(CRD, whole) == []


def edited(path: str, value: Any) -> dict[str, Any]:
    obj = copy.deepcopy(EXAMPLE)
    *parents, last = path.split(".")
    node: Any = obj
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return obj


@pytest.mark.parametrize(
    ("obj", "words"),
    [
        (edited("spec.nodeName", "gpu-node-2"), "a GpuUsageReport is named after its node"),
        (
            edited("spec.buckets.0.start", "2026-12-04T12:07:00Z"),
            "spec.buckets[0].start in body should match",
        ),
        (
            edited("spec.buckets.0.usage.0.energyJoules", -1.0),
            "energyJoules in body should be greater than or equal to 0",
        ),
        (edited("spec.buckets.0.closed", None), "spec.buckets[0].closed: Required value"),
        (edited("spec.buckets.0.usage.0.cost", 3), 'unknown field "spec.buckets[0].usage[0].cost"'),
        (edited("spec.through", None), "spec.through: Required value"),
    ],
)
def test_a_broken_report_is_refused_with_the_reason(obj, words):
    found = violations(CRD, obj)
    assert any(words in v for v in found), found


def test_the_printer_columns_name_node_through_buckets_and_age():
    (version,) = CRD["spec"]["versions"]
    names = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert names == ["Node", "Through", "Buckets", "Age"]
    assert version["subresources"] == {"status": {}} and CRD["spec"]["scope"] == "Cluster"
