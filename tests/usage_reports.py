"""The API-server emulator serving ``GpuUsageReport`` for the tests of the node's report writer.

The emulator does not serve CRDs yet (issue 22, item 9, being built): until it does, a test that
needs the resource adds it to the emulator's resource table, which every part of the emulator
(routing, RBAC attributes, the status subresource, watches) reads. Its schema is checked by the
tests themselves against the CRD (tests/deploy/crdcheck.py). Once CRDs are served, tests apply
deploy/daemonset/budgets/gpuusagereport-crd.yaml instead and this module goes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from agent.sim.apiserver_crd import violations
from agent.sim.apiserver_types import RESOURCES, ResourceType

GPU_USAGE_REPORTS = ResourceType(
    "gpuusagereports",
    "GpuUsageReport",
    group="tessera.dev",
    version="v1alpha1",
    status=True,
    generation=True,
    short_names=("gpuur",),
)
SERVED = (*RESOURCES, GPU_USAGE_REPORTS)
"""The emulator's resources plus GpuUsageReport (``ApiServer(resources=SERVED)``)."""

CRD: dict[str, Any] = yaml.safe_load(
    (
        Path(__file__).resolve().parents[1]
        / "deploy"
        / "daemonset"
        / "budgets"
        / "gpuusagereport-crd.yaml"
    ).read_text()
)


def crd_violations(report: dict[str, Any]) -> list[str]:
    """What the CRD's schema and rules refuse in ``report`` (empty: accepted)."""
    return violations(CRD, report)
