"""Bad input at the kubelet's door: generated NodePrepareResources and NodeUnprepareResources
calls (v1 and v1beta1) through the real DRA socket of one daemon, requests that are not
messages at all, calls of every size, and the registration socket (docs/reliability.md,
"Untrusted input at every door"; the checks every case ends with: tests/reliability/doors.py).

Each generated call is answered claim by claim as the rules say: a UID, namespace or name
Kubernetes could not have made is refused naming the field (``claims[i].uid: ...``), one UID
for two claims is refused naming both, a claim named twice is answered once, a claim of the
claim files is prepared (its CDI spec written in the CDI root) or unprepared, any other is not
found; a call of more than 1024 claims is refused whole; bytes that are not a request are
INVALID_ARGUMENT. `make test` runs a few cases; `make reliability` thousands.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dra_driver.errors import KubeletApiError
from dra_driver.kubeletapi import dra_v1_pb2, dra_v1beta1_pb2, registration_pb2
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.integration.daemon import claim_manifest, write_claims
from tests.reliability.doors import (
    DNS_LABEL,
    DNS_SUBDOMAIN,
    MODEL,
    RERUN,
    DaemonDoor,
    clear,
    close_door,
    end,
    fast,
    hostile_text,
    long,
    names,
    open_door,
    valid_label,
)
from tests.reliability.report import add

# a failing case of huge generated values is still worth reporting in full
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

REAL = [ClaimRef("fuzz", f"fz-{i}", f"uid-fz-{i}") for i in range(4)]
"""Claims in the claim files, on gpu-0..gpu-3: a generated call may name them."""
MODULES = {"v1": dra_v1_pb2, "v1beta1": dra_v1beta1_pb2}
MAX_CLAIMS = 1024


@pytest.fixture(scope="module")
def door() -> Iterator[DaemonDoor]:
    d = open_door("grpc", itemize=("not_a_request",))
    write_claims(
        d.state,
        *[claim_manifest(r.name, r.uid, [("gpu", f"gpu-{i}")], MODEL, r.namespace)
          for i, r in enumerate(REAL)],
    )  # fmt: skip
    try:
        yield d
    finally:
        close_door(d)


@pytest.fixture(scope="module")
def kubelet(door: DaemonDoor) -> Iterator[KubeletClient]:
    with KubeletClient(door.daemon.dra_socket, timeout=60) as k:
        yield k


# -- generated calls -------------------------------------------------------------------------

uids = st.one_of(valid_label, st.uuids().map(str), hostile_text)


@st.composite
def claim_refs(draw: st.DrawFn) -> ClaimRef:
    """A claim of the claim files, one of them with one part changed, or a new one."""
    real = draw(st.sampled_from(REAL))
    how = draw(st.sampled_from(["real", "other-uid", "other-name", "other-namespace", "new"]))
    if how == "real":
        return real
    if how == "other-uid":
        return ClaimRef(real.namespace, real.name, draw(uids))
    if how == "other-name":
        return ClaimRef(real.namespace, draw(names), real.uid)
    if how == "other-namespace":
        return ClaimRef(draw(names), real.name, real.uid)
    return ClaimRef(draw(names), draw(names), draw(uids))


@st.composite
def calls(draw: st.DrawFn) -> tuple[str, str, list[ClaimRef]]:
    """(API version, operation, claims): empty, one, several, with duplicates."""
    refs = draw(st.lists(claim_refs(), max_size=6))
    if refs and draw(st.booleans()):  # the same claim again, or its UID for another claim
        again = draw(st.sampled_from(refs))
        twin = again if draw(st.booleans()) else ClaimRef(draw(names), draw(names), again.uid)
        refs.insert(draw(st.integers(0, len(refs))), twin)
    op = draw(st.sampled_from(["prepare", "unprepare"]))
    return draw(st.sampled_from(list(MODULES))), op, refs


def valid(ref: ClaimRef) -> bool:
    return bool(
        DNS_LABEL.fullmatch(ref.uid)
        and DNS_LABEL.fullmatch(ref.namespace)
        and len(ref.name) <= 253
        and DNS_SUBDOMAIN.fullmatch(ref.name)
    )


def expected(op: str, refs: list[ClaimRef], prepared: dict[str, str]) -> dict[str, tuple[str, Any]]:
    """uid -> (outcome, detail) by the rules of the module docstring; ``prepared``: the UIDs
    prepared now, with their device (a prepare of a prepared UID under other names is refused,
    naming the claim that holds it)."""
    out: dict[str, tuple[str, Any]] = {}
    first: dict[str, tuple[int, ClaimRef]] = {}
    for i, ref in enumerate(refs):
        if out.get(ref.uid, ("",))[0] in ("invalid", "same-uid"):
            continue  # the first refusal of a UID is its answer
        if not valid(ref):
            out[ref.uid] = ("invalid", i)
            continue
        if ref.uid in first:
            j, other = first[ref.uid]
            if other != ref:
                out[ref.uid] = ("same-uid", (j, i))
            continue
        first[ref.uid] = (i, ref)
        if op == "unprepare":
            out[ref.uid] = ("ok", None)
        elif ref.uid in prepared:
            owner = next(r for r in REAL if r.uid == ref.uid)  # only REAL claims get prepared
            out[ref.uid] = ("prepared", prepared[ref.uid]) if owner == ref else ("held", owner)
        elif ref in REAL:
            out[ref.uid] = ("prepared", f"gpu-{REAL.index(ref)}")
        elif any((r.namespace, r.name) == (ref.namespace, ref.name) for r in REAL):
            out[ref.uid] = ("uid-mismatch", None)
        else:
            out[ref.uid] = ("not-found", None)
    return out


def one_call(door: DaemonDoor, kubelet: KubeletClient, api: str, op: str, refs: list[ClaimRef]):
    answer = (kubelet.prepare if op == "prepare" else kubelet.unprepare)(refs, api)["claims"]
    want = expected(op, refs, door.prepared)
    assert set(answer) == set(want), (refs, answer)
    for uid, (outcome, detail) in want.items():
        error = answer[uid]["error"]
        if outcome in ("ok", "prepared"):
            assert error == "", (refs, error)
            if outcome == "prepared":
                assert [d["deviceName"] for d in answer[uid]["devices"]] == [detail]
                assert (door.daemon.cdi_dir / f"k8s.gpu.tessera.dev-claim_{uid}.json").exists()
                door.prepared[uid] = detail
            else:
                door.prepared.pop(uid, None)
            continue
        assert not clear(error), (clear(error), error)
        if outcome == "invalid":
            assert error.startswith(f"claim refused: claims[{detail}].")
            assert any(f"claims[{detail}].{f}: " in error for f in ("uid", "namespace", "name"))
        elif outcome == "same-uid":
            j, i = detail
            assert error.startswith(f"claims[{j}] and claims[{i}] have the same UID")
        elif outcome == "held":
            assert f"UID {uid!r} is prepared as {detail.namespace}/{detail.name}" in error
        elif outcome == "uid-mismatch":
            assert "has UID 'uid-fz-" in error and f"the kubelet asked for {uid!r}" in error
        else:
            assert " not found in " in error and str(door.state / "resourceclaims") in error
    door.count("call")
    door.check()


def release(door: DaemonDoor, kubelet: KubeletClient) -> None:
    """The claims the cases prepared are released, and their CDI specs with them."""
    answer = kubelet.unprepare(REAL)["claims"]
    assert all(a["error"] == "" for a in answer.values())
    door.prepared.clear()
    assert door.daemon.cdi_files() == []


def calls_case(door: DaemonDoor, kubelet: KubeletClient) -> Any:
    @given(calls())
    def case(call: tuple[str, str, list[ClaimRef]]) -> None:
        one_call(door, kubelet, *call)

    return case


def test_generated_kubelet_calls(door, kubelet):
    fast(40)(calls_case(door, kubelet))()
    release(door, kubelet)
    end(door, record=False)


@pytest.mark.reliability
@pytest.mark.timeout(1800)
def test_generated_kubelet_calls_long(door, kubelet):
    long(4000)(calls_case(door, kubelet))()
    release(door, kubelet)
    end(door, record=True)


# -- bytes that are not a request --------------------------------------------------------------

METHODS = [
    (MODULES[api], f"/k8s.io.kubelet.pkg.apis.dra.{api}.DRAPlugin/Node{op}Resources", op)
    for api in MODULES
    for op in ("Prepare", "Unprepare")
]


@st.composite
def not_requests(draw: st.DrawFn) -> tuple[Any, str, str, bytes]:
    """Random bytes, or a real request's bytes with some changed, cut or added."""
    module, method, op = draw(st.sampled_from(METHODS))
    real = getattr(module, f"Node{op}ResourcesRequest")(
        claims=[module.Claim(namespace=r.namespace, name=r.name, uid=r.uid) for r in REAL[:2]]
    ).SerializeToString()
    data = draw(
        st.one_of(
            st.binary(max_size=200),
            st.tuples(st.integers(0, len(real)), st.binary(min_size=1, max_size=8)).map(
                lambda t: real[: t[0]] + t[1] + real[t[0] + len(t[1]) :]
            ),
            st.integers(0, len(real)).map(lambda n: real[:n]),
            st.binary(max_size=20).map(lambda b: real + b),
        )
    )
    return module, method, op, data


def raw_case(door: DaemonDoor, channel: grpc.Channel) -> Any:
    @given(not_requests())
    def case(sent: tuple[Any, str, str, bytes]) -> None:
        module, method, op, data = sent
        call = channel.unary_unary(
            method, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        try:
            response = getattr(module, f"Node{op}ResourcesResponse")
            answer = response.FromString(call(data, timeout=60))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
            assert "the request does not decode: Error parsing message with type" in str(
                exc.details()
            )
            assert f"Node{op}ResourcesRequest" in str(exc.details())
        else:
            for entry in answer.claims.values():
                assert entry.error == "" or not clear(entry.error), entry.error
        door.count("not_a_request")
        door.check()

    return case


def test_bytes_that_are_not_a_request(door, kubelet):
    with grpc.insecure_channel(f"unix://{door.daemon.dra_socket}") as channel:
        fast(30)(raw_case(door, channel))()
    release(door, kubelet)
    end(door, record=False)


@pytest.mark.reliability
@pytest.mark.timeout(1800)
def test_bytes_that_are_not_a_request_long(door, kubelet):
    with grpc.insecure_channel(f"unix://{door.daemon.dra_socket}") as channel:
        long(1500)(raw_case(door, channel))()
    release(door, kubelet)
    end(door, record=True)


# -- calls of every size, and the registration socket -----------------------------------------


LONG = pytest.mark.reliability


@pytest.mark.parametrize(
    ("claims", "uid_chars"),
    [pytest.param(0, 0, id="empty"), pytest.param(1023, 8, id="1023"),
     pytest.param(MAX_CLAIMS, 8, id="at-the-limit"), pytest.param(MAX_CLAIMS + 1, 8, id="one-over"),
     pytest.param(100_000, 8, id="100000", marks=LONG),
     pytest.param(1, 15_000_000, id="a-15-MB-uid", marks=LONG),
     pytest.param(1, 17_000_000, id="a-17-MB-uid", marks=LONG)],
)  # fmt: skip
@pytest.mark.parametrize("op", ["prepare", "unprepare"])
def test_calls_of_every_size(door, kubelet, op, claims, uid_chars, request):
    """Up to 1024 claims are each answered; more are refused whole with INVALID_ARGUMENT; a UID
    of 15 MB is refused naming it cut short; a call over gRPC's 16 MiB is RESOURCE_EXHAUSTED.
    None of it costs the daemon anything but the call."""
    refs = [ClaimRef("default", f"c{i}", f"u{i}".ljust(uid_chars, "x")) for i in range(claims)]
    send = kubelet.prepare if op == "prepare" else kubelet.unprepare
    if uid_chars > 16 * 1024 * 1024:  # sent by a client that sends more than the kubelet's
        assert over_the_limit(door, op, refs) == grpc.StatusCode.RESOURCE_EXHAUSTED
    elif claims > MAX_CLAIMS:
        with pytest.raises(KubeletApiError) as e:
            send(refs)
        assert e.value.code == "INVALID_ARGUMENT"
        assert f"the call names {claims} claims; at most {MAX_CLAIMS} are taken" in str(e.value)
    else:
        answer = send(refs)["claims"]
        assert len(answer) == claims
        for ref in refs:
            error = answer[ref.uid]["error"]
            if uid_chars > 63:
                assert "claims[0].uid: 'u0xxxx" in error and not clear(error)
            elif op == "prepare":
                assert f"claim default/{ref.name} not found" in error
            else:
                assert error == ""
    door.check()
    if request.node.get_closest_marker("reliability"):
        add("bad-input", cases=1, details={"grpc_sizes_cases_total": 1}, rerun=RERUN)


def over_the_limit(door: DaemonDoor, op: str, refs: list[ClaimRef]) -> grpc.StatusCode:
    """The status of a call larger than the DRA socket takes (16 MiB), sent by a client that
    sends up to 64 MiB."""
    name = "Prepare" if op == "prepare" else "Unprepare"
    data = getattr(dra_v1_pb2, f"Node{name}ResourcesRequest")(
        claims=[dra_v1_pb2.Claim(namespace=r.namespace, name=r.name, uid=r.uid) for r in refs]
    ).SerializeToString()
    options = [("grpc.max_send_message_length", 64 * 1024 * 1024)]
    with grpc.insecure_channel(f"unix://{door.daemon.dra_socket}", options=options) as channel:
        call = channel.unary_unary(
            f"/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/Node{name}Resources",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.RpcError) as e:
            call(data, timeout=60)
    code: grpc.StatusCode = e.value.code()
    return code


def test_the_registration_socket_answers_whatever_it_is_sent(door, kubelet):
    """GetInfo with bytes that are not an InfoRequest, and the kubelet's registration status
    with any error text: the socket keeps answering GetInfo."""
    channel = grpc.insecure_channel(f"unix://{door.daemon.reg_socket}")
    get_info = channel.unary_unary(
        "/pluginregistration.Registration/GetInfo",
        request_serializer=lambda b: b,
        response_deserializer=registration_pb2.PluginInfo.FromString,
    )

    @fast(40)
    @given(hostile_text, st.binary(max_size=64))
    def case(error: str, data: bytes) -> None:
        try:
            info = get_info(data, timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
        else:
            assert info.name == "gpu.tessera.dev"
        with KubeletClient(door.daemon.reg_socket, timeout=10) as reg:
            reg.notify_registration(True, error)
        door.count("registration")
        door.check()

    with channel:
        case()
    end(door, record=False)
