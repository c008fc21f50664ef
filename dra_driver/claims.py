"""ResourceClaims as the driver needs them: where to read them and what their allocation says.

``parse_allocation`` is pure: it checks a claim object against what the kubelet asked for (UID,
allocated, node) and extracts the results and opaque configs for this driver. Sources read the
claim object: ``KubeClaimSource`` from the API server, ``DirClaimSource`` from
``<state-dir>/resourceclaims/*.yaml`` (standalone mode: manifests that carry
``status.allocation``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml

from dra_driver.errors import ClaimError, KubeError
from dra_driver.kube import KubeClient

YamlLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when installed


@dataclass(frozen=True)
class ClaimKey:
    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


@dataclass(frozen=True)
class AllocatedDevice:
    request: str
    """``<request>`` or ``<request>/<subrequest>``."""
    driver: str
    pool: str
    device: str
    admin_access: bool = False
    share_id: str | None = None


@dataclass(frozen=True)
class OpaqueConfig:
    source: str
    """``FromClass`` or ``FromClaim``."""
    requests: tuple[str, ...]
    """Empty: applies to every request."""
    parameters: Any


@dataclass(frozen=True)
class Allocation:
    claim: ClaimKey
    devices: tuple[AllocatedDevice, ...]
    """Results for this driver only."""
    configs: tuple[OpaqueConfig, ...]
    """Opaque configs for this driver, in the order they apply (class first, then claim)."""


def _node_allowed(selector: Any, node: str) -> bool:
    """Whether an allocation's nodeSelector admits ``node`` (only the terms the scheduler writes
    for node-local pools are understood: matchFields on metadata.name)."""
    if not selector:
        return True
    for term in selector.get("nodeSelectorTerms") or []:
        fields = term.get("matchFields") or []
        if any(
            f.get("key") == "metadata.name" and f.get("operator") == "In" and node in f["values"]
            for f in fields
        ):
            return True
        if not fields and not term.get("matchExpressions"):
            return True
    return False


def parse_allocation(obj: dict[str, Any], key: ClaimKey, driver: str, node: str) -> Allocation:
    """Check the claim against the kubelet's request and pick this driver's part. Pure."""
    meta = obj.get("metadata") or {}
    if meta.get("uid") != key.uid:
        raise ClaimError(
            f"claim {key.namespace}/{key.name} has UID {meta.get('uid')!r}, the kubelet asked for"
            f" {key.uid!r} (the claim was deleted and re-created?)",
            reason="uid_mismatch",
        )
    allocation = (obj.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(
            f"claim {key} is not allocated (status.allocation is empty)", reason="not_allocated"
        )
    if not _node_allowed(allocation.get("nodeSelector"), node):
        raise ClaimError(
            f"claim {key} is allocated to another node, not {node!r}", reason="other_node"
        )
    devices_status = allocation.get("devices") or {}
    results = []
    for r in devices_status.get("results") or []:
        if r.get("driver") != driver:
            continue
        if r.get("pool") != node:
            raise ClaimError(
                f"claim {key}: device {r.get('device')!r} is allocated from pool"
                f" {r.get('pool')!r}, which is another node's (this node is {node!r})",
                reason="other_node",
            )
        results.append(
            AllocatedDevice(
                request=str(r["request"]),
                driver=driver,
                pool=str(r["pool"]),
                device=str(r["device"]),
                admin_access=bool(r.get("adminAccess", False)),
                share_id=r.get("shareID"),
            )
        )
    configs = [
        OpaqueConfig(
            source=str(c.get("source", "FromClaim")),
            requests=tuple(c.get("requests") or ()),
            parameters=c["opaque"].get("parameters"),
        )
        for c in devices_status.get("config") or []
        if (c.get("opaque") or {}).get("driver") == driver
    ]
    # class configs first, then claim configs; within each, later entries win (stable sort)
    configs.sort(key=lambda c: 0 if c.source == "FromClass" else 1)
    return Allocation(claim=key, devices=tuple(results), configs=tuple(configs))


def configs_for(allocation: Allocation, request: str) -> list[OpaqueConfig]:
    """The configs that apply to one request, lowest precedence first. A config naming
    ``req`` applies to ``req`` and to its subrequests ``req/x``."""
    parent = request.split("/", 1)[0]
    return [
        c
        for c in allocation.configs
        if not c.requests or request in c.requests or parent in c.requests
    ]


class ClaimSource(Protocol):
    def get(self, namespace: str, name: str) -> dict[str, Any]:
        """The claim object; ClaimError when it does not exist, KubeError when unreachable."""
        ...


class KubeClaimSource:
    def __init__(self, kube: KubeClient) -> None:
        self._kube = kube

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        try:
            return self._kube.request(
                "GET", f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"
            )
        except KubeError as exc:
            if exc.status == 404:
                raise ClaimError(f"claim {namespace}/{name} not found", "not_found") from exc
            raise


class DirClaimSource:
    """Standalone mode: ResourceClaim manifests (with status.allocation) in a directory.

    Parsed files are cached by (mtime, size), so a batch of claims parses each file once."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._cache: dict[Path, tuple[tuple[int, int], list[dict[str, Any]]]] = {}
        self._lock = threading.Lock()

    def _file(self, path: Path) -> list[dict[str, Any]]:
        try:
            st = path.stat()
            key = (st.st_mtime_ns, st.st_size)
            with self._lock:
                cached = self._cache.get(path)
            if cached is not None and cached[0] == key:
                return cached[1]
            docs = [
                d for d in yaml.load_all(path.read_text(), Loader=YamlLoader) if isinstance(d, dict)
            ]
        except (OSError, yaml.YAMLError) as exc:
            raise ClaimError(f"cannot read claim file {path}: {exc}", "claim_source") from exc
        with self._lock:
            self._cache[path] = (key, docs)
        return docs

    def _documents(self) -> Sequence[dict[str, Any]]:
        if not self.directory.is_dir():
            return []
        paths = sorted(self.directory.glob("*.yaml")) + sorted(self.directory.glob("*.yml"))
        return [d for path in paths for d in self._file(path)]

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        for doc in self._documents():
            meta = doc.get("metadata") or {}
            if (
                doc.get("kind") == "ResourceClaim"
                and meta.get("name") == name
                and meta.get("namespace", "default") == namespace
            ):
                return doc
        raise ClaimError(f"claim {namespace}/{name} not found in {self.directory}", "not_found")
