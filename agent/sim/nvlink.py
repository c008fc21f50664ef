"""The simulated NVLink fabric: which link of which GPU goes where (pure, from the model)."""

from __future__ import annotations

from dataclasses import dataclass

import pynvml

from agent.sim.model import NodeModel


@dataclass(frozen=True)
class LinkEnd:
    """The far end of an active NVLink."""

    bus: str
    """sysfs form."""
    device_type: int
    pci_device_id: int


def nvlink_table(model: NodeModel) -> dict[int, tuple[LinkEnd | None, ...]]:
    """Per GPU index, its links (None = inactive); empty for products without NVLink (pure).

    ``nvswitch`` models: every link is active and goes to a switch, links spread round-robin
    over the model's NVSwitches. ``bridge`` models: a bridged pair's first ``links`` links go to
    the peer GPU; other links are inactive. ``none``: all links inactive.
    """
    table: dict[int, tuple[LinkEnd | None, ...]] = {}
    by_bus = {g.bus: g for g in model.gpus}
    for g in model.gpus:
        ends: list[LinkEnd | None] = [None] * g.spec.nvlinks
        if model.nvlink_kind == "nvswitch" and model.nvswitches:
            switch_id = model.switch_device_id or 0
            for link in range(g.spec.nvlinks):
                sw = model.nvswitches[link % len(model.nvswitches)]
                ends[link] = LinkEnd(sw.bus, pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH, switch_id)
        elif model.nvlink_kind == "bridge":
            for bridge in model.bridges:
                if g.bus in bridge.gpus:
                    peer = by_bus[bridge.gpus[1] if bridge.gpus[0] == g.bus else bridge.gpus[0]]
                    for link in range(min(bridge.links, g.spec.nvlinks)):
                        ends[link] = LinkEnd(
                            peer.bus, pynvml.NVML_NVLINK_DEVICE_TYPE_GPU, peer.spec.pci_device_id
                        )
        table[g.index] = tuple(ends)
    return table
