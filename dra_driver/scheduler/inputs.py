"""What ``tessera explain`` is given, turned into what the allocator takes. Pure: no I/O.

- :func:`parse_documents`: the documents of one file (multi-document YAML or JSON; ``List``
  objects are unpacked), each remembered with its file and index so that an error can say
  ``claim.yaml: document 2: spec.devices: ...``.
- :func:`subjects`: the claims to explain in a CLAIM file: ResourceClaims, the claim specs of
  ResourceClaimTemplates, or the claims a Pod (or a workload's pod template) references, found in
  the same file (or, in cluster mode, through a ``lookup``).

Which slices a node sees, and the nodeSelector an allocation gets: ``node_reach``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.decode import fields, load_json, load_yaml_documents
from agent.errors import DecodeError
from dra_driver.scheduler.allocated import parse_allocated
from dra_driver.scheduler.pools import QuantityReader

RESOURCE_API = "resource.k8s.io/v1"
MAX_FILE_CHARS = 256 * 1024 * 1024
"""The largest file read: a person's own files (a dump of a 64-node cluster's slices, 13,000
devices, is about 15 MB of YAML)."""
MAX_YAML_EVENTS = 50_000_000
"""YAML parser events allowed in one file (that dump: about 1.5 million); aliases stay refused."""
WORKLOADS = {
    # kind -> path of the pod template, as in the apps/v1 and batch/v1 APIs
    "Deployment": ("spec", "template"),
    "StatefulSet": ("spec", "template"),
    "ReplicaSet": ("spec", "template"),
    "DaemonSet": ("spec", "template"),
    "Job": ("spec", "template"),
    "CronJob": ("spec", "jobTemplate", "spec", "template"),
}


class DocumentError(ValueError):
    """Malformed input: which file, which document (0-based, as in the stream), which field,
    what is wrong. ``str()`` is the whole message."""

    def __init__(self, source: str, index: int | None, path: str, message: str) -> None:
        self.source, self.index, self.path, self.message = source, index, path, message
        where = source if index is None else f"{source}: document {index}"
        super().__init__(f"{where}: {path}: {message}" if path else f"{where}: {message}")


@dataclass(frozen=True)
class Document:
    """One object of an input file. ``item``: its index in a List object's ``items``."""

    source: str
    index: int
    obj: dict[str, Any]
    item: int | None = None

    @property
    def kind(self) -> str:
        return str(self.obj.get("kind", ""))

    def field(self, path: str) -> str:
        """A field path of this object as an error names it (inside a List: ``items[3].``)."""
        prefix = "" if self.item is None else f"items[{self.item}]"
        return ".".join(p for p in (prefix, path) if p)

    def error(self, path: str, message: str) -> DocumentError:
        return DocumentError(self.source, self.index, self.field(path), message)

    @property
    def name(self) -> str:
        meta = self.obj.get("metadata")
        name = meta.get("name") if isinstance(meta, dict) else None
        if not isinstance(name, str) or not name:
            raise self.error("metadata.name", "missing; every object needs a name")
        return name

    @property
    def namespace(self) -> str:
        meta = self.obj.get("metadata")
        ns = meta.get("namespace") if isinstance(meta, dict) else None
        return ns if isinstance(ns, str) and ns else "default"


def parse_documents(text: str, source: str) -> list[Document]:
    """Every object in ``text`` (YAML, multi-document, or JSON). Empty documents are skipped; a
    document that is not an object, or has no kind, is a DocumentError."""
    try:
        if text.lstrip().startswith(("{", "[")):  # JSON: its own parser, 10x faster than YAML's
            value = load_json(text, source, MAX_FILE_CHARS)
            raw = value if isinstance(value, list) else [value]
        else:
            raw = load_yaml_documents(text, source, MAX_FILE_CHARS, MAX_YAML_EVENTS)
    except DecodeError as exc:
        raise DocumentError(source, None, "", str(exc).removeprefix(f"{source}: ")) from exc
    docs: list[Document] = []
    for index, obj in enumerate(raw):
        if obj is None:
            continue
        if not isinstance(obj, dict):
            raise DocumentError(source, index, "", f"{fields.kind_of(obj)}, not an object")
        kind = obj.get("kind")
        if not isinstance(kind, str) or not kind:
            raise DocumentError(source, index, "kind", "missing; expected e.g. ResourceClaim")
        if kind.endswith("List") and "items" in obj:
            items = obj["items"]
            if not isinstance(items, list):
                raise DocumentError(source, index, "items", f"{fields.kind_of(items)}, not a list")
            for i, item in enumerate(items):
                if not isinstance(item, dict):
                    raise DocumentError(source, index, f"items[{i}]", "not an object")
                item = dict(item)
                item.setdefault("kind", kind.removesuffix("List"))  # kubectl's lists have kinds
                if "apiVersion" not in item and "apiVersion" in obj:
                    item["apiVersion"] = obj["apiVersion"]
                docs.append(Document(source, index, item, i))
            continue
        docs.append(Document(source, index, obj))
    return docs


def _dict(value: Any) -> dict[str, Any]:
    """``value`` when it is an object, else an empty one (for optional fields)."""
    return value if isinstance(value, dict) else {}


def check_api(doc: Document, expected: str = RESOURCE_API) -> None:
    """resource.k8s.io objects must be v1 (the version the allocator reads)."""
    version = doc.obj.get("apiVersion")
    if version != expected:
        raise doc.error(
            "apiVersion",
            f"{version!r} is not supported; {doc.kind} must be {expected}"
            + (" (Kubernetes 1.34 or newer)" if expected == RESOURCE_API else ""),
        )


def _object(doc: Document, path: Sequence[str]) -> dict[str, Any]:
    value: Any = doc.obj
    for i, key in enumerate(path):
        value = value.get(key) if isinstance(value, dict) else None
        if not isinstance(value, dict):
            shown = ".".join(path[: i + 1])
            what = "missing" if value is None else f"{fields.kind_of(value)}, not an object"
            raise doc.error(shown, what)
    return _dict(value)


def of_kind(docs: Iterable[Document], kind: str) -> list[Document]:
    """The documents of one kind, their apiVersion checked for the resource.k8s.io kinds."""
    found = [d for d in docs if d.kind == kind]
    for d in found:
        if kind in ("ResourceClaim", "ResourceClaimTemplate", "DeviceClass", "ResourceSlice"):
            check_api(d)
    return found


def only_kinds(docs: Iterable[Document], allowed: Sequence[str], role: str) -> None:
    """Each document is one of ``allowed`` (e.g. a --slices file holds ResourceSlices)."""
    for d in docs:
        if d.kind not in allowed:
            raise d.error("kind", f"{d.kind!r} does not belong in {role}; expected {_or(allowed)}")


def _or(words: Sequence[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def allocated_claims(docs: Iterable[Document]) -> list[dict[str, Any]]:
    """ResourceClaims given as already allocated, each with ``status.allocation``, read by the
    allocator's reader now: a malformed one is an error of its own file and field before the
    grouping of nodes reads it (the allocator's error would name the claim explained)."""
    claims = []
    for d in of_kind(docs, "ResourceClaim"):
        _object(d, ("status", "allocation"))
        try:
            parse_allocated([d.obj], (), QuantityReader())
        except fields.FieldError as exc:  # its path without "claim NS/NAME: " or "allocated[0]."
            raise d.error(_ALLOCATED_PREFIX.sub("", exc.path), exc.message) from None
        claims.append(d.obj)
    return claims


_ALLOCATED_PREFIX = re.compile(r"^(allocated\[0\]\.|claim [^:]*: )")


# -- the claims to explain ----------------------------------------------------------------------


@dataclass(frozen=True)
class Subject:
    """One claim to explain. ``doc``: the ResourceClaim document it is (None: made from a
    template, or read from the API); ``via``: how a pod reaches it (for people)."""

    key: str
    """``namespace/name``."""
    claim: dict[str, Any]
    doc: Document | None = None
    via: str | None = None
    source: str = ""
    """Where it came from: ``FILE: document N`` or ``API``."""
    pod: str | None = None
    """The pod (``pod NS/NAME``, ``job NS/NAME``, ...) it is allocated with; None: no pod's."""


Lookup = Callable[[str, str, str], dict[str, Any] | None]
"""(kind, namespace, name) -> the object from the API server, None when there is none."""


def claim_from_template(template: Mapping[str, Any], name: str, namespace: str) -> dict[str, Any]:
    """The ResourceClaim the resource-claim controller would create from a template: the
    template's ``spec.spec``, labels and annotations of ``spec.metadata``."""
    spec = template.get("spec", {})
    meta = spec.get("metadata") if isinstance(spec.get("metadata"), dict) else {}
    claim_meta: dict[str, Any] = {"name": name, "namespace": namespace}
    for key in ("labels", "annotations"):
        if isinstance(meta.get(key), dict):
            claim_meta[key] = dict(meta[key])
    return {
        "apiVersion": RESOURCE_API,
        "kind": "ResourceClaim",
        "metadata": claim_meta,
        "spec": spec.get("spec"),
    }


@dataclass
class _Found:
    claims: dict[tuple[str, str], Document] = field(default_factory=dict)
    templates: dict[tuple[str, str], Document] = field(default_factory=dict)


def subjects(docs: Sequence[Document], lookup: Lookup | None = None) -> list[Subject]:
    """The claims to explain, in order; they are placed together on one node (a pod's claims
    allocated together: ``Subject.pod``).

    With Pods (or Deployments, Jobs, ...: their pod template counts as one pod) in the file: the
    claims they reference, each once (pods sharing a ``resourceClaimName`` share the claim; a
    ``resourceClaimTemplateName`` gives each pod a claim of its own, named ``<pod>-<claim>``),
    then the file's ResourceClaims no pod references. Without pods: every ResourceClaim and
    ResourceClaimTemplate of the file. A reference the file does not hold is looked up with
    ``lookup`` (cluster mode), else it is a DocumentError."""
    found = _Found()
    for d in of_kind(docs, "ResourceClaim"):
        _object(d, ("spec",))
        found.claims.setdefault((d.namespace, d.name), d)
    for d in of_kind(docs, "ResourceClaimTemplate"):
        _object(d, ("spec", "spec"))
        found.templates.setdefault((d.namespace, d.name), d)
    pods = [(d, found_spec) for d in docs if (found_spec := _pod_spec(d)) is not None]
    out: list[Subject] = []
    seen: set[str] = set()
    if not pods:
        for (ns, name), d in found.claims.items():
            out.append(Subject(f"{ns}/{name}", d.obj, d, None, _where(d)))
        for (ns, name), d in found.templates.items():
            claim = claim_from_template(d.obj, name, ns)
            out.append(Subject(f"{ns}/{name}", claim, None, f"template {name}", _where(d)))
        return out
    for pod, (spec, path) in pods:
        for s in _pod_claims(pod, spec, path, found, lookup):
            if s.key not in seen:
                seen.add(s.key)
                out.append(s)
    for (ns, name), d in found.claims.items():
        if f"{ns}/{name}" not in seen:
            out.append(Subject(f"{ns}/{name}", d.obj, d, None, _where(d)))
    return out


def _where(d: Document) -> str:
    return f"{d.source}: document {d.index}"


def _pod_spec(d: Document) -> tuple[dict[str, Any], str] | None:
    """A Pod's spec, or a workload's pod template spec, with its field path."""
    if d.kind == "Pod":
        return _object(d, ("spec",)), "spec"
    path = WORKLOADS.get(d.kind)
    if path is None:
        return None
    return _object(d, (*path, "spec")), ".".join((*path, "spec"))


def _pod_claims(
    pod: Document, spec: dict[str, Any], path: str, found: _Found, lookup: Lookup | None
) -> list[Subject]:
    refs = spec.get("resourceClaims") or []
    if not isinstance(refs, list):
        raise pod.error(f"{path}.resourceClaims", f"{fields.kind_of(refs)}, not a list")
    ns = pod.namespace
    who = f"{pod.kind.lower()} {ns}/{pod.name}"
    out = []
    for i, ref in enumerate(refs):
        at = f"{path}.resourceClaims[{i}]"
        if not isinstance(ref, dict) or not isinstance(ref.get("name"), str):
            raise pod.error(f"{at}.name", "missing; each pod claim has a name")
        claim_name, template_name = (
            ref.get("resourceClaimName"),
            ref.get("resourceClaimTemplateName"),
        )
        if (claim_name is None) == (template_name is None):
            raise pod.error(at, "needs exactly one of resourceClaimName, resourceClaimTemplateName")
        if claim_name is not None:
            d = found.claims.get((ns, str(claim_name)))
            key = f"{ns}/{claim_name}"
            if d is not None:
                via = f"{who}, claim {ref['name']}"
                out.append(Subject(key, d.obj, d, via, _where(d), who))
                continue
            obj = lookup("ResourceClaim", ns, str(claim_name)) if lookup else None
            if obj is None:
                raise pod.error(
                    f"{at}.resourceClaimName",
                    f"ResourceClaim {key} is not in {pod.source}"
                    + (" nor in the API server" if lookup else " (add it to the file)"),
                )
            out.append(Subject(key, obj, None, f"{who}, claim {ref['name']}", "API", who))
            continue
        t = found.templates.get((ns, str(template_name)))
        template = t.obj if t is not None else None
        if template is None and lookup is not None:
            template = lookup("ResourceClaimTemplate", ns, str(template_name))
        if template is None:
            raise pod.error(
                f"{at}.resourceClaimTemplateName",
                f"ResourceClaimTemplate {ns}/{template_name} is not in {pod.source}"
                + (" nor in the API server" if lookup else " (add it to the file)"),
            )
        name = f"{pod.name}-{ref['name']}"
        claim = claim_from_template(template, name, ns)
        via = f"{who}, claim {ref['name']} from template {template_name}"
        out.append(Subject(f"{ns}/{name}", claim, None, via, _where(t) if t else "API", who))
    return out
