"""NVIDIA's layout: the ResourceSlices NVIDIA's DRA driver for GPUs (NVIDIA/k8s-dra-driver-gpu)
would publish for a simulated node, built here in Python from what its code says, so that
``bench/scale_model.py`` can put its bytes and writes next to Tessera's for the same node.

Read at commit 22407113785e78c7763b4637689a201eb39c6199 (2026-05-15) of
github.com/NVIDIA/k8s-dra-driver-gpu (no code copied; the facts used, by file):

- ``cmd/gpu-kubelet-plugin/main.go``: the driver is ``gpu.nvidia.com``.
- ``cmd/gpu-kubelet-plugin/deviceinfo.go``: a whole GPU is ``gpu-<minor>`` with attributes
  type, uuid, productName, brand, architecture, cudaComputeCapability, driverVersion,
  cudaDriverVersion (the last three as semver versions), the standard
  ``resource.kubernetes.io/pciBusID`` and ``/pcieRoot``, ``addressingMode`` only on coherent
  systems; capacity ``memory`` (the GPU's total, ``resource.NewQuantity(..., BinarySI)``). A
  static MIG device adds its uuid and a ``memorySlice<i>: 1`` capacity per memory slice it
  holds. A passthrough device is ``gpu-vfio-<index>`` (type, uuid, deviceID, vendorID, numa,
  productName, iommuFDEnabled, the two PCI attributes; capacity ``addressableMemory``).
- ``cmd/gpu-kubelet-plugin/mig.go``: a MIG device is ``gpu-<minor>-mig-<profile, dots removed,
  other characters than [a-z0-9-] as '-'>-<GI profile id>-<placement start>``, attributes type
  ``mig``, parentUUID, profile and the parent's product, brand, architecture, versions and PCI
  attributes (no uuid for a dynamic one); capacities multiprocessors, copyEngines, decoders,
  encoders, jpegEngines, ofaEngines and memory (MiB x 2^20), zeros included.
- ``cmd/gpu-kubelet-plugin/partitions.go``: dynamic MIG (KEP 4815): one counter set
  ``gpu-<minor>-counter-set`` per GPU with one counter per capacity (camelCase to dash-case)
  plus ``memory-slice-<i>`` (1 each); the whole GPU's capacity is the per-capacity maximum over
  all MIG profiles and it consumes every counter; a MIG device consumes its capacities and the
  memory slices of its placement.
- ``cmd/gpu-kubelet-plugin/nvlib.go``: dynamic MIG advertises every placement of every GPU-
  instance profile NVML reports (one compute-instance profile each, C == G); the memory-slice
  count is the largest placement size; static MIG advertises the MIG devices that exist, and a
  GPU with MIG enabled is not advertised whole.
- ``cmd/gpu-kubelet-plugin/driver.go``: dynamic MIG on Kubernetes 1.35+ publishes G+1 slices
  (one with every counter set, then one per GPU with its devices, sorted by name); before 1.35
  G slices each with its GPU's counter set and devices; without dynamic MIG one slice with every
  device.
- ``vendor/k8s.io/dynamic-resource-allocation/resourceslice/resourceslicecontroller.go``
  (``syncPool``): slices are named ``<index, 5 hex digits>-<driver>-<node>-`` plus the API
  server's random suffix, owned by the Node (an ownerReference with controller true); the pool
  generation is kept when at most one existing slice changes and none is added, else bumped
  and every slice rewritten; a slice whose spec equals the desired one is not written (so a
  restart with the same devices writes nothing).

What is not modelled: device taints from health events (none in steady state), the
ComputeDomain slices (another plugin) and vGPU hosts (NVIDIA's driver has no vGPU-host mode).
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from agent.discovery.inventory import Gpu, NodeInventory
from agent.nvml.types import GpuDevice, MigProfile

NVIDIA_REPO = "github.com/NVIDIA/k8s-dra-driver-gpu"
NVIDIA_COMMIT = "22407113785e78c7763b4637689a201eb39c6199"
DRIVER = "gpu.nvidia.com"
MODES = ("gpu", "static-mig", "dynamic-mig", "passthrough")
"""Whole GPUs (MIG as the node has it: static MIG devices where MIG is on), the same named
for a node with MIG on, dynamic MIG (the DynamicMIG feature gate) and whole GPUs with a vfio
device each (the PassthroughSupport feature gate)."""
CAPACITIES = (
    "copyEngines",
    "decoders",
    "encoders",
    "jpegEngines",
    "memory",
    "multiprocessors",
    "ofaEngines",
)

Obj = dict[str, Any]


def binary_si(n: int) -> str:
    """A Quantity made by ``resource.NewQuantity(n, BinarySI)`` as it serializes: below 1024
    plain digits; else the largest power-of-1024 suffix that divides it exactly (apimachinery's
    ``CanonicalizeBytes``). Written here (no Quantity library in our dependencies)."""
    if -1024 < n < 1024:
        return str(n)
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = 1024 ** ("KMGTPE".index(suffix[0]) + 1)
        if n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def semver(text: str) -> str:
    """Masterminds/semver's ``MustParse(text).String()``: missing parts become 0 and leading
    zeros go (``550.90.07`` -> ``550.90.7``, ``8.0`` -> ``8.0.0``)."""
    parts = [int(p) for p in re.findall(r"\d+", text)[:3]]
    parts += [0] * (3 - len(parts))
    return ".".join(str(p) for p in parts)


def camel_to_dns(name: str) -> str:
    """``camelToDNSName``: a dash before each capital that follows a lower-case letter or digit,
    lower-cased (``copyEngines`` -> ``copy-engines``)."""
    return re.sub(r"([a-z0-9])([A-Z])", r"\1-\2", name).lower()


def mig_device_name(minor: int, profile: str, profile_id: int, start: int) -> str:
    pname = re.sub(r"[^a-z0-9-.]", "-", profile.replace(".", "").lower()).strip("-")
    return f"gpu-{minor}-mig-{pname}-{profile_id}-{start}"


def _gpu_attributes(gpu: Gpu, inv: NodeInventory) -> dict[str, Obj]:
    d = gpu.device
    return {
        "architecture": {"string": d.architecture},
        "brand": {"string": d.brand},
        "cudaComputeCapability": {"version": semver("{}.{}".format(*d.compute_capability))},
        "cudaDriverVersion": {"version": semver(inv.system.cuda_driver_version)},
        "driverVersion": {"version": semver(inv.system.driver_version)},
        "productName": {"string": d.name},
        "resource.kubernetes.io/pciBusID": {"string": gpu.pcie.bus_id},
        "resource.kubernetes.io/pcieRoot": {"string": gpu.pcie.pcie_root},
    }


def _mig_attributes(gpu: Gpu, inv: NodeInventory, profile: str) -> dict[str, Obj]:
    attrs = _gpu_attributes(gpu, inv)
    attrs.update(
        type={"string": "mig"},
        parentUUID={"string": gpu.device.uuid},
        profile={"string": profile},
    )
    return dict(sorted(attrs.items()))


def _profile_capacities(p: MigProfile) -> dict[str, int]:
    return {
        "copyEngines": p.copy_engines,
        "decoders": p.decoders,
        "encoders": p.encoders,
        "jpegEngines": p.jpeg_engines,
        "memory": p.memory_bytes,
        "multiprocessors": p.multiprocessors,
        "ofaEngines": p.ofa_engines,
    }


def _quantities(values: dict[str, int]) -> dict[str, Obj]:
    return {k: {"value": binary_si(v)} for k, v in sorted(values.items())}


def _counters(capacities: dict[str, int], start: int, size: int) -> dict[str, Obj]:
    counters = {camel_to_dns(k): v for k, v in capacities.items()}
    counters.update({f"memory-slice-{i}": 1 for i in range(start, start + size)})
    return _quantities(counters)


def _max_capacities(d: GpuDevice) -> tuple[dict[str, int], int]:
    """The per-capacity maximum over every profile, and the memory-slice count."""
    caps = [_profile_capacities(p) for p in d.mig_profiles if p.placements]
    top = {k: max(c[k] for c in caps) for k in CAPACITIES}
    slices = max(pl.size for p in d.mig_profiles for pl in p.placements)
    return top, slices


def whole_gpu(gpu: Gpu, inv: NodeInventory) -> Obj:
    attrs = {**_gpu_attributes(gpu, inv), "type": {"string": "gpu"}}
    attrs["uuid"] = {"string": gpu.device.uuid}
    return {
        "name": f"gpu-{gpu.device.minor}",
        "attributes": dict(sorted(attrs.items())),
        "capacity": _quantities({"memory": gpu.device.memory.total}),
    }


def vfio_device(gpu: Gpu, index: int) -> Obj:
    """``nvlib.go`` ``getVfioDeviceInfo``: its UUID is a SHA-1 UUID of the PCI address in the
    DNS namespace. Approximated: the product name (the PCI database's, here NVML's) and the
    addressable memory (its BARs' total, here the GPU's memory: a Quantity of the same
    length)."""
    d = gpu.device
    attrs = {
        "deviceID": {"string": f"0x{d.pci_device_id >> 16:04x}"},
        "iommuFDEnabled": {"bool": False},
        "numa": {"int": gpu.pcie.numa_node or 0},
        "productName": {"string": d.name},
        "resource.kubernetes.io/pciBusID": {"string": gpu.pcie.bus_id},
        "resource.kubernetes.io/pcieRoot": {"string": gpu.pcie.pcie_root},
        "type": {"string": "vfio"},
        "uuid": {"string": str(uuid.uuid5(uuid.NAMESPACE_DNS, gpu.pcie.bus_id))},
        "vendorID": {"string": f"0x{d.pci_device_id & 0xFFFF:04x}"},
    }
    return {
        "name": f"gpu-vfio-{index}",
        "attributes": attrs,
        "capacity": _quantities({"addressableMemory": d.memory.total}),
    }


def static_mig_devices(gpu: Gpu, inv: NodeInventory) -> list[Obj]:
    d = gpu.device
    profiles = {p.profile_id: p for p in d.mig_profiles}
    out = []
    for m in d.mig_instances:
        attrs = _mig_attributes(gpu, inv, m.profile_name)
        attrs["uuid"] = {"string": m.uuid}
        caps = _profile_capacities(profiles[m.profile_id])
        caps |= {f"memorySlice{i}": 1 for i in m.placement.slots()}
        out.append(
            {
                "name": mig_device_name(d.minor, m.profile_name, m.profile_id, m.placement.start),
                "attributes": dict(sorted(attrs.items())),
                "capacity": _quantities(caps),
            }
        )
    return out


def toggles_mig(d: GpuDevice) -> bool:
    """Hopper and later switch MIG mode without a GPU reset (``supportsMIGModeToggle``)."""
    return d.architecture not in ("Ampere",)


def dynamic_capable(d: GpuDevice) -> bool:
    """``isDynamicMIGCapable``: MIG-capable, and on Ampere only with MIG already on."""
    return d.mig_capable and bool(d.mig_profiles) and (toggles_mig(d) or d.mig_enabled)


def dynamic_devices(gpu: Gpu, inv: NodeInventory) -> tuple[list[Obj], Obj]:
    """One GPU's devices in dynamic MIG mode, sorted by name, and its counter set."""
    d = gpu.device
    top, memory_slices = _max_capacities(d)
    counter_set = f"gpu-{d.minor}-counter-set"
    full = whole_gpu(gpu, inv)
    full["capacity"] = _quantities(top)
    full["consumesCounters"] = [
        {"counterSet": counter_set, "counters": _counters(top, 0, memory_slices)}
    ]
    devices = [] if d.mig_enabled and not toggles_mig(d) else [full]
    for p in d.mig_profiles:
        caps = _profile_capacities(p)
        for pl in p.placements:
            devices.append(
                {
                    "name": mig_device_name(d.minor, p.name, p.profile_id, pl.start),
                    "attributes": _mig_attributes(gpu, inv, p.name),
                    "capacity": _quantities(caps),
                    "consumesCounters": [
                        {"counterSet": counter_set, "counters": _counters(caps, pl.start, pl.size)}
                    ],
                }
            )
    counters = {"name": counter_set, "counters": _counters(top, 0, memory_slices)}
    return sorted(devices, key=lambda dev: str(dev["name"])), counters


def slice_specs(inv: NodeInventory, mode: str, split: bool = True) -> list[Obj]:
    """The slices' contents (``devices`` and/or ``sharedCounters``) in publishing order.
    ``split``: Kubernetes 1.35+ (counter sets in a slice of their own)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
    gpus = sorted(inv.gpus, key=lambda g: g.pcie.bus_id)  # the driver sorts by PCI bus ID
    if mode == "dynamic-mig" and any(dynamic_capable(g.device) for g in gpus):
        per_gpu: list[Obj] = []
        counter_sets = []
        for g in gpus:
            if not dynamic_capable(g.device):
                per_gpu.append({"devices": [whole_gpu(g, inv)]})
                continue
            devices, counters = dynamic_devices(g, inv)
            counter_sets.append(counters)
            per_gpu.append(
                {"devices": devices}
                if split
                else {"devices": devices, "sharedCounters": [counters]}
            )
        return [{"sharedCounters": counter_sets}, *per_gpu] if split else per_gpu
    devices = []
    for i, g in enumerate(sorted(inv.gpus, key=lambda g: g.device.minor)):
        if g.device.mig_enabled:
            devices += static_mig_devices(g, inv)
            continue
        devices.append(whole_gpu(g, inv))
        if mode == "passthrough":
            devices.append(vfio_device(g, i))
    return [{"devices": devices}]


def nvidia_slices(
    inv: NodeInventory, mode: str, node: str, node_uid: str, split: bool = True, generation: int = 1
) -> list[Obj]:
    """The ResourceSlice objects NVIDIA's kubelet plugin creates for ``inv`` (before the API
    server names them from ``generateName`` and stamps them)."""
    specs = slice_specs(inv, mode, split)
    owner = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid, "controller": True}
    out = []
    for i, content in enumerate(specs):
        spec: Obj = {
            "driver": DRIVER,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": len(specs)},
            "nodeName": node,
            **content,
        }
        out.append(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {
                    "generateName": f"{i:05x}-{DRIVER}-{node}-",
                    "ownerReferences": [owner],
                },
                "spec": spec,
            }
        )
    return out


def tainted(specs: list[Obj], minor: int) -> list[Obj]:
    """``specs`` with every device of GPU ``minor`` tainted as its health monitor does for an
    Xid (``device_health.go`` ``healthEventToTaint``: key ``gpu.nvidia.com/xid``, the Xid as
    value, NoSchedule; the API server stamps ``timeAdded``)."""
    taint = {
        "key": f"{DRIVER}/xid",
        "value": "79",
        "effect": "NoSchedule",
        "timeAdded": "2026-01-01T00:00:00Z",
    }
    mine = (f"gpu-{minor}", f"gpu-{minor}-")

    def mark(dev: Obj) -> Obj:
        hit = dev["name"] == mine[0] or str(dev["name"]).startswith(mine[1])
        return {**dev, "taints": [taint]} if hit else dev

    return [
        {**s, "devices": [mark(d) for d in s["devices"]]} if "devices" in s else s for s in specs
    ]
