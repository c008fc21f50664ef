"""Which requests a ValidatingAdmissionPolicy or its binding matches, as the real server decides.

The admission request (:class:`Attributes`) and the matching of ``matchConstraints`` /
``matchResources``: ``resourceRules`` and ``excludeResourceRules`` (API groups, versions,
operations, resources with ``*`` and ``resource/subresource``, ``resourceNames``, ``scope``),
``namespaceSelector`` and ``objectSelector`` (label selectors: ``matchLabels`` and
``matchExpressions``). Upstream: k8s.io/apiserver pkg/admission/plugin/policy/matching
(matching.go ``Matches``), pkg/admission/plugin/webhook/predicates/rules (rules.go: a rule's
resource ``pods/*`` also matches ``pods`` itself, ``*`` every resource but no subresource),
predicates/namespace (a cluster-scoped request other than a Namespace's always matches a
namespaceSelector) and predicates/object (the object or the old object must match).

``matchPolicy`` is read but changes nothing here: the emulator serves one version of each
resource, so ``Exact`` and ``Equivalent`` match the same requests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.sim.apiserver_types import ResourceType

Obj = dict[str, Any]


@dataclass(frozen=True)
class UserInfo:
    """Who sent a request: ``request.userInfo`` in CEL (``extra`` omitted when empty, as the
    real server leaves the field out)."""

    username: str
    groups: tuple[str, ...] = ("system:authenticated",)
    extra: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    uid: str = ""

    def cel(self) -> Obj:
        out: Obj = {"username": self.username, "groups": list(self.groups)}
        if self.uid:
            out["uid"] = self.uid
        if self.extra:
            out["extra"] = {k: list(v) for k, v in self.extra.items()}
        return out


@dataclass(frozen=True)
class Attributes:
    """One write as admission sees it: ``obj`` is None for a DELETE, ``old`` for a CREATE."""

    operation: str  # CREATE, UPDATE or DELETE
    rt: ResourceType
    namespace: str  # "" for a cluster-scoped resource
    name: str
    obj: Obj | None
    old: Obj | None
    user: UserInfo
    subresource: str = ""
    dry_run: bool = False

    def request(self) -> Obj:
        """The CEL ``request`` variable (admission.k8s.io/v1 AdmissionRequest's fields; the
        ``uid`` and ``options`` are left out)."""
        gvk = {"group": self.rt.group, "version": self.rt.version, "kind": self.rt.kind}
        gvr = {"group": self.rt.group, "version": self.rt.version, "resource": self.rt.plural}
        out: Obj = {
            "kind": gvk,
            "resource": gvr,
            "requestKind": gvk,
            "requestResource": gvr,
            "name": self.name,
            "namespace": self.namespace,
            "operation": self.operation,
            "userInfo": self.user.cel(),
            "dryRun": self.dry_run,
        }
        if self.subresource:
            out["subResource"] = out["requestSubResource"] = self.subresource
        return out


def labels_match(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A metav1.LabelSelector against ``labels``: every ``matchLabels`` pair and every
    ``matchExpressions`` term (In, NotIn, Exists, DoesNotExist) must hold; an empty or absent
    selector matches everything (LabelSelectorAsSelector)."""
    if not selector:
        return True
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for term in selector.get("matchExpressions") or []:
        key, op, values = term["key"], term["operator"], set(term.get("values") or [])
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
    return True


def _labels(obj: Obj | None) -> Mapping[str, str] | None:
    if obj is None:
        return None
    found = (obj.get("metadata") or {}).get("labels") or {}
    return dict(found)


def _rule_matches(rule: Mapping[str, Any], attrs: Attributes) -> bool:
    rt = attrs.rt

    def has(key: str, value: str) -> bool:
        listed = rule.get(key) or []
        return "*" in listed or value in listed

    if not (
        has("apiGroups", rt.group)
        and has("apiVersions", rt.version)
        and has("operations", attrs.operation)
    ):
        return False
    scope = rule.get("scope") or "*"
    if (scope == "Cluster" and rt.namespaced) or (scope == "Namespaced" and not rt.namespaced):
        return False
    names = rule.get("resourceNames") or []
    if names and attrs.name not in names:
        return False
    for entry in rule.get("resources") or []:
        resource, _, sub = str(entry).partition("/")
        if resource in ("*", rt.plural) and sub in ("*", attrs.subresource):
            return True
    return False


def _any_rule(rules: Sequence[Mapping[str, Any]], attrs: Attributes) -> bool:
    return any(_rule_matches(r, attrs) for r in rules)


def matches(criteria: Mapping[str, Any] | None, attrs: Attributes, namespace: Obj | None) -> bool:
    """Whether a policy's ``matchConstraints`` or a binding's ``matchResources`` matches the
    request; ``namespace`` is the request's Namespace object (None for a cluster-scoped
    request). No resourceRules (a binding's) constrain nothing."""
    criteria = criteria or {}
    ns_selector = criteria.get("namespaceSelector")
    if ns_selector:
        if attrs.rt.plural == "namespaces":
            ns_labels = _labels(attrs.obj if attrs.obj is not None else attrs.old) or {}
        elif attrs.rt.namespaced:
            ns_labels = _labels(namespace) or {}
        else:
            ns_labels = None  # a cluster-scoped request is never exempted
        if ns_labels is not None and not labels_match(ns_selector, ns_labels):
            return False
    obj_selector = criteria.get("objectSelector")
    if obj_selector:
        candidates = [_labels(attrs.obj), _labels(attrs.old)]
        if not any(c is not None and labels_match(obj_selector, c) for c in candidates):
            return False
    if _any_rule(criteria.get("excludeResourceRules") or [], attrs):
        return False
    rules = criteria.get("resourceRules") or []
    return not rules or _any_rule(rules, attrs)
