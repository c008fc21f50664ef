"""The network endpoints hold against abusive clients, through the real daemon (`tessera run
--simulate ... --no-kube`): half-open and slow HTTP clients, a low open-file limit, idle and slow
telemetry watchers, health-watch streams on the DRA socket, and TLS on the metrics endpoint and
the telemetry TCP listener. docs/reliability.md ("The network endpoints") lists each case."""

from __future__ import annotations

import contextlib
import io
import json
import resource
import socket
import ssl
import struct
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from agent.cli import main
from agent.telemetry.api import telemetry_pb2 as pb
from agent.telemetry.api import telemetry_pb2_grpc as pb_grpc
from dra_driver.kubeletapi import health_v1alpha1_pb2, health_v1alpha1_pb2_grpc
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.integration.daemon import Daemon, claim_manifest, write_claims
from tests.integration.test_daemon import wait_ready
from tests.tlscerts import Pki, make_pki

NOFILE = 300


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(autouse=True)
def enough_descriptors_here():
    """This test process holds hundreds of sockets at once."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def http_address(d: Daemon) -> tuple[str, int]:
    url = d.metrics_url("")  # http://host:port
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    return host, int(port)


def healthz(d: Daemon) -> tuple[int, bytes]:
    with urllib.request.urlopen(d.metrics_url("/healthz"), timeout=10) as r:
        return r.status, r.read()


def read_all(s: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def records(d: Daemon, msg_start: str) -> list[dict]:
    return [r for r in list(d.logs) if str(r.get("msg", "")).startswith(msg_start)]


def all_json(d: Daemon) -> list[dict]:
    """Every stderr line of the daemon, each one JSON object (fails on any other line)."""
    assert d.raw, "the daemon wrote nothing"
    parsed = [json.loads(line) for line in d.raw]
    assert all(isinstance(r, dict) for r in parsed)
    return parsed


def prepare_and_unprepare(d: Daemon, name: str, uid: str, device: str) -> None:
    write_claims(d.state, claim_manifest(name, uid, [("gpu", device)], d.node))
    with KubeletClient(d.dra_socket, timeout=30) as k:
        prepared = k.prepare([ClaimRef("default", name, uid)])["claims"][uid]
        assert prepared["error"] == "" and prepared["devices"], prepared
        assert k.unprepare([ClaimRef("default", name, uid)])["claims"][uid]["error"] == ""


# -- HTTP ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [(), ("--http-max-connections", "1000")],
    ids=["connection-cap", "descriptor-reserve"],
)
def test_half_open_http_connections_with_300_descriptors_leave_the_kubelet_socket_serving(
    short_tmp, extra
):
    """400 connections that send nothing or half a header, to an agent limited to 300 open
    files: the kubelet still prepares and unprepares over the DRA socket, /healthz answers, and
    the agent's threads do not grow. With the connection cap raised out of the way, the
    descriptor reserve is what holds."""
    d = Daemon(short_tmp, "l40s-pcie", *extra, nofile=NOFILE).start()
    held: list[socket.socket] = []
    try:
        wait_ready(d.metrics_url("/readyz"))
        prepare_and_unprepare(d, "warm", "uid-warm", "gpu-0")  # lazily started pools run now
        threads = d.status("Threads")
        address = http_address(d)
        for i in range(400):
            s = socket.create_connection(address, timeout=30)
            if i % 4 == 0:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: node\r\nAcc")
            held.append(s)
        assert healthz(d) == (200, b"ok\n")
        prepare_and_unprepare(d, "train", "uid-train", "gpu-1")
        assert healthz(d) == (200, b"ok\n")
        assert d.status("Threads") <= threads + 2  # one more call could start a pool thread
        assert d.descriptors() < NOFILE - 32
        made_room = records(d, "HTTP connection closed to make room")
        assert made_room, "the oldest unfinished connections were never closed"
        limit = "descriptors" if extra else "connections"
        assert {r["limit"] for r in made_room} == {limit}
    finally:
        for s in held:
            s.close()
        d.stop()
    assert not any("Traceback" in line for line in d.raw)
    all_json(d)


def test_a_slow_http_client_is_timed_out(short_tmp):
    d = Daemon(short_tmp, "l40s-pcie", "--http-header-timeout", "1").start()
    try:
        with socket.create_connection(http_address(d), timeout=60) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: node\r\n")  # and never the blank line
            assert read_all(s).startswith(b"HTTP/1.0 408 Request Timeout\r\n")
        late = d.wait_log("HTTP request timed out: the client was too slow sending it")
        assert late["phase"] == "header" and late["timeout_seconds"] == 1.0
        assert healthz(d)[0] == 200
    finally:
        d.stop()


def test_an_abandoned_request_leaves_one_json_line_and_no_traceback(short_tmp):
    d = Daemon(short_tmp, "l40s-pcie").start()
    try:
        s = socket.create_connection(http_address(d), timeout=30)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: node\r\nAccept: text/pl")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # a reset: the client gave up
        gone = d.wait_log("HTTP client went away before finishing its request")
        assert gone["level"] == "warning" and gone["logger"] == "tessera.http"
        assert gone["received_bytes"] > 0
        assert healthz(d)[0] == 200
    finally:
        assert d.stop() == 0
    parsed = all_json(d)
    assert len([r for r in parsed if r["msg"].startswith("HTTP client went away")]) == 1
    assert not any("Traceback" in line for line in d.raw)


# -- the DRA socket ------------------------------------------------------------------------------


def test_health_watch_streams_cannot_starve_prepare_and_unprepare(short_tmp):
    """20 clients each hold a health-watch stream open on the DRA socket: 4 are served, the rest
    refused with RESOURCE_EXHAUSTED, and the kubelet's prepare and unprepare still answer."""
    d = Daemon(short_tmp, "l40s-pcie").start()
    channels, calls = [], []
    try:
        for _ in range(20):
            ch = grpc.insecure_channel(
                f"unix://{d.dra_socket}", options=[("grpc.use_local_subchannel_pool", 1)]
            )
            channels.append(ch)
            stub = health_v1alpha1_pb2_grpc.DRAResourceHealthStub(ch)
            request = health_v1alpha1_pb2.NodeWatchResourcesRequest()
            calls.append(stub.NodeWatchResources(request, timeout=120))  # a guard, not a gap
        served, refused = 0, []
        for call in calls:
            try:
                first = next(call)
                assert first.devices
                served += 1
            except grpc.RpcError as exc:
                refused.append(exc)
        assert served == 4
        assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert "--kubelet-health-streams" in refused[0].details()
        prepare_and_unprepare(d, "train", "uid-train", "gpu-0")
        d.wait_log("health-watch stream refused: too many are open")
    finally:
        for call in calls:
            call.cancel()
        for ch in channels:
            ch.close()
        d.stop()


# -- telemetry -----------------------------------------------------------------------------------


def telemetry_channel(target: str, **options: object) -> grpc.Channel:
    """A channel with a connection of its own, like a separate client process."""
    opts = [("grpc.use_local_subchannel_pool", 1), *options.items()]
    return grpc.insecure_channel(target, options=opts)


@contextlib.contextmanager
def watchers(target: str, n: int) -> Iterator[list]:
    """``n`` idle watchers, each on its own connection; yields each one's first answer (a
    sample or the RpcError)."""
    channels = [telemetry_channel(target) for _ in range(n)]
    request = pb.WatchRequest(interval_seconds=3600)
    calls = [pb_grpc.TelemetryStub(ch).Watch(request, timeout=120) for ch in channels]  # a guard
    firsts: list = []
    try:
        for call in calls:
            try:
                firsts.append(next(call))
            except grpc.RpcError as exc:
                firsts.append(exc)
        yield firsts
    finally:
        for call in calls:
            call.cancel()
        for ch in channels:
            ch.close()


def test_70_idle_watchers_leave_snapshot_and_top_working_on_the_unix_socket(short_tmp):
    d = Daemon(short_tmp, "dgx-h100").start()
    target = f"unix://{short_tmp / 'telemetry.sock'}"
    try:
        with watchers(target, 70) as firsts:
            samples = [f for f in firsts if not isinstance(f, grpc.RpcError)]
            refused = [f for f in firsts if isinstance(f, grpc.RpcError)]
            assert len(samples) == 32 and all(s.gpus for s in samples)
            assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            # the service's refusal names the flag; a burst of calls beyond the server's queue
            # can also meet gRPC's own limit first ("Concurrent RPC limit exceeded!")
            assert any("--telemetry-max-watchers" in e.details() for e in refused)
            with telemetry_channel(target) as ch:
                snap = pb_grpc.TelemetryStub(ch).Snapshot(pb.SnapshotRequest(), timeout=30)
            assert len(snap.gpus) == 8
            out, err = io.StringIO(), io.StringIO()
            code = main(["top", "--state-dir", str(short_tmp), "--once"], {}, out, err)
            assert code == 0, err.getvalue()
            assert "dgx-h100" in out.getvalue()
        d.wait_log("telemetry watcher refused: too many watchers on this listener")
    finally:
        d.stop()
    assert (short_tmp / "telemetry.sock").exists() is False


def test_a_watcher_that_stops_reading_is_dropped(short_tmp):
    d = Daemon(
        short_tmp, "dgx-h100", "--telemetry-interval", "0.1", "--telemetry-send-timeout", "1"
    ).start()
    target = f"unix://{short_tmp / 'telemetry.sock'}"
    try:
        # no BDP probing: the stream's flow-control window stays small, so a reader that stops
        # fills it after a few dozen samples
        with telemetry_channel(target, **{"grpc.http2.bdp_probe": 0}) as ch:
            call = pb_grpc.TelemetryStub(ch).Watch(pb.WatchRequest())
            dropped = d.wait_log(
                "dropped a slow telemetry watcher: it took no sample in time", timeout=120
            )
            assert dropped["listener"] == "unix" and dropped["send_timeout_seconds"] == 1.0
            with pytest.raises(grpc.RpcError) as ended:
                for _ in call:  # what was buffered, then the end
                    pass
            assert ended.value.code() == grpc.StatusCode.CANCELLED
        with watchers(target, 1) as (first,):  # the place it held is free again
            assert not isinstance(first, grpc.RpcError)
    finally:
        d.stop()


def top(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["top", "--once", *args], {}, out, err)
    return code, out.getvalue(), err.getvalue()


def test_telemetry_over_tls_with_client_certificates(short_tmp, pki):
    d = Daemon(
        short_tmp, "l40s-pcie",
        "--telemetry-address", "127.0.0.1:0",
        "--telemetry-tls-cert", str(pki.server_cert),
        "--telemetry-tls-key", str(pki.server_key),
        "--telemetry-tls-client-ca", str(pki.ca),
    ).start()  # fmt: skip
    try:
        serving = d.wait_log("telemetry API serving")
        assert serving["tls"] is True and serving["client_certificates"] is True
        endpoint = f"127.0.0.1:{serving['tcp_port']}"
        ca = ("--tls-ca", str(pki.ca))
        mine = ("--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key))
        code, out, err = top("--endpoint", endpoint, *ca, *mine)
        assert code == 0, err
        assert "l40s-pcie" in out
        code, _, err = top("--endpoint", endpoint, *ca)  # no certificate
        assert code == 2 and err.startswith("tessera: error: no Tessera agent answers at"), err
        stranger = (
            "--tls-cert",
            str(pki.other_client_cert),
            "--tls-key",
            str(pki.other_client_key),
        )
        code, _, err = top("--endpoint", endpoint, *ca, *stranger)
        assert code == 2, err  # a certificate the agent's CA did not sign
        code, _, err = top("--endpoint", endpoint)  # plain gRPC to a TLS port
        assert code == 2, err
        assert top("--state-dir", str(short_tmp))[0] == 0  # the unix socket needs none
    finally:
        d.stop()


def test_metrics_over_tls_with_and_without_client_certificates(short_tmp, pki):
    d = Daemon(
        short_tmp, "l40s-pcie",
        "--metrics-tls-cert", str(pki.server_cert),
        "--metrics-tls-key", str(pki.server_key),
        "--metrics-tls-client-ca", str(pki.ca),
    ).start()  # fmt: skip
    try:
        url = d.wait_log("HTTP endpoint serving")["url"].replace("127.0.0.1", "localhost")
        assert url.startswith("https://")
        ok = ssl.create_default_context(cafile=str(pki.ca))
        ok.load_cert_chain(pki.client_cert, pki.client_key)
        with urllib.request.urlopen(f"{url}/metrics", timeout=10, context=ok) as r:
            assert r.status == 200 and b"tessera_gpu_power_watts" in r.read()
        bare = ssl.create_default_context(cafile=str(pki.ca))
        with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
            urllib.request.urlopen(f"{url}/healthz", timeout=10, context=bare)
        d.wait_log("HTTP TLS handshake failed")
    finally:
        d.stop()
    all_json(d)


def test_metrics_over_tls_without_client_certificates(short_tmp, pki):
    d = Daemon(
        short_tmp, "l40s-pcie",
        "--metrics-tls-cert", str(pki.server_cert), "--metrics-tls-key", str(pki.server_key),
    ).start()  # fmt: skip
    try:
        url = d.wait_log("HTTP endpoint serving")["url"].replace("127.0.0.1", "localhost")
        ctx = ssl.create_default_context(cafile=str(pki.ca))
        try:  # the TLS handshake is the point: ready or not yet (503 on a loaded machine)
            with urllib.request.urlopen(f"{url}/readyz", timeout=10, context=ctx) as r:
                status = r.status
        except urllib.error.HTTPError as exc:  # urlopen raises for a 503
            status = exc.code
        assert status in (200, 503)
    finally:
        d.stop()


@pytest.mark.parametrize("from_env", [False, True], ids=["flag", "variable"])
def test_a_bad_tls_file_is_one_line_naming_it(short_tmp, pki, from_env):
    missing = short_tmp / "missing.pem"
    if from_env:
        d = Daemon(short_tmp, "l40s-pcie", "--metrics-tls-key", str(pki.server_key))
        env_cert = {"TESSERA_METRICS_TLS_CERT": str(missing)}
    else:
        d = Daemon(short_tmp, "l40s-pcie", "--metrics-tls-cert", str(missing),
                   "--metrics-tls-key", str(pki.server_key))  # fmt: skip
        env_cert = {}
    d.start(wait=False, env=env_cert)
    assert d.wait_exit(60) == 2
    (failed,) = [r for r in all_json(d) if r["level"] == "error"]
    label = "TESSERA_METRICS_TLS_CERT" if from_env else "--metrics-tls-cert"
    assert failed["msg"] == "agent cannot run"
    assert failed["error"] == f"{label}: cannot read {missing}: No such file or directory"
