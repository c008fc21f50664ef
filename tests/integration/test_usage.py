"""Usage for budgets end to end: a real `tessera run --simulate` process, a claim prepared over
its DRA socket, the usage ledger read from its state directory and its metrics scraped, across a
``kill -9`` and a clean restart."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.integration.daemon import Daemon, claim_manifest, write_claims
from tests.sim.tools_helpers import wait_for

UID = "uid-train"


def ledger(d: Daemon) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((d.state / "usage.json").read_text())
    return doc


def holding(doc: dict[str, Any]) -> dict[str, Any] | None:
    return next((h for h in doc["holdings"] if h["uid"] == UID), None)


def counted(d: Daemon) -> tuple[float, float, dict[str, Any]]:
    """(allocated GPU-seconds, through, the holding) as the ledger file holds them now."""
    doc = ledger(d)
    h = holding(doc)
    assert h is not None
    return h["allocatedGpuSeconds"], doc["through"], h


def held_for_a_while(d: Daemon) -> None:
    wait_for(
        lambda: (
            (d.state / "usage.json").exists()
            and (h := holding(ledger(d))) is not None
            and h["allocatedGpuSeconds"] > 0
        ),
        "the claim's first counted interval",
    )


def test_a_claim_held_across_a_kill_is_counted_for_every_second_it_was_held_once(
    short_tmp: Path,
):
    d = Daemon(short_tmp, "dgx-h100", "--usage-write-interval", "1").start()
    try:
        write_claims(d.state, claim_manifest("train", UID, [("gpu", "gpu-0")], d.node))
        ref = ClaimRef("default", "train", UID)
        with KubeletClient(d.dra_socket) as k:
            assert k.prepare([ref])["claims"][UID].get("error", "") == ""
        held_for_a_while(d)
        allocated0, through0, h0 = counted(d)
        assert (h0["weight"], h0["rule"], h0["namespace"]) == (1.0, "whole-gpu", "default")

        d.kill()  # SIGKILL: the interval being measured is lost, nothing else
        d.start()
        continued = d.wait_log("usage ledger continued")
        assert continued["reason"] == "credited" and continued["holdings"] == 1
        wait_for(lambda: counted(d)[1] > through0 + continued["gap_seconds"], "a later tick")
        allocated1, through1, h1 = counted(d)
        # every second between the two readings counted once, the downtime included: the
        # ledger's own clock, so this holds however long the kill and the restart took
        assert allocated1 - allocated0 == pytest.approx(through1 - through0, abs=0.05)
        unobserved = h1["unobservedSeconds"] - h0["unobservedSeconds"]
        assert unobserved >= continued["gap_seconds"] - 0.001  # the log rounds to ms
        assert h1["energyJoules"] > h0["energyJoules"]

        scraped = d.scrape()["tessera_usage_allocated_gpu_seconds_total"]
        ours = [v for labels, v in scraped.items() if ("claim_uid", UID) in labels]
        assert len(ours) == 1 and ours[0] >= allocated1
        assert ("rule", "whole-gpu") in next(iter(scraped))

        with KubeletClient(d.dra_socket) as k:
            assert k.unprepare([ref])["claims"][UID].get("error", "") == ""
        wait_for(lambda: counted(d)[2]["releasedAt"] is not None, "the release")
        final, _, _ = counted(d)
        wait_for(lambda: ledger(d)["through"] > counted(d)[2]["releasedAt"], "a tick after")
        assert counted(d)[0] == final  # a released claim counts no more
    finally:
        d.kill()


def test_a_claim_is_counted_from_its_prepare_to_its_unprepare_not_from_ticks(short_tmp: Path):
    """With a 2-second telemetry interval, a claim held for less than that between two ticks is
    still counted for exactly the time between its prepare and its unprepare (the test's instants
    around each call bracket it), and a stop right after the unprepare counts up to it."""
    d = Daemon(short_tmp, "dgx-h100", "--telemetry-interval", "2").start()
    try:
        write_claims(d.state, claim_manifest("train", UID, [("gpu", "gpu-0")], d.node))
        ref = ClaimRef("default", "train", UID)
        with KubeletClient(d.dra_socket) as k:
            before_prepare = time.monotonic()
            assert k.prepare([ref])["claims"][UID].get("error", "") == ""
            prepared = time.monotonic()
            held_for_a_while(d)  # a tick saw it
            before_unprepare = time.monotonic()
            assert k.unprepare([ref])["claims"][UID].get("error", "") == ""
            unprepared = time.monotonic()
        assert d.stop() == 0  # before the next tick, most likely: the stop counts up to it
        allocated, _, _ = counted(d)
        assert before_unprepare - prepared <= allocated <= unprepared - before_prepare
    finally:
        d.kill()
