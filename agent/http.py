"""The agent's HTTP endpoint: /healthz, /readyz and /metrics.

Readiness is a set of named checks; /readyz answers 200 only when every check passes and lists
the failing ones otherwise. Nothing on these paths touches NVML or Kubernetes.

The DaemonSet exposes the endpoint on the node's network, so it is built to hold against clients
that connect and never finish (see docs/reliability.md, "The network endpoints"):

- **No thread per connection.** One selector thread (``http``) accepts connections and reads
  each request, head and body, without blocking: a client that connects and sends nothing, or
  half a header, costs one descriptor and no thread. Only a complete request goes to one of a
  fixed pool of ``threads`` workers (``http-worker-<n>``), which answers it and closes the
  connection (HTTP/1.0: one request per connection).
- **Timeouts.** The request head must arrive within ``header_timeout`` of the connection (TLS
  handshake included), its body within ``body_timeout`` after the head; the response must be
  taken within ``response_timeout``. A late client gets ``408`` and is closed.
- **A connection cap and a descriptor reserve.** At most ``max_connections`` connections are
  open at once, and a new one is only kept while more than ``fd_reserve`` descriptors remain
  below the soft ``RLIMIT_NOFILE``, so the kubelet's sockets and the telemetry API can always
  accept. At either limit the oldest connection that has not finished its request is closed to
  make room (a probe sends its request at once and is answered while slow clients hold the rest);
  when every open connection is being answered, the new one is closed at once.
- **Logs.** Every refused, timed-out, malformed or broken request is one JSON record through
  logging (never a traceback on stderr), at most one per kind every ``LOG_INTERVAL`` seconds with
  the number not logged (``agent.logs.Throttle``).
- **TLS** (optional): a certificate and key, and optionally a client CA (clients without a
  certificate it signed are refused at the handshake); see ``agent.tls``.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import queue
import re
import resource
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any, cast

from agent.errors import ConfigError
from agent.logs import Throttle, fields_
from agent.tls import TlsFiles, TlsMaterial, load_server

Check = Callable[[], tuple[bool, str]]
Exposition = Callable[[], tuple[bytes, str]]
"""Renders /metrics: (body, content type)."""

LOG_INTERVAL = 10.0
"""Seconds between two log records of one kind of refused or broken request."""
LISTEN_BACKLOG = 128
"""Connections the kernel queues before we accept them (the stdlib default of 5 makes the sixth
concurrent scraper wait a second for a SYN retry)."""
ACCEPT_BATCH = 64
"""Connections accepted per wake-up before the loop serves the others."""
ACCEPT_PAUSE = 0.5
"""Seconds accepting pauses when the process is out of descriptors and nothing can be closed."""
MAX_HEADER_BYTES = 16 * 1024
MAX_BODY_BYTES = 64 * 1024
REFUSED = {
    "connections": "HTTP connection refused: the connection limit is reached and every open"
    " connection is being answered",
    "descriptors": "HTTP connection refused: too few file descriptors are left (a reserve is kept"
    " for the kubelet's sockets) and every open connection is being answered",
}
_HEAD_END = re.compile(rb"\r?\n\r?\n")
_CONTENT_LENGTH = re.compile(rb"^content-length:[ \t]*(\S*)[ \t]*\r?$", re.I | re.M)
_CHUNKED = re.compile(rb"^transfer-encoding:", re.I | re.M)


@dataclass(frozen=True)
class HttpLimits:
    """How much the endpoint gives its clients (the daemon's ``--http-*`` and ``--fd-reserve``)."""

    max_connections: int = 64
    threads: int = 4
    header_timeout: float = 10.0
    body_timeout: float = 10.0
    response_timeout: float = 10.0
    fd_reserve: int = 64


class Readiness:
    """Named checks, registered by the components that own them: /readyz's, and /healthz's
    (liveness: what a restart of the agent would repair)."""

    def __init__(self) -> None:
        self._checks: dict[str, Check] = {}
        self._lock = threading.Lock()

    def add(self, name: str, check: Check) -> None:
        with self._lock:
            self._checks[name] = check

    def evaluate(self, empty_ok: bool = False) -> tuple[bool, dict[str, str]]:
        """Whether every check passes (no checks at all passes only when ``empty_ok``), with
        every check's detail; for liveness, only the failing ones' details matter."""
        with self._lock:
            checks = dict(self._checks)
        results = {name: check() for name, check in checks.items()}
        ok = (bool(results) or empty_ok) and all(passed for passed, _ in results.values())
        if empty_ok:  # liveness: say what is wrong, not what is fine
            return ok, {name: detail for name, (passed, detail) in results.items() if not passed}
        return ok, {name: detail for name, (_, detail) in results.items()}


def descriptors_left() -> int | None:
    """Descriptors this process may still open below its soft ``RLIMIT_NOFILE``; None when
    unlimited or unknown (no ``/proc``)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        used = len(os.listdir("/proc/self/fd")) - 1  # less the one listdir itself had open
    except FileNotFoundError:
        return None
    except OSError:  # EMFILE: not even one left for listdir
        return 0
    return soft - used


def raise_descriptor_limit() -> tuple[int, int] | None:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (the agent uses epoll, never
    ``select``, so a high limit costs nothing); ``(old, new)`` when it changed, else None."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        return None
    return soft, hard


class _Conn:
    """One accepted connection, from accept to close."""

    __slots__ = ("body", "buf", "deadline", "head", "opened", "peer", "phase", "sock")

    def __init__(
        self, sock: socket.socket, peer: str, now: float, phase: str, deadline: float
    ) -> None:
        self.sock = sock
        self.peer = peer
        self.opened = now
        self.phase = phase
        """``handshake`` (TLS), ``header``, ``body``, then ``response`` on a worker."""
        self.deadline = deadline
        self.buf = bytearray()
        self.head = 0
        self.body = 0


class _ResponseTimeout(Exception):
    """The client did not take the response in time (not a TimeoutError: the stdlib handler
    would swallow that as a read timeout)."""


class _DeadlineWriter:
    """The handler's ``wfile``: writes to the socket, all of it within one deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise _ResponseTimeout
            self.sock.settimeout(left)
            try:
                sent = self.sock.send(view[:65536])
            except TimeoutError:
                raise _ResponseTimeout from None
            view = view[sent:]
        return len(data)

    def flush(self) -> None:
        return

    def close(self) -> None:
        return


def _peer(addr: Any) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = f"[{addr[0]}]" if ":" in str(addr[0]) else str(addr[0])
        return f"{host}:{addr[1]}"
    return str(addr)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
    except OSError as exc:
        raise ConfigError(
            f"--metrics-address: cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from exc
    sock.setblocking(False)
    return sock


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
        self._listener = _bind(host, port)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._pending: dict[int, _Conn] = {}
        """Connections still sending their request, oldest first (the loop thread's alone)."""
        self._answering: set[_Conn] = set()
        """Connections a worker is answering (guarded by ``_lock``)."""
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Conn | None] = queue.SimpleQueue()
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accept_paused_until = 0.0
        self._handler = self._handler_class()

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
                elif isinstance(key.data, _Conn):
                    self._guarded(key.data)
            self._expire(time.monotonic())

    def _guarded(self, c: _Conn) -> None:
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
            self._admit(sock, _peer(addr))

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
        c = _Conn(sock, peer, now, phase, now + self.limits.header_timeout)
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

    def _drop(self, c: _Conn) -> None:
        """Forget a pending connection and close it."""
        with self._lock:
            self._pending.pop(id(c), None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(c.sock)
        self._close(c)

    @staticmethod
    def _close(c: _Conn) -> None:
        with contextlib.suppress(OSError):
            c.sock.close()

    def _reply_and_drop(self, c: _Conn, code: int, reason: str, msg: str, **fields: Any) -> None:
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

    def _readable(self, c: _Conn) -> None:
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
                self._drop(c)
                self.throttle(
                    logging.WARNING,
                    "broken-request",
                    "HTTP client went away before finishing its request",
                    peer=c.peer,
                    phase=c.phase,
                    received_bytes=len(c.buf),
                    error=str(exc),
                )
                return
            if not data:
                self._drop(c)
                if c.buf:  # nothing sent at all is a TCP probe, not worth a warning
                    self.throttle(
                        logging.WARNING,
                        "broken-request",
                        "HTTP client went away before finishing its request",
                        peer=c.peer,
                        phase=c.phase,
                        received_bytes=len(c.buf),
                    )
                return
            c.buf += data
            if self._advance(c):
                return

    def _handshake(self, c: _Conn) -> bool:
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

    def _advance(self, c: _Conn) -> bool:
        """Look at what has arrived; True when the connection left the loop (dispatched to a
        worker or refused)."""
        if c.phase == "header":
            end = _HEAD_END.search(c.buf)
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
            length = _CONTENT_LENGTH.search(head)
            if _CHUNKED.search(head):
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

    def _finish(self, c: _Conn) -> None:
        with self._lock:
            self._answering.discard(c)
        self._close(c)

    def _answer(self, c: _Conn) -> None:
        deadline = time.monotonic() + self.limits.response_timeout
        try:
            c.sock.setblocking(True)
            request: Any = (bytes(c.buf), _DeadlineWriter(c.sock, deadline))
            self._handler(request, c.peer, cast(Any, self))
        except _ResponseTimeout:
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

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            """Parses and answers one request already read by the loop (``request`` is the
            raw bytes and the response writer)."""

            _version = "HTTP/1.0"

            @property
            def request_version(self) -> str:
                return self._version

            @request_version.setter
            def request_version(self, version: str) -> None:
                # http.server answers an HTTP/0.9 request (a two-word line, "HTTP/0.9", and a
                # line whose version is bad, which it takes for 0.9 until it knows better) with
                # a bare body: no status line a client could read, even for its errors (400,
                # 431, 505). Every answer here has its status line.
                self._version = "HTTP/1.0" if version == "HTTP/0.9" else version

            def setup(self) -> None:
                raw, writer = self.request
                self.rfile = io.BytesIO(raw)
                self.wfile = writer

            def finish(self) -> None:
                return

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                try:
                    code, ctype, body = endpoint._route(path)
                except Exception as exc:
                    endpoint.throttle(
                        logging.ERROR,
                        "handler",
                        "HTTP request failed",
                        exc_info=exc,
                        path=path,
                        peer=str(self.client_address),
                    )
                    code, ctype, body = 500, "text/plain; charset=utf-8", b"internal error\n"
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
                return  # access logs off: scrapes every few seconds would drown the real logs

            def log_error(self, format: str, *args: Any) -> None:
                endpoint.throttle(
                    logging.WARNING,
                    "bad-request",
                    "HTTP request refused",
                    peer=str(self.client_address),
                    reason=format % args,
                )

        return Handler

    def _route(self, path: str) -> tuple[int, str, bytes]:
        if path == "/healthz":
            alive, detail = self.liveness.evaluate(empty_ok=True)
            if alive:
                return 200, "text/plain; charset=utf-8", b"ok\n"
            failing = "".join(f"{name}: {why}\n" for name, why in detail.items())
            return 503, "text/plain; charset=utf-8", failing.encode()
        if path == "/metrics" and self.metrics is not None:
            body, ctype = self.metrics()
            return 200, ctype, body
        if path == "/readyz":
            ok, detail = self.readiness.evaluate()
            body = json.dumps({"ready": ok, "checks": detail}, indent=1).encode() + b"\n"
            return 200 if ok else 503, "application/json", body
        return 404, "text/plain; charset=utf-8", b"not found\n"
