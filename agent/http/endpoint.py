"""The endpoint itself: one selector thread reads every connection's request, a fixed pool of
workers answers complete ones (the package docstring says how it holds against bad clients)."""

from __future__ import annotations

import contextlib
import logging
import queue
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from agent.http.connection import (
    ACCEPT_BATCH,
    ACCEPT_PAUSE,
    CHUNKED,
    CONTENT_LENGTH,
    HEAD_END,
    LOG_INTERVAL,
    MAX_BODY_BYTES,
    MAX_HEADER_BYTES,
    REFUSED,
    Conn,
    DeadlineWriter,
    HttpLimits,
    ResponseTimeout,
    bind,
    peer_name,
)
from agent.http.descriptors import descriptors_left
from agent.http.handler import handler_class, route
from agent.http.probes import Readiness
from agent.logs import Throttle, fields_
from agent.tls import TlsFiles, TlsMaterial, load_server

Exposition = Callable[[], tuple[bytes, str]]
"""Renders /metrics: (body, content type)."""


class HttpEndpoint:
    """The agent's HTTP endpoint on one address (see the module's docstring)."""

    def __init__(
        self,
        host: str,
        port: int,
        readiness: Readiness,
        metrics: Exposition | None = None,
        *,
        liveness: Readiness | None = None,
        limits: HttpLimits | None = None,
        tls: TlsFiles | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        self.readiness = readiness
        self.liveness = liveness or Readiness()
        self.metrics = metrics
        self.limits = limits or HttpLimits()
        self.log = log or logging.getLogger("tessera.http")
        self.throttle = Throttle(self.log, LOG_INTERVAL)
        self.tls: TlsMaterial | None = None if tls is None else load_server(tls)
        self._listener = bind(host, port)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._pending: dict[int, Conn] = {}
        """Connections still sending their request, oldest first (the loop thread's alone)."""
        self._answering: set[Conn] = set()
        """Connections a worker is answering (guarded by ``_lock``)."""
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Conn | None] = queue.SimpleQueue()
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accept_paused_until = 0.0
        self._handler = handler_class(self._route, self.throttle)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def start(self) -> None:
        """Serve (idempotent: an agent waiting for its state directory serves its probes early)."""
        if self._threads:
            return
        self._selector.register(self._listener, selectors.EVENT_READ, "listener")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._threads = [threading.Thread(target=self._serve, name="http", daemon=True)]
        self._threads += [
            threading.Thread(target=self._work, name=f"http-worker-{i}", daemon=True)
            for i in range(self.limits.threads)
        ]
        for t in self._threads:
            t.start()
        host, port = self.address
        self.log.info(
            "HTTP endpoint serving",
            extra=fields_(
                url=f"{self.scheme}://{host}:{port}",
                client_certificates=self.tls is not None and self.tls.verifies_peer,
                max_connections=self.limits.max_connections,
                threads=self.limits.threads,
                fd_reserve=self.limits.fd_reserve,
            ),
        )

    def stop(self) -> None:
        """Stop serving and close every connection; safe before start. Workers blocked on a
        client are released at once (their sockets are shut down), so this never waits for a
        client."""
        self._closing.set()
        self._wake()
        for _worker in self._threads[1:]:
            self._jobs.put(None)
        if self._threads:
            self._threads[0].join(timeout=5)
        with self._lock:
            answering = list(self._answering)
        for c in answering:
            with contextlib.suppress(OSError):
                c.sock.shutdown(socket.SHUT_RDWR)
        for t in self._threads[1:]:
            t.join(timeout=5)
        for c in list(self._pending.values()):
            self._close(c)
        self._pending.clear()
        with contextlib.suppress(KeyError, ValueError):
            self._selector.close()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()

    # -- the selector thread -----------------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _serve(self) -> None:
        while not self._closing.is_set():
            now = time.monotonic()
            if self._accept_paused_until and now >= self._accept_paused_until:
                self._accept_paused_until = 0.0
                self._selector.register(self._listener, selectors.EVENT_READ, "listener")
            timeout = 0.5
            if self._pending:
                oldest_deadline = min(c.deadline for c in self._pending.values())
                timeout = min(timeout, max(0.0, oldest_deadline - now))
            for key, _mask in self._selector.select(timeout):
                if key.data == "listener":
                    self._accept()
                elif key.data == "wake":
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                elif isinstance(key.data, Conn):
                    self._guarded(key.data)
            self._expire(time.monotonic())

    def _guarded(self, c: Conn) -> None:
        """Read from one connection; a bug there costs that connection, never the endpoint."""
        try:
            self._readable(c)
        except Exception as exc:
            self._drop(c)
            self.throttle(
                logging.ERROR, "loop", "HTTP connection failed", exc_info=exc, peer=c.peer
            )

    def _open_connections(self) -> int:
        with self._lock:
            return len(self._pending) + len(self._answering)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE/ENFILE: no descriptor even for the accept
                if not self._evict_oldest("descriptors"):
                    self._pause_accepting(exc)
                    return
                continue
            self._admit(sock, peer_name(addr))

    def _pause_accepting(self, exc: OSError) -> None:
        """Out of descriptors with nothing to close: leave new connections in the kernel's
        queue for a moment instead of spinning on a listener that stays readable."""
        self._selector.unregister(self._listener)
        self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE
        self.throttle(
            logging.WARNING,
            "accept",
            "HTTP endpoint cannot accept connections: the process is out of file descriptors",
            error=exc.strerror or str(exc),
        )

    def _full(self) -> str | None:
        """Which limit a new connection would break now: ``connections``, ``descriptors``."""
        if self._open_connections() >= self.limits.max_connections:
            return "connections"
        left = descriptors_left()
        if left is not None and left < self.limits.fd_reserve:
            return "descriptors"
        return None

    def _admit(self, sock: socket.socket, peer: str) -> None:
        limit = self._full()
        if limit is not None and not self._evict_oldest(limit):
            sock.close()
            self.throttle(
                logging.WARNING,
                f"refused-{limit}",
                REFUSED[limit],
                peer=peer,
                limit=limit,
                max_connections=self.limits.max_connections,
                fd_reserve=self.limits.fd_reserve,
            )
            return
        now = time.monotonic()
        phase = "handshake" if self.tls is not None else "header"
        c = Conn(sock, peer, now, phase, now + self.limits.header_timeout)
        try:
            sock.setblocking(False)
            if self.tls is not None:
                c.sock = self.tls.context.wrap_socket(
                    sock, server_side=True, do_handshake_on_connect=False
                )
            self._selector.register(c.sock, selectors.EVENT_READ, c)
        except OSError as exc:
            self._close(c)
            self.throttle(
                logging.WARNING,
                "broken",
                "HTTP connection failed at accept",
                peer=peer,
                error=str(exc),
            )
            return
        with self._lock:
            self._pending[id(c)] = c

    def _evict_oldest(self, limit: str) -> bool:
        """Close the oldest connection still sending its request, to make room; False when
        there is none."""
        if not self._pending:
            return False
        c = next(iter(self._pending.values()))
        self._drop(c)
        self.throttle(
            logging.WARNING,
            f"evicted-{limit}",
            "HTTP connection closed to make room: the oldest one had not sent its request",
            peer=c.peer,
            phase=c.phase,
            age_seconds=round(time.monotonic() - c.opened, 3),
            limit=limit,
            max_connections=self.limits.max_connections,
            fd_reserve=self.limits.fd_reserve,
        )
        return True

    def _drop(self, c: Conn) -> None:
        """Forget a pending connection and close it."""
        with self._lock:
            self._pending.pop(id(c), None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(c.sock)
        self._close(c)

    @staticmethod
    def _close(c: Conn) -> None:
        with contextlib.suppress(OSError):
            c.sock.close()

    def _reply_and_drop(self, c: Conn, code: int, reason: str, msg: str, **fields: Any) -> None:
        """Answer a request the loop refuses with a short error (best effort: never blocks)."""
        body = f"{reason}\n".encode()
        head = (
            f"HTTP/1.0 {code} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        if c.phase != "handshake":
            with contextlib.suppress(OSError, ssl.SSLError):
                c.sock.send(head + body)
        self._drop(c)
        self.throttle(
            logging.WARNING,
            f"{code}-{c.phase}",
            msg,
            peer=c.peer,
            phase=c.phase,
            status=code,
            **fields,
        )

    def _expire(self, now: float) -> None:
        late = [c for c in self._pending.values() if c.deadline <= now]
        for c in late:
            timeout = self.limits.body_timeout if c.phase == "body" else self.limits.header_timeout
            self._reply_and_drop(
                c,
                408,
                "Request Timeout",
                "HTTP request timed out: the client was too slow sending it",
                timeout_seconds=timeout,
                received_bytes=len(c.buf),
            )

    def _went_away(self, c: Conn, **error: Any) -> None:
        """The client left before its request was complete: dropped, one rate-limited warning."""
        self._drop(c)
        self.throttle(
            logging.WARNING,
            "broken-request",
            "HTTP client went away before finishing its request",
            peer=c.peer,
            phase=c.phase,
            received_bytes=len(c.buf),
            **error,
        )

    def _readable(self, c: Conn) -> None:
        if c.phase == "handshake" and not self._handshake(c):
            return
        while True:
            try:
                data = c.sock.recv(65536)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                return
            except ssl.SSLWantWriteError:
                return  # the selector wakes us when the peer sends again
            except (OSError, ssl.SSLError) as exc:
                self._went_away(c, error=str(exc))
                return
            if not data:
                if c.buf:
                    self._went_away(c)
                else:  # nothing sent at all is a TCP probe, not worth a warning
                    self._drop(c)
                return
            c.buf += data
            if self._advance(c):
                return

    def _handshake(self, c: Conn) -> bool:
        """Advance a TLS handshake; True when it is done and the request may be read."""
        assert isinstance(c.sock, ssl.SSLSocket)
        try:
            c.sock.do_handshake()
        except ssl.SSLWantReadError:
            return False
        except ssl.SSLWantWriteError:  # rare on a fresh socket: try again when data comes
            return False
        except (ssl.SSLError, OSError) as exc:
            self._drop(c)
            self.throttle(
                logging.WARNING,
                "tls",
                "HTTP TLS handshake failed",
                peer=c.peer,
                error=getattr(exc, "reason", None) or str(exc),
            )
            return False
        c.phase = "header"
        return True

    def _advance(self, c: Conn) -> bool:
        """Look at what has arrived; True when the connection left the loop (dispatched to a
        worker or refused)."""
        if c.phase == "header":
            end = HEAD_END.search(c.buf)
            if end is None:
                if len(c.buf) > MAX_HEADER_BYTES:
                    self._reply_and_drop(
                        c,
                        431,
                        "Request Header Fields Too Large",
                        "HTTP request refused: its head is too large",
                        max_bytes=MAX_HEADER_BYTES,
                    )
                    return True
                return False
            head = bytes(c.buf[: end.end()])
            length = CONTENT_LENGTH.search(head)
            if CHUNKED.search(head):
                self._reply_and_drop(
                    c,
                    411,
                    "Length Required",
                    "HTTP request refused: a chunked body is not accepted",
                )
                return True
            try:
                body = int(length.group(1)) if length else 0
                if body < 0:
                    raise ValueError(body)
            except ValueError:
                self._reply_and_drop(
                    c, 400, "Bad Request", "HTTP request refused: a bad Content-Length"
                )
                return True
            if body > MAX_BODY_BYTES:
                self._reply_and_drop(
                    c,
                    413,
                    "Content Too Large",
                    "HTTP request refused: its body is too large",
                    content_length=body,
                    max_bytes=MAX_BODY_BYTES,
                )
                return True
            c.head, c.body = end.end(), body
            c.phase = "body"
            c.deadline = time.monotonic() + self.limits.body_timeout
        if len(c.buf) < c.head + c.body:
            return False
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(c.sock)
        c.phase = "response"
        with self._lock:
            self._pending.pop(id(c), None)
            self._answering.add(c)
        self._jobs.put(c)
        return True

    # -- the workers --------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            c = self._jobs.get()
            if c is None or self._closing.is_set():
                if c is not None:
                    self._finish(c)
                return
            try:
                self._answer(c)
            finally:
                self._finish(c)

    def _finish(self, c: Conn) -> None:
        with self._lock:
            self._answering.discard(c)
        self._close(c)

    def _answer(self, c: Conn) -> None:
        deadline = time.monotonic() + self.limits.response_timeout
        try:
            c.sock.setblocking(True)
            request: Any = (bytes(c.buf), DeadlineWriter(c.sock, deadline))
            self._handler(request, c.peer, cast(Any, self))
        except ResponseTimeout:
            self.throttle(
                logging.WARNING,
                "response-timeout",
                "HTTP response timed out: the client did not read it",
                peer=c.peer,
                timeout_seconds=self.limits.response_timeout,
            )
        except (OSError, ssl.SSLError) as exc:
            self.throttle(
                logging.WARNING,
                "broken-response",
                "HTTP client went away before the response was sent",
                peer=c.peer,
                error=str(exc),
            )
        except Exception as exc:  # a bug in a handler: logged, once, as JSON
            self.throttle(
                logging.ERROR,
                "handler",
                "HTTP request failed",
                exc_info=exc,
                peer=c.peer,
            )

    def _route(self, path: str) -> tuple[int, str, bytes]:
        return route(path, self.readiness, self.liveness, self.metrics)
