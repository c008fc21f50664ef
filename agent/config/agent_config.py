"""The agent's :class:`Config`: everything the agent can be told, in groups, each a frozen
settings dataclass that the component it configures receives (the HTTP endpoint its
:class:`HttpSettings`, telemetry its :class:`TelemetrySettings`, ...), never the whole Config.
Flags and ``TESSERA_*`` variables are named after the settings, not the groups
(``--metrics-address``, ``TESSERA_METRICS_ADDRESS``); the checks that span groups are here."""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.config.converters import dns_subdomain, pod_uid_text
from agent.config.daemon_settings import (
    CdiSettings,
    ClusterSettings,
    DaemonSettings,
    KubeletSettings,
    PublishingSettings,
    SharingSettings,
)
from agent.config.declare import SettingMeta, build_settings, settings_of
from agent.config.node_settings import DriverSettings, NodeSettings, SimulatorSettings
from agent.config.options import load_settings
from agent.config.serving_settings import HttpSettings, TelemetrySettings
from agent.errors import ConfigError


@dataclass(frozen=True)
class Config:
    """Everything the agent can be told, by group. Defaults are production defaults."""

    node: NodeSettings = field(default_factory=NodeSettings)
    simulator: SimulatorSettings = field(default_factory=SimulatorSettings)
    driver: DriverSettings = field(default_factory=DriverSettings)
    daemon: DaemonSettings = field(default_factory=DaemonSettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    publishing: PublishingSettings = field(default_factory=PublishingSettings)
    kubelet: KubeletSettings = field(default_factory=KubeletSettings)
    cdi: CdiSettings = field(default_factory=CdiSettings)
    sharing: SharingSettings = field(default_factory=SharingSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)

    @classmethod
    def of(cls, **values: Any) -> Config:
        """A Config from values by setting name, whatever their group:
        ``Config.of(simulate="dgx-h100", sharing="time-slicing")``."""
        return build_settings(cls, values)

    def __post_init__(self) -> None:
        self._check_rolling_update()
        sim, node, driver = self.simulator, self.node, self.driver
        if sim.sim_crash_at is not None and sim.simulate is None:
            raise ConfigError("--sim-crash-at: fault injection is only allowed with --simulate")
        if sim.sim_driver_layout is not None and sim.simulate is None:
            raise ConfigError(
                f"--sim-driver-layout {sim.sim_driver_layout}: only with --simulate (a real"
                " node's layout is what its driver root holds)"
            )
        for name, p in (
            ("--host-driver-root", node.host_driver_root),
            ("--cdi-hook-path", self.cdi.cdi_hook_path),
        ):
            if p is not None and not p.is_absolute():
                raise ConfigError(f"{name} {str(p)!r} is not absolute: it names a host path")
        try:
            dns_subdomain(driver.driver_name)
        except ValueError as exc:
            raise ConfigError(f"--driver-name: {driver.driver_name!r} {exc}") from None
        for name, group in (("metrics", self.http), ("telemetry", self.telemetry)):
            cert, key, ca = (
                getattr(group, f"{name}_tls_{f}") for f in ("cert", "key", "client_ca")
            )
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
        if (
            self.telemetry.telemetry_tls_cert is not None
            and self.telemetry.telemetry_address is None
        ):
            raise ConfigError(
                "--telemetry-tls-cert applies to the TCP listener, and --telemetry-address is"
                " not set (the unix socket is never TLS)"
            )

    def _check_rolling_update(self) -> None:
        daemon = self.daemon
        if daemon.rolling_update and daemon.pod_uid is None:
            raise ConfigError(
                "--rolling-update needs this pod's UID: set --pod-uid or TESSERA_POD_UID (the"
                " DaemonSet sets it from the downward API, fieldRef metadata.uid)"
            )
        if daemon.pod_uid is not None:
            try:
                pod_uid_text(daemon.pod_uid)
            except ValueError as exc:
                raise ConfigError(f"--pod-uid: {daemon.pod_uid!r} {exc}") from None
        if daemon.rolling_update and self.publishing.cleanup_on_exit:
            raise ConfigError(
                "--cleanup-on-exit and --rolling-update go against each other: the agent that"
                " takes over publishes the same ResourceSlices the exiting one would delete"
            )


def load_config(
    args: argparse.Namespace | Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    groups: Collection[str] | None = None,
) -> Config:
    """The agent's Config (see :func:`agent.config.options.load_settings`)."""
    return load_settings(Config, args, environ, groups)


def settings() -> list[tuple[str, SettingMeta, Any]]:
    """Every Config setting as ``(field name, meta, default)``, in declaration order."""
    return [(s.name, s.meta, s.default) for s in settings_of(Config)]
