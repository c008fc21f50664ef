"""The settings groups of what the daemon serves over the network: the HTTP endpoint (/healthz,
/readyz, /metrics) and telemetry (the sampler and its gRPC API)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.config.converters import (
    host_port,
    non_negative_int,
    parse_host_port,
    positive_int,
    seconds,
)
from agent.config.declare import setting
from agent.telemetry.gpu_health import parse_xids
from agent.tls import TlsFiles


@dataclass(frozen=True)
class HttpSettings:
    """The HTTP endpoint (/healthz, /readyz, /metrics): address, limits, TLS."""

    metrics_address: str = setting(
        "127.0.0.1:9400",
        "host:port of the HTTP endpoint serving /healthz, /readyz (and /metrics).",
        groups=("daemon",),
        metavar="HOST:PORT",
        parse=host_port,
        listen=True,
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

    def host_port(self) -> tuple[str, int]:
        return parse_host_port("metrics-address", self.metrics_address)

    def tls(self) -> TlsFiles | None:
        """The HTTP endpoint's TLS files; None: plain HTTP."""
        if self.metrics_tls_cert is None:
            return None
        return TlsFiles(
            self.metrics_tls_cert,
            self.metrics_tls_key,
            self.metrics_tls_client_ca,
            option="--metrics-tls",
        )


@dataclass(frozen=True)
class TelemetrySettings:
    """Telemetry: the sampler, XIDs, and the gRPC API (address, limits, TLS)."""

    telemetry_interval: float = setting(
        1.0,
        "Seconds between telemetry samples (NVML reads); metrics and the telemetry API serve the"
        " latest sample.",
        groups=("daemon",),
        metavar="SECONDS",
    )
    usage_write_interval: float = setting(
        15.0,
        "Seconds between writes of the usage ledger (<state-dir>/usage.json) while no claim comes"
        " or goes (a change is written at once). A crash loses at most this much busy time;"
        " allocated GPU-seconds and energy are exact across it (docs/budgets.md). A write costs"
        " the sampler about as much CPU as a second of counting (docs/performance.md).",
        groups=("daemon",),
        metavar="SECONDS",
        parse=seconds,
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

    def tls(self) -> TlsFiles | None:
        """The telemetry TCP listener's TLS files; None: plain gRPC."""
        if self.telemetry_tls_cert is None:
            return None
        return TlsFiles(
            self.telemetry_tls_cert,
            self.telemetry_tls_key,
            self.telemetry_tls_client_ca,
            option="--telemetry-tls",
        )
