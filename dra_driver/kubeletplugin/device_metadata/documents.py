"""The two documents of KEP-5304 device metadata and where they go: pure functions.

What k8s.io/dynamic-resource-allocation's kubelet-plugin helper writes (``kubeletplugin/
metadata.go`` and ``api/metadata``, commit 3d036712 of 2026-07-01; the same code is vendored as
v0.36.0-rc.0 in NVIDIA/k8s-dra-driver-gpu 22407113), per request of a prepared claim:

- **the metadata file**, on the host at ``<plugin data dir>/dra-device-metadata/
  <namespace>_<claim>/<request>/metadata.json`` (mode 0644, directories 0755): a JSON stream,
  the same object once per configured API version, newest first, each ``MarshalIndent``-ed and
  followed by a new line. The only version there is (and the only one NVIDIA's driver and
  KubeVirt use) is ``metadata.resource.k8s.io/v1alpha1``::

      {"kind": "DeviceMetadata", "apiVersion": "metadata.resource.k8s.io/v1alpha1",
       "metadata": {"name", "namespace", "uid", "generation": 1},
       "podClaimName": <the claim's resource.kubernetes.io/pod-claim-name annotation; only
                        when it has one (claims made from a template)>,
       "requests": [{"name": <request, or request/subrequest>,
                     "devices": [{"driver", "pool", "name",
                                  "attributes": {<ResourceSlice form, keys sorted>}}]}]}

  ``kind`` comes before ``apiVersion`` (``metav1.TypeMeta``'s field order); no
  ``creationTimestamp`` (``omitzero`` since apimachinery 503b9897, 2025-03).
- **its CDI spec**, ``<cdi dir>/<driver>_metadata_<claimUID>_<request>.json`` (0644)::

      {"cdiVersion": "0.5.0", "kind": "<driver>/metadata",
       "devices": [{"name": "<claimUID>_<request>",
                    "containerEdits": {"mounts": [{"hostPath": <the file>,
                       "containerPath": <below>, "options": ["ro", "bind"]}]}}]}

  mounting the file in the containers of the request at ``/var/run/kubernetes.io/
  dra-device-attributes/resourceclaims/<claim>/<request>/<driver>-metadata.json``, or
  ``resourceclaimtemplates/<podClaimName>/...`` for a claim made from a template (the pod's own
  name for the claim, which is what a pod spec, and KubeVirt's VMI, knows). The CDI device id
  ``<driver>/metadata=<claimUID>_<request>`` is handed to the kubelet with the first device of
  the request.

``<request>`` in paths and names is the base request (``gpu`` of ``gpu/large``,
``resourceclaim.BaseRequestRef``); the object names the request as allocated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from dra_driver.kubeletplugin.claims import ClaimKey
from dra_driver.kubeletplugin.device_metadata.gojson import marshal_indent

API_VERSION = "metadata.resource.k8s.io/v1alpha1"
KIND = "DeviceMetadata"
CONTAINER_DIR = PurePosixPath("/var/run/kubernetes.io/dra-device-attributes")
CLAIMS_SUBDIR = "resourceclaims"
TEMPLATES_SUBDIR = "resourceclaimtemplates"
HOST_SUBDIR = "dra-device-metadata"
HOST_FILE = "metadata.json"
POD_CLAIM_NAME_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
"""Set by the ResourceClaim controller on the claims it makes from a pod's template
(k8s.io/api resource/v1 ``PodResourceClaimAnnotation``)."""
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
MDEV_UUID = "mdevUUID"
"""KubeVirt's key for a mediated device (``pkg/dra/metadata/types.go``: "not yet standardized
under resource.kubernetes.io")."""
CDI_VERSION = "0.5.0"
"""The helper's ``cdiVersionStr`` (kept apart from the claim specs' version on purpose)."""
ATTRIBUTE_FIELDS = ("int", "bool", "string", "version")
"""A v1 DeviceAttribute's value fields in their Go declaration order (the JSON's order)."""


@dataclass(frozen=True)
class MetadataDevice:
    """One prepared device as the metadata file describes it."""

    pool: str
    name: str
    attributes: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    """Qualified name -> ``{"string": ...}`` (or ``int``, ``bool``, ``version``), as in a
    ResourceSlice."""


def base_request(request: str) -> str:
    """``gpu`` of ``gpu`` and of the subrequest ``gpu/large``."""
    return request.partition("/")[0]


def container_path(driver: str, claim_name: str, pod_claim_name: str | None, request: str) -> str:
    """Where the containers of ``request`` find the file (``api/metadata/helpers.go``)."""
    if pod_claim_name:
        return str(
            CONTAINER_DIR / TEMPLATES_SUBDIR / pod_claim_name / request / f"{driver}-{HOST_FILE}"
        )
    return str(CONTAINER_DIR / CLAIMS_SUBDIR / claim_name / request / f"{driver}-{HOST_FILE}")


def cdi_device_name(claim_uid: str, request: str) -> str:
    return f"{claim_uid}_{request}"


def cdi_kind(driver: str) -> str:
    return f"{driver}/metadata"


def _attribute(name: str, value: Mapping[str, object]) -> dict[str, object]:
    unknown = sorted(set(value) - set(ATTRIBUTE_FIELDS))
    if unknown or not value:
        raise ValueError(
            f"attribute {name!r}: {dict(value)!r} is not a DeviceAttribute (one of"
            f" {', '.join(ATTRIBUTE_FIELDS)})"
        )
    return {k: value[k] for k in ATTRIBUTE_FIELDS if k in value}


def _device(driver: str, d: MetadataDevice) -> dict[str, object]:
    out: dict[str, object] = {"driver": driver, "pool": d.pool, "name": d.name}
    if d.attributes:  # omitempty
        out["attributes"] = {k: _attribute(k, d.attributes[k]) for k in sorted(d.attributes)}
    return out


def metadata_stream(
    driver: str,
    claim: ClaimKey,
    pod_claim_name: str | None,
    request: str,
    devices: Sequence[MetadataDevice],
    generation: int = 1,
) -> bytes:
    """The metadata file of one request: the v1alpha1 object, then a new line."""
    meta: dict[str, object] = {"name": claim.name, "namespace": claim.namespace, "uid": claim.uid}
    if generation:  # omitempty
        meta["generation"] = generation
    obj: dict[str, object] = {"kind": KIND, "apiVersion": API_VERSION, "metadata": meta}
    if pod_claim_name is not None:  # a pointer: "" is written, only nil omitted
        obj["podClaimName"] = pod_claim_name
    req: dict[str, object] = {"name": request}
    if devices:  # omitempty
        req["devices"] = [_device(driver, d) for d in devices]
    obj["requests"] = [req]
    return marshal_indent(obj) + b"\n"


def cdi_spec(
    driver: str, claim_uid: str, request: str, host_path: str, in_container: str
) -> dict[str, object]:
    """The CDI spec bind-mounting one request's file read-only into its containers."""
    mount = {"hostPath": host_path, "containerPath": in_container, "options": ["ro", "bind"]}
    return {
        "cdiVersion": CDI_VERSION,
        "kind": cdi_kind(driver),
        "devices": [
            {"name": cdi_device_name(claim_uid, request), "containerEdits": {"mounts": [mount]}}
        ],
    }


def cdi_spec_bytes(spec: Mapping[str, object]) -> bytes:
    """The spec as the helper writes it (``json.MarshalIndent``, no trailing new line)."""
    return marshal_indent(spec)
