"""The node's GpuUsageReport end to end: a real `tessera run --simulate` in kube mode against the
API-server emulator (real HTTP, the real client), a claim prepared over its DRA socket; the report
the agent writes carries the claim's usage by device class, is accepted by the CRD, and is
written once more at a clean stop with what the ledger counted last. Without the CRD the agent
says so once and keeps the usage in its ledger. The CRD is installed through the emulator's API
(tests/crds.py), so the emulator checks every report the agent writes against it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agent.sim.apiserver import ApiServer
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.crds import crd_violations, serving
from tests.integration.daemon import Daemon, claim_manifest
from tests.k8sschema import VERSIONS, validate
from tests.sim.tools_helpers import wait_for

MODEL = "dgx-h100"


def start(server: ApiServer, tmp: Path) -> tuple[Daemon, str]:
    """A kube-mode daemon reporting every 0.3 s, its Node, and a prepared claim (its UID)."""
    kubeconfig = str(server.kubeconfig(tmp / "kubeconfig"))
    d = Daemon(tmp / "state", MODEL, "--kubeconfig", kubeconfig, "--telemetry-interval", "0.2",
               "--usage-report-interval", "0.3")  # fmt: skip
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": d.node, "labels": {"tessera.dev/pool": "reserved"}},
    }
    for version in VERSIONS:
        validate(node, version)
    server.put_object("nodes", node)
    claim = claim_manifest("train", "uid-train", [("gpu", "gpu-0")], d.node, "team-a")
    for version in VERSIONS:
        validate(claim, version)
    uid = server.put_object("resourceclaims", claim)["metadata"]["uid"]
    d.start()
    with KubeletClient(d.dra_socket) as k:
        (result,) = k.prepare([ClaimRef("team-a", "train", uid)])["claims"].values()
    assert result["error"] == "", result
    return d, uid


def usage_of(report: dict[str, Any] | None, uid: str) -> list[dict[str, Any]]:
    if report is None:
        return []
    return [u for b in report["spec"]["buckets"] for u in b["usage"] if u["claimUID"] == uid]


def test_the_report_carries_the_claims_usage_and_a_clean_stop_writes_the_last(short_tmp):
    with serving() as server:
        d, uid = start(server, short_tmp)
        try:
            node = d.node
            wait_for(
                lambda: any(
                    u["allocatedGpuSeconds"] > 0
                    for u in usage_of(server.get_object("gpuusagereports", node), uid)
                ),
                "the claim's usage reported",
            )
            report = server.get_object("gpuusagereports", node)
            assert report is not None and crd_violations("gpuusagereports", report) == []
            spec = report["spec"]
            assert spec["nodeName"] == node and report["metadata"]["name"] == node
            assert spec["nodeLabels"]["tessera.dev/pool"] == "reserved"
            assert report["metadata"]["labels"] == {"tessera.dev/node": node}
            (entry,) = usage_of(report, uid)
            assert (entry["namespace"], entry["claim"], entry["deviceClass"]) == (
                "team-a",
                "train",
                "gpu.tessera.dev",  # from the claim's request, through the checkpoint
            )
            assert entry["product"].startswith("NVIDIA H100") and "migProfile" not in entry
            assert spec["buckets"][-1]["closed"] is False
            wait_for(  # set once the answer is read, after the server stored the report
                lambda: "tessera_usage_report_last_success_timestamp_seconds" in d.scrape(),
                "the last success exported",
            )
            assert d.stop() == 0
            ledger = json.loads((d.state / "usage.json").read_text())
            last = server.get_object("gpuusagereports", node)
            assert last is not None and crd_violations("gpuusagereports", last) == []
            # the last report carries exactly what the ledger holds at the stop
            (kept,) = [h for h in ledger["holdings"] if h["uid"] == uid]
            reported = sum(u["allocatedGpuSeconds"] for u in usage_of(last, uid))
            assert abs(reported - kept["allocatedGpuSeconds"]) < 1e-6
            assert server.rejected == []
        finally:
            d.kill()


def test_without_the_crd_the_agent_says_so_once_and_keeps_counting(short_tmp):
    with ApiServer() as server:  # GpuUsageReport not served
        d, _ = start(server, short_tmp)
        try:
            wait_for(
                lambda: (
                    d.scrape().get("tessera_usage_report_errors_total", {0: 0.0}) != {}
                    and max(d.scrape()["tessera_usage_report_errors_total"].values()) >= 3
                ),
                "three reports refused",
            )
            said = [
                line
                for line in d.logs
                if "GpuUsageReport resource is not served" in str(line.get("msg", ""))
            ]
            assert len(said) == 1, said
            assert said[0]["apply"] == "deploy/daemonset/budgets/gpuusagereport-crd.yaml"
            ledger = json.loads((d.state / "usage.json").read_text())
            assert ledger["buckets"]["buckets"], "the usage waits in the ledger"
        finally:
            d.kill()
