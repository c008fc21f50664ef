"""The composition root: the only place that constructs the daemon's object graph.

``build_agent`` turns a Config (and what the CLI decided about the node: :class:`NodeAccess`)
into a ready-to-start :class:`Agent`, in one pass: every part gets its dependencies, and only
the settings groups it needs, when it is constructed, and nothing is patched afterwards. The
two callbacks that point back at a part built later (the sampler's health changes and the
publisher's notice that taints were dropped, both handled by :class:`NodeDevices`) go through a
:class:`Relay` made first and handed to both sides."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from agent.config import Config
from agent.daemon.agent import Agent
from agent.daemon.devices import CurrentDevices, NodeDevices
from agent.daemon.gone_claims import GoneClaims
from agent.daemon.handover import StateDir
from agent.daemon.hub import Relay
from agent.daemon.node_owner import NodeOwner
from agent.daemon.paths import DEFAULT_STATE_DIR, agent_paths, take_state_dir
from agent.daemon.readiness import AgentChecks, ClaimChecks, SocketChecks
from agent.daemon.sampling import Sampling
from agent.daemon.vm_wiring import vm_tools
from agent.daemon.wiring import (
    agent_status,
    cdi_writer,
    claim_unprepared,
    crash_hook,
    devices_event,
    health_event,
    held_devices,
    log_nvml_library,
    sharing_effects,
)
from agent.discovery.vm import vm_discovery
from agent.driverfiles.discover import make_char_device
from agent.hotplug import DevicesChanged, EventSource, Rediscovery
from agent.http import HttpEndpoint, HttpLimits, Readiness
from agent.node import NodeSource
from agent.nvml.events import EventWatcher
from agent.nvml.telemetry import TelemetryReader
from agent.statelock import StateLock
from agent.telemetry.agent_metrics import AgentCollector, DriverMetrics
from agent.telemetry.energy import EnergyAccounting
from agent.telemetry.faults import FaultStore
from agent.telemetry.gpu_health import GpuHealth, application_xids
from agent.telemetry.metrics import Exposition, SnapshotCollector
from agent.telemetry.owners import ProcessPods
from agent.telemetry.sampler import Sampler
from agent.telemetry.stream import TelemetryLimits, TelemetryServer
from agent.telemetry.usage_meter import UsageMeter
from dra_driver.advertise.publisher import Publisher
from dra_driver.advertise.slice_stores import DirSliceStore, KubeSliceStore, SliceStore
from dra_driver.advertise.slices import SlicePolicy
from dra_driver.cluster.node_events import KubeEventSink, LogEventSink, NodeEventRecorder
from dra_driver.kubeletplugin.cdi_spec import MakeNode
from dra_driver.kubeletplugin.checkpoint import CheckpointStore
from dra_driver.kubeletplugin.claim_sources import DirClaimSource, KubeClaimSource
from dra_driver.kubeletplugin.device_metadata import DeviceMetadataWriter
from dra_driver.kubeletplugin.health_stream import HealthBoard
from dra_driver.kubeletplugin.prepare import Preparer
from dra_driver.kubeletplugin.server import PluginServer


@dataclass(frozen=True)
class NodeAccess:
    """What the CLI decides about the node the daemon runs on: this machine, or the simulator's
    stand-in for one (``--simulate``). The daemon itself never imports the simulator."""

    open: Callable[[Path], NodeSource]
    """The node, given the state directory (NVML not initialized yet)."""
    triggers: Callable[[Path, logging.Logger], EventSource] | None
    """What tells the agent that GPUs came or went, given the state directory (None: no
    rediscovery loop at all)."""
    make_device_node: MakeNode = make_char_device
    """How a missing MIG capability's device node is made (``mknod``, or the simulator's)."""


def build_agent(
    config: Config,
    log: logging.Logger,
    node: NodeAccess,
    environ: Mapping[str, str] | None = None,
) -> Agent:
    """Compose the agent from its configuration: takes the state directory's lock (with
    --rolling-update: ``Agent.start`` waits for it), then initializes NVML (no driver is the most
    basic failure); starts no loop and writes nothing in the state directory. ``environ`` is the
    agent's environment (its ``PATH`` is searched for the toolkit's hook binary)."""
    state_dir = config.node.state_dir or DEFAULT_STATE_DIR
    daemon = config.daemon
    lock = take_state_dir(
        state_dir,
        pod_uid=daemon.pod_uid if daemon.rolling_update else None,
        now=not daemon.rolling_update,
    )
    try:
        return _build(config, log, node, state_dir, lock, environ or {})
    except BaseException:
        lock.release()
        raise


def _build(
    config: Config,
    log: logging.Logger,
    node: NodeAccess,
    state_dir: Path,
    lock: StateLock,
    environ: Mapping[str, str],
) -> Agent:
    source = node.open(state_dir)
    log_nvml_library(source, log)
    source.nvml.init()
    driver_name = config.driver.driver_name
    registry = CollectorRegistry(auto_describe=True)
    driver_metrics = DriverMetrics(registry)
    kube = None
    if not config.cluster.no_kube:
        # imported here: the kubernetes client costs 0.2 s at start-up, which standalone mode
        # (--no-kube) need not pay
        from dra_driver.cluster.kube import KubeClient

        kube = KubeClient.from_config(config.cluster.kubeconfig)
    store: SliceStore = (
        DirSliceStore(state_dir / "resourceslices", log.getChild("publisher"))
        if kube is None
        else KubeSliceStore(kube, driver_name, source.hostname)
    )
    claims: DirClaimSource | KubeClaimSource = (
        DirClaimSource(state_dir / "resourceclaims")
        if kube is None
        else KubeClaimSource(kube, timeout=(5.0, config.cluster.claim_read_timeout))
    )
    paths = agent_paths(config, state_dir)
    events_log = log.getChild("node-events")
    owner = NodeOwner(kube, source.hostname, log)
    node_events = NodeEventRecorder(
        LogEventSink(events_log) if kube is None else KubeEventSink(kube),
        node=source.hostname,
        component=driver_name,
        log=events_log,
        node_uid=owner.uid,
    )
    # handled by NodeDevices, built once what it needs is
    health_changes: Relay[GpuHealth] = Relay("on_health_change")
    taints_dropped: Relay[None] = Relay("on_taints_dropped")
    devices_changed: Relay[DevicesChanged] = Relay("on_devices_changed")
    mig_changed: Relay[int] = Relay("on_mig_changed")  # a prepare made or destroyed MIG devices
    gpu_rebound: Relay[str] = Relay("on_gpu_rebound")  # a GPU back on nvidia from a VM (its BDF)
    gpu_handing: Relay[str] = Relay("on_gpu_handing")  # a GPU about to leave nvidia for a VM
    # a GPU now on vfio-pci for a VM, or a function a vGPU was made on or removed from
    vm_changed: Relay[str] = Relay("on_vm_changed")
    devices_changed.subscribe(devices_event(node_events))
    publisher = Publisher(
        store,
        SlicePolicy(
            driver_name=driver_name, node_name=source.hostname, layout=config.driver.kube_layout
        ),
        log.getChild("publisher"),
        resync_interval=config.publishing.resync_interval,
        node_uid=owner.uid,
        on_taints_dropped=lambda: taints_dropped(None),
    )
    driver_version = source.nvml.system().driver_version
    devices = CurrentDevices()
    prepare_log = log.getChild("prepare")
    crash = crash_hook(config.simulator.sim_crash_at, log.getChild("sim"))
    telemetry = config.telemetry
    usage = UsageMeter(
        state_dir / "usage.json",
        source.boot_id,
        log.getChild("usage"),
        write_interval=telemetry.usage_write_interval,
    )
    claim_status = None
    if kube is not None:
        from dra_driver.cluster.claim_usage_status import ClaimUsageStatusWriter

        claim_status = ClaimUsageStatusWriter(
            kube, driver_name, usage, log.getChild("claim-usage-status")
        )
    vm = vm_tools(
        config.driver.device_policy().virtualization,
        source,
        kernel_write=source.pci_write,  # the simulator's kernel under --simulate, else None
        rebound=gpu_rebound,
        handing=gpu_handing,
        handed=vm_changed,
        log=prepare_log.getChild("vm"),
        crash=crash,
    )
    preparer = Preparer(
        driver_name=driver_name,
        pool=source.hostname,
        claims=claims,
        store=CheckpointStore(
            state_dir / "checkpoint.json",
            source.boot_id,
            log=log.getChild("checkpoint"),
            guard=lock.guard,  # only the agent holding the state directory writes it
        ),
        cdi=cdi_writer(
            config,
            source,
            paths.cdi_root,
            driver_version,
            log.getChild("cdi"),
            environ,
            node.make_device_node,
        ),
        devices=devices.get,
        log=prepare_log,
        effects=sharing_effects(
            config, source, state_dir, devices, prepare_log, crash, mig_changed, kube, vm=vm
        ),
        sharing=config.driver.sharing_policy(),
        crash_hook=crash,
        observe=driver_metrics.observe,
        boot_time=source.boot_time,
        index=claims,
        on_unprepared=claim_unprepared(claim_status),
        # KEP-5304 metadata of VM devices, always: KubeVirt finds a VM's GPU only there
        # (docs/virtualization.md); container devices get none, so nothing to switch off
        metadata=DeviceMetadataWriter(paths.plugins_dir / driver_name, paths.cdi_root, driver_name),
    )
    health = HealthBoard(pool=source.hostname, held=lambda: held_devices(preparer))
    daemon = config.daemon
    plugin = PluginServer(
        driver_name=driver_name,
        registry_dir=paths.registry_dir,
        plugins_dir=paths.plugins_dir,
        preparer=preparer,
        health=health,
        log=log.getChild("plugin"),
        health_streams=config.kubelet.kubelet_health_streams,
        instance=daemon.pod_uid if daemon.rolling_update else None,
    )
    events = EventWatcher(source.nvml)
    reader = TelemetryReader(source.nvml)
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
        interval=telemetry.telemetry_interval,
        xids=lambda: events.wait(0),
        on_health_change=health_changes,
        application_xids=application_xids(telemetry.application_xids),
        usage=usage,
        holders_changed=preparer.holder_changes,
    )
    usage_report = None
    if kube is not None:
        from dra_driver.cluster.usage_report import UsageReporter

        usage_report = UsageReporter(
            kube,
            source.hostname,
            usage,
            log.getChild("usage-report"),
            interval=config.cluster.usage_report_interval,
        )
    telemetry_server = TelemetryServer(
        lambda: sampler.latest,
        state_dir / "telemetry.sock",
        log.getChild("telemetry"),
        telemetry.telemetry_address,
        limits=TelemetryLimits(
            max_watchers=telemetry.telemetry_max_watchers,
            streams_per_connection=telemetry.telemetry_streams_per_connection,
            send_timeout=telemetry.telemetry_send_timeout,
        ),
        tls=telemetry.tls(),
        device_names=devices.names,
    )
    triggers = (
        None if node.triggers is None else node.triggers(state_dir, log.getChild("rediscovery"))
    )
    faults = FaultStore(state_dir, source.boot_id, log.getChild("health"))
    node_devices = NodeDevices(
        source=source,
        vm=vm_discovery(
            config.driver.virtualization, state_dir, source.nvml, log.getChild("discovery")
        ),
        policy=config.driver.device_policy(),
        device_taints=config.publishing.device_taints,
        devices=devices,
        health=health,
        publisher=publisher,
        events=events,
        reader=reader,
        sampler=sampler,
        faults=faults,
        lock=lock,
        log=log,
        health_changes=health_changes,
        taints_dropped=taints_dropped,
        devices_changed=devices_changed,
        mig_changed=mig_changed,
        health_published=health_event(node_events),
    )
    # a GPU back on nvidia from a VM: NVML's indexes shift, so the whole node is read again and
    # the GPU advertised for containers again before the unprepare answers
    gpu_rebound.subscribe(lambda bus_id: node_devices.rediscover(frozenset({bus_id})))
    gpu_rebound.subscribe(sampler.handed_back)
    # a GPU handed to a VM: not read from before its unbind (its reads fail, and that is no
    # loss) until the inventory, read again at once after the binding, says it is handed over
    gpu_handing.subscribe(sampler.hand_over)
    vm_changed.subscribe(lambda _: node_devices.rediscover())
    gone = GoneClaims(
        preparer, lambda: node_devices.inventory, node_events, log.getChild("gone-devices")
    )
    devices_changed.subscribe(lambda _: gone.observe())
    status = agent_status(
        source.hostname,
        kube,
        plugin,
        publisher,
        preparer,
        node_events,
        None if usage_report is None else usage_report.stats,
        None if claim_status is None else claim_status.stats,
        gone.count,
    )
    registry.register(
        SnapshotCollector(lambda: sampler.latest, lambda: (usage.counters(), usage.through))
    )
    registry.register(AgentCollector(status))
    exposition = Exposition(
        registry,
        lambda: (sampler.latest.tick if sampler.latest else None, driver_metrics.version, status()),
    )
    state = StateDir(state_dir, lock, log)
    sockets = SocketChecks(plugin, telemetry_server, standalone=kube is None)
    checks = AgentChecks(
        handover=[*sockets.handover_checks(), *state.handover_checks()],
        ready=[
            *node_devices.readiness_checks(),
            *sockets.readiness_checks(),
            *ClaimChecks(preparer).readiness_checks(),
            *gone.readiness_checks(),
            *publisher.readiness_checks(),
            *sampler.readiness_checks(),
        ],
        live=[*sockets.liveness_checks(), *state.liveness_checks()],
    )
    http_settings = config.http
    host, port = http_settings.host_port()
    http = HttpEndpoint(
        host,
        port,
        Readiness(),
        metrics=exposition,
        liveness=Readiness(),
        limits=HttpLimits(
            max_connections=http_settings.http_max_connections,
            threads=http_settings.http_threads,
            header_timeout=http_settings.http_header_timeout,
            body_timeout=http_settings.http_body_timeout,
            response_timeout=http_settings.http_response_timeout,
            fd_reserve=http_settings.fd_reserve,
        ),
        tls=http_settings.tls(),
        log=log.getChild("http"),
    )
    return Agent(
        settings=daemon,
        cleanup_on_exit=config.publishing.cleanup_on_exit,
        driver_name=driver_name,
        source=source,
        state=state,
        http=http,
        checks=checks,
        node=node_devices,
        publisher=publisher,
        preparer=preparer,
        plugin=plugin,
        kube=kube,
        owner=owner,
        node_events=node_events,
        gone=gone,
        usage_report=usage_report,
        claim_status=claim_status,
        telemetry=Sampling(
            sampler=sampler,
            reader=reader,
            events=events,
            accounting=accounting,
            faults=faults,
            server=telemetry_server,
            log=log,
        ),
        log=log,
        triggers=triggers,
        rediscovery=None
        if triggers is None
        else Rediscovery(
            triggers,
            node_devices.rediscover,
            interval=daemon.rediscovery_interval,
            debounce=daemon.rediscovery_debounce,
            log=log.getChild("rediscovery"),
        ),
    )
