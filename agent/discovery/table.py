"""Human-readable inventory tables for `tessera discover` (rich)."""

from __future__ import annotations

from typing import IO

from rich.console import Console
from rich.table import Table

from agent.discovery.inventory import NodeInventory

GIB = 1024**3


def render_table(inv: NodeInventory, out: IO[str]) -> None:
    # data, not markup: rich must not turn bus ids into emoji (0000:cd:00.0) or [x] into styles
    console = Console(
        file=out, width=140, no_color=not out.isatty(), highlight=False, markup=False, emoji=False
    )
    console.print(
        f"Node {inv.hostname}: {len(inv.gpus)} GPUs, {len(inv.nics)} NICs, "
        f"{len(inv.numa_nodes)} NUMA nodes; driver {inv.system.driver_version}, "
        f"CUDA {inv.system.cuda_driver_version}"
    )
    gpus = Table(title="GPUs", title_justify="left")
    for col in (
        "GPU",
        "Product",
        "Memory",
        "PCI bus",
        "NUMA",
        "CPUs",
        "PCIe root",
        "NVLink",
        "MIG",
    ):
        gpus.add_column(col)
    for g in inv.gpus:
        d = g.device
        if not d.mig_capable:
            mig = "-"
        elif d.mig_enabled:
            mig = ", ".join(m.profile_name for m in d.mig_instances) or "enabled (empty)"
        else:
            mig = "disabled" + (
                " (enable pending reset)" if d.mig_mode and d.mig_mode.pending else ""
            )
        gpus.add_row(
            str(d.index),
            d.name,
            f"{d.memory.total / GIB:.1f} GiB",
            g.pcie.bus_id,
            "-" if g.pcie.numa_node is None else str(g.pcie.numa_node),
            g.pcie.cpus or "-",
            g.pcie.pcie_root,
            f"{g.nvlink_clique} ({g.nvlink_links} links)" if g.nvlink_clique else "-",
            mig,
        )
    console.print(gpus)
    if inv.nics:
        nics = Table(title="NICs", title_justify="left")
        for col in ("NIC", "Netdev", "Link", "PCI bus", "NUMA", "PCIe root"):
            nics.add_column(col)
        for n in inv.nics:
            nics.add_row(
                n.name,
                n.netdev or "-",
                n.link_layer or "-",
                n.pcie.bus_id,
                "-" if n.pcie.numa_node is None else str(n.pcie.numa_node),
                n.pcie.pcie_root,
            )
        console.print(nics)
