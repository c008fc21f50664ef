"""`tessera top`: a live terminal view over the telemetry API (rich).

Per GPU and MIG device: utilization bars, memory, power, energy, temperature and the claims
holding it. The GPU column is the GPU's minor number, the N of its device name ``gpu-N`` and of
its metrics' ``gpu`` label (NVML's index shifts when a GPU before it is removed). ``--once``
prints one frame and exits (scripts, tests).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import grpc
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from agent.errors import ConfigError, TesseraError
from agent.telemetry.api import telemetry_pb2 as pb
from agent.telemetry.api import telemetry_pb2_grpc as pb_grpc
from agent.tls import TlsFiles, load_client

GIB = 1024**3


class TopError(TesseraError):
    """The telemetry API could not be reached or answered with an error."""


def target(endpoint: str | None, state_dir: Path) -> str:
    """``unix:///path`` or ``host:port``; default the agent's socket under the state dir."""
    if not endpoint:
        return f"unix://{(state_dir / 'telemetry.sock').absolute()}"
    return endpoint


def no_agent(endpoint: str) -> str:
    """What to say when nothing serves the telemetry API at ``endpoint``."""
    return (
        f"no Tessera agent answers at {endpoint}; is `tessera run` going? Point at a running"
        " agent with --state-dir DIR (its --state-dir; the socket is DIR/telemetry.sock) or"
        " --endpoint unix:///PATH/telemetry.sock or HOST:PORT (its --telemetry-address)"
    )


def went_away(endpoint: str) -> str:
    """What to say when the agent ends a running `tessera top`'s stream."""
    return (
        f"the Tessera agent at {endpoint} went away (it stopped, restarted or dropped this"
        " watcher); run `tessera top` again once the agent is back"
    )


def console(out: IO[str], **options: Any) -> Console:
    """A console for data: rich's markup and emoji codes are off, so names and bus ids print
    as they are (``0000:cd:00.0`` is not an emoji, ``[x]`` is not a style)."""
    return Console(file=out, markup=False, emoji=False, highlight=False, **options)


def bar(ratio: float | None, width: int = 12) -> Text:
    if ratio is None:
        return Text("n/a".ljust(width + 5), style="dim")
    filled = round(max(0.0, min(1.0, ratio)) * width)
    style = "green" if ratio < 0.5 else "yellow" if ratio < 0.85 else "red"
    return Text("█" * filled + "░" * (width - filled), style=style) + Text(f" {ratio:4.0%}")


def _opt(msg: Any, field: str) -> Any:
    return getattr(msg, field) if msg.HasField(field) else None


def _mem(used: int | None, total: int | None) -> str:
    if used is None:
        return "n/a"
    return f"{used / GIB:.1f}/{total / GIB:.0f} GiB" if total else f"{used / GIB:.1f} GiB"


def _energy(joules: float | None) -> str:
    if joules is None:
        return "n/a"
    return f"{joules / 3.6e6:.2f} kWh" if joules >= 3.6e6 else f"{joules / 1000:.1f} kJ"


def render(sample: Any) -> Group:
    """One frame for one ``Sample`` message. Pure."""
    table = Table(
        title=f"{sample.node} — tick {sample.tick}, {sample.tick_duration_seconds * 1000:.1f} ms",
        title_justify="left",
        expand=False,
    )
    for col in ("GPU", "Device", "Util", "Memory", "Power", "Energy", "Temp", "Claim"):
        table.add_column(col)
    for g in sample.gpus:
        holders = ", ".join(f"{h.namespace}/{h.claim}" for h in g.holders) or "-"
        status = "LOST" if g.lost else ("" if g.healthy else "UNHEALTHY")
        power = _opt(g, "power_watts")
        energy = _opt(g, "energy_joules_total")
        temp = _opt(g, "temperature_gpu_celsius")
        table.add_row(
            str(g.minor),  # as in the device name gpu-<minor>; NVML's index shifts
            Text(f"{g.name} {status}".strip(), style="bold red" if status else ""),
            bar(_opt(g, "utilization_gpu")),
            _mem(_opt(g, "memory_used_bytes"), _opt(g, "memory_total_bytes")),
            "n/a" if power is None else f"{power:.0f} W",
            _energy(energy),
            "n/a" if temp is None else f"{temp:.0f} °C",
            holders,
        )
        for m in g.mig:
            held = ", ".join(
                f"{h.namespace}/{h.claim}"
                for h in g.holders
                if _opt(h, "gpu_instance_id") == m.gpu_instance_id
            )
            table.add_row(
                "",
                f"  └ {m.profile or 'mig'} (GI {m.gpu_instance_id})",
                bar(_opt(m, "utilization")),
                _mem(_opt(m, "memory_used_bytes"), _opt(m, "memory_total_bytes")),
                "",
                "",
                "",
                held or "-",
            )
    return Group(table)


class TopClient:
    def __init__(
        self,
        endpoint: str,
        timeout: float = 10.0,
        tls: TlsFiles | None = None,
        server_name: str | None = None,
    ) -> None:
        """``tls``: connect with TLS (a HOST:PORT endpoint only), checking the server against
        its CA (unset: the system's) and presenting its certificate when given; ``server_name``:
        the name the server's certificate must carry when it is not the endpoint's host."""
        self.endpoint = endpoint
        self.timeout = timeout
        self.tls = tls
        if tls is None:
            self._channel = grpc.insecure_channel(endpoint)
        else:
            if endpoint.startswith("unix:"):
                raise ConfigError(
                    f"{tls.option} options apply to a HOST:PORT endpoint (the agent's"
                    f" --telemetry-address), not to the unix socket {endpoint}"
                )
            material = load_client(tls)
            credentials = grpc.ssl_channel_credentials(
                root_certificates=material.ca,
                private_key=material.key,
                certificate_chain=material.cert_chain,
            )
            options = (
                [] if server_name is None else [("grpc.ssl_target_name_override", server_name)]
            )
            self._channel = grpc.secure_channel(endpoint, credentials, options=options)
        self._stub = pb_grpc.TelemetryStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def _error(self, exc: grpc.RpcError) -> TopError:
        if self.tls is not None and exc.code() == grpc.StatusCode.UNAVAILABLE:
            return TopError(  # most often the handshake: say what gRPC saw
                f"{no_agent(self.endpoint)}; over TLS: {exc.details()}"
            )
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED):
            return TopError(no_agent(self.endpoint))
        return TopError(f"telemetry API at {self.endpoint}: {exc.code().name}: {exc.details()}")

    def snapshot(self) -> Any:
        try:
            return self._stub.Snapshot(pb.SnapshotRequest(), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise self._error(exc) from exc

    def watch(self, interval: float) -> Iterator[Any]:
        """Samples until the caller stops iterating. The stream ending by itself, or cancelled
        by the server, means the agent went away (it stops, restarts or dropped this watcher):
        a ``TopError`` says so, so that `tessera top` exits non-zero instead of as if the user
        had quit."""
        call = self._stub.Watch(pb.WatchRequest(interval_seconds=interval))
        try:
            yield from call
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE):
                raise self._error(exc) from exc
        finally:
            call.cancel()
        raise TopError(went_away(self.endpoint))


def run_top(
    endpoint: str,
    once: bool,
    interval: float,
    out: IO[str],
    stop: threading.Event,
    tls: TlsFiles | None = None,
    server_name: str | None = None,
) -> int:
    client = TopClient(endpoint, tls=tls, server_name=server_name)
    try:
        if once:
            console(out, width=140).print(render(client.snapshot()))
            return 0
        live_console = console(out)
        with Live(render(client.snapshot()), console=live_console, auto_refresh=False) as live:
            for sample in client.watch(interval):
                live.update(render(sample), refresh=True)
                if stop.is_set():
                    break
        return 0
    finally:
        client.close()
