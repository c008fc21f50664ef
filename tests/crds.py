"""Tessera's custom resources in the API-server emulator, from their real CRDs: ``install`` (and
``serving``, for all three) writes a CRD through the emulator's API, as ``kubectl apply`` does,
after which the emulator serves the resource with the CRD's schema, defaults, CEL rules and
status subresource; ``create`` writes an object through the API, so that the CRD (or, for a
built-in kind, the upstream schema) checks it. ``TYPES`` is the emulator's resource table once
the three CRDs are served, for tests that route the requests they record
(``agent.sim.apiserver_types.resolve``)."""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from agent.sim.apiserver import ApiServer
from agent.sim.apiserver_crd import served_types, violations
from agent.sim.apiserver_types import RESOURCES, ResourceType
from tests.apiclient import api_client
from tests.k8sschema import VERSIONS
from tests.k8sschema import validate as validate_k8s

BUDGETS = Path(__file__).resolve().parents[1] / "deploy" / "daemonset" / "budgets"
CRDS: dict[str, dict[str, Any]] = {
    plural: yaml.safe_load((BUDGETS / f"{kind}-crd.yaml").read_text())
    for plural, kind in (
        ("gpubudgets", "gpubudget"),
        ("gpuusagereports", "gpuusagereport"),
        ("gpuusagesummaries", "gpuusagesummary"),
    )
}
"""The CRDs of deploy/daemonset/budgets/, by the plural they serve."""
TYPES: tuple[ResourceType, ...] = (
    *RESOURCES,
    *(t for crd in CRDS.values() for t in served_types(crd)),
)


def install(api: Any, crd: dict[str, Any]) -> dict[str, Any]:
    """Create ``crd`` through the API (``api``: a kubernetes ``ApiClient``); the CRD as stored.
    Both the CRD written and the one read back are checked against the upstream schemas."""
    for version in VERSIONS:
        validate_k8s(crd, version)
    ext: Any = client.ApiextensionsV1Api(api)  # the client takes the dict as the model
    ext.create_custom_resource_definition(crd)
    got: dict[str, Any] = api.sanitize_for_serialization(
        ext.read_custom_resource_definition(crd["metadata"]["name"])
    )
    for version in VERSIONS:
        validate_k8s(got, version)
    return got


@contextmanager
def serving(**kwargs: Any) -> Iterator[ApiServer]:
    """A started ``ApiServer(**kwargs)`` with the three tessera.dev CRDs installed through its
    API; its request log is then cleared, so that a test sees only its own requests."""
    with ApiServer(**kwargs) as server:
        api = api_client(server, retries=False)
        try:
            for crd in CRDS.values():
                install(api, crd)
        finally:
            api.close()
        server.requests.clear()
        yield server


def create(server: ApiServer, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
    """POST ``obj`` (a ``plural``) through the API, then PUT its ``status`` to the status
    subresource when it has one (a create drops it, as the real server's strategy does); the
    object as stored. A refusal (the CRD's schema or rules, the upstream schema) fails the test
    with the server's message."""
    body = copy.deepcopy(obj)
    body["metadata"].pop("resourceVersion", None)  # the real server refuses it on a create
    api_version = body["apiVersion"]
    base = f"/apis/{api_version}" if "/" in api_version else f"/api/{api_version}"
    ns = body["metadata"].get("namespace")
    path = base + (f"/namespaces/{ns}" if ns else "") + f"/{plural}"
    stored = _send(server, "POST", path, body)
    if "status" in body:
        stored["status"] = body["status"]
        stored = _send(server, "PUT", f"{path}/{body['metadata']['name']}/status", stored)
    return stored


def _send(server: ApiServer, method: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        server.url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Accept": "application/json"},
        method=method,
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            got: dict[str, Any] = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        answer = exc.read().decode()
        raise AssertionError(f"{method} {path} refused ({exc.code}): {answer}") from None
    return got


def crd_violations(plural: str, obj: dict[str, Any]) -> list[str]:
    """What the CRD serving ``plural`` refuses in ``obj`` by its schema and rules (empty:
    accepted), for objects a test checks without writing them."""
    return violations(CRDS[plural], obj)
