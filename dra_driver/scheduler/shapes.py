"""The fields of the objects ``tessera explain`` reads from files, as resource.k8s.io/v1 defines
them, so that a misspelt field is refused as the API server would refuse it.

The API server decodes strictly: ``selector:`` for ``selectors:`` in a claim is answered
``strict decoding error: unknown field "spec.devices.requests[0].exactly.selector"``
(k8s.io/apimachinery ``pkg/runtime/serializer/json``, the strict decoding of ``kubectl apply``
and of every create/update; e.g. datainfrahq/druid-operator#50). ``explain`` must not answer
"fits" for a file the API server would not take, so :func:`unknown_field` finds the first such
field, using :func:`agent.decode.fields.first_unknown` and the shapes below, and
:func:`check_known_fields` refuses a file that has one.

Shapes follow k8s.io/api ``resource/v1/types.go`` (ResourceClaim, ResourceClaimSpec,
DeviceClaim, DeviceRequest, ExactDeviceRequest, DeviceSubRequest, DeviceSelector,
DeviceToleration, CapacityRequirements, DeviceConstraint, DeviceClaimConfiguration,
ResourceClaimStatus, AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult,
AllocatedDeviceStatus, ResourceClaimTemplate, DeviceClass, ResourceSlice, Device, CounterSet,
DeviceCapacity, CapacityRequestPolicy, DeviceTaint), ``core/v1/types.go`` for NodeSelector and a
Pod's claim references (PodResourceClaim, ResourceClaim in ResourceRequirements.claims; the
rest of a Pod is not explain's business) and ``apimachinery/pkg/apis/meta/v1/types.go`` for
ObjectMeta (``metadata`` may carry any of its fields; labels, annotations and the like are not
looked into). Values that are free-form (opaque parameters, conditions) are not looked into.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from agent.decode.fields import Shape, UnknownField, first_unknown
from dra_driver.scheduler.inputs import RESOURCE_API, WORKLOADS, Document, DocumentError

ANY = None
"""A value of any shape, not looked into."""

OBJECT_META = Shape(
    dict.fromkeys(
        (
            "name",
            "generateName",
            "namespace",
            "selfLink",
            "uid",
            "resourceVersion",
            "generation",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "labels",
            "annotations",
            "ownerReferences",
            "finalizers",
            "managedFields",
        ),
        ANY,
    )
)
NODE_SELECTOR_REQUIREMENT = Shape({"key": ANY, "operator": ANY, "values": ANY})
NODE_SELECTOR = Shape(
    {
        "nodeSelectorTerms": Shape(
            {
                "matchExpressions": NODE_SELECTOR_REQUIREMENT,
                "matchFields": NODE_SELECTOR_REQUIREMENT,
            }
        )
    }
)
DEVICE_SELECTOR = Shape({"cel": Shape({"expression": ANY})})
DEVICE_TOLERATION = Shape(
    {"key": ANY, "operator": ANY, "value": ANY, "effect": ANY, "tolerationSeconds": ANY}
)
CAPACITY_REQUIREMENTS = Shape({"requests": ANY})
OPAQUE = Shape({"driver": ANY, "parameters": ANY})
_SUBREQUEST_FIELDS: dict[str, Shape | None] = {
    "deviceClassName": ANY,
    "selectors": DEVICE_SELECTOR,
    "allocationMode": ANY,
    "count": ANY,
    "tolerations": DEVICE_TOLERATION,
    "capacity": CAPACITY_REQUIREMENTS,
}
_V1BETA1_HINT = "a v1beta1 field; in resource.k8s.io/v1 it goes under `exactly`"
DEVICE_REQUEST = Shape(
    {
        "name": ANY,
        "exactly": Shape({**_SUBREQUEST_FIELDS, "adminAccess": ANY}),
        "firstAvailable": Shape({"name": ANY, **_SUBREQUEST_FIELDS}),
    },
    hints=dict.fromkeys(
        ("deviceClassName", "selectors", "allocationMode", "count", "adminAccess"), _V1BETA1_HINT
    ),
)
RESOURCE_CLAIM_SPEC = Shape(
    {
        "devices": Shape(
            {
                "requests": DEVICE_REQUEST,
                "constraints": Shape(
                    {"requests": ANY, "matchAttribute": ANY, "distinctAttribute": ANY}
                ),
                "config": Shape({"requests": ANY, "opaque": OPAQUE}),
            }
        )
    }
)
ALLOCATION_RESULT = Shape(
    {
        "devices": Shape(
            {
                "results": Shape(
                    dict.fromkeys(
                        (
                            "request",
                            "driver",
                            "pool",
                            "device",
                            "adminAccess",
                            "tolerations",
                            "bindingConditions",
                            "bindingFailureConditions",
                            "shareID",
                            "consumedCapacity",
                        ),
                        ANY,
                    )
                ),
                "config": Shape({"source": ANY, "requests": ANY, "opaque": OPAQUE}),
            }
        ),
        "nodeSelector": NODE_SELECTOR,
        "allocationTimestamp": ANY,
    }
)
RESOURCE_CLAIM_STATUS = Shape(
    {
        "allocation": ALLOCATION_RESULT,
        "reservedFor": Shape({"apiGroup": ANY, "resource": ANY, "name": ANY, "uid": ANY}),
        "devices": Shape(
            dict.fromkeys(
                ("driver", "pool", "device", "shareID", "conditions", "data", "networkData"), ANY
            )
        ),
    }
)
_TYPE_META: dict[str, Shape | None] = {"apiVersion": ANY, "kind": ANY, "metadata": OBJECT_META}
RESOURCE_CLAIM = Shape({**_TYPE_META, "spec": RESOURCE_CLAIM_SPEC, "status": RESOURCE_CLAIM_STATUS})
RESOURCE_CLAIM_TEMPLATE = Shape(
    {**_TYPE_META, "spec": Shape({"metadata": OBJECT_META, "spec": RESOURCE_CLAIM_SPEC})}
)
DEVICE_CLASS = Shape(
    {
        **_TYPE_META,
        "spec": Shape(
            {
                "selectors": DEVICE_SELECTOR,
                "config": Shape({"opaque": OPAQUE}),
                "extendedResourceName": ANY,
            }
        ),
    }
)
COUNTERS = Shape(each=Shape({"value": ANY}))
CAPACITY_REQUEST_POLICY = Shape(
    {
        "default": ANY,
        "validValues": ANY,
        "validRange": Shape({"min": ANY, "max": ANY, "step": ANY}),
    }
)
DEVICE = Shape(
    {
        "name": ANY,
        "attributes": Shape(each=Shape({"int": ANY, "bool": ANY, "string": ANY, "version": ANY})),
        "capacity": Shape(each=Shape({"value": ANY, "requestPolicy": CAPACITY_REQUEST_POLICY})),
        "consumesCounters": Shape({"counterSet": ANY, "counters": COUNTERS}),
        "nodeName": ANY,
        "nodeSelector": NODE_SELECTOR,
        "allNodes": ANY,
        "taints": Shape({"key": ANY, "value": ANY, "effect": ANY, "timeAdded": ANY}),
        "bindsToNode": ANY,
        "bindingConditions": ANY,
        "bindingFailureConditions": ANY,
        "allowMultipleAllocations": ANY,
    }
)
RESOURCE_SLICE = Shape(
    {
        **_TYPE_META,
        "spec": Shape(
            {
                "driver": ANY,
                "pool": Shape({"name": ANY, "generation": ANY, "resourceSliceCount": ANY}),
                "nodeName": ANY,
                "nodeSelector": NODE_SELECTOR,
                "allNodes": ANY,
                "devices": DEVICE,
                "perDeviceNodeSelection": ANY,
                "sharedCounters": Shape({"name": ANY, "counters": COUNTERS}),
            }
        ),
    }
)
POD_RESOURCE_CLAIM = Shape(
    {"name": ANY, "resourceClaimName": ANY, "resourceClaimTemplateName": ANY}
)
CONTAINER_CLAIM = Shape({"name": ANY, "request": ANY})

RESOURCE_KINDS: Mapping[str, Shape] = {
    "ResourceClaim": RESOURCE_CLAIM,
    "ResourceClaimTemplate": RESOURCE_CLAIM_TEMPLATE,
    "DeviceClass": DEVICE_CLASS,
    "ResourceSlice": RESOURCE_SLICE,
}
"""The resource.k8s.io/v1 kinds explain reads whole."""


def pod_spec_unknown(spec: object, path: str) -> UnknownField | None:
    """The first unknown field of a Pod spec's claim references: ``spec.resourceClaims[]`` and
    each container's ``resources.claims[]`` (the rest of a Pod is not explain's business)."""
    if not isinstance(spec, Mapping):
        return None
    found = first_unknown(spec.get("resourceClaims"), POD_RESOURCE_CLAIM, f"{path}.resourceClaims")
    if found is not None:
        return found
    for group in ("initContainers", "containers"):
        containers = spec.get(group)
        for i, c in enumerate(containers if isinstance(containers, list) else ()):
            resources = c.get("resources") if isinstance(c, Mapping) else None
            claims = resources.get("claims") if isinstance(resources, Mapping) else None
            where = f"{path}.{group}[{i}].resources.claims"
            found = first_unknown(claims, CONTAINER_CLAIM, where)
            if found is not None:
                return found
    return None


def unknown_field(doc: Document) -> UnknownField | None:
    """The first field of ``doc`` that its type does not define, or None. Only resource.k8s.io/v1
    objects are looked into (another version is refused by ``check_api``, with its own words),
    and of Pods and workloads only the claim references."""
    shape = RESOURCE_KINDS.get(doc.kind)
    if shape is not None:
        if doc.obj.get("apiVersion") != RESOURCE_API:
            return None
        return first_unknown(doc.obj, shape)
    path = (
        ("spec",)
        if doc.kind == "Pod"
        else (*WORKLOADS[doc.kind], "spec")
        if doc.kind in WORKLOADS
        else None
    )
    if path is None:
        return None
    value: object = doc.obj
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return pod_spec_unknown(value, ".".join(path))


def check_known_fields(docs: Iterable[Document]) -> None:
    """Raise DocumentError for the first unknown field of any document, in the API server's
    words: ``c.yaml: document 0: unknown field "spec.devices.requests[0].exactly.selector";
    allowed: ...`` (with why, for a field of an older API version)."""
    for d in docs:
        found = unknown_field(d)
        if found is not None:
            why = f": {found.hint}" if found.hint else f"; allowed: {', '.join(found.allowed)}"
            raise DocumentError(
                d.source, d.index, "", f'unknown field "{d.field(found.field)}"{why}'
            )
