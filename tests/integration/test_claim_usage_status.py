"""An unprepared claim's final usage in its ResourceClaim's status, end to end: a real
`tessera run --simulate` in kube mode against the API-server emulator (real HTTP, the real
client), a claim prepared and unprepared over its DRA socket as the kubelet does. After the
unprepare the claim's ``status.devices`` entry for its GPU carries the usage the node's ledger
counted (never more), the entry another driver wrote is kept, the claim passes the upstream
schemas, and nothing was written to the claim's status while it was held."""

from __future__ import annotations

import json
from datetime import datetime
from decimal import Decimal
from typing import Any

from agent.sim.apiserver import ApiServer
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.crds import serving
from tests.integration.daemon import Daemon, claim_manifest
from tests.k8sschema import VERSIONS, validate
from tests.sim.tools_helpers import wait_for

MODEL = "dgx-h100"
NIC = {"driver": "nic.example.com", "pool": "nics", "device": "nic-0", "data": {"mac": "aa"}}


def claim_status(server: ApiServer, uid: str) -> list[dict[str, Any]]:
    claim = server.get_object("resourceclaims", "train", "team-a")
    assert claim is not None and claim["metadata"]["uid"] == uid
    for version in VERSIONS:
        validate(claim, version)
    return list((claim.get("status") or {}).get("devices") or [])


def test_the_claims_status_carries_its_final_usage_after_unprepare(short_tmp):
    with serving() as server:
        kubeconfig = str(server.kubeconfig(short_tmp / "kubeconfig"))
        d = Daemon(short_tmp / "state", MODEL, "--kubeconfig", kubeconfig,
                   "--telemetry-interval", "0.2", "--usage-report-interval", "0.3")  # fmt: skip
        server.put_object(
            "nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": d.node}}
        )
        claim = claim_manifest("train", "uid-train", [("gpu", "gpu-0")], d.node, "team-a")
        # another driver's device, allocated with ours, and the entry that driver wrote
        claim["spec"]["devices"]["requests"].append(
            {"name": "nic", "exactly": {"deviceClassName": "nic.example.com"}}
        )
        claim["status"]["allocation"]["devices"]["results"].append(
            {"request": "nic", **{k: v for k, v in NIC.items() if k != "data"}}
        )
        claim["status"]["devices"] = [NIC]
        for version in VERSIONS:
            validate(claim, version)
        uid = server.put_object("resourceclaims", claim)["metadata"]["uid"]
        ref = ClaimRef("team-a", "train", uid)
        d.start()
        try:
            with KubeletClient(d.dra_socket) as k:
                (result,) = k.prepare([ref])["claims"].values()
                assert result["error"] == "", result
                wait_for(  # the ledger counted the claim (its usage reached the report)
                    lambda: any(
                        u["claimUID"] == uid and u["allocatedGpuSeconds"] > 0
                        for b in (server.get_object("gpuusagereports", d.node) or {})
                        .get("spec", {})
                        .get("buckets", [])
                        for u in b["usage"]
                    ),
                    "the claim's usage counted",
                )
                assert claim_status(server, uid) == [NIC]  # never written while held
                assert k.unprepare([ref])["claims"] == {uid: {"error": ""}}
            wait_for(lambda: len(claim_status(server, uid)) == 2, "the claim's usage written")
            nic, ours = claim_status(server, uid)
            assert nic == NIC
            assert (ours["driver"], ours["pool"], ours["device"]) == (
                "gpu.tessera.dev",
                d.node,
                "gpu-0",
            )
            data = ours["data"]
            assert (data["apiVersion"], data["kind"]) == ("gpu.tessera.dev/v1alpha1", "ClaimUsage")
            through = datetime.fromisoformat(data["through"])
            assert through.tzinfo is not None
            assert d.stop() == 0
            ledger = json.loads((d.state / "usage.json").read_text())
            (held,) = [h for h in ledger["holdings"] if h["uid"] == uid]
            # what the status says was counted, and never more than the ledger's final count
            allocated = Decimal(data["allocatedGpuHours"])
            assert 0 < allocated <= Decimal(held["allocatedGpuSeconds"] / 3600) + Decimal("1e-6")
            energy = Decimal(data["energyKWh"])
            assert 0 < energy <= Decimal(held["energyJoules"] / 3.6e6) + Decimal("1e-6")
            assert through.timestamp() <= ledger["through"] + 1e-6  # RFC 3339: microseconds
            writes = [r.method for r in server.requests.snapshot() if r.path.endswith("/status")]
            assert writes == ["PUT"]  # one write, at unprepare
            assert server.rejected == []
        finally:
            d.kill()
