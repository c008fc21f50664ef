"""The kubelet plugin: registration and DRA services over unix sockets.

- ``<registry-dir>/<driver>-reg.sock`` serves ``pluginregistration.Registration``;
- ``<plugins-dir>/<driver>/dra.sock`` serves ``DRAPlugin`` v1 and v1beta1 (one implementation)
  and ``v1alpha1.DRAResourceHealth``.

Sockets are created 0600 in 0750 directories. A stale socket file (left by a crash) is replaced,
but a socket some live process still serves is refused (one agent per state directory is already
guaranteed by the state-directory lock; this also covers two agents sharing kubelet directories).
Both are removed on shutdown, only if they are still ours. Each gRPC call runs on the server's
thread pool; claim work runs on the preparer's own pool under a deadline, so a slow claim never
stalls other calls. Health-watch streams are bounded (``health_streams``, more are refused with
RESOURCE_EXHAUSTED) and the pool has that many threads beyond the ones the DRA calls use, so
streams held open can never starve NodePrepareResources/NodeUnprepareResources.
"""

from __future__ import annotations

import logging
import os
import socket as sock_module
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

from agent.errors import ConfigError
from agent.fsutil import SocketIdentity, ensure_dir, socket_identity
from agent.logs import Throttle, fields_
from dra_driver.claims import ClaimKey
from dra_driver.health import HealthBoard
from dra_driver.kubeletapi import (
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    health_v1alpha1_pb2,
    health_v1alpha1_pb2_grpc,
    registration_pb2,
    registration_pb2_grpc,
)
from dra_driver.prepare import ClaimResult, Preparer

MAX_MESSAGE = 16 * 1024 * 1024
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")
LOG_INTERVAL = 10.0
"""Seconds between two log records of refused health-watch streams."""
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
]


class RegistrationService(registration_pb2_grpc.RegistrationServicer):
    def __init__(self, plugin: PluginServer) -> None:
        self.plugin = plugin

    def GetInfo(self, request: Any, context: Any) -> Any:
        return registration_pb2.PluginInfo(
            type="DRAPlugin",
            name=self.plugin.driver_name,
            endpoint=str(self.plugin.dra_socket),
            supported_versions=list(SUPPORTED_VERSIONS),
        )

    def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        self.plugin.registered = bool(request.plugin_registered)
        self.plugin.registration_error = request.error or None
        if request.plugin_registered:
            self.plugin.log.info("registered with the kubelet")
        else:
            self.plugin.log.error(
                "the kubelet refused the registration", extra=fields_(reason=request.error)
            )
        return registration_pb2.RegistrationStatusResponse()


class DraService:
    """DRAPlugin for one API version; the message classes come from that version's module."""

    def __init__(self, pb2: ModuleType, preparer: Preparer) -> None:
        self.pb2 = pb2
        self.preparer = preparer

    @staticmethod
    def _keys(request: Any) -> list[ClaimKey]:
        return [ClaimKey(c.namespace, c.name, c.uid) for c in request.claims]

    def _device(self, d: Any) -> Any:
        device = self.pb2.Device(
            request_names=list(d.request_names),
            pool_name=d.pool,
            device_name=d.device,
            cdi_device_ids=list(d.cdi_device_ids),
        )
        # the allocation's share ID, echoed so the kubelet matches the device to its result
        # (v1 only: v1beta1 has no such field)
        if d.share_id is not None and "share_id" in self.pb2.Device.DESCRIPTOR.fields_by_name:
            device.share_id = d.share_id
        return device

    def NodePrepareResources(self, request: Any, context: Any) -> Any:
        results: dict[str, ClaimResult] = self.preparer.prepare(self._keys(request))
        resp = self.pb2.NodePrepareResourcesResponse()
        for uid, r in results.items():
            entry = resp.claims[uid]
            entry.error = r.error
            entry.devices.extend(self._device(d) for d in r.devices)
        return resp

    def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        results = self.preparer.unprepare(self._keys(request))
        resp = self.pb2.NodeUnprepareResourcesResponse()
        for uid, r in results.items():
            resp.claims[uid].error = r.error
        return resp


class HealthService(health_v1alpha1_pb2_grpc.DRAResourceHealthServicer):
    """``NodeWatchResources``: at most ``max_streams`` at once. The kubelet opens one per plugin;
    more are refused with RESOURCE_EXHAUSTED, and the DRA server has ``max_streams`` threads
    beyond the ones prepare and unprepare use, so health streams can never starve them."""

    def __init__(
        self,
        board: HealthBoard,
        stop: threading.Event,
        resend_interval: float,
        max_streams: int = 4,
        log: logging.Logger | None = None,
    ) -> None:
        self.board = board
        self.stop = stop
        self.resend_interval = resend_interval
        self.max_streams = max_streams
        self.throttle = Throttle(log or logging.getLogger("tessera.plugin"), LOG_INTERVAL)
        self._streams = 0
        self._lock = threading.Lock()

    def _enter(self) -> bool:
        with self._lock:
            if self._streams >= self.max_streams:
                return False
            self._streams += 1
            return True

    def _leave(self) -> None:
        with self._lock:
            self._streams -= 1

    def NodeWatchResources(self, request: Any, context: Any) -> Iterator[Any]:
        if not self._enter():
            self.throttle(
                logging.WARNING,
                "health-streams",
                "health-watch stream refused: too many are open",
                peer=context.peer(),
                max_streams=self.max_streams,
            )
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many health-watch streams: {self.max_streams} are open (the agent's"
                " --kubelet-health-streams; the kubelet opens one); retry when one ends",
            )
        # a stream that ends (the kubelet restarted) wakes its thread at once, freeing its place
        context.add_callback(self.board.wake_all)
        try:
            yield from self._watch(context)
        finally:
            self._leave()

    def _watch(self, context: Any) -> Iterator[Any]:
        pb = health_v1alpha1_pb2
        seen = -1
        while not self.stop.is_set() and context.is_active():
            version, states = self.board.snapshot()
            if version != seen:
                seen = version
                yield pb.NodeWatchResourcesResponse(
                    devices=[
                        pb.DeviceHealth(
                            device=pb.DeviceIdentifier(pool_name=s.pool, device_name=s.device),
                            health=s.health,
                            last_updated_time=s.updated_at,
                            health_check_timeout_seconds=int(self.resend_interval * 3),
                        )
                        for s in states
                    ]
                )
            if not self.board.wait_change(seen, self.resend_interval):
                seen = -1  # nothing changed: resend the full list anyway


def _prepare_dir(path: Path) -> None:
    ensure_dir(path)
    os.chmod(path, 0o750)


MAX_SOCKET_PATH = 107  # sockaddr_un.sun_path holds 108 bytes with the terminating NUL


def _bind(server: grpc.Server, socket: Path) -> None:
    """Bind ``socket``, replacing a stale socket file (left by a crash); refuse one that a live
    process still serves (another agent with another state directory, say)."""
    if len(os.fsencode(socket)) > MAX_SOCKET_PATH:
        raise ConfigError(
            f"unix socket path {socket} is {len(os.fsencode(socket))} bytes; the limit is"
            f" {MAX_SOCKET_PATH}: choose shorter --kubelet-registry-dir/--kubelet-plugins-dir"
            " (or --state-dir with --simulate)"
        )
    if _answers(socket):
        raise ConfigError(
            f"{socket} is served by another process (another Tessera agent?); refusing to take"
            " it over: stop that process or choose other --kubelet-registry-dir/"
            "--kubelet-plugins-dir"
        )
    socket.unlink(missing_ok=True)  # a stale socket or file from an earlier run
    try:
        server.add_insecure_port(f"unix://{socket}")
    except RuntimeError as exc:  # what grpc raises for a failed bind
        raise ConfigError(f"cannot listen on {socket}: {exc}") from exc


def _answers(path: Path) -> bool:
    """Whether a process accepts connections on the unix socket ``path``."""
    if socket_identity(path) is None:
        return False
    probe = sock_module.socket(sock_module.AF_UNIX, sock_module.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


class PluginServer:
    def __init__(
        self,
        *,
        driver_name: str,
        registry_dir: Path,
        plugins_dir: Path,
        preparer: Preparer,
        health: HealthBoard,
        log: logging.Logger,
        max_workers: int = 16,
        resend_interval: float = 20.0,
        health_streams: int = 4,
    ) -> None:
        """``max_workers`` threads serve the kubelet's DRA calls; ``health_streams`` more serve
        at most as many health-watch streams (more are refused)."""
        self.driver_name = driver_name
        self.reg_socket = (registry_dir / f"{driver_name}-reg.sock").absolute()
        self.dra_socket = (plugins_dir / driver_name / "dra.sock").absolute()
        self.preparer = preparer
        self.health = health
        self.log = log
        self.registered = False
        self.registration_error: str | None = None
        self._bound: dict[Path, SocketIdentity | None] = {}
        self._stop = threading.Event()
        self._reg = grpc.server(ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS)
        self._dra = grpc.server(
            ThreadPoolExecutor(max_workers=max_workers + health_streams, thread_name_prefix="dra"),
            options=GRPC_OPTIONS,
        )
        registration_pb2_grpc.add_RegistrationServicer_to_server(
            RegistrationService(self), self._reg
        )
        dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(DraService(dra_v1_pb2, preparer), self._dra)
        dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(
            DraService(dra_v1beta1_pb2, preparer), self._dra
        )
        health_v1alpha1_pb2_grpc.add_DRAResourceHealthServicer_to_server(
            HealthService(health, self._stop, resend_interval, health_streams, log), self._dra
        )

    def start(self) -> None:
        """DRA socket first: when the kubelet sees the registration socket, the service is up."""
        for sock in (self.dra_socket, self.reg_socket):
            _prepare_dir(sock.parent)
        _bind(self._dra, self.dra_socket)
        self._bound[self.dra_socket] = None
        self._dra.start()
        os.chmod(self.dra_socket, 0o600)
        self._bound[self.dra_socket] = socket_identity(self.dra_socket)
        _bind(self._reg, self.reg_socket)
        self._bound[self.reg_socket] = None
        self._reg.start()
        os.chmod(self.reg_socket, 0o600)
        self._bound[self.reg_socket] = socket_identity(self.reg_socket)
        self.log.info(
            "kubelet plugin serving",
            extra=fields_(registration=str(self.reg_socket), dra=str(self.dra_socket)),
        )

    def sockets_intact(self) -> tuple[bool, str]:
        """Whether the kubelet can still reach us: each socket we bound is still there and is
        still ours (deleted or replaced by another process, the kubelet cannot call us)."""
        if not self._bound:
            return False, "not serving"
        lost = [str(p) for p, ident in self._bound.items() if socket_identity(p) != ident]
        return (not lost, f"socket gone or replaced: {', '.join(lost)}" if lost else "serving")

    def stop(self, grace: float = 2.0) -> None:
        """Stop serving (registration first, so the kubelet stops calling), remove sockets."""
        self._stop.set()
        self.health.wake_all()
        self._reg.stop(grace).wait()
        self._dra.stop(grace).wait()
        for sock, ident in self._bound.items():  # only our own, never another instance's
            if ident is None or socket_identity(sock) == ident:
                sock.unlink(missing_ok=True)
        self._bound.clear()
