"""Simulated node models: typed, validated views of the data files in ``agent/sim/models/``.

A model says what hardware a node has and where it sits on the PCIe tree; the simulator's NVML
fake, sysfs writer and tool stand-ins are all driven by it. Pure data: loading does no other I/O.
"""

from __future__ import annotations

import re
import uuid as uuidlib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

from agent.decode.bounds import YamlLoader
from agent.sim.errors import ModelError
from agent.sim.specs import GpuSpec, gpu_specs

BDF_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
ROOT_RE = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")

NIC_DEVICE_IDS = {"ConnectX-6": 0x101B, "ConnectX-6 Dx": 0x101D, "ConnectX-7": 0x1021}
MELLANOX_VENDOR = 0x15B3
NVIDIA_VENDOR = 0x10DE


def _parent(value: str, where: str) -> tuple[str, ...]:
    parts = tuple(value.split("/"))
    if not parts or not ROOT_RE.match(parts[0]):
        raise ModelError(
            f"{where}: parent must start with a root complex like pci0000:00, got {value!r}"
        )
    for bridge in parts[1:]:
        if not BDF_RE.match(bridge):
            raise ModelError(
                f"{where}: bridge {bridge!r} in parent is not a PCI address 0000:bb:dd.f"
            )
    return parts


def _bdf(value: str, where: str) -> str:
    if not BDF_RE.match(value):
        raise ModelError(f"{where}: bus {value!r} is not a PCI address in sysfs form 0000:bb:dd.f")
    return value


@dataclass(frozen=True)
class PciEndpoint:
    """A PCI function with its place in the tree."""

    bus: str
    """sysfs form, ``0000:1b:00.0``."""
    numa: int
    parent: tuple[str, ...]
    """Root complex (``pci0000:16``) then each bridge from the root port down."""

    @property
    def root(self) -> str:
        return self.parent[0]


@dataclass(frozen=True)
class GpuSlot(PciEndpoint):
    spec: GpuSpec
    index: int
    uuid: str
    serial: str


@dataclass(frozen=True)
class NicSlot(PciEndpoint):
    name: str
    """RDMA device name, ``mlx5_0``."""
    model: str
    link_layer: str
    """``InfiniBand`` or ``Ethernet``."""
    netdev: str

    @property
    def device_id(self) -> int:
        return NIC_DEVICE_IDS[self.model]


@dataclass(frozen=True)
class SwitchSlot(PciEndpoint):
    """An NVSwitch visible on PCIe (class 0x068000)."""


@dataclass(frozen=True)
class NvlinkBridge:
    gpus: tuple[str, str]
    links: int


@dataclass(frozen=True)
class NodeModel:
    name: str
    description: str
    hostname: str
    driver_version: str
    cuda_driver_version: int
    default_mig_layout: str
    numa_nodes: dict[int, str]
    """NUMA node id -> cpulist (``0-55,112-167``)."""
    nvlink_kind: str
    """``nvswitch``, ``bridge`` or ``none``."""
    switch_device_id: int | None
    bridges: tuple[NvlinkBridge, ...]
    gpus: tuple[GpuSlot, ...]
    nics: tuple[NicSlot, ...]
    nvswitches: tuple[SwitchSlot, ...]

    def gpu_by_bus(self, bus: str) -> GpuSlot:
        for g in self.gpus:
            if g.bus == bus:
                return g
        raise KeyError(bus)


def _stable_uuid(*parts: str) -> str:
    return str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, "tessera-sim/" + "/".join(parts)))


def parse_model(
    raw: dict[str, Any], source: str = "<model>", specs: Mapping[str, GpuSpec] | None = None
) -> NodeModel:
    """Validate one model document and build the typed model. GPUs get NVML indices in bus order.
    Products are looked up in ``specs`` (default: the bundled ``gpus.yaml``)."""
    try:
        name = str(raw["name"])
        specs = gpu_specs() if specs is None else specs
        gpu_rows = sorted(raw.get("gpus", []), key=lambda r: str(r["bus"]))
        gpus: list[GpuSlot] = []
        for i, r in enumerate(gpu_rows):
            where = f"{source}: gpus[{i}]"
            product = str(r["product"])
            if product not in specs:
                raise ModelError(f"{where}: unknown product {product!r}; known: {', '.join(specs)}")
            bus = _bdf(str(r["bus"]), where)
            gpus.append(
                GpuSlot(
                    bus=bus,
                    numa=int(r["numa"]),
                    parent=_parent(str(r["parent"]), where),
                    spec=specs[product],
                    index=i,
                    uuid="GPU-" + _stable_uuid(name, bus),
                    serial=str(r.get("serial", f"{1650000000000 + i * 7919 + int(bus[5:7], 16)}")),
                )
            )
        nics = tuple(
            NicSlot(
                bus=_bdf(str(r["bus"]), f"{source}: nics[{i}]"),
                numa=int(r["numa"]),
                parent=_parent(str(r["parent"]), f"{source}: nics[{i}]"),
                name=str(r["name"]),
                model=str(r["model"]),
                link_layer=str(r["linkLayer"]),
                netdev=str(r["netdev"]),
            )
            for i, r in enumerate(raw.get("nics", []))
        )
        for n in nics:
            if n.model not in NIC_DEVICE_IDS:
                raise ModelError(f"{source}: NIC {n.name} has unknown model {n.model!r}")
        switches = tuple(
            SwitchSlot(
                bus=_bdf(str(r["bus"]), f"{source}: nvswitches[{i}]"),
                numa=int(r["numa"]),
                parent=_parent(str(r["parent"]), f"{source}: nvswitches[{i}]"),
            )
            for i, r in enumerate(raw.get("nvswitches", []))
        )
        nv = raw.get("nvlink", {"kind": "none"})
        kind = str(nv["kind"])
        if kind not in ("nvswitch", "bridge", "none"):
            raise ModelError(f"{source}: nvlink.kind {kind!r} must be nvswitch, bridge or none")
        bridges = tuple(
            NvlinkBridge(gpus=(str(b["gpus"][0]), str(b["gpus"][1])), links=int(b["links"]))
            for b in nv.get("bridges", [])
        )
        model = NodeModel(
            name=name,
            description=str(raw["description"]),
            hostname=str(raw.get("hostname", name)),
            driver_version=str(raw["driverVersion"]),
            cuda_driver_version=int(raw["cudaDriverVersion"]),
            default_mig_layout=str(raw.get("defaultMigLayout", "none")),
            numa_nodes={int(k): str(v) for k, v in raw["numaNodes"].items()},
            nvlink_kind=kind,
            switch_device_id=int(nv["switchDeviceId"]) if "switchDeviceId" in nv else None,
            bridges=bridges,
            gpus=tuple(gpus),
            nics=nics,
            nvswitches=switches,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"{source}: malformed model: {exc!r}") from exc
    buses = [d.bus for d in (*model.gpus, *model.nics, *model.nvswitches)]
    if len(set(buses)) != len(buses):
        raise ModelError(f"{source}: duplicate PCI bus ids in model")
    for d in (*model.gpus, *model.nics, *model.nvswitches):
        if d.numa not in model.numa_nodes:
            raise ModelError(f"{source}: device {d.bus} is on NUMA node {d.numa}, not in numaNodes")
    for b in model.bridges:
        for bus in b.gpus:
            if bus not in {g.bus for g in model.gpus}:
                raise ModelError(f"{source}: NVLink bridge names {bus}, which is not a GPU")
    return model


def model_names() -> list[str]:
    """Names of the bundled models, sorted."""
    files = resources.files("agent.sim").joinpath("models").iterdir()
    return sorted(f.name.removesuffix(".yaml") for f in files if f.name.endswith(".yaml"))


def load_model(name: str) -> NodeModel:
    """Load a bundled model by name (``dgx-h100``) or a model file by path."""
    if name.endswith((".yaml", ".yml")):
        try:
            with open(name) as f:
                text = f.read()
        except OSError as exc:
            raise ModelError(f"cannot read node model file {name!r}: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            raise ModelError(f"node model file {name!r} is not UTF-8 text: {exc.reason}") from exc
        source = name
    else:
        if name not in model_names():
            raise ModelError(
                f"unknown simulated node model {name!r}; choose one of: {', '.join(model_names())}"
            )
        text = resources.files("agent.sim").joinpath("models", f"{name}.yaml").read_text()
        source = f"{name}.yaml"
    try:
        raw = yaml.load(text, Loader=YamlLoader)  # libyaml: a model loads in 1/8 the time
    except yaml.YAMLError as exc:
        raise ModelError(f"{source} is not valid YAML: {' '.join(str(exc).split())}") from exc
    if not isinstance(raw, dict):
        raise ModelError(f"{source}: a node model must be a YAML mapping")
    return parse_model(raw, source)
