"""The doctor's API-server checks against the API-server emulator: reachability, version, and a
SelfSubjectAccessReview per request the agent makes, with verbs taken away one at a time."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from agent.doctor.cluster_api import AGENT_ACCESS, api_checks
from agent.doctor.verdict import Verdict
from agent.errors import ConfigError
from agent.sim.apiserver import ApiServer
from dra_driver.cluster.kube import KubeClient

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def server() -> Iterator[ApiServer]:
    with ApiServer() as s:
        yield s


def connect(server: ApiServer, tmp_path: Path) -> Callable[[], KubeClient]:
    kubeconfig = server.kubeconfig(tmp_path / "kubeconfig")
    return lambda: KubeClient.from_config(kubeconfig)


def by_subject(verdicts: list[Verdict]) -> dict[str, Verdict]:
    return {v.subject or v.check: v for v in verdicts}


def test_everything_the_agent_needs_is_granted(server, tmp_path):
    verdicts = api_checks(connect(server, tmp_path))
    assert [v.status for v in verdicts] == ["ok"] * 8
    got = by_subject(verdicts)
    assert got["gpuusagereports.tessera.dev"].detail.startswith("get, create, update allowed")
    assert "Kubernetes v1.35.0" in got["api-server"].detail
    slices = got["resourceslices.resource.k8s.io"].detail
    assert slices.startswith("list, watch, create, update, delete allowed to system:serviceaccount")
    assert got["pods"].detail.startswith("create, get, list, delete allowed")  # the MPS Pods


def test_a_denied_verb_fails_naming_it_and_what_the_agent_needs_it_for(server, tmp_path):
    server.access.deny("delete", "resourceslices", "resource.k8s.io")
    got = by_subject(api_checks(connect(server, tmp_path)))
    v = got["resourceslices.resource.k8s.io"]
    assert v.status == "fail"
    assert "denied to system:serviceaccount:tessera-system:tessera: delete" in v.detail
    assert "publishing this node's ResourceSlices" in v.detail
    assert "deploy/daemonset/rbac.yaml" in v.fix
    assert got["resourceclaims.resource.k8s.io"].status == "ok"


def test_a_claims_status_is_asked_as_a_subresource_and_a_denial_only_warns(server, tmp_path):
    """The review carries resource and subresource apart, as the API server takes them: the
    emulator's access table denies ``resourceclaims/status`` only when the review says so."""
    server.access.deny("update", "resourceclaims/status", "resource.k8s.io")
    got = by_subject(api_checks(connect(server, tmp_path)))
    v = got["resourceclaims/status.resource.k8s.io"]
    assert v.status == "warn"
    assert "update" in v.detail and "usage summary" in v.detail
    assert got["resourceclaims.resource.k8s.io"].status == "ok"


def test_listing_claims_is_asked_and_optional_so_a_denial_only_warns(server, tmp_path):
    got = by_subject(api_checks(connect(server, tmp_path)))
    assert got["resourceclaims.resource.k8s.io"].detail.startswith("get, list allowed")
    server.access.deny("list", "resourceclaims", "resource.k8s.io")
    v = by_subject(api_checks(connect(server, tmp_path)))["resourceclaims.resource.k8s.io"]
    assert v.status == "warn" and "denied" in v.detail and ": list" in v.detail
    assert "lost checkpoint" in v.detail  # what the agent cannot do without it


def test_reading_the_node_is_optional_so_a_denial_only_warns(server, tmp_path):
    server.access.deny("get", "nodes")
    v = by_subject(api_checks(connect(server, tmp_path)))["nodes"]
    assert v.status == "warn" and "owner reference" in v.detail


def test_writing_node_events_is_optional_so_a_denial_only_warns(server, tmp_path):
    server.access.deny("patch", "events")
    v = by_subject(api_checks(connect(server, tmp_path)))["events"]
    assert v.status == "warn" and "patch" in v.detail and "Events on the Node" in v.detail


def test_a_cluster_older_than_1_34_fails(tmp_path):
    with ApiServer(kube_version="1.33.2") as old:
        v = api_checks(connect(old, tmp_path))[0]
    assert v.status == "fail" and "served from 1.34" in v.detail


def test_an_unreachable_server_fails_and_rbac_is_not_asked(tmp_path, server):
    kubeconfig = server.kubeconfig(tmp_path / "kubeconfig")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    text = kubeconfig.read_text().replace(f":{server.port}", f":{port}")
    kubeconfig.write_text(text)
    verdicts = api_checks(lambda: KubeClient.from_config(kubeconfig))
    assert [v.status for v in verdicts] == ["fail", "skip"]
    assert "not reachable" in verdicts[0].detail


def test_no_credentials_fail_and_standalone_mode_skips_both():
    def nothing() -> KubeClient:
        raise ConfigError("cannot load in-cluster configuration: Service host/port is not set")

    assert [v.status for v in api_checks(nothing)] == ["fail", "skip"]
    assert [v.status for v in api_checks(None)] == ["skip", "skip"]


def granted(doc: dict) -> set[tuple[str, str, str, str]]:
    """(namespace, group, resource, verb) a ClusterRole ("" namespace: all) or Role grants."""
    ns = doc["metadata"].get("namespace", "") if doc["kind"] == "Role" else ""
    return {
        (ns, group, resource, verb)
        for rule in doc["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_the_deployed_rbac_grants_every_request_the_agent_makes():
    docs = list(yaml.safe_load_all((ROOT / "deploy/daemonset/rbac.yaml").read_text()))
    bound = {
        (d["roleRef"]["kind"], d["roleRef"]["name"], d["metadata"].get("namespace", ""))
        for d in docs
        if d["kind"] in ("ClusterRoleBinding", "RoleBinding")
        and {"kind": "ServiceAccount", "name": "tessera", "namespace": "tessera-system"}
        in d["subjects"]
    }
    roles = [
        d
        for d in docs
        if d["kind"] in ("ClusterRole", "Role")
        and (d["kind"], d["metadata"]["name"], d["metadata"].get("namespace", "")) in bound
    ]
    grants = set().union(*(granted(d) for d in roles))
    for a in AGENT_ACCESS:
        anywhere = ("", a.group, a.resource, a.verb)
        assert anywhere in grants or (a.namespace, a.group, a.resource, a.verb) in grants, a
    # each Role (Events in default, the MPS Pods in tessera-system) grants exactly what the
    # agent asks for in its namespace, nothing else
    namespaced = [d for d in roles if d["kind"] == "Role"]
    assert sorted(d["metadata"]["namespace"] for d in namespaced) == ["default", "tessera-system"]
    for role in namespaced:
        ns = role["metadata"]["namespace"]
        assert granted(role) == {
            (a.namespace, a.group, a.resource, a.verb) for a in AGENT_ACCESS if a.namespace == ns
        }
