"""Prepared state rebuilt from what survives a lost or corrupt checkpoint.

A claim's CDI spec names its UID and the pool devices it exposes, with their device nodes, and
(for MPS) ``CUDA_MPS_PIPE_DIRECTORY`` and the daemon's directories. The claim itself (in the API,
or in standalone mode ``<state-dir>/resourceclaims/``) gives its namespace, name, allocation
and opaque config, so the plan prepare made can be computed again (``plan.plan_claim``) and
compared with what survived; the sharing leftovers (an MPS control daemon still running in
``<mps-root>/<claim UID>``, a dynamic MIG instance at the placement a device names) are adopted.

``decide`` is the one decision per claim: a ``Rebuilt`` entry (a normal completed checkpoint
entry, with ``rebuilt_from`` set) or an ``Unrecovered`` one with a reason from ``REASONS``. Only
the ``Leftovers`` it is handed look at the node; it changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from agent.errors import TesseraError
from agent.nvml.types import MigInstance
from dra_driver.device_model import AdvertisedDevice, DeviceModel
from dra_driver.errors import ClaimError, ParamsError
from dra_driver.kubeletplugin.cdi_spec import SpecEvidence
from dra_driver.kubeletplugin.checkpoint import (
    PREPARE_COMPLETED,
    ClaimEntry,
    MpsRecord,
    PreparedDevice,
)
from dra_driver.kubeletplugin.claims import ClaimKey, check_claim_names, parse_allocation
from dra_driver.kubeletplugin.plan import (
    ClaimPlan,
    PlannedDevice,
    SharingPolicy,
    limits,
    plan_claim,
)
from dra_driver.sharing.mps import MpsDaemon

REASONS: Mapping[str, str] = {
    "spec_unreadable": "its CDI spec cannot be read",
    "claim_source_unavailable": "the claims could not be read (API server or claim files)",
    "no_claim": "no ResourceClaim with this UID exists",
    "allocation_invalid": "the claim is not allocated to this node's pool, or is malformed",
    "device_not_advertised": "a device of its allocation is no longer advertised",
    "invalid_config": "its opaque config does not validate, or it asks what the node's --sharing"
    " does not offer",
    "allocation_disagrees": "its allocation or config differs from what its CDI spec exposes",
    "leftovers_inconsistent": "its devices, MIG instances or MPS daemon differ from its spec",
    "conflict": "another prepared claim holds one of its devices",
}
"""Why a claim could not be rebuilt (the ``reason`` of its log record and /readyz detail)."""

MPS_NOT_RUNNING = 0
"""The PID of a rebuilt MPS record whose daemon is gone: no process has it, so the start's
restore sees the daemon dead and starts it again (as for any completed claim)."""


@dataclass(frozen=True)
class Unrecovered:
    uid: str
    reason: str
    """One of ``REASONS``."""
    detail: str

    def __str__(self) -> str:
        return f"{self.uid} ({self.reason}: {self.detail})"


@dataclass(frozen=True)
class Rebuilt:
    entry: ClaimEntry
    plan: ClaimPlan
    adopted: tuple[str, ...] = ()
    """What running leftovers it took over (``mps daemon <pid>``, ``mig <device>``)."""

    @property
    def key(self) -> ClaimKey:
        return ClaimKey(self.entry.namespace, self.entry.name, self.entry.uid)


class Leftovers(Protocol):
    """What of a claim's side effects the node still has (read only)."""

    def mig_instance(self, device: AdvertisedDevice) -> MigInstance | None:
        """The MIG device at a dynamic placement (None: none there, or not dynamic mode)."""
        ...

    def mps_daemon(self, uid: str) -> MpsDaemon | None:
        """The claim's MPS control daemon, if it still runs (PID file + start time)."""
        ...

    def mps_pipe_dir(self, uid: str) -> str | None:
        """Where the claim's MPS daemon's pipe directory is (None: no MPS on this node)."""
        ...

    def device_nodes(
        self, uid: str, devices: tuple[PreparedDevice, ...]
    ) -> dict[str, tuple[str, ...]]:
        """The device nodes (container paths) the claim's spec gives each device now."""
        ...


Record = Callable[[str, PlannedDevice], PreparedDevice]
"""The checkpoint record of a planned device for a claim UID (``records.Records.device``)."""


def _key(uid: str, obj: Mapping[str, Any]) -> ClaimKey:
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, dict) else {}
    namespace, name = meta.get("namespace", "default"), meta.get("name")
    if not isinstance(namespace, str) or not isinstance(name, str):
        raise ClaimError(f"claim {uid}: metadata.namespace and metadata.name must be strings")
    check_claim_names(namespace, name)
    return ClaimKey(namespace, name, uid)


def decide(
    spec: SpecEvidence,
    obj: Mapping[str, Any] | None,
    *,
    driver: str,
    pool: str,
    model: DeviceModel,
    sharing: SharingPolicy,
    record: Record,
    leftovers: Leftovers,
    rebuilt_from: str,
    now: Callable[[], float] = time.time,
) -> Rebuilt | Unrecovered:
    """Rebuild the entry of claim ``spec.uid`` from its spec, its claim object ``obj`` (None:
    not found) and the node's leftovers, or say why it cannot be."""
    uid = spec.uid
    if obj is None:
        return Unrecovered(uid, "no_claim", f"no ResourceClaim has UID {uid} ({rebuilt_from})")
    try:
        key = _key(uid, obj)
        allocation = parse_allocation(dict(obj), key, driver, pool)
        plan = plan_claim(allocation, model, sharing)
    except ClaimError as exc:
        reason = {
            "unknown_device": "device_not_advertised",
            "sharing_mismatch": "invalid_config",
        }.get(exc.reason, "allocation_invalid")
        return Unrecovered(uid, reason, str(exc))
    except ParamsError as exc:
        return Unrecovered(uid, "invalid_config", str(exc))
    planned = sorted(p.device.name for p in plan.devices)
    if planned != sorted(spec.devices):
        return Unrecovered(
            uid,
            "allocation_disagrees",
            f"claim {key}: its allocation on this node is {', '.join(planned) or 'nothing'},"
            f" its CDI spec exposes {', '.join(sorted(spec.devices)) or 'nothing'}",
        )
    devices, adopted = [], []
    for p in plan.devices:
        r = record(uid, p)
        if p.dynamic:
            inst = leftovers.mig_instance(p.device)
            if inst is not None:  # gone: the start's restore makes it again, as for any claim
                r = _with_instance(r, inst)
                adopted.append(f"mig {p.device.name} ({inst.uuid})")
        devices.append(r)
    records = tuple(devices)
    problem = _nodes_problem(spec, records, leftovers)
    if problem is not None:
        return Unrecovered(uid, "leftovers_inconsistent", f"claim {key}: {problem}")
    pipe = spec.mps_pipe_dir
    if plan.uses_mps != (pipe is not None):
        says = "shares through MPS" if plan.uses_mps else "does not use MPS"
        spec_says = "mounts no MPS daemon" if pipe is None else f"mounts the MPS pipe {pipe}"
        return Unrecovered(
            uid, "allocation_disagrees", f"claim {key}: its config {says}, its CDI spec {spec_says}"
        )
    mps = None
    if plan.uses_mps:
        expected = leftovers.mps_pipe_dir(uid)
        if pipe != expected:
            return Unrecovered(
                uid,
                "leftovers_inconsistent",
                f"claim {key}: its CDI spec mounts the MPS pipe {pipe}, this node's daemon for"
                f" the claim would be at {expected or 'nowhere (no MPS here)'}",
            )
        daemon = leftovers.mps_daemon(uid)
        mps = _mps_record(plan, records, daemon, str(expected))
        if daemon is not None:
            adopted.append(f"mps daemon {daemon.pid}")
    entry = ClaimEntry(
        uid=uid,
        namespace=key.namespace,
        name=key.name,
        state=PREPARE_COMPLETED,
        devices=records,
        updated_at=now(),
        mps=mps,
        pods=plan.pods,
        rebuilt_from=rebuilt_from,
    )
    return Rebuilt(entry, plan, tuple(adopted))


def _with_instance(r: PreparedDevice, inst: MigInstance) -> PreparedDevice:
    return replace(
        r,
        mig_uuid=inst.uuid,
        gpu_instance_id=inst.gpu_instance_id,
        compute_instance_id=inst.compute_instance_id,
    )


def _nodes_problem(
    spec: SpecEvidence, records: tuple[PreparedDevice, ...], leftovers: Leftovers
) -> str | None:
    """Whether the spec's device nodes are the ones the devices have now (a whole GPU's minor,
    a MIG device's GPU and compute instance capability nodes). A dynamic MIG device whose
    instance is gone is not compared: it is made again."""
    present = tuple(r for r in records if r.kind == "gpu" or r.gpu_instance_id is not None)
    try:
        expected = leftovers.device_nodes(spec.uid, present)
    except TesseraError as exc:  # a capability file gone, an unreadable driver root
        return f"cannot describe its devices' nodes now: {exc}"
    found = dict(spec.device_nodes)
    for name, nodes in sorted(expected.items()):
        has = tuple(found.get(name, ()))
        if has != tuple(nodes):
            return (
                f"device {name}: its CDI spec exposes {', '.join(has) or 'nothing'}, the device"
                f" now has {', '.join(nodes)}"
            )
    return None


def _mps_record(
    plan: ClaimPlan, records: tuple[PreparedDevice, ...], daemon: MpsDaemon | None, pipe: str
) -> MpsRecord:
    by_name = {r.device: r for r in records}
    shared = [p for p in plan.devices if p.uses_mps]
    uuids = {
        p.device.name: (by_name[p.device.name].mig_uuid or by_name[p.device.name].gpu_uuid)
        for p in shared
    }
    pinned = limits(shared, uuids)
    base = pipe.removesuffix("/pipe")
    return MpsRecord(
        pid=daemon.pid if daemon is not None else MPS_NOT_RUNNING,
        started_at=daemon.started_at if daemon is not None else 0.0,
        pipe_dir=daemon.pipe_dir if daemon is not None else pipe,
        log_dir=daemon.log_dir if daemon is not None else f"{base}/log",
        shm_dir=daemon.shm_dir if daemon is not None else f"{base}/shm",
        devices=tuple(uuids[p.device.name] for p in shared),
        thread_percentage=plan.mps_thread_percentage,
        pinned=tuple(sorted(pinned.items())),
    )
