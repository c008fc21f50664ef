"""Telemetry end to end: a `tessera run --simulate` process under a scripted load."""

from __future__ import annotations

import io
import itertools
import time
from collections.abc import Iterator

import grpc
import pytest

from agent.cli import main
from agent.telemetry.api import telemetry_pb2 as pb
from agent.telemetry.api import telemetry_pb2_grpc as pb_grpc
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.integration.daemon import Daemon, claim_manifest, write_claims

INTERVAL = 0.2


@pytest.fixture
def node(short_tmp) -> Iterator[Daemon]:
    d = Daemon(short_tmp, "dgx-h100", "--telemetry-interval", str(INTERVAL)).start()
    yield d
    d.kill()


def scrape(d: Daemon) -> dict[str, dict[tuple, float]]:
    return d.scrape()


def value(m: dict, name: str, **labels: str) -> float:
    hits = [v for k, v in m[name].items() if all((a, b) in k for a, b in labels.items())]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def prepare(d: Daemon, name: str, uid: str, device: str) -> None:
    write_claims(d.state, claim_manifest(name, uid, [("gpu", device)], d.node, namespace="ml"))
    with KubeletClient(d.dra_socket) as k:
        res = k.prepare([ClaimRef("ml", name, uid)])
    assert res["claims"][uid]["error"] == ""


def wait_ticks(d: Daemon, n: int = 3) -> None:
    start = value(scrape(d), "tessera_sampler_ticks_total")
    deadline = time.monotonic() + 30
    while value(scrape(d), "tessera_sampler_ticks_total") < start + n:
        assert time.monotonic() < deadline
        time.sleep(INTERVAL / 2)


def test_load_shows_up_and_claim_energy_matches_gpu_energy(node):
    prepare(node, "train", "uid-train", "gpu-0")
    node.fault("load", "--gpu", "0", "--utilization", "0.8")
    wait_ticks(node)
    m1 = scrape(node)
    assert value(m1, "tessera_gpu_utilization_ratio", gpu="0") == pytest.approx(0.8, abs=0.01)
    assert value(m1, "tessera_gpu_utilization_ratio", gpu="1") == pytest.approx(0.0, abs=0.01)
    assert value(m1, "tessera_device_prepared", device="gpu-0", claim="train") == 1
    g1 = value(m1, "tessera_gpu_energy_joules_total", gpu="0")
    c1 = value(m1, "tessera_claim_energy_joules_total", claim="train", rule="exclusive")
    wait_ticks(node, 10)
    m2 = scrape(node)
    dg = value(m2, "tessera_gpu_energy_joules_total", gpu="0") - g1
    dc = value(m2, "tessera_claim_energy_joules_total", claim="train") - c1
    assert dg > 0 and dc == pytest.approx(dg, rel=0.01)
    seconds = value(m2, "tessera_claim_gpu_seconds_total", claim="train")
    assert seconds > 0
    assert value(m2, "tessera_gpu_power_watts", gpu="0") > value(
        m2, "tessera_gpu_power_watts", gpu="1"
    )


def test_counters_never_go_backwards_across_a_driver_reload_and_a_restart(node):
    prepare(node, "a", "uid-a", "gpu-2")
    node.fault("load", "--gpu", "2", "--utilization", "0.5")
    history = []
    for step in range(6):
        wait_ticks(node, 2)
        history.append(scrape(node))
        if step == 2:
            node.fault("driver-reload")
    assert node.stop() == 0
    node.start()
    wait_ticks(node, 2)
    history.append(scrape(node))
    for name in ("tessera_gpu_energy_joules_total", "tessera_claim_energy_joules_total",
                 "tessera_claim_gpu_seconds_total"):  # fmt: skip
        for series in history[0][name]:
            values = [h[name][series] for h in history if series in h[name]]
            assert values == sorted(values), (name, series, values)


def test_a_lost_gpu_is_unhealthy_while_the_others_keep_reporting(node):
    node.fault("gpu-lost", "--gpu", "3")
    wait_ticks(node)
    m1 = scrape(node)
    assert value(m1, "tessera_gpu_healthy", gpu="3") == 0
    assert value(m1, "tessera_gpu_xid_errors_total", gpu="3", xid="79") >= 1
    assert not any(("gpu", "3") in k for k in m1["tessera_gpu_power_watts"])  # absent
    ticks = value(m1, "tessera_sampler_ticks_total")
    wait_ticks(node, 3)
    m2 = scrape(node)
    assert value(m2, "tessera_sampler_ticks_total") > ticks
    assert all(value(m2, "tessera_gpu_healthy", gpu=str(i)) == 1 for i in (0, 1, 2, 4, 5, 6, 7))
    with KubeletClient(node.dra_socket) as k:
        (devices,) = list(k.watch_health(max_messages=1, timeout=10))
    health = {d["deviceName"]: d["health"] for d in devices}
    assert health["gpu-3"] == "UNHEALTHY" and health["gpu-4"] == "HEALTHY"


def test_stream_clients_get_samples_at_the_asked_interval_and_top_renders(node):
    prepare(node, "viz", "uid-viz", "gpu-5")
    with grpc.insecure_channel(f"unix://{node.state / 'telemetry.sock'}") as channel:
        api = pb_grpc.TelemetryStub(channel)
        call = api.Watch(pb.WatchRequest(interval_seconds=0.6, devices=["5"]))
        samples = []
        for s in call:
            samples.append(s)
            if len(samples) == 4:
                call.cancel()
                break
    # paced on the sampler's own stamps: never closer than the asked interval less half a tick
    gaps = [b.wall_time - a.wall_time for a, b in itertools.pairwise(samples)]
    assert all(g >= 0.6 - INTERVAL / 2 - 0.01 for g in gaps), gaps
    assert all([g.index for g in s.gpus] == [5] for s in samples)
    assert samples[-1].gpus[0].holders[0].claim == "viz"
    with grpc.insecure_channel(f"unix://{node.state / 'telemetry.sock'}") as channel:
        api = pb_grpc.TelemetryStub(channel)  # the DRA name from the slice, as a user has it
        by_name = api.Snapshot(pb.SnapshotRequest(devices=["gpu-5"]), timeout=10)
        assert [g.index for g in by_name.gpus] == [5]
        with pytest.raises(grpc.RpcError) as e:
            api.Snapshot(pb.SnapshotRequest(devices=["gpu-99"]), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    out, err = io.StringIO(), io.StringIO()
    assert main(["top", "--once", "--state-dir", str(node.state)], {}, out, err) == 0, (
        err.getvalue()
    )
    frame = out.getvalue()
    assert "NVIDIA H100 80GB HBM3" in frame and "ml/viz" in frame


def test_readyz_includes_a_fresh_sampler(node):
    from tests.integration.test_daemon import wait_ready

    url = node.wait_log("agent started")["healthz"].replace("healthz", "readyz")
    assert wait_ready(url)["checks"]["sampler"] == "fresh"
