"""Tessera's telemetry gRPC API (``tessera.telemetry.v1``): ``Watch`` and ``Snapshot``.

Served on ``<state-dir>/telemetry.sock`` (and optionally TCP). Both read the sampler's latest
snapshot; a watcher that reads slowly only ever skips samples: gRPC flow control holds back that
stream's own thread, never the sampler.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from agent.errors import ConfigError
from agent.fsutil import SocketIdentity, ensure_dir, socket_identity
from agent.logs import fields_
from agent.telemetry.api import telemetry_pb2 as pb
from agent.telemetry.api import telemetry_pb2_grpc as pb_grpc
from agent.telemetry.snapshot import GpuTelemetry, Snapshot

MAX_STREAMS = 64


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
            pb.Holder(namespace=p.namespace, claim=p.claim, device=p.device)
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
            )
            for c in snap.claims
            if c.gpu_index in indexes
        ],
        tick_duration_seconds=snap.tick_duration_seconds,
        lag_seconds=snap.lag_seconds,
    )


class TelemetryService(pb_grpc.TelemetryServicer):
    def __init__(
        self,
        latest: Callable[[], Snapshot | None],
        stop: threading.Event,
        wake: threading.Condition,
    ) -> None:
        self.latest = latest
        self.stop = stop
        self.wake = wake

    def Snapshot(self, request: Any, context: Any) -> Any:
        snap = self.latest()
        if snap is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no sample taken yet; retry shortly")
        assert snap is not None
        return to_proto(snap, request.devices)

    def Watch(self, request: Any, context: Any) -> Iterator[Any]:
        if request.interval_seconds < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "interval_seconds must be >= 0")
        last_tick = -1
        next_due = 0.0
        while not self.stop.is_set() and context.is_active():
            snap = self.latest()
            if snap is not None and snap.tick != last_tick and snap.monotonic >= next_due:
                last_tick = snap.tick
                next_due = snap.monotonic + request.interval_seconds - snap.interval_seconds / 2
                yield to_proto(snap, request.devices)
            with self.wake:
                self.wake.wait(timeout=0.5)


class TelemetryServer:
    """The gRPC server: a unix socket (0660) and optionally a TCP address."""

    def __init__(
        self,
        latest: Callable[[], Snapshot | None],
        socket: Path,
        log: logging.Logger,
        tcp_address: str | None = None,
    ) -> None:
        self.socket = socket.absolute()
        self.tcp_address = tcp_address
        self.log = log
        self.tcp_port: int | None = None
        self._started = False
        self._identity: SocketIdentity | None = None
        self._stop = threading.Event()
        self.wake = threading.Condition()
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=MAX_STREAMS + 4, thread_name_prefix="telemetry"),
            maximum_concurrent_rpcs=MAX_STREAMS,
        )
        pb_grpc.add_TelemetryServicer_to_server(
            TelemetryService(latest, self._stop, self.wake), self._server
        )

    def notify(self) -> None:
        """A new snapshot exists: wake the watchers (called by the sampler after each tick)."""
        with self.wake:
            self.wake.notify_all()

    def start(self) -> None:
        if len(os.fsencode(self.socket)) > 107:
            raise ConfigError(f"telemetry socket path {self.socket} is longer than 107 bytes")
        ensure_dir(self.socket.parent)
        self.socket.unlink(missing_ok=True)
        try:
            self._server.add_insecure_port(f"unix://{self.socket}")
        except RuntimeError as exc:  # what grpc raises for a failed bind
            raise ConfigError(f"cannot listen on {self.socket}: {exc}") from exc
        if self.tcp_address:
            try:
                self.tcp_port = self._server.add_insecure_port(self.tcp_address)
            except RuntimeError as exc:
                raise ConfigError(
                    f"--telemetry-address: cannot listen on {self.tcp_address}: the address is"
                    " in use or not allowed here"
                ) from exc
        self._server.start()
        self._started = True
        os.chmod(self.socket, 0o660)
        self._identity = socket_identity(self.socket)
        self.log.info(
            "telemetry API serving",
            extra=fields_(socket=str(self.socket), tcp=self.tcp_address, tcp_port=self.tcp_port),
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
        self._server.stop(grace).wait()
        if self._started:  # only our own socket, never another instance's
            if socket_identity(self.socket) == self._identity:
                self.socket.unlink(missing_ok=True)
            self._started = False
