"""Tessera's telemetry gRPC API (``tessera.telemetry.v1``): ``Watch`` and ``Snapshot``.

Served on ``<state-dir>/telemetry.sock`` (0600) and optionally on TCP (``--telemetry-address``,
optionally TLS with client certificates). Both read the sampler's latest snapshot; a watcher that
reads slowly only ever skips samples: gRPC flow control holds back that stream's own thread,
never the sampler.

Each listener is its own gRPC server, so a network client can never use up what local clients
need (see docs/reliability.md, "The network endpoints"):

- at most ``max_watchers`` Watch streams at once per listener; more are refused with
  ``RESOURCE_EXHAUSTED``, and ``SNAPSHOT_THREADS`` threads beyond the watchers' stay free for
  ``Snapshot`` (``tessera top --once``);
- at most ``streams_per_connection`` streams on one client connection (HTTP/2
  ``MAX_CONCURRENT_STREAMS``; further calls wait on the client);
- a watcher that has not taken a sample within ``send_timeout`` is dropped (its call is
  cancelled), so watchers that stopped reading do not hold threads forever.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from agent.errors import ConfigError
from agent.fsutil import SocketIdentity, ensure_dir, socket_identity
from agent.grpcguard import MalformedRequests
from agent.logs import Throttle, fields_
from agent.telemetry.api import telemetry_pb2 as pb
from agent.telemetry.api import telemetry_pb2_grpc as pb_grpc
from agent.telemetry.snapshot import GpuTelemetry, Snapshot
from agent.threadpool import FixedPool
from agent.tls import TlsFiles, TlsMaterial, load_server

SNAPSHOT_THREADS = 4
"""Threads of each listener beyond its watchers': Snapshot calls always have these."""
QUEUED_CALLS = 16
"""Calls a listener queues when its threads are busy; beyond, gRPC answers RESOURCE_EXHAUSTED."""
LOG_INTERVAL = 10.0
"""Seconds between two log records of one kind of refused or dropped watcher."""


@dataclass(frozen=True)
class TelemetryLimits:
    """What each listener gives its clients (the daemon's ``--telemetry-*`` limits)."""

    max_watchers: int = 32
    streams_per_connection: int = 8
    send_timeout: float = 10.0


DeviceNames = Callable[[], Mapping[str, str]]
"""The DRA device names the node advertises now (``gpu-0``, ``gpu-0-mig-1g10gb-19-0``), each to
the NVML UUID of its GPU or MIG device (a dynamic MIG placement not yet created: its GPU's)."""


def _no_names() -> Mapping[str, str]:
    return {}


def resolve(snap: Snapshot, devices: Sequence[str], names: Mapping[str, str]) -> set[str]:
    """The filter ``devices`` as indexes and UUIDs: a DRA device name becomes its UUID.

    Raises ``ValueError`` naming the filters that match nothing and what would: an unknown
    name is a mistake to say, not an empty answer that looks like a node without GPUs."""
    known = {str(g.sample.index) for g in snap.gpus} | {g.sample.uuid for g in snap.gpus}
    known |= {m.uuid for g in snap.gpus for m in g.sample.mig}
    wanted = {names.get(d, d) for d in devices}
    unknown = [d for d in devices if names.get(d, d) not in known]
    if unknown:
        allowed = sorted(known | set(names), key=lambda k: (len(k), k))
        raise ValueError(
            f"unknown device filter {', '.join(map(repr, unknown))}; known on this node: GPU"
            f" indexes, GPU and MIG UUIDs and DRA device names: {', '.join(allowed)}"
        )
    return wanted


def _wanted(
    snap: Snapshot, devices: Sequence[str], names: Mapping[str, str], context: Any
) -> set[str]:
    """``resolve``, or the call aborted with INVALID_ARGUMENT saying why."""
    try:
        return resolve(snap, devices, names)
    except ValueError as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        raise  # abort raises; this line is for the type checker


def _gpu_selected(g: GpuTelemetry, wanted: set[str]) -> tuple[bool, set[str]]:
    """Whether the GPU is selected, and which of its MIG UUIDs (empty = all of them)."""
    if not wanted or str(g.sample.index) in wanted or g.sample.uuid in wanted:
        return True, set()
    migs = {m.uuid for m in g.sample.mig} & wanted
    return bool(migs), migs


def to_proto(snap: Snapshot, devices: Any = ()) -> Any:
    """The snapshot as a ``Sample`` message, filtered to ``devices``. Pure."""
    wanted = set(devices)
    holders: dict[int, list[Any]] = {}
    for p in snap.prepared:
        holders.setdefault(p.gpu_index, []).append(
            pb.Holder(
                namespace=p.namespace,
                claim=p.claim,
                device=p.device,
                gpu_instance_id=p.gpu_instance_id,
            )
        )
    gpus, indexes = [], set()
    for g in snap.gpus:
        selected, migs = _gpu_selected(g, wanted)
        if not selected:
            continue
        s = g.sample
        indexes.add(s.index)
        total = None
        if s.memory_used_bytes is not None and s.memory_free_bytes is not None:
            total = s.memory_used_bytes + s.memory_free_bytes + (s.memory_reserved_bytes or 0)
        profiles = dict(g.mig_profiles)
        gpus.append(
            pb.Gpu(
                index=s.index,
                minor=g.minor,
                uuid=s.uuid,
                name=g.name,
                pci_bus_id=g.pci_bus_id,
                lost=s.lost,
                healthy=g.healthy,
                utilization_gpu=s.utilization_gpu,
                utilization_memory=s.utilization_memory,
                memory_used_bytes=s.memory_used_bytes,
                memory_total_bytes=total,
                power_watts=s.power_watts,
                energy_joules_total=g.energy_joules_total,
                temperature_gpu_celsius=s.temperature_gpu_celsius,
                temperature_memory_celsius=s.temperature_memory_celsius,
                clock_sm_hertz=s.clock_sm_hertz,
                clock_memory_hertz=s.clock_memory_hertz,
                xids=[pb.Xid(xid=x, count=c) for x, c in g.xid_counts],
                mig=[
                    pb.Mig(
                        gpu_instance_id=m.gpu_instance_id,
                        compute_instance_id=m.compute_instance_id,
                        uuid=m.uuid,
                        profile=profiles.get(m.gpu_instance_id, ""),
                        memory_used_bytes=m.memory_used_bytes,
                        memory_total_bytes=m.memory_total_bytes,
                        utilization=m.utilization,
                    )
                    for m in s.mig
                    if not migs or m.uuid in migs
                ],
                holders=holders.get(s.index, []),
            )
        )
    return pb.Sample(
        node=snap.node,
        tick=snap.tick,
        wall_time=snap.wall_time,
        interval_seconds=snap.interval_seconds,
        gpus=gpus,
        claims=[
            pb.ClaimUsage(
                namespace=c.namespace,
                claim=c.claim,
                uid=c.uid,
                pool=c.pool,
                device=c.device,
                gpu_index=c.gpu_index,
                rule=c.rule,
                energy_joules_total=c.energy_joules_total,
                gpu_seconds_total=c.gpu_seconds_total,
                share=c.share,
            )
            for c in snap.claims
            if c.gpu_index in indexes
        ],
        tick_duration_seconds=snap.tick_duration_seconds,
        lag_seconds=snap.lag_seconds,
    )


class Watcher:
    """One Watch stream: its call, and since when its current sample has been sending."""

    __slots__ = ("context", "dropped", "peer", "sending_since")

    def __init__(self, context: Any) -> None:
        self.context = context
        self.peer: str = context.peer()
        self.sending_since: float | None = None
        self.dropped = False


class Watchers:
    """The watchers of one listener: at most ``limit`` at once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._active: set[Watcher] = set()
        self._lock = threading.Lock()

    def enter(self, context: Any) -> Watcher | None:
        """A place for a new watcher; None when all ``limit`` are taken."""
        with self._lock:
            if len(self._active) >= self.limit:
                return None
            watcher = Watcher(context)
            self._active.add(watcher)
            return watcher

    def leave(self, watcher: Watcher) -> None:
        with self._lock:
            self._active.discard(watcher)

    def count(self) -> int:
        with self._lock:
            return len(self._active)

    def slow(self, now: float, timeout: float) -> list[Watcher]:
        """Watchers whose current sample has been sending for ``timeout`` seconds or more."""
        with self._lock:
            return [
                w
                for w in self._active
                if not w.dropped
                and w.sending_since is not None
                and now - w.sending_since >= timeout
            ]


class TelemetryService(pb_grpc.TelemetryServicer):
    def __init__(
        self,
        latest: Callable[[], Snapshot | None],
        stop: threading.Event,
        wake: threading.Condition,
        watchers: Watchers | None = None,
        throttle: Throttle | None = None,
        listener: str = "unix",
        device_names: DeviceNames = _no_names,
    ) -> None:
        self.latest = latest
        self.device_names = device_names
        self.stop = stop
        self.wake = wake
        self.watchers = watchers or Watchers(32)
        self.throttle = throttle or Throttle(logging.getLogger("tessera.telemetry"))
        self.listener = listener

    def Snapshot(self, request: Any, context: Any) -> Any:
        snap = self.latest()
        if snap is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no sample taken yet; retry shortly")
        assert snap is not None
        return to_proto(snap, _wanted(snap, request.devices, self.device_names(), context))

    def _wake_all(self) -> None:
        with self.wake:
            self.wake.notify_all()

    def Watch(self, request: Any, context: Any) -> Iterator[Any]:
        if request.interval_seconds < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "interval_seconds must be >= 0")
        watcher = self.watchers.enter(context)
        if watcher is None:
            self.throttle(
                logging.WARNING,
                f"watchers-{self.listener}",
                "telemetry watcher refused: too many watchers on this listener",
                listener=self.listener,
                peer=context.peer(),
                max_watchers=self.watchers.limit,
            )
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many telemetry watchers: {self.watchers.limit} are open on this listener"
                " (the agent's --telemetry-max-watchers); Snapshot still answers; retry later",
            )
        assert watcher is not None
        context.add_callback(self._wake_all)  # a watcher that goes away frees its place at once
        try:
            last_tick = -1
            next_due = 0.0
            wanted: set[str] | None = None
            while not self.stop.is_set() and context.is_active():
                snap = self.latest()
                if snap is not None and snap.tick != last_tick and snap.monotonic >= next_due:
                    last_tick = snap.tick
                    next_due = snap.monotonic + request.interval_seconds - snap.interval_seconds / 2
                    if wanted is None:  # checked once: a GPU that goes later just leaves
                        wanted = _wanted(snap, request.devices, self.device_names(), context)
                    message = to_proto(snap, wanted)
                    watcher.sending_since = time.monotonic()
                    yield message  # returns once gRPC has handed it to the transport
                    watcher.sending_since = None
                with self.wake:
                    self.wake.wait(timeout=0.5)
        finally:
            self.watchers.leave(watcher)


@dataclass
class _Listener:
    name: str
    """``unix`` or ``tcp``."""
    server: grpc.Server
    watchers: Watchers
    executor: ThreadPoolExecutor
    """The server's threads: ``server.stop`` leaves them, so ``stop`` shuts them down."""


class TelemetryServer:
    """The gRPC servers: the unix socket (0600) and optionally a TCP address (optionally TLS)."""

    def __init__(
        self,
        latest: Callable[[], Snapshot | None],
        socket: Path,
        log: logging.Logger,
        tcp_address: str | None = None,
        *,
        limits: TelemetryLimits | None = None,
        tls: TlsFiles | None = None,
        device_names: DeviceNames = _no_names,
    ) -> None:
        self.socket = socket.absolute()
        self._device_names = device_names
        self.tcp_address = tcp_address
        self.log = log
        self.limits = limits or TelemetryLimits()
        self.tls: TlsMaterial | None = None if tls is None else load_server(tls)
        self.tcp_port: int | None = None
        self.throttle = Throttle(log, LOG_INTERVAL)
        self._latest = latest
        self._started = False
        self._identity: SocketIdentity | None = None
        self._stop = threading.Event()
        self.wake = threading.Condition()
        self._listeners = [self._listener("unix")]
        if tcp_address:
            self._listeners.append(self._listener("tcp"))
        self._watchdog: threading.Thread | None = None

    def _listener(self, name: str) -> _Listener:
        threads = self.limits.max_watchers + SNAPSHOT_THREADS
        executor = FixedPool(threads, f"telemetry-{name}")  # its thread count stays put
        server = grpc.server(
            executor,
            options=[("grpc.max_concurrent_streams", self.limits.streams_per_connection)],
            maximum_concurrent_rpcs=threads + QUEUED_CALLS,
            interceptors=[MalformedRequests(self._malformed)],
        )
        watchers = Watchers(self.limits.max_watchers)
        service = TelemetryService(
            self._latest,
            self._stop,
            self.wake,
            watchers,
            self.throttle,
            listener=name,
            device_names=self._device_names,
        )
        pb_grpc.add_TelemetryServicer_to_server(service, server)
        return _Listener(name, server, watchers, executor)

    def _malformed(self, method: str, error: str) -> None:
        """A request that does not decode (``agent.grpcguard``): one rate-limited warning."""
        self.throttle(
            logging.WARNING,
            "malformed-request",
            "telemetry request refused: it does not decode",
            method=method,
            error=error,
        )

    def watchers(self) -> dict[str, int]:
        """Watchers open now, by listener."""
        return {lst.name: lst.watchers.count() for lst in self._listeners}

    def notify(self) -> None:
        """A new snapshot exists: wake the watchers (called by the sampler after each tick)."""
        with self.wake:
            self.wake.notify_all()

    def start(self) -> None:
        if len(os.fsencode(self.socket)) > 107:
            raise ConfigError(f"telemetry socket path {self.socket} is longer than 107 bytes")
        ensure_dir(self.socket.parent)
        self.socket.unlink(missing_ok=True)
        unix = self._listeners[0].server
        try:
            unix.add_insecure_port(f"unix://{self.socket}")
        except RuntimeError as exc:  # what grpc raises for a failed bind
            raise ConfigError(f"cannot listen on {self.socket}: {exc}") from exc
        if self.tcp_address:
            self.tcp_port = self._bind_tcp(self._listeners[1].server, self.tcp_address)
        for lst in self._listeners:
            lst.server.start()
        self._started = True
        os.chmod(self.socket, 0o600)
        self._identity = socket_identity(self.socket)
        self._watchdog = threading.Thread(target=self._drop_slow, name="telemetry-watchdog")
        self._watchdog.daemon = True
        self._watchdog.start()
        self.log.info(
            "telemetry API serving",
            extra=fields_(
                socket=str(self.socket),
                tcp=self.tcp_address,
                tcp_port=self.tcp_port,
                tls=self.tls is not None,
                client_certificates=self.tls is not None and self.tls.verifies_peer,
                max_watchers=self.limits.max_watchers,
            ),
        )

    def _bind_tcp(self, server: grpc.Server, address: str) -> int:
        try:
            if self.tls is None:
                return int(server.add_insecure_port(address))
            assert self.tls.key is not None and self.tls.cert_chain is not None
            credentials = grpc.ssl_server_credentials(
                [(self.tls.key, self.tls.cert_chain)],
                root_certificates=self.tls.ca,
                require_client_auth=self.tls.verifies_peer,
            )
            return int(server.add_secure_port(address, credentials))
        except RuntimeError as exc:
            raise ConfigError(
                f"--telemetry-address: cannot listen on {address}: the address is"
                " in use or not allowed here"
            ) from exc

    def _drop_slow(self) -> None:
        """Cancel watchers that have not taken a sample within the send timeout: the client
        stopped reading, and its thread would wait for it forever."""
        timeout = self.limits.send_timeout
        while not self._stop.wait(min(1.0, timeout / 4)):
            now = time.monotonic()
            for lst in self._listeners:
                for w in lst.watchers.slow(now, timeout):
                    w.dropped = True
                    w.context.cancel()
                    self.throttle(
                        logging.WARNING,
                        f"slow-{lst.name}",
                        "dropped a slow telemetry watcher: it took no sample in time",
                        listener=lst.name,
                        peer=w.peer,
                        send_timeout_seconds=timeout,
                    )

    def socket_intact(self) -> tuple[bool, str]:
        """Whether the unix socket we bound is still there and still ours."""
        if not self._started:
            return False, "not serving"
        if socket_identity(self.socket) != self._identity:
            return False, f"socket gone or replaced: {self.socket}"
        return True, "serving"

    def stop(self, grace: float = 1.0) -> None:
        self._stop.set()
        self.notify()
        stopped = [lst.server.stop(grace) for lst in self._listeners]  # all at once
        for done in stopped:
            done.wait()
        for lst in self._listeners:  # every call has ended: the idle workers may go
            lst.executor.shutdown(wait=False)
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)
        if self._started:  # only our own socket, never another instance's
            if socket_identity(self.socket) == self._identity:
                self.socket.unlink(missing_ok=True)
            self._started = False
