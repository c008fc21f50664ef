"""The node's devices as the running agent keeps them: one path for every inventory (the
start's and each rediscovery's), the devices published with their health, and a GPU's health
change carried to the kubelet's health stream and the ResourceSlices."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace

from agent.daemon.hub import Relay
from agent.discovery.inventory import Gpu, NodeInventory
from agent.discovery.vm import VmDiscovery
from agent.errors import TesseraError
from agent.hotplug import DevicesChanged, inventory_change
from agent.logs import fields_
from agent.node import NodeSource, Reread, rediscover
from agent.nvml.events import EventWatcher
from agent.nvml.telemetry import TelemetryReader
from agent.nvml.types import MemoryInfo
from agent.statelock import StateLock
from agent.telemetry.faults import FaultStore
from agent.telemetry.gpu_health import GpuHealth
from agent.telemetry.gpuinfo import gpu_info
from agent.telemetry.sampler import Sampler
from dra_driver.advertise.publisher import Publisher
from dra_driver.advertise.taints import UnhealthyGpu, UnhealthyGpus, with_health
from dra_driver.device_model import (
    DeviceModel,
    DevicePolicy,
    advertised_devices,
    node_mig_profiles,
    unknown_mig_profiles,
)
from dra_driver.errors import ClaimError
from dra_driver.kubeletplugin.health_stream import HEALTHY, UNHEALTHY, HealthBoard

Check = Callable[[], tuple[bool, str]]
REREADS = 3
"""Reads of the node a rediscovery makes at most when prepares keep changing MIG devices."""


def enumerated(inv: NodeInventory) -> list[Gpu]:
    """The inventory's GPUs NVML enumerates: not those lent to virtual machines (index -1),
    which NVML cannot read or watch."""
    return [g for g in inv.gpus if g.device.index >= 0]


def model_inputs(inv: NodeInventory, policy: DevicePolicy) -> NodeInventory:
    """``inv`` without what the device model under ``policy`` does not read: two inventories
    whose inputs compare equal advertise the same devices, so the model of one serves the
    other without being built again (``advertised_devices`` takes milliseconds for a node of
    200 MIG placements, and every dynamic MIG prepare and unprepare re-reads its GPU before
    it answers: :meth:`NodeDevices.mig_changed`). Left out: memory in use (the devices carry
    the total only) and, in dynamic MIG mode, the GPUs' MIG devices (the placements are
    advertised, made or not; MIG mode itself stays an input). tests/agent/
    test_daemon_devices.py builds both models to check it."""

    def device_inputs(gpu: Gpu) -> Gpu:
        d = gpu.device
        instances = () if policy.mig_mode == "dynamic" else d.mig_instances
        memory = MemoryInfo(d.memory.total, 0, 0)
        return replace(gpu, device=replace(d, memory=memory, mig_instances=instances))

    return replace(inv, gpus=tuple(device_inputs(g) for g in inv.gpus))


class CurrentDevices:
    """What the node advertises right now: discovery sets it, prepare reads it."""

    def __init__(self) -> None:
        self._model: DeviceModel | None = None
        self._lock = threading.Lock()

    def set(self, model: DeviceModel) -> None:
        with self._lock:
            self._model = model

    def current(self) -> DeviceModel | None:
        """The model now, None before the first discovery."""
        with self._lock:
            return self._model

    def names(self) -> dict[str, str]:
        """Each advertised device's name to its NVML UUID (a dynamic MIG placement, not yet
        created: its GPU's): the telemetry API's filters by the names users see in slices."""
        model = self.current()
        if model is None:
            return {}
        return {d.name: d.uuid or d.parent_uuid for d in model.devices}

    def get(self) -> DeviceModel:
        with self._lock:
            if self._model is None:
                raise ClaimError("the node has not been discovered yet; retry shortly", "not_ready")
            return self._model


class NodeDevices:
    """The inventory, the devices advertised from it and their health (module docstring).

    ``health_changes`` carries the sampler's GPU health changes here and ``taints_dropped`` the
    publisher's notice that taints cannot work (both subscribed at construction);
    ``devices_changed`` is told every rediscovery that changed the GPUs or devices, or saw a GPU
    bound again, and ``health_published`` every GPU health change once it is published;
    ``mig_changed`` carries the NVML index of a GPU whose MIG devices a prepare or unprepare
    changed (dynamic MIG) here, before that call returns."""

    def __init__(
        self,
        *,
        source: NodeSource,
        policy: DevicePolicy,
        device_taints: bool,
        devices: CurrentDevices,
        health: HealthBoard,
        publisher: Publisher,
        events: EventWatcher,
        reader: TelemetryReader,
        sampler: Sampler,
        faults: FaultStore,
        lock: StateLock,
        log: logging.Logger,
        health_changes: Relay[GpuHealth],
        taints_dropped: Relay[None],
        devices_changed: Relay[DevicesChanged],
        mig_changed: Relay[int],
        health_published: Callable[[GpuHealth], None],
        vm: VmDiscovery | None = None,
    ) -> None:
        self.source = source
        self.vm = vm
        """``--virtualization`` not none: discovery fills ``Gpu.virtualization`` and keeps GPUs
        lent to virtual machines (agent.discovery.vm)."""
        self.policy = policy
        self.device_taints = device_taints
        self.devices = devices
        self.health = health
        self.publisher = publisher
        self.events = events
        self.reader = reader
        self.sampler = sampler
        self.faults = faults
        self.lock = lock
        self.log = log
        self.inventory: NodeInventory | None = None
        self.unhealthy = UnhealthyGpus()
        self.devices_changed = devices_changed
        self._health_published = health_published
        self._apply_lock = threading.RLock()  # mig_changed applies while it holds it
        self._mig_changes = 0
        """MIG changes applied by :meth:`mig_changed` (changed under ``_apply_lock``)."""
        self._publish_lock = threading.Lock()
        self._unlisted_warned: set[str] = set()
        health_changes.subscribe(self.gpu_health_changed)
        taints_dropped.subscribe(lambda _: self.publish_devices())
        mig_changed.subscribe(self.mig_changed)

    def readiness_checks(self) -> list[tuple[str, Check]]:
        """/readyz's check of discovery: the node was discovered."""
        return [("inventory", self._discovered)]

    def _discovered(self) -> tuple[bool, str]:
        return (True, "node discovered") if self.inventory else (False, "not discovered yet")

    def apply_inventory(
        self, inv: NodeInventory, rebound: frozenset[str] = frozenset()
    ) -> DevicesChanged:
        """The one path an inventory takes, at the start and after every rediscovery: device
        model, then the devices prepare sees, the publisher, the health board (devices of a
        removed GPU that claims hold stay there, UNHEALTHY), then the XID watcher, the telemetry
        reader and the sampler (by UUID: indexes may shift), of the GPUs NVML enumerates (not
        those lent to virtual machines, index -1). Logs the inventory at the start and one record
        per rediscovery that changed anything; tells ``devices_changed``."""
        with self._apply_lock:
            previous = self.inventory
            old_model = self.devices.current()
            model = self._model_of(inv, previous, old_model)
            self.inventory = inv
            if model != old_model:
                self.devices.set(model)
                self.health.set_devices(d.name for d in model.devices)
                self.publish_devices()
            readable = enumerated(inv)
            self.events.watch([g.device.index for g in readable])
            self.reader.expect({g.device.index: g.device.uuid for g in readable})
            before = {g.device.uuid: g.device for g in previous.gpus} if previous else {}
            for g in readable:
                old = before.get(g.device.uuid)
                if old is not None and old.mig_instances != g.device.mig_instances:
                    self.reader.refresh(g.device.index)
            # every GPU, those handed to a VM too: they serve tessera_gpu_passthrough
            self.sampler.set_gpus([gpu_info(g.device, g.virtualization) for g in inv.gpus])
            change = inventory_change(
                previous,
                inv,
                [d.name for d in old_model.devices] if old_model else (),
                [d.name for d in model.devices],
                rebound,
            )
        if previous is None or node_mig_profiles(previous) != node_mig_profiles(inv):
            self._log_unknown_profiles(inv)
        if previous is None:
            self._log_inventory(inv)
            return change
        if change.devices_changed:
            self.log.warning(
                "node inventory changed",
                extra=fields_(
                    gpus_added=[g.uuid for g in change.added_gpus],
                    gpus_removed=[g.uuid for g in change.removed_gpus],
                    devices_added=list(change.added_devices),
                    devices_removed=list(change.removed_devices),
                    rebound=list(change.rebound),
                    gpus=len(inv.gpus),
                    devices=len(model.devices),
                ),
            )
        for g in inv.gpus:  # bound again: a sticky fatal XID waits for the health probe only
            if g.pcie.bus_id in change.rebound:
                self.sampler.observe_reset(g.device.uuid)
        if change.devices_changed or change.rebound:
            try:
                self.devices_changed(change)
            except Exception:
                self.log.exception("on_devices_changed failed")
        return change

    def _model_of(
        self, inv: NodeInventory, previous: NodeInventory | None, old_model: DeviceModel | None
    ) -> DeviceModel:
        """The devices ``inv`` advertises: ``old_model`` (built from ``previous``) when nothing
        it was built from changed (``model_inputs``), else built."""
        if (
            previous is not None
            and old_model is not None
            and model_inputs(previous, self.policy) == model_inputs(inv, self.policy)
        ):
            return old_model
        return advertised_devices(inv, self.policy)

    def rediscover(self, rebound: frozenset[str] = frozenset()) -> None:
        """Read NVML and sysfs again and apply what they say (:meth:`apply_inventory`); a read
        that fails is logged and the inventory stays as it was. A read a prepare's MIG change
        (:meth:`mig_changed`) overtook is not applied over it: the node is read again (at most
        ``REREADS`` times in all; the last read is applied whatever happened meanwhile)."""
        for attempt in range(1, REREADS + 1):
            seen = self._mig_changes
            reread = self._reread()
            if reread is None:
                return
            with self._apply_lock:
                if self._mig_changes == seen or attempt == REREADS:
                    self.apply_inventory(reread.inventory, rebound)
                    return

    def _reread(self) -> Reread | None:
        try:
            reread = rediscover(self.source, self.inventory, self.vm)
        except (TesseraError, OSError) as exc:
            self.log.warning(
                "rediscovery failed; the advertised devices stay as they were",
                extra=fields_(error=str(exc)),
            )
            return None
        if reread.kept_unreadable:
            self.log.info(
                "GPUs NVML cannot read are kept as they were (their PCI functions are there)",
                extra=fields_(gpus=list(reread.kept_unreadable)),
            )
        fresh = [b for b in reread.unlisted if b not in self._unlisted_warned]
        if fresh:
            self._unlisted_warned.update(fresh)
            self.log.warning(
                "NVIDIA GPUs in sysfs that NVML does not enumerate: not advertised; a GPU"
                " hot-added after the agent started is advertised after a restart of the agent",
                extra=fields_(pci_bus_ids=fresh),
            )
        return reread

    def mig_changed(self, index: int) -> None:
        """Dynamic MIG made or destroyed MIG devices on GPU ``index`` (or switched its MIG
        mode): that GPU alone is read again and the inventory with it applied
        (:meth:`apply_inventory`), before the prepare or unprepare answers. So the sampler reads
        the GPU's new MIG devices, labelled with their profiles, from its next tick on, not
        after the next rediscovery. A read that fails, or a GPU no longer at that index (a
        rediscovery is due), is logged and left to the next rediscovery."""
        try:
            device = self.source.nvml.device(index)
        except (TesseraError, OSError) as exc:
            self.log.warning(
                "cannot read a GPU whose MIG devices changed; telemetry sees them at the next"
                " rediscovery",
                extra=fields_(gpu=index, error=str(exc)),
            )
            return
        with self._apply_lock:  # no other inventory is applied between this read and apply
            inv = self.inventory
            known = {g.device.uuid: g.device.index for g in inv.gpus} if inv else {}
            if inv is None or known.get(device.uuid) != index:
                self.log.info(
                    "a GPU whose MIG devices changed is not in the inventory at that index;"
                    " left to the next rediscovery",
                    extra=fields_(gpu=index, uuid=device.uuid),
                )
                return
            gpus = tuple(
                replace(g, device=device) if g.device.uuid == device.uuid else g for g in inv.gpus
            )
            self._mig_changes += 1  # a rediscovery reading now must not apply its older read
            self.apply_inventory(replace(inv, gpus=gpus))

    def publish_devices(self) -> None:
        """Publish the current devices as health has them: the kubelet's health stream marks
        every device of an unhealthy GPU, and the slices taint or withdraw them
        (``--device-taints``; dra_driver/advertise/taints.py). Prepare keeps reading the full
        model. Call
        after the devices or the health changed; writes nothing when nothing did."""
        with self._publish_lock:
            model = self.devices.get()
            unhealthy = self.unhealthy.snapshot()
            for d in model.devices:
                self.health.mark(d.name, UNHEALTHY if d.parent_uuid in unhealthy else HEALTHY)
            self.publisher.set_devices(
                with_health(
                    model,
                    unhealthy,
                    taints=self._tainting(),
                    driver_name=self.policy.driver_name,
                )
            )

    def _tainting(self) -> bool:
        """Unhealthy devices are tainted (else withdrawn): --device-taints, and the API server
        keeps taints (publisher.taints_dropped)."""
        return self.device_taints and not self.publisher.taints_dropped

    def gpu_health_changed(self, change: GpuHealth) -> None:
        """The sampler's callback: a GPU's health or cause changed (sticky faults are saved
        first, so a restart right after keeps them)."""
        if self.lock.held:
            self.faults.save(self.sampler.sticky_faults())
        gone = (
            None if change.healthy else UnhealthyGpu(change.uuid, change.cause or "", change.since)
        )
        self.unhealthy.update(change.uuid, gone)
        try:
            affected = [d.name for d in self.devices.get().devices if d.parent_uuid == change.uuid]
        except ClaimError:  # not discovered yet: publish_devices at start picks it up
            affected = []
        else:
            self.publish_devices()
        published = (
            "advertised" if change.healthy else "tainted" if self._tainting() else "withdrawn"
        )
        self.log.warning(
            "GPU health published",
            extra=fields_(
                gpu=change.index,
                uuid=change.uuid,
                healthy=change.healthy,
                cause=change.cause,
                devices=len(affected),
                slices=published,
            ),
        )
        self._health_published(change)

    def _log_unknown_profiles(self, inv: NodeInventory) -> None:
        """--mig-profiles names a profile no GPU of the node has (a DaemonSet's one setting on
        nodes of several products): logged at the start and when the node's profiles change,
        not refused, so that the node keeps advertising the profiles it has."""
        unknown = unknown_mig_profiles(inv, self.policy)
        if unknown:
            self.log.warning(
                "MIG profiles not on this node",
                extra=fields_(
                    mig_profiles=list(unknown),
                    node_mig_profiles=list(node_mig_profiles(inv)),
                ),
            )

    def _log_inventory(self, inv: NodeInventory) -> None:
        for g in inv.gpus:
            d = g.device
            self.log.info(
                "discovered GPU",
                extra=fields_(
                    gpu=d.index,
                    uuid=d.uuid,
                    model=d.name,
                    pci_bus_id=g.pcie.bus_id,
                    numa_node=g.pcie.numa_node,
                    pcie_root=g.pcie.pcie_root,
                    nvlink_clique=g.nvlink_clique,
                    mig_enabled=d.mig_enabled,
                    mig_devices=len(d.mig_instances),
                    near_nics=",".join(g.near_nics),
                ),
            )
        self.log.info(
            "node inventory",
            extra=fields_(
                node=inv.hostname,
                gpus=len(inv.gpus),
                nics=len(inv.nics),
                numa_nodes=len(inv.numa_nodes),
                nvlink_cliques=len(inv.nvlink_cliques),
                driver_version=inv.system.driver_version,
                cuda_driver_version=inv.system.cuda_driver_version,
            ),
        )
