"""The simulator's side of ``make gpu-check``: a simulated node of the real node's products.

:func:`reference_model` writes the node model the simulator would need to be the real node: one
GPU of the matching product (``agent/sim/gpus.yaml``, by PCI device id, then name) at each real
GPU's PCI address, with the real NVLink wiring, driver and CUDA versions, and loads it through
the simulator's own model loader. :func:`mirror_state` then gives the simulated GPUs the real
ones' MIG mode, GPU and compute instances and compute mode, with the simulator's NVML calls.
What differs afterwards is the simulator's model of the product, which is what the check is for.

Only the simulator is changed here: :func:`mirror_state` takes a :class:`FakeNvml` and nothing
else.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from agent.discovery.inventory import Gpu, NodeInventory
from agent.node import NodeSource
from agent.nvml.facade import Nvml
from agent.sim.errors import ModelError
from agent.sim.model import BDF_RE, ROOT_RE, NodeModel, load_model, model_names, parse_model
from agent.sim.nvml import FakeNvml
from agent.sim.specs import GpuSpec
from bench.gpu_check.probe import GpuState

REFERENCE_MODEL = "gpu-check-reference"
_FALLBACK_PARENT = "pci0000:00"


@dataclass(frozen=True)
class Match:
    """A real GPU and the simulator product that models it (None: no product does)."""

    index: int
    bus: str
    name: str
    pci_device_id: int
    product: str | None
    models: tuple[str, ...]
    """The bundled node models that have this product."""

    def json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "pciBusId": self.bus,
            "name": self.name,
            "pciDeviceId": f"0x{self.pci_device_id:08X}",
            "simulatorProduct": self.product,
            "simulatorModels": list(self.models),
        }


def match_products(inv: NodeInventory, specs: Mapping[str, GpuSpec]) -> tuple[Match, ...]:
    """Each real GPU's product in ``specs``: by PCI device id (one id can be two products: then
    the one of the same name), else by name."""
    users = _models_by_product()
    out: list[Match] = []
    for gpu in sorted(inv.gpus, key=lambda g: g.device.index):
        d = gpu.device
        same_id = [k for k, s in specs.items() if s.pci_device_id == d.pci_device_id]
        same_name = [k for k, s in specs.items() if s.name == d.name]
        both = [k for k in same_id if k in same_name]
        candidates = both or same_id or same_name
        found = candidates[0] if candidates else None
        models = tuple(users.get(found, ())) if found else ()
        out.append(Match(d.index, d.pci_bus_id, d.name, d.pci_device_id, found, models))
    return tuple(out)


def _models_by_product() -> dict[str, list[str]]:
    users: dict[str, list[str]] = {}
    for name in model_names():
        for key in sorted({g.spec.key for g in load_model(name).gpus}):
            users.setdefault(key, []).append(name)
    return users


def _parent(gpu: Gpu) -> str:
    path = gpu.pcie.path
    if path and ROOT_RE.match(path[0]) and all(BDF_RE.match(b) for b in path[1:]):
        return "/".join(path)
    return _FALLBACK_PARENT


def _nvlink(inv: NodeInventory, buses: set[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The model's ``nvlink`` and ``nvswitches``: switches where real links reach switches,
    bridges where they reach another GPU of the node, else none."""
    switches: set[str] = set()
    pairs: dict[tuple[str, str], int] = {}
    for gpu in inv.gpus:
        for link in gpu.device.nvlinks:
            remote = link.remote_pci_bus_id
            if not link.active or remote is None:
                continue
            if link.remote_device_type == "switch":
                switches.add(remote)
            elif link.remote_device_type == "gpu" and remote in buses:
                pair = (min(gpu.device.pci_bus_id, remote), max(gpu.device.pci_bus_id, remote))
                pairs[pair] = pairs.get(pair, 0) + 1
    usable = sorted(b for b in switches if BDF_RE.match(b) and b not in buses)
    if usable:
        rows = [{"bus": b, "numa": 0, "parent": _FALLBACK_PARENT} for b in usable]
        return {"kind": "nvswitch"}, rows
    if pairs:
        # each side counted the pair's links once
        bridges = [{"gpus": list(p), "links": n // 2 or n} for p, n in sorted(pairs.items())]
        return {"kind": "bridge", "bridges": bridges}, []
    return {"kind": "none"}, []


def reference_model(
    inv: NodeInventory,
    matches: Sequence[Match],
    specs: Mapping[str, GpuSpec],
    cuda_driver_version: int,
    source: str,
) -> NodeModel | None:
    """The simulated twin of the real node (its matched GPUs only); None when no GPU matched.
    Raises ModelError when the simulator's loader rejects it."""
    product = {m.bus: m.product for m in matches}
    gpus = [g for g in inv.gpus if product.get(g.device.pci_bus_id)]
    if not gpus:
        return None
    numas = sorted({g.pcie.numa_node or 0 for g in gpus})
    nvlink, switches = _nvlink(inv, {g.device.pci_bus_id for g in gpus})
    raw: dict[str, Any] = {
        "name": REFERENCE_MODEL,
        "description": f"the simulator's model of {inv.hostname}'s GPUs, from {source}",
        "hostname": inv.hostname,
        "driverVersion": inv.system.driver_version,
        "cudaDriverVersion": cuda_driver_version,
        "defaultMigLayout": "none",
        "numaNodes": dict.fromkeys(numas, "0"),
        "nvlink": nvlink,
        "gpus": [
            {
                "bus": g.device.pci_bus_id,
                "product": product[g.device.pci_bus_id],
                "numa": g.pcie.numa_node or 0,
                "parent": _parent(g),
            }
            for g in gpus
        ],
        "nvswitches": switches,
    }
    try:
        return parse_model(raw, source, specs)
    except ModelError:
        if not switches:
            raise
        raw["nvlink"], raw["nvswitches"] = {"kind": "none"}, []  # wiring the model cannot hold
        return parse_model(raw, source, specs)


def reference_node(model: NodeModel, state_dir: Path, real: NodeSource) -> NodeSource:
    """The simulator of ``model`` (NVML not initialized yet), reading the real node's sysfs:
    PCIe places and NUMA nodes are the real ones, only NVML is simulated."""
    fake = FakeNvml(model, state_dir)
    return NodeSource(
        nvml=Nvml(fake),
        sysfs_root=real.sysfs_root,
        hostname=real.hostname,
        model=model.name,
        driver_root=real.driver_root,
        boot_id="gpu-check",
        boot_time=0.0,
        sim=fake,
        proc_root=fake.proc_root,
    )


def sim_indices(model: NodeModel) -> dict[str, int]:
    """PCI bus id -> the simulated GPU's NVML index."""
    return {g.bus: g.index for g in model.gpus}


def mirror_state(
    fake: FakeNvml, states: Sequence[GpuState], index_of: Mapping[str, int]
) -> dict[int, str]:
    """Give each simulated GPU its real GPU's MIG mode, instances and compute mode (in the real
    GPU instances' id order, each at its real placement). Returns, per real GPU index, why the
    simulator cannot hold that state (an NVML error of the simulator's rules)."""
    problems: dict[int, str] = {}
    for state in states:
        j = index_of.get(state.bus)
        if j is None:
            continue
        try:
            _mirror_gpu(fake, j, state)
        except pynvml.NVMLError as exc:
            notes = " ".join(getattr(exc, "__notes__", []))
            problems[state.index] = f"<cannot reproduce: {exc}{': ' + notes if notes else ''}>"
    return problems


def _mirror_gpu(fake: FakeNvml, j: int, state: GpuState) -> None:
    h = fake.nvmlDeviceGetHandleByIndex(j)
    if isinstance(state.compute_mode, int) and state.compute_mode != fake.nvmlDeviceGetComputeMode(
        h
    ):
        fake.nvmlDeviceSetComputeMode(h, state.compute_mode)
    if not isinstance(state.mig_mode, list):
        return
    current, pending = state.mig_mode
    if current:
        fake.nvmlDeviceSetMigMode(h, 1)
        if not fake.nvmlDeviceGetMigMode(h)[0]:  # Ampere: MIG mode applies at a GPU reset
            fake.reset_gpu(j)
    if not isinstance(state.gpu_instances, str):
        for gi in sorted(state.gpu_instances, key=lambda g: g.id):
            where = pynvml.c_nvmlGpuInstancePlacement_t(gi.start, gi.size)
            gih = fake.nvmlDeviceCreateGpuInstanceWithPlacement(
                h, gi.profile_id, ctypes.byref(where)
            )
            for ci in sorted(gi.compute_instances, key=lambda c: c.id):
                at = pynvml.c_nvmlComputeInstancePlacement_t(ci.start, ci.size)
                fake.nvmlGpuInstanceCreateComputeInstanceWithPlacement(
                    gih, ci.profile_id, ctypes.byref(at)
                )
    if pending != current:
        fake.nvmlDeviceSetMigMode(h, pending)
