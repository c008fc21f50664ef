import contextlib
import json
import logging
import resource
import socket
import ssl
import struct
import threading
import time
import urllib.error
import urllib.request

import pytest

from agent.http import HttpEndpoint, HttpLimits, Readiness, raise_descriptor_limit
from agent.tls import TlsFiles
from tests.tlscerts import make_pki


@pytest.fixture
def endpoint():
    readiness = Readiness()
    ep = HttpEndpoint("127.0.0.1", 0, readiness)
    ep.start()
    yield ep
    ep.stop()


def get(ep, path):
    host, port = ep.address
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_healthz_is_ok(endpoint):
    assert get(endpoint, "/healthz") == (200, b"ok\n")


def test_readyz_is_503_until_every_check_passes(endpoint):
    status, body = get(endpoint, "/readyz")
    assert status == 503  # no checks registered yet: not ready
    state = {"ok": False}
    endpoint.readiness.add("inventory", lambda: (True, "node discovered"))
    endpoint.readiness.add("kubelet", lambda: (state["ok"], "registered" if state["ok"] else "no"))
    status, body = get(endpoint, "/readyz")
    assert status == 503
    assert json.loads(body)["checks"]["kubelet"] == "no"
    state["ok"] = True
    status, body = get(endpoint, "/readyz")
    assert status == 200 and json.loads(body)["ready"] is True


def test_unknown_path_is_404(endpoint):
    assert get(endpoint, "/nope")[0] == 404


# -- holding against clients that never finish (docs/reliability.md, "The network endpoints") --


class Records(logging.Handler):
    """The endpoint's log records, for the tests to wait on."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def fields(self, msg_start: str) -> list[dict]:
        return [
            {**getattr(r, "fields", {}), "level": r.levelname, "exc": r.exc_info}
            for r in list(self.records)
            if r.getMessage().startswith(msg_start)
        ]

    def wait(self, msg_start: str, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.fields(msg_start)
            if found:
                return found[0]
            time.sleep(0.01)
        raise AssertionError(f"no log record {msg_start!r}: {[r.msg for r in self.records]}")


@contextlib.contextmanager
def serving(**kwargs):
    records = Records()
    log = logging.getLogger(f"test.http.{id(records)}")
    log.addHandler(records)
    log.propagate = False
    log.setLevel(logging.DEBUG)
    limits = HttpLimits(**kwargs.pop("limits", {}))
    ep = HttpEndpoint("127.0.0.1", 0, Readiness(), limits=limits, log=log, **kwargs)
    ep.start()
    try:
        yield ep, records
    finally:
        ep.stop()


def connect(ep, timeout: float = 30) -> socket.socket:
    return socket.create_connection(ep.address, timeout=timeout)


def read_all(s: socket.socket) -> bytes:
    """Everything until the server closes (a reset counts as closed)."""
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def reset(s: socket.socket) -> None:
    """Close with a TCP reset, as a client that gives up abruptly does."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def wait_until(predicate, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_a_client_that_sends_half_a_header_is_answered_408_and_closed():
    with serving(limits={"header_timeout": 0.3}) as (ep, records), connect(ep) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        answer = read_all(s)  # the server closes it: no wait beyond the guard
        assert answer.startswith(b"HTTP/1.0 408 ")
        rec = records.wait("HTTP request timed out")
        assert rec["phase"] == "header" and rec["status"] == 408 and rec["timeout_seconds"] == 0.3


def test_a_client_that_sends_half_a_body_is_answered_408_and_closed():
    with serving(limits={"body_timeout": 0.3}) as (ep, records), connect(ep) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")
        assert read_all(s).startswith(b"HTTP/1.0 408 ")
        assert records.wait("HTTP request timed out")["phase"] == "body"


def test_half_open_connections_take_no_thread_and_healthz_still_answers():
    with serving(limits={"max_connections": 16}) as (ep, records):
        get(ep, "/healthz")
        before = set(threading.enumerate())  # other tests' threads may end meanwhile
        idle = [connect(ep) for _ in range(100)]  # six times the cap, none sends a byte
        idle[-1].sendall(b"GET /heal")  # and some send half a request
        try:
            assert get(ep, "/healthz") == (200, b"ok\n")
            assert set(threading.enumerate()) - before == set()  # no thread per connection
            assert ep._open_connections() <= 16
            rec = records.wait("HTTP connection closed to make room")
            assert rec["limit"] == "connections" and rec["max_connections"] == 16
        finally:
            for s in idle:
                s.close()


def test_at_the_cap_the_oldest_unfinished_connection_makes_room():
    with serving(limits={"max_connections": 2}) as (ep, _records):
        first, second = connect(ep), connect(ep)
        wait_until(lambda: ep._open_connections() == 2)
        with connect(ep) as third:
            third.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            assert read_all(third).endswith(b"\r\n\r\nok\n")
        assert read_all(first) == b""  # closed to make room: it was the oldest
        second.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        assert read_all(second).endswith(b"\r\n\r\nok\n")
        first.close()
        second.close()


def test_when_every_connection_is_being_answered_a_new_one_is_refused():
    inside, release = threading.Semaphore(0), threading.Event()

    def slow_metrics() -> tuple[bytes, str]:
        inside.release()
        release.wait(30)
        return b"m 1\n", "text/plain"

    with serving(metrics=slow_metrics, limits={"max_connections": 2, "threads": 2}) as (
        ep,
        records,
    ):
        busy = [connect(ep) for _ in range(2)]
        for s in busy:
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        for _ in busy:
            assert inside.acquire(timeout=30)
        with connect(ep) as refused:
            refused.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            assert read_all(refused) == b""
        rec = records.wait("HTTP connection refused")
        assert rec["limit"] == "connections"
        release.set()
        for s in busy:
            assert read_all(s).endswith(b"m 1\n")
            s.close()


def test_the_descriptor_reserve_refuses_a_connection_when_too_few_are_left():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    with serving(limits={"fd_reserve": soft}) as (ep, records), connect(ep) as s:
        s.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        assert read_all(s) == b""
        rec = records.wait("HTTP connection refused: too few file descriptors")
        assert rec["limit"] == "descriptors" and rec["fd_reserve"] == soft


def test_an_abandoned_request_is_one_warning_and_a_flood_of_them_is_rate_limited():
    with serving() as (ep, records):
        for _ in range(20):
            s = connect(ep)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 10.0.0.1\r\nAcc")
            reset(s)
        rec = records.wait("HTTP client went away before finishing its request")
        assert rec["level"] == "WARNING" and rec["exc"] is None
        assert get(ep, "/healthz")[0] == 200  # every reset has been handled by now
        assert len(records.fields("HTTP client went away")) == 1  # the rest are counted, later


def test_a_client_that_goes_away_during_the_response_is_one_warning():
    body = b"x" * (32 * 1024 * 1024)  # more than any socket buffer holds
    with serving(metrics=lambda: (body, "text/plain")) as (ep, records):
        s = connect(ep)
        s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        assert s.recv(16).startswith(b"HTTP/1.0 200")
        reset(s)
        rec = records.wait("HTTP client went away before the response was sent")
        assert rec["exc"] is None
        assert get(ep, "/healthz")[0] == 200


def test_a_client_that_does_not_read_the_response_is_timed_out():
    body = b"x" * (32 * 1024 * 1024)
    with serving(metrics=lambda: (body, "text/plain"), limits={"response_timeout": 0.5}) as (
        ep,
        records,
    ):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(30)
        s.connect(ep.address)
        s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        rec = records.wait("HTTP response timed out")
        assert rec["timeout_seconds"] == 0.5
        s.close()
        assert get(ep, "/healthz")[0] == 200


def test_a_failing_handler_is_a_500_and_one_json_record_not_a_traceback(capsys):
    def broken() -> tuple[bytes, str]:
        raise RuntimeError("collector exploded")

    with serving(metrics=broken) as (ep, records):
        assert get(ep, "/metrics") == (500, b"internal error\n")
        rec = records.wait("HTTP request failed")
        assert rec["level"] == "ERROR" and rec["exc"][0] is RuntimeError
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"BREW /pot HTCPCP/1.0\r\n\r\n", b"400"),
        (b"POST /metrics HTTP/1.0\r\n\r\n", b"501"),
        (b"GET / HTTP/1.1\r\nX: " + b"a" * 20000, b"431"),
        (b"GET / HTTP/1.1\r\nContent-Length: 999999999\r\n\r\n", b"413"),
        (b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", b"411"),
        (b"GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", b"400"),
        (b"GET /healthz HTTP/2.0\r\n\r\n", b"505"),
        (b"GET /healthz HTTP/1.1x\r\n\r\n", b"400"),
        (b"POST /healthz\r\n\r\n", b"400"),  # HTTP/0.9 knows only GET
        (b"GET /healthz HTTP/0.9\r\n" + b"X: y\r\n" * 150 + b"\r\n", b"431"),
    ],
)
def test_bad_requests_get_an_error_status_and_one_warning(request_bytes, status):
    """Every refusal has a status line, also for a line whose version is not one (the stdlib
    would answer those as HTTP/0.9: a bare HTML body)."""
    with serving() as (ep, records), connect(ep) as s:
        s.sendall(request_bytes)
        answer = read_all(s)
        assert answer.startswith(b"HTTP/1.0 " + status), answer[:100]
        records.wait("HTTP request refused")


@pytest.mark.parametrize("line", [b"GET /healthz", b"GET /healthz HTTP/0.9"])
def test_an_http_0_9_request_is_answered_with_a_status_line(line):
    with serving() as (ep, _), connect(ep) as s:
        s.sendall(line + b"\r\n\r\n")
        answer = read_all(s)
        assert answer.startswith(b"HTTP/1.0 200 ") and answer.endswith(b"\r\n\r\nok\n")


def test_raise_descriptor_limit_raises_the_soft_limit_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        lower = min(soft, 512)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lower, hard))
        assert raise_descriptor_limit() == ((lower, hard) if lower != hard else None)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
        assert raise_descriptor_limit() is None
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# -- TLS -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def https_get(ep, path, context):
    _host, port = ep.address
    with urllib.request.urlopen(
        f"https://localhost:{port}{path}", timeout=10, context=context
    ) as r:
        return r.status, r.read()


def client_context(pki, cert=None, key=None):
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if cert is not None:
        ctx.load_cert_chain(cert, key)
    return ctx


def test_tls_serves_https_and_refuses_plain_http(pki):
    tls = TlsFiles(pki.server_cert, pki.server_key, option="--metrics-tls")
    with serving(tls=tls) as (ep, records):
        assert ep.scheme == "https"
        assert https_get(ep, "/healthz", client_context(pki)) == (200, b"ok\n")
        with connect(ep) as s:
            s.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            assert b"ok" not in read_all(s)
        assert records.wait("HTTP TLS handshake failed")["peer"].startswith("127.0.0.1:")


def test_with_a_client_ca_a_client_needs_a_certificate_it_signed(pki):
    tls = TlsFiles(pki.server_cert, pki.server_key, pki.ca, option="--metrics-tls")
    with serving(tls=tls) as (ep, records):
        ok = client_context(pki, pki.client_cert, pki.client_key)
        assert https_get(ep, "/metrics" if ep.metrics else "/healthz", ok)[0] == 200
        stranger = client_context(pki, pki.other_client_cert, pki.other_client_key)
        for ctx in (client_context(pki), stranger):
            with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
                https_get(ep, "/healthz", ctx)
        records.wait("HTTP TLS handshake failed")
        assert https_get(ep, "/healthz", ok) == (200, b"ok\n")  # still serving
