"""The inventory as plain JSON-able data (what `tessera discover -o json|yaml` prints). Pure."""

from __future__ import annotations

from typing import Any

from agent.discovery.inventory import Gpu, NodeInventory, PcieLocation
from agent.nvml.types import MigInstance


def _pcie(loc: PcieLocation) -> dict[str, Any]:
    return {
        "pciBusID": loc.bus_id,
        "pcieRoot": loc.pcie_root,
        "pciePath": list(loc.path),
        "numaNode": loc.numa_node,
        "cpus": loc.cpus,
    }


def _mig(m: MigInstance) -> dict[str, Any]:
    return {
        "uuid": m.uuid,
        "profile": m.profile_name,
        "profileId": m.profile_id,
        "gpuInstance": m.gpu_instance_id,
        "computeInstance": m.compute_instance_id,
        "placement": {"start": m.placement.start, "size": m.placement.size},
        "memoryBytes": m.memory_bytes,
        "multiprocessors": m.multiprocessors,
    }


def _gpu(g: Gpu) -> dict[str, Any]:
    d = g.device
    return {
        "index": d.index,
        "minor": d.minor,
        "uuid": d.uuid,
        "productName": d.name,
        "brand": d.brand,
        "architecture": d.architecture,
        "cudaComputeCapability": f"{d.compute_capability[0]}.{d.compute_capability[1]}",
        "memoryBytes": d.memory.total,
        "serial": d.serial,
        **_pcie(g.pcie),
        "nvlinkClique": g.nvlink_clique,
        "nvlinkLinks": g.nvlink_links,
        "nearNics": list(g.near_nics),
        "migCapable": d.mig_capable,
        "migEnabled": d.mig_enabled,
        "migPending": d.mig_mode.pending if d.mig_mode else None,
        "migDevices": [_mig(m) for m in d.mig_instances],
    }


def inventory_to_dict(inv: NodeInventory) -> dict[str, Any]:
    return {
        "hostname": inv.hostname,
        "driverVersion": inv.system.driver_version,
        "cudaDriverVersion": inv.system.cuda_driver_version,
        "numaNodes": [{"id": n.id, "cpus": n.cpus} for n in inv.numa_nodes],
        "gpus": [_gpu(g) for g in inv.gpus],
        "nics": [
            {
                "name": n.name,
                "netdev": n.netdev,
                "linkLayer": n.link_layer,
                "vendorID": f"0x{n.vendor_id:04x}",
                "deviceID": f"0x{n.device_id:04x}",
                **_pcie(n.pcie),
            }
            for n in inv.nics
        ],
        "nvlink": {
            "edges": [
                {"a": e.a, "b": e.b, "links": e.links, "via": e.via} for e in inv.nvlink_edges
            ],
            "cliques": [list(c) for c in inv.nvlink_cliques],
        },
        "topology": {
            "labels": list(inv.topology.labels),
            "matrix": {
                str(a): {str(b): lvl for b, lvl in row.items()}
                for a, row in inv.topology.gpu_matrix().items()
            },
        },
    }
