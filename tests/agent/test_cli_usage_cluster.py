"""`tessera usage --cluster`: a cluster's usage per namespace and DeviceClass over a range, read
from its GpuUsageSummaries and the GpuUsageReports not yet folded (each bucket once), with exact
costs. The command reads them over real HTTP from the API-server emulator serving the real CRDs
(tests/crds.py), which checks every object written; the lists are paged with limit/continue by
the emulator (one item a page where a test asks, so that paging is exercised)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.cli import main
from agent.cli.usage_cluster import claim_rows, cluster_rows, time_range
from agent.errors import ConfigError
from agent.sim.apiserver import ApiServer
from agent.usage.budget_plan import ClusterView, plan
from agent.usage.prices import price_table
from dra_driver.cluster.kube import KubeClient
from tests.apiclient import api_client
from tests.crds import create, serving
from tests.usage.clusterobjs import bucket, check_summary, entry, report

PRICES = {"currency": "EUR", "gpuHour": [{"price": "2.50"}], "energy": [{"pricePerKWh": "0.20"}]}
NOW = datetime(2026, 12, 4, 12, 20, tzinfo=UTC)


def cluster() -> dict[str, list[dict[str, Any]]]:
    """Two nodes; node 1's 12:00 bucket folded into summaries (its report acknowledged and still
    carrying it, as before the agent drops it); the open buckets live in the reports only."""
    r1 = report(
        "n1",
        bucket(
            "2026-12-04T12:00:00Z",
            entry("team-a", allocated=3600.0, energy=3.6e6),
            entry("team-b", allocated=1800.0),
        ),
        bucket("2026-12-04T12:15:00Z", entry("team-a", allocated=1800.0), closed=False),
    )
    r2 = report(
        "n2",
        bucket(
            "2026-11-30T23:00:00Z",
            entry("team-b", allocated=7200.0, device_class="mig.tessera.dev", mig="3g.40gb"),
        ),
    )
    p = plan(ClusterView([r1], [], [], [], frozenset({"n1"}), [], [], None), NOW)
    for s in p.summaries:
        check_summary(s)
    (acked,) = p.acks
    return {"gpuusagereports": [acked, r2], "gpuusagesummaries": p.summaries}


@pytest.fixture
def server() -> Iterator[ApiServer]:
    """The emulator serving the CRDs, holding :func:`cluster` (written through its API)."""
    with serving() as srv:
        for plural, objects in cluster().items():
            for obj in objects:
                create(srv, plural, obj)
        yield srv


class Lists:
    """The command's request function against ``server``, asking for pages of one item whatever
    the limit the command sends, so that every list takes the emulator's continue tokens."""

    def __init__(self, server: ApiServer) -> None:
        self.kube = KubeClient(api_client(server, retries=False))
        self.calls: list[tuple[str, dict[str, str]]] = []

    def __call__(self, method: str, path: str, query: Mapping[str, str]) -> dict[str, Any]:
        assert method == "GET" and "limit" in query
        self.calls.append((path, dict(query)))
        return self.kube.request(method, path, {**query, "limit": "1"})


@pytest.fixture
def lists(server: ApiServer) -> Iterator[Lists]:
    found = Lists(server)
    yield found
    found.kube.close()


def test_each_namespace_and_class_counts_summaries_and_live_buckets_once(lists: Lists):
    rows = cluster_rows(lists, None, None, price_table(PRICES))
    got = {(r.namespace, r.device_class): (r.gpu_hours, r.energy_kwh, r.cost) for r in rows}
    assert got[("team-a", "gpu.tessera.dev")] == (  # 1 h folded + 0.5 h live
        Decimal("1.5"),
        Decimal(1),
        Decimal("3.95"),  # 1.5 x 2.50 + 1 kWh x 0.20, exact
    )
    assert got[("team-b", "gpu.tessera.dev")][0] == Decimal("0.5")
    assert got[("team-b", "mig.tessera.dev")][0] == Decimal(2)
    pages = [q for p, q in lists.calls if p == "/apis/tessera.dev/v1alpha1/gpuusagesummaries"]
    assert len(pages) == 2 and "continue" not in pages[0] and pages[1]["continue"]


def test_a_range_cuts_on_buckets(lists: Lists):
    start, end = time_range("2026-12-01", "", "range", "Europe/Berlin", NOW)
    rows = cluster_rows(lists, start, end, None)
    assert {r.namespace for r in rows if r.device_class == "mig.tessera.dev"} == {"team-b"}
    start, end = time_range("2026-12-01", "", "range", "UTC", NOW)  # 23:00 UTC on 30 Nov: out
    assert "mig.tessera.dev" not in {r.device_class for r in cluster_rows(lists, start, end, None)}
    start, end = time_range("", "2026-12-04T12:15:00Z", "range", "UTC", NOW)
    a = [r for r in cluster_rows(lists, start, end, None) if r.namespace == "team-a"]
    assert a[0].gpu_hours == 1  # the open 12:15 bucket is past the end


def test_a_month_in_a_time_zone_and_clear_errors(lists: Lists):
    start, end = time_range("", "", "month", "Europe/Berlin", NOW)
    assert (start.isoformat(), end.isoformat()) == (
        "2026-12-01T00:00:00+01:00",
        "2027-01-01T00:00:00+01:00",
    )
    with pytest.raises(ConfigError, match="--since '1 Dec': expected a day"):
        time_range("1 Dec", "", "range", "UTC", NOW)
    with pytest.raises(ConfigError, match="--time-zone: unknown time zone 'Mars'"):
        time_range("", "", "month", "Mars", NOW)
    with pytest.raises(ConfigError, match="--period month goes against --since"):
        time_range("2026-12-01", "", "month", "UTC", NOW)
    with pytest.raises(ConfigError, match=r"ends .* before it starts"):
        start, end = time_range("2026-12-02", "2026-12-01", "range", "UTC", NOW)
        cluster_rows(lists, start, end, None)


@pytest.fixture
def api(server: ApiServer, tmp_path: Path) -> Path:
    return server.kubeconfig(tmp_path / "kubeconfig")


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["usage", *args], env or {}, out, err)
    return code, out.getvalue(), err.getvalue()


def test_the_command_reads_the_cluster_over_http_and_prints_json_with_costs(
    api: Path, tmp_path: Path
):
    (tmp_path / "prices.yaml").write_text(yaml.safe_dump(PRICES))
    code, out, err = run(
        "--cluster",
        "--kubeconfig",
        str(api),
        "--prices",
        str(tmp_path / "prices.yaml"),
        "-o",
        "json",
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["currency"] == "EUR" and data["since"] is None
    rows = {(r["namespace"], r["deviceClass"]): r for r in data["rows"]}
    assert rows[("team-a", "gpu.tessera.dev")]["gpuHours"] == "1.500000"
    assert Decimal(rows[("team-a", "gpu.tessera.dev")]["cost"]) == Decimal("3.95")


def test_the_table_and_the_settings_by_environment(api: Path):
    code, out, err = run(
        env={"TESSERA_CLUSTER": "1", "TESSERA_KUBECONFIG": str(api), "TESSERA_SINCE": "2026-12-04"}
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["NAMESPACE", "DEVICECLASS", "GPU-H", "KWH"]
    assert lines[1].split() == ["team-a", "gpu.tessera.dev", "1.500", "1.000"]
    assert lines[-1] == "from 2026-12-04T00:00:00+00:00 to now"


def test_an_unreachable_cluster_is_a_clear_error(tmp_path: Path):
    code, _, err = run("--cluster", "--kubeconfig", str(tmp_path / "missing"))
    assert code != 0 and "tessera: error:" in err and "missing" in err


def test_per_claim_rows_add_the_summaries_day_totals_to_the_live_entries(lists: Lists):
    rows = {(r.namespace, r.claim, r.device_class): r for r in claim_rows(lists, None, None)}
    train_a = rows[("team-a", "train", "gpu.tessera.dev")]
    assert (train_a.claim_uid, train_a.gpu_hours, train_a.energy_kwh) == (
        "uid-team-a-train",
        Decimal("1.5"),  # 1 h from the summary's claims, 0.5 h live
        Decimal(1),
    )
    assert rows[("team-b", "train", "mig.tessera.dev")].gpu_hours == 2
    start, end = time_range("2026-12-01", "", "range", "UTC", NOW)
    assert ("team-b", "train", "mig.tessera.dev") not in {
        (r.namespace, r.claim, r.device_class) for r in claim_rows(lists, start, end)
    }


def test_per_claim_rows_need_whole_utc_days(lists: Lists):
    start, end = time_range("2026-12-01", "", "range", "Europe/Berlin", NOW)
    with pytest.raises(ConfigError, match="whole UTC days only"):
        claim_rows(lists, start, end)


def test_the_command_shows_claims(api: Path):
    code, out, err = run("--cluster", "--kubeconfig", str(api), "--by", "claim")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["NAMESPACE", "CLAIM", "DEVICECLASS", "GPU-H", "KWH"]
    assert ["team-a", "train", "gpu.tessera.dev", "1.500", "1.000"] in [
        line.split() for line in lines
    ]
