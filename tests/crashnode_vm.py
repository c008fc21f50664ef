"""What a crash of the agent must never leave behind on a node that hands GPUs to virtual machines
(``--virtualization``), read from the simulated node's sysfs the way the agent reads it
(:mod:`agent.pcihost`): every GPU either bound to nvidia and free, or bound to vfio-pci and
recorded for its claim; the vGPUs exactly the recorded ones; the KEP-5304 device metadata exactly
that of the completed VM claims. :func:`tests.crashnode.node_violations` adds these."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from agent.pcihost import attrs
from agent.pcihost.read import read_gpu_functions
from agent.pcihost.vm_types import NVIDIA, VFIO_PCI
from agent.sim.model import NodeModel
from dra_driver.kubeletplugin.checkpoint import VFIO, VGPU, ClaimEntry
from dra_driver.vm.passthrough import same_device
from tests.integration.daemon import DRIVER, Daemon
from tests.simnode import node_model

METADATA_DIR = "dra-device-metadata"
"""Under the plugin's directory: ``<namespace>_<claim>/<request>/metadata.json`` (KEP-5304)."""


def sys_root(d: Daemon) -> Path:
    """The simulated node's sysfs (``simulated_node`` writes it under the simulator's dir)."""
    return d.state / "sim" / "sys"


def gpu_drivers(d: Daemon) -> dict[str, str | None]:
    """The driver each GPU of the node is bound to now (None: unbound), by BDF."""
    root = sys_root(d)
    return {gpu.bus: attrs.bound_driver(root, gpu.bus) for gpu in node_model(d.model).gpus}


def vm_violations(d: Daemon, model: NodeModel, claims: Mapping[str, ClaimEntry]) -> list[str]:
    """Everything wrong with the VM side of the node of the idle daemon ``d`` against the
    checkpoint's ``claims`` (every one completed), one line each:

    - each function a claim records for vfio (the GPU and the other functions of its IOMMU
      group) is bound to vfio-pci through ``driver_override`` ``vfio-pci``, and recorded by one
      claim only;
    - every other GPU is bound to nvidia with its ``driver_override`` cleared, and no other
      function of its group is left on vfio-pci or with an override (a crash between the
      unbind and the bind leaves a GPU unbound: that shows here);
    - the vGPUs (VFs with a type, mdevs) on the GPUs are exactly the recorded ones, of the
      recorded type and at the recorded VF or UUID, and every VF keeps its override cleared.
    """
    root = sys_root(d)
    out: list[str] = []
    vfio: dict[str, list[str]] = {}
    vgpus: dict[tuple[str, int | None, str | None], list[str]] = {}
    for uid, e in sorted(claims.items()):
        for dev in e.devices:
            if dev.kind == VFIO:
                for bdf, _ in dev.vfio_functions:
                    vfio.setdefault(bdf, []).append(uid)
                if not dev.vfio_functions:
                    out.append(f"claim {uid}: {dev.device} records no function it rebound")
            elif dev.kind == VGPU:
                if dev.pci_bus_id is None or dev.vgpu_type_id is None:
                    out.append(f"claim {uid}: {dev.device} records no vGPU it made")
                    continue
                key = (dev.pci_bus_id, dev.vgpu_type_id, dev.mdev_uuid)
                vgpus.setdefault(key, []).append(uid)
    out += [f"{bdf} recorded for vfio by several claims: {uids}" for bdf, uids in vfio.items()
            if len(uids) > 1]  # fmt: skip
    out += [f"vGPU {key} recorded by several claims: {uids}" for key, uids in vgpus.items()
            if len(uids) > 1]  # fmt: skip
    made: set[tuple[str, int | None, str | None]] = set()
    for gpu in model.gpus:
        fn = read_gpu_functions(root, gpu.bus)
        own = sorted({gpu.bus, *(m for m in fn.group_members if same_device(m, gpu.bus))})
        for bdf in own:
            out += _binding(root, bdf, bdf == gpu.bus, vfio.get(bdf))
        for vf in fn.vgpu_functions:
            if vf != gpu.bus and attrs.driver_override(root, vf) is not None:
                out.append(f"VF {vf}: driver_override {attrs.driver_override(root, vf)!r} set")
        made |= {(v.function, v.type_id, v.mdev_uuid) for v in fn.vgpus}
    if made != set(vgpus):
        out.append(
            f"vGPUs on the node {sorted(made, key=str)} != recorded {sorted(vgpus, key=str)}"
            " ((function, type, mdev UUID))"
        )
    return out


def _binding(root: Path, bdf: str, is_gpu: bool, holders: list[str] | None) -> list[str]:
    driver = attrs.bound_driver(root, bdf)
    override = attrs.driver_override(root, bdf)
    what = "GPU" if is_gpu else "function"
    if holders:
        if (driver, override) != (VFIO_PCI, VFIO_PCI):
            return [
                f"{what} {bdf} of claim {holders[0]}: bound to {driver!r} with driver_override"
                f" {override!r}, not to vfio-pci through its override"
            ]
        return []
    if is_gpu and driver != NVIDIA:
        return [f"GPU {bdf}: no claim records it, yet it is bound to {driver!r}, not nvidia"]
    if driver == VFIO_PCI:
        return [f"function {bdf}: no claim records it, yet it is bound to vfio-pci"]
    if override is not None:
        return [f"{what} {bdf}: no claim records it, yet its driver_override is {override!r}"]
    return []


def metadata_violations(d: Daemon, claims: Mapping[str, ClaimEntry]) -> list[str]:
    """The KEP-5304 device metadata (its CDI specs in the CDI root, its files under the plugin's
    directory) is there for exactly the completed claims with a VM device, per base request."""
    want_specs: set[str] = set()
    want_files: set[str] = set()
    for uid, e in claims.items():
        requests = {
            r.split("/", 1)[0] for dev in e.devices if dev.kind in (VFIO, VGPU)
            for r in dev.request_names
        }  # fmt: skip
        want_specs |= {f"{DRIVER}_metadata_{uid}_{r}.json" for r in requests}
        want_files |= {f"{e.namespace}_{e.name}/{r}/metadata.json" for r in requests}
    specs = {p.name for p in d.cdi_dir.glob(f"{DRIVER}_metadata_*.json")}
    root = d.state / "kubelet" / "plugins" / DRIVER / METADATA_DIR
    files = {str(p.relative_to(root)) for p in root.glob("*/*/*")} if root.exists() else set()
    out = []
    if specs != want_specs:
        out.append(f"device metadata CDI specs {sorted(specs)} != expected {sorted(want_specs)}")
    if files != want_files:
        out.append(f"device metadata files {sorted(files)} != expected {sorted(want_files)}")
    return out
