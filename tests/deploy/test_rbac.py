"""deploy/daemonset/rbac.yaml grants exactly the API calls the agent makes, no more, no less.

Every request is collected from the API-server emulator (real HTTP, the real client) while the
real code paths run, mode by mode:

* publisher: ``tessera run`` in kube mode publishes its node's slices, repairs one someone else
  edited (PUT), removes a stale one (DELETE), watches them, and deletes them all on exit
  (``--cleanup-on-exit``); it reads the Node for the slices' owner reference;
* claims: a NodePrepareResources through the kubelet's gRPC API reads the ResourceClaim; a
  restart after a corrupt checkpoint lists claims across namespaces to find the ones its CDI
  specs name;
* unprepare: a NodeUnprepareResources of another claim writes its usage into its status
  (dra_driver/cluster/claim_usage_status.py: a GET, then a PUT of ``/status``);
* events: GPU health changes become Events on the Node (created, then patched as they repeat);
* mps: an MPS claim's control daemon runs in a Pod of its own (created at prepare, read while it
  is stopped, deleted at unprepare; the simulator's pod runner plays the kubelet), and a start
  lists the MPS Pods of the node to remove orphans;
* doctor: ``tessera doctor`` in kube mode (discovery, self reviews).

Each request maps to an RBAC verb as the API server's request-info resolver does (GET of an item:
get, of a collection: list, with watch=true: watch; POST create, PUT update, PATCH patch, DELETE
delete, of a collection deletecollection). Then both ways: every call is granted by a role bound
to the agent's ServiceAccount (in the call's namespace for a Role), and every verb a role grants
is used by some call. Discovery and the self reviews are granted to every authenticated user by
the default ClusterRoles (system:discovery, system:public-info-viewer, system:basic-user), so
they are checked to be exactly those and need nothing in rbac.yaml."""

from __future__ import annotations

import copy
import io
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml
import yaml

from agent.cli import main
from agent.doctor.cluster_api import AGENT_ACCESS
from agent.sim.apiserver import ApiServer
from agent.sim.apiserver_access import verb_of
from agent.sim.apiserver_faults import RequestRecord
from agent.sim.apiserver_types import resolve
from agent.sim.nvml import FakeNvml
from agent.sim.podrunner import PodRunner
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.crds import TYPES, serving
from tests.integration.daemon import Daemon, claim_manifest
from tests.simnode import node_model

ROOT = Path(__file__).resolve().parents[2]
RBAC = ROOT / "deploy" / "daemonset" / "rbac.yaml"
SUBJECT = {"kind": "ServiceAccount", "name": "tessera", "namespace": "tessera-system"}
MODEL = "l40s-pcie"
DRIVER = "gpu.tessera.dev"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


@dataclass(frozen=True, order=True)
class Call:
    """One API call as RBAC sees it; ``namespace`` "" for cluster-scoped or all namespaces."""

    verb: str
    group: str
    resource: str
    namespace: str = ""

    def __str__(self) -> str:
        where = f" in {self.namespace}" if self.namespace else ""
        return f"{self.verb} {self.resource}{'.' + self.group if self.group else ''}{where}"


DEFAULT_GRANTED = {
    ("GET", "/version"): "system:public-info-viewer",
    ("GET", "/apis/resource.k8s.io/v1"): "system:discovery",
    ("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews"): "system:basic-user",
    ("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"): "system:basic-user",
}
"""Requests every authenticated user may make: the default ClusterRoles named (bound to
system:authenticated; kubernetes plugin/pkg/auth/authorizer/rbac/bootstrappolicy/policy.go)."""


def rbac_call(record: RequestRecord) -> Call | None:
    """The RBAC attributes of a resource request; None for discovery and the self reviews."""
    if (record.method, record.path) in DEFAULT_GRANTED:
        return None
    route = resolve(TYPES, record.path)
    assert route is not None, f"not a resource request: {record}"
    watch = record.method == "GET" and (route.watch_path or record.params.get("watch") == "true")
    named = route.name is not None and not route.watch_path
    verb = verb_of(record.method, named, watch, route.name is None)
    resource = route.rt.plural + (f"/{route.subresource}" if route.subresource else "")
    return Call(verb, route.rt.group, resource, route.namespace or "")


def kubelets(record: RequestRecord) -> bool:
    """A request of the simulator's pod runner, which plays the kubelet (with the node's own
    credentials, not the agent's): its list of the node's Pods across namespaces and its
    writes of their status. The agent makes neither."""
    pod_status = record.path.startswith("/api/v1/namespaces/") and record.path.endswith("/status")
    return (record.method, record.path) == ("GET", "/api/v1/pods") or (
        record.method == "PUT" and "/pods/" in record.path and pod_status
    )


def calls(records: list[RequestRecord]) -> set[Call]:
    found = {rbac_call(r) for r in records if not kubelets(r)}
    return {c for c in found if c is not None}


# -- what rbac.yaml grants ----------------------------------------------------------------------


def documents() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(RBAC.read_text()) if d]


def grants() -> set[tuple[str, Call]]:
    """(role, Call) for every verb on every resource a role bound to the agent grants; a
    ClusterRole's namespace is "" (every namespace and the cluster scope)."""
    docs = documents()
    bound = {
        (d["roleRef"]["kind"], d["roleRef"]["name"], d["metadata"].get("namespace", ""))
        for d in docs
        if d["kind"] in ("ClusterRoleBinding", "RoleBinding") and SUBJECT in d["subjects"]
    }
    out = set()
    for d in docs:
        if d["kind"] not in ("ClusterRole", "Role"):
            continue
        ns = d["metadata"].get("namespace", "") if d["kind"] == "Role" else ""
        if (d["kind"], d["metadata"]["name"], ns) not in bound:
            continue
        role = f"{d['kind']}/{d['metadata']['name']}"
        for rule in d["rules"]:
            assert not rule.get("resourceNames") and not rule.get("nonResourceURLs"), rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        assert "*" not in (group, resource, verb), f"a wildcard in {role}"
                        out.add((role, Call(verb, group, resource, ns)))
    return out


def allows(grant: Call, call: Call) -> bool:
    return (grant.verb, grant.group, grant.resource) == (call.verb, call.group, call.resource) and (
        grant.namespace in ("", call.namespace)
    )


# -- driving the agent --------------------------------------------------------------------------


def until(cond: Callable[[], bool], d: Daemon, what: str, timeout: float = 60) -> None:
    """Wait for ``cond`` (a generous hang guard), failing at once if the daemon died."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert d.proc is not None and d.proc.poll() is None, f"the agent died: {d.logs[-5:]}"
        assert time.monotonic() < deadline, f"never: {what}"
        threading.Event().wait(0.05)


def ours(server: ApiServer, node: str) -> list[dict[str, Any]]:
    return [
        s
        for s in server.objects("resourceslices")
        if s["spec"]["nodeName"] == node and s["spec"]["driver"] == DRIVER
    ]


def events(server: ApiServer, reason: str) -> int:
    return sum(e["count"] for e in server.objects("events", "default") if e["reason"] == reason)


class Phases:
    """The requests of each phase, told apart by when they arrived.

    A phase ends when the test sees its effect in the server's store; the server logs a request
    when it answers, after the store changed, so a log cut at that moment could miss the request
    that ended the phase and give it to the next one (a Node event's PATCH seen in the restart).
    Every request that caused what the test saw arrived before the test saw it, and every request
    of the next phase arrives after the test starts it: so each phase ends at an instant (``end``)
    and the log is split by arrival time once the agent has exited (all answered then)."""

    def __init__(self) -> None:
        self.ends: list[tuple[str, float]] = []

    def end(self, mode: str) -> None:
        self.ends.append((mode, time.monotonic()))

    def split(self, server: ApiServer, last: str) -> dict[str, list[RequestRecord]]:
        """Every request the server logged, by the phase it arrived in; after the last end:
        ``last``."""
        modes: dict[str, list[RequestRecord]] = {mode: [] for mode, _ in self.ends}
        modes[last] = []
        for record in server.requests.snapshot():
            mode = next((m for m, at in self.ends if record.at < at), last)
            modes[mode].append(record)
        return modes


def drive_the_agent(server: ApiServer, state: Path) -> dict[str, list[RequestRecord]]:
    """Every mode of the agent in kube mode against ``server``; the requests of each."""
    kubeconfig = str(server.kubeconfig(state.parent / "kubeconfig"))
    d = Daemon(state, MODEL, "--kubeconfig", kubeconfig, "--cleanup-on-exit",
               "--telemetry-interval", "0.2", "--usage-report-interval", "0.5",
               "--mps-pod-image", "ghcr.io/tessera-gpu/tessera:test")  # fmt: skip
    node = d.node
    server.put_object("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
    server.put_object("namespaces", {"metadata": {"name": "tessera-system"}})
    mps_params = {"apiVersion": f"{DRIVER}/v1alpha1", "kind": "GpuConfig",
                  "sharing": {"strategy": "MPS"}}  # fmt: skip
    mps_config = {"source": "FromClaim", "requests": [],
                  "opaque": {"driver": DRIVER, "parameters": mps_params}}  # fmt: skip
    shared = claim_manifest("mps", "uid-mps", [("gpu", "gpu-3")], node, "team-a", [mps_config])
    mps = ClaimRef("team-a", "mps", server.put_object("resourceclaims", shared)["metadata"]["uid"])
    runner = PodRunner(server.url, node, state.parent / "pod-logs", dict(os.environ)).start()
    claim = claim_manifest("train", "uid-train", [("gpu", "gpu-1")], node, "team-a")
    uid = server.put_object("resourceclaims", claim)["metadata"]["uid"]
    ref = ClaimRef("team-a", "train", uid)
    other = claim_manifest("infer", "uid-infer", [("gpu", "gpu-2")], node, "team-a")
    done = ClaimRef(
        "team-a", "infer", server.put_object("resourceclaims", other)["metadata"]["uid"]
    )
    phases = Phases()
    try:
        d.start()
        until(lambda: len(ours(server, node)) == 1, d, "the node's slice published")
        (mine,) = ours(server, node)
        edited = copy.deepcopy(mine)
        edited["spec"]["devices"] = edited["spec"]["devices"][:1]
        stale = copy.deepcopy(mine)
        stale["metadata"] = {"name": f"{node}-stale", "labels": mine["metadata"].get("labels", {})}
        server.put_object("resourceslices", stale)  # left behind, say by an older version
        server.put_object("resourceslices", edited)  # someone else edits ours
        until(
            lambda: (
                [s["metadata"]["name"] for s in ours(server, node)] == [mine["metadata"]["name"]]
                and len(ours(server, node)[0]["spec"]["devices"]) == len(mine["spec"]["devices"])
            ),
            d,
            "the edit repaired and the stale slice removed",
        )
        phases.end("publisher")

        with KubeletClient(d.dra_socket) as k:
            results = k.prepare([ref, done])["claims"]
        assert [r["error"] for r in results.values()] == ["", ""], results
        phases.end("claims")

        with KubeletClient(d.dra_socket) as k:
            assert k.unprepare([done])["claims"] == {done.uid: {"error": ""}}
        until(
            lambda: bool(
                (server.get_object("resourceclaims", "infer", "team-a") or {})
                .get("status", {})
                .get("devices")
            ),
            d,
            "the unprepared claim's usage in its status",
        )
        phases.end("unprepare")

        # GPU 0 flaps twice: lost (one read fails as a lost GPU's would), then answers again
        sim = FakeNvml(node_model(MODEL), d.state / "sim")
        for cycle in (1, 2):
            sim.fail_call("nvmlDeviceGetPowerUsage", gpu=0, code=pynvml.NVML_ERROR_GPU_IS_LOST)
            until(
                lambda c=cycle: events(server, "GpuHealthy") == c,  # type: ignore[misc]
                d,
                f"flap {cycle} recorded",
            )
        phases.end("events")

        with KubeletClient(d.dra_socket) as k:
            prepared = k.prepare([mps])["claims"][mps.uid]
            assert prepared.get("error", "") == "", prepared
            assert k.unprepare([mps])["claims"] == {mps.uid: {"error": ""}}
        until(
            lambda: bool(
                (server.get_object("resourceclaims", "mps", "team-a") or {})
                .get("status", {})
                .get("devices")
            ),
            d,
            "the MPS claim's usage in its status",
        )
        phases.end("mps")

        d.kill()  # kill -9, then the checkpoint is damaged: the claim is found through the API
        (d.state / "checkpoint.json").write_text('{"version": 2, "claims": {"uid-')
        d.start()
        until(lambda: uid in d.checkpoint()["claims"], d, "the claim rebuilt")
        assert d.checkpoint()["claims"][uid]["rebuiltFrom"] == "cdi-spec+api"
        assert d.stop() == 0  # and --cleanup-on-exit removes the slices
        assert ours(server, node) == []
        phases.end("restart and exit")
    finally:
        d.kill()
        runner.stop()
    doctor(state, kubeconfig)
    assert server.rejected == []
    return phases.split(server, "doctor")


def doctor(state: Path, kubeconfig: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    argv = ["doctor", "--simulate", MODEL, "--state-dir", str(state), "--kubeconfig", kubeconfig]
    main([*argv, "-o", "json"], {}, out, err)
    report = json.loads(out.getvalue())
    for check in ("api-server", "rbac"):
        assert {c["status"] for c in report["checks"] if c["check"] == check} == {"ok"}, report


# -- the test -----------------------------------------------------------------------------------


def test_rbac_grants_exactly_the_calls_the_agent_makes(short_tmp):
    with serving() as server:
        modes = drive_the_agent(server, short_tmp / "state")
    per_mode = {mode: calls(records) for mode, records in modes.items()}
    shown = {mode: sorted(str(c) for c in found) for mode, found in per_mode.items()}

    # what each mode makes (the table in docs/security.md); the publisher runs all along (a
    # health change republishes the slice: an unhealthy GPU is tainted), so its calls may show
    # up in any mode of the daemon, but nothing else does
    slices = "resourceslices.resource.k8s.io"
    publisher = {
        f"create {slices}",  # the first publish
        f"delete {slices}",  # the stale slice
        "get nodes",  # the Node's uid for the slices' owner reference
        f"list {slices}",
        f"update {slices}",  # the edited slice put back
        f"watch {slices}",
    }
    reports = "gpuusagereports.tessera.dev"
    report = {  # the usage report, every 0.5 s all along
        f"get {reports}",  # when its resourceVersion is not known (at a start)
        f"create {reports}",  # the first
        f"update {reports}",  # every later one
        "get nodes",  # the Node's labels
    }
    sweep = {"list pods in tessera-system"}  # a start's MPS orphans: Pods of no claim
    background = publisher | report | sweep
    expected = {
        "publisher": publisher,
        "claims": {"get resourceclaims.resource.k8s.io in team-a"},
        "unprepare": {
            "get resourceclaims.resource.k8s.io in team-a",  # read, then merged into
            "update resourceclaims/status.resource.k8s.io in team-a",
        },
        "events": {"create events in default", "patch events in default"},
        "mps": {
            "get resourceclaims.resource.k8s.io in team-a",
            "update resourceclaims/status.resource.k8s.io in team-a",
            *(f"{verb} pods in tessera-system" for verb in ("create", "get", "delete")),
        },
        "restart and exit": {
            "list resourceclaims.resource.k8s.io",
            f"delete {slices}",
            "list pods in tessera-system",  # the MPS Pods of claims no longer prepared
        },
    }
    for mode, wanted in expected.items():
        found = set(shown[mode])
        assert wanted <= found, (mode, shown)
        assert found - wanted <= background, (mode, shown)
    assert set(shown["publisher"]) - report == (publisher | sweep) - report, shown
    assert report <= set().union(*map(set, shown.values())), shown
    assert per_mode["doctor"] == set(), shown  # discovery and self reviews only
    # the pod runner (the kubelet's part, stopped just before) may have one list in flight
    doctor_asked = {(r.method, r.path) for r in modes["doctor"] if not kubelets(r)}
    assert doctor_asked == set(DEFAULT_GRANTED)
    for mode, records in modes.items():
        defaulted = {(r.method, r.path) for r in records} & set(DEFAULT_GRANTED)
        assert mode == "doctor" or not defaulted, (mode, defaulted)

    made = set().union(*per_mode.values())
    granted = grants()
    missing = [str(c) for c in sorted(made) if not any(allows(g, c) for _, g in granted)]
    assert missing == [], f"calls rbac.yaml does not grant: {missing}"
    unused = sorted(f"{role}: {g}" for role, g in granted if not any(allows(g, c) for c in made))
    assert unused == [], f"grants no call uses: {unused}"

    # and `tessera doctor` asks the server about exactly these (its RBAC check)
    # (a claim is read in its own namespace: the doctor asks for every namespace)
    asked = {Call(a.verb, a.group, a.resource, a.namespace) for a in AGENT_ACCESS}
    namespaced = ("events", "pods")
    cluster_wide = {Call(c.verb, c.group, c.resource) for c in made if c.resource not in namespaced}
    assert asked == cluster_wide | {c for c in made if c.resource in namespaced}
