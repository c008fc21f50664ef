"""Bad input at the metrics endpoint: raw HTTP requests to one daemon's ``/metrics`` server
(docs/reliability.md, "Untrusted input at every door"; the checks every case ends with:
tests/reliability/doors.py).

Generated requests: methods, paths (traversals, NUL, 20,000 characters), versions, headers
(hostile names and values, oversized, too many, bad and huge Content-Length, chunked bodies),
bodies, and bytes that are no request at all, sent at once, in pieces, or followed by a reset.
Each is answered with a status line of an expected code, or closed, within the endpoint's
timeouts. Then slow clients (a head sent byte by byte past the
header timeout: 408), and hundreds of connections at once (idle, half a head, whole requests)
while ``/healthz`` and ``/metrics`` must still answer. The daemon runs with a header and body
timeout of 1 s so that slow cases are quick.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.integration.test_network import (  # noqa: F401 (a fixture, used by name)
    enough_descriptors_here,
    http_address,
)
from tests.reliability.doors import (
    ESCAPE,
    DaemonDoor,
    close_door,
    end,
    fast,
    hostile_text,
    long,
    open_door,
)

# a failing case of huge generated values is still worth reporting in full
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

TIMEOUT = 1.0
"""The daemon's --http-header-timeout and --http-body-timeout, in seconds."""
STATUSES = {200, 400, 404, 408, 411, 413, 414, 431, 501, 503, 505}
"""What the endpoint may answer to anything (405 never: unknown methods are 501)."""


@pytest.fixture(scope="module")
def door() -> Iterator[DaemonDoor]:
    d = open_door(
        "http",
        "--http-header-timeout", str(TIMEOUT),
        "--http-body-timeout", str(TIMEOUT),
        "--http-response-timeout", "3",
        itemize=("slow", "concurrent"),
    )  # fmt: skip
    try:
        yield d
    finally:
        close_door(d)


def address(door: DaemonDoor) -> tuple[str, int]:
    return http_address(door.daemon)


# -- generated requests ------------------------------------------------------------------------

methods = st.one_of(
    st.sampled_from(["GET", "GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "TRACE",
                     "CONNECT", "PATCH", "get", "G\x00ET", "", "GET GET"]),
    st.text(max_size=10),
)  # fmt: skip
paths = st.one_of(
    st.sampled_from(["/healthz", "/readyz", "/metrics", "/", "/metrics?x=1&y", "/healthz#f",
                     "//healthz", "/../../etc/passwd", f"/../../{ESCAPE}", f"/%2e%2e/{ESCAPE}",
                     "*", "http://127.0.0.1/healthz", "/\x00", "/" + "a" * 20_000,
                     "/metrics?" + "x=1&" * 3000]),
    hostile_text.map(lambda t: "/" + t),
)  # fmt: skip
versions = st.sampled_from(
    ["HTTP/1.0", "HTTP/1.1", "HTTP/1.1", "HTTP/2.0", "HTTP/0.9", "HTTP/1.1x", "HTTP/9.9", "",
     "http/1.1", "HTTP/1.1\x00", "HTTP/"]
)  # fmt: skip
header_names = st.one_of(
    st.sampled_from(["Host", "Accept", "User-Agent", "Content-Type", "X-A", "Expect",
                     "Connection", "Accept-Encoding", ""]),
    hostile_text,
)  # fmt: skip
header_values = st.one_of(
    st.sampled_from(["x", "", "100-continue", "gzip", "close", "keep-alive", "a" * 17_000]),
    hostile_text,
)
body_headers = st.sampled_from(
    [[], [], [("Content-Length", "0")], [("Content-Length", "5")], [("Content-Length", "-1")],
     [("Content-Length", "abc")], [("Content-Length", str(10**30))],
     [("Content-Length", "70000")], [("Content-Length", "1, 2")],
     [("Content-Length", "3"), ("Content-Length", "4")], [("Transfer-Encoding", "chunked")],
     [("Transfer-Encoding", "gzip, chunked")], [("Content-Length", " 2 ")]]
)  # fmt: skip


@st.composite
def requests(draw: st.DrawFn) -> tuple[bytes, bool]:
    """(bytes, complete): a request of every part generated, or bytes that are none."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.binary(max_size=400)), False
    eol = draw(st.sampled_from(["\r\n", "\r\n", "\n", "\r"]))
    line = " ".join(p for p in (draw(methods), draw(paths), draw(versions)) if p)
    headers = draw(st.lists(st.tuples(header_names, header_values), max_size=4))
    if draw(st.integers(0, 19)) == 0:
        headers += [(f"X-{i}", "y") for i in range(150)]  # more than the stdlib's 100
    framing = draw(body_headers)
    headers += framing
    head = line + eol + "".join(f"{n}: {v}{eol}" for n, v in headers) + eol
    body = draw(st.binary(max_size=100))
    declared = [int(v) for n, v in framing if n == "Content-Length" and v.strip().isdigit()]
    # a body shorter than declared waits for the body timeout: the slow clients' test's part
    whole = not declared or len(body) >= max(declared) or max(declared) > 64 * 1024
    return head.encode("utf-8", "surrogateescape") + body, eol != "\r" and line != "" and whole


def exchange(door: DaemonDoor, data: bytes, how: str) -> bytes:
    """Send ``data`` as ``how`` says; everything the endpoint answers until it closes."""
    with socket.create_connection(address(door), timeout=TIMEOUT + 5) as s:
        step = max(1, len(data) // 4) if how == "pieces" else max(1, len(data))
        with contextlib.suppress(OSError):  # the server may answer and close before the end
            for i in range(0, len(data), step):
                s.sendall(data[i : i + step])
                if how == "pieces":
                    time.sleep(0.005)
        if how == "reset":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return b""
        if how == "half-close":
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_WR)
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                answer += chunk
        return answer


def check_answer(answer: bytes) -> None:
    """Nothing (closed: a reset, a head cut short, bytes that are none), or a whole head with
    a status line of an expected code."""
    if not answer:
        return
    status_line = answer.split(b"\r\n", 1)[0]
    version, code = [*status_line.split(b" ", 2), b"", b""][:2]
    assert version == b"HTTP/1.0" and code.isdigit() and int(code) in STATUSES, status_line
    assert b"\r\n\r\n" in answer, answer[:200]


def raw_case(door: DaemonDoor) -> Any:
    @given(requests(), st.sampled_from(["once", "pieces", "half-close", "reset"]))
    def case(request: tuple[bytes, bool], how: str) -> None:
        data, complete = request
        if not complete and how in ("once", "pieces"):
            how = "half-close"  # else it waits for the header timeout: the slow test's part
        started = time.monotonic()
        answer = exchange(door, data, how)
        assert time.monotonic() - started < TIMEOUT + 4
        check_answer(answer)
        door.count("raw")
        door.check()

    return case


def test_generated_http_requests(door):
    fast(60)(raw_case(door))()
    end(door, record=False)


@pytest.mark.reliability
@pytest.mark.timeout(1800)
def test_generated_http_requests_long(door):
    long(4000)(raw_case(door))()
    end(door, record=True)


# -- slow clients and many at once -------------------------------------------------------------


def healthz(door: DaemonDoor) -> float:
    """Seconds /healthz took to answer 200."""
    started = time.monotonic()
    with urllib.request.urlopen(door.daemon.metrics_url("/healthz"), timeout=10) as r:
        assert r.status == 200 and r.read() == b"ok\n"
    return time.monotonic() - started


def slow_client(door: DaemonDoor, gap: float, out: list[bytes]) -> None:
    """A head sent a byte every ``gap`` seconds, for longer than the header timeout."""
    head = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"s" * 200 + b"\r\n\r\n"
    with socket.create_connection(address(door), timeout=TIMEOUT + 5) as s:
        answer = b""
        try:
            for byte in head:
                s.sendall(bytes([byte]))
                time.sleep(gap)
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    answer += s.recv(65536)
                s.setblocking(True)
                if answer:
                    break
            while chunk := s.recv(65536):
                answer += chunk
        except OSError:
            pass
        out.append(answer)


def slow_clients(door: DaemonDoor, clients: int) -> None:
    """``clients`` slow heads at once: each gets 408 after the header timeout, and /healthz
    answers meanwhile."""
    answers: list[bytes] = []
    threads = [
        threading.Thread(target=slow_client, args=(door, 0.02, answers)) for _ in range(clients)
    ]
    started = time.monotonic()
    for t in threads:
        t.start()
    assert healthz(door) < 2  # the slow ones take no thread
    for t in threads:
        t.join(TIMEOUT + 10)
    assert time.monotonic() - started < TIMEOUT + 5
    assert len(answers) == clients
    for answer in answers:
        assert answer.startswith(b"HTTP/1.0 408 Request Timeout\r\n"), answer[:100]
    for _ in range(clients):
        door.count("slow")
    door.check()


def hundreds(door: DaemonDoor) -> None:
    """300 connections at once, on the endpoint's 64: 100 idle, 100 with half a head, 100 whole
    requests; /healthz and /metrics answer meanwhile, and the daemon's descriptors go back."""
    before = door.daemon.descriptors()
    host, port = address(door)
    held: list[socket.socket] = []
    answers: list[bytes] = []
    lock = threading.Lock()

    def whole() -> None:
        try:
            answer = exchange(door, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", "once")
        except OSError:
            answer = b""
        with lock:
            answers.append(answer)

    try:
        for i in range(200):
            s = socket.create_connection((host, port), timeout=10)
            if i % 2:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # half a head
            held.append(s)
        threads = [threading.Thread(target=whole) for _ in range(100)]
        for t in threads:
            t.start()
        assert healthz(door) < 5
        with urllib.request.urlopen(door.daemon.metrics_url("/metrics"), timeout=10) as r:
            assert r.status == 200 and b"tessera_" in r.read()
        for t in threads:
            t.join(30)
    finally:
        for s in held:
            s.close()
    assert len(answers) == 100
    assert any(a.startswith(b"HTTP/1.0 200 ") for a in answers), "no whole request answered"
    assert all(a == b"" or a.startswith(b"HTTP/1.0 ") for a in answers)  # some made room
    deadline = time.monotonic() + 10
    while door.daemon.descriptors() > before + 5 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert door.daemon.descriptors() <= before + 5
    for _ in range(300):
        door.count("concurrent")
    door.check()


def test_slow_clients_and_hundreds_of_connections(door):
    slow_clients(door, 1)
    slow_clients(door, 20)
    hundreds(door)
    end(door, record=False)


@pytest.mark.reliability
@pytest.mark.timeout(1800)
def test_slow_clients_and_hundreds_of_connections_long(door):
    for _ in range(5):
        slow_clients(door, 50)
        hundreds(door)
    end(door, record=True)
