"""KEP-5304 device metadata: the files KubeVirt's virt-launcher reads to find a VM's GPU, byte for
byte as k8s.io/dynamic-resource-allocation's helper writes them (golden files in
golden/kep5304, written by hand from the Go code: their README), where they go, and when they
are removed."""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from dra_driver.device_model import AdvertisedDevice
from dra_driver.errors import CdiError
from dra_driver.kubeletplugin.cdi_spec import validate_spec
from dra_driver.kubeletplugin.checkpoint import PreparedDevice
from dra_driver.kubeletplugin.claims import ClaimKey
from dra_driver.kubeletplugin.device_metadata import (
    DeviceMetadataWriter,
    MetadataDevice,
    pod_claim_name,
    prepare_metadata,
)
from dra_driver.kubeletplugin.device_metadata.gojson import marshal_indent

DRIVER = "gpu.tessera.dev"
POOL = "node-a"
GOLDEN = Path(__file__).parent / "golden" / "kep5304"
GOLDEN_PLUGIN_DIR = "/var/lib/kubelet/plugins/gpu.tessera.dev"
CLAIM_A = ClaimKey(
    "vms", "virt-launcher-vm-a-x7k2p-gpu-q9zcm", "5f0c8a3e-2b7d-4c1a-9e6f-3d2a1b0c9e8f"
)
CLAIM_B = ClaimKey("default", "vm-b-gpu", "c2d4e6f8-0a1b-4c3d-8e5f-6a7b8c9d0e1f")
CONTAINER_DIR = "/var/run/kubernetes.io/dra-device-attributes"
ANNOTATION = "resource.kubernetes.io/pod-claim-name"


def advertised(
    name: str, kind: str, attributes: Mapping[str, dict[str, object]]
) -> AdvertisedDevice:
    return AdvertisedDevice(
        name=name,
        kind=kind,
        gpu_index=0,
        gpu_minor=0,
        parent_uuid="GPU-4b2a6c1e-8d3f-4a5b-9c7d-0e1f2a3b4c5d",
        uuid=None,
        mig_profile_id=None,
        mig_placement_start=None,
        mig_placement_size=None,
        gpu_instance_id=None,
        compute_instance_id=None,
        attributes=tuple(sorted(attributes.items())),
        capacity=(),
    )


VFIO = advertised(
    "gpu-0-vfio",
    "vfio",
    {
        "type": {"string": "vfio"},
        "uuid": {"string": "GPU-4b2a6c1e-8d3f-4a5b-9c7d-0e1f2a3b4c5d"},
        "productName": {"string": "NVIDIA H200"},
        "architecture": {"string": "Hopper"},
        "driverVersion": {"version": "550.90.7"},
        "pciVendorID": {"string": "10de"},
        "pciDeviceID": {"string": "2335"},
        "iommuGroup": {"int": 19},
        "resource.kubernetes.io/pciBusID": {"string": "0000:18:00.0"},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:17"},
        "resource.kubernetes.io/numaNode": {"int": 0},
    },
)
MDEV = advertised(
    "gpu-1-vgpu-232-0",
    "vgpu",
    {
        "type": {"string": "vgpu"},
        "vgpuType": {"string": "T4-2Q"},
        "vgpuTypeID": {"int": 232},
        "maxInstances": {"int": 8},
        "parentPciBusID": {"string": "0000:3b:00.0"},
    },
)


def record(
    dev: AdvertisedDevice, *requests: str, pci_bus_id: str | None = None, mdev: str | None = None
) -> PreparedDevice:
    return PreparedDevice(
        request_names=requests,
        pool=POOL,
        device=dev.name,
        cdi_device_ids=(f"k8s.{DRIVER}/claim=x-{dev.name}", f"k8s.{DRIVER}/driver=common"),
        kind=dev.kind,
        gpu_uuid=dev.parent_uuid,
        gpu_minor=dev.gpu_minor,
        pci_bus_id=pci_bus_id,
        mdev_uuid=mdev,
    )


def by_name(*devs: AdvertisedDevice) -> Any:
    return {d.name: d for d in devs}.get


def golden(name: str, plugin_dir: Path) -> bytes:
    return (
        (GOLDEN / name).read_bytes().replace(GOLDEN_PLUGIN_DIR.encode(), str(plugin_dir).encode())
    )


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "plugins" / DRIVER, tmp_path / "cdi"


def test_a_template_claims_passthrough_gpu_is_written_as_the_go_helper_writes_it(dirs):
    plugin_dir, cdi_dir = dirs
    writer = DeviceMetadataWriter(plugin_dir, cdi_dir, DRIVER)
    records = [record(VFIO, "gpu", pci_bus_id="0000:18:00.0")]
    out = prepare_metadata(writer, CLAIM_A, "gpu", records, by_name(VFIO))
    meta = plugin_dir / "dra-device-metadata" / f"vms_{CLAIM_A.name}" / "gpu" / "metadata.json"
    spec = cdi_dir / f"{DRIVER}_metadata_{CLAIM_A.uid}_gpu.json"
    assert meta.read_bytes() == golden("template-vfio.metadata.json", plugin_dir)
    assert spec.read_bytes() == golden("template-vfio.cdi.json", plugin_dir)
    validate_spec(json.loads(spec.read_bytes()))  # the CDI schema the claim specs meet
    # the kubelet gets the metadata device with the claim's own devices
    assert out[0].cdi_device_ids == (
        *records[0].cdi_device_ids,
        f"{DRIVER}/metadata={CLAIM_A.uid}_gpu",
    )
    # the helper's modes: readable by the container runtime, written by root alone
    assert stat.S_IMODE(meta.stat().st_mode) == stat.S_IMODE(spec.stat().st_mode) == 0o644
    assert stat.S_IMODE(meta.parent.stat().st_mode) == 0o755


def test_a_plain_claims_mediated_vgpu_names_its_mdev_and_the_base_request(dirs):
    """A subrequest (``firstAvailable``) is named in the file; the path has its request. A
    mediated device gets ``mdevUUID`` and no ``pciBusID`` of its own (the parent's BDF is not
    the device's address; KubeVirt takes mdevUUID first anyway)."""
    plugin_dir, cdi_dir = dirs
    writer = DeviceMetadataWriter(plugin_dir, cdi_dir, DRIVER)
    uuid = "8c6f7f0e-3a4b-4d5e-9f10-112233445566"
    records = [record(MDEV, "vgpu/small", pci_bus_id="0000:3b:00.0", mdev=uuid)]
    ids = writer.write(CLAIM_B, None, {"vgpu/small": []})  # ids without devices too
    assert ids == [f"{DRIVER}/metadata={CLAIM_B.uid}_vgpu"]
    prepare_metadata(writer, CLAIM_B, None, records, by_name(MDEV))
    meta = plugin_dir / "dra-device-metadata" / "default_vm-b-gpu" / "vgpu" / "metadata.json"
    spec = cdi_dir / f"{DRIVER}_metadata_{CLAIM_B.uid}_vgpu.json"
    assert meta.read_bytes() == golden("plain-mdev.metadata.json", plugin_dir)
    assert spec.read_bytes() == golden("plain-mdev.cdi.json", plugin_dir)


def test_a_vf_vgpu_gets_the_vfs_address_over_the_slices(dirs):
    writer = DeviceMetadataWriter(*dirs, DRIVER)
    vf = advertised(
        "gpu-0-vgpu-1024-0", "vgpu", {"resource.kubernetes.io/pciBusID": {"string": "0000:18:00.0"}}
    )
    prepare_metadata(
        writer, CLAIM_B, None, [record(vf, "vgpu", pci_bus_id="0000:18:00.4")], by_name(vf)
    )
    (device,) = read_like_kubevirt(dirs[1], "resourceclaims", CLAIM_B.name, "vgpu")
    assert device["attributes"] == {"resource.kubernetes.io/pciBusID": {"string": "0000:18:00.4"}}


def read_like_kubevirt(
    cdi_dir: Path, subdir: str, claim: str, request: str
) -> list[dict[str, Any]]:
    """What virt-launcher reads (kubevirt/kubevirt pkg/dra/utils.go ``resolveClaimMetadata``):
    ``<dir>/<subdir>/<claim>/<request>/*-metadata.json``, the first object of the stream whose
    apiVersion it knows, the request of that name. The container's view is the CDI mounts."""
    mounts = {
        m["containerPath"]: Path(m["hostPath"])
        for spec in cdi_dir.glob("*_metadata_*.json")
        for d in json.loads(spec.read_bytes())["devices"]
        for m in d["containerEdits"]["mounts"]
    }
    wanted = f"{CONTAINER_DIR}/{subdir}/{claim}/{request}/"
    (path,) = [
        h for c, h in mounts.items() if c.startswith(wanted) and c.endswith("-metadata.json")
    ]
    decoder, text, at = json.JSONDecoder(), path.read_text(), 0
    while text[at:].strip():
        obj, end = decoder.raw_decode(text, at)
        at = end + (len(text[end:]) - len(text[end:].lstrip()))
        if obj["apiVersion"] == "metadata.resource.k8s.io/v1alpha1":
            (req,) = [r for r in obj["requests"] if r["name"].partition("/")[0] == request]
            return list(req["devices"])
    raise AssertionError("no object of a known apiVersion")


def test_kubevirt_finds_a_template_claim_under_the_pods_name_for_it(dirs):
    writer = DeviceMetadataWriter(*dirs, DRIVER)
    prepare_metadata(writer, CLAIM_A, "gpu", [record(VFIO, "gpu")], by_name(VFIO))
    (device,) = read_like_kubevirt(dirs[1], "resourceclaimtemplates", "gpu", "gpu")
    assert device["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:18:00.0"}
    assert (device["driver"], device["pool"], device["name"]) == (DRIVER, POOL, "gpu-0-vfio")


def test_only_vm_devices_get_metadata_and_each_request_one_id_on_its_first_device(dirs):
    writer = DeviceMetadataWriter(*dirs, DRIVER)
    gpu = advertised("gpu-1", "gpu", {"type": {"string": "gpu"}})
    vfio2 = advertised("gpu-2-vfio", "vfio", {"type": {"string": "vfio"}})
    records = [record(gpu, "gpu"), record(VFIO, "vm"), record(vfio2, "vm"), record(VFIO, "more")]
    out = prepare_metadata(writer, CLAIM_B, None, records, by_name(gpu, VFIO, vfio2))
    extra = [
        tuple(o.cdi_device_ids[len(r.cdi_device_ids) :]) for o, r in zip(out, records, strict=True)
    ]
    base = f"{DRIVER}/metadata={CLAIM_B.uid}"
    assert extra == [(), (f"{base}_vm",), (), (f"{base}_more",)]
    assert sorted(p.name for p in dirs[1].iterdir()) == [
        f"{DRIVER}_metadata_{CLAIM_B.uid}_more.json",
        f"{DRIVER}_metadata_{CLAIM_B.uid}_vm.json",
    ]
    devices = read_like_kubevirt(dirs[1], "resourceclaims", CLAIM_B.name, "vm")
    assert [d["name"] for d in devices] == ["gpu-0-vfio", "gpu-2-vfio"]
    # a claim of container devices only: nothing written, nothing added
    assert prepare_metadata(writer, CLAIM_A, None, [record(gpu, "gpu")], by_name(gpu)) == (
        record(gpu, "gpu"),
    )


def test_go_escapes_what_python_does_not():
    """encoding/json's appendString: HTML characters, U+2028/9, and \\b \\f since Go 1.22."""
    value = {"s": 'a<b>&c\u2028\u2029\b\f\n\x01"\\é'}
    assert marshal_indent(value) == (
        b'{\n  "s": "a\\u003cb\\u003e\\u0026c\\u2028\\u2029\\b\\f\\n\\u0001\\"\\\\\xc3\xa9"\n}'
    )
    assert marshal_indent({"a": [], "b": {}, "c": [True, 3]}) == (
        b'{\n  "a": [],\n  "b": {},\n  "c": [\n    true,\n    3\n  ]\n}'
    )


def test_the_pod_claim_name_comes_from_the_claim_controllers_annotation():
    annotated = {"metadata": {"annotations": {ANNOTATION: "gpu"}}}
    assert pod_claim_name(annotated) == "gpu"
    assert pod_claim_name({"metadata": {"name": "x"}}) is None
    assert pod_claim_name({"metadata": {"annotations": {"other": "x"}}}) is None


@pytest.mark.parametrize(
    ("claim", "pod_name", "req", "match"),
    [
        (CLAIM_A, "../etc", "gpu", f"pod claim name (annotation {ANNOTATION}) '../etc' is not"),
        (CLAIM_A, None, "gpu/../x", "subrequest name '../x' is not a DNS label"),
        (CLAIM_A, None, "GPU", "request name 'GPU' is not a DNS label"),
        (ClaimKey("vms", "a/b", CLAIM_A.uid), None, "gpu", "claim name 'a/b'"),
        (ClaimKey("vms", "a", "UID/1"), None, "gpu", "claim UID 'UID/1'"),
    ],
)
def test_names_that_would_leave_the_directories_are_refused(dirs, claim, pod_name, req, match):
    writer = DeviceMetadataWriter(*dirs, DRIVER)
    with pytest.raises(CdiError, match=re.escape(match)):
        writer.write(claim, pod_name, {req: [MetadataDevice(POOL, "gpu-0-vfio")]})
    assert not dirs[0].exists() and not dirs[1].exists()


def test_a_rewrite_replaces_the_file_whole(dirs):
    """A reader holding the old file reads all of it, a new reader all of the new one: the file
    is replaced (rename), never rewritten in place as os.WriteFile does."""
    writer = DeviceMetadataWriter(*dirs, DRIVER)
    first = {"gpu": [MetadataDevice(POOL, "gpu-0-vfio", {"a": {"string": "1"}})]}
    writer.write(CLAIM_B, None, first)
    path = writer.host_path(CLAIM_B.namespace, CLAIM_B.name, "gpu")
    with path.open("rb") as old:
        writer.write(
            CLAIM_B, None, {"gpu": [MetadataDevice(POOL, "gpu-0-vfio", {"a": {"string": "2"}})]}
        )
        assert (
            json.loads(old.read())["requests"][0]["devices"][0]["attributes"]["a"]["string"] == "1"
        )
    assert (
        json.loads(path.read_bytes())["requests"][0]["devices"][0]["attributes"]["a"]["string"]
        == "2"
    )
    assert [p.name for p in path.parent.iterdir()] == ["metadata.json"]  # no temporary file left


def test_remove_takes_the_claims_files_and_leaves_the_others(dirs):
    plugin_dir, cdi_dir = dirs
    writer = DeviceMetadataWriter(plugin_dir, cdi_dir, DRIVER)
    writer.write(CLAIM_A, "gpu", {"gpu": [MetadataDevice(POOL, "gpu-0-vfio")]})
    writer.write(
        CLAIM_B, None, {"a": [MetadataDevice(POOL, "x")], "b": [MetadataDevice(POOL, "y")]}
    )
    other = cdi_dir / "k8s.gpu.tessera.dev-claim_x.json"  # not ours to touch
    other.write_text("{}")
    assert writer.remove(CLAIM_B.uid) is True
    assert writer.claim_uids() == {CLAIM_A.uid}
    assert not (plugin_dir / "dra-device-metadata" / "default_vm-b-gpu").exists()
    assert writer.host_path(CLAIM_A.namespace, CLAIM_A.name, "gpu").exists()
    assert other.exists()
    assert writer.remove(CLAIM_B.uid) is False  # idempotent


def test_remove_never_takes_a_newer_claims_file_of_the_same_name(dirs):
    """A claim deleted and made again under its name shares the old one's directory (the helper
    keys it by namespace and name): the old one's removal leaves the new one's file."""
    writer = DeviceMetadataWriter(*dirs, DRIVER)
    newer = ClaimKey(CLAIM_B.namespace, CLAIM_B.name, "d3e5f7a9-1b2c-4d3e-8f4a-5b6c7d8e9f0a")
    writer.write(CLAIM_B, None, {"gpu": [MetadataDevice(POOL, "gpu-0-vfio")]})
    writer.write(newer, None, {"gpu": [MetadataDevice(POOL, "gpu-0-vfio")]})
    writer.remove(CLAIM_B.uid)
    path = writer.host_path(newer.namespace, newer.name, "gpu")
    assert json.loads(path.read_bytes())["metadata"]["uid"] == newer.uid
    assert writer.claim_uids() == {newer.uid}


def test_remove_never_follows_a_spec_to_a_file_outside_its_directory(dirs, tmp_path):
    writer = DeviceMetadataWriter(*dirs, DRIVER)
    writer.write(CLAIM_B, None, {"gpu": [MetadataDevice(POOL, "gpu-0-vfio")]})
    precious = tmp_path / "precious"
    precious.write_text("keep")
    spec = dirs[1] / f"{DRIVER}_metadata_{CLAIM_B.uid}_gpu.json"
    doc = json.loads(spec.read_bytes())
    doc["devices"][0]["containerEdits"]["mounts"][0]["hostPath"] = str(precious)
    spec.write_text(json.dumps(doc))
    writer.remove(CLAIM_B.uid)
    assert precious.read_text() == "keep"
    assert not spec.exists()


def test_sweep_removes_what_no_held_claim_owns(dirs):
    """At start: the files of claims the checkpoint does not hold, a metadata file whose spec
    went first (or that no claim owns), and the temporary files of an interrupted write."""
    plugin_dir, cdi_dir = dirs
    writer = DeviceMetadataWriter(plugin_dir, cdi_dir, DRIVER)
    writer.write(CLAIM_A, "gpu", {"gpu": [MetadataDevice(POOL, "gpu-0-vfio")]})
    writer.write(CLAIM_B, None, {"gpu": [MetadataDevice(POOL, "gpu-1-vfio")]})
    stray = ClaimKey("default", "stray", "e4f6a8b0-2c3d-4e5f-9a6b-7c8d9e0f1a2b")
    writer.write(stray, None, {"gpu": [MetadataDevice(POOL, "gpu-2-vfio")]})
    os.unlink(cdi_dir / f"{DRIVER}_metadata_{stray.uid}_gpu.json")  # its spec gone first
    host_a = writer.host_path(CLAIM_A.namespace, CLAIM_A.name, "gpu")
    temps = [
        cdi_dir / f".{DRIVER}_metadata_{CLAIM_B.uid}_x.json.abc123.tmp",
        host_a.parent / ".metadata.json.abc123.tmp",
    ]
    for t in temps:
        t.write_text("half")
    assert writer.sweep({CLAIM_A.uid}) == [CLAIM_B.uid]
    assert writer.claim_uids() == {CLAIM_A.uid}
    assert host_a.exists()
    assert sorted(p.name for p in (plugin_dir / "dra-device-metadata").iterdir()) == [
        f"vms_{CLAIM_A.name}"
    ]
    assert not any(t.exists() for t in temps)
