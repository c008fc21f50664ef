"""The API-server checks: reachable, new enough, serving ``resource.k8s.io/v1``, and granting
the agent every request it makes (one SelfSubjectAccessReview per verb and resource).

The answers are for whoever the credentials are: the service account in the agent's pod (run
``tessera doctor`` there), the kubeconfig's user elsewhere; the verdict names the user when the
server says who it is (SelfSubjectReview, ``authentication.k8s.io/v1``, Kubernetes 1.28+).
``resource.k8s.io/v1`` is served from Kubernetes 1.34 (DRA's GA).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agent.doctor.verdict import Verdict, fail, ok, skip, warn
from agent.errors import TesseraError
from dra_driver.cluster.kube import KubeClient

TIMEOUT = (3.0, 10.0)
"""(connect, read) seconds for each request the doctor makes."""
MIN_KUBERNETES = (1, 34)
RBAC_FIX = (
    "grant it: the ClusterRole 'tessera' in deploy/daemonset/rbac.yaml, bound to the agent's"
    " service account (kubectl apply -k deploy/daemonset)"
)


@dataclass(frozen=True)
class Access:
    """A request the agent makes: ``verb`` on ``resource`` of API ``group`` ("" is core)."""

    group: str
    resource: str
    verb: str
    used_for: str
    """What the agent makes it for."""
    required: bool = True
    """False: the agent works without it, with less (a warning when denied)."""
    namespace: str = ""
    """The namespace the request is made in ("" for cluster-scoped or every namespace)."""


AGENT_ACCESS: tuple[Access, ...] = (
    # dra_driver/advertise/slice_stores.py KubeSliceStore: list, watch, create, update (PUT), delete
    *(
        Access("resource.k8s.io", "resourceslices", verb, "publishing this node's ResourceSlices")
        for verb in ("list", "watch", "create", "update", "delete")
    ),
    # dra_driver/kubeletplugin/claim_sources.py KubeClaimSource: GET of one claim at
    # NodePrepareResources; a list across namespaces (by_uid) at a start after a lost or corrupt
    # checkpoint
    Access("resource.k8s.io", "resourceclaims", "get", "reading claims to prepare them"),
    Access(
        "resource.k8s.io",
        "resourceclaims",
        "list",
        "finding, by UID, the claims of CDI specs a lost checkpoint no longer lists",
        required=False,
    ),
    # dra_driver/cluster/claim_usage_status.py: an unprepared claim's usage in its status
    # (PUT of /status with the resourceVersion); without it the summary is not written (logged,
    # counted), the GpuUsageReport still carries the usage
    Access(
        "resource.k8s.io",
        "resourceclaims/status",
        "update",
        "each unprepared claim's usage summary in its status",
        required=False,
    ),
    # agent/daemon/node_owner.py: without it the slices get no owner reference (logged, retried)
    Access("", "nodes", "get", "the slices' owner reference (the Node's uid)", required=False),
    # dra_driver/cluster/usage_report.py UsageReporter: the node's GpuUsageReport; without it
    # usage stays in the node's ledger (budgets see none of this node's)
    *(
        Access(
            "tessera.dev", "gpuusagereports", verb, "reporting usage for budgets", required=False
        )
        for verb in ("get", "create", "update")
    ),
    # dra_driver/cluster/node_events.py KubeEventSink: Events about the Node live in "default";
    # without them GPU health changes are only logged (and counted as failed)
    *(
        Access("", "events", verb, "Events on the Node", required=False, namespace="default")
        for verb in ("create", "patch")
    ),
    # dra_driver/cluster/mps_pods.py PodLauncher: a Pod per MPS claim in the agent's namespace
    # (--mps-pod-namespace, tessera-system by default): create at prepare, get (is it still
    # running), delete at unprepare, list at a start (orphans); without them MPS claims fail
    *(
        Access(
            "",
            "pods",
            verb,
            "the Pods of the claims' MPS control daemons",
            required=False,
            namespace="tessera-system",
        )
        for verb in ("create", "get", "list", "delete")
    ),
)
"""Every request the agent makes in kube mode (deploy/daemonset/rbac.yaml grants them; a test
checks that it does)."""


def _version(info: dict[str, object]) -> tuple[int, int] | None:
    major, minor = str(info.get("major", "")), str(info.get("minor", ""))
    m = re.match(r"\d+", minor)
    return (int(major), int(m.group())) if major.isdigit() and m else None


def check_api_server(kube: KubeClient) -> Verdict:
    """Reachable, Kubernetes 1.34 or newer, ``resource.k8s.io/v1`` served."""
    try:
        info = kube.request("GET", "/version", timeout=TIMEOUT)
    except TesseraError as exc:
        return fail(
            "api-server",
            f"not reachable: {exc}",
            "check --kubeconfig (unset: the pod's service account), the network to the API"
            " server, and its certificate; or run standalone with --no-kube",
        )
    shown = str(info.get("gitVersion", "an unknown version"))
    version = _version(info)
    if version is not None and version < MIN_KUBERNETES:
        return fail(
            "api-server",
            f"Kubernetes {shown}: the agent needs resource.k8s.io/v1, served from 1.34",
            "upgrade the cluster to Kubernetes 1.34 or newer",
        )
    try:
        kube.request("GET", "/apis/resource.k8s.io/v1", timeout=TIMEOUT)
    except TesseraError as exc:
        return fail(
            "api-server",
            f"Kubernetes {shown} does not serve resource.k8s.io/v1: {exc}",
            "enable the resource.k8s.io/v1 API (Kubernetes 1.34+: on by default)",
        )
    return ok("api-server", f"Kubernetes {shown}; resource.k8s.io/v1 served")


def who_am_i(kube: KubeClient) -> str | None:
    """The user the credentials are, as the server says (None when it cannot say)."""
    body = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
    try:
        answer = kube.request(
            "POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews", body=body, timeout=TIMEOUT
        )
    except TesseraError:
        return None
    user = answer.get("status", {}).get("userInfo", {}).get("username")
    return str(user) if user else None


def allowed(kube: KubeClient, access: Access) -> tuple[bool, str]:
    """Whether the server allows ``access`` to these credentials, and its reason. A
    subresource (``resourceclaims/status``) is asked as the API server's
    ``resourceAttributes`` take it: ``resource`` and ``subresource`` apart."""
    resource, _, subresource = access.resource.partition("/")
    body = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectAccessReview",
        "spec": {
            "resourceAttributes": {
                "group": access.group,
                "resource": resource,
                **({"subresource": subresource} if subresource else {}),
                "verb": access.verb,
                **({"namespace": access.namespace} if access.namespace else {}),
            }
        },
    }
    answer = kube.request(
        "POST",
        "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
        body=body,
        timeout=TIMEOUT,
    )
    status = answer.get("status", {})
    return bool(status.get("allowed")), str(status.get("reason", "") or "")


def _qualified(group: str, resource: str) -> str:
    return f"{resource}.{group}" if group else resource


def check_rbac(kube: KubeClient, needed: Sequence[Access] = AGENT_ACCESS) -> list[Verdict]:
    """One verdict per resource: the verbs denied (or all allowed)."""
    user = who_am_i(kube)
    as_whom = f" to {user}" if user else ""
    resources = list(dict.fromkeys((a.group, a.resource) for a in needed))
    out: list[Verdict] = []
    for group, resource in resources:
        name = _qualified(group, resource)
        asked = [a for a in needed if (a.group, a.resource) == (group, resource)]
        denied: list[tuple[Access, str]] = []
        try:
            for a in asked:
                yes, reason = allowed(kube, a)
                if not yes:
                    denied.append((a, reason))
        except TesseraError as exc:
            out.append(
                fail(
                    "rbac",
                    f"cannot ask the API server (SelfSubjectAccessReview): {exc}",
                    "the API server must serve authorization.k8s.io/v1 to every authenticated"
                    " user (Kubernetes does by default)",
                    subject=name,
                )
            )
            continue
        verbs = ", ".join(a.verb for a in asked)
        if not denied:
            out.append(ok("rbac", f"{verbs} allowed{as_whom}", subject=name))
            continue
        no = ", ".join(a.verb + (f" ({r})" if r else "") for a, r in denied)
        uses = "; ".join(sorted({a.used_for for a, _ in denied}))
        detail = f"denied{as_whom}: {no}; the agent needs it for {uses}"
        if all(not a.required for a, _ in denied):
            out.append(warn("rbac", detail, RBAC_FIX, subject=name))
        else:
            out.append(fail("rbac", detail, RBAC_FIX, subject=name))
    return out


def api_checks(connect: Callable[[], KubeClient] | None) -> list[Verdict]:
    """The API server and RBAC checks; ``connect`` None: standalone mode, both skipped."""
    if connect is None:
        return [
            skip("api-server", "standalone mode (--no-kube): the agent talks to no API server"),
            skip("rbac", "standalone mode (--no-kube)"),
        ]
    try:
        kube = connect()
    except TesseraError as exc:
        return [
            fail("api-server", str(exc), "pass --kubeconfig FILE, or run standalone (--no-kube)"),
            skip("rbac", "not checked: no API server (see api-server)"),
        ]
    try:
        server = check_api_server(kube)
        if server.status == "fail":
            return [server, skip("rbac", "not checked: no API server (see api-server)")]
        return [server, *check_rbac(kube)]
    finally:
        kube.close()
