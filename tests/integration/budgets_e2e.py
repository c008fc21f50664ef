"""The budgets end to end's cluster (tests/integration/test_budgets_e2e.py): one API-server
emulator with the budgets bundle applied over HTTP as `kubectl apply` sends it (the three CRDs and
both admission policies from deploy/daemonset/budgets/), two kube-mode agents (two simulated
models, so two nodes), two `tessera budgets` replicas, and the claims and pods of two teams, each
written over HTTP and, where the test reads it back, checked against the upstream schemas (1.34,
1.35) or its CRD."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from agent.sim.apiserver import ApiServer, UserInfo
from agent.sim.apiserver_crd import violations
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.integration.daemon import Daemon, claim_manifest
from tests.k8sschema import VERSIONS, validate

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "deploy" / "daemonset" / "budgets"
CRDS = ("gpubudget-crd.yaml", "gpuusagereport-crd.yaml", "gpuusagesummary-crd.yaml")
POLICIES = ("deny-new-policy.yaml", "usage-report-policy.yaml")
PATIENCE_S = 60.0
"""How long one step may take before the test fails (a hang guard, never a measurement)."""

ADMIN = UserInfo("kubernetes-admin", ("kubeadm:cluster-admins", "system:authenticated"))
"""Who the emulator's requests come from. Not the agent's ServiceAccount: the Python client
cannot impersonate from a kubeconfig, and one identity for two agents cannot carry two node names,
so the own-node report policy (which matches only the agent's ServiceAccount) is installed but not
exercised here (tests/deploy/test_usage_report_policy.py exercises it)."""

Obj = dict[str, Any]

PLURALS = {
    "CustomResourceDefinition": "customresourcedefinitions",
    "ValidatingAdmissionPolicy": "validatingadmissionpolicies",
    "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings",
    "Namespace": "namespaces",
    "Node": "nodes",
    "Pod": "pods",
    "ResourceClaim": "resourceclaims",
    "GpuBudget": "gpubudgets",
}
CRD_OF = {
    "GpuBudget": "gpubudget-crd.yaml",
    "GpuUsageReport": "gpuusagereport-crd.yaml",
    "GpuUsageSummary": "gpuusagesummary-crd.yaml",
}


class HttpError(Exception):
    def __init__(self, code: int, body: Obj) -> None:
        super().__init__(f"{code}: {body.get('message', body)}")
        self.code, self.body = code, body


def url_of(server: ApiServer, obj: Obj, name: str = "", sub: str = "") -> str:
    group, _, version = obj["apiVersion"].rpartition("/")
    base = f"/apis/{group}/{version}" if group else f"/api/{version}"
    ns = obj["metadata"].get("namespace")
    path = f"{base}/namespaces/{ns}" if ns else base
    path += f"/{PLURALS[obj['kind']]}"
    if name:
        path += f"/{name}"
    if sub:
        path += f"/{sub}"
    return server.url + path


def call(method: str, url: str, body: Obj | None = None) -> Obj:
    """One request over real HTTP; the answer, or HttpError with the server's Status."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            out: Obj = json.loads(r.read())
            return out
    except urllib.error.HTTPError as exc:
        raise HttpError(exc.code, json.loads(exc.read() or b"{}")) from None


def create(server: ApiServer, obj: Obj) -> Obj:
    """POST ``obj`` (checked first against the upstream schemas when it is a built-in kind)."""
    if obj["kind"] not in CRD_OF and obj["kind"] != "CustomResourceDefinition":
        check_builtin(obj)
    return call("POST", url_of(server, obj), obj)


def check_builtin(obj: Obj) -> None:
    for version in VERSIONS:
        validate(obj, version)


def check_custom(obj: Obj) -> None:
    """``obj`` as its CRD (from the bundle) accepts it."""
    crd = yaml.safe_load((BUNDLE / CRD_OF[obj["kind"]]).read_text())
    assert violations(crd, obj) == [], (obj["metadata"]["name"], violations(crd, obj))


def apply_bundle(server: ApiServer) -> None:
    """The CRDs, then the policies, as `kubectl apply -f` sends them (a POST each)."""
    for name in (*CRDS, *POLICIES):
        for doc in yaml.safe_load_all((BUNDLE / name).read_text()):
            if doc:
                if doc["kind"] != "CustomResourceDefinition":
                    check_builtin(doc)
                create(server, doc)


def wait(what: str, probe: Callable[[], Any], patience: float = PATIENCE_S) -> Any:
    """Poll ``probe`` until it returns something truthy, and return that."""
    deadline = time.monotonic() + patience
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def namespace(name: str) -> Obj:
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": {"team": name}}}  # fmt: skip


def node(name: str) -> Obj:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"tessera.dev/pool": "reserved"}}}  # fmt: skip


def claim(ns: str, name: str) -> Obj:
    """A new (unallocated) ResourceClaim asking for one Tessera GPU, as a user writes it."""
    obj = claim_manifest(name, "", [("gpu", "")], "", ns, allocated=False)
    del obj["metadata"]["uid"]
    return obj


def pod(ns: str, name: str, claim_name: str, node_name: str = "") -> Obj:
    obj: Obj = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "containers": [{"name": "main", "image": "registry.example/train:1"}],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}],
            "terminationGracePeriodSeconds": 5,
        },
    }
    if node_name:
        obj["spec"]["nodeName"] = node_name
    return obj


MIG_1G = "gpu-0-mig-1g5gb-19-2"
"""A dgx-a100 MIG device (the model's balanced layout): 1 of 7 compute and 1 of 8 memory slices."""
MIG_1G_WEIGHT = (1 / 7 + 1 / 8) / 2


@dataclass
class Held:
    """A claim the test prepared on a node: the instants around its prepare and unprepare calls
    (monotonic), so the time it was held is bracketed by what the test observed."""

    ref: ClaimRef
    daemon: Daemon
    pod: str
    prepared: tuple[float, float]
    unprepared: tuple[float, float] | None = None
    weight: float = 1.0

    @property
    def released(self) -> tuple[float, float]:
        assert self.unprepared is not None, f"{self.ref.name} was never released"
        return self.unprepared


def allocate(
    server: ApiServer, d: Daemon, ns: str, name: str, devices: list[str], weight: float = 1.0
) -> Held:
    """``weight``: the GPUs' worth the devices hold together (docs/budgets.md, "The weights"). A
    user's claim and pod (POST), the scheduler's allocation and reservation (PUT status),
    the kubelet's prepare over the agent's socket: the claim is then held."""
    pairs = [(f"gpu{i}", x) for i, x in enumerate(devices)]  # one request per device
    wanted = claim_manifest(name, "", pairs, d.node, ns, allocated=False)
    del wanted["metadata"]["uid"]  # the server assigns it
    made = create(server, wanted)
    p = create(server, pod(ns, f"{name}-pod", name, d.node))
    holder = (p["metadata"]["name"], p["metadata"]["uid"])
    made["status"] = claim_manifest(name, "", pairs, d.node, ns, reserved_for=[holder])["status"]
    check_builtin(made)
    call("PUT", url_of(server, made, name, "status"), made)
    ref = ClaimRef(ns, name, made["metadata"]["uid"])
    before = time.monotonic()
    with KubeletClient(d.dra_socket) as k:
        (result,) = k.prepare([ref])["claims"].values()
    after = time.monotonic()
    assert result["error"] == "", result
    return Held(ref, d, p["metadata"]["name"], (before, after), weight=weight)


def release(h: Held) -> None:
    """The kubelet's unprepare, then the claim's deletion (the pod is gone)."""
    before = time.monotonic()
    with KubeletClient(h.daemon.dra_socket) as k:
        (result,) = k.unprepare([h.ref])["claims"].values()
    h.unprepared = (before, time.monotonic())
    assert result["error"] == "", result


def budget(name: str, ns: str, gpu_hours: str, grace: str = "2s") -> Obj:
    obj: Obj = {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "GpuBudget",
        "metadata": {"name": name},
        "spec": {"scope": {"namespace": ns}, "period": {"type": "None"},
                 "limits": {"gpuHours": gpu_hours}, "thresholds": [50, 80],
                 "action": "Terminate", "gracePeriod": grace},
    }  # fmt: skip
    check_custom(obj)
    return obj


SERVED: dict[str, tuple[str, str]] = {
    "gpubudgets": ("tessera.dev/v1alpha1", "GpuBudget"),
    "gpuusagereports": ("tessera.dev/v1alpha1", "GpuUsageReport"),
    "gpuusagesummaries": ("tessera.dev/v1alpha1", "GpuUsageSummary"),
    "events": ("v1", "Event"),
    "pods": ("v1", "Pod"),
}
"""What the tests read back: resource -> (apiVersion, kind)."""


def read(server: ApiServer, resource: str, ns: str | None = None) -> list[Obj]:
    """Every object of ``resource`` as served over HTTP, each checked against its schema (a list's
    items carry no apiVersion and kind: they are set from the list's, as clients do)."""
    api_version, kind = SERVED[resource]
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/namespaces/{ns}/{resource}" if ns else f"{base}/{resource}"
    items: list[Obj] = call("GET", server.url + path)["items"]
    for item in items:
        item.setdefault("apiVersion", api_version)
        item.setdefault("kind", kind)
        if kind in CRD_OF:
            check_custom(item)
        else:
            check_builtin(item)
    return items


def condition(budget_obj: Obj, kind: str) -> Obj | None:
    for c in (budget_obj.get("status") or {}).get("conditions") or ():
        if c["type"] == kind:
            return dict(c)
    return None


def events(server: ApiServer, ns: str, reason: str) -> list[Obj]:
    return [e for e in read(server, "events", ns) if e.get("reason") == reason]
