"""One HTTP connection's pieces: the limits the endpoint gives its clients, the connection's
state from accept to close, the response writer bound to a deadline, and the listening socket."""

from __future__ import annotations

import re
import socket
import time
from dataclasses import dataclass
from typing import Any

from agent.errors import ConfigError

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
HEAD_END = re.compile(rb"\r?\n\r?\n")
CONTENT_LENGTH = re.compile(rb"^content-length:[ \t]*(\S*)[ \t]*\r?$", re.I | re.M)
CHUNKED = re.compile(rb"^transfer-encoding:", re.I | re.M)


@dataclass(frozen=True)
class HttpLimits:
    """How much the endpoint gives its clients (the daemon's ``--http-*`` and ``--fd-reserve``)."""

    max_connections: int = 64
    threads: int = 4
    header_timeout: float = 10.0
    body_timeout: float = 10.0
    response_timeout: float = 10.0
    fd_reserve: int = 64


class Conn:
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


class ResponseTimeout(Exception):
    """The client did not take the response in time (not a TimeoutError: the stdlib handler
    would swallow that as a read timeout)."""


class DeadlineWriter:
    """The handler's ``wfile``: writes to the socket, all of it within one deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise ResponseTimeout
            self.sock.settimeout(left)
            try:
                sent = self.sock.send(view[:65536])
            except TimeoutError:
                raise ResponseTimeout from None
            view = view[sent:]
        return len(data)

    def flush(self) -> None:
        return

    def close(self) -> None:
        return


def peer_name(addr: Any) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = f"[{addr[0]}]" if ":" in str(addr[0]) else str(addr[0])
        return f"{host}:{addr[1]}"
    return str(addr)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
    except OSError as exc:
        raise ConfigError(
            f"--metrics-address: cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from exc
    sock.setblocking(False)
    return sock
