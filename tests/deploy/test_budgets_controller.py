"""The budget controller's manifests (deploy/daemonset/budgets/): valid for 1.34 and 1.35, the
Deployment runs what the settings expect, the bundle lists every part, kubectl builds it, and
the RBAC grants exactly the calls the controller makes: collected from the real code (Lease,
prices, every list, every write of a plan, the release) against the emulator over real HTTP,
mapped to RBAC verbs as the API server's request-info resolver does, checked both ways."""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.config import BudgetsSettings, resolve_settings
from agent.sim.apiserver_access import verb_of
from agent.sim.apiserver_faults import RequestRecord
from agent.sim.apiserver_types import resolve
from dra_driver.budgets.budget_metrics import BudgetMetrics
from dra_driver.budgets.controller import BudgetController, ControllerSettings
from dra_driver.budgets.view import PricesRef
from dra_driver.cluster.kube import KubeClient
from dra_driver.cluster.lease import LeaseElector, LeaseTiming
from tests.apiclient import api_client
from tests.budgets import cluster
from tests.budgets.cluster import a_plan, seeded
from tests.crds import TYPES
from tests.fakeclock import FakeClock
from tests.k8sschema import VERSIONS, validate

ROOT = Path(__file__).resolve().parents[2]
BUDGETS = ROOT / "deploy" / "daemonset" / "budgets"
OURS = ("controller-rbac.yaml", "controller.yaml")
SUBJECT = {"kind": "ServiceAccount", "name": "tessera-budgets", "namespace": "tessera-system"}


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((BUDGETS / name).read_text()) if d]


def of_kind(kind: str) -> dict[str, Any]:
    return next(d for name in OURS for d in docs(name) if d["kind"] == kind)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", OURS)
def test_the_controllers_manifests_are_valid(name: str, version: str) -> None:
    for doc in docs(name):
        validate(doc, version)


def test_the_deployment_runs_two_replicas_of_tessera_budgets_as_its_settings_expect() -> None:
    deployment = of_kind("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 2
    assert pod["serviceAccountName"] == SUBJECT["name"]
    (container,) = pod["containers"]
    assert container["args"] == ["budgets"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    settings = resolve_settings(
        BudgetsSettings, {}, {"POD_NAME": "budgets-0", **{
            k: v["value"] for k, v in env.items() if "value" in v}}
    )[0]  # fmt: skip
    assert settings.identity == "budgets-0"
    assert settings.host_port()[1] == container["ports"][0]["containerPort"]
    assert (settings.namespace, settings.lease_name) == ("tessera-system", "tessera-budgets")
    assert deployment["metadata"]["namespace"] == settings.namespace
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    pdb = of_kind("PodDisruptionBudget")
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]


def test_the_bundle_lists_the_crds_the_policy_and_the_controller() -> None:
    kust = yaml.safe_load((BUDGETS / "kustomization.yaml").read_text())
    present = {p.name for p in BUDGETS.glob("*.yaml")} - {"kustomization.yaml"}
    assert present <= set(kust["resources"])
    assert set(kust["resources"]) == {
        "gpubudget-crd.yaml", "gpuusagereport-crd.yaml", "gpuusagesummary-crd.yaml",
        "deny-new-policy.yaml", "usage-report-policy.yaml", *OURS,
    }  # fmt: skip


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_builds_the_controllers_part(tmp_path: Path) -> None:
    for name in OURS:
        shutil.copy(BUDGETS / name, tmp_path / name)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({"resources": list(OURS)}))
    out = subprocess.run(
        ["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout
    built = [d for d in yaml.safe_load_all(out) if d]
    assert sorted(d["kind"] for d in built) == sorted(
        d["kind"] for name in OURS for d in docs(name)
    )
    for doc in built:
        for version in VERSIONS:
            validate(doc, version)


# -- RBAC: exactly the calls --------------------------------------------------------------------


def rbac_call(record: RequestRecord) -> tuple[str, str, str, str, str]:
    """(verb, group, resource, namespace, name) as RBAC sees the request."""
    parts = record.path.split("/")
    if record.method == "POST" and parts[-1] == "eviction":  # /api/v1/namespaces/N/pods/P/...
        return "create", "", "pods/eviction", parts[4], parts[6]
    route = resolve(TYPES, record.path)
    assert route is not None, f"not a resource request: {record}"
    named = route.name is not None
    verb = verb_of(record.method, named, False, route.name is None)
    resource = route.rt.plural + (f"/{route.subresource}" if route.subresource else "")
    return verb, route.rt.group, resource, route.namespace or "", route.name or ""


def grants() -> set[tuple[str, str, str, str, str]]:
    """(verb, group, resource, namespace, resourceName) granted to the controller's account;
    "" for a ClusterRole's namespace and for a rule without resourceNames."""
    all_docs = docs("controller-rbac.yaml")
    bound = {
        (d["roleRef"]["kind"], d["roleRef"]["name"], d["metadata"].get("namespace", ""))
        for d in all_docs
        if d["kind"] in ("ClusterRoleBinding", "RoleBinding") and SUBJECT in d["subjects"]
    }
    out = set()
    for d in all_docs:
        if d["kind"] not in ("ClusterRole", "Role"):
            continue
        ns = d["metadata"].get("namespace", "") if d["kind"] == "Role" else ""
        if (d["kind"], d["metadata"]["name"], ns) not in bound:
            continue
        for rule in d["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        assert "*" not in (group, resource, verb)
                        for name in rule.get("resourceNames") or [""]:
                            out.add((verb, group, resource, ns, name))
    return out


def allows(grant: tuple[str, ...], call: tuple[str, ...]) -> bool:
    return grant[:3] == call[:3] and grant[3] in ("", call[3]) and grant[4] in ("", call[4])


def the_controllers_calls() -> set[tuple[str, str, str, str, str]]:
    with cluster.server() as server:
        client = KubeClient(api_client(server, retries=False))
        server.put_object("configmaps", {
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "tessera-prices", "namespace": "tessera-system"},
            "data": {"prices.yaml": "currency: EUR\ngpuHour:\n  - price: '1'\n"}})  # fmt: skip
        plan = a_plan(seeded(server))
        clock = FakeClock(1_796_385_600.0)
        timing = LeaseTiming()
        elector = LeaseElector(
            client, "tessera-system", "tessera-budgets", "budgets-0_1", timing, clock, clock
        )
        c = BudgetController(
            client, elector, lambda view, now: plan, BudgetMetrics(),
            ControllerSettings(PricesRef("tessera-system", "tessera-prices")),
            logging.getLogger("test"), clock, clock,
        )  # fmt: skip
        server.requests.clear()
        c.tick()  # creates the Lease, reconciles: every list and every write of a plan
        clock.advance(timing.renew_period_s)
        c.tick()  # renews
        assert c.elector.release()
        records = server.requests.snapshot()
        client.close()
    failed = [(r.method, r.path, r.status) for r in records if not 200 <= r.status < 300]
    lease = "/apis/coordination.k8s.io/v1/namespaces/tessera-system/leases/tessera-budgets"
    assert failed[0] == ("GET", lease, 404)  # the first replica finds no Lease and creates it
    # until the emulator serves pods/eviction, an eviction answers 404 (taken as a pod gone)
    assert all(path.endswith("/eviction") for _, path, _ in failed[1:])
    return {rbac_call(r) for r in records}


def test_the_rbac_grants_exactly_the_calls_the_controller_makes() -> None:
    made = the_controllers_calls()
    granted = grants()
    missing = sorted(c for c in made if not any(allows(g, c) for g in granted))
    unused = sorted(g for g in granted if not any(allows(g, c) for c in made))
    assert missing == [] and unused == []
    # the Lease's update and the price table's get are granted on their names only
    assert ("update", "coordination.k8s.io", "leases", "tessera-system", "") not in granted
    assert ("get", "", "configmaps", "tessera-system", "") not in granted


def test_the_rbac_check_can_fail() -> None:
    made = the_controllers_calls()
    granted = grants() - {("create", "", "pods/eviction", "", "")}
    assert any(not any(allows(g, c) for g in granted) for c in made)
