"""ResourceClaims as the driver needs them: who a claim is and what its allocation says.

A claim is untrusted input (the API server, or a file someone wrote in standalone mode), so it is
decoded at this boundary into typed values: ``parse_allocation`` checks the claim object against
what the kubelet asked for (UID, allocated, node) and extracts this driver's results and opaque
configs; anything of the wrong shape is a ``ClaimError`` naming the field path (``status.
allocation.devices.results[0].request: missing``), never another exception. It is pure.

Where the claim object is read from (the API server, or claim files in standalone mode) is
``claim_sources.py``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.decode import fields
from dra_driver.errors import ClaimError, QuantityError
from dra_driver.quantity import parse_bytes

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
CLAIM_UID = DNS_LABEL
"""What a claim UID may be: it names the claim's CDI spec file and MPS directory, which accept a
lower-case DNS label (a Kubernetes UID, a UUID, is one)."""
SHOWN_CHARS = 60
"""Of a value put in an error message, at most this many characters are shown."""


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``value`` as Python writes it (quoted, control characters escaped), a long string cut to
    ``limit`` characters with its length: an untrusted value in a message stays one short,
    printable line."""
    text = repr(value)
    if len(text) <= limit + 2:
        return text
    if isinstance(value, str):  # cut the string, not its repr: the quotes stay closed
        n = min(len(value), limit)
        while n > 0 and len(repr(value[:n])) > limit + 2:  # escapes take 2 to 10 characters
            n -= 1
        return f"{value[:n]!r}... ({len(value)} characters)"
    return f"{text[:limit]}... ({len(text)} characters)"


@dataclass(frozen=True)
class ClaimKey:
    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


def check_claim_names(namespace: str, name: str) -> None:
    """Raise ClaimError unless ``namespace`` is a DNS label and ``name`` a DNS subdomain, as
    Kubernetes requires (so neither can change the URL or path it is put into)."""
    if not DNS_LABEL.fullmatch(namespace):
        raise ClaimError(
            f"claim namespace {namespace[:100]!r} is not a DNS label (at most 63 of a-z, 0-9"
            " and '-', starting and ending alphanumeric)",
            "invalid_claim",
        )
    if len(name) > 253 or not DNS_SUBDOMAIN.fullmatch(name):
        raise ClaimError(
            f"claim name {name[:100]!r} is not a DNS subdomain (at most 253 of a-z, 0-9, '-'"
            " and '.')",
            "invalid_claim",
        )


@dataclass(frozen=True)
class AllocatedDevice:
    request: str
    """``<request>`` or ``<request>/<subrequest>``."""
    driver: str
    pool: str
    device: str
    admin_access: bool = False
    share_id: str | None = None
    consumed_memory: int | None = None
    """Bytes of the device's ``memory`` capacity this allocation consumed (consumable capacity:
    a memory share), from ``consumedCapacity``."""
    device_class: str = ""
    """The DeviceClass its request (or subrequest) names in ``spec.devices.requests``; "" when
    the claim does not say (what the usage record is keyed by, with the product)."""


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
    pods: tuple[str, ...] = ()
    """UIDs of the pods the claim is reserved for (``status.reservedFor``)."""


def check_claim_key(key: ClaimKey, where: str, *, names: bool = True) -> None:
    """Raise ClaimError (``invalid_claim``) unless ``key``, as the kubelet sent it, names a claim
    Kubernetes could have: the UID a lower-case DNS label (it becomes a file name), and with
    ``names`` the namespace a DNS label and the name a DNS subdomain. ``where`` is the claim's
    place in the request (``claims[3]``); the message names the field and shows the value."""
    problems = []
    if not CLAIM_UID.fullmatch(key.uid):
        problems.append(
            f"{where}.uid: {shown(key.uid)} is not a claim UID (a lower-case DNS label: at most 63"
            " of a-z, 0-9 and '-', starting and ending alphanumeric)"
        )
    if names and not DNS_LABEL.fullmatch(key.namespace):
        problems.append(
            f"{where}.namespace: {shown(key.namespace)} is not a DNS label (at most 63 of a-z, 0-9"
            " and '-', starting and ending alphanumeric)"
        )
    if names and (len(key.name) > 253 or not DNS_SUBDOMAIN.fullmatch(key.name)):
        problems.append(
            f"{where}.name: {shown(key.name)} is not a DNS subdomain (at most 253 of a-z, 0-9, '-'"
            " and '.')"
        )
    if problems:
        raise ClaimError("; ".join(problems), "invalid_claim")


def _opt_obj(value: Any, path: str) -> Mapping[str, Any] | None:
    return None if value is None else fields.obj(value, path)


def _node_allowed(selector: Mapping[str, Any] | None, node: str) -> bool:
    """Whether an allocation's nodeSelector admits ``node`` (only the terms the scheduler writes
    for node-local pools are understood: matchFields on metadata.name)."""
    if selector is None:
        return True
    path = "status.allocation.nodeSelector"
    terms = fields.objects(selector.get("nodeSelectorTerms"), f"{path}.nodeSelectorTerms")
    if not terms:
        return True
    for i, term in enumerate(terms):
        tp = f"{path}.nodeSelectorTerms[{i}]"
        found = fields.objects(term.get("matchFields"), f"{tp}.matchFields")
        for j, f in enumerate(found):
            fp = f"{tp}.matchFields[{j}]"
            if (
                fields.text(f.get("key"), f"{fp}.key") == "metadata.name"
                and fields.text(f.get("operator"), f"{fp}.operator") == "In"
                and node in fields.texts(f.get("values"), f"{fp}.values")
            ):
                return True
        if not found and not fields.objects(term.get("matchExpressions"), f"{tp}.matchExpressions"):
            return True
    return False


def parse_allocation(obj: Any, key: ClaimKey, driver: str, node: str) -> Allocation:
    """Check the claim against the kubelet's request and pick this driver's part. Pure; every
    problem is a ClaimError (reasons ``uid_mismatch``, ``not_allocated``, ``other_node``,
    ``invalid_claim`` with the field path, read with :mod:`agent.decode.fields`; unknown fields
    are ignored: the API server has checked the claim, and a newer one may add fields)."""
    try:
        return _allocation(obj, key, driver, node)
    except fields.FieldError as exc:
        raise ClaimError(f"claim {key}: {exc}", "invalid_claim") from exc


def _allocation(obj: Any, key: ClaimKey, driver: str, node: str) -> Allocation:
    claim = fields.obj(obj, "")
    meta = _opt_obj(claim.get("metadata"), "metadata") or {}
    uid = meta.get("uid")
    if uid != key.uid:
        raise ClaimError(
            f"claim {key.namespace}/{key.name} has UID {shown(uid)}, the kubelet asked for"
            f" {key.uid!r} (the claim was deleted and re-created?)",
            reason="uid_mismatch",
        )
    status = _opt_obj(claim.get("status"), "status")
    allocation = _opt_obj(status.get("allocation"), "status.allocation") if status else None
    if not allocation:
        raise ClaimError(
            f"claim {key} is not allocated (status.allocation is empty)", reason="not_allocated"
        )
    selector = _opt_obj(allocation.get("nodeSelector"), "status.allocation.nodeSelector")
    if not _node_allowed(selector, node):
        raise ClaimError(
            f"claim {key} is allocated to another node (status.allocation.nodeSelector), not"
            f" {node!r}",
            reason="other_node",
        )
    dp = "status.allocation.devices"
    devices = _opt_obj(allocation.get("devices"), dp) or {}
    classes = device_classes(claim)
    results = []
    for i, r in enumerate(fields.objects(devices.get("results"), f"{dp}.results")):
        rp = f"{dp}.results[{i}]"
        if fields.text(r.get("driver"), f"{rp}.driver") != driver:
            continue
        pool = fields.text(r.get("pool"), f"{rp}.pool")
        name = fields.text(r.get("device"), f"{rp}.device")
        if pool != node:
            raise ClaimError(
                f"claim {key}: {rp}: device {shown(name)} is allocated from pool"
                f" {shown(pool)}, which is another node's (this node is {node!r})",
                reason="other_node",
            )
        results.append(
            AllocatedDevice(
                request=fields.text(r.get("request"), f"{rp}.request"),
                driver=driver,
                pool=pool,
                device=name,
                admin_access=fields.flag(
                    r.get("adminAccess", False), f"{rp}.adminAccess", default=None
                ),
                share_id=fields.opt_text(r.get("shareID"), f"{rp}.shareID"),
                consumed_memory=_consumed_memory(r, rp),
                device_class=classes.get(fields.text(r.get("request"), f"{rp}.request"), ""),
            )
        )
    configs = []
    for i, c in enumerate(fields.objects(devices.get("config"), f"{dp}.config")):
        cp = f"{dp}.config[{i}]"
        opaque = _opt_obj(c.get("opaque"), f"{cp}.opaque")
        if opaque is None or fields.text(opaque.get("driver"), f"{cp}.opaque.driver") != driver:
            continue
        configs.append(
            OpaqueConfig(
                source=fields.opt_text(c.get("source"), f"{cp}.source") or "FromClaim",
                requests=fields.texts(c.get("requests"), f"{cp}.requests"),
                parameters=opaque.get("parameters"),
            )
        )
    # class configs first, then claim configs; within each, later entries win (stable sort)
    configs.sort(key=lambda c: 0 if c.source == "FromClass" else 1)
    pods = (
        tuple(
            fields.text(ref.get("uid"), f"status.reservedFor[{i}].uid")
            for i, ref in enumerate(fields.objects(status.get("reservedFor"), "status.reservedFor"))
            if ref.get("resource") == "pods" and ref.get("uid") is not None
        )
        if status is not None
        else ()
    )
    return Allocation(claim=key, devices=tuple(results), configs=tuple(configs), pods=pods)


def device_classes(claim: Mapping[str, Any]) -> dict[str, str]:
    """Request name (``req``, or ``req/sub`` for a ``firstAvailable`` subrequest) -> the
    DeviceClass it names, from ``spec.devices.requests`` (resource.k8s.io/v1: ``exactly.
    deviceClassName``, or each ``firstAvailable[].deviceClassName``). Lenient: a request that
    does not say is left out (the API server validated the spec; this only labels usage)."""
    out: dict[str, str] = {}
    spec = claim.get("spec")
    devices = spec.get("devices") if isinstance(spec, Mapping) else None
    requests = devices.get("requests") if isinstance(devices, Mapping) else None
    for r in requests if isinstance(requests, list) else ():
        name = r.get("name") if isinstance(r, Mapping) else None
        if not isinstance(name, str):
            continue
        exactly = r.get("exactly")
        if isinstance(exactly, Mapping) and isinstance(exactly.get("deviceClassName"), str):
            out[name] = exactly["deviceClassName"]
        for sub in r.get("firstAvailable") or ():
            if isinstance(sub, Mapping) and isinstance(sub.get("name"), str):
                cls = sub.get("deviceClassName")
                if isinstance(cls, str):
                    out[f"{name}/{sub['name']}"] = cls
    return out


def _consumed_memory(result: Mapping[str, Any], path: str) -> int | None:
    consumed = _opt_obj(result.get("consumedCapacity"), f"{path}.consumedCapacity")
    text = consumed.get("memory") if consumed is not None else None
    if text is None:
        return None
    where = f"{path}.consumedCapacity.memory"
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text
    if not isinstance(text, str):
        raise fields.expected("a quantity", text, where)
    try:
        value = parse_bytes(text)
    except QuantityError as exc:
        raise fields.FieldError(where, str(exc)) from exc
    if value < 0:
        raise fields.FieldError(where, f"{shown(text)} is negative")
    return value


def configs_for(allocation: Allocation, request: str) -> list[OpaqueConfig]:
    """The configs that apply to one request, lowest precedence first. A config naming
    ``req`` applies to ``req`` and to its subrequests ``req/x``."""
    parent = request.split("/", 1)[0]
    return [
        c
        for c in allocation.configs
        if not c.requests or request in c.requests or parent in c.requests
    ]
