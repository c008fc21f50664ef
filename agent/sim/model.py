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

from agent.decode import fields as F
from agent.decode.bounds import YamlLoader
from agent.sim.errors import ModelError
from agent.sim.specs import GpuSpec, gpu_specs

BDF_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
ROOT_RE = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")

NIC_DEVICE_IDS = {"ConnectX-6": 0x101B, "ConnectX-6 Dx": 0x101D, "ConnectX-7": 0x1021}
MELLANOX_VENDOR = 0x15B3
NVIDIA_VENDOR = 0x10DE
VGPU_INTERFACES = ("vf", "mdev")
VM_MODELS = "vm"
"""The folder (under ``models/``) of the models of hosts for virtual machines (vGPU host
drivers): listed by :func:`vm_model_names`, not by :func:`model_names`, so that the tests and
tables that go over every container model stay as they are."""


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
    vgpu_interface: str | None = None
    """The host driver is NVIDIA's vGPU host driver offering vGPUs this way: ``vf`` (SR-IOV VFs
    with ``nvidia/current_vgpu_type``, Ada/Hopper and newer, vGPU 17+) or ``mdev`` (mediated
    devices on the GPU, before Ampere); None: the ordinary (bare-metal) driver."""

    def gpu_by_bus(self, bus: str) -> GpuSlot:
        for g in self.gpus:
            if g.bus == bus:
                return g
        raise KeyError(bus)


def _stable_uuid(*parts: str) -> str:
    return str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, "tessera-sim/" + "/".join(parts)))


def _scalar(value: object, path: str) -> str:
    """A string, or a number YAML read from unquoted text (``numaNodes: {0: 0}``), as text."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise F.expected("a string", value, path)
    return str(value)


def _endpoint(r: Mapping[str, Any], path: str) -> tuple[str, int, tuple[str, ...]]:
    """A device's bus, NUMA node and parent path."""
    where = path
    bus = _bdf(F.text(r.get("bus"), F.at(path, "bus"), nonempty=True), where)
    numa = F.integer(r.get("numa"), F.at(path, "numa"), low=0)
    parent = _parent(F.text(r.get("parent"), F.at(path, "parent"), nonempty=True), where)
    return bus, numa, parent


def _read_model(raw: Mapping[str, Any], specs: Mapping[str, GpuSpec] | None) -> NodeModel:
    """The model from its document, every field read by ``agent.decode.fields`` (its errors
    name the field path: ``gpus[0].numa: expected an integer, got a string: "zero"``)."""
    name = F.text(raw.get("name"), "name", nonempty=True)
    specs = gpu_specs() if specs is None else specs
    rows = F.objects(raw.get("gpus"), "gpus")
    keyed = sorted(
        (_bdf(F.text(r.get("bus"), f"gpus[{i}].bus", nonempty=True), f"gpus[{i}]"), i, r)
        for i, r in enumerate(rows)
    )
    gpus: list[GpuSlot] = []
    for index, (_, i, r) in enumerate(keyed):
        where = f"gpus[{i}]"
        product = F.text(r.get("product"), F.at(where, "product"), nonempty=True)
        if product not in specs:
            raise ModelError(f"{where}: unknown product {product!r}; known: {', '.join(specs)}")
        bus, numa, parent = _endpoint(r, where)
        serial = r.get("serial")
        gpus.append(
            GpuSlot(
                bus=bus,
                numa=numa,
                parent=parent,
                spec=specs[product],
                index=index,
                uuid="GPU-" + _stable_uuid(name, bus),
                serial=_scalar(serial, F.at(where, "serial"))
                if serial is not None
                else f"{1650000000000 + index * 7919 + int(bus[5:7], 16)}",
            )
        )
    nics = []
    for i, r in enumerate(F.objects(raw.get("nics"), "nics")):
        where = f"nics[{i}]"
        bus, numa, parent = _endpoint(r, where)
        nics.append(
            NicSlot(
                bus=bus,
                numa=numa,
                parent=parent,
                name=F.text(r.get("name"), F.at(where, "name"), nonempty=True),
                model=F.one_of(r.get("model"), F.at(where, "model"), list(NIC_DEVICE_IDS)),
                link_layer=F.text(r.get("linkLayer"), F.at(where, "linkLayer"), nonempty=True),
                netdev=F.text(r.get("netdev"), F.at(where, "netdev"), nonempty=True),
            )
        )
    switches = []
    for i, r in enumerate(F.objects(raw.get("nvswitches"), "nvswitches")):
        bus, numa, parent = _endpoint(r, f"nvswitches[{i}]")
        switches.append(SwitchSlot(bus=bus, numa=numa, parent=parent))
    nv = F.obj(raw.get("nvlink", {"kind": "none"}), "nvlink")
    kind = F.one_of(nv.get("kind"), "nvlink.kind", ("nvswitch", "bridge", "none"))
    bridges = []
    for i, b in enumerate(F.objects(nv.get("bridges"), "nvlink.bridges")):
        where = f"nvlink.bridges[{i}]"
        pair = F.texts(b.get("gpus"), F.at(where, "gpus"), required=True)
        if len(pair) != 2:
            raise F.FieldError(F.at(where, "gpus"), f"expected 2 GPU bus ids, got {len(pair)}")
        bridges.append(
            NvlinkBridge(
                gpus=(pair[0], pair[1]),
                links=F.integer(b.get("links"), F.at(where, "links"), low=1),
            )
        )
    switch_id = nv.get("switchDeviceId")
    vgpu = F.obj(raw.get("vgpu", {}), "vgpu")
    interface = F.one_of(vgpu.get("interface"), "vgpu.interface", VGPU_INTERFACES) if vgpu else None
    for i, g in enumerate(gpus):
        if interface is not None and not g.spec.vgpu_types:
            raise ModelError(f"gpus[{i}]: product {g.spec.key} has no vgpuTypes in gpus.yaml")
        if interface == "vf" and g.spec.sriov_total_vfs < max(
            t.max_instances for t in g.spec.vgpu_types
        ):
            raise ModelError(f"gpus[{i}]: product {g.spec.key} has too few SR-IOV VFs for vGPUs")
    numa_nodes = F.obj(raw.get("numaNodes"), "numaNodes")
    if not numa_nodes:
        raise F.FieldError("numaNodes", "missing; expected {node: cpu list}, e.g. {0: '0-23'}")
    return NodeModel(
        name=name,
        description=_scalar(raw.get("description"), "description"),
        hostname=_scalar(raw.get("hostname", name), "hostname"),
        driver_version=_scalar(raw.get("driverVersion"), "driverVersion"),
        cuda_driver_version=F.integer(raw.get("cudaDriverVersion"), "cudaDriverVersion", low=1),
        default_mig_layout=F.text(raw.get("defaultMigLayout", "none"), "defaultMigLayout"),
        numa_nodes={
            F.integer(k, f"numaNodes.{F.field_name(k)}", low=0): _scalar(
                v, f"numaNodes.{F.field_name(k)}"
            )
            for k, v in numa_nodes.items()
        },
        nvlink_kind=kind,
        switch_device_id=None
        if switch_id is None
        else F.integer(switch_id, "nvlink.switchDeviceId", low=0),
        bridges=tuple(bridges),
        gpus=tuple(gpus),
        nics=tuple(nics),
        nvswitches=tuple(switches),
        vgpu_interface=interface,
    )


def parse_model(
    raw: dict[str, Any], source: str = "<model>", specs: Mapping[str, GpuSpec] | None = None
) -> NodeModel:
    """Validate one model document and build the typed model. GPUs get NVML indices in bus order.
    Products are looked up in ``specs`` (default: the bundled ``gpus.yaml``)."""
    try:
        model = _read_model(raw, specs)
    except F.FieldError as exc:  # the field's place, what is wrong and what is allowed
        raise ModelError(f"{source}: {exc}") from exc
    except ModelError as exc:
        raise ModelError(f"{source}: {exc}") from exc
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


def _yaml_names(*folder: str) -> list[str]:
    files = resources.files("agent.sim").joinpath("models", *folder).iterdir()
    return sorted(f.name.removesuffix(".yaml") for f in files if f.name.endswith(".yaml"))


def model_names() -> list[str]:
    """Names of the bundled node models, sorted (the hosts for VMs are :func:`vm_model_names`)."""
    return _yaml_names()


def vm_model_names() -> list[str]:
    """Names of the bundled models of hosts running NVIDIA's vGPU host driver, sorted."""
    return _yaml_names(VM_MODELS)


def all_model_names() -> list[str]:
    """Every bundled model: :func:`model_names` then :func:`vm_model_names`."""
    return [*model_names(), *vm_model_names()]


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
        if name not in all_model_names():
            raise ModelError(
                f"unknown simulated node model {name!r}; choose one of:"
                f" {', '.join(all_model_names())}"
            )
        folder = (VM_MODELS,) if name in vm_model_names() else ()
        text = resources.files("agent.sim").joinpath("models", *folder, f"{name}.yaml").read_text()
        source = f"{name}.yaml"
    try:
        raw = yaml.load(text, Loader=YamlLoader)  # libyaml: a model loads in 1/8 the time
    except yaml.YAMLError as exc:
        raise ModelError(f"{source} is not valid YAML: {' '.join(str(exc).split())}") from exc
    if not isinstance(raw, dict):
        raise ModelError(f"{source}: a node model must be a YAML mapping")
    return parse_model(raw, source)
