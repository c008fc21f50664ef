"""The kubelet plugin: registration and DRA services over unix sockets.

- ``<registry-dir>/<driver>-reg.sock`` serves ``pluginregistration.Registration``;
- ``<plugins-dir>/<driver>/dra.sock`` serves ``DRAPlugin`` v1 and v1beta1 (one implementation)
  and ``v1alpha1.DRAResourceHealth``.

With an ``instance`` (the pod UID under ``--rolling-update``) the sockets are
``<driver>-<instance>-reg.sock`` and ``dra-<instance>.sock``, as the upstream kubelet plugin
helper names them (``kubeletplugin.RollingUpdate``), so two agents of one driver are registered
with the kubelet side by side (docs/gpu-facts.md, "The kubelet and several plugins of a driver").

Sockets are created 0600 in 0750 directories. A stale socket file (left by a crash) is replaced,
but a socket some live process still serves is refused (one agent per state directory is already
guaranteed by the state-directory lock; this also covers two agents sharing kubelet directories).
Both are removed on shutdown, only if they are still ours. Each gRPC call runs on the server's
thread pool; claim work runs on the preparer's own pool under a deadline, so a slow claim never
stalls other calls. Health-watch streams are bounded (``health_streams``, more are refused with
RESOURCE_EXHAUSTED) and the pool has that many threads beyond the ones the DRA calls use, so
streams held open can never starve NodePrepareResources/NodeUnprepareResources.

:meth:`PluginServer.serve` binds and serves before the agent may touch its state (a rolling
update's successor registers while its predecessor still holds the state directory): DRA calls
and health streams then wait at the :class:`Gate`, bounded by the kubelet's deadline, until
:meth:`PluginServer.start` opens it. The DRA and health services and the gate are in
``services``; this module holds the sockets, the registration service and the servers.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from agent.errors import ConfigError
from agent.fsutil import SocketIdentity, accepts_connections, ensure_dir, socket_identity
from agent.grpcguard import MalformedRequests
from agent.logs import Throttle, fields_
from agent.threadpool import FixedPool
from dra_driver.kubeletapi import (
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    health_v1alpha1_pb2_grpc,
    registration_pb2,
    registration_pb2_grpc,
)
from dra_driver.kubeletplugin.health_stream import HealthBoard
from dra_driver.kubeletplugin.prepare import Preparer
from dra_driver.kubeletplugin.services import LOG_INTERVAL, DraService, Gate, HealthService

MAX_MESSAGE = 16 * 1024 * 1024
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")
HANDOVER_WAIT_S = 40.0
"""The longest a DRA call waits at a closed gate (the preparer's own deadline)."""
STALE_AFTER_S = 10.0
"""A socket of another instance that refuses connections is stale once it is this old (a
younger one may belong to an agent between bind and listen)."""
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
MAX_REGISTRATION_ERROR = 1000
"""Characters of the kubelet's registration error kept (for the log and /readyz)."""
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
]


def socket_paths(
    registry_dir: Path, plugins_dir: Path, driver_name: str, instance: str | None = None
) -> tuple[Path, Path]:
    """The registration and DRA sockets (absolute): ``<driver>-reg.sock`` and
    ``<driver>/dra.sock``, or with ``instance`` ``<driver>-<instance>-reg.sock`` and
    ``<driver>/dra-<instance>.sock``."""
    part = f"-{instance}" if instance else ""
    return (
        (registry_dir / f"{driver_name}{part}-reg.sock").absolute(),
        (plugins_dir / driver_name / f"dra{part}.sock").absolute(),
    )


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
        # the kubelet's reason goes into a log record and /readyz: kept to a few lines
        error = request.error
        if len(error) > MAX_REGISTRATION_ERROR:
            error = f"{error[:MAX_REGISTRATION_ERROR]}... ({len(request.error)} characters)"
        self.plugin.registration_answered(bool(request.plugin_registered), error or None)
        return registration_pb2.RegistrationStatusResponse()


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
    return socket_identity(path) is not None and accepts_connections(path)


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
        instance: str | None = None,
        handover_wait: float = HANDOVER_WAIT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``max_workers`` threads serve the kubelet's DRA calls; ``health_streams`` more serve
        at most as many health-watch streams (more are refused). ``instance`` (the pod UID in a
        rolling update) names the sockets of this instance; DRA calls that arrive before
        :meth:`start` wait at most ``handover_wait`` seconds (within the kubelet's deadline)."""
        self.driver_name = driver_name
        self.instance = instance
        self.reg_socket, self.dra_socket = socket_paths(
            registry_dir, plugins_dir, driver_name, instance
        )
        self.gate = Gate()
        self._clock = clock
        self.preparer = preparer
        self.health = health
        self.log = log
        self.registered = False
        self.registration_error: str | None = None
        self._bound: dict[Path, SocketIdentity | None] = {}
        self._stop = threading.Event()
        self.throttle = Throttle(log, LOG_INTERVAL)
        guard = MalformedRequests(self._malformed)
        # grpc's server.stop leaves its executor alone: stop() shuts these down
        self._executors = (  # all their workers from the start: the thread count stays put
            FixedPool(2, "registration"),
            FixedPool(max_workers + health_streams, "dra"),
        )
        self._reg = grpc.server(self._executors[0], options=GRPC_OPTIONS, interceptors=[guard])
        self._dra = grpc.server(
            self._executors[1],
            options=GRPC_OPTIONS,
            interceptors=[guard],
        )
        registration_pb2_grpc.add_RegistrationServicer_to_server(
            RegistrationService(self), self._reg
        )
        dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(
            DraService(dra_v1_pb2, preparer, self.gate, handover_wait, self.throttle), self._dra
        )
        dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(
            DraService(dra_v1beta1_pb2, preparer, self.gate, handover_wait, self.throttle),
            self._dra,
        )
        health_v1alpha1_pb2_grpc.add_DRAResourceHealthServicer_to_server(
            HealthService(health, self._stop, resend_interval, health_streams, log, self.gate),
            self._dra,
        )

    def registration_answered(self, registered: bool, error: str | None) -> None:
        """The kubelet's answer to our registration (``NotifyRegistrationStatus``): kept for
        /readyz and logged."""
        self.registered, self.registration_error = registered, error
        if registered:
            self.log.info("registered with the kubelet")
        else:
            self.log.error("the kubelet refused the registration", extra=fields_(reason=error))

    def _malformed(self, method: str, error: str) -> None:
        """A request that does not decode (``agent.grpcguard``): one rate-limited warning."""
        self.throttle(
            logging.WARNING,
            "malformed-request",
            "kubelet plugin request refused: it does not decode",
            method=method,
            error=error,
        )

    @property
    def serving(self) -> bool:
        return bool(self._bound)

    def start(self) -> None:
        """Serve (:meth:`serve`, unless already serving) and let the kubelet's calls in."""
        self.serve()
        self.gate.open()

    def serve(self) -> None:
        """Bind and serve both sockets, DRA socket first: when the kubelet sees the registration
        socket, the service is up. Calls wait at the gate until :meth:`start`. With an instance,
        stale sockets of other instances are removed first (:meth:`remove_stale_sockets`)."""
        if self._bound:
            return
        if self.instance is not None:
            self.remove_stale_sockets()
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

    def peers(self) -> list[Path]:
        """The sockets other instances of this driver could have left here: the classic names
        and, with another instance's UID, ``<driver>-<UUID>-reg.sock`` in the shared registry
        directory (a UUID only, since other drivers' names may start like ours) and
        ``dra-<label>.sock`` in our own plugins directory; never ours."""
        reg_dir, dra_dir = self.reg_socket.parent, self.dra_socket.parent
        driver = re.escape(self.driver_name)
        patterns = (
            (reg_dir, re.compile(f"{driver}(-{UUID})?-reg\\.sock")),
            (dra_dir, re.compile(f"dra(-{DNS_LABEL})?\\.sock")),
        )
        found = []
        for directory, pattern in patterns:
            try:
                names = sorted(os.listdir(directory))
            except OSError:
                continue
            for name in names:
                path = directory / name
                if pattern.fullmatch(name) and path not in (self.reg_socket, self.dra_socket):
                    found.append(path)
        return found

    def remove_stale_sockets(self) -> list[Path]:
        """Remove the sockets of other instances (:meth:`peers`) that nothing answers on and
        that are older than STALE_AFTER_S (a crashed agent's; the kubelet cannot reach them
        either); those a live process serves are left alone. Returns the removed paths; each
        removal and each live peer is logged."""
        removed = []
        for path in self.peers():
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISSOCK(st.st_mode):
                continue
            if _answers(path):
                self.log.info(
                    "another instance of the driver serves here", extra=fields_(socket=str(path))
                )
                continue
            if self._clock() - st.st_mtime < STALE_AFTER_S:
                continue
            try:
                path.unlink()
            except OSError as exc:
                self.log.warning(
                    "cannot remove a stale socket",
                    extra=fields_(socket=str(path), error=str(exc.strerror or exc)),
                )
                continue
            removed.append(path)
            self.log.warning(
                "removed a stale socket of an earlier agent (nothing answers on it)",
                extra=fields_(socket=str(path)),
            )
        return removed

    def stop(self, grace: float = 2.0) -> None:
        """Stop serving (registration first, so the kubelet stops calling), remove sockets."""
        self._stop.set()
        self.gate.abort()
        self.health.wake_all()
        self._reg.stop(grace).wait()
        self._dra.stop(grace).wait()
        for executor in self._executors:  # every call has ended: the idle workers may go
            executor.shutdown(wait=False)
        for sock, ident in self._bound.items():  # only our own, never another instance's
            if ident is None or socket_identity(sock) == ident:
                sock.unlink(missing_ok=True)
        self._bound.clear()
