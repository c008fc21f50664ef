"""An unprepared claim's usage in its ResourceClaim's status.devices[].data
(dra_driver/cluster/claim_usage_status.py), against the API-server emulator over real HTTP
through the production client: the entries written (keyed by driver, pool, device and shareID),
other drivers' entries and our own conditions kept, one retry on a 409, a claim gone or no
longer allocated is no error, an outage is counted and logged, and what is still queued at
shutdown is written within the bound or dropped by name. Every claim written passes the
upstream 1.34 and 1.35 schemas."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.sim.apiserver import ApiServer
from agent.usage.counters import Interval, UsageLedger
from agent.usage.ledger_file import Counters
from dra_driver.cluster.claim_usage_status import ClaimUsageStatusWriter, UnpreparedClaim
from dra_driver.cluster.kube import KubeClient
from tests.fakeclock import FakeClock
from tests.k8sschema import VERSIONS
from tests.k8sschema import validate as validate_k8s

DRIVER = "gpu.tessera.dev"
NODE = "gpu-node-1"
NS, NAME, UID = "team-a", "train-1", "uid-1"
T = 1_796_385_600.0  # 2026-12-04T12:00:00Z
STATUS_PATH = f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/{NAME}/status"
NIC = {"driver": "nic.example.com", "pool": "nics", "device": "nic-0"}
CONDITION = {
    "type": "Ready",
    "status": "True",
    "lastTransitionTime": "2026-12-04T11:00:00Z",
    "reason": "Prepared",
    "message": "",
}


class LedgerTotals:
    """The real ledger behind UsageMeter.claim_totals (one thread: the test's)."""

    def __init__(self, path: Path) -> None:
        self.ledger = UsageLedger(path, "boot-1")

    def hold(self, device: str, seconds: float, busy: float, joules: float) -> None:
        """``device`` held ``seconds`` up to T, ``busy`` GPUs' worth busy, ``joules`` used."""
        iv = Interval((UID, NODE, device), NS, NAME, f"GPU-{device}", 1.0, "whole-gpu", 0.0, None)
        self.ledger.account(T - seconds, 0.0, [iv], {})
        self.ledger.account(T, seconds, [iv._replace(energy_joules=joules, busy_gpus=busy)], {})

    def claim_totals(self, uid: str) -> tuple[float, dict[tuple[str, str], Counters]] | None:
        through = self.ledger.counted_through
        if through is None:
            return None
        return through, {(k[1], k[2]): c for k, c in self.ledger.counters().items() if k[0] == uid}


@pytest.fixture
def server() -> Iterator[ApiServer]:
    with ApiServer() as s:
        yield s


@pytest.fixture
def kube(server: ApiServer, tmp_path: Path) -> Iterator[KubeClient]:
    client = KubeClient.from_config(server.kubeconfig(tmp_path / "kubeconfig"))
    yield client
    client.close()


@pytest.fixture
def totals(tmp_path: Path) -> LedgerTotals:
    return LedgerTotals(tmp_path / "usage.json")


def writer(kube: KubeClient, totals: LedgerTotals, **kw: Any) -> ClaimUsageStatusWriter:
    return ClaimUsageStatusWriter(
        kube, DRIVER, totals, logging.getLogger("test.claim-usage-status"), **kw
    )


def result(device: str, share: str | None = None, **kw: str) -> dict[str, Any]:
    r = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device, **kw}
    if share is not None:
        r["shareID"] = share
    return r


def put_claim(
    server: ApiServer, results: list[dict[str, Any]] | None, devices: list[Any] | None = None
) -> None:
    obj: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": NAME, "namespace": NS, "uid": UID},
        "spec": {
            "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}
        },
    }
    status: dict[str, Any] = {}
    if results is not None:
        status["allocation"] = {"devices": {"results": results}}
    if devices:
        status["devices"] = devices
    if status:
        obj["status"] = status
    server.put_object("resourceclaims", obj)


def stored(server: ApiServer) -> dict[str, Any]:
    claim = server.get_object("resourceclaims", NAME, NS)
    assert claim is not None
    for version in VERSIONS:  # as the real API server would check it
        validate_k8s(claim, version)
    return claim


def unprepared(*devices: tuple[str, str | None]) -> UnpreparedClaim:
    return UnpreparedClaim(NS, NAME, UID, tuple((NODE, d, s) for d, s in devices))


def status_writes(server: ApiServer) -> list[str]:
    return [r.method for r in server.requests.snapshot() if r.path.endswith(f"/{NAME}/status")]


def test_each_device_gets_its_final_usage_and_other_entries_are_kept(server, kube, totals):
    totals.hold("gpu-0", 3600.0, 0.5, 1.8e6)  # an hour, half busy, 0.5 kWh
    totals.hold("gpu-1", 900.0, 1.0, 0.0)
    put_claim(
        server,
        [result("gpu-0"), result("gpu-1"), {**NIC, "request": "nic"}],
        [NIC | {"data": {"mac": "aa"}}, {"driver": DRIVER, "pool": NODE, "device": "gpu-0",
                                          "conditions": [CONDITION]}],
    )  # fmt: skip
    w = writer(kube, totals)
    assert w.write(unprepared(("gpu-0", None), ("gpu-1", None)))
    devices = stored(server)["status"]["devices"]
    assert devices[0] == NIC | {"data": {"mac": "aa"}}  # another driver's, untouched
    assert devices[1]["conditions"] == [CONDITION]  # our own entry's other fields kept
    assert devices[1]["data"] == {
        "apiVersion": "gpu.tessera.dev/v1alpha1",
        "kind": "ClaimUsage",
        "allocatedGpuHours": "1.000000",
        "busyGpuHours": "0.500000",
        "energyKWh": "0.500000",
        "through": "2026-12-04T12:00:00Z",
    }
    assert devices[2] == {
        "driver": DRIVER,
        "pool": NODE,
        "device": "gpu-1",
        "data": devices[1]["data"]
        | {"allocatedGpuHours": "0.250000", "busyGpuHours": "0.250000", "energyKWh": "0.000000"},
    }
    assert status_writes(server) == ["PUT"] and w.stats.writes == 1 and w.stats.errors == 0


def test_a_shared_device_is_keyed_by_its_share_id(server, kube, totals):
    totals.hold("gpu-0", 1800.0, 0.0, 0.0)
    put_claim(server, [result("gpu-0", share="7d3b0c1e-7a1f-4a9e-8f0c-1c2d3e4f5a6b")])
    assert writer(kube, totals).write(unprepared(("gpu-0", "7d3b0c1e-7a1f-4a9e-8f0c-1c2d3e4f5a6b")))
    (entry,) = stored(server)["status"]["devices"]
    assert entry["shareID"] == "7d3b0c1e-7a1f-4a9e-8f0c-1c2d3e4f5a6b"
    assert entry["data"]["allocatedGpuHours"] == "0.500000"


def test_a_conflict_is_retried_once_from_a_fresh_read(server, kube, totals):
    totals.hold("gpu-0", 3600.0, 0.0, 0.0)
    put_claim(server, [result("gpu-0")])
    server.faults.add("PUT", f"{STATUS_PATH}$", "409")
    w = writer(kube, totals)
    assert w.write(unprepared(("gpu-0", None)))
    assert stored(server)["status"]["devices"][0]["data"]["allocatedGpuHours"] == "1.000000"
    assert status_writes(server) == ["PUT", "PUT"] and w.stats.errors == 0
    server.faults.add("PUT", f"{STATUS_PATH}$", "409", times=2)  # twice: given up, counted
    assert not w.write(unprepared(("gpu-0", None)))
    assert w.stats.errors == 1


def test_a_claim_gone_or_deallocated_is_not_an_error(server, kube, totals, caplog):
    totals.hold("gpu-0", 60.0, 0.0, 0.0)
    w = writer(kube, totals)
    with caplog.at_level(logging.DEBUG, "test.claim-usage-status"):
        assert not w.write(unprepared(("gpu-0", None)))  # no such claim: deleted with its pod
        put_claim(server, None)  # deallocated: the API server takes no device status then
        assert not w.write(unprepared(("gpu-0", None)))
        put_claim(server, [result("gpu-3")])  # the claim of that name now holds another device
        assert not w.write(unprepared(("gpu-0", None)))
    assert status_writes(server) == [] and w.stats.errors == 0
    assert [r.levelname for r in caplog.records] == ["DEBUG"] * 3
    assert "status" not in stored(server) or "devices" not in stored(server)["status"]


def test_an_outage_is_logged_with_the_claim_and_counted(server, kube, totals, caplog):
    totals.hold("gpu-0", 60.0, 0.0, 0.0)
    put_claim(server, [result("gpu-0")])
    server.faults.start_outage("503")
    w = writer(kube, totals)
    with caplog.at_level(logging.WARNING, "test.claim-usage-status"):
        assert not w.write(unprepared(("gpu-0", None)))
    assert w.stats.errors == 1
    (record,) = caplog.records
    assert record.fields["claim"] == f"{NS}/{NAME} ({UID})"  # type: ignore[attr-defined]
    assert "503" in record.fields["error"]  # type: ignore[attr-defined]
    server.faults.end_outage()
    assert w.write(unprepared(("gpu-0", None)))  # the API server back: the next claim is written


def test_nothing_counted_yet_writes_nothing(server, kube, totals):
    put_claim(server, [result("gpu-0")])
    w = writer(kube, totals)
    assert not w.write(unprepared(("gpu-0", None)))
    assert status_writes(server) == [] and w.stats.errors == 0


def test_a_full_queue_drops_and_counts_never_blocking(kube, totals):
    w = writer(kube, totals, queue_size=1)
    assert w.submit(unprepared(("gpu-0", None)))
    assert not w.submit(unprepared(("gpu-1", None)))
    assert w.stats.errors == 1


def test_at_shutdown_queued_claims_are_written_within_the_bound_then_dropped_by_name(
    server, kube, totals, caplog
):
    totals.hold("gpu-0", 60.0, 0.0, 0.0)
    put_claim(server, [result("gpu-0")])
    clock = FakeClock(100.0)
    # generous request timeouts: a loaded machine must not turn the write into a failure
    w = writer(kube, totals, monotonic=clock, timeout=(30.0, 30.0))
    w.submit(unprepared(("gpu-0", None)))
    assert w.close(60.0) == []  # within the bound: written
    assert stored(server)["status"]["devices"][0]["device"] == "gpu-0"
    w.submit(UnpreparedClaim(NS, "other", "uid-2", ((NODE, "gpu-1", None),)))
    with caplog.at_level(logging.WARNING, "test.claim-usage-status"):
        assert w.close(0.0) == [f"{NS}/other (uid-2)"]  # no time left: dropped, named
    assert caplog.records[-1].fields["claims"] == [f"{NS}/other (uid-2)"]  # type: ignore[attr-defined]
    assert w.stats.errors == 1


def test_a_write_that_runs_out_of_shutdown_time_stops_before_its_next_request(server, kube, totals):
    """Each clock read moves it 0.4 s on: the GET starts with 0.2 s left, the PUT with none."""
    totals.hold("gpu-0", 60.0, 0.0, 0.0)
    put_claim(server, [result("gpu-0")])
    w = writer(kube, totals, monotonic=FakeClock(100.0, step=0.4))
    w.submit(unprepared(("gpu-0", None)))
    assert w.close(1.0) == []
    assert status_writes(server) == [] and w.stats.errors == 1
    assert "devices" not in stored(server)["status"]
