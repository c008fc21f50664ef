"""One node's answer renamed for another node of its group (:mod:`dra_driver.scheduler.lookalike`).

The two nodes' slices differ only in names the claims cannot read (node, pool and slice names,
the pool's generation) and in attribute values no selector or constraint reads, and their
devices stand in the same order. So the search's outcome holds for both; what changes is where
each device is: its pool, slice, node and field path, the pool's name, generation and slice
names, each pick's device and its shareID (a digest of the device's pool), and the slices the
allocation's nodeSelector is made from. Device attributes keep the first node's values: only the
ones nobody reads differ, and an explanation shows only what was read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from dra_driver.scheduler.domain import Device, Node, Pool
from dra_driver.scheduler.explanation import Explanation
from dra_driver.scheduler.lookalike import NodeLabel
from dra_driver.scheduler.outcome import Attempt, Pick
from dra_driver.scheduler.search import share_id_of


def renamed_node(node: Node, label: NodeLabel) -> Node | None:
    """``node`` (the first member's, parsed) with ``label``'s names; None when its pools do
    not line up with the label's (then the node is evaluated on its own)."""
    if len(node.pools) != len(label.pools):
        return None
    devices: list[Device] = []
    pools: list[Pool] = []
    for pool, new in zip(node.pools, label.pools, strict=True):
        if pool.problem is not None or pool.driver != new.driver:
            return None
        if len(pool.slices) != len(new.slices):
            return None
        slice_names = dict(zip(pool.slices, new.slices, strict=True))
        pool_devices = []
        for dev in pool.devices:
            sname = slice_names[dev.slice_name]
            old_base, new_base = f"ResourceSlice {dev.slice_name}.", f"ResourceSlice {sname}."
            moved = dataclasses.replace(
                dev,
                pool=new.name,
                slice_name=sname,
                node_name=label.node if dev.node_name else "",
                path=dev.path.replace(old_base, new_base, 1),
            )
            pool_devices.append(moved)
        pools.append(
            dataclasses.replace(
                pool,
                name=new.name,
                generation=new.generation,
                slices=list(new.slices),
                devices=pool_devices,
            )
        )
        devices += pool_devices
    if [d.index for d in devices] != list(range(len(devices))):
        return None  # devices not in pool order: nothing to rename by position
    by_key: dict[tuple[str, str, str], Device] = {}
    for dev in devices:
        by_key.setdefault(dev.key, dev)
    return Node(pools, devices, by_key)


def _pick(exp: Explanation, pick: Pick, node: Node) -> Pick:
    dev = node.devices[pick.device.index]
    share = None if pick.share_id is None else share_id_of(exp.claim, pick.request, dev)
    return dataclasses.replace(pick, device=dev, share_id=share)


def _stub_slices(picks: Sequence[Pick], label: NodeLabel) -> list[Mapping[str, Any]]:
    """What ``inputs.node_selector`` reads of the slices of the picked devices: every slice of
    a node in a group is its own (spec.nodeName), so this is all it needs."""
    return [
        {
            "spec": {
                "driver": p.device.driver,
                "pool": {"name": p.device.pool},
                "nodeName": label.node,
                "devices": [{"name": p.device.name}],
            }
        }
        for p in picks
    ]


def renamed(exp: Explanation, node: Node, label: NodeLabel) -> Explanation:
    """``exp`` (of the group's first member) as the answer for the member ``label`` names,
    whose devices are ``node`` (:func:`renamed_node`)."""
    o = exp.outcome
    picks = [_pick(exp, p, node) for p in o.picks]
    attempts = {
        k: Attempt([_pick(exp, p, node) for p in a.placed], a.rejections, a.reason)
        for k, a in o.attempts.items()
    }
    outcome = dataclasses.replace(o, picks=picks, attempts=attempts)
    return exp.renamed(node, outcome, _stub_slices(picks, label))
