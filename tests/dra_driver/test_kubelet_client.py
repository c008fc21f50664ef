"""The kubelet-side client and ``tessera kubelet`` against a fake plugin served in the test.

The fake serves, like a real DRA plugin, ``Registration`` on a registration socket and
``DRAPlugin`` v1 + v1beta1 and ``DRAResourceHealth`` on a DRA socket (two gRPC servers on unix
sockets in tmp_path). Claims are scripted by name: ``bad`` -> per-claim error, ``empty`` -> no
devices, ``missing`` -> left out of the answer, ``shared`` -> a device with a share id (v1),
``boom`` -> the handler raises, ``abort`` -> FAILED_PRECONDITION, ``slow`` -> sleeps.
"""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.cli import main
from agent.errors import TesseraError
from dra_driver.errors import KubeletApiError
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
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient, register_like_kubelet

DRIVER = "gpu.tessera.dev"
HEALTHY = health_v1alpha1_pb2.HEALTHY
UNHEALTHY = health_v1alpha1_pb2.UNHEALTHY


@dataclass
class FakePlugin:
    reg_socket: Path
    dra_socket: Path
    info: dict[str, Any] = field(default_factory=dict)
    notifications: list[tuple[bool, str]] = field(default_factory=list)
    requests: list[tuple[str, str, list[tuple[str, str, str]]]] = field(default_factory=list)
    health: list[list[tuple[str, str, int]]] = field(default_factory=list)
    hold_health: bool = False  # keep the stream open after the scripted messages
    stop: threading.Event = field(default_factory=threading.Event)


def _record(fake: FakePlugin, api: str, rpc: str, request: Any) -> None:
    claims = [(c.namespace, c.name, c.uid) for c in request.claims]
    fake.requests.append((api, rpc, claims))


def _script(claim: Any, context: grpc.ServicerContext) -> str | None:
    """Common misbehaviour by claim name; returns the per-claim error, if any."""
    if claim.name == "boom":
        raise RuntimeError("boom")
    if claim.name == "abort":
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "nope")
    if claim.name == "slow":
        time.sleep(1.0)
    if claim.name == "bad":
        return f"claim {claim.namespace}/{claim.name} is not allocated"
    return None


class Registration(registration_pb2_grpc.RegistrationServicer):
    def __init__(self, fake: FakePlugin) -> None:
        self.fake = fake

    def GetInfo(self, request, context):
        return registration_pb2.PluginInfo(**self.fake.info)

    def NotifyRegistrationStatus(self, request, context):
        self.fake.notifications.append((request.plugin_registered, request.error))
        return registration_pb2.RegistrationStatusResponse()


def _dra_servicer(base: type, mod: Any, api: str) -> type:
    class Servicer(base):
        def __init__(self, fake: FakePlugin) -> None:
            self.fake = fake

        def NodePrepareResources(self, request, context):
            _record(self.fake, api, "prepare", request)
            resp = mod.NodePrepareResourcesResponse()
            for c in request.claims:
                error = _script(c, context)
                if c.name == "missing":
                    continue
                out = resp.claims[c.uid]
                if error:
                    out.error = error
                elif c.name != "empty":
                    dev = out.devices.add(
                        request_names=["gpu"],
                        pool_name="node-a",
                        device_name="gpu-0",
                        cdi_device_ids=[f"tessera.dev/gpu={c.uid}-gpu-0"],
                    )
                    if c.name == "shared" and api == "v1":
                        dev.share_id = "share-1"
            return resp

        def NodeUnprepareResources(self, request, context):
            _record(self.fake, api, "unprepare", request)
            resp = mod.NodeUnprepareResourcesResponse()
            for c in request.claims:
                error = _script(c, context)
                if c.name != "missing":
                    resp.claims[c.uid].error = error or ""
            return resp

    return Servicer


DRAv1 = _dra_servicer(dra_v1_pb2_grpc.DRAPluginServicer, dra_v1_pb2, "v1")
DRAv1beta1 = _dra_servicer(dra_v1beta1_pb2_grpc.DRAPluginServicer, dra_v1beta1_pb2, "v1beta1")


class Health(health_v1alpha1_pb2_grpc.DRAResourceHealthServicer):
    def __init__(self, fake: FakePlugin) -> None:
        self.fake = fake

    def NodeWatchResources(self, request, context):
        for msg in self.fake.health:
            yield health_v1alpha1_pb2.NodeWatchResourcesResponse(
                devices=[
                    health_v1alpha1_pb2.DeviceHealth(
                        device=health_v1alpha1_pb2.DeviceIdentifier(
                            pool_name="node-a", device_name=name
                        ),
                        health=status,
                        last_updated_time=when,
                        health_check_timeout_seconds=30 if name == "gpu-0" else 0,
                    )
                    for name, status, when in msg
                ]
            )
        while self.fake.hold_health and context.is_active() and not self.fake.stop.is_set():
            time.sleep(0.01)


def _serve(path: Path, executor: ThreadPoolExecutor, *adders: tuple[Any, Any]) -> grpc.Server:
    server = grpc.server(executor)
    for add, servicer in adders:
        add(servicer, server)
    assert server.add_insecure_port(f"unix://{path}")
    server.start()
    return server


@pytest.fixture
def fake(tmp_path):
    plugin = FakePlugin(reg_socket=tmp_path / "reg.sock", dra_socket=tmp_path / "dra.sock")
    plugin.info = {
        "type": "DRAPlugin",
        "name": DRIVER,
        "endpoint": str(plugin.dra_socket),
        "supported_versions": ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth"],
    }
    executors = [ThreadPoolExecutor(max_workers=4) for _ in range(2)]
    reg = _serve(
        plugin.reg_socket,
        executors[0],
        (registration_pb2_grpc.add_RegistrationServicer_to_server, Registration(plugin)),
    )
    dra = _serve(
        plugin.dra_socket,
        executors[1],
        (dra_v1_pb2_grpc.add_DRAPluginServicer_to_server, DRAv1(plugin)),
        (dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server, DRAv1beta1(plugin)),
        (health_v1alpha1_pb2_grpc.add_DRAResourceHealthServicer_to_server, Health(plugin)),
    )
    yield plugin
    plugin.stop.set()
    dra.stop(None).wait()
    reg.stop(None).wait()
    for executor in executors:  # grpc's stop leaves them
        executor.shutdown(wait=False)


def claims(*names: str) -> list[ClaimRef]:
    return [ClaimRef("default", n, f"uid-{n}") for n in names]


def device(uid: str, **extra: str) -> dict[str, Any]:
    return {
        "requestNames": ["gpu"],
        "poolName": "node-a",
        "deviceName": "gpu-0",
        "cdiDeviceIds": [f"tessera.dev/gpu={uid}-gpu-0"],
        **extra,
    }


# -- ClaimRef ---------------------------------------------------------------------------------


def test_claimref_parse():
    ref = ClaimRef.parse("team-a/my-claim/0b6c7e1a-1111-2222-3333-444455556666")
    assert ref == ClaimRef("team-a", "my-claim", "0b6c7e1a-1111-2222-3333-444455556666")
    assert str(ref) == "team-a/my-claim/0b6c7e1a-1111-2222-3333-444455556666"


@pytest.mark.parametrize(
    "text", ["", "ns/name", "ns/name/uid/extra", "ns//uid", "/name/uid", "a/b/ "]
)
def test_claimref_parse_rejects(text):
    with pytest.raises(ValueError, match="NAMESPACE/NAME/UID") as exc:
        ClaimRef.parse(text)
    assert repr(text) in str(exc.value)


# -- registration -----------------------------------------------------------------------------


def test_get_info(fake):
    with KubeletClient(fake.reg_socket) as client:
        assert client.get_info() == {
            "type": "DRAPlugin",
            "name": DRIVER,
            "endpoint": str(fake.dra_socket),
            "supportedVersions": [
                "v1.DRAPlugin",
                "v1beta1.DRAPlugin",
                "v1alpha1.DRAResourceHealth",
            ],
        }
    assert fake.notifications == []


def test_register_accepts(fake):
    result = register_like_kubelet(fake.reg_socket)
    assert result == {
        "info": {
            "type": "DRAPlugin",
            "name": DRIVER,
            "endpoint": str(fake.dra_socket),
            "supportedVersions": fake.info["supported_versions"],
        },
        "chosenVersion": "v1.DRAPlugin",
        "registered": True,
        "error": "",
    }
    assert fake.notifications == [(True, "")]


@pytest.mark.parametrize(
    ("versions", "chosen"),
    [
        (["v1beta1.DRAPlugin", "v1.DRAPlugin"], "v1beta1.DRAPlugin"),
        (["v1alpha1.DRAResourceHealth", "v2.DRAPlugin", "v1.DRAPlugin"], "v1.DRAPlugin"),
    ],
)
def test_register_takes_first_known_version_in_plugin_order(fake, versions, chosen):
    fake.info["supported_versions"] = versions
    result = register_like_kubelet(fake.reg_socket)
    assert (result["chosenVersion"], result["registered"]) == (chosen, True)


def test_register_refuses_unknown_versions_and_says_so(fake):
    fake.info["supported_versions"] = ["v2.DRAPlugin", "v1alpha1.DRAResourceHealth"]
    result = register_like_kubelet(fake.reg_socket)
    assert result["registered"] is False
    assert result["chosenVersion"] == ""
    assert "v2.DRAPlugin" in result["error"]
    assert "v1.DRAPlugin" in result["error"]
    assert fake.notifications == [(False, result["error"])]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"endpoint": "plugins/dra.sock"}, "not an absolute path"),
        ({"endpoint": "/nonexistent/dra.sock"}, "does not exist"),
        ({"type": "CSIPlugin"}, "'CSIPlugin' is not 'DRAPlugin'"),
        ({"name": ""}, "name"),
    ],
)
def test_register_refuses_bad_info(fake, change, reason):
    fake.info.update(change)
    result = register_like_kubelet(fake.reg_socket)
    assert result["registered"] is False
    assert reason in result["error"]
    assert fake.notifications == [(False, result["error"])]


def test_register_refuses_endpoint_that_is_not_a_socket(fake, tmp_path):
    regular = tmp_path / "plain-file"
    regular.write_text("")
    fake.info["endpoint"] = str(regular)
    result = register_like_kubelet(fake.reg_socket)
    assert "is not a unix socket" in result["error"]
    assert fake.notifications == [(False, result["error"])]


# -- prepare / unprepare ----------------------------------------------------------------------


def test_prepare_v1(fake):
    with KubeletClient(fake.dra_socket) as client:
        result = client.prepare(claims("shared", "plain", "bad", "empty"))
    assert result == {
        "claims": {
            "uid-shared": {"devices": [device("uid-shared", shareId="share-1")], "error": ""},
            "uid-plain": {"devices": [device("uid-plain")], "error": ""},
            "uid-bad": {"devices": [], "error": "claim default/bad is not allocated"},
            "uid-empty": {"devices": [], "error": ""},
        }
    }
    assert fake.requests == [
        (
            "v1",
            "prepare",
            [
                ("default", "shared", "uid-shared"),
                ("default", "plain", "uid-plain"),
                ("default", "bad", "uid-bad"),
                ("default", "empty", "uid-empty"),
            ],
        )
    ]


def test_prepare_v1beta1_has_no_share_id(fake):
    with KubeletClient(fake.dra_socket) as client:
        result = client.prepare(claims("shared", "bad"), api="v1beta1")
    assert result == {
        "claims": {
            "uid-shared": {"devices": [device("uid-shared")], "error": ""},
            "uid-bad": {"devices": [], "error": "claim default/bad is not allocated"},
        }
    }
    assert [r[:2] for r in fake.requests] == [("v1beta1", "prepare")]


@pytest.mark.parametrize("api", ["v1", "v1beta1"])
def test_unprepare(fake, api):
    with KubeletClient(fake.dra_socket) as client:
        result = client.unprepare(claims("a", "bad", "missing"), api=api)
    assert result == {
        "claims": {
            "uid-a": {"error": ""},
            "uid-bad": {"error": "claim default/bad is not allocated"},
        }
    }
    assert fake.requests[0][:2] == (api, "unprepare")


def test_prepare_no_claims_and_missing_claims(fake):
    with KubeletClient(fake.dra_socket) as client:
        assert client.prepare([]) == {"claims": {}}
        assert client.prepare(claims("missing")) == {"claims": {}}


def test_unknown_api_version(fake):
    with KubeletClient(fake.dra_socket) as client, pytest.raises(ValueError, match="v1beta2"):
        client.prepare(claims("a"), api="v1beta2")
    with KubeletClient(fake.dra_socket) as client, pytest.raises(ValueError, match="v1, v1beta1"):
        client.unprepare(claims("a"), api="v2")
    assert fake.requests == []


# -- health -----------------------------------------------------------------------------------


def test_watch_health(fake):
    fake.health = [
        [("gpu-0", HEALTHY, 1700000000), ("gpu-1", HEALTHY, 1700000000)],
        [("gpu-0", UNHEALTHY, 1700000030), ("gpu-1", HEALTHY, 1700000030)],
    ]
    with KubeletClient(fake.dra_socket) as client:
        messages = list(client.watch_health())
    assert messages == [
        [
            {
                "poolName": "node-a",
                "deviceName": "gpu-0",
                "health": "HEALTHY",
                "lastUpdatedTime": 1700000000,
                "healthCheckTimeoutSeconds": 30,
            },
            {
                "poolName": "node-a",
                "deviceName": "gpu-1",
                "health": "HEALTHY",
                "lastUpdatedTime": 1700000000,
                "healthCheckTimeoutSeconds": 0,
            },
        ],
        [
            {
                "poolName": "node-a",
                "deviceName": "gpu-0",
                "health": "UNHEALTHY",
                "lastUpdatedTime": 1700000030,
                "healthCheckTimeoutSeconds": 30,
            },
            {
                "poolName": "node-a",
                "deviceName": "gpu-1",
                "health": "HEALTHY",
                "lastUpdatedTime": 1700000030,
                "healthCheckTimeoutSeconds": 0,
            },
        ],
    ]
    assert all(isinstance(m[0]["lastUpdatedTime"], int) for m in messages)


def test_watch_health_stops_after_max_messages_on_open_stream(fake):
    fake.health = [[("gpu-0", HEALTHY, 1)], [("gpu-0", UNHEALTHY, 2)], [("gpu-0", HEALTHY, 3)]]
    fake.hold_health = True
    with KubeletClient(fake.dra_socket) as client:
        messages = list(client.watch_health(max_messages=2))
    assert [m[0]["health"] for m in messages] == ["HEALTHY", "UNHEALTHY"]


def test_watch_health_timeout_ends_quietly(fake):
    fake.health = [[("gpu-0", HEALTHY, 1)], []]
    fake.hold_health = True  # the stream stays open: only the timeout can end the call
    with KubeletClient(fake.dra_socket) as client:
        messages = list(client.watch_health(max_messages=5, timeout=0.3))
    assert messages == [[{"poolName": "node-a", "deviceName": "gpu-0", "health": "HEALTHY",
                          "lastUpdatedTime": 1, "healthCheckTimeoutSeconds": 30}], []]  # fmt: skip


def test_watch_health_unimplemented(fake):
    # the registration server does not serve DRAResourceHealth
    with KubeletClient(fake.reg_socket) as client, pytest.raises(KubeletApiError) as exc:
        next(client.watch_health())
    assert exc.value.code == "UNIMPLEMENTED"
    assert exc.value.method == "/v1alpha1.DRAResourceHealth/NodeWatchResources"


# -- failures ---------------------------------------------------------------------------------


def test_missing_socket_is_a_clear_error(tmp_path):
    path = tmp_path / "nothing-here.sock"
    with KubeletClient(path) as client, pytest.raises(KubeletApiError) as exc:
        client.prepare(claims("a"))
    assert str(path) in str(exc.value)
    assert "no socket" in str(exc.value)
    assert exc.value.code == "UNAVAILABLE"
    assert exc.value.temporary
    with pytest.raises(KubeletApiError, match="no socket"):
        register_like_kubelet(path)
    with KubeletClient(path) as client, pytest.raises(KubeletApiError, match="no socket"):
        next(client.watch_health())


def test_socket_nobody_listens_on(tmp_path):
    path = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))  # a socket file left behind by a dead plugin
    with (
        KubeletClient(path, timeout=5) as client,
        pytest.raises(KubeletApiError, match="cannot reach the plugin") as exc,
    ):
        client.get_info()
    assert exc.value.code == "UNAVAILABLE"
    assert str(path) in str(exc.value)


def test_server_exception_becomes_kubelet_api_error(fake):
    with KubeletClient(fake.dra_socket) as client:
        with pytest.raises(KubeletApiError) as exc:
            client.prepare(claims("boom"))
        assert exc.value.code == "UNKNOWN"
        assert isinstance(exc.value, TesseraError)
        assert exc.value.method == "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
        with pytest.raises(KubeletApiError) as exc:
            client.unprepare(claims("abort"), api="v1beta1")
        assert (exc.value.code, exc.value.details) == ("FAILED_PRECONDITION", "nope")
        assert not exc.value.temporary


def test_call_timeout(fake):
    with (
        KubeletClient(fake.dra_socket, timeout=0.2) as client,
        pytest.raises(KubeletApiError) as exc,
    ):
        client.prepare(claims("slow"))
    assert exc.value.code == "DEADLINE_EXCEEDED"
    assert exc.value.temporary


def test_closed_client_refuses_calls(fake):
    client = KubeletClient(fake.reg_socket)
    client.close()
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.get_info()


# -- CLI --------------------------------------------------------------------------------------


def run(*argv: str) -> tuple[int, str]:
    """``tessera kubelet ...`` as a user runs it; stderr must stay empty when it succeeds."""
    out, err = io.StringIO(), io.StringIO()
    code = main(["kubelet", *argv], {}, out, err)
    assert code == 2 or err.getvalue() == "", err.getvalue()
    return code, out.getvalue() if code != 2 else err.getvalue()


def test_cli_info(fake):
    code, text = run("info", "--socket", str(fake.reg_socket))
    assert code == 0
    assert text.startswith("{\n  ")
    data = json.loads(text)
    assert (data["registered"], data["chosenVersion"]) == (True, "v1.DRAPlugin")
    assert fake.notifications == [(True, "")]


def test_cli_info_refused(fake):
    fake.info["supported_versions"] = ["v9.DRAPlugin"]
    code, text = run("info", "--socket", str(fake.reg_socket))
    assert code == 1
    assert json.loads(text)["registered"] is False


def test_cli_prepare(fake):
    sock = str(fake.dra_socket)
    code, text = run("prepare", "--socket", sock, "--claim", "default/shared/uid-shared")
    assert code == 0
    assert json.loads(text) == {
        "claims": {
            "uid-shared": {"devices": [device("uid-shared", shareId="share-1")], "error": ""}
        }
    }
    code, text = run(
        "prepare", "--socket", sock, "--claim", "default/a/uid-a", "--claim", "default/bad/uid-bad",
        "--api", "v1beta1",
    )  # fmt: skip
    assert code == 1
    assert json.loads(text)["claims"]["uid-bad"]["error"] == "claim default/bad is not allocated"
    assert fake.requests[-1] == (
        "v1beta1", "prepare", [("default", "a", "uid-a"), ("default", "bad", "uid-bad")],
    )  # fmt: skip


def test_cli_unprepare_and_missing_claims(fake):
    sock = str(fake.dra_socket)
    assert run("unprepare", "--socket", sock, "--claim", "ns/a/uid-a")[0] == 0
    code, text = run("unprepare", "--socket", sock, "--claim", "ns/missing/uid-missing")
    assert code == 1
    assert json.loads(text) == {"claims": {}, "missingClaims": ["uid-missing"]}


def test_cli_health(fake):
    fake.health = [[("gpu-0", HEALTHY, 1)], [("gpu-0", UNHEALTHY, 2)]]
    fake.hold_health = True
    code, text = run("health", "--socket", str(fake.dra_socket), "--count", "2")
    assert code == 0
    lines = text.splitlines()
    assert [json.loads(line)[0]["health"] for line in lines] == ["HEALTHY", "UNHEALTHY"]
    code, text = run("health", "--socket", str(fake.dra_socket))
    assert (code, len(text.splitlines())) == (0, 1)
    code, text = run("health", "--socket", str(fake.dra_socket), "--count", "3", "--timeout", "0.3")
    assert (code, len(text.splitlines())) == (1, 2)


def test_cli_errors_are_one_line(tmp_path):
    code, err = run("prepare", "--socket", str(tmp_path / "x.sock"), "--claim", "ns/a/uid")
    assert code == 2 and "no socket" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["prepare", "--socket", "/s", "--claim", "ns/a"], "'ns/a' is not NAMESPACE/NAME/UID"),
        (["prepare", "--socket", "/s"], "--claim is required"),
        (["unprepare", "--claim", "ns/a/u"], "--socket is required"),
        (
            ["prepare", "--socket", "/s", "--claim", "n/a/u", "--api", "v2"],
            "not one of v1, v1beta1",
        ),
        (["health", "--socket", "/s", "--count", "0"], "positive"),
        (["info"], "--socket"),
        ([], "KUBELET_COMMAND"),
    ],
)
def test_cli_usage_errors(argv, message):
    code, err = run(*argv)
    assert code == 2
    assert message in err


def test_cli_help_says_what_it_is_for():
    out, err = io.StringIO(), io.StringIO()
    assert main(["kubelet", "prepare", "--help"], {}, out, err) == 0
    text = out.getvalue()
    assert "exactly as the kubelet does" in text
    assert "debugging on a node" in text.replace("\n", " ").replace("  ", " ")


@pytest.fixture
def other_grpc_socket(tmp_path):
    """A unix socket whose gRPC server serves something else (like the agent's telemetry.sock)."""
    path = tmp_path / "other.sock"
    executor = ThreadPoolExecutor(max_workers=4)
    server = _serve(path, executor)
    yield path
    server.stop(None).wait()
    executor.shutdown(wait=False)


@pytest.mark.parametrize(
    ("argv", "kind"),
    [(["info"], "registration socket"), (["prepare", "--claim", "a/b/c"], "DRA socket")],
)
def test_a_socket_that_is_not_a_dra_plugin_says_so(other_grpc_socket, argv, kind):
    code, err = run(*argv, "--socket", str(other_grpc_socket))
    assert code == 2 and err.count("\n") == 1
    assert f"{other_grpc_socket} is not a DRA plugin's {kind}" in err
    assert "Method not found" not in err


def test_the_client_reports_a_foreign_socket(other_grpc_socket):
    with KubeletClient(other_grpc_socket) as client, pytest.raises(KubeletApiError) as exc:
        client.get_info()
    assert exc.value.code == "UNIMPLEMENTED"
    assert "is not a DRA plugin's registration socket" in exc.value.details
