"""Where the objects the budget controller reads and writes live (their REST paths)."""

from __future__ import annotations

from urllib.parse import quote

TESSERA = "/apis/tessera.dev/v1alpha1"
TESSERA_API_VERSION = "tessera.dev/v1alpha1"
REPORTS = f"{TESSERA}/gpuusagereports"
SUMMARIES = f"{TESSERA}/gpuusagesummaries"
BUDGETS = f"{TESSERA}/gpubudgets"
NAMESPACES = "/api/v1/namespaces"
NODES = "/api/v1/nodes"
PODS = "/api/v1/pods"
CLAIMS = "/apis/resource.k8s.io/v1/resourceclaims"
DRIVER = "gpu.tessera.dev"
"""The driver whose allocated claims a Terminate budget's evictions target."""

KINDS = {
    REPORTS: ("GpuUsageReport", TESSERA_API_VERSION),
    SUMMARIES: ("GpuUsageSummary", TESSERA_API_VERSION),
    BUDGETS: ("GpuBudget", TESSERA_API_VERSION),
    NAMESPACES: ("Namespace", "v1"),
    NODES: ("Node", "v1"),
    PODS: ("Pod", "v1"),
    CLAIMS: ("ResourceClaim", "resource.k8s.io/v1"),
}
"""The kind and apiVersion of each list's items (a list of built-in objects leaves them out)."""


def named(collection: str, name: str) -> str:
    return f"{collection}/{quote(name, safe='')}"


def namespaced(namespace: str, plural: str, name: str | None = None) -> str:
    """``/api/v1/namespaces/<ns>/<plural>[/<name>]`` (core group)."""
    base = f"{NAMESPACES}/{quote(namespace, safe='')}/{plural}"
    return base if name is None else f"{base}/{quote(name, safe='')}"
