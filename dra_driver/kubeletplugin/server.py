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
:meth:`PluginServer.start` opens it.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

from agent.errors import ConfigError
from agent.fsutil import SocketIdentity, accepts_connections, ensure_dir, socket_identity
from agent.grpcguard import MalformedRequests
from agent.logs import Throttle, fields_
from dra_driver.errors import ClaimError
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
from dra_driver.kubeletplugin.batch import ClaimResult
from dra_driver.kubeletplugin.claims import ClaimKey, check_claim_key
from dra_driver.kubeletplugin.health_stream import HealthBoard
from dra_driver.kubeletplugin.prepare import Preparer

MAX_MESSAGE = 16 * 1024 * 1024
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")
LOG_INTERVAL = 10.0
"""Seconds between two log records of refused health-watch streams."""
HANDOVER_WAIT_S = 40.0
"""The longest a DRA call waits at a closed gate (the preparer's own deadline)."""
HANDOVER_RESERVE_S = 5.0
"""Of the kubelet's deadline for a call, what a wait at the gate leaves for the call itself."""
STALE_AFTER_S = 10.0
"""A socket of another instance that refuses connections is stale once it is this old (a
younger one may belong to an agent between bind and listen)."""
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
MAX_REGISTRATION_ERROR = 1000
"""Characters of the kubelet's registration error kept (for the log and /readyz)."""
MAX_CLAIMS_PER_CALL = 1024
"""Claims one NodePrepareResources or NodeUnprepareResources call may name (the kubelet sends
the claims of one pod); a call naming more is refused with INVALID_ARGUMENT, so a request of
16 MiB cannot queue hundreds of thousands of claims or ask for an answer too large to send."""
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


class Gate:
    """Closed until the agent may touch its state; DRA calls wait here (:meth:`wait`).

    ``waiting_for`` says what it waits for (the state directory and who holds it), for the
    answer a call gets when the wait runs out. :meth:`abort` (shutting down) wakes every waiter
    with False."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = False
        self._aborted = False
        self.waiting_for = "the agent's state"

    @property
    def is_open(self) -> bool:
        with self._cond:
            return self._open

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    def wait(self, timeout: float) -> bool:
        """Whether the gate is open within ``timeout`` seconds (False at once once aborted)."""
        with self._cond:
            self._cond.wait_for(lambda: self._open or self._aborted, max(0.0, timeout))
            return self._open and not self._aborted

    def refused(self, claims: Sequence[ClaimKey], context: Any, most: float) -> dict[str, str]:
        """Wait for the gate within the call's deadline (less a reserve for the call itself, at
        most ``most`` seconds): {} when open, else each claim's retryable error."""
        if self.is_open:
            return {}
        left = context.time_remaining() if context is not None else None
        budget = most if left is None else min(most, left - HANDOVER_RESERVE_S)
        if self.wait(budget):
            return {}
        with self._cond:
            aborted = self._aborted
        why = (
            "the agent is shutting down; the kubelet retries it with the next agent"
            if aborted
            else f"the agent is taking over from the one before it and is still waiting for"
            f" {self.waiting_for}; the kubelet retries the call"
        )
        return {c.uid: f"claim {c}: {why}" for c in claims}


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
        self.plugin.registered = bool(request.plugin_registered)
        self.plugin.registration_error = error or None
        if request.plugin_registered:
            self.plugin.log.info("registered with the kubelet")
        else:
            self.plugin.log.error(
                "the kubelet refused the registration", extra=fields_(reason=error)
            )
        return registration_pb2.RegistrationStatusResponse()


class DraService:
    """DRAPlugin for one API version; the message classes come from that version's module."""

    def __init__(
        self,
        pb2: ModuleType,
        preparer: Preparer,
        gate: Gate,
        handover_wait: float,
        throttle: Throttle | None = None,
    ) -> None:
        self.pb2 = pb2
        self.preparer = preparer
        self.gate = gate
        self.handover_wait = handover_wait
        self.throttle = throttle or Throttle(preparer.log, LOG_INTERVAL)

    def _admit(
        self, request: Any, context: Any, op: str
    ) -> tuple[list[ClaimKey], dict[str, ClaimResult]]:
        """The request's claims the preparer may see, and the answers of those refused here.

        The kubelet's request is input like any other: a call naming more than
        MAX_CLAIMS_PER_CALL claims is refused whole (INVALID_ARGUMENT); a claim whose UID,
        namespace or name Kubernetes could not have made is answered with an error naming the
        field and the value (``claims[2].uid: '../x' is not a claim UID ...``), to prepare and
        to unprepare alike (the preparer makes file names of UIDs and logs the names); a claim
        named twice is taken once, and one UID given to two different claims answers that UID
        with an error naming both (the answer is keyed by UID: one of them would be lost). The
        first refusal of a UID is its answer."""
        claims = request.claims
        if len(claims) > MAX_CLAIMS_PER_CALL:
            self.throttle(
                logging.WARNING,
                f"{op}-too-many-claims",
                f"{op} call refused: too many claims",
                claims=len(claims),
                max_claims=MAX_CLAIMS_PER_CALL,
            )
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the call names {len(claims)} claims; at most {MAX_CLAIMS_PER_CALL} are taken in"
                " one call",
            )
        first: dict[str, tuple[int, ClaimKey]] = {}
        refused: dict[str, ClaimResult] = {}
        for i, c in enumerate(claims):
            key = ClaimKey(c.namespace, c.name, c.uid)
            if key.uid in refused:
                continue
            try:
                check_claim_key(key, f"claims[{i}]")
            except ClaimError as exc:
                refused[key.uid] = ClaimResult(error=f"claim refused: {exc}")
                continue
            if key.uid in first:
                j, other = first[key.uid]
                if other != key:
                    refused[key.uid] = ClaimResult(
                        error=f"claims[{j}] and claims[{i}] have the same UID {key.uid!r} but"
                        f" name different claims ({other.namespace}/{other.name} and"
                        f" {key.namespace}/{key.name}); neither is taken"
                    )
                continue
            first[key.uid] = (i, key)
        for result in refused.values():
            self.preparer.observe(op, 0.0, "invalid_claim")
            self.throttle(
                logging.WARNING,
                f"{op}-invalid-claim",
                f"{op} failed: the kubelet's request names an invalid claim",
                error=result.error,
                reason="invalid_claim",
            )
        return [k for _, k in first.values() if k.uid not in refused], refused

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
        keys, invalid = self._admit(request, context, "prepare")
        refused = self.gate.refused(keys, context, self.handover_wait)
        results: dict[str, ClaimResult] = invalid | (
            {uid: ClaimResult(error=e) for uid, e in refused.items()}
            if refused
            else self.preparer.prepare(keys)
        )
        resp = self.pb2.NodePrepareResourcesResponse()
        for uid, r in results.items():
            entry = resp.claims[uid]
            entry.error = r.error
            entry.devices.extend(self._device(d) for d in r.devices)
        return resp

    def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        keys, invalid = self._admit(request, context, "unprepare")
        refused = self.gate.refused(keys, context, self.handover_wait)
        results = invalid | (
            {uid: ClaimResult(error=e) for uid, e in refused.items()}
            if refused
            else self.preparer.unprepare(keys)
        )
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
        gate: Gate | None = None,
    ) -> None:
        self.board = board
        self.stop = stop
        self.gate = gate
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
        # before the agent holds its state, it knows nothing to say about its devices
        while self.gate is not None and not self.gate.is_open:
            if self.stop.is_set() or not context.is_active():
                return
            self.gate.wait(1.0)
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
        self._reg = grpc.server(
            ThreadPoolExecutor(max_workers=2), options=GRPC_OPTIONS, interceptors=[guard]
        )
        self._dra = grpc.server(
            ThreadPoolExecutor(max_workers=max_workers + health_streams, thread_name_prefix="dra"),
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
        for sock, ident in self._bound.items():  # only our own, never another instance's
            if ident is None or socket_identity(sock) == ident:
                sock.unlink(missing_ok=True)
        self._bound.clear()
