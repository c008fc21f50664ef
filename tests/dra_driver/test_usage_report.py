"""The node's GpuUsageReport writer (dra_driver/cluster/usage_report.py) against a small fake
API server: one write per report, create on 404, one retry on a 409, the CRD missing logged once,
acknowledged buckets dropped from the real ledger, the size bound, and every object written
accepted by the CRD (tests/crds.py)."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest

from agent.usage.buckets import BUCKET_SECONDS, report_buckets
from agent.usage.counters import Interval, UsageLedger
from dra_driver.cluster.usage_report import REPORTS_PATH, UsageReporter
from dra_driver.errors import KubeConflict, KubeError
from tests.crds import crd_violations

NODE = "gpu-node-1"
T = 1_796_385_600.0  # 2026-12-04T12:00:00Z
KEY = ("uid-1", NODE, "gpu-0")
PATH = f"{REPORTS_PATH}/{NODE}"


class FakeKube:
    """What the writer sends, answered like the API server: objects by path, resourceVersions,
    409 on a stale one; ``fail`` queues errors for the next requests of a method."""

    def __init__(self, served: bool = True) -> None:
        self.served = served
        self.objects: dict[str, dict[str, Any]] = {
            f"/api/v1/nodes/{NODE}": {"metadata": {"name": NODE, "labels": {"pool": "reserved"}}}
        }
        self.sent: list[tuple[str, str]] = []
        self.fail: dict[str, list[KubeError]] = {}
        self.rv = 0

    def request(
        self, method: str, path: str, query: Any = None, body: Any = None, timeout: Any = None
    ) -> dict[str, Any]:
        self.sent.append((method, path))
        if self.fail.get(method):
            raise self.fail[method].pop(0)
        if path.startswith(REPORTS_PATH) and not self.served:
            raise KubeError(404, "NotFound", "the server could not find the resource", method, path)
        if method == "GET":
            if path not in self.objects:
                raise KubeError(404, "NotFound", "not found", method, path)
            return copy.deepcopy(self.objects[path])
        name = body["metadata"]["name"]
        item = f"{REPORTS_PATH}/{name}"
        current = self.objects.get(item)
        if method == "POST" and current is not None:
            raise KubeConflict(409, "AlreadyExists", "exists", method, path)
        if method == "PUT" and (
            current is None
            or current["metadata"]["resourceVersion"] != body["metadata"].get("resourceVersion")
        ):
            raise KubeConflict(409, "Conflict", "the object has been modified", method, path)
        self.rv += 1
        stored = copy.deepcopy(body)
        stored["metadata"]["resourceVersion"] = str(self.rv)
        stored["status"] = (current or {}).get("status", {})  # the status subresource's
        self.objects[item] = stored
        return copy.deepcopy(stored)

    def writes(self) -> int:
        return sum(1 for m, _ in self.sent if m in ("POST", "PUT"))

    def acknowledge(self, through: str) -> None:
        """The controller, through the status subresource: the resourceVersion moves too."""
        self.rv += 1
        obj = self.objects[PATH]
        obj["status"] = {"acknowledgedThrough": through}
        obj["metadata"]["resourceVersion"] = str(self.rv)


class LedgerSource:
    """The real ledger behind the UsageMeter's two calls (one thread: the test's)."""

    def __init__(self, path: Path) -> None:
        self.ledger = UsageLedger(path, "boot-1")

    def hold(self, now: float, seconds: float) -> None:
        iv = Interval(KEY, "team-a", "train", "GPU-0", 1.0, "whole-gpu", 10.0, 0.5, "H100", None)
        self.ledger.account(now, seconds, [iv._replace(device_class="gpu.tessera.dev")], {})

    def report(self, max_bytes: int) -> tuple[float, list[dict[str, Any]]] | None:
        through, buckets = self.ledger.report()
        return through, report_buckets(buckets, max_bytes)

    def acknowledge(self, through: float) -> int:
        return self.ledger.acknowledge(through)


def reporter(kube: FakeKube, source: LedgerSource, **kw: Any) -> UsageReporter:
    return UsageReporter(
        kube,  # type: ignore[arg-type]
        NODE,
        source,
        logging.getLogger("test.usage-report"),
        interval=60.0,
        wall=lambda: T,
        **kw,
    )


def test_the_first_report_is_created_and_each_later_one_is_one_put(tmp_path: Path):
    kube, source = FakeKube(), LedgerSource(tmp_path / "usage.json")
    source.hold(T - 10.0, 0.0)
    source.hold(T + 20.0, 30.0)
    r = reporter(kube, source)
    assert r.report_once()
    assert kube.sent == [("GET", f"/api/v1/nodes/{NODE}"), ("GET", PATH), ("POST", REPORTS_PATH)]
    report = kube.objects[PATH]
    assert crd_violations("gpuusagereports", report) == []
    spec = report["spec"]
    assert spec["nodeName"] == NODE and spec["nodeLabels"] == {"pool": "reserved"}
    assert spec["through"] == "2026-12-04T12:00:20Z"
    assert [(b["start"], b["closed"]) for b in spec["buckets"]] == [
        ("2026-12-04T11:45:00Z", True),
        ("2026-12-04T12:00:00Z", False),
    ]
    (early,), (late,) = (b["usage"] for b in spec["buckets"])
    assert (early["allocatedGpuSeconds"], late["allocatedGpuSeconds"]) == (10.0, 20.0)
    assert early["deviceClass"] == "gpu.tessera.dev" and "migProfile" not in early
    for n in range(5):  # steady state: one write per report, no read of the report
        source.hold(T + 21.0 + n, 1.0)
        kube.sent.clear()
        assert r.report_once()
        assert kube.sent == [("GET", f"/api/v1/nodes/{NODE}"), ("PUT", PATH)]
    assert r.stats.writes == 6 and r.stats.errors == 0 and r.stats.last_success == T


def test_an_acknowledgement_drops_the_closed_buckets_before_it_from_the_ledger(tmp_path: Path):
    kube, source = FakeKube(), LedgerSource(tmp_path / "usage.json")
    source.hold(T - 10.0, 0.0)
    source.hold(T + 20.0, 30.0)
    r = reporter(kube, source)
    r.report_once()
    kube.acknowledge("2026-12-04T12:00:00Z")  # the controller folded the closed bucket
    assert r.report_once()  # the PUT is refused (409), read again, and put again
    assert kube.sent[-3:] == [("PUT", PATH), ("GET", PATH), ("PUT", PATH)]
    assert [s for s, _ in source.ledger.buckets.items()] == [int(T)]  # the open one stays
    r.report_once()  # (that write was made before the read; the next one no longer has it)
    starts = [b["start"] for b in kube.objects[PATH]["spec"]["buckets"]]
    assert starts == ["2026-12-04T12:00:00Z"]
    assert crd_violations("gpuusagereports", kube.objects[PATH]) == []
    # an acknowledgement past the open bucket never drops it (nor anything not yet closed)
    kube.acknowledge("2026-12-04T13:00:00Z")
    r.report_once()
    assert [s for s, _ in source.ledger.buckets.items()] == [int(T)]


def test_a_second_conflict_fails_this_report_and_the_next_one_carries_it(tmp_path: Path):
    kube, source = FakeKube(), LedgerSource(tmp_path / "usage.json")
    source.hold(T, 0.0)
    r = reporter(kube, source)
    r.report_once()
    conflict = KubeConflict(409, "Conflict", "modified", "PUT", PATH)
    kube.fail["PUT"] = [conflict, conflict]
    source.hold(T + 5.0, 5.0)
    assert not r.report_once() and r.stats.errors == 1
    assert kube.objects[PATH]["spec"]["through"] == "2026-12-04T12:00:00Z"
    assert r.report_once()
    assert kube.objects[PATH]["spec"]["through"] == "2026-12-04T12:00:05Z"


def test_the_crd_missing_is_logged_once_and_retried_every_interval(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    kube, source = FakeKube(served=False), LedgerSource(tmp_path / "usage.json")
    source.hold(T, 0.0)
    r = reporter(kube, source)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert not r.report_once()
    found = [m for m in caplog.messages if "GpuUsageReport resource is not served" in m]
    assert len(found) == 1 and r.stats.errors == 3
    kube.served = True  # the CRD applied: the buckets waited in the ledger
    assert r.report_once()
    assert kube.objects[PATH]["spec"]["buckets"][0]["usage"][0]["claimUID"] == "uid-1"


def test_an_outage_counts_an_error_and_keeps_the_last_node_labels(tmp_path: Path):
    kube, source = FakeKube(), LedgerSource(tmp_path / "usage.json")
    source.hold(T, 0.0)
    r = reporter(kube, source)
    r.report_once()
    down = KubeError(503, "ServiceUnavailable", "down", "GET", "")
    kube.fail["GET"] = [down]  # the Node read fails: the labels last read are carried
    kube.fail["PUT"] = [KubeError(0, "ConnectionError", "refused", "PUT", PATH)]
    assert not r.report_once() and r.stats.errors == 1
    assert r.report_once()  # read again first: the last write's answer is not known
    assert kube.sent[-2:] == [("GET", PATH), ("PUT", PATH)]
    assert kube.objects[PATH]["spec"]["nodeLabels"] == {"pool": "reserved"}


def test_a_report_carries_the_oldest_buckets_first_up_to_the_size_bound(tmp_path: Path):
    kube, source = FakeKube(), LedgerSource(tmp_path / "usage.json")
    source.hold(T, 0.0)
    source.hold(T + 3 * BUCKET_SECONDS, 3 * BUCKET_SECONDS)  # four buckets
    r = reporter(kube, source, max_bytes=700)
    r.report_once()
    starts = [b["start"] for b in kube.objects[PATH]["spec"]["buckets"]]
    assert starts == ["2026-12-04T12:00:00Z", "2026-12-04T12:15:00Z"]


def test_nothing_is_reported_before_the_ledger_counted_anything(tmp_path: Path):
    class Empty:
        def report(self, max_bytes: int) -> None:
            return None

        def acknowledge(self, through: float) -> int:
            return 0

    kube = FakeKube()
    r = UsageReporter(kube, NODE, Empty(), logging.getLogger("t"), interval=60.0)  # type: ignore[arg-type]
    assert not r.report_once() and kube.sent == [] and r.stats.errors == 0
