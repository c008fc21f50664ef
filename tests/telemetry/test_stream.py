"""The telemetry gRPC API and `tessera top --once` over a real unix socket."""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest

from agent.errors import ConfigError
from agent.telemetry.api import telemetry_pb2 as pb
from agent.telemetry.api import telemetry_pb2_grpc as pb_grpc
from agent.telemetry.stream import TelemetryLimits, TelemetryServer, to_proto
from agent.telemetry.top import TopError, console, render, run_top
from agent.tls import TlsFiles
from tests.telemetry.snapshots import make_snapshot
from tests.tlscerts import make_pki

LOG = logging.getLogger("test.stream")


class Producer:
    """Stands in for the sampler: a new snapshot every ``period`` seconds. Each snapshot is
    stamped on the sampler's clock as the real sampler does (tick N at N x period), so the
    server's pacing can be checked on the samples' own stamps, not on arrival times."""

    def __init__(self, period: float) -> None:
        self.period = period
        self.server: TelemetryServer | None = None
        self.stop = threading.Event()
        self.ticks = 0
        self._changed = threading.Condition()
        self._next()
        self.thread = threading.Thread(target=self._run)

    def _next(self) -> None:
        self.ticks += 1
        s = make_snapshot(tick=self.ticks)
        self.snap = type(s)(**{**s.__dict__, "monotonic": self.ticks * self.period,
                               "interval_seconds": self.period})  # fmt: skip
        with self._changed:
            self._changed.notify_all()

    def _run(self) -> None:
        while not self.stop.wait(self.period):
            self._next()
            if self.server is not None:
                self.server.notify()

    def wait_tick(self, tick: int, timeout: float = 30) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: self.ticks >= tick, timeout)


@pytest.fixture
def served(short_tmp) -> Iterator[tuple[Producer, str]]:
    prod = Producer(0.02)
    server = TelemetryServer(lambda: prod.snap, short_tmp / "telemetry.sock", LOG)
    prod.server = server
    server.start()
    prod.thread.start()
    try:
        yield prod, f"unix://{short_tmp / 'telemetry.sock'}"
    finally:
        prod.stop.set()
        prod.thread.join()
        server.stop()


def stub(target: str):
    channel = grpc.insecure_channel(target)
    return channel, pb_grpc.TelemetryStub(channel)


def test_snapshot_and_device_filter(served):
    _, target = served
    channel, api = stub(target)
    with channel:
        full = api.Snapshot(pb.SnapshotRequest(), timeout=5)
        assert [g.index for g in full.gpus] == [0, 1, 2]
        assert full.gpus[2].lost and not full.gpus[2].healthy
        assert not full.gpus[2].HasField("utilization_gpu")  # absent, not zero
        assert [h.claim for h in full.gpus[0].holders] == ["job-0"]
        assert [(c.rule, c.HasField("share")) for c in full.claims] == [
            ("exclusive", True),
            ("mig-sm-share", False),  # job-1's share is unknown: absent
        ]
        assert full.claims[0].share == 1.0
        one = api.Snapshot(pb.SnapshotRequest(devices=["GPU-0"]), timeout=5)
        assert [g.uuid for g in one.gpus] == ["GPU-0"]
        assert [c.device for c in one.claims] == ["gpu-0"]
        mig = api.Snapshot(pb.SnapshotRequest(devices=["MIG-1"]), timeout=5)
        assert [g.index for g in mig.gpus] == [1] and [m.uuid for m in mig.gpus[0].mig] == ["MIG-1"]


def test_watch_delivers_samples_at_the_asked_interval(served):
    """Asked for 0.1 s over 0.02 s ticks: consecutive samples are at least 0.1 s (less half a
    tick) apart on the sampler's clock, i.e. at least 5 ticks, never every tick."""
    prod, target = served
    channel, api = stub(target)
    with channel:
        call = api.Watch(pb.WatchRequest(interval_seconds=0.1))
        ticks = []
        for sample in call:
            ticks.append(sample.tick)
            if len(ticks) == 6:
                call.cancel()
                break
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert all(g * prod.period >= 0.1 - prod.period / 2 for g in gaps), gaps


def test_a_slow_watcher_does_not_slow_the_producer(served):
    prod, target = served
    channel, api = stub(target)
    with channel:
        call = api.Watch(pb.WatchRequest(interval_seconds=0))
        first = next(call)
        prod.wait_tick(first.tick + 30)  # the producer goes on while the client reads nothing
        # only what the transport already buffered is stale; then the server sends the latest
        reads, latest = 0, first
        while latest.tick < first.tick + 10 and reads < 20:
            latest, reads = next(call), reads + 1
        assert latest.tick >= first.tick + 10, f"still {latest.tick} after {reads} reads"
        assert reads < 20
        call.cancel()


def test_negative_interval_is_refused(served):
    _, target = served
    channel, api = stub(target)
    with channel, pytest.raises(grpc.RpcError) as e:
        next(api.Watch(pb.WatchRequest(interval_seconds=-1)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(("method", "devices_field"), [("Snapshot", 1), ("Watch", 2)])
def test_a_request_that_does_not_decode_is_invalid_argument_and_one_warning(
    served, caplog, method, devices_field
):
    """Bytes that are not the method's message: INVALID_ARGUMENT naming the message type, one
    rate-limited warning and no traceback (grpc itself would log one at ERROR every time)."""
    _, target = served
    name = f"/{pb.DESCRIPTOR.services_by_name['Telemetry'].full_name}/{method}"
    with grpc.insecure_channel(target) as channel, caplog.at_level(logging.WARNING):
        raw = (channel.unary_unary if method == "Snapshot" else channel.unary_stream)(
            name, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        not_utf8 = bytes([devices_field << 3 | 2, 3, 0xFF, 0xFE, 0xFD])  # devices: ["\xff\xfe\xfd"]
        for garbage in (b"\xff\xff\xff", not_utf8):
            with pytest.raises(grpc.RpcError) as e:
                answer = raw(garbage, timeout=5)
                if method == "Watch":
                    next(answer)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "does not decode" in str(e.value.details())
            assert "Request" in str(e.value.details())  # the message type it is not
        assert api_still_answers(channel)
    refused = [r for r in caplog.records if "does not decode" in r.getMessage()]
    assert len(refused) == 1 and refused[0].levelno == logging.WARNING  # the second: throttled
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def api_still_answers(channel: grpc.Channel) -> bool:
    return len(pb_grpc.TelemetryStub(channel).Snapshot(pb.SnapshotRequest(), timeout=5).gpus) > 0


def test_top_once_renders_a_frame(served):
    _, target = served
    out = io.StringIO()
    assert run_top(target, once=True, interval=1.0, out=out, stop=threading.Event()) == 0
    text = out.getvalue()
    assert "node-a" in text and "NVIDIA H100 80GB HBM3" in text
    assert "team-a/job-0" in text and "LOST" in text and "1g.10gb" in text
    assert "50%" in text and "W" in text


def test_top_without_an_agent_says_so(short_tmp):
    with pytest.raises(
        TopError, match=f"^no Tessera agent answers at unix://{short_tmp}/none.sock;"
    ):
        run_top(f"unix://{short_tmp}/none.sock", True, 1.0, io.StringIO(), threading.Event())


def test_the_api_and_top_name_a_gpu_by_its_minor_number_beside_its_index():
    first = make_snapshot(lost_gpu=False)
    moved = replace(first.gpus[1], sample=replace(first.gpus[1].sample, index=5), minor=6)
    sample = to_proto(replace(first, gpus=(first.gpus[0], moved)))
    assert [(g.index, g.minor) for g in sample.gpus] == [(0, 0), (5, 6)]
    out = io.StringIO()
    console(out, width=140).print(render(sample))
    rows = re.findall(r"^│ (\d+)\s+│ NVIDIA", out.getvalue(), flags=re.MULTILINE)
    assert rows == ["0", "6"]  # as the device names gpu-0 and gpu-6, not NVML's 0 and 5
    # each MIG row names the claim holding that GPU instance (claim 1 holds GI 1), no other
    out = io.StringIO()
    console(out, width=140).print(render(to_proto(first)))
    migs = re.findall(r"└ 1g\.10gb \(GI (\d)\).*│ (\S+)\s+│$", out.getvalue(), re.MULTILINE)
    assert migs == [("1", "team-a/job-1"), ("2", "-")]


def test_render_is_pure_and_handles_an_empty_sample():
    assert render(pb.Sample(node="n")) is not None


def test_also_served_over_tcp_when_asked(short_tmp):
    snap = make_snapshot(tick=7)
    server = TelemetryServer(
        lambda: snap, short_tmp / "telemetry.sock", LOG, tcp_address="127.0.0.1:0"
    )
    server.start()
    try:
        assert server.tcp_port
        out = io.StringIO()
        endpoint = f"127.0.0.1:{server.tcp_port}"
        assert run_top(endpoint, True, 1.0, out, threading.Event()) == 0
        assert "tick 7" in out.getvalue()
    finally:
        server.stop()
    assert not (short_tmp / "telemetry.sock").exists()


# -- holding against clients that never let go (docs/reliability.md, "The network endpoints") --


@contextlib.contextmanager
def limited(short_tmp, limits: TelemetryLimits, **kwargs):
    prod = Producer(0.02)
    server = TelemetryServer(
        lambda: prod.snap, short_tmp / "telemetry.sock", LOG, limits=limits, **kwargs
    )
    prod.server = server
    server.start()
    prod.thread.start()
    try:
        yield server
    finally:
        prod.stop.set()
        prod.thread.join()
        server.stop()


def own_channel(target: str, **options: object) -> grpc.Channel:
    """A channel with its own connection (like another client process)."""
    return grpc.insecure_channel(
        target, options=[("grpc.use_local_subchannel_pool", 1), *options.items()]
    )


def test_the_unix_socket_is_for_its_owner_only(served):
    _, target = served
    mode = os.stat(target.removeprefix("unix://")).st_mode
    assert stat.S_IMODE(mode) == 0o600


def test_watchers_beyond_the_limit_are_refused_and_snapshot_still_answers(short_tmp):
    target = f"unix://{short_tmp / 'telemetry.sock'}"
    with limited(short_tmp, TelemetryLimits(max_watchers=3)) as server:
        channels = [own_channel(target) for _ in range(5)]
        calls = [pb_grpc.TelemetryStub(ch).Watch(pb.WatchRequest(), timeout=60) for ch in channels]
        answers = []
        for call in calls:
            try:
                answers.append(next(call).tick)
            except grpc.RpcError as exc:
                answers.append(exc.code())
        assert answers.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 2
        assert server.watchers() == {"unix": 3}
        with own_channel(target) as ch:
            assert pb_grpc.TelemetryStub(ch).Snapshot(pb.SnapshotRequest(), timeout=30).gpus
        accepted = next(i for i, a in enumerate(answers) if isinstance(a, int))
        calls[accepted].cancel()  # a watcher that leaves frees its place (not a refused one)
        deadline = time.monotonic() + 30
        while server.watchers()["unix"] != 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with own_channel(target) as ch:
            assert next(pb_grpc.TelemetryStub(ch).Watch(pb.WatchRequest(), timeout=60)).tick
        for call in calls:
            call.cancel()
        for ch in channels:
            ch.close()


def test_one_connection_gets_at_most_its_streams(short_tmp):
    """Streams beyond --telemetry-streams-per-connection wait on the client (HTTP/2): the extra
    watcher never starts on this connection, while another connection is served."""
    target = f"unix://{short_tmp / 'telemetry.sock'}"
    with limited(short_tmp, TelemetryLimits(streams_per_connection=2)) as server:
        ch = own_channel(target)
        api = pb_grpc.TelemetryStub(ch)
        first, second = api.Watch(pb.WatchRequest()), api.Watch(pb.WatchRequest())
        next(first), next(second)
        waiting = api.Watch(pb.WatchRequest(), timeout=2)
        with pytest.raises(grpc.RpcError) as e:
            next(waiting)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # it never started
        assert server.watchers() == {"unix": 2}
        with own_channel(target) as other:
            assert next(pb_grpc.TelemetryStub(other).Watch(pb.WatchRequest(), timeout=60)).tick
        first.cancel()
        second.cancel()
        ch.close()


def test_a_watcher_that_stops_reading_is_cancelled(short_tmp):
    target = f"unix://{short_tmp / 'telemetry.sock'}"
    with limited(short_tmp, TelemetryLimits(send_timeout=0.5)) as server:
        ch = own_channel(target, **{"grpc.http2.bdp_probe": 0})  # a small window fills soon
        call = pb_grpc.TelemetryStub(ch).Watch(pb.WatchRequest())
        assert next(call).tick
        deadline = time.monotonic() + 60  # the client reads nothing more: dropped, place freed
        while server.watchers()["unix"]:
            assert time.monotonic() < deadline, "the slow watcher was never dropped"
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as ended:
            for _ in call:  # what the transport had buffered, then the end
                pass
        assert ended.value.code() == grpc.StatusCode.CANCELLED
        ch.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_tcp_with_tls_and_client_certificates(short_tmp, pki):
    tls = TlsFiles(pki.server_cert, pki.server_key, pki.ca, option="--telemetry-tls")
    with limited(short_tmp, TelemetryLimits(), tcp_address="127.0.0.1:0", tls=tls) as server:
        endpoint = f"127.0.0.1:{server.tcp_port}"
        client = TlsFiles(pki.client_cert, pki.client_key, pki.ca, "--tls", "-ca")
        out = io.StringIO()
        assert run_top(endpoint, True, 1.0, out, threading.Event(), tls=client) == 0
        assert "node-a" in out.getvalue()
        no_cert = TlsFiles(None, None, pki.ca, "--tls", "-ca")
        with pytest.raises(TopError, match="over TLS"):
            run_top(endpoint, True, 1.0, io.StringIO(), threading.Event(), tls=no_cert)
        with pytest.raises(TopError):  # plain gRPC to a TLS listener
            run_top(endpoint, True, 1.0, io.StringIO(), threading.Event())
        # the unix socket stays plain
        target = f"unix://{short_tmp / 'telemetry.sock'}"
        assert run_top(target, True, 1.0, io.StringIO(), threading.Event()) == 0


def test_tcp_with_tls_and_a_server_name(short_tmp, pki):
    tls = TlsFiles(pki.server_cert, pki.server_key, option="--telemetry-tls")
    with limited(short_tmp, TelemetryLimits(), tcp_address="127.0.0.1:0", tls=tls) as server:
        client = TlsFiles(None, None, pki.ca, "--tls", "-ca")
        out = io.StringIO()
        endpoint = f"127.0.0.1:{server.tcp_port}"
        assert run_top(endpoint, True, 1.0, out, threading.Event(), tls=client,
                       server_name="localhost") == 0  # fmt: skip
        with pytest.raises(TopError):  # the certificate is not for that name
            run_top(endpoint, True, 1.0, io.StringIO(), threading.Event(), tls=client,
                    server_name="elsewhere.example")  # fmt: skip


def test_tls_options_do_not_apply_to_the_unix_socket(short_tmp, pki):
    with pytest.raises(ConfigError, match="--tls options apply to a HOST:PORT endpoint"):
        run_top(f"unix://{short_tmp}/t.sock", True, 1.0, io.StringIO(), threading.Event(),
                tls=TlsFiles(None, None, pki.ca, "--tls", "-ca"))  # fmt: skip


def test_top_exits_with_a_message_when_its_agent_goes_away(short_tmp):
    """The agent stops while `tessera top` watches: top does not end as if the user quit
    (exit 0, no word); it says the agent went away, and the CLI exits non-zero."""
    snap = make_snapshot(tick=1)
    server = TelemetryServer(lambda: snap, short_tmp / "telemetry.sock", LOG)
    server.start()
    target = f"unix://{short_tmp / 'telemetry.sock'}"
    outcome: list[BaseException | int] = []

    def top() -> None:
        try:
            outcome.append(run_top(target, False, 0.05, io.StringIO(), threading.Event()))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=top)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while server.watchers()["unix"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # until top's Watch stream is open
        assert server.watchers()["unix"] == 1
    finally:
        server.stop()
        thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], TopError), outcome
    assert str(outcome[0]).startswith(f"the Tessera agent at {target} went away")


@pytest.fixture
def named(short_tmp) -> Iterator[str]:
    """A server that knows the DRA device names the node advertises (as the daemon's are)."""
    snap = make_snapshot(tick=1)
    names = {"gpu-0": "GPU-0", "gpu-1": "GPU-1", "gpu-1-mig-1g10gb-19-1": "MIG-1"}
    server = TelemetryServer(
        lambda: snap, short_tmp / "telemetry.sock", LOG, device_names=lambda: names
    )
    server.start()
    try:
        yield f"unix://{short_tmp / 'telemetry.sock'}"
    finally:
        server.stop()


def test_the_dra_device_names_users_see_are_filters(named):
    channel, api = stub(named)
    with channel:
        whole = api.Snapshot(pb.SnapshotRequest(devices=["gpu-0"]), timeout=5)
        assert [g.uuid for g in whole.gpus] == ["GPU-0"]
        mig = api.Snapshot(pb.SnapshotRequest(devices=["gpu-1-mig-1g10gb-19-1"]), timeout=5)
        assert [g.index for g in mig.gpus] == [1] and [m.uuid for m in mig.gpus[0].mig] == ["MIG-1"]
        call = api.Watch(pb.WatchRequest(devices=["gpu-1"]))
        assert [g.uuid for g in next(call).gpus] == ["GPU-1"]
        call.cancel()


@pytest.mark.parametrize("method", ["Snapshot", "Watch"])
def test_an_unknown_device_filter_is_invalid_argument(named, method):
    """Not an empty answer that looks like a node without GPUs: the name and what is known."""
    channel, api = stub(named)
    with channel, pytest.raises(grpc.RpcError) as e:
        if method == "Snapshot":
            api.Snapshot(pb.SnapshotRequest(devices=["gpu-0", "gpu-9"]), timeout=5)
        else:
            next(api.Watch(pb.WatchRequest(devices=["gpu-9"]), timeout=5))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = str(e.value.details())
    assert "'gpu-9'" in details and "'gpu-0'" not in details.split("known")[0]
    assert "gpu-1-mig-1g10gb-19-1" in details and "GPU-0" in details and "0" in details
