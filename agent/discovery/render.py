"""Human views of a NodeInventory: the ``nvidia-smi topo -m`` matrix and a Graphviz DOT graph.

Both functions are pure: they format the inventory and read nothing else.
"""

from __future__ import annotations

import itertools

from agent.discovery.inventory import NodeInventory, PcieLocation

LEGEND = (
    "Legend:",
    "",
    "  X    = Self",
    "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes"
    " (e.g., QPI/UPI)",
    "  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges"
    " within a NUMA node",
    "  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)",
    "  PXB  = Connection traversing multiple PCIe bridges"
    " (without traversing the PCIe Host Bridge)",
    "  PIX  = Connection traversing at most a single PCIe bridge",
    "  NV#  = Connection traversing a bonded set of # NVLinks",
)
"""nvidia-smi's legend, word for word."""

NVLINK_COLOR = "#76b900"


def _cpu_affinity(inv: NodeInventory, loc: PcieLocation) -> str:
    if loc.cpus:
        return loc.cpus
    for n in inv.numa_nodes:
        if n.id == loc.numa_node and n.cpus:
            return n.cpus
    return "N/A"


def render_matrix(inv: NodeInventory) -> str:
    """The topology matrix as ``nvidia-smi topo -m`` prints it (tab-separated).

    Rows and columns are GPU0..n then NIC0..m; GPU rows end with the CPU Affinity, NUMA Affinity
    and GPU NUMA ID columns (the last is ``N/A``: only Grace-style GPUs are NUMA nodes). Then the
    legend, and a NIC legend mapping NIC# to the NIC names when there are NICs.
    """
    labels = inv.topology.labels
    nic_label = {n.name: f"NIC{i}" for i, n in enumerate(inv.nics)}
    shown = [nic_label.get(label, label) for label in labels]
    gpu_by_label = {f"GPU{g.index}": g for g in inv.gpus}
    lines = ["\t".join(["", *shown, "CPU Affinity", "NUMA Affinity", "GPU NUMA ID"])]
    for label, name, row in zip(labels, shown, inv.topology.levels, strict=True):
        cells = [" X " if level == "X" else level for level in row]
        gpu = gpu_by_label.get(label)
        if gpu is not None:
            numa = "N/A" if gpu.pcie.numa_node is None else str(gpu.pcie.numa_node)
            tail = [_cpu_affinity(inv, gpu.pcie), numa, "", "N/A"]
        else:
            tail = ["", "", "", ""]
        lines.append("\t".join([name, *cells, *tail]))
    lines += ["", *LEGEND]
    if inv.nics:
        lines += ["", "NIC Legend:", ""]
        lines += [f"  NIC{i}: {n.name}" for i, n in enumerate(inv.nics)]
    return "\n".join(lines) + "\n"


def _esc(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _q(text: str) -> str:
    """A DOT quoted ID."""
    return f'"{_esc(text)}"'


def _label(*lines: str) -> str:
    """A DOT label of several lines."""
    return '"' + "\\n".join(_esc(line) for line in lines) + '"'


def render_dot(inv: NodeInventory) -> str:
    """A Graphviz ``graph``: one cluster per NUMA node (with a node for its CPUs), inside it one
    cluster per root complex holding its bridges and devices; PCIe edges follow the tree
    (NUMA node -- root complex -- bridges -- device); NVLink edges join GPUs, labelled ``NV#``.
    """
    devices: list[tuple[str, str, PcieLocation]] = []
    for g in inv.gpus:
        attrs = (
            f"shape=box, style=filled, fillcolor={_q(NVLINK_COLOR)}, "
            f"label={_label(f'GPU{g.index}', g.device.name, g.pcie.bus_id)}"
        )
        devices.append((f"GPU{g.index}", attrs, g.pcie))
    for n in inv.nics:
        detail = n.netdev or ""
        if n.link_layer:
            detail = f"{detail} ({n.link_layer})".strip()
        attrs = f"shape=box, style=rounded, label={_label(n.name, detail, n.pcie.bus_id)}"
        devices.append((n.name, attrs, n.pcie))

    root_numa: dict[str, int | None] = {}
    members: dict[str, list[str]] = {}
    edges: dict[tuple[str, str], None] = {}  # an ordered set
    for node_id, attrs, loc in devices:
        root = loc.pcie_root
        if root not in members:
            members[root] = [f"{_q(root)} [shape=box3d, label={_label(root, 'host bridge')}];"]
            root_numa[root] = loc.numa_node
        for bridge in loc.path[1:]:
            stmt = f"{_q(bridge)} [shape=ellipse, fontsize=9, label={_q(bridge)}];"
            if stmt not in members[root]:
                members[root].append(stmt)
        members[root].append(f"{_q(node_id)} [{attrs}];")
        chain = [*loc.path, node_id]
        edges.update(dict.fromkeys(itertools.pairwise(chain)))

    numa_ids = sorted(
        {n.id for n in inv.numa_nodes} | {r for r in root_numa.values() if r is not None}
    )
    numa_cpus = {n.id: n.cpus for n in inv.numa_nodes}
    out = [
        f"graph {_q(inv.hostname)} {{",
        f"  graph [label={_q(inv.hostname)}, labelloc=t, fontname=Helvetica, compound=true];",
        "  node [fontname=Helvetica, fontsize=10];",
    ]

    def cluster(root: str, indent: str) -> list[str]:
        body = [f"{indent}subgraph {_q('cluster_' + root)} {{", f"{indent}  label={_q(root)};"]
        body += [f"{indent}  {stmt}" for stmt in members[root]]
        return [*body, f"{indent}}}"]

    for numa in numa_ids:
        out.append(f"  subgraph {_q(f'cluster_numa{numa}')} {{")
        out.append(f"    label={_q(f'NUMA {numa}')};")
        cpus = numa_cpus.get(numa) or "unknown"
        out.append(
            f"    {_q(f'NUMA{numa}')} [shape=component, label={_label(f'NUMA {numa}', cpus)}];"
        )
        for root in sorted(r for r, n in root_numa.items() if n == numa):
            out += cluster(root, "    ")
        out.append("  }")
    for root in sorted(r for r, n in root_numa.items() if n is None):
        out += cluster(root, "  ")

    for a, b in itertools.pairwise(numa_ids):
        out.append(f"  {_q(f'NUMA{a}')} -- {_q(f'NUMA{b}')} [style=dashed, label=SYS];")
    for root, root_node in sorted(root_numa.items()):
        if root_node is not None:
            out.append(f"  {_q(f'NUMA{root_node}')} -- {_q(root)} [style=bold];")
    out += [f"  {_q(a)} -- {_q(b)};" for a, b in edges]
    for e in inv.nvlink_edges:
        out.append(
            f"  {_q(f'GPU{e.a}')} -- {_q(f'GPU{e.b}')} [label={_q(f'NV{e.links}')}, "
            f"color={_q(NVLINK_COLOR)}, penwidth=2, constraint=false];"
        )
    out.append("}")
    return "\n".join(out) + "\n"
