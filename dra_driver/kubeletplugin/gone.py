"""Prepared devices the node no longer has (pure).

A claim prepared on this node keeps its checkpoint entry until the kubelet unprepares it (its pod
may still run, and an unprepare must find what to undo). Meanwhile the device can leave the node:
its GPU was lost or hot-removed, the node came back as another model (another GPU under the same
device name and minor number), or an administrator changed a GPU's MIG layout under a static MIG
device. :func:`gone_devices` finds them by identity, never by name or minor number: a device is
on the node only while a GPU with its recorded UUID is (and, for a static MIG device, a MIG
device with its recorded UUID, profile and placement on that GPU).

A dynamic MIG device (one prepare made, ``placement`` recorded) is checked only for its GPU and
that GPU's MIG mode: the inventory is read at the start and at each rediscovery, so it can miss
a MIG device a prepare made since (and the start's reconcile makes a missing one again). A
device with no recorded UUID (a claim rebuilt from a CDI spec naming a device the node no longer
advertises) is left out: it is already an unrecovered claim (``Reconciler.unrecovered``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from agent.discovery.inventory import NodeInventory
from dra_driver.device_model import mig_device_name
from dra_driver.kubeletplugin.checkpoint import PREPARE_COMPLETED, ClaimEntry

GPU_GONE = "no GPU with this UUID on the node"
MIG_GONE = "no MIG device with this UUID on its GPU"
MIG_DISABLED = "its GPU is no longer in MIG mode"


@dataclass(frozen=True)
class GoneDevice:
    """One device of a prepared claim that the node no longer has."""

    uid: str
    namespace: str
    name: str
    pool: str
    device: str
    gpu_uuid: str
    mig_uuid: str | None
    why: str
    """One of ``GPU_GONE``, ``MIG_GONE``, ``MIG_DISABLED``."""

    @property
    def key(self) -> tuple[str, str, str]:
        """(claim uid, pool, device)."""
        return (self.uid, self.pool, self.device)

    def describe(self) -> str:
        """``ns/name (uid) device on GPU-... (MIG-...): why``, for people."""
        claim = f"{self.namespace}/{self.name}" if self.name else "an unnamed claim"
        mig = f" ({self.mig_uuid})" if self.mig_uuid else ""
        return f"{claim} ({self.uid}) {self.device} on {self.gpu_uuid}{mig}: {self.why}"


def gone_devices(claims: Iterable[ClaimEntry], inventory: NodeInventory) -> tuple[GoneDevice, ...]:
    """The devices of ``claims`` (completed prepares) that ``inventory`` does not have, sorted by
    claim UID and device (see the module docstring)."""
    gpus = {g.device.uuid: g.device for g in inventory.gpus}
    out = []
    for entry in sorted(claims, key=lambda e: e.uid):
        if entry.state != PREPARE_COMPLETED:
            continue
        for d in entry.devices:
            if not d.gpu_uuid:
                continue
            gpu = gpus.get(d.gpu_uuid)
            why = None
            if gpu is None:
                why = GPU_GONE
            elif d.kind == "mig" and not gpu.mig_enabled:
                why = MIG_DISABLED
            elif d.kind == "mig" and d.placement is None and d.mig_uuid:
                # the same UUID and the same profile and placement (the device's name): a MIG
                # device's UUID alone may be given again to a new instance with its GPU
                # instance's ID (the simulator does), so it does not prove the device is there
                there = {
                    (
                        m.uuid,
                        mig_device_name(gpu.minor, m.profile_name, m.profile_id, m.placement.start),
                    )
                    for m in gpu.mig_instances
                }
                if (d.mig_uuid, d.device) not in there:
                    why = MIG_GONE
            if why is not None:
                out.append(
                    GoneDevice(
                        entry.uid,
                        entry.namespace,
                        entry.name,
                        d.pool,
                        d.device,
                        d.gpu_uuid,
                        d.mig_uuid if d.kind == "mig" else None,
                        why,
                    )
                )
    return tuple(sorted(out, key=lambda g: (g.uid, g.device)))
