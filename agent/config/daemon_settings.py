"""The settings groups only the daemon (``tessera run``) reads: its lifecycle, the API server,
publishing, the kubelet, CDI and the sharing tools."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.config.converters import (
    malloc_arenas,
    non_negative_seconds,
    pod_uid_text,
    positive_int,
    seconds,
)
from agent.config.declare import setting


@dataclass(frozen=True)
class DaemonSettings:
    """The daemon's own lifecycle: logs, shutdown, rolling update, rediscovery."""

    log_format: str = setting(
        "json",
        "Log line format: json (one object per line) or text.",
        groups=("daemon",),
        choices=("json", "text"),
    )
    log_level: str = setting(
        "info",
        "Lowest log level written.",
        groups=("daemon",),
        choices=("debug", "info", "warning", "error"),
    )
    shutdown_timeout: float = setting(
        20.0,
        "Seconds the whole shutdown may take after SIGTERM: claims being prepared get this long"
        " to finish (those still running are rolled back and redone by the next start), then"
        " every loop stops. Keep it below the pod's terminationGracePeriodSeconds (30 in the"
        " DaemonSet).",
        groups=("daemon",),
        metavar="SECONDS",
    )
    rolling_update: bool = setting(
        False,
        "Rolling upgrade without a gap (the DaemonSet's maxSurge: 1, maxUnavailable: 0; kubelet"
        " 1.33 or newer): the kubelet sockets carry the pod's UID (<driver>-<uid>-reg.sock,"
        " dra-<uid>.sock), so a new agent registers while the old one still serves; it waits"
        " for the old one to hand the state directory over (its kubelet calls wait meanwhile)."
        " Needs --pod-uid. Unset: the classic socket names, and a second agent on the state"
        " directory exits at once.",
        groups=("daemon",),
    )
    pod_uid: str | None = setting(
        None,
        "With --rolling-update: this agent's pod UID, which names its kubelet sockets and is"
        " written into the state directory's lock (the DaemonSet sets it from the downward API,"
        " fieldRef metadata.uid).",
        groups=("daemon",),
        metavar="UID",
        parse=pod_uid_text,
    )
    rediscovery_interval: float = setting(
        60.0,
        "Seconds between periodic re-reads of the node's GPUs (NVML and sysfs), which also catch"
        " MIG changes an administrator made with nvidia-smi; udev events trigger a re-read at"
        " once besides. 0 turns the periodic re-read off.",
        groups=("daemon",),
        metavar="SECONDS",
        parse=non_negative_seconds,
    )
    rediscovery_debounce: float = setting(
        2.0,
        "Seconds without a further udev event before a burst of PCI events is re-read (once;"
        " at the latest five times this after the burst began).",
        groups=("daemon",),
        metavar="SECONDS",
        parse=seconds,
    )
    malloc_arenas: int = setting(
        2,
        "glibc malloc arenas the daemon's threads share (mallopt M_ARENA_MAX, set before any"
        " thread starts). glibc's own limit is 8 per core, and with the daemon's ~80 threads"
        " each arena keeps the free memory of its own busiest moment: the RSS creeps up under"
        " claim churn (docs/performance.md). 0 leaves glibc's limit (or MALLOC_ARENA_MAX's)."
        " Without glibc (musl) nothing is done.",
        groups=("daemon",),
        metavar="N",
        parse=malloc_arenas,
    )


@dataclass(frozen=True)
class ClusterSettings:
    """The API server: standalone mode, the kubeconfig, how long a claim read may take."""

    no_kube: bool = setting(
        False,
        "Standalone mode: no API server; ResourceSlices are written as YAML files under"
        " <state-dir>/resourceslices/.",
        groups=("daemon",),
    )
    kubeconfig: Path | None = setting(
        None,
        "kubeconfig file for the API server. Unset: the in-cluster service account.",
        groups=("daemon",),
        metavar="FILE",
    )
    claim_read_timeout: float = setting(
        15.0,
        "Seconds one read of a ResourceClaim from the API server may take (it runs inside the"
        " kubelet's 45 s call, so a claim that cannot be read fails with its own error in"
        " time; the kubelet retries it).",
        groups=("daemon",),
        metavar="SECONDS",
    )
    usage_report_interval: float = setting(
        60.0,
        "Seconds between writes of the node's GpuUsageReport (kube mode): the usage ledger's"
        " 15-minute buckets not yet acknowledged by the budget controller, in one write per"
        " node whatever the number of claims (docs/budgets.md).",
        groups=("daemon",),
        metavar="SECONDS",
        parse=seconds,
    )


@dataclass(frozen=True)
class PublishingSettings:
    """How the ResourceSlices are kept: re-reads, taints, clean-up on exit."""

    resync_interval: float = setting(
        600.0,
        "Seconds between full re-reads of the published ResourceSlices (drift is also repaired"
        " at once through a watch); nothing is written when nothing changed.",
        groups=("daemon",),
        metavar="SECONDS",
    )
    device_taints: bool = setting(
        False,
        "Taint the devices of an unhealthy GPU in the ResourceSlices (key <driver>/unhealthy,"
        " effect NoSchedule, the cause as value, e.g. xid-79) instead of withdrawing them. Needs"
        " the DRADeviceTaints feature gate (alpha in Kubernetes 1.33-1.35) on the API server"
        " and the scheduler.",
        groups=("daemon",),
    )
    cleanup_on_exit: bool = setting(
        False,
        "Delete this node's ResourceSlices when the agent exits cleanly.",
        groups=("daemon",),
    )


@dataclass(frozen=True)
class KubeletSettings:
    """The kubelet's plugin directories and the health streams served to it."""

    kubelet_registry_dir: Path | None = setting(
        None,
        "Kubelet plugin registry directory (the registration socket <driver>-reg.sock goes here)."
        " Unset: /var/lib/kubelet/plugins_registry, or <state-dir>/kubelet/plugins_registry"
        " with --simulate.",
        groups=("daemon",),
        metavar="DIR",
    )
    kubelet_plugins_dir: Path | None = setting(
        None,
        "Kubelet plugins directory (the DRA socket is <dir>/<driver>/dra.sock). Unset:"
        " /var/lib/kubelet/plugins, or <state-dir>/kubelet/plugins with --simulate.",
        groups=("daemon",),
        metavar="DIR",
    )
    kubelet_health_streams: int = setting(
        4,
        "Health-watch streams (DRAResourceHealth) served at once on the DRA socket; the kubelet"
        " opens one. More are refused with RESOURCE_EXHAUSTED, and these have threads of their"
        " own, so they never take the ones NodePrepareResources/NodeUnprepareResources need.",
        groups=("daemon",),
        metavar="N",
        parse=positive_int,
    )


@dataclass(frozen=True)
class CdiSettings:
    """Where CDI specs go and the toolkit hook they run."""

    cdi_root: Path | None = setting(
        None,
        "Directory for the CDI specs written at prepare. Unset: /var/run/cdi, or"
        " <state-dir>/cdi with --simulate.",
        groups=("daemon",),
        metavar="DIR",
    )
    cdi_hook_path: Path | None = setting(
        None,
        "The host path of NVIDIA Container Toolkit's nvidia-cdi-hook (or nvidia-ctk): CDI specs"
        " then run its create-symlinks and update-ldcache hooks, as the toolkit's own specs do."
        " Unset: nvidia-cdi-hook, else nvidia-ctk, in usr/bin, usr/local/bin or"
        " usr/local/nvidia/toolkit under --driver-root (or on PATH when the agent sees the"
        " host's paths as they are); none found: specs that need no hook (every library name"
        " mounted, also under /usr/local/nvidia/lib64).",
        groups=("daemon",),
        metavar="FILE",
    )


@dataclass(frozen=True)
class SharingSettings:
    """The tools prepare shares GPUs with: nvidia-smi and MPS."""

    nvidia_smi: Path | None = setting(
        None,
        "The nvidia-smi to set compute modes and time-slices with. Unset: the first of"
        " usr/bin, usr/sbin, bin under --driver-root.",
        groups=("daemon",),
        metavar="FILE",
    )
    mps_control: Path | None = setting(
        None,
        "The nvidia-cuda-mps-control to start MPS daemons with. Unset: found like --nvidia-smi.",
        groups=("daemon",),
        metavar="FILE",
    )
    mps_root: Path | None = setting(
        None,
        "Directory of the claims' MPS daemons (pipe, log and shared-memory directories). The"
        " CDI specs mount them into containers by this path, so it must be the same path on"
        " the host. Unset: <state-dir>/mps.",
        groups=("daemon",),
        metavar="DIR",
    )
    mps_ready_timeout: float = setting(
        10.0,
        "Seconds a claim's MPS daemon gets to start and answer; a prepare whose daemon does"
        " not answer in time fails (and is undone).",
        groups=("daemon",),
        metavar="SECONDS",
    )
    mps_pod_namespace: str = setting(
        "tessera-system",
        "Kube mode: the namespace of the Pods that run the claims' MPS control daemons (one"
        " per claim, pinned to this node, so they outlive the agent's container); the agent's"
        " own namespace, where its Role lets it create them.",
        groups=("daemon",),
        metavar="NAMESPACE",
    )
    mps_pod_image: str | None = setting(
        None,
        "Kube mode: the image of those Pods (the agent's own: the daemon itself is the"
        " driver's nvidia-cuda-mps-control, mounted from the host). Unset: MPS claims fail to"
        " prepare in kube mode, naming this setting.",
        groups=("daemon",),
        metavar="IMAGE",
    )
