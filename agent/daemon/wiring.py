"""The parts the composition root builds with more than a constructor call: the CDI writer, the
sharing tools, the fault-injection hook, the agent's status for /metrics and the Node events a
device or health change records. Each reads the settings groups it needs."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from agent.config import CdiSettings, Config, CrashAt
from agent.daemon.devices import CurrentDevices
from agent.driverfiles.discover import find_cdi_hook, make_char_device, under
from agent.hotplug import DevicesChanged
from agent.logs import fields_
from agent.node import NodeSource
from agent.nvml.mig import MigControl
from agent.nvml.power import PowerControl
from agent.telemetry.agent_metrics import AgentStatus
from agent.telemetry.gpu_health import GpuHealth
from dra_driver.advertise.publisher import Publisher
from dra_driver.cluster.claim_usage_status import (
    ClaimUsageStatusWriter,
    StatusStats,
    UnpreparedClaim,
)
from dra_driver.cluster.node_events import (
    NodeEventRecorder,
    devices_changed,
    gpu_added,
    gpu_health,
    gpu_removed,
)
from dra_driver.kubeletplugin.cdi import CdiWriter
from dra_driver.kubeletplugin.cdi_spec import MakeNode
from dra_driver.kubeletplugin.checkpoint import ClaimEntry
from dra_driver.kubeletplugin.effects import Effects
from dra_driver.kubeletplugin.prepare import Preparer
from dra_driver.kubeletplugin.server import PluginServer
from dra_driver.sharing.dynamic_mig import DynamicMig
from dra_driver.sharing.mps import MpsControl
from dra_driver.sharing.mps_launch import LocalLauncher, MpsLauncher
from dra_driver.sharing.node_tools import Tools, find_tool, tool_env
from dra_driver.sharing.power_cap import GpuPower
from dra_driver.sharing.timeslice import GpuSettings
from dra_driver.vm.tools import VmTools

if TYPE_CHECKING:  # imported where kube mode starts (build_agent)
    from dra_driver.cluster.kube import KubeClient
    from dra_driver.cluster.usage_report import ReportStats


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


def cdi_hook(cdi: CdiSettings, source: NodeSource, environ: Mapping[str, str]) -> str | None:
    """The host path of the NVIDIA Container Toolkit hook the CDI specs run, or None for the
    hook-free layout: --cdi-hook-path, else the hook found under the driver root (the one
    decision ``tessera run`` and ``tessera doctor`` share)."""
    if cdi.cdi_hook_path is not None:
        return str(cdi.cdi_hook_path)
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
    make_node: MakeNode = make_char_device,
) -> CdiWriter:
    """The CDI writer of this node: the driver's files under the driver root, named in specs
    under the host's driver root, with the toolkit's hooks when its binary is on the host
    (:func:`cdi_hook`); ``make_node`` makes a missing MIG capability's device node (the
    simulator's stand-in with --simulate: the CLI decides). Writes nothing: ``Agent.start``
    writes the base spec once the state directory is ours."""
    hook = cdi_hook(config.cdi, source, environ)
    cdi = CdiWriter(
        cdi_root,
        config.driver.driver_name,
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


def held_devices(preparer: Preparer) -> set[str]:
    """The devices of this node's pool that checkpointed claims hold (recovered ones too)."""
    try:
        checkpoint = preparer.checkpoint
    except RuntimeError:  # before the start's reconcile
        return set()
    return {
        d.device for e in checkpoint.claims.values() for d in e.devices if d.pool == preparer.pool
    }


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
    usage_report: ReportStats | None = None,
    claim_status: StatusStats | None = None,
    devices_gone: Callable[[], int] | None = None,
) -> Callable[[], AgentStatus]:
    """The agent's own state for /metrics (in-memory reads only). ``devices_gone``: how many
    prepared devices the node no longer has (``GoneClaims.count``)."""

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
            usage_report_last_success=None if usage_report is None else usage_report.last_success,
            usage_report_errors=None if usage_report is None else usage_report.errors,
            claim_usage_status_errors=None if claim_status is None else claim_status.errors,
            prepared_devices_gone=0 if devices_gone is None else devices_gone(),
        )

    return status


def claim_unprepared(
    writer: ClaimUsageStatusWriter | None,
) -> Callable[[ClaimEntry], None]:
    """What the preparer calls for each claim it unprepared: queue its usage summary for its
    ResourceClaim's status (kube mode; standalone: nothing). A claim rebuilt from a CDI spec
    whose name is not known yet has no claim to write to."""

    def unprepared(entry: ClaimEntry) -> None:
        if writer is None or not entry.namespace or not entry.name:
            return
        devices = tuple((d.pool, d.device, d.share_id) for d in entry.devices)
        writer.submit(UnpreparedClaim(entry.namespace, entry.name, entry.uid, devices))

    return unprepared


def mps_launcher(
    config: Config,
    source: NodeSource,
    tools: Tools,
    root: Path,
    kube: KubeClient | None,
    log: logging.Logger,
) -> MpsLauncher:
    """Where the claims' MPS control daemons run: standalone, the agent's own processes; in
    kube mode a Pod per claim pinned to this node, which a restart of the agent's container
    does not kill (dra_driver/cluster/mps_pods.py)."""
    # the real daemon gets the claim's shared-memory directory as its /dev/shm (its clients
    # see the same one through the CDI mount); the simulator's stand-in needs none
    private_shm = config.simulator.simulate is None
    if kube is None:
        return LocalLauncher(tools, private_shm=private_shm)
    from dra_driver.cluster.mps_pods import PodLauncher, PodTemplate

    # where the tools the agent runs are on the host: the host's view of the driver root; the
    # simulator's stand-in tools are real files at the simulated driver root itself (its
    # host_root names where a real node's files would be, for the CDI specs)
    on_host = source.driver_root if config.simulator.simulate else source.host_root
    template = PodTemplate(
        namespace=config.sharing.mps_pod_namespace,
        node=source.hostname,
        image=config.sharing.mps_pod_image or "",
        mps_control=str(tools.mps_control),
        driver_root=str(source.driver_root),
        driver_root_on_host=str(on_host),
        root=str(root),
        tool_env=dict(tools.env),
        private_shm=private_shm,
    )
    return PodLauncher(kube, template, log)


def sharing_effects(
    config: Config,
    source: NodeSource,
    state_dir: Path,
    devices: CurrentDevices,
    log: logging.Logger,
    crash: Callable[[str], None],
    mig_changed: Callable[[int], None],
    kube: KubeClient | None = None,
    vm: VmTools | None = None,
) -> Effects:
    """The tools prepare shares devices and makes partitions with: nvidia-smi and
    nvidia-cuda-mps-control from the driver root (the simulator's stand-ins with --simulate),
    MPS daemons under --mps-root (run by :func:`mps_launcher`), and dynamic MIG through NVML
    when --mig-mode is dynamic (``mig_changed``: told the index of each GPU whose MIG devices
    it changed), and ``vm`` to hand GPUs to virtual machines (:mod:`agent.daemon.vm_wiring`;
    None with --virtualization none)."""
    tools_ = config.sharing
    tools = Tools(
        nvidia_smi=find_tool("nvidia-smi", source.driver_root, tools_.nvidia_smi),
        mps_control=find_tool("nvidia-cuda-mps-control", source.driver_root, tools_.mps_control),
        env=tool_env(source.driver_root),
    )
    root = tools_.mps_root or state_dir / "mps"
    mps = MpsControl(
        tools,
        root,
        log.getChild("mps"),
        ready_timeout_s=tools_.mps_ready_timeout,
        launcher=mps_launcher(config, source, tools, root, kube, log.getChild("mps")),
    )
    # claim UIDs are 36 characters: warn now rather than at the first MPS claim
    problem = mps.socket_path_problem("0" * 36)
    if problem is not None:
        log.warning("MPS claims will fail to prepare", extra=fields_(reason=problem))
    mig = (
        DynamicMig(MigControl(source.nvml), log.getChild("mig"), crash, mig_changed)
        if config.driver.mig_mode == "dynamic"
        else None
    )
    return Effects(
        mig=mig,
        settings=GpuSettings(tools),
        mps=mps,
        devices=devices.get,
        log=log,
        crash_hook=crash,
        power=GpuPower(PowerControl(source.nvml), log.getChild("power")),
        vm=vm,
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
