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
from dra_driver.prepare import CRASH_POINTS
from tests.integration.daemon import DRIVER, Daemon, claim_manifest, write_claims
from tests.integration.test_sharing import advertised, sharing_config
from tests.simnode import mig_instances, mps_daemons, reap_mps_daemons, sharing

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


SHARING_POINTS = CRASH_POINTS
"""Every point prepare and unprepare can crash at, the sharing ones included."""


def consistent_node(d: Daemon) -> dict[str, str]:
    """Beyond the CDI specs: the MIG instances are the placements the claims hold, the MPS
    daemons are the ones they record, the time-slice is set while a claim time-slices."""
    cp = d.checkpoint()["claims"]
    specs = {name.split("claim_", 1)[1].removesuffix(".json") for name in d.cdi_files()}
    assert specs == set(cp), f"CDI specs {sorted(specs)} != claims {sorted(cp)}"
    assert all(e["state"] == "PrepareCompleted" for e in cp.values())
    for gpu in range(8):
        held = sorted(
            (dev["placement"][0], dev["placement"][1])
            for e in cp.values()
            for dev in e["devices"]
            if dev.get("placement") and dev["gpuMinor"] == gpu
        )
        have = sorted(
            (i.profile_id, i.placement.start) for i in mig_instances(d.state / "sim", d.model, gpu)
        )
        assert have == held, f"GPU {gpu}: MIG instances {have} != held placements {held}"
    recorded = sorted(e["mps"]["pid"] for e in cp.values() if e.get("mps"))
    assert sorted(x.pid for x in mps_daemons(d.state / "sim", d.model)) == recorded
    sliced = any(dev.get("interval") == "Long" for e in cp.values() for dev in e["devices"])
    assert sharing(d.state / "sim", d.model).gpus[2].timeslice == (3 if sliced else 0)
    return {uid: e["state"] for uid, e in cp.items()}


def test_crash_storm_with_partitions_and_sharing(short_tmp):
    rng = random.Random(20261201)
    d = Daemon(short_tmp, "dgx-h100", "--mig-mode", "dynamic", "--sharing", "time-slicing")
    d.start()
    names = {
        (dev["attributes"]["minor"]["int"], dev["attributes"]["profile"]["string"],
         int(dev["name"].rsplit("-", 1)[1])): dev["name"]
        for dev in advertised(d)
        if dev["attributes"]["type"]["string"] == "mig"
    }  # fmt: skip
    d.stop()
    long = sharing_config("GpuConfig", "TimeSlicing", interval="Long")
    mig_mps = sharing_config("MigDeviceConfig", "MPS", activeThreadPercentage=50)
    plan = [
        (names[(0, "1g.10gb", 0)], None),
        (names[(0, "2g.20gb", 2)], None),
        (names[(1, "3g.40gb", 0)], mig_mps),
        ("gpu-2", long),
        ("gpu-2", long),
        ("gpu-3", sharing_config("GpuConfig", "MPS")),
        ("gpu-4", None),
        (names[(5, "7g.80gb", 0)], None),
    ]
    refs = [ClaimRef("default", f"s{i}", f"uid-s{i}") for i in range(len(plan))]
    write_claims(
        d.state,
        *[
            claim_manifest(r.name, r.uid, [("gpu", dev)], "dgx-h100", config=[cfg] if cfg else None)
            for r, (dev, cfg) in zip(refs, plan, strict=True)
        ],
    )
    crashes, rounds = 0, 40
    try:
        for _ in range(rounds):
            point = rng.choice(SHARING_POINTS)
            d.extra[4:] = ["--sim-crash-at", point]
            d.start()
            consistent_node(d)  # start-up reconcile left the node as the claims say
            batch = rng.sample(refs, rng.randint(1, len(refs)))
            unprep = rng.random() < 0.4

            def call(chunk: list[ClaimRef], unprep: bool = unprep) -> None:
                try:
                    with KubeletClient(d.dra_socket, timeout=30) as k:
                        (k.unprepare if unprep else k.prepare)(chunk)
                except KubeletApiError:
                    pass  # the daemon died under the call, as planned

            threads = [threading.Thread(target=call, args=(batch[i::3],)) for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
            if d.proc is not None and d.proc.poll() is None:
                d.stop()
            else:
                crashes += 1
                assert d.wait_exit() == -9
        d.extra[4:] = []
        d.start()
        consistent_node(d)
        with KubeletClient(d.dra_socket) as k:
            res = k.prepare(refs)["claims"]
        assert all(r["error"] == "" for r in res.values()), res
        assert len(consistent_node(d)) == len(refs)
        with KubeletClient(d.dra_socket) as k:
            assert all(r["error"] == "" for r in k.unprepare(refs)["claims"].values())
        assert consistent_node(d) == {}
        assert d.stop() == 0
    finally:
        d.kill()
        reap_mps_daemons(d.state / "sim", d.model)
    # most points are reached only by some claims (a MIG step, an MPS start), and a claim
    # already prepared reaches none
    assert crashes >= rounds // 5, f"only {crashes} crashes: the storm did not storm"
