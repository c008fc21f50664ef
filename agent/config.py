"""Settings: flags and ``TESSERA_*`` environment variables -> one frozen ``Config``.

Every setting is declared once here, with its flag, environment variable, default and help; the
CLI's argparse options and docs/configuration.md are derived from these declarations. Nothing
below the CLI reads ``os.environ``: the CLI passes the environment in.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from agent.errors import ConfigError

ENV_PREFIX = "TESSERA_"
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@dataclass(frozen=True)
class SettingMeta:
    """How one Config field is set from the command line and the environment."""

    help: str
    groups: tuple[str, ...]
    """Option groups carrying it: ``node`` (commands that look at a node), ``driver`` (commands
    that compute what the driver advertises), ``daemon`` (only `run`)."""
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    extra_env: tuple[str, ...] = ()
    """Further environment variables honoured after ``TESSERA_<NAME>`` (e.g. ``NODE_NAME``)."""


def setting(
    default: Any,
    help: str,
    *,
    groups: tuple[str, ...] = ("node",),
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    extra_env: tuple[str, ...] = (),
) -> Any:
    meta = SettingMeta(help, groups, choices, metavar, extra_env)
    return field(default=default, metadata={"tessera": meta})


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
    )
    mig_mode: str = setting(
        "static",
        "How MIG is advertised: static (existing MIG devices only) or dynamic (the whole GPU and"
        " every profile x placement as partitionable devices; needs the DRAPartitionableDevices"
        " feature gate).",
        groups=("driver",),
        choices=("static", "dynamic"),
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
        "Root of the NVIDIA driver installation (libraries, /proc/driver/nvidia). Unset: /, or"
        " the simulator's driver root under --state-dir with --simulate.",
        groups=("daemon",),
        metavar="DIR",
    )
    telemetry_interval: float = setting(
        1.0,
        "Seconds between telemetry samples (NVML reads); metrics and the telemetry API serve the"
        " latest sample.",
        groups=("daemon",),
        metavar="SECONDS",
    )
    telemetry_address: str | None = setting(
        None,
        "Also serve the telemetry gRPC API on this TCP host:port (it is always served on"
        " <state-dir>/telemetry.sock).",
        groups=("daemon",),
        metavar="HOST:PORT",
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
    sim_crash_at: str | None = setting(
        None,
        "Fault injection, --simulate only: the daemon kills itself (SIGKILL) when a prepare or"
        " unprepare reaches this point; for crash-safety tests.",
        groups=("daemon",),
        choices=("after-started", "after-cdi", "after-completed", "after-unprepare-commit"),
    )

    def __post_init__(self) -> None:
        if self.sim_crash_at is not None and self.simulate is None:
            raise ConfigError("--sim-crash-at: fault injection is only allowed with --simulate")
        if not DNS_SUBDOMAIN.fullmatch(self.driver_name) or len(self.driver_name) > 63:
            raise ConfigError(
                f"--driver-name: {self.driver_name!r} must be a lower-case DNS subdomain of at"
                " most 63 characters, e.g. gpu.example.com"
            )

    def metrics_host_port(self) -> tuple[str, int]:
        return parse_host_port("metrics-address", self.metrics_address)


def parse_host_port(name: str, value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(
            f"--{name}: {value!r} is not HOST:PORT (e.g. 127.0.0.1:9400; port 0-65535)"
        )
    return host.strip("[]") or "0.0.0.0", int(port)


def _meta(f: Any) -> SettingMeta:
    meta: SettingMeta = f.metadata["tessera"]
    return meta


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def settings() -> list[tuple[str, SettingMeta, Any]]:
    """Every setting as ``(field name, meta, default)``, in declaration order."""
    out = []
    for f in fields(Config):
        default = None if f.default is MISSING else f.default
        out.append((f.name, _meta(f), default))
    return out


def add_settings(parser: argparse.ArgumentParser, groups: tuple[str, ...]) -> None:
    """Add the options of the given groups to an argparse parser (defaults stay unset)."""
    for name, meta, default in settings():
        if not set(meta.groups) & set(groups):
            continue
        envs = ", ".join((env_name(name), *meta.extra_env))
        shown = "" if default is None else f" Default: {default}."
        if isinstance(default, bool):
            parser.add_argument(
                flag_name(name),
                dest=name,
                default=None,
                action="store_true",
                help=f"{meta.help} Env: {envs}=true.",
            )
            continue
        parser.add_argument(
            flag_name(name),
            dest=name,
            default=None,
            choices=meta.choices,
            metavar=meta.metavar,
            help=f"{meta.help}{shown} Env: {envs}.",
        )


TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def _bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low not in TRUE + FALSE:
        raise ValueError("expected one of " + ", ".join(TRUE + FALSE))
    return low in TRUE


def _seconds(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError("expected a number of seconds > 0")
    return value


def _convert(name: str, raw: str, meta: SettingMeta, default: Any, annotation: Any) -> Any:
    if meta.choices is not None and raw not in meta.choices:
        raise ConfigError(
            f"{flag_name(name)}: {raw!r} is not allowed; choose one of: {', '.join(meta.choices)}"
        )
    if raw == "":
        raise ConfigError(f"{flag_name(name)}: empty value is not allowed")
    convert: Callable[[str], Any] = str
    if isinstance(default, bool):
        convert = _bool
    elif isinstance(default, float):
        convert = _seconds
    elif "Path" in str(annotation):
        convert = Path
    try:
        return convert(raw)
    except ValueError as exc:
        raise ConfigError(f"{flag_name(name)}: {raw!r} is not valid: {exc}") from exc


def load_config(
    args: argparse.Namespace | Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Build the Config: a flag wins over ``TESSERA_<NAME>``, which wins over extra variables
    (e.g. ``NODE_NAME``), which win over the default. Pure: reads only what it is given."""
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    env = environ or {}
    values: dict[str, Any] = {}
    for f in fields(Config):
        meta = _meta(f)
        raw = given.get(f.name)
        if raw is None:
            for var in (env_name(f.name), *meta.extra_env):
                if env.get(var):
                    raw = env[var]
                    break
        if raw is not None:
            default = None if f.default is MISSING else f.default
            values[f.name] = _convert(f.name, str(raw), meta, default, f.type)
    return Config(**values)


def render_config_docs() -> str:
    """docs/configuration.md, generated from the declarations above (`make docs`)."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `make docs` from agent/config.py; a test fails when it is stale. -->",
        "",
        "Every setting is a flag and an environment variable; a flag wins over the variable,",
        "which wins over the default. Empty variables count as unset. The options of single",
        "commands (`-o/--output`, `--format`, `--socket`, `--claim`, `--endpoint`, …) follow the",
        "same rule: `TESSERA_<OPTION>` in upper case (`TESSERA_OUTPUT=json`, `TESSERA_SOCKET=...`;",
        "lists comma-separated).",
        "",
        "| flag | environment | default | commands | meaning |",
        "|---|---|---|---|---|",
    ]
    commands = {"node": "run, discover, topo, slices", "daemon": "run", "driver": "run, slices"}
    for name, meta, default in settings():
        envs = "<br>".join(f"`{e}`" for e in (env_name(name), *meta.extra_env))
        shown = "(unset)" if default is None else f"`{default}`"
        if meta.choices:
            shown += "<br>one of " + ", ".join(f"`{c}`" for c in meta.choices)
        cmds = ", ".join(commands[g] for g in meta.groups)
        lines.append(f"| `{flag_name(name)}` | {envs} | {shown} | {cmds} | {meta.help} |")
    lines.append("")
    return "\n".join(lines)
