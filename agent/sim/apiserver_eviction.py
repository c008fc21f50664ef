"""The Eviction subresource of Pods (``POST /api/v1/namespaces/{ns}/pods/{name}/eviction``), as
the real server answers it (kubernetes pkg/registry/core/pod/storage/eviction.go):

* the body is a ``policy/v1`` (or ``v1beta1``) ``Eviction``, checked against the upstream schema
  like every write (422); its ``metadata.name`` must be the pod's (400 ``name in URL does not
  match name in Eviction object``) and its namespace the URL's (400);
* a missing pod is 404; ``deleteOptions.preconditions`` (uid, resourceVersion) that do not hold
  are 409;
* the pod is then deleted gracefully, as the pod strategy deletes it (:func:`terminate`): grace
  ``deleteOptions.gracePeriodSeconds``, else the pod's ``terminationGracePeriodSeconds``, else
  30; an unscheduled, Succeeded or Failed pod goes at once; a pod already terminating is
  deleted again without a PDB check (``canIgnorePDB``), which keeps its grace when shorter. The
  answer is 201 with a ``Status`` Success.

PodDisruptionBudgets are not modelled (the emulator serves none): every eviction is allowed. A
test that needs the 429 a PDB causes arms a fault (``faults.add("POST", r"/eviction$",
"429")``). Every eviction answered is recorded in an :class:`EvictionLog`.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from agent.sim import apiserver_errors as err
from agent.sim.apiserver_store import Obj, Store
from agent.sim.apiserver_types import ResourceType

EVICTION = ResourceType("evictions", "Eviction", "policy", namespaced=True)
DEFAULT_GRACE = 30  # corev1.DefaultTerminationGracePeriodSeconds


@dataclass(frozen=True)
class EvictionRecord:
    """One eviction the server granted: the pod, the grace it got (0: deleted at once), whether
    the pod was already terminating, and the Eviction body as sent."""

    namespace: str
    pod: str
    grace: int
    already_terminating: bool
    body: Obj


class EvictionLog:
    """Thread-safe record of the evictions granted, oldest first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[EvictionRecord] = []

    def append(self, record: EvictionRecord) -> None:
        with self._lock:
            self._records.append(record)

    def snapshot(self) -> list[EvictionRecord]:
        with self._lock:
            return list(self._records)


def _body(namespace: str, name: str, body: Any) -> Obj:
    if not isinstance(body, dict):
        raise err.bad_request("the body of the request must be a JSON object")
    if body.get("apiVersion") not in ("policy/v1", "policy/v1beta1") or body.get("kind") != (
        "Eviction"
    ):
        raise err.bad_request(
            f"the body must be a policy/v1 Eviction, not {body.get('apiVersion')!r}"
            f" {body.get('kind')!r}"
        )
    obj = copy.deepcopy(body)
    meta = obj.setdefault("metadata", {})
    if not isinstance(meta, dict):
        raise err.bad_request("metadata must be a JSON object")
    if meta.get("namespace") not in (None, "", namespace):
        raise err.bad_request(
            "the namespace of the provided object does not match the namespace sent on the request"
        )
    if meta.get("name") not in (None, "", name):
        raise err.bad_request("name in URL does not match name in Eviction object")
    meta.setdefault("name", name)
    meta["namespace"] = namespace
    return obj


def terminate(pod: Obj, grace: int, now: datetime) -> Obj | None:
    """The pod strategy's graceful deletion (pkg/registry/core/pod/strategy.go
    CheckGracefulDelete, and apiserver's BeforeDelete): grace 0, a pod bound to no node, or
    one Succeeded or Failed goes at once (None); else it gets ``deletionTimestamp`` = now +
    grace and ``deletionGracePeriodSeconds`` = grace, and stays until deleted with grace 0
    (the kubelet's delete once its containers stopped). A second graceful delete only ever
    shortens the grace."""
    phase = (pod.get("status") or {}).get("phase")
    if grace <= 0 or not (pod.get("spec") or {}).get("nodeName"):
        return None
    if phase in ("Succeeded", "Failed"):
        return None
    meta = pod["metadata"]
    if meta.get("deletionTimestamp") and meta.get("deletionGracePeriodSeconds", 0) <= grace:
        return pod
    at = now + timedelta(seconds=grace)
    meta["deletionTimestamp"] = at.strftime("%Y-%m-%dT%H:%M:%SZ")
    meta["deletionGracePeriodSeconds"] = grace
    return pod


def evict(
    store: Store, pods: ResourceType, log: EvictionLog, namespace: str, name: str, body: Any
) -> Obj:
    """Grant the eviction of pod ``namespace/name`` (see the module's doc); the answer body."""
    obj = _body(namespace, name, body)
    store.check_body(EVICTION, {**obj, "apiVersion": "policy/v1"})
    store.admit("CREATE", pods, {**obj, "apiVersion": "policy/v1"}, "eviction")
    options = obj.get("deleteOptions") or {}
    pod = store.get(pods, namespace, name)
    meta = pod["metadata"]
    for field in ("uid", "resourceVersion"):
        want = (options.get("preconditions") or {}).get(field)
        if want and want != meta.get(field):
            label = "UID" if field == "uid" else "ResourceVersion"
            raise err.conflict(
                pods,
                name,
                f"Precondition failed: {label} in precondition: {want}, {label} in object meta:"
                f" {meta.get(field)}",
            )
    asked = options.get("gracePeriodSeconds")
    if asked is None:
        asked = (pod.get("spec") or {}).get("terminationGracePeriodSeconds", DEFAULT_GRACE)
    grace = int(asked)
    terminating = bool(meta.get("deletionTimestamp"))
    now = store.clock()
    gone, after = store.rewrite(pods, namespace, name, lambda p: terminate(p, grace, now))
    kept = 0 if gone else int(after["metadata"].get("deletionGracePeriodSeconds", 0))
    log.append(EvictionRecord(namespace, name, kept, terminating, obj))
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
