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
from dataclasses import dataclass
from typing import Any

from dra_driver.scheduler.domain import Device, Node
from dra_driver.scheduler.explanation import Explanation
from dra_driver.scheduler.lookalike import NodeLabel
from dra_driver.scheduler.outcome import Attempt, Pick, Reason
from dra_driver.scheduler.picking import share_id_of, share_ordinal


@dataclass(frozen=True)
class Renaming:
    """Where the first member's pools and slices are on another member (by pool index)."""

    label: NodeLabel
    slice_names: tuple[dict[str, str], ...]
    """Per pool: the first member's slice name -> the other member's."""


def renaming(node: Node, label: NodeLabel) -> Renaming | None:
    """How ``node`` (the first member's, parsed) maps onto the member ``label`` names; None
    when its pools do not line up with the label's (then that node is evaluated on its own),
    or when a pool has a problem (its text names the pool), or a slice is ignored (its text
    names the slice)."""
    if len(node.pools) != len(label.pools) or node.ignored:
        return None
    slice_names = []
    for pool, new in zip(node.pools, label.pools, strict=True):
        if pool.problem is not None or pool.driver != new.driver:
            return None
        if len(pool.slices) != len(new.slices):
            return None
        slice_names.append(dict(zip(pool.slices, new.slices, strict=True)))
    return Renaming(label, tuple(slice_names))


def renamed_device(dev: Device, r: Renaming) -> Device:
    """``dev`` where it is on the other member: pool, slice, node and field path."""
    new = r.label.pools[dev.pool_index]
    sname = r.slice_names[dev.pool_index][dev.slice_name]
    old_base, new_base = f"ResourceSlice {dev.slice_name}.", f"ResourceSlice {sname}."
    return dataclasses.replace(
        dev,
        pool=new.name,
        slice_name=sname,
        node_name=r.label.node if dev.node_name else "",
        path=dev.path.replace(old_base, new_base, 1),
    )


def renamed_node(node: Node, r: Renaming) -> Node:
    """``node`` with the other member's names: every device and pool."""
    devices = [renamed_device(dev, r) for dev in node.devices]
    pools = [
        dataclasses.replace(
            pool,
            name=new.name,
            generation=new.generation,
            slices=list(new.slices),
            devices=[devices[d.index] for d in pool.devices],
        )
        for pool, new in zip(node.pools, r.label.pools, strict=True)
    ]
    by_key: dict[tuple[str, str, str], Device] = {}
    for dev in devices:
        by_key.setdefault(dev.key, dev)
    return Node(pools, devices, by_key)


def _picks(exp: Explanation, picks: Sequence[Pick], r: Renaming) -> list[Pick]:
    out = []
    for i, pick in enumerate(picks):
        dev = renamed_device(pick.device, r)
        share = None
        if pick.share_id is not None:
            share = share_id_of(exp.claim, pick.request, dev, share_ordinal(picks, i))
        out.append(dataclasses.replace(pick, device=dev, share_id=share))
    return out


def _stub_slices(picks: Sequence[Pick], label: NodeLabel) -> list[Mapping[str, Any]]:
    """What ``node_reach.node_selector`` reads of the slices of the picked devices: every slice of
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


def _fatal(exp: Explanation, r: Renaming) -> Reason | None:
    """The outcome's error with the device it names (``deviceID``: driver/pool/device, as
    upstream's message names it) where it is on the other member."""
    fatal = exp.outcome.fatal
    old = fatal.details.get("deviceID") if fatal is not None else None
    if fatal is None or not isinstance(old, str):
        return fatal
    dev = next(d for d in exp.node.devices if "/".join(d.key) == old)
    new = "/".join(renamed_device(dev, r).key)
    details = {
        k: v.replace(old, new) if isinstance(v, str) else v for k, v in fatal.details.items()
    }
    return Reason(fatal.kind, fatal.text.replace(old, new), details)


def renamed(exp: Explanation, r: Renaming) -> Explanation:
    """``exp`` (of the group's first member) as the answer for the member ``r`` names. Its
    picks are renamed now; its node (every device, for the full text or JSON) when first
    read."""
    o = exp.outcome
    picks = _picks(exp, o.picks, r)
    attempts = {
        k: Attempt(_picks(exp, a.placed, r), a.rejections, a.reason) for k, a in o.attempts.items()
    }
    outcome = dataclasses.replace(o, picks=picks, attempts=attempts, fatal=_fatal(exp, r))
    first = exp.node
    return exp.renamed(lambda: renamed_node(first, r), outcome, _stub_slices(picks, r.label))
