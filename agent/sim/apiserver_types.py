"""The resource table of the API-server emulator, its URL layout and its discovery documents.

Adding a resource to the emulator is one :class:`ResourceType` line in :data:`RESOURCES`. The
table says what the real API server does for that resource where a client can tell: its scope,
whether it has a ``status`` subresource, which field selectors it accepts (the real server
answers 400 to any other field), whether ``metadata.generation`` is kept.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DRA_GROUP = "resource.k8s.io"

#: What every resource accepts when it registers no field-label conversion of its own.
DEFAULT_FIELDS = ("metadata.name", "metadata.namespace")

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True)
class Subresource:
    """A subresource other than ``status``, answered by its own handler (``pods/eviction``)."""

    name: str
    kind: str
    group: str
    version: str
    verbs: tuple[str, ...] = ("create",)


@dataclass(frozen=True)
class ResourceType:
    """One REST resource served by the emulator."""

    plural: str
    kind: str
    group: str = ""  # "" is the core group (served under /api/v1)
    version: str = "v1"
    namespaced: bool = False
    status: bool = False  # has a ``status`` subresource (normal writes ignore status changes)
    keep_status_on_create: bool = False  # else a create drops the status, like the real strategy
    initial_status: dict[str, Any] | None = field(default=None, compare=False)  # set on create
    generation: bool = False  # metadata.generation = 1 on create, +1 on every spec change
    spec_immutable: bool = False  # an update that changes spec is 422 (claims, claim templates)
    fields: tuple[str, ...] = DEFAULT_FIELDS  # field selectors the real server accepts
    field_paths: tuple[tuple[str, str], ...] = ()  # (selector field, object path) where they differ
    short_names: tuple[str, ...] = ()
    name_rule: str = "subdomain"  # "subdomain" (DNS-1123 subdomain) or "label" (DNS-1123 label)
    verbs: tuple[str, ...] = field(
        default=("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
    )
    subresources: tuple[Subresource, ...] = ()  # beyond status (pods/eviction)
    crd: str = ""  # the CustomResourceDefinition serving it ("" for a built-in resource)
    schema: Mapping[str, Any] | None = field(default=None, compare=False, hash=False, repr=False)
    """A custom resource's structural OpenAPI v3 schema (the CRD's, of this version)."""
    columns: tuple[Mapping[str, Any], ...] = field(default=(), compare=False, hash=False)
    """A custom resource's additionalPrinterColumns."""

    def generation_content(self, obj: Mapping[str, Any]) -> Any:
        """What bumps ``metadata.generation`` when it changes: ``spec`` for the built-in
        resources; for a custom one everything but metadata (and status, when it is a
        subresource), as the CRD strategy compares."""
        if not self.crd:
            return obj.get("spec")
        skip = ("metadata", "status") if self.status else ("metadata",)
        return {k: v for k, v in obj.items() if k not in skip}

    @property
    def api_version(self) -> str:
        """``apiVersion`` of the objects: ``v1`` or ``<group>/<version>``."""
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def prefix(self) -> str:
        """URL prefix of the group-version: ``/api/v1`` or ``/apis/<group>/<version>``."""
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"

    @property
    def qualified(self) -> str:
        """``resourceslices.resource.k8s.io`` (``nodes`` for the core group), as in messages."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def qualified_kind(self) -> str:
        """``ResourceSlice.resource.k8s.io`` (``Node`` for the core group), as in 422 messages."""
        return f"{self.kind}.{self.group}" if self.group else self.kind

    @property
    def singular(self) -> str:
        return self.kind.lower()

    def check_name(self, name: str) -> str | None:
        """The reason ``name`` is not a valid object name, or None."""
        limit, rx = (63, _DNS_LABEL) if self.name_rule == "label" else (253, _DNS_SUBDOMAIN)
        if len(name) > limit:
            return f"must be no more than {limit} characters"
        if not rx.match(name):
            return (
                "a lowercase RFC 1123 "
                + ("label" if self.name_rule == "label" else "subdomain")
                + " must consist of lower case alphanumeric characters, '-' or '.', and must"
                " start and end with an alphanumeric character"
            )
        return None


#: The resources served by default. One line per resource.
RESOURCES: tuple[ResourceType, ...] = (
    ResourceType(
        "resourceslices",
        "ResourceSlice",
        DRA_GROUP,
        generation=True,
        fields=("metadata.name", "spec.nodeName", "spec.driver"),
    ),
    ResourceType(
        "resourceclaims",
        "ResourceClaim",
        DRA_GROUP,
        namespaced=True,
        status=True,
        generation=True,
        spec_immutable=True,
    ),
    ResourceType(
        "resourceclaimtemplates",
        "ResourceClaimTemplate",
        DRA_GROUP,
        namespaced=True,
        generation=True,
        spec_immutable=True,
    ),
    ResourceType("deviceclasses", "DeviceClass", DRA_GROUP, generation=True),
    # evaluated on every write by apiserver_admission
    ResourceType(
        "validatingadmissionpolicies",
        "ValidatingAdmissionPolicy",
        "admissionregistration.k8s.io",
        status=True,
        generation=True,
    ),
    ResourceType(
        "validatingadmissionpolicybindings",
        "ValidatingAdmissionPolicyBinding",
        "admissionregistration.k8s.io",
        generation=True,
    ),
    ResourceType("configmaps", "ConfigMap", namespaced=True, short_names=("cm",)),
    ResourceType(
        "nodes",
        "Node",
        status=True,
        keep_status_on_create=True,
        short_names=("no",),
        fields=("metadata.name", "spec.unschedulable"),
    ),
    ResourceType(
        "namespaces",
        "Namespace",
        status=True,
        name_rule="label",
        short_names=("ns",),
        initial_status={"phase": "Active"},
        fields=("metadata.name", "status.phase"),
    ),
    ResourceType(
        "pods",
        "Pod",
        namespaced=True,
        status=True,
        short_names=("po",),
        subresources=(Subresource("eviction", "Eviction", "policy", "v1"),),
        fields=(
            "metadata.name",
            "metadata.namespace",
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.nominatedNodeName",
        ),
    ),
    ResourceType("leases", "Lease", "coordination.k8s.io", namespaced=True),
    ResourceType(
        "customresourcedefinitions",
        "CustomResourceDefinition",
        "apiextensions.k8s.io",
        status=True,
        generation=True,
        short_names=("crd", "crds"),
    ),
    ResourceType(
        "events",
        "Event",
        namespaced=True,
        short_names=("ev",),
        fields=(
            "metadata.name",
            "metadata.namespace",
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "reason",
            "reportingComponent",
            "source",
            "type",
        ),
        # Kubernetes pkg/registry/core/event/strategy.go ToSelectableFields: "source" is
        # source.component (reportingComponent where that is empty)
        field_paths=(("source", "source.component"),),
    ),
)


@dataclass(frozen=True)
class Route:
    """A request path resolved against the resource table."""

    rt: ResourceType
    namespace: str | None  # None: cluster-scoped, or a namespaced resource across namespaces
    name: str | None  # None: the collection
    subresource: str | None  # "status", another of the resource's subresources, or None
    watch_path: bool  # the legacy /watch/ URL form


class RouteError(Exception):
    """The path names nothing the emulator serves (404)."""


def resolve(types: Sequence[ResourceType], path: str) -> Route | None:
    """The resource route of ``path``, None when it is not a resource path.

    Raises :class:`RouteError` for a resource path that names no served resource.
    """
    segs = [s for s in path.split("/") if s]
    if len(segs) >= 2 and segs[0] == "api":
        group, version, rest = "", segs[1], segs[2:]
    elif len(segs) >= 3 and segs[0] == "apis":
        group, version, rest = segs[1], segs[2], segs[3:]
    else:
        return None
    served = {t.plural: t for t in types if t.group == group and t.version == version}
    if not served:
        raise RouteError(path)
    if not rest:
        return None  # the group-version discovery document
    watch_path = rest[0] == "watch"
    if watch_path:
        rest = rest[1:]
    namespace: str | None = None
    if (
        len(rest) >= 3
        and rest[0] == "namespaces"
        and rest[2] in served
        and served[rest[2]].namespaced
    ):
        namespace, rest = rest[1], rest[2:]
    if not rest or rest[0] not in served or len(rest) > 3:
        raise RouteError(path)
    rt = served[rest[0]]
    name = rest[1] if len(rest) > 1 else None
    sub = rest[2] if len(rest) > 2 else None
    if sub is not None and not (
        (sub == "status" and rt.status) or any(s.name == sub for s in rt.subresources)
    ):
        raise RouteError(path)
    if rt.namespaced and namespace is None and name is not None:
        raise RouteError(path)
    return Route(rt, namespace, name, sub, watch_path)


def resource_of(path: str) -> str | None:
    """The resource (plural) a request path is about, without consulting a table."""
    segs = [s for s in path.split("/") if s]
    if len(segs) >= 2 and segs[0] == "api":
        rest = segs[2:]
    elif len(segs) >= 3 and segs[0] == "apis":
        rest = segs[3:]
    else:
        return None
    if rest and rest[0] == "watch":
        rest = rest[1:]
    if len(rest) >= 3 and rest[0] == "namespaces":
        return rest[2]
    return rest[0] if rest else None


# ---------------------------------------------------------------------------- discovery documents


def _group_versions(types: Sequence[ResourceType]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for t in types:
        versions = out.setdefault(t.group, [])
        if t.version not in versions:
            versions.append(t.version)
    return out


def api_versions(types: Sequence[ResourceType], server_address: str) -> dict[str, Any]:
    """``GET /api``."""
    return {
        "kind": "APIVersions",
        "versions": _group_versions(types).get("", ["v1"]),
        "serverAddressByClientCIDRs": [
            {"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}
        ],
    }


def api_group(types: Sequence[ResourceType], group: str) -> dict[str, Any] | None:
    """``GET /apis/<group>``, None for an unknown group."""
    versions = _group_versions(types).get(group)
    if not versions or not group:
        return None
    gvs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
    return {
        "kind": "APIGroup",
        "apiVersion": "v1",
        "name": group,
        "versions": gvs,
        "preferredVersion": gvs[0],
    }


def api_group_list(types: Sequence[ResourceType]) -> dict[str, Any]:
    """``GET /apis``."""
    groups = [api_group(types, g) for g in _group_versions(types) if g]
    for g in groups:
        if g is not None:
            del g["kind"], g["apiVersion"]
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def api_resource_list(
    types: Sequence[ResourceType], group: str, version: str
) -> dict[str, Any] | None:
    """``GET /api/v1`` or ``GET /apis/<group>/<version>``, None when not served."""
    served = [t for t in types if t.group == group and t.version == version]
    if not served:
        return None
    resources: list[dict[str, Any]] = []
    for t in served:
        entry: dict[str, Any] = {
            "name": t.plural,
            "singularName": t.singular,
            "namespaced": t.namespaced,
            "kind": t.kind,
            "verbs": list(t.verbs),
        }
        if t.short_names:
            entry["shortNames"] = list(t.short_names)
        resources.append(entry)
        if t.status:
            resources.append(
                {
                    "name": f"{t.plural}/status",
                    "singularName": "",
                    "namespaced": t.namespaced,
                    "kind": t.kind,
                    "verbs": ["get", "patch", "update"],
                }
            )
        for sub in t.subresources:
            resources.append(
                {
                    "name": f"{t.plural}/{sub.name}",
                    "singularName": "",
                    "namespaced": t.namespaced,
                    "group": sub.group,
                    "version": sub.version,
                    "kind": sub.kind,
                    "verbs": list(sub.verbs),
                }
            )
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": resources,
    }


def major_minor(kube_version: str) -> tuple[int, int]:
    """``1.35.0`` -> ``(1, 35)``."""
    major, minor = kube_version.split(".")[:2]
    return int(major), int(minor)


def version_info(kube_version: str) -> dict[str, Any]:
    """``GET /version``, as k8s.io/apimachinery ``pkg/version`` ``Info`` has it since the
    compatibility versions (KEP-4330): the binary's major and minor, the emulated ones (the
    binary's own, without ``--emulated-version``) and the oldest it stays compatible with (the
    minor before)."""
    major, minor = kube_version.split(".")[:2]
    return {
        "major": major,
        "minor": minor,
        "emulationMajor": major,
        "emulationMinor": minor,
        "minCompatibilityMajor": major,
        "minCompatibilityMinor": str(max(int(minor) - 1, 0)),
        "gitVersion": f"v{kube_version}",
        "gitCommit": "0" * 40,
        "gitTreeState": "clean",
        "buildDate": "2025-01-01T00:00:00Z",
        "goVersion": "go1.24.0",
        "compiler": "gc",
        "platform": "linux/amd64",
    }
