"""GPU health changes become Events on the Node, through the running daemon: in kube mode against
the API-server emulator (real HTTP; every Event validated with the 1.34 and 1.35 schemas),
aggregated so that a flapping GPU is a few Events with growing counts; standalone, one structured
log record per event."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agent.sim.apiserver import ApiServer
from agent.sim.nvml import FakeNvml
from tests.integration.daemon import Daemon
from tests.k8sschema import validate as validate_k8s
from tests.simnode import node_model

MODEL = "l40s-pcie"
TICK = "0.2"


def until(cond: Callable[[], bool], d: Daemon, what: str, timeout: float = 60) -> None:
    """Wait for ``cond`` (a generous hang guard), failing at once if the daemon died."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert d.proc is not None and d.proc.poll() is None, f"the agent died: {d.logs[-5:]}"
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        threading.Event().wait(0.05)


def uuid_of(d: Daemon, gpu: int) -> str:
    d.wait_log("agent started")
    (rec,) = [r for r in d.logs if r.get("msg") == "discovered GPU" and r.get("gpu") == gpu]
    return str(rec["uuid"])


def on_node(server: ApiServer, node: str) -> list[dict[str, Any]]:
    return [
        e
        for e in server.objects("events", "default")
        if e["involvedObject"]["kind"] == "Node" and e["involvedObject"]["name"] == node
    ]


def node_events(server: ApiServer, node: str) -> list[dict[str, Any]]:
    """The Events on the Node, each checked against the upstream schemas."""
    found = on_node(server, node)
    for e in found:
        for version in ("1.34.0", "1.35.0"):
            validate_k8s(e, version)
    return found


def count(server: ApiServer, node: str, reason: str, gpu: int) -> int:
    return sum(
        e["count"]
        for e in on_node(server, node)
        if e["reason"] == reason and e["message"].startswith(f"GPU {gpu} (")
    )


def metric(d: Daemon, outcome: str) -> float:
    with urllib.request.urlopen(d.metrics_url("/metrics"), timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("tessera_node_events_total{") and f'outcome="{outcome}"' in line:
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"tessera_node_events_total{{outcome={outcome!r}}} not exposed")


@pytest.fixture
def server() -> Iterator[ApiServer]:
    with ApiServer() as s:
        s.put_object("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": MODEL}})
        yield s


@pytest.fixture
def kube_daemon(server: ApiServer, short_tmp: Path) -> Iterator[Daemon]:
    kubeconfig = str(server.kubeconfig(short_tmp / "kubeconfig"))
    d = Daemon(short_tmp, MODEL, "--kubeconfig", kubeconfig, "--telemetry-interval", TICK)
    try:
        yield d.start()
    finally:
        d.kill()


def test_a_lost_gpu_is_a_warning_on_the_node_and_a_flapping_one_is_counted(server, kube_daemon):
    d, node = kube_daemon, kube_daemon.node
    uid = server.get_object("nodes", node)["metadata"]["uid"]
    lost = uuid_of(d, 0)
    d.fault("gpu-lost", "--gpu", "0")  # XID 79
    until(lambda: count(server, node, "GpuUnhealthy", 0) == 1, d, "a Warning for GPU 0")
    (warning,) = node_events(server, node)
    assert warning["type"] == "Warning" and warning["involvedObject"]["uid"] == uid
    assert f"GPU 0 ({lost})" in warning["message"]
    assert warning["metadata"]["name"].startswith(f"{node}.")

    # GPU 1 flaps 20 times: one read fails as a lost GPU would, the next answers again
    flaky, sim = uuid_of(d, 1), FakeNvml(node_model(MODEL), d.state / "sim")
    for cycle in range(1, 21):
        sim.fail_call("nvmlDeviceGetPowerUsage", gpu=1, code=pynvml.NVML_ERROR_GPU_IS_LOST)
        until(
            lambda c=cycle: count(server, node, "GpuHealthy", 1) == c,  # type: ignore[misc]
            d,
            f"flap {cycle} of GPU 1 counted",
        )
    events = node_events(server, node)
    by_reason = {(e["reason"], e["message"].split(" (")[0]): e for e in events}
    assert len(events) == 3  # GPU 0's Warning, GPU 1's Warning and its Normal: counted, not new
    assert by_reason[("GpuUnhealthy", "GPU 1")]["count"] == 20
    assert by_reason[("GpuHealthy", "GPU 1")]["count"] == 20
    assert flaky in by_reason[("GpuHealthy", "GPU 1")]["message"]
    writes = [r.method for r in server.requests if r.resource == "events" and r.method != "GET"]
    assert writes.count("POST") == 3 and writes.count("PATCH") == 38
    assert server.rejected == []
    # the agent counts an event once the API server's answer is back: the server may log the
    # last PATCH just before the agent's counter moves
    until(lambda: metric(d, "recorded") == 41, d, "all 41 events counted as recorded")
    assert metric(d, "failed") == 0
    assert d.stop() == 0
    assert not any(r.get("msg") == "tasks did not stop in time" for r in d.logs)


def test_lost_and_recovered_is_a_warning_then_a_normal_and_cycles_aggregate(server, kube_daemon):
    d, node = kube_daemon, kube_daemon.node
    uuid = uuid_of(d, 2)
    d.fault("gpu-lost", "--gpu", "2")
    until(lambda: count(server, node, "GpuUnhealthy", 2) == 1, d, "a Warning for GPU 2")
    d.fault("recover", "--gpu", "2")
    until(lambda: count(server, node, "GpuHealthy", 2) == 1, d, "a Normal for GPU 2", 8)
    (normal,) = [e for e in node_events(server, node) if e["type"] == "Normal"]
    assert f"GPU 2 ({uuid})" in normal["message"]
    for cycle in range(2, 7):  # the 20-cycle flap above already proves the counting
        d.fault("gpu-lost", "--gpu", "2")
        # a loss the agent never read is only an XID: it stays sticky (docs/reliability.md)
        until(
            lambda c=cycle: count(server, node, "GpuUnhealthy", 2) >= c,  # type: ignore[misc]
            d,
            f"loss {cycle} seen",
        )
        d.fault("recover", "--gpu", "2")
        until(
            lambda c=cycle: count(server, node, "GpuHealthy", 2) == c,  # type: ignore[misc]
            d,
            f"cycle {cycle} counted",
        )
    assert len(node_events(server, node)) == 2 and server.rejected == []


def test_standalone_a_node_event_is_one_structured_log_record(short_tmp):
    d = Daemon(short_tmp, MODEL, "--telemetry-interval", TICK).start()
    try:
        uuid = uuid_of(d, 3)
        d.fault("gpu-lost", "--gpu", "3")
        rec = d.wait_log("node event")
        assert rec["logger"] == "tessera.node-events" and rec["level"] == "warning"
        assert (rec["type"], rec["reason"], rec["count"]) == ("Warning", "GpuUnhealthy", 1)
        assert rec["node"] == d.node and f"GPU 3 ({uuid})" in rec["message"]
        assert d.stop() == 0
    finally:
        d.kill()
