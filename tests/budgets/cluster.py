"""The budget controller's test cluster: the API-server emulator serving, besides its built-in
resources, the three tessera.dev resources the controller reads and writes (until the emulator
serves CRDs from their manifests, they are plain resource types here), and a few objects."""

from __future__ import annotations

from typing import Any

from agent.sim.apiserver import RESOURCES, ApiServer, ResourceType

TESSERA = ("tessera.dev", "v1alpha1")
TYPES = (
    *RESOURCES,
    ResourceType("gpuusagereports", "GpuUsageReport", *TESSERA, status=True),
    ResourceType("gpuusagesummaries", "GpuUsageSummary", *TESSERA),
    ResourceType("gpubudgets", "GpuBudget", *TESSERA, status=True, generation=True),
    ResourceType("configmaps", "ConfigMap", namespaced=True),
)


def server(**kwargs: Any) -> ApiServer:
    return ApiServer(resources=TYPES, namespaces=("default", "team-a", "tessera-system"), **kwargs)


def report(node: str) -> dict[str, Any]:
    return {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "GpuUsageReport",
        "metadata": {"name": node, "labels": {"tessera.dev/node": node}},
        "spec": {"nodeName": node, "nodeLabels": {}, "through": "2026-12-04T12:07:31Z",
                 "buckets": []},
    }  # fmt: skip


def summary(name: str) -> dict[str, Any]:
    ns, day = name.split(".", 1)
    return {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "GpuUsageSummary",
        "metadata": {"name": name, "labels": {"tessera.dev/namespace": ns, "tessera.dev/day": day}},
        "spec": {"namespace": ns, "day": day, "buckets": [], "claims": [], "nodes": []},
    }


def budget(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "GpuBudget",
        "metadata": {"name": name},
        "spec": {"scope": {"namespace": "team-a"}, "limits": {"gpuHours": 10},
                 "action": "Terminate"},
    }  # fmt: skip


def pod(name: str, namespace: str = "team-a") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "containers": [{"name": "main", "image": "registry.example/train:1"}],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": f"{name}-gpu"}],
        },
    }
