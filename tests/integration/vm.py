"""What the VM end-to-end tests share: claims of the VM classes, the node's simulated sysfs, the
daemon's published devices, its CDI results and KEP-5304 metadata (design of issue 24)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.integration.daemon import DRIVER, Daemon, claim_manifest, write_claims
from tests.k8sschema import VERSIONS, validate
from tests.sim.tools_helpers import wait_for

CLASSES = {"vfio": "vfio.gpu.tessera.dev", "vgpu": "vgpu.gpu.tessera.dev", "gpu": DRIVER}
"""The DeviceClass a claim for a device of each kind names (deploy/daemonset/deviceclasses.yaml:
the container classes select no VM device and the reverse)."""


def kind_of(device: str) -> str:
    return "vfio" if device.endswith("-vfio") else "vgpu" if "-vgpu-" in device else "gpu"


def claim(d: Daemon, name: str, device: str, **kw: Any) -> ClaimRef:
    """A claim of ``device`` (request ``gpu``) in the class of its kind, checked against the
    schemas and written where the standalone daemon reads claims."""
    obj = claim_manifest(name, f"uid-{name}", [("gpu", device)], d.node, **kw)
    obj["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = CLASSES[kind_of(device)]
    for version in VERSIONS:
        validate(obj, version)
    write_claims(d.state, obj)
    return ClaimRef("default", name, f"uid-{name}")


def prepare(d: Daemon, ref: ClaimRef, api: str = "v1") -> dict[str, Any]:
    with KubeletClient(d.dra_socket) as k:
        result: dict[str, Any] = k.prepare([ref], api=api)["claims"][ref.uid]
    return result


def unprepare(d: Daemon, ref: ClaimRef, api: str = "v1") -> str:
    with KubeletClient(d.dra_socket) as k:
        error: str = k.unprepare([ref], api=api)["claims"][ref.uid]["error"]
    return error


def slices(d: Daemon) -> list[dict[str, Any]]:
    """The slice files the standalone daemon published, parsed with libyaml (a dynamic MIG
    node's slices take seconds to parse in pure Python); empty when one was replaced while
    read."""
    out = []
    for path in sorted((d.state / "resourceslices").glob("*.yaml")):
        try:
            out.append(yaml.load(path.read_bytes(), Loader=yaml.CSafeLoader))
        except (OSError, yaml.YAMLError):  # replaced while read: read again at the next poll
            return []
    return out


def current_slices(d: Daemon) -> list[dict[str, Any]]:
    """The newest complete generation of the daemon's slices (empty while none is)."""
    found = [s for s in slices(d) if s]
    if not found:
        return []
    newest = max(s["spec"]["pool"]["generation"] for s in found)
    current = [s for s in found if s["spec"]["pool"]["generation"] == newest]
    if len(current) != current[0]["spec"]["pool"]["resourceSliceCount"]:
        return []  # a generation half written: read again
    return current


def published(d: Daemon) -> dict[str, dict[str, Any]]:
    """The devices of the newest complete generation of the daemon's slices, by name."""
    return {dev["name"]: dev for s in current_slices(d) for dev in s["spec"].get("devices", [])}


def validated(d: Daemon) -> dict[str, dict[str, Any]]:
    """:func:`published`, each slice first checked against the schemas (a slice of a dynamic
    MIG node takes a while: called once per state a test looks at, not in polls)."""
    current: list[dict[str, Any]] = []

    def complete() -> bool:  # the publisher may be between the slices of a generation
        current[:] = current_slices(d)
        return bool(current)

    wait_for(complete, "a complete generation of slices")
    for s in current:
        for version in VERSIONS:
            validate(s, version)
    return {dev["name"]: dev for s in current for dev in s["spec"].get("devices", [])}


def attr(device: dict[str, Any], name: str) -> Any:
    (value,) = device["attributes"][name].values()
    return value


def sysfs(d: Daemon, bdf: str) -> Path:
    return d.state / "sim" / "sys" / "bus" / "pci" / "devices" / bdf


def binding(d: Daemon, bdf: str) -> tuple[str | None, str]:
    """(bound driver, ``driver_override``) of a PCI function in the simulated sysfs."""
    fn = sysfs(d, bdf)
    link = fn / "driver"
    driver = os.path.basename(os.readlink(link)) if link.is_symlink() else None
    return driver, (fn / "driver_override").read_text().strip()


def group(d: Daemon, bdf: str) -> int:
    return int(os.path.basename(os.readlink(sysfs(d, bdf) / "iommu_group")))


def cdi_nodes(d: Daemon, uid: str) -> list[str]:
    """The device nodes of the claim's CDI spec (its one device)."""
    spec = json.loads((d.cdi_dir / f"k8s.{DRIVER}-claim_{uid}.json").read_text())
    (dev,) = spec["devices"]
    return [n["path"] for n in dev["containerEdits"]["deviceNodes"]]


def metadata(d: Daemon, claim_name: str, request: str = "gpu") -> dict[str, Any]:
    """The KEP-5304 metadata file of the claim's request (the one device's attributes)."""
    path = (
        d.state / "kubelet" / "plugins" / DRIVER / "dra-device-metadata"
        / f"default_{claim_name}" / request / "metadata.json"
    )  # fmt: skip
    doc = json.loads(path.read_text())
    assert doc["apiVersion"] == "metadata.resource.k8s.io/v1alpha1"
    ((req,),) = [doc["requests"]]
    assert req["name"] == request
    (dev,) = req["devices"]
    return {k: next(iter(v.values())) for k, v in dev["attributes"].items()}


def metadata_files(d: Daemon) -> list[str]:
    """What is left of KEP-5304 metadata: the CDI specs and the claims' metadata directories."""
    specs = sorted(p.name for p in d.cdi_dir.glob(f"{DRIVER}_metadata_*.json"))
    root = d.state / "kubelet" / "plugins" / DRIVER / "dra-device-metadata"
    return specs + (sorted(p.name for p in root.iterdir()) if root.is_dir() else [])


def metadata_id(uid: str, request: str = "gpu") -> str:
    return f"{DRIVER}/metadata={uid}_{request}"
