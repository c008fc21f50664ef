"""A time-sliced GPU two claims share, end to end: a real `tessera run --simulate --sharing
time-slicing` process, both claims prepared over the kubelet socket, a simulated process in each
claim's pod, and /metrics splitting the GPU's energy by the processes' SM utilization under one
stable ``rule="shared"`` label."""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterator

import pytest

from agent.cli import main
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.integration.daemon import DRIVER, Daemon, claim_manifest, write_claims
from tests.integration.test_telemetry import scrape, value

INTERVAL = 0.2
TIME_SLICED = {
    "apiVersion": "gpu.tessera.dev/v1alpha1",
    "kind": "GpuConfig",
    "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Default"}},
}
CLAIMS = {  # claim name -> (claim uid, pod name, pod uid)
    "train": (
        "7d3f6a1e-2b4c-4d5e-8f90-a1b2c3d4e5f6",
        "train-0",
        "11111111-2222-4333-8444-555555555555",
    ),
    "infer": (
        "9a8b7c6d-5e4f-4a3b-9c2d-1e0f9a8b7c6d",
        "infer-0",
        "66666666-7777-4888-9999-aaaaaaaaaaaa",
    ),
}


@pytest.fixture
def node(short_tmp) -> Iterator[Daemon]:
    d = Daemon(
        short_tmp, "dgx-h100", "--sharing", "time-slicing", "--telemetry-interval", str(INTERVAL)
    ).start()
    yield d
    d.kill()


def sim_process(d: Daemon, *args: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    code = main(["sim", "process", "--state-dir", str(d.state), *args], {}, out, err)
    assert code == 0, err.getvalue()
    return out.getvalue()


def prepare_shared(d: Daemon) -> None:
    config = [
        {
            "source": "FromClaim",
            "requests": ["gpu"],
            "opaque": {"driver": DRIVER, "parameters": TIME_SLICED},
        }
    ]
    for name, (uid, pod, pod_uid) in CLAIMS.items():
        manifest = claim_manifest(
            name, uid, [("gpu", "gpu-0")], d.node, namespace="ml", config=config,
            reserved_for=[(pod, pod_uid)],
        )  # fmt: skip
        write_claims(d.state, manifest)
    with KubeletClient(d.dra_socket) as k:
        res = k.prepare([ClaimRef("ml", name, uid) for name, (uid, _, _) in CLAIMS.items()])
    assert {uid: r["error"] for uid, r in res["claims"].items()} == {
        uid: "" for uid, _, _ in CLAIMS.values()
    }
    for uid, _, pod_uid in CLAIMS.values():
        entry = d.checkpoint()["claims"][uid]
        assert entry["pods"] == [pod_uid]
        assert [x["sharing"] for x in entry["devices"]] == ["TimeSlicing"]


Metrics = dict[str, dict[tuple, float]]


def poll(d: Daemon, ready: Callable[[Metrics], bool], timeout: float = 30) -> Metrics:
    """Scrape until ``ready(metrics)`` holds (the sampler ticks every INTERVAL)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(d)
        if ready(m):
            return m
        assert time.monotonic() < deadline, "the metrics never got there"
        time.sleep(INTERVAL / 2)


def shares(m: Metrics) -> dict[str, float]:
    out = {}
    for labels, v in m.get("tessera_claim_share_ratio", {}).items():
        out[dict(labels)["claim"]] = v
    return out


def rules(m: Metrics) -> set[tuple[str, str]]:
    return {
        (dict(k)["claim"], dict(k)["rule"])
        for name in ("tessera_claim_energy_joules_total", "tessera_claim_share_ratio")
        for k in m.get(name, {})
    }


def test_two_claims_on_one_time_sliced_gpu_split_its_energy_by_their_pods_utilization(node):
    prepare_shared(node)
    # nothing runs yet: an even split, already under the one label the claims keep
    even = poll(node, lambda m: shares(m) == {"train": 0.5, "infer": 0.5})
    seen = rules(even)
    sim_process(node, "start", "--gpu", "0", "--pod-uid", CLAIMS["train"][2],
                "--sm-utilization", "0.6", "--memory-mib", "4096")  # fmt: skip
    sim_process(node, "start", "--gpu", "0", "--pod-uid", CLAIMS["infer"][2],
                "--sm-utilization", "0.2")  # fmt: skip
    m1 = poll(node, lambda m: shares(m) == pytest.approx({"train": 0.75, "infer": 0.25}))

    def moved(m: Metrics) -> bool:
        ticks = value(m, "tessera_sampler_ticks_total") - value(m1, "tessera_sampler_ticks_total")
        return ticks >= 5 and all(
            value(m, "tessera_claim_energy_joules_total", claim=c)
            > value(m1, "tessera_claim_energy_joules_total", claim=c)
            for c in CLAIMS
        )

    m2 = poll(node, moved)
    seen |= rules(m1) | rules(m2)
    assert seen == {("train", "shared"), ("infer", "shared")}  # one series per claim throughout

    def delta(name: str, **labels: str) -> float:
        return value(m2, name, **labels) - value(m1, name, **labels)

    gpu = delta("tessera_gpu_energy_joules_total", gpu="0")
    train = delta("tessera_claim_energy_joules_total", claim="train", rule="shared")
    infer = delta("tessera_claim_energy_joules_total", claim="infer", rule="shared")
    assert gpu > 0
    assert train == pytest.approx(0.75 * gpu, rel=0.01)
    assert infer == pytest.approx(0.25 * gpu, rel=0.01)
    assert delta("tessera_claim_gpu_seconds_total", claim="train") == pytest.approx(
        3 * delta("tessera_claim_gpu_seconds_total", claim="infer"), rel=0.01
    )
    assert value(m2, "tessera_gpu_processes", gpu="0") == 2
