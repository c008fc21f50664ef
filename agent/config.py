"""Settings: one declaration per setting serves flags, ``TESSERA_*`` variables and the docs.

A settings class is a frozen dataclass whose fields are declared with :func:`setting`: flag(s),
help, default (or :data:`REQUIRED`), and how one raw string becomes a value (from the field's type,
``choices`` or ``parse``). The daemon's :class:`Config` below is one; the options of single
commands (``-o/--output``, ``--socket``, ...) are others, declared next to their commands in
``agent/cli/``. From the declarations:

- :func:`add_options` adds a class's options to an argparse parser. argparse only collects raw
  strings (no ``type``, ``choices`` or ``required``): converting and checking is done once, here.
- :func:`load_settings` builds the class from the parsed flags and an environment mapping: a flag
  wins over ``TESSERA_<FLAG>``, which wins over extra variables (``NODE_NAME``), which win over the
  default. A bad value is a :class:`ConfigError` that names where it came from: the variable
  (``TESSERA_OUTPUT='xml' is not one of table, json, yaml``) or the flag (``-o/--output: ...``).
- ``agent.cli.docs`` renders docs/configuration.md.

Nothing below the CLI reads ``os.environ``: the CLI passes the environment in.
"""

from __future__ import annotations

import argparse
import re
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypeVar

from agent.errors import ConfigError
from agent.telemetry.gpu_health import parse_xids
from agent.tls import TlsFiles
from dra_driver.device_model import SHARING_MODES, DevicePolicy
from dra_driver.errors import QuantityError
from dra_driver.kubeletplugin.plan import SharingPolicy
from dra_driver.kubeletplugin.prepare import CRASH_POINTS
from dra_driver.quantity import parse_bytes

ENV_PREFIX = "TESSERA_"
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
REQUIRED: Any = MISSING
"""The default of a setting that must be given (by its flag or its variable)."""
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")

T = TypeVar("T")


@dataclass(frozen=True)
class SettingMeta:
    """How one field is set from the command line and the environment."""

    help: str
    groups: tuple[str, ...]
    """For Config: the option groups carrying it: ``node`` (commands that look at a node),
    ``driver`` (commands that compute what the driver advertises), ``daemon`` (only `run`).
    Command options ignore it: a command exposes all of its own options."""
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    extra_env: tuple[str, ...] = ()
    """Further environment variables honoured after ``TESSERA_<FLAG>`` (e.g. ``NODE_NAME``)."""
    flags: tuple[str, ...] = ()
    """Option strings; unset: ``--<field-name>`` with dashes. The variable is named after the
    last (long) one: ``("-o", "--output")`` -> ``TESSERA_OUTPUT``."""
    parse: Callable[[str], Any] | None = None
    """Turns one raw string into the value; a ValueError's message says what is wrong, as a
    phrase that follows the value (``is not a positive whole number``). Unset: from the type."""
    listen: bool = False
    """The value is an address or port the command listens on (named when it is busy)."""
    positional: bool = False
    """Given as the command's argument (``tessera explain CLAIM.yaml``), not as a flag; its one
    ``flags`` entry is how usage and errors name it (``CLAIM``); the variable is named after it
    (``TESSERA_CLAIM``)."""


def setting(
    default: Any,
    help: str,
    *,
    groups: tuple[str, ...] = ("node",),
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    extra_env: tuple[str, ...] = (),
    flags: tuple[str, ...] = (),
    parse: Callable[[str], Any] | None = None,
    listen: bool = False,
    positional: bool = False,
) -> Any:
    """A settings field: ``name: type = setting(default, help, ...)``. Supported types: ``str``,
    ``int``, ``float`` (seconds > 0 unless ``parse`` says otherwise), ``bool`` (a switch),
    ``Path``, ``X | None``, and ``tuple[X, ...]`` (a repeatable option; comma-separated in a
    variable)."""
    meta = SettingMeta(help, groups, choices, metavar, extra_env, flags, parse, listen, positional)
    return field(default=default, metadata={"tessera": meta})


# -- parsers: one raw string -> value; ValueError("<phrase after the value>") --------------------


def text(raw: str) -> str:
    if not raw:
        raise ValueError("is empty")
    return raw


def path(raw: str) -> Path:
    if not raw:
        raise ValueError("is empty; expected a path")
    return Path(raw)


def boolean(raw: str) -> bool:
    low = raw.strip().lower()
    if low not in TRUE + FALSE:
        raise ValueError("is not a boolean; use one of " + ", ".join(TRUE + FALSE))
    return low in TRUE


def integer(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError("is not a whole number") from None


def non_negative_int(raw: str) -> int:
    value = integer(raw)
    if value < 0:
        raise ValueError("is not a whole number >= 0")
    return value


def positive_int(raw: str) -> int:
    value = integer(raw)
    if value < 1:
        raise ValueError("is not a positive whole number")
    return value


def number(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError("is not a finite number")
    return value


def seconds(raw: str) -> float:
    value = number(raw)
    if not value > 0:
        raise ValueError("is not a number of seconds > 0")
    return value


def non_negative_seconds(raw: str) -> float:
    value = number(raw)
    if value < 0:
        raise ValueError("is not a number of seconds >= 0")
    return value


def fraction(raw: str) -> float:
    value = number(raw)
    if not 0 <= value <= 1:
        raise ValueError("is not a fraction from 0 to 1 (e.g. 0.9)")
    return value


def port(raw: str) -> int:
    value = integer(raw)
    if not 0 <= value <= 65535:
        raise ValueError("is not a TCP port (0-65535)")
    return value


@dataclass(frozen=True)
class CrashAt:
    """Where ``--sim-crash-at`` kills the daemon: the ``occurrence``-th time (1: the first) this
    process reaches ``point`` (the claims of one call run concurrently, so a point is reached once
    per claim of a batch, or once per call where the claims share that step)."""

    point: str
    occurrence: int = 1

    def __str__(self) -> str:
        return self.point if self.occurrence == 1 else f"{self.point}:{self.occurrence}"


OCCURRENCE = re.compile(r"[0-9]{1,9}")


def crash_at(raw: str) -> CrashAt:
    """``POINT`` or ``POINT:N``: a crash point of prepare or unprepare and, optionally, which time
    it is reached (N >= 1)."""
    point, sep, count = raw.partition(":")
    if point not in CRASH_POINTS:
        raise ValueError(
            "does not name a crash point (POINT or POINT:N); POINT is one of "
            + ", ".join(CRASH_POINTS)
        )
    if not sep:
        return CrashAt(point)
    if not OCCURRENCE.fullmatch(count) or int(count) < 1:
        raise ValueError(
            "is not POINT:N with N a whole number >= 1 (the N-th time the point is reached, e.g."
            f" {point}:3)"
        )
    return CrashAt(point, int(count))


def host_port(raw: str) -> str:
    """``HOST:PORT`` (``[::1]:9400`` for IPv6), kept as text."""
    _host, sep, number_ = raw.rpartition(":")
    if not sep or not number_.isdigit() or not 0 <= int(number_) <= 65535:
        raise ValueError("is not HOST:PORT (e.g. 127.0.0.1:9400; port 0-65535)")
    return raw


def memory_quantity(raw: str) -> str:
    """A Kubernetes quantity of bytes > 0 (``1Gi``, ``512Mi``), kept as written."""
    try:
        value = parse_bytes(raw)
    except QuantityError as exc:
        raise ValueError(f"is not a quantity of bytes ({exc}); e.g. 1Gi, 512Mi") from None
    if value <= 0:
        raise ValueError("is not a quantity of bytes > 0 (e.g. 1Gi, 512Mi)")
    return raw


def dns_subdomain(raw: str) -> str:
    if not DNS_SUBDOMAIN.fullmatch(raw) or len(raw) > 63:
        raise ValueError(
            "is not a lower-case DNS subdomain of at most 63 characters (e.g. gpu.example.com)"
        )
    return raw


def pod_uid_text(raw: str) -> str:
    """A pod UID as it goes into socket names: a lower-case DNS label."""
    if not DNS_LABEL.fullmatch(raw) or len(raw) > 63:
        raise ValueError(
            "is not a pod UID: lower-case letters, digits and '-', starting and ending with a"
            " letter or digit, at most 63 characters (e.g. 4f1b2c3d-5e6f-4a7b-8c9d-0e1f2a3b4c5d,"
            " what metadata.uid holds)"
        )
    return raw


@dataclass(frozen=True)
class Config:
    """Everything the agent can be told. Defaults are production defaults."""

    simulate: str | None = setting(
        None,
        "Run on a simulated node instead of NVML: a bundled model name (see `tessera sim models`)"
        " or a model YAML file.",
        metavar="MODEL",
    )
    sim_mig_layout: str | None = setting(
        None,
        "With --simulate: apply this MIG layout to every MIG-capable GPU at start"
        " (none, balanced, all-1g, all-7g). Unset: keep the simulated GPUs' state, or the"
        " model's default layout on a fresh state directory.",
        metavar="LAYOUT",
    )
    sysfs_root: Path | None = setting(
        None,
        "Root of the sysfs tree to read PCI, NUMA and NIC topology from. Unset: /sys, or the"
        " simulator's tree under --state-dir with --simulate.",
        metavar="DIR",
    )
    state_dir: Path | None = setting(
        None,
        "Directory for the agent's state (checkpoint, simulator state, standalone objects)."
        " Unset: /var/lib/tessera for `run`; a temporary directory for one-shot commands"
        " with --simulate.",
        metavar="DIR",
    )
    node_name: str | None = setting(
        None,
        "Kubernetes node name of this node. Unset: NODE_NAME, else the host name (the model's"
        " host name with --simulate).",
        extra_env=("NODE_NAME",),
        metavar="NAME",
    )
    metrics_address: str = setting(
        "127.0.0.1:9400",
        "host:port of the HTTP endpoint serving /healthz, /readyz (and /metrics).",
        groups=("daemon",),
        metavar="HOST:PORT",
        parse=host_port,
        listen=True,
    )
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

    driver_name: str = setting(
        "gpu.tessera.dev",
        "DRA driver name: ResourceSlice spec.driver, the kubelet plugin name, the CDI vendor.",
        groups=("driver",),
        metavar="NAME",
        parse=dns_subdomain,
    )
    mig_mode: str = setting(
        "static",
        "How MIG is advertised: static (existing MIG devices only) or dynamic (the whole GPU and"
        " every profile x placement as partitionable devices; needs the DRAPartitionableDevices"
        " feature gate).",
        groups=("driver",),
        choices=("static", "dynamic"),
    )
    sharing: str = setting(
        "none",
        "How whole GPUs are shared between claims: none (one claim per GPU; a claim can still"
        " time-slice or run MPS on its own GPU through its opaque config), time-slicing (claims"
        " whose configs time-slice at the same interval share a GPU) or memory-shares (claims"
        " share a GPU by memory: each gets the memory it requested, enforced by its own MPS"
        " daemon). Sharing needs the DRAConsumableCapacity feature gate.",
        groups=("driver",),
        choices=SHARING_MODES,
    )
    memory_share_min: str = setting(
        "1Gi",
        "With --sharing memory-shares: the smallest memory share, and a claim's share when it"
        " asks for none (a Kubernetes quantity).",
        groups=("driver",),
        metavar="QUANTITY",
        parse=memory_quantity,
    )
    memory_share_step: str = setting(
        "1Gi",
        "With --sharing memory-shares: shares are the minimum plus a multiple of this (the"
        " scheduler rounds requests up).",
        groups=("driver",),
        metavar="QUANTITY",
        parse=memory_quantity,
    )
    kube_layout: str = setting(
        "1.35",
        "ResourceSlice layout: 1.35 (counters in their own slice) or 1.34 (counters and the"
        " devices consuming them in one slice).",
        groups=("driver",),
        choices=("1.35", "1.34"),
    )
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
    cleanup_on_exit: bool = setting(
        False,
        "Delete this node's ResourceSlices when the agent exits cleanly.",
        groups=("daemon",),
    )
    resync_interval: float = setting(
        600.0,
        "Seconds between full re-reads of the published ResourceSlices (drift is also repaired"
        " at once through a watch); nothing is written when nothing changed.",
        groups=("daemon",),
        metavar="SECONDS",
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
    cdi_root: Path | None = setting(
        None,
        "Directory for the CDI specs written at prepare. Unset: /var/run/cdi, or"
        " <state-dir>/cdi with --simulate.",
        groups=("daemon",),
        metavar="DIR",
    )
    driver_root: Path | None = setting(
        None,
        "Where the NVIDIA driver's files are visible to the agent: the driver's libraries"
        " (libnvidia-ml.so.1 is loaded from here), binaries, firmware and /proc/driver/nvidia,"
        " found as under / of that root. In the DaemonSet the host's / (or the GPU operator's"
        " containerized driver root, /run/nvidia/driver) mounted at a fixed path. Unset: /, or"
        " the simulator's driver root under --state-dir with --simulate.",
        metavar="DIR",
    )
    host_driver_root: Path | None = setting(
        None,
        "Where the same driver files are on the host: every path a CDI spec names is under it,"
        " since the container runtime reads them on the host (/ for a driver installed on the"
        " host, /run/nvidia/driver for the GPU operator's containerized driver). Unset: the"
        " same as --driver-root; with --simulate, the simulated layout's (/ or"
        " /run/nvidia/driver).",
        metavar="DIR",
    )
    sim_driver_layout: str | None = setting(
        None,
        "With --simulate: the layout of the simulated driver root: ubuntu (a host driver in"
        " /usr/lib/x86_64-linux-gnu), rhel (a host driver in /usr/lib64) or container (the GPU"
        " operator's containerized driver, seen by the host at /run/nvidia/driver). Unset:"
        " ubuntu.",
        choices=("ubuntu", "rhel", "container"),
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
    proc_root: Path | None = setting(
        None,
        "The proc tree to find which pod runs each GPU process in (<dir>/<pid>/cgroup), to split"
        " a shared GPU between its claims. NVML reports the host's PIDs: outside the host's PID"
        " namespace (a pod without hostPID) mount the host's /proc and point this at it."
        " Unset: /proc, or the simulator's tree under --state-dir with --simulate.",
        groups=("daemon",),
        metavar="DIR",
    )
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
    telemetry_interval: float = setting(
        1.0,
        "Seconds between telemetry samples (NVML reads); metrics and the telemetry API serve the"
        " latest sample.",
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
    application_xids: frozenset[int] | None = setting(
        None,
        "XIDs that are the workload's fault, not the GPU's, in addition to the built-in 13, 31,"
        " 43, 45, 68, 109: counted and logged, the GPU stays healthy. Comma-separated; fatal"
        " XIDs (48, 63, 64, 74, 79, 92, 94, 95) are refused.",
        groups=("daemon",),
        metavar="XID,...",
        parse=parse_xids,
    )
    telemetry_address: str | None = setting(
        None,
        "Also serve the telemetry gRPC API on this TCP host:port (it is always served on"
        " <state-dir>/telemetry.sock).",
        groups=("daemon",),
        metavar="HOST:PORT",
        parse=host_port,
        listen=True,
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
    claim_read_timeout: float = setting(
        15.0,
        "Seconds one read of a ResourceClaim from the API server may take (it runs inside the"
        " kubelet's 45 s call, so a claim that cannot be read fails with its own error in"
        " time; the kubelet retries it).",
        groups=("daemon",),
        metavar="SECONDS",
    )
    sim_crash_at: CrashAt | None = setting(
        None,
        "Fault injection, --simulate only: the daemon kills itself (SIGKILL) when a prepare or"
        " unprepare reaches POINT, one of " + ", ".join(CRASH_POINTS) + "; with POINT:N, the"
        " N-th time this process reaches it (N >= 1; a crash inside a batch of claims, e.g."
        " after-cdi:3 after the third claim's CDI spec). For crash-safety tests.",
        groups=("daemon",),
        metavar="POINT[:N]",
        parse=crash_at,
    )
    http_max_connections: int = setting(
        64,
        "Connections the HTTP endpoint keeps open at once. At the limit the oldest connection"
        " that has not finished sending its request is closed to make room; when every open"
        " connection is being answered, a new one is closed at once.",
        groups=("daemon",),
        metavar="N",
        parse=positive_int,
    )
    http_threads: int = setting(
        4,
        "Threads answering HTTP requests. A connection takes no thread while it sends its"
        " request (one selector thread reads them all), so slow clients cannot use these up.",
        groups=("daemon",),
        metavar="N",
        parse=positive_int,
    )
    http_header_timeout: float = setting(
        10.0,
        "Seconds an HTTP client has, from connecting, to send the head of its request (the TLS"
        " handshake included); a slower one gets 408 and is closed.",
        groups=("daemon",),
        metavar="SECONDS",
    )
    http_body_timeout: float = setting(
        10.0,
        "Seconds an HTTP client has, after the head, to send the body of its request.",
        groups=("daemon",),
        metavar="SECONDS",
    )
    http_response_timeout: float = setting(
        10.0,
        "Seconds an HTTP client has to take the whole response; then the connection is closed.",
        groups=("daemon",),
        metavar="SECONDS",
    )
    fd_reserve: int = setting(
        64,
        "File descriptors kept free below the soft open-file limit (which the agent raises to"
        " the hard limit at start): the HTTP endpoint takes no connection that would use them,"
        " so the kubelet's sockets and the telemetry API can always accept.",
        groups=("daemon",),
        metavar="N",
        parse=non_negative_int,
    )
    metrics_tls_cert: Path | None = setting(
        None,
        "Serve the HTTP endpoint over TLS with this PEM certificate (chain); needs"
        " --metrics-tls-key. Unset: plain HTTP.",
        groups=("daemon",),
        metavar="FILE",
    )
    metrics_tls_key: Path | None = setting(
        None,
        "The PEM private key (unencrypted) of --metrics-tls-cert.",
        groups=("daemon",),
        metavar="FILE",
    )
    metrics_tls_client_ca: Path | None = setting(
        None,
        "With --metrics-tls-cert: serve only clients presenting a certificate signed by a CA in"
        " this PEM bundle (mutual TLS); others are refused at the handshake. The kubelet's"
        " httpGet probes present none: probe with tcpSocket then.",
        groups=("daemon",),
        metavar="FILE",
    )
    telemetry_max_watchers: int = setting(
        32,
        "Watch streams served at once on each telemetry listener (the unix socket and"
        " --telemetry-address count apart); more are refused with RESOURCE_EXHAUSTED."
        " Snapshot calls have threads of their own beyond these.",
        groups=("daemon",),
        metavar="N",
        parse=positive_int,
    )
    telemetry_streams_per_connection: int = setting(
        8,
        "Streams (watchers and calls together) one client connection may have open at once on"
        " the telemetry API (HTTP/2 MAX_CONCURRENT_STREAMS); further calls wait on the client.",
        groups=("daemon",),
        metavar="N",
        parse=positive_int,
    )
    telemetry_send_timeout: float = setting(
        10.0,
        "Seconds a telemetry watcher may take to receive one sample; a slower one is dropped"
        " (CANCELLED), freeing its place for others.",
        groups=("daemon",),
        metavar="SECONDS",
    )
    telemetry_tls_cert: Path | None = setting(
        None,
        "Serve --telemetry-address over TLS with this PEM certificate (chain); needs"
        " --telemetry-tls-key. The unix socket stays plain (0600, owner only).",
        groups=("daemon",),
        metavar="FILE",
    )
    telemetry_tls_key: Path | None = setting(
        None,
        "The PEM private key (unencrypted) of --telemetry-tls-cert.",
        groups=("daemon",),
        metavar="FILE",
    )
    telemetry_tls_client_ca: Path | None = setting(
        None,
        "With --telemetry-tls-cert: serve only clients presenting a certificate signed by a CA"
        " in this PEM bundle (mutual TLS); others are refused at the handshake.",
        groups=("daemon",),
        metavar="FILE",
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

    def __post_init__(self) -> None:
        self._check_rolling_update()
        if self.sim_crash_at is not None and self.simulate is None:
            raise ConfigError("--sim-crash-at: fault injection is only allowed with --simulate")
        if self.sim_driver_layout is not None and self.simulate is None:
            raise ConfigError(
                f"--sim-driver-layout {self.sim_driver_layout}: only with --simulate (a real"
                " node's layout is what its driver root holds)"
            )
        for name, p in (
            ("--host-driver-root", self.host_driver_root),
            ("--cdi-hook-path", self.cdi_hook_path),
        ):
            if p is not None and not p.is_absolute():
                raise ConfigError(f"{name} {str(p)!r} is not absolute: it names a host path")
        try:
            dns_subdomain(self.driver_name)
        except ValueError as exc:
            raise ConfigError(f"--driver-name: {self.driver_name!r} {exc}") from None
        for name in ("metrics", "telemetry"):
            cert, key, ca = (getattr(self, f"{name}_tls_{f}") for f in ("cert", "key", "client_ca"))
            if (cert is None) != (key is None):
                raise ConfigError(
                    f"--{name}-tls-cert and --{name}-tls-key go together: give both for TLS,"
                    " or neither"
                )
            if ca is not None and cert is None:
                raise ConfigError(
                    f"--{name}-tls-client-ca needs --{name}-tls-cert and --{name}-tls-key"
                    " (client certificates are only checked over TLS)"
                )
        if self.telemetry_tls_cert is not None and self.telemetry_address is None:
            raise ConfigError(
                "--telemetry-tls-cert applies to the TCP listener, and --telemetry-address is"
                " not set (the unix socket is never TLS)"
            )

    def _check_rolling_update(self) -> None:
        if self.rolling_update and self.pod_uid is None:
            raise ConfigError(
                "--rolling-update needs this pod's UID: set --pod-uid or TESSERA_POD_UID (the"
                " DaemonSet sets it from the downward API, fieldRef metadata.uid)"
            )
        if self.pod_uid is not None:
            try:
                pod_uid_text(self.pod_uid)
            except ValueError as exc:
                raise ConfigError(f"--pod-uid: {self.pod_uid!r} {exc}") from None
        if self.rolling_update and self.cleanup_on_exit:
            raise ConfigError(
                "--cleanup-on-exit and --rolling-update go against each other: the agent that"
                " takes over publishes the same ResourceSlices the exiting one would delete"
            )

    def device_policy(self) -> DevicePolicy:
        """What the node advertises, from the driver settings."""
        return DevicePolicy(
            driver_name=self.driver_name,
            mig_mode=self.mig_mode,
            sharing=self.sharing,
            memory_share_min=parse_bytes(self.memory_share_min),
            memory_share_step=parse_bytes(self.memory_share_step),
        )

    def sharing_policy(self) -> SharingPolicy:
        """How prepare lets claims share devices, from the driver settings."""
        return SharingPolicy(
            mode=self.sharing,
            dynamic_mig=self.mig_mode == "dynamic",
            memory_share_min=parse_bytes(self.memory_share_min),
        )

    def metrics_host_port(self) -> tuple[str, int]:
        return parse_host_port("metrics-address", self.metrics_address)

    def metrics_tls(self) -> TlsFiles | None:
        """The HTTP endpoint's TLS files; None: plain HTTP."""
        if self.metrics_tls_cert is None:
            return None
        return TlsFiles(
            self.metrics_tls_cert,
            self.metrics_tls_key,
            self.metrics_tls_client_ca,
            option="--metrics-tls",
        )

    def telemetry_tls(self) -> TlsFiles | None:
        """The telemetry TCP listener's TLS files; None: plain gRPC."""
        if self.telemetry_tls_cert is None:
            return None
        return TlsFiles(
            self.telemetry_tls_cert,
            self.telemetry_tls_key,
            self.telemetry_tls_client_ca,
            option="--telemetry-tls",
        )


def parse_host_port(name: str, value: str) -> tuple[str, int]:
    try:
        host_port(value)
    except ValueError as exc:
        raise ConfigError(f"--{name}: {value!r} {exc}") from None
    host, _, number_ = value.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(number_)


# -- the mechanism -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One declared setting, resolved: its flags, variables and converter."""

    name: str
    meta: SettingMeta
    default: Any
    """None when unset; :data:`REQUIRED` when it must be given."""
    kind: Literal["switch", "value", "list"]
    convert: Callable[[str], Any]
    """One raw string (one item of a list) -> value; ValueError("<phrase>")."""

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    @property
    def flags(self) -> tuple[str, ...]:
        return self.meta.flags or (flag_name(self.name),)

    @property
    def label(self) -> str:
        """``-o/--output``: how errors and docs name the option."""
        return "/".join(self.flags)

    @property
    def env(self) -> tuple[str, ...]:
        """``TESSERA_<FLAG>`` then the extra variables, in the order they are honoured."""
        own = ENV_PREFIX + self.flags[-1].lstrip("-").replace("-", "_").upper()
        return (own, *self.meta.extra_env)

    @property
    def metavar(self) -> str:
        if self.meta.choices:
            return "{" + ",".join(self.meta.choices) + "}"
        return self.meta.metavar or self.flags[-1].lstrip("-").replace("-", "_").upper()

    def in_groups(self, groups: Collection[str] | None) -> bool:
        return groups is None or bool(set(self.meta.groups) & set(groups))


@dataclass(frozen=True)
class Origin:
    """Where a setting's value came from: ``label`` is the flag (``--state-dir``) or the
    variable (``TESSERA_STATE_DIR``) that gave it."""

    setting: Setting
    label: str
    value: Any


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _base_converter(kind: Any) -> Callable[[str], Any]:
    by_type: dict[Any, Callable[[str], Any]] = {
        str: text,
        int: integer,
        float: seconds,  # every float setting so far is a duration; others pass parse=
        bool: boolean,
        Path: path,
    }
    if kind not in by_type:
        raise TypeError(f"unsupported setting type {kind!r}")
    return by_type[kind]


def settings_of(cls: type[Any]) -> tuple[Setting, ...]:
    """Every setting of a settings dataclass, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        meta: SettingMeta = f.metadata["tessera"]
        kind_: Literal["switch", "value", "list"] = "value"
        hint = hints[f.name]
        if isinstance(hint, types.UnionType):  # X | None
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        if typing.get_origin(hint) is tuple:
            kind_, hint = "list", typing.get_args(hint)[0]
        elif hint is bool:
            kind_ = "switch"
        convert = meta.parse or _base_converter(hint)
        if meta.choices is not None:
            convert = _choice(meta.choices, convert)
        out.append(Setting(f.name, meta, f.default, kind_, convert))
    return tuple(out)


def _choice(choices: tuple[str, ...], then: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(raw: str) -> Any:
        if raw not in choices:
            raise ValueError("is not one of " + ", ".join(choices))
        return then(raw)

    return convert


def dest(cls: type[Any], name: str) -> str:
    """The argparse destination of a setting: unique per class, so classes never collide."""
    return f"{cls.__qualname__}.{name}"


def option_help(s: Setting) -> str:
    parts = [s.meta.help.rstrip()]
    if s.required:
        parts.append("Required.")
    elif s.default is not None and s.kind != "switch":
        parts.append(f"Default: {s.default}.")
    env = ", ".join(s.env)
    parts.append(f"Env: {env}=true." if s.kind == "switch" else f"Env: {env}.")
    return " ".join(parts).replace("%", "%%")


def add_options(
    parser: argparse.ArgumentParser, cls: type[Any], groups: Collection[str] | None = None
) -> None:
    """Add the options of ``cls`` (of the given groups; None: all) to an argparse parser. argparse
    only collects raw strings; :func:`load_settings` converts and checks them."""
    for s in settings_of(cls):
        if not s.in_groups(groups):
            continue
        if s.meta.positional:
            parser.add_argument(
                dest(cls, s.name), nargs="?", default=None, metavar=s.flags[0],
                help=option_help(s),
            )  # fmt: skip
            continue
        if s.kind == "switch":
            parser.add_argument(
                *s.flags, dest=dest(cls, s.name), default=None, action="store_true",
                help=option_help(s),
            )  # fmt: skip
            continue
        parser.add_argument(
            *s.flags,
            dest=dest(cls, s.name),
            default=None,
            action="append" if s.kind == "list" else "store",
            metavar=s.metavar,
            help=option_help(s),
        )


def _convert(s: Setting, raw: Any, label: str, from_env: bool) -> Any:
    where = f"{label}=" if from_env else f"{label}: "
    if s.kind == "switch" and not from_env:
        return bool(raw)
    items: list[str]
    if s.kind == "list":
        items = [i.strip() for i in raw.split(",")] if from_env else list(raw)
    else:
        items = [raw]
    values = []
    for item in items:
        item = item if isinstance(item, str) else str(item)
        try:
            values.append(s.convert(item))
        except ValueError as exc:
            raise ConfigError(f"{where}{item!r} {exc}") from None
    return tuple(values) if s.kind == "list" else values[0]


def resolve_settings(
    cls: type[T],
    args: argparse.Namespace | Mapping[str, Any] | None,
    environ: Mapping[str, str] | None,
    groups: Collection[str] | None = None,
) -> tuple[T, tuple[Origin, ...]]:
    """:func:`load_settings`, and where each given value came from."""
    if isinstance(args, argparse.Namespace):
        given = {s.name: getattr(args, dest(cls, s.name), None) for s in settings_of(cls)}
    else:
        given = dict(args or {})
    env = environ or {}
    values: dict[str, Any] = {}
    origins: list[Origin] = []
    for s in settings_of(cls):
        if not s.in_groups(groups):
            continue
        raw = given.get(s.name)
        label, from_env = s.label, False
        if raw is None or raw == []:
            raw = None
            for var in s.env:
                if env.get(var):
                    raw, label, from_env = env[var], var, True
                    break
        if raw is None:
            if s.required:
                give = s.flags[0] if s.meta.positional else f"{s.flags[-1]} {s.metavar}"
                raise ConfigError(f"{s.label} is required: give {give} or set {s.env[0]}")
            continue
        values[s.name] = _convert(s, raw, label, from_env)
        origins.append(Origin(s, label, values[s.name]))
    return cls(**values), tuple(origins)


def load_settings(
    cls: type[T],
    args: argparse.Namespace | Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    groups: Collection[str] | None = None,
) -> T:
    """Build a settings class from parsed flags (an argparse Namespace filled by
    :func:`add_options`, or a mapping by field name) and an environment mapping; settings
    outside ``groups`` keep their defaults. Pure: reads only what it is given."""
    return resolve_settings(cls, args, environ, groups)[0]


def load_config(
    args: argparse.Namespace | Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    groups: Collection[str] | None = None,
) -> Config:
    """The agent's Config (see :func:`load_settings`)."""
    return load_settings(Config, args, environ, groups)


def settings() -> list[tuple[str, SettingMeta, Any]]:
    """Every Config setting as ``(field name, meta, default)``, in declaration order."""
    return [(s.name, s.meta, s.default) for s in settings_of(Config)]
