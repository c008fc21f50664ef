"""The daemon's wiring and lifecycle: the only place that constructs the object graph.

``build_agent`` is the composition root: it turns a Config into a ready-to-start ``Agent`` with
every dependency passed in explicitly. ``Agent.start``/``stop`` bring the loops up and down in
order; ``run`` blocks until asked to stop (SIGINT/SIGTERM in the CLI) or until a task fails.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from agent.config import Config, CrashAt
from agent.discovery.inventory import NodeInventory
from agent.driverfiles.discover import find_cdi_hook, make_char_device, under
from agent.errors import ConfigError, TesseraError
from agent.fsutil import disk_trouble, ensure_dir, remove_temp_files
from agent.hotplug import DevicesChanged, EventSource, Rediscovery, inventory_change, open_udev
from agent.http import HttpEndpoint, HttpLimits, Readiness
from agent.logs import fields_
from agent.node import NodeSource, discover, real_node, rediscover
from agent.nvml.events import EventWatcher
from agent.nvml.mig import MigControl
from agent.nvml.telemetry import TelemetryReader
from agent.statelock import StateLock
from agent.supervisor import Deadline, Supervisor
from agent.telemetry.energy import EnergyAccounting
from agent.telemetry.faults import FaultStore
from agent.telemetry.gpu_health import GpuHealth, application_xids
from agent.telemetry.gpuinfo import gpu_info
from agent.telemetry.metrics import (
    AgentCollector,
    AgentStatus,
    DriverMetrics,
    Exposition,
    SnapshotCollector,
)
from agent.telemetry.owners import ProcessPods
from agent.telemetry.sampler import Sampler
from agent.telemetry.stream import TelemetryLimits, TelemetryServer
from dra_driver.advertise.publisher import DirSliceStore, KubeSliceStore, Publisher, SliceStore
from dra_driver.advertise.slices import SlicePolicy
from dra_driver.advertise.taints import UnhealthyGpu, UnhealthyGpus, with_health
from dra_driver.cluster.node_events import (
    KubeEventSink,
    LogEventSink,
    NodeEventRecorder,
    devices_changed,
    gpu_added,
    gpu_health,
    gpu_removed,
)
from dra_driver.device_model import DeviceModel, advertised_devices
from dra_driver.errors import ClaimError, KubeError
from dra_driver.kubeletplugin.cdi import CdiWriter
from dra_driver.kubeletplugin.checkpoint import CheckpointStore
from dra_driver.kubeletplugin.claims import DirClaimSource, KubeClaimSource
from dra_driver.kubeletplugin.effects import Effects
from dra_driver.kubeletplugin.health_stream import HEALTHY, UNHEALTHY, HealthBoard
from dra_driver.kubeletplugin.prepare import Preparer
from dra_driver.kubeletplugin.server import PluginServer
from dra_driver.sharing.dynamic_mig import DynamicMig
from dra_driver.sharing.mps import MpsControl
from dra_driver.sharing.node_tools import Tools, find_tool, tool_env
from dra_driver.sharing.timeslice import GpuSettings

if TYPE_CHECKING:  # imported where kube mode starts (build_agent)
    from dra_driver.cluster.kube import KubeClient

DEFAULT_STATE_DIR = Path("/var/lib/tessera")
KUBELET_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
KUBELET_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
CDI_ROOT = Path("/var/run/cdi")
HANDOVER_LOG_S = 30.0
"""While waiting for the state directory, one log line this often."""
STOP_RESERVE_S = 2.0
"""Of the shutdown timeout, what is kept for stopping the servers and loops after the claims
(at most half of it)."""


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

    def get(self) -> DeviceModel:
        with self._lock:
            if self._model is None:
                raise ClaimError("the node has not been discovered yet; retry shortly", "not_ready")
            return self._model


@dataclass
class Agent:
    config: Config
    source: NodeSource
    state_dir: Path
    http: HttpEndpoint
    readiness: Readiness
    publisher: Publisher
    preparer: Preparer
    plugin: PluginServer
    health: HealthBoard
    kube: KubeClient | None
    log: logging.Logger
    sampler: Sampler
    reader: TelemetryReader
    accounting: EnergyAccounting
    events: EventWatcher
    telemetry_server: TelemetryServer
    lock: StateLock
    node_events: NodeEventRecorder | None = None
    stop_event: threading.Event = field(default_factory=threading.Event)
    devices: CurrentDevices = field(default_factory=lambda: CurrentDevices())
    inventory: NodeInventory | None = None
    supervisor: Supervisor | None = None
    unfinished: list[str] = field(default_factory=list)
    """What had not stopped when the shutdown deadline passed (threads still running)."""
    triggers: EventSource | None = None
    """Where udev's PCI events come from (None: no rediscovery loop at all)."""
    on_devices_changed: Callable[[DevicesChanged], None] = lambda change: None
    """Told every rediscovery that changed the GPUs or devices, or saw a GPU bound again."""
    _apply_lock: threading.Lock = field(default_factory=threading.Lock)
    unhealthy: UnhealthyGpus = field(default_factory=UnhealthyGpus)
    faults: FaultStore | None = None
    """Where fatal XIDs that hold GPUs unhealthy survive a restart (``faults.json``)."""
    on_health_event: Callable[[GpuHealth], None] | None = None
    """Hook for every GPU health change after it is published (Kubernetes Node events)."""
    _publish_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _unlisted_warned: set[str] = field(default_factory=set, init=False, repr=False)

    def start(self, stop: threading.Event | None = None) -> None:
        """Discover the node, start publishing, open the HTTP endpoint (NVML is initialized).
        With --rolling-update, first serve the kubelet and wait for the state directory
        (:meth:`_take_over`; ``stop`` ends the wait, and then nothing else starts)."""
        if not self.lock.held and not self._take_over(stop or self.stop_event):
            return
        self._sweep_temp_files()
        self.accounting.load()
        if self.faults is not None:
            restored = self.faults.load(time.time())
            self.sampler.restore_faults(restored)
            if restored:
                self.log.warning(
                    "GPUs with a fatal XID no recovery cleared stay unhealthy",
                    extra=fields_(gpus=sorted(restored), path=str(self.faults.path)),
                )
        self.preparer.cdi.write_base()
        inventory = discover(self.source)
        self.readiness.add("inventory", lambda: (True, "node discovered"))
        if self.kube is not None:
            uid = node_uid(self.kube, self.publisher.policy.node_name, self.log)
            self.publisher.policy = dataclasses.replace(self.publisher.policy, node_uid=uid)
            if self.node_events is not None:
                self.node_events.set_node_uid(uid)
        self.apply_inventory(inventory)
        self.preparer.reconcile_on_start()
        self.plugin.start()
        self.readiness.add("sockets", self._sockets_intact)
        # what a restart repairs: the kubelet restarts the container when /healthz fails
        self.http.liveness.add("sockets", self._sockets_intact)
        self.http.liveness.add("state-dir", self._state_dir_intact)
        self.readiness.add("claims", self._claims_moving)
        self.readiness.add("disk", self._disk_writable)
        self.readiness.add("unrecovered-claims", self._claims_accounted_for)
        self.readiness.add("kubelet", self._registered)
        self.readiness.add(
            "resourceslices",
            lambda: (
                self.publisher.ready,
                f"published generation {self.publisher.published_generation}"
                if self.publisher.ready
                else f"not yet published ({self.publisher.stats.last_error or 'pending'})",
            ),
        )
        self._start_telemetry()
        self.supervisor = Supervisor(self.log, self.stop_event.set)
        if self.node_events is not None:
            recorder = self.node_events
            self.supervisor.spawn("node-events", lambda: recorder.run(self.stop_event))
        self.supervisor.spawn("sampler", lambda: self.sampler.run(self.stop_event))
        self.supervisor.spawn("telemetry-notify", self._notify_watchers)
        self.supervisor.spawn("publisher", lambda: self.publisher.run(self.stop_event))
        if self.publisher.store.watchable:
            self.supervisor.spawn("slice-watch", lambda: self.publisher.watch_loop(self.stop_event))
        if self.triggers is not None:
            loop = Rediscovery(
                self.triggers,
                self.rediscover,
                interval=self.config.rediscovery_interval,
                debounce=self.config.rediscovery_debounce,
                log=self.log.getChild("rediscovery"),
            )
            self.supervisor.spawn("rediscovery", lambda: loop.run(self.stop_event))
        self.http.start()
        host, port = self.http.address
        self.log.info(
            "agent started",
            extra=fields_(
                node=self.source.hostname,
                simulated=self.source.model,
                driver=self.config.driver_name,
                mode="standalone" if self.kube is None else "kube",
                healthz=f"{'https' if self.http.tls else 'http'}://{host}:{port}/healthz",
                state_dir=str(self.state_dir),
            ),
        )

    def apply_inventory(
        self, inv: NodeInventory, rebound: frozenset[str] = frozenset()
    ) -> DevicesChanged:
        """The one path an inventory takes, at the start and after every rediscovery: device
        model, then the devices prepare sees, the publisher, the health board (devices of a
        removed GPU that claims hold stay there, UNHEALTHY), then the XID watcher, the telemetry
        reader and the sampler (by UUID: indexes may shift). Logs the inventory at the start and
        one record per rediscovery that changed anything; tells ``on_devices_changed``."""
        with self._apply_lock:
            previous = self.inventory
            old_model = self.devices.current()
            model = advertised_devices(inv, self.config.device_policy())
            self.inventory = inv
            if model != old_model:
                self.devices.set(model)
                self.health.set_devices(d.name for d in model.devices)
                self.publish_devices()
            self.events.watch([g.device.index for g in inv.gpus])
            self.reader.expect({g.device.index: g.device.uuid for g in inv.gpus})
            before = {g.device.uuid: g.device for g in previous.gpus} if previous else {}
            for g in inv.gpus:
                old = before.get(g.device.uuid)
                if old is not None and old.mig_instances != g.device.mig_instances:
                    self.reader.refresh(g.device.index)
            self.sampler.set_gpus([gpu_info(g.device) for g in inv.gpus])
            change = inventory_change(
                previous,
                inv,
                [d.name for d in old_model.devices] if old_model else (),
                [d.name for d in model.devices],
                rebound,
            )
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
                self.on_devices_changed(change)
            except Exception:
                self.log.exception("on_devices_changed failed")
        return change

    def rediscover(self, rebound: frozenset[str] = frozenset()) -> None:
        """Read NVML and sysfs again and apply what they say (:meth:`apply_inventory`); a read
        that fails is logged and the inventory stays as it was."""
        try:
            reread = rediscover(self.source, self.inventory)
        except (TesseraError, OSError) as exc:
            self.log.warning(
                "rediscovery failed; the advertised devices stay as they were",
                extra=fields_(error=str(exc)),
            )
            return
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
        self.apply_inventory(reread.inventory, rebound)

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
                    driver_name=self.config.driver_name,
                )
            )

    def _tainting(self) -> bool:
        """Unhealthy devices are tainted (else withdrawn): --device-taints, and the API server
        keeps taints (publisher.taints_dropped)."""
        return self.config.device_taints and not self.publisher.taints_dropped

    def gpu_health_changed(self, change: GpuHealth) -> None:
        """The sampler's callback: a GPU's health or cause changed (sticky faults are saved
        first, so a restart right after keeps them)."""
        if self.faults is not None and self.lock.held:
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
        if self.on_health_event is not None:
            self.on_health_event(change)

    def _registered(self) -> tuple[bool, str]:
        """Ready only once the kubelet has registered us (kube mode)."""
        if self.kube is None:
            return True, "standalone mode"
        if self.plugin.registered:
            return True, "registered"
        return False, f"not registered ({self.plugin.registration_error or 'waiting for kubelet'})"

    def _take_over(self, stop: threading.Event) -> bool:
        """--rolling-update: serve the kubelet at once (it sends new calls to the newest plugin
        of a driver; they wait at the plugin's gate), then wait for the state directory until
        the agent before us hands it over. Ready while waiting: the DaemonSet deletes the old
        pod only once this one is ready, and only then does the old agent let go (a deadlock
        otherwise). False when ``stop`` was set first."""
        self.plugin.gate.waiting_for = f"the state directory {self.state_dir}"
        self.plugin.serve()
        self.readiness.add("kubelet", self._registered)
        self.readiness.add("sockets", self.plugin.sockets_intact)
        self.readiness.add("state-dir", lambda: (True, self._handover_detail()))
        self.http.start()
        host, port = self.http.address
        started, previous, timeout = time.monotonic(), None, 0.0
        while not self.lock.acquire(wait=True, stop=stop, timeout=timeout):
            if stop.is_set():
                self.log.info("stopped before the state directory was handed over")
                return False
            previous, timeout = self.lock.holder(), HANDOVER_LOG_S
            self.plugin.gate.waiting_for = f"the state directory {self.state_dir} ({previous})"
            self.log.info(
                "waiting for the state directory",
                extra=fields_(
                    state_dir=str(self.state_dir),
                    holder=str(previous),
                    waited_s=round(time.monotonic() - started, 1),
                    healthz=f"{self.http.scheme}://{host}:{port}/healthz",
                ),
            )
        self.log.info(
            "took over the state directory",
            extra=fields_(
                state_dir=str(self.state_dir),
                previous=str(previous) if previous else None,
                waited_s=round(time.monotonic() - started, 3),
            ),
        )
        return True

    def _handover_detail(self) -> str:
        if self.lock.held:
            return "held"
        return (
            f"waiting for {self.lock.holder()} to hand {self.state_dir} over; the kubelet's calls"
            " wait meanwhile"
        )

    def _release_state_dir(self) -> None:
        """Give the state directory up unless something of ours may still write it: then the
        kernel releases it when the process exits (the CLI ends it at once)."""
        if not self.lock.held:
            return
        if self.unfinished:
            self.log.warning(
                "keeping the state directory locked until the process exits: work is still running",
                extra=fields_(state_dir=str(self.state_dir), unfinished=self.unfinished),
            )
            return
        self.lock.release()
        self.log.info("released the state directory", extra=fields_(state_dir=str(self.state_dir)))

    def _sockets_intact(self) -> tuple[bool, str]:
        """Ready only while the kubelet and telemetry clients can still reach our sockets."""
        results = (self.plugin.sockets_intact(), self.telemetry_server.socket_intact())
        problems = [detail for ok, detail in results if not ok]
        return (not problems, "; ".join(problems) or "serving")

    def _sweep_temp_files(self) -> None:
        """Temporary files that a crash mid-write left (the lock says no one else writes here)."""
        removed = [
            *remove_temp_files(self.state_dir),
            *remove_temp_files(self.state_dir / "resourceslices"),
            *self.preparer.cdi.remove_temp_files(),
        ]
        for path in removed:
            self.log.info("removed a temporary file left by a crash", extra=fields_(path=str(path)))

    def _state_dir_intact(self) -> tuple[bool, str]:
        """The state directory (and the lock in it) is still the one this agent started with."""
        if self.lock.intact():
            return True, "intact"
        return False, f"{self.state_dir} was deleted or replaced while the agent runs"

    def _disk_writable(self) -> tuple[bool, str]:
        """Not ready while the checkpoint or a CDI spec cannot be written (a read-only or full
        disk): every prepare and unprepare fails until the disk is fixed, which a restart does
        not do (so /healthz passes). The check follows the disk: ready again once there is room."""
        checkpoint = self.preparer.store.path
        try:
            size = checkpoint.stat().st_size
        except OSError:
            size = 0
        problems = [
            p
            for p in (
                disk_trouble(checkpoint.parent, size),
                disk_trouble(self.preparer.cdi.cdi_root),
            )
            if p is not None
        ]
        if not problems:
            return True, "writable"
        return False, "; ".join(problems) + ": claims that need a write there fail"

    def _claims_moving(self) -> tuple[bool, str]:
        """Not ready while a prepare or unprepare is stuck past the kubelet's deadline."""
        stuck = self.preparer.stuck()
        return (not stuck, f"stuck past the deadline: {'; '.join(stuck)}" if stuck else "moving")

    def _claims_accounted_for(self) -> tuple[bool, str]:
        """Passes, naming the claims a lost checkpoint could not be rebuilt for (their devices
        stay held; the kubelet can still unprepare them): an operator's problem, not one a
        restart or taking the agent out of service would repair (docs/reliability.md)."""
        lost = self.preparer.unrecovered()
        if not lost:
            return True, "every prepared claim is accounted for"
        return True, f"{len(lost)} held but not rebuilt: {'; '.join(str(u) for u in lost)}"

    def stop(self) -> None:
        """Stop in reverse order of start, all of it within ``--shutdown-timeout``.

        Claims being prepared get most of that time to finish (new kubelet calls are refused
        meanwhile); claims still running at the deadline are left to the next start's
        reconcile, and what had not stopped is listed in ``unfinished``. The state directory's
        lock is released last, or with --rolling-update as soon as nothing of ours writes the
        directory or the API any more (the claims answered, the loops stopped, the energy state
        saved), so the agent taking over waits no longer than that; never while something of
        ours is still running (the process then exits with it)."""
        deadline = Deadline(self.config.shutdown_timeout)
        self.stop_event.set()
        if self.triggers is not None:
            self.triggers.close()
        self.http.stop()
        total = deadline.remaining()
        running = self.preparer.close(total - min(STOP_RESERVE_S, total / 2))
        if running:
            self.log.warning(
                "claims still running at the shutdown deadline; the next start rolls them back",
                extra=fields_(claims=running),
            )
            self.unfinished += [f"claim {c}" for c in running]
        # the sockets go only once every call is answered: the kubelet closes its connection to
        # a plugin whose registration socket is removed, cancelling calls still in flight
        self.plugin.stop(grace=deadline.remaining(1.0))
        # its socket is in the state directory: gone before a successor binds its own there
        self.telemetry_server.stop(grace=deadline.remaining(1.0))
        self.publisher.stop()
        if self.supervisor is not None:
            stuck = self.supervisor.join(deadline)
            if stuck:
                self.log.warning("tasks did not stop in time", extra=fields_(tasks=stuck))
                self.unfinished += stuck
        if self.node_events is not None:
            self.node_events.close()  # the loop flushed what it could; logs what is left
        if self.lock.held:  # an agent that never got its state directory has nothing to save
            self.accounting.close()
        if self.config.rolling_update:
            self._release_state_dir()  # hand over now
        self.reader.close()
        self.events.close()
        if self.config.cleanup_on_exit:
            try:
                self.publisher.cleanup()
            except KubeError as exc:
                self.log.error("could not remove ResourceSlices", extra=fields_(error=str(exc)))
        if self.kube is not None:
            self.kube.close()
        self.source.nvml.shutdown()
        self._release_state_dir()
        self.log.info("agent stopped", extra=fields_(unfinished=self.unfinished))

    def run(self, stop: threading.Event) -> int:
        """Run until ``stop`` is set or a task fails; the exit code (1 when a task failed).
        A start that fails half way still stops what it had started."""
        try:
            self.start(stop)
            while not stop.wait(0.2) and not self.stop_event.is_set():
                pass
        finally:
            self.stop()
        return 1 if self.supervisor and self.supervisor.failures else 0

    def _start_telemetry(self) -> None:
        """Sample the discovered GPUs; serve the telemetry API once a first sample exists."""
        self.sampler.tick()
        self.readiness.add(
            "sampler",
            lambda: (
                self.sampler.fresh(),
                "fresh" if self.sampler.fresh() else "no recent sample",
            ),
        )
        self.telemetry_server.start()

    def _notify_watchers(self) -> None:
        """Wake telemetry watchers on every new snapshot (a latest-wins subscription)."""
        sub = self.sampler.subscribe()
        try:
            while not self.stop_event.is_set():
                if sub.get(timeout=0.5) is not None:
                    self.telemetry_server.notify()
        finally:
            sub.close()

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


def open_node(config: Config, state_dir: Path) -> NodeSource:
    """The node this run looks at: a simulated model with ``--simulate``, else this machine
    (NVML is not initialized yet). The one place that decides."""
    if config.simulate:
        from agent.sim.node import simulated_node

        return simulated_node(
            config.simulate,
            state_dir,
            mig_layout=config.sim_mig_layout,
            node_name=config.node_name,
            sysfs_root=config.sysfs_root,
            driver_root=config.driver_root,
            proc_root=config.proc_root,
            driver_layout=config.sim_driver_layout,
            host_driver_root=config.host_driver_root,
        )
    return real_node(
        node_name=config.node_name,
        sysfs_root=config.sysfs_root,
        driver_root=config.driver_root,
        proc_root=config.proc_root,
        host_driver_root=config.host_driver_root,
    )


@dataclass(frozen=True)
class AgentPaths:
    """The directories the agent writes outside its state directory, as the agent sees them."""

    registry_dir: Path
    """The kubelet's plugin registry (the registration socket goes here)."""
    plugins_dir: Path
    """The kubelet's plugins directory (the DRA socket is ``<dir>/<driver>/dra.sock``)."""
    cdi_root: Path
    """Where the CDI specs of prepared claims are written."""


REAL_PATHS = AgentPaths(KUBELET_REGISTRY_DIR, KUBELET_PLUGINS_DIR, CDI_ROOT)


def simulated_paths(state_dir: Path) -> AgentPaths:
    """Where the simulated node's kubelet and container runtime have these directories."""
    return AgentPaths(
        state_dir / "kubelet" / "plugins_registry", state_dir / "kubelet" / "plugins",
        state_dir / "cdi",
    )  # fmt: skip


def agent_paths(config: Config, state_dir: Path) -> AgentPaths:
    """The kubelet and CDI directories ``tessera run`` with this Config uses (``tessera doctor``
    checks the same ones): the flags, else the real node's, or the simulated node's with
    ``--simulate``."""
    default = REAL_PATHS if config.simulate is None else simulated_paths(state_dir)
    return AgentPaths(
        registry_dir=config.kubelet_registry_dir or default.registry_dir,
        plugins_dir=config.kubelet_plugins_dir or default.plugins_dir,
        cdi_root=config.cdi_root or default.cdi_root,
    )


def host_root(config: Config, state_dir: Path, given: Path | None) -> Path:
    """Where the host's / is seen: ``given`` (``tessera doctor --host-root``), else /, or with
    ``--simulate`` the simulated node's host tree, written under ``<state_dir>/sim/host`` (a
    given one is read as it is, never written)."""
    if given is not None:
        return given
    if config.simulate is None:
        return Path("/")
    from agent.sim.hostroot import write_host_root
    from agent.sim.model import load_model

    root = state_dir / "sim" / "host"
    sim = simulated_paths(state_dir)
    write_host_root(
        load_model(config.simulate),
        root,
        cdi_dirs=[sim.cdi_root],
        kubelet_dirs=[sim.registry_dir, sim.plugins_dir],
    )
    return root


def node_uid(kube: KubeClient, name: str, log: logging.Logger) -> str | None:
    """The Node's uid for slice ownerReferences; None (logged) when it cannot be read."""
    try:
        uid = kube.request("GET", f"/api/v1/nodes/{name}").get("metadata", {}).get("uid")
    except KubeError as exc:
        log.warning("cannot read the Node; slices get no owner", extra=fields_(error=str(exc)))
        return None
    return str(uid) if uid else None


def take_state_dir(state_dir: Path, *, pod_uid: str | None = None, now: bool = True) -> StateLock:
    """Create the state directory if needed and take its lock before anything else touches it
    (one agent per state directory). Raises ConfigError or StateDirInUse, each one line.
    ``now=False`` (a rolling update): the lock is taken later (``Agent.start``)."""
    if state_dir.exists() and not state_dir.is_dir():
        raise ConfigError(f"--state-dir: {state_dir} is not a directory")
    try:
        ensure_dir(state_dir)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename not in (None, str(state_dir)) else ""
        raise ConfigError(
            f"--state-dir: cannot create {state_dir}: {exc.strerror or exc}{where}"
        ) from exc
    if not state_dir.is_dir():
        raise ConfigError(f"--state-dir: {state_dir} is not a directory")
    lock = StateLock(state_dir, pod_uid)
    if now:
        lock.acquire()
    return lock


def build_agent(
    config: Config, log: logging.Logger, environ: Mapping[str, str] | None = None
) -> Agent:
    """Compose the agent from its configuration: takes the state directory's lock (with
    --rolling-update: ``Agent.start`` waits for it), then initializes NVML (no driver is the most
    basic failure); starts no loop and writes nothing in the state directory. ``environ`` is the
    agent's environment (its ``PATH`` is searched for the toolkit's hook binary)."""
    state_dir = config.state_dir or DEFAULT_STATE_DIR
    lock = take_state_dir(
        state_dir,
        pod_uid=config.pod_uid if config.rolling_update else None,
        now=not config.rolling_update,
    )
    try:
        return _build(config, log, state_dir, lock, environ or {})
    except BaseException:
        lock.release()
        raise


def log_nvml_library(source: NodeSource, log: logging.Logger) -> None:
    """The one line that says which libnvidia-ml.so.1 NVML uses, and why."""
    lib = source.nvml_library
    log.info(
        "NVML library",
        extra=fields_(
            path=lib.path if lib else None,
            reason=lib.reason if lib else "not decided",
            driver_root=str(source.driver_root),
        ),
    )


def cdi_hook(config: Config, source: NodeSource, environ: Mapping[str, str]) -> str | None:
    """The host path of the NVIDIA Container Toolkit hook the CDI specs run, or None for the
    hook-free layout: --cdi-hook-path, else the hook found under the driver root (the one
    decision ``tessera run`` and ``tessera doctor`` share)."""
    if config.cdi_hook_path is not None:
        return str(config.cdi_hook_path)
    same_view = source.host_root.resolve() == source.driver_root.resolve()
    rel = find_cdi_hook(source.driver_root, host_view_is_ours=same_view, env=environ)
    return None if rel is None else str(under(source.host_root, rel))


def cdi_writer(
    config: Config,
    source: NodeSource,
    cdi_root: Path,
    driver_version: str,
    log: logging.Logger,
    environ: Mapping[str, str],
) -> CdiWriter:
    """The CDI writer of this node: the driver's files under the driver root, named in specs
    under the host's driver root, with the toolkit's hooks when its binary is on the host
    (:func:`cdi_hook`). Writes nothing: ``Agent.start`` writes the base spec once the state
    directory is ours."""
    hook = cdi_hook(config, source, environ)
    make_node = make_char_device
    if config.simulate:
        from agent.sim.driverroot import make_device_node

        make_node = make_device_node
    cdi = CdiWriter(
        cdi_root,
        config.driver_name,
        source.driver_root,
        driver_version,
        host_driver_root=source.host_root,
        hook=hook,
        make_node=make_node,
    )
    f = cdi.files
    log.info(
        "driver files for containers",
        extra=fields_(
            driver_root=str(source.driver_root),
            host_driver_root=str(source.host_root),
            driver_version=driver_version,
            libraries=len(f.libraries),
            library_dirs=",".join(f.library_dirs),
            binaries=len(f.binaries),
            firmware=len(f.firmware),
            sockets=",".join(f.sockets),
            cdi_hook=hook or "none (every library name mounted)",
            base_spec=str(cdi.base_path),
        ),
    )
    if not f.library("libcuda.so") or not f.library("libnvidia-ml.so"):
        log.warning(
            "the driver's libcuda or libnvidia-ml was not found under the driver root: CUDA"
            " containers will not find the driver (check --driver-root)",
            extra=fields_(driver_root=str(source.driver_root), driver_version=driver_version),
        )
    return cdi


def _build(
    config: Config,
    log: logging.Logger,
    state_dir: Path,
    lock: StateLock,
    environ: Mapping[str, str],
) -> Agent:
    source = open_node(config, state_dir)
    log_nvml_library(source, log)
    source.nvml.init()
    readiness, liveness = Readiness(), Readiness()
    registry = CollectorRegistry(auto_describe=True)
    driver_metrics = DriverMetrics(registry)
    host, port = config.metrics_host_port()
    exposition = Exposition(registry, lambda: None)
    http = HttpEndpoint(
        host,
        port,
        readiness,
        metrics=exposition,
        liveness=liveness,
        limits=HttpLimits(
            max_connections=config.http_max_connections,
            threads=config.http_threads,
            header_timeout=config.http_header_timeout,
            body_timeout=config.http_body_timeout,
            response_timeout=config.http_response_timeout,
            fd_reserve=config.fd_reserve,
        ),
        tls=config.metrics_tls(),
        log=log.getChild("http"),
    )
    kube = None
    if not config.no_kube:
        # imported here: the kubernetes client costs 0.2 s at start-up, which standalone mode
        # (--no-kube) need not pay
        from dra_driver.cluster.kube import KubeClient

        kube = KubeClient.from_config(config.kubeconfig)
    store: SliceStore = (
        DirSliceStore(state_dir / "resourceslices", log.getChild("publisher"))
        if kube is None
        else KubeSliceStore(kube, config.driver_name, source.hostname)
    )
    claims: DirClaimSource | KubeClaimSource = (
        DirClaimSource(state_dir / "resourceclaims")
        if kube is None
        else KubeClaimSource(kube, timeout=(5.0, config.claim_read_timeout))
    )
    paths = agent_paths(config, state_dir)
    health = HealthBoard(pool=source.hostname, held=lambda: held_devices(preparer))
    events_log = log.getChild("node-events")
    node_events = NodeEventRecorder(
        LogEventSink(events_log) if kube is None else KubeEventSink(kube),
        node=source.hostname,
        component=config.driver_name,
        log=events_log,
    )
    publisher = Publisher(
        store,
        SlicePolicy(
            driver_name=config.driver_name, node_name=source.hostname, layout=config.kube_layout
        ),
        log.getChild("publisher"),
        resync_interval=config.resync_interval,
    )
    driver_version = source.nvml.system().driver_version
    devices = CurrentDevices()
    prepare_log = log.getChild("prepare")
    crash = crash_hook(config.sim_crash_at, log.getChild("sim"))
    preparer = Preparer(
        driver_name=config.driver_name,
        pool=source.hostname,
        claims=claims,
        store=CheckpointStore(
            state_dir / "checkpoint.json",
            source.boot_id,
            log=log.getChild("checkpoint"),
            guard=lock.guard,  # only the agent holding the state directory writes it
        ),
        cdi=cdi_writer(
            config, source, paths.cdi_root, driver_version, log.getChild("cdi"), environ
        ),
        devices=devices.get,
        log=prepare_log,
        effects=sharing_effects(config, source, state_dir, devices, prepare_log, crash),
        sharing=config.sharing_policy(),
        crash_hook=crash,
        observe=driver_metrics.observe,
        boot_time=source.boot_time,
        index=claims,
    )
    plugin = PluginServer(
        driver_name=config.driver_name,
        registry_dir=paths.registry_dir,
        plugins_dir=paths.plugins_dir,
        preparer=preparer,
        health=health,
        log=log.getChild("plugin"),
        health_streams=config.kubelet_health_streams,
        instance=config.pod_uid if config.rolling_update else None,
    )
    nvml = source.nvml
    events = EventWatcher(nvml)
    reader = TelemetryReader(nvml)
    accounting = EnergyAccounting(
        state_dir / "energy.json",
        log=log.getChild("energy"),
        process_pod=ProcessPods(source.proc_root, log=log.getChild("owners")),
        load=False,  # Agent.start, once the state directory is ours
    )
    sampler = Sampler(
        node=source.hostname,
        read=reader.read,
        gpus=[],
        holders=preparer.prepared_claims,
        accounting=accounting,
        log=log.getChild("sampler"),
        interval=config.telemetry_interval,
        xids=lambda: events.wait(0),
        application_xids=application_xids(config.application_xids),
    )
    status = agent_status(source.hostname, kube, plugin, publisher, preparer, node_events)
    registry.register(SnapshotCollector(lambda: sampler.latest))
    registry.register(AgentCollector(status))
    exposition.key = lambda: (
        sampler.latest.tick if sampler.latest else None,
        driver_metrics.version,
        status(),
    )
    agent = Agent(
        config=config,
        source=source,
        state_dir=state_dir,
        http=http,
        readiness=readiness,
        publisher=publisher,
        preparer=preparer,
        plugin=plugin,
        health=health,
        kube=kube,
        log=log,
        devices=devices,
        sampler=sampler,
        reader=reader,
        accounting=accounting,
        events=events,
        telemetry_server=TelemetryServer(
            lambda: sampler.latest,
            state_dir / "telemetry.sock",
            log.getChild("telemetry"),
            config.telemetry_address,
            limits=TelemetryLimits(
                max_watchers=config.telemetry_max_watchers,
                streams_per_connection=config.telemetry_streams_per_connection,
                send_timeout=config.telemetry_send_timeout,
            ),
            tls=config.telemetry_tls(),
        ),
        lock=lock,
        triggers=open_triggers(config, state_dir, log.getChild("rediscovery")),
        node_events=node_events,
        faults=FaultStore(state_dir, source.boot_id, log.getChild("health")),
    )
    sampler.on_health_change = agent.gpu_health_changed
    agent.on_health_event = health_event(node_events)
    agent.on_devices_changed = devices_event(node_events)
    publisher.on_taints_dropped = agent.publish_devices
    return agent


def held_devices(preparer: Preparer) -> set[str]:
    """The devices of this node's pool that checkpointed claims hold (recovered ones too)."""
    try:
        checkpoint = preparer.checkpoint
    except RuntimeError:  # before the start's reconcile
        return set()
    return {
        d.device for e in checkpoint.claims.values() for d in e.devices if d.pool == preparer.pool
    }


def open_triggers(config: Config, state_dir: Path, log: logging.Logger) -> EventSource:
    """What tells the agent that GPUs came or went: udev on a real node, the simulator's event
    log with ``--simulate`` (the one place that chooses)."""
    if config.simulate:
        from agent.sim.udev import SimUdevSource

        return SimUdevSource(state_dir / "sim")
    return open_udev(log)


def devices_event(node_events: NodeEventRecorder) -> Callable[[DevicesChanged], None]:
    """A rediscovery that changed the advertised devices, recorded as Events on the Node: one
    per GPU that left (GpuRemoved, Warning) or came (GpuAdded), and one DevicesChanged naming
    the devices (a MIG change has only that one). A re-bind alone records nothing here: the
    health change it leads to does."""

    def record(change: DevicesChanged) -> None:
        for g in change.removed_gpus:
            node_events.record(*gpu_removed(g.index, g.uuid, g.bus_id))
        for g in change.added_gpus:
            node_events.record(*gpu_added(g.index, g.uuid, g.bus_id))
        if change.added_devices or change.removed_devices:
            node_events.record(*devices_changed(change.added_devices, change.removed_devices))

    return record


def health_event(node_events: NodeEventRecorder) -> Callable[[GpuHealth], None]:
    """A published GPU health change, recorded as an Event on the Node (reason GpuUnhealthy
    or GpuHealthy, the message naming the GPU, its UUID and the cause)."""

    def record(change: GpuHealth) -> None:
        cause = change.cause or "it answers again and passed the health probe"
        node_events.record(*gpu_health(change.index, change.uuid, change.healthy, cause))

    return record


def agent_status(
    node: str,
    kube: KubeClient | None,
    plugin: PluginServer,
    publisher: Publisher,
    preparer: Preparer,
    node_events: NodeEventRecorder | None = None,
) -> Callable[[], AgentStatus]:
    """The agent's own state for /metrics (in-memory reads only)."""

    def status() -> AgentStatus:
        return AgentStatus(
            node=node,
            kubelet_registered=None if kube is None else plugin.registered,
            slice_generation=publisher.published_generation,
            slice_writes=publisher.stats.writes,
            slice_errors=publisher.stats.errors,
            claims_stuck=len(preparer.stuck()),
            claims_unrecovered=len(preparer.unrecovered()),
            node_events=() if node_events is None else node_events.stats.outcomes(),
        )

    return status


def sharing_effects(
    config: Config,
    source: NodeSource,
    state_dir: Path,
    devices: CurrentDevices,
    log: logging.Logger,
    crash: Callable[[str], None],
) -> Effects:
    """The tools prepare shares devices and makes partitions with: nvidia-smi and
    nvidia-cuda-mps-control from the driver root (the simulator's stand-ins with --simulate),
    MPS daemons under --mps-root, and dynamic MIG through NVML when --mig-mode is dynamic."""
    tools = Tools(
        nvidia_smi=find_tool("nvidia-smi", source.driver_root, config.nvidia_smi),
        mps_control=find_tool("nvidia-cuda-mps-control", source.driver_root, config.mps_control),
        env=tool_env(source.driver_root),
    )
    mps = MpsControl(
        tools,
        config.mps_root or state_dir / "mps",
        log.getChild("mps"),
        # the real daemon gets the claim's shared-memory directory as its /dev/shm (its clients
        # see the same one through the CDI mount); the simulator's stand-in needs none
        private_shm=config.simulate is None,
        ready_timeout_s=config.mps_ready_timeout,
    )
    # claim UIDs are 36 characters: warn now rather than at the first MPS claim
    problem = mps.socket_path_problem("0" * 36)
    if problem is not None:
        log.warning("MPS claims will fail to prepare", extra=fields_(reason=problem))
    mig = (
        DynamicMig(MigControl(source.nvml), log.getChild("mig"), crash)
        if config.mig_mode == "dynamic"
        else None
    )
    return Effects(
        mig=mig,
        settings=GpuSettings(tools),
        mps=mps,
        devices=devices.get,
        log=log,
        crash_hook=crash,
    )


def kill_self() -> None:
    """SIGKILL this process: no handler, no clean-up, as a crash would end it."""
    os.kill(os.getpid(), signal.SIGKILL)


def crash_hook(
    at: CrashAt | None,
    log: logging.Logger | None = None,
    kill: Callable[[], None] = kill_self,
) -> Callable[[str], None]:
    """Simulation fault injection (``--sim-crash-at``): ``kill`` (SIGKILL ourselves) the
    ``at.occurrence``-th time prepare or unprepare reaches ``at.point`` in this process.

    The claims of a call run on several threads, so the count is kept under a lock: each
    occurrence is counted once, and exactly one caller kills. The passes before it are logged
    (``passed a crash point``), so a test can tell a point reached fewer times than it armed
    from one never reached."""
    if at is None:
        return lambda reached: None
    lock = threading.Lock()
    passed = 0

    def hook(reached: str) -> None:
        nonlocal passed
        if reached != at.point:
            return
        with lock:
            passed += 1
            occurrence = passed
        if occurrence == at.occurrence:
            kill()
        elif occurrence < at.occurrence and log is not None:
            log.info(
                "passed a crash point",
                extra=fields_(point=at.point, occurrence=occurrence, fires_at=at.occurrence),
            )

    return hook
