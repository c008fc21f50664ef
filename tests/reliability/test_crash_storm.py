"""Crash storm (`make reliability`): a daemon killed with SIGKILL at random points of prepare and
unprepare, again and again, while a kubelet keeps calling; after every restart the node must be
consistent: every completed claim has exactly its CDI spec, nothing else has one, and the
kubelet's retries converge."""

from __future__ import annotations

import json
import random
import threading

import pytest

from dra_driver.errors import KubeletApiError
from dra_driver.kubelet_calls import ClaimRef
from dra_driver.kubelet_client import KubeletClient
from tests.integration.daemon import DRIVER, Daemon, claim_manifest, write_claims

pytestmark = pytest.mark.reliability

POINTS = ["after-started", "after-cdi", "after-completed", "after-unprepare-commit"]
ROUNDS = 25


def consistent(d: Daemon) -> dict[str, str]:
    """The invariants; returns claim uid -> state."""
    cp = d.checkpoint()["claims"]
    specs = {name.split("claim_", 1)[1].removesuffix(".json") for name in d.cdi_files()}
    completed = {uid for uid, e in cp.items() if e["state"] == "PrepareCompleted"}
    assert specs == completed, f"CDI specs {sorted(specs)} != completed {sorted(completed)}"
    holders: dict[str, str] = {}
    for uid, e in cp.items():
        for dev in e["devices"]:
            assert dev["device"] not in holders, f"{dev['device']} held twice"
            holders[dev["device"]] = uid
    for name in d.cdi_files():
        spec = json.loads((d.cdi_dir / name).read_text())
        assert spec["kind"] == f"k8s.{DRIVER}/claim"
    return {uid: e["state"] for uid, e in cp.items()}


def test_crash_storm(short_tmp):
    rng = random.Random(20261130)
    d = Daemon(short_tmp, "dgx-h100")
    refs = [ClaimRef("default", f"c{i}", f"uid-c{i}") for i in range(8)]
    write_claims(
        d.state,
        *[
            claim_manifest(r.name, r.uid, [("gpu", f"gpu-{i}")], "dgx-h100")
            for i, r in enumerate(refs)
        ],
    )
    crashes = 0
    try:
        for _ in range(ROUNDS):
            point = rng.choice(POINTS)
            d.extra = ["--sim-crash-at", point]
            d.start()
            consistent(d)  # start-up reconcile left a consistent node
            batch = rng.sample(refs, rng.randint(1, len(refs)))
            unprep = rng.random() < 0.4

            def call(chunk: list[ClaimRef], unprep: bool = unprep) -> None:
                try:
                    with KubeletClient(d.dra_socket, timeout=20) as k:
                        (k.unprepare if unprep else k.prepare)(chunk)
                except KubeletApiError:
                    pass  # the daemon died under the call, as planned

            threads = [threading.Thread(target=call, args=(batch[i::3],)) for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            if d.proc is not None and d.proc.poll() is None:
                d.stop()  # the crash point was not reached this round
            else:
                crashes += 1
                assert d.wait_exit() == -9
        # the kubelet's retries converge: everything prepared once, then everything released
        d.extra = []
        d.start()
        with KubeletClient(d.dra_socket) as k:
            res = k.prepare(refs)["claims"]
        assert all(r["error"] == "" for r in res.values()), res
        assert set(consistent(d).values()) == {"PrepareCompleted"} and len(d.cdi_files()) == 8
        with KubeletClient(d.dra_socket) as k:
            assert all(r["error"] == "" for r in k.unprepare(refs)["claims"].values())
        assert consistent(d) == {} and d.cdi_files() == []
        assert d.stop() == 0
    finally:
        d.kill()
    assert crashes >= ROUNDS // 3, f"only {crashes} crashes: the storm did not storm"
