"""The kubelet plugin's socket names (classic and per pod), the removal of stale sockets other
instances left, the gate that holds DRA calls until the agent holds its state, and the checks
of the kubelet's requests at the door."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path

import grpc
import pytest

from dra_driver.kubeletapi import dra_v1_pb2, dra_v1beta1_pb2
from dra_driver.kubeletplugin.batch import ClaimResult
from dra_driver.kubeletplugin.claims import ClaimKey
from dra_driver.kubeletplugin.health_stream import HealthBoard
from dra_driver.kubeletplugin.server import PluginServer, socket_paths
from dra_driver.kubeletplugin.services import MAX_CLAIMS_PER_CALL, DraService, Gate

DRIVER = "gpu.tessera.dev"
ME = "4f1b2c3d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"
OLD = "0a1b2c3d-0000-4000-8000-00000000000a"
OLDER = "0a1b2c3d-0000-4000-8000-00000000000b"


def test_classic_names_and_per_pod_names_as_the_upstream_helper_makes_them(tmp_path):
    reg, plugins = tmp_path / "registry", tmp_path / "plugins"
    assert socket_paths(reg, plugins, DRIVER) == (
        reg / f"{DRIVER}-reg.sock",
        plugins / DRIVER / "dra.sock",
    )
    assert socket_paths(reg, plugins, DRIVER, ME) == (
        reg / f"{DRIVER}-{ME}-reg.sock",
        plugins / DRIVER / f"dra-{ME}.sock",
    )


def server(short_tmp: Path, instance: str | None, now: float = 10_000.0) -> PluginServer:
    return PluginServer(
        driver_name=DRIVER,
        registry_dir=short_tmp / "r",
        plugins_dir=short_tmp / "p",
        preparer=None,  # type: ignore[arg-type]  # no call reaches it here
        health=HealthBoard(pool="node"),
        log=logging.getLogger("tessera.test.plugin"),
        instance=instance,
        clock=lambda: now,
    )


def stale(path: Path, mtime: float) -> Path:
    """A socket file nobody listens on (a crashed agent's), last changed at ``mtime``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
    os.utime(path, (mtime, mtime))
    return path


def test_stale_sockets_of_other_instances_go_live_and_foreign_ones_stay(short_tmp):
    plugin = server(short_tmp, ME, now=10_000.0)
    reg, dra = plugin.reg_socket.parent, plugin.dra_socket.parent
    gone = [
        stale(reg / f"{DRIVER}-{OLD}-reg.sock", 1_000.0),
        stale(dra / f"dra-{OLD}.sock", 1_000.0),
        stale(reg / f"{DRIVER}-reg.sock", 1_000.0),  # a classic agent's, before the switch
        stale(dra / "dra.sock", 1_000.0),
    ]
    kept = [
        stale(reg / f"{DRIVER}-{OLDER}-reg.sock", 9_995.0),  # too young: maybe between bind
        stale(reg / f"{DRIVER}-other-reg.sock", 1_000.0),  # driver "gpu.tessera.dev-other"?
        stale(reg / f"other.example.com-{OLD}-reg.sock", 1_000.0),  # another driver's
    ]
    not_a_socket = dra / f"dra-{OLDER}.sock"
    not_a_socket.write_text("")
    os.utime(not_a_socket, (1_000.0, 1_000.0))
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # the old pod, still serving
    live.bind(str(dra / "dra-live.sock"))
    live.listen()
    os.utime(dra / "dra-live.sock", (1_000.0, 1_000.0))
    try:
        assert sorted(plugin.remove_stale_sockets()) == sorted(gone)
    finally:
        live.close()
    assert not any(p.exists() for p in gone)
    assert all(p.exists() for p in [*kept, not_a_socket, dra / "dra-live.sock"])


def test_serving_removes_stale_peers_only_in_a_rolling_update(short_tmp):
    old = time.time() - 60
    classic = server(short_tmp, None, now=time.time())
    peer = stale(classic.reg_socket.parent / f"{DRIVER}-{OLD}-reg.sock", old)
    classic.serve()
    try:
        assert peer.exists()  # the classic agent behaves as it always did
        assert classic.sockets_intact() == (True, "serving")
    finally:
        classic.stop(0)
    rolling = server(short_tmp, ME, now=time.time())
    rolling.serve()
    try:
        assert not peer.exists()
        assert rolling.reg_socket.exists() and rolling.dra_socket.exists()
    finally:
        rolling.stop(0)
    assert not rolling.reg_socket.exists() and not rolling.dra_socket.exists()


class Context:
    """The part of grpc.ServicerContext the gate reads."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining


CLAIMS = [ClaimKey("default", "a", "uid-a"), ClaimKey("default", "b", "uid-b")]


def test_an_open_gate_lets_calls_through_and_a_closed_one_answers_each_claim():
    gate = Gate()
    gate.waiting_for(
        "the agent is taking over from the one before it and is still waiting for the state"
        " directory /var/lib/tessera (PID 1 of pod old)"
    )
    # 5 s left of the kubelet's deadline is the reserve for the call itself: no wait at all
    refused = gate.refused(CLAIMS, Context(5.0), most=40.0)
    assert refused == {
        c.uid: f"claim {c}: the agent is taking over from the one before it and is still"
        " waiting for the state directory /var/lib/tessera (PID 1 of pod old); the kubelet"
        " retries the call"
        for c in CLAIMS
    }
    gate.open()
    assert gate.refused(CLAIMS, Context(5.0), most=40.0) == {}


def test_a_waiting_call_goes_through_when_the_gate_opens():
    gate = Gate()
    results: list[dict[str, str]] = []
    waiter = threading.Thread(
        target=lambda: results.append(gate.refused(CLAIMS, Context(None), most=60.0))
    )
    waiter.start()
    gate.open()
    waiter.join(10)
    assert results == [{}]


def test_shutting_down_wakes_the_waiting_calls_with_a_retryable_answer():
    gate = Gate()
    results: list[dict[str, str]] = []
    waiter = threading.Thread(
        target=lambda: results.append(gate.refused(CLAIMS, Context(45.0), most=40.0))
    )
    waiter.start()
    gate.abort()
    waiter.join(10)
    assert results == [
        {
            c.uid: f"claim {c}: the agent is shutting down; the kubelet retries it with the"
            " next agent"
            for c in CLAIMS
        }
    ]
    assert not waiter.is_alive()


class Budget(Gate):
    """A gate that never opens and records how long a call would wait at it."""

    def __init__(self) -> None:
        super().__init__()
        self.budgets: list[float] = []

    def wait(self, timeout: float) -> bool:
        self.budgets.append(timeout)
        return False


@pytest.mark.parametrize(
    ("remaining", "budget"),
    [(None, 40.0), (60.0, 40.0), (45.0, 40.0), (20.0, 15.0), (3.0, -2.0)],
    ids=["no-deadline", "long-deadline", "kubelet-45s", "short", "none-left"],
)
def test_a_call_waits_within_its_deadline_less_a_reserve_for_the_call(remaining, budget):
    gate = Budget()
    assert gate.refused(CLAIMS[:1], Context(remaining), most=40.0)
    assert gate.budgets == [budget]


# -- the kubelet's request is input like any other ---------------------------------------------


class Aborted(Exception):
    pass


class AbortingContext(Context):
    """A gRPC context whose ``abort`` raises, as grpc's does."""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


class Recorder:
    """Stands in for the preparer: answers every claim it is given, and remembers them."""

    def __init__(self) -> None:
        self.log = logging.getLogger("tessera.test.plugin")
        self.given: list[list[ClaimKey]] = []
        self.observed: list[tuple[str, str | None]] = []

    def observe(self, op: str, seconds: float, reason: str | None) -> None:
        self.observed.append((op, reason))

    def prepare(self, keys: list[ClaimKey]) -> dict[str, ClaimResult]:
        self.given.append(list(keys))
        return {k.uid: ClaimResult() for k in keys}

    unprepare = prepare


def dra(preparer: Recorder, pb2=dra_v1_pb2) -> DraService:
    gate = Gate()
    gate.open()
    return DraService(pb2, preparer, gate, 40.0)  # type: ignore[arg-type]


def call(service: DraService, op: str, *claims: tuple[str, str, str]) -> dict[str, str]:
    pb2 = service.pb2
    request = getattr(pb2, f"Node{op}ResourcesRequest")(
        claims=[pb2.Claim(namespace=n, name=m, uid=u) for n, m, u in claims]
    )
    answer = getattr(service, f"Node{op}Resources")(request, AbortingContext(45.0))
    return {uid: entry.error for uid, entry in answer.claims.items()}


HOSTILE = [
    ("../..", "ok", "uid-1", "claims[0].namespace: '../..' is not a DNS label"),
    ("default", "a/../../b", "uid-1", "claims[0].name: 'a/../../b' is not a DNS subdomain"),
    ("default", "ok", "../../x", "claims[0].uid: '../../x' is not a claim UID"),
    ("default", "ok", "u\x00id", "claims[0].uid: 'u\\x00id' is not a claim UID"),
    ("default", "ok", "Ü", "claims[0].uid: 'Ü' is not a claim UID"),
    ("default", "ok", "", "claims[0].uid: '' is not a claim UID"),
    ("default", "x" * 300, "uid-1", "claims[0].name: '" + "x" * 60 + "'... (300 characters)"),
]


@pytest.mark.parametrize(("namespace", "name", "uid", "message"), HOSTILE)
@pytest.mark.parametrize("pb2", [dra_v1_pb2, dra_v1beta1_pb2], ids=["v1", "v1beta1"])
def test_a_claim_kubernetes_could_not_have_made_is_refused_at_the_door(
    pb2, namespace, name, uid, message
):
    """Path separators, '..', NUL, non-ASCII, empty and long values: the claim is answered with
    an error naming the field and showing the value (escaped, cut short), and the preparer, which
    makes file names of UIDs, never sees it; the other claims of the call are prepared."""
    preparer = Recorder()
    answers = call(
        dra(preparer, pb2), "Prepare", (namespace, name, uid), ("default", "good", "uid-good")
    )
    assert message in answers[uid]
    assert answers[uid].startswith("claim refused: ") and answers[uid].isprintable()
    assert len(answers[uid]) < 400  # a long value is cut short
    assert answers["uid-good"] == ""
    assert preparer.given == [[ClaimKey("default", "good", "uid-good")]]
    assert preparer.observed == [("prepare", "invalid_claim")]


def test_unprepare_is_checked_as_prepare_is():
    preparer = Recorder()
    answers = call(
        dra(preparer),
        "Unprepare",
        ("default", "n", "uid-1"),
        ("default", "n", "../x"),
        ("default", "n" * 100_000, "uid-2"),
    )
    assert answers["uid-1"] == ""
    assert "claims[1].uid: '../x' is not a claim UID" in answers["../x"]
    assert "claims[2].name: 'nnnn" in answers["uid-2"] and len(answers["uid-2"]) < 400
    assert preparer.given == [[ClaimKey("default", "n", "uid-1")]]


def test_a_claim_named_twice_is_taken_once_and_one_uid_for_two_claims_is_refused():
    preparer = Recorder()
    answers = call(
        dra(preparer),
        "Prepare",
        ("default", "a", "uid-a"),
        ("default", "a", "uid-a"),
        ("default", "b", "uid-b"),
        ("other", "b", "uid-b"),
        ("default", "b", "uid-b"),
        ("default", "c", "uid-c"),
        ("default", "c" * 300, "uid-c"),  # the first refusal of a UID is its answer
        ("default", "c2", "uid-c"),
    )
    assert answers["uid-a"] == ""
    assert answers["uid-b"] == (
        "claims[2] and claims[3] have the same UID 'uid-b' but name different claims"
        " (default/b and other/b); neither is taken"
    )
    assert answers["uid-c"].startswith("claim refused: claims[6].name: 'ccc")
    assert preparer.given == [[ClaimKey("default", "a", "uid-a")]]


def test_an_empty_call_is_an_empty_answer():
    preparer = Recorder()
    assert call(dra(preparer), "Prepare") == {}
    assert call(dra(preparer), "Unprepare") == {}


@pytest.mark.parametrize("op", ["Prepare", "Unprepare"])
def test_a_call_with_more_claims_than_a_pod_could_have_is_refused_whole(op):
    preparer = Recorder()
    service = dra(preparer)
    at_limit = [("default", f"c{i}", f"uid-{i}") for i in range(MAX_CLAIMS_PER_CALL)]
    assert len(call(service, op, *at_limit)) == MAX_CLAIMS_PER_CALL
    with pytest.raises(Aborted) as e:
        call(service, op, *at_limit, ("default", "one-more", "uid-one-more"))
    code, details = e.value.args
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == (
        f"the call names {MAX_CLAIMS_PER_CALL + 1} claims; at most {MAX_CLAIMS_PER_CALL} are"
        " taken in one call"
    )
    assert len(preparer.given) == 1  # the refused call reached nothing


def test_a_request_that_does_not_decode_is_invalid_argument_and_never_a_traceback(
    short_tmp, caplog
):
    """Over the real sockets: bytes that are not the message (corrupt, a string that is not
    UTF-8) get INVALID_ARGUMENT naming the message type, and one throttled warning, for the
    DRA services and registration alike; grpc alone answers INTERNAL and logs a traceback at
    ERROR for each."""
    plugin = server(short_tmp, None)
    plugin.serve()
    try:
        claim_not_utf8 = b"\x0a\x05\x0a\x03\xff\xfe\xfd"  # claims[0].namespace
        dra_v1 = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
        dra_v1beta1 = "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"
        for sock, method, not_utf8 in [
            (plugin.dra_socket, f"{dra_v1}/NodePrepareResources", claim_not_utf8),
            (plugin.dra_socket, f"{dra_v1beta1}/NodeUnprepareResources", claim_not_utf8),
            (plugin.reg_socket, "/pluginregistration.Registration/NotifyRegistrationStatus",
             b"\x12\x03\xff\xfe\xfd"),  # error
        ]:  # fmt: skip
            with grpc.insecure_channel(f"unix://{sock}") as channel:
                raw = channel.unary_unary(
                    method, request_serializer=lambda b: b, response_deserializer=lambda b: b
                )
                for garbage in (b"\xff\xff\xff", not_utf8):
                    with pytest.raises(grpc.RpcError) as e, caplog.at_level(logging.WARNING):
                        raw(garbage, timeout=5)
                    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
                    assert "the request does not decode: Error parsing message" in str(
                        e.value.details()
                    )
    finally:
        plugin.stop(0)
    refused = [r for r in caplog.records if "does not decode" in r.getMessage()]
    assert len(refused) == 1  # six refusals, one record within the interval
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def test_the_kubelets_registration_error_is_kept_to_a_few_lines(short_tmp, caplog):
    """The kubelet's reason for refusing the registration goes into the log and /readyz: a
    megabyte of it stays a thousand characters."""
    from dra_driver.kubeletapi import registration_pb2
    from dra_driver.kubeletplugin.server import RegistrationService

    plugin = server(short_tmp, None)
    with caplog.at_level(logging.ERROR):
        RegistrationService(plugin).NotifyRegistrationStatus(
            registration_pb2.RegistrationStatus(plugin_registered=False, error="e" * 1_000_000),
            None,
        )
    assert plugin.registered is False
    assert plugin.registration_error == "e" * 1000 + "... (1000000 characters)"
    (record,) = caplog.records
    assert record.fields["reason"] == plugin.registration_error  # type: ignore[attr-defined]
