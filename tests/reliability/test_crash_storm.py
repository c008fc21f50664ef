"""Crash storm (`make reliability`): a daemon killed with SIGKILL at random points of prepare and
unprepare, again and again, while a kubelet keeps calling; after every restart the node must be
consistent (tests/crashnode.py: the checkpoint, exactly one CDI spec per completed claim, no
device held twice, the MIG instances, MPS daemons and GPU settings the claims hold) and the
kubelet's retries converge.

Whether a round crashes depends on what its call finds: a prepare point is reached only by a
claim of the batch that is not prepared yet (and a MIG, time-slicing or MPS step only by a claim
that has one), an unprepare point only by a claim that is. What was prepared when a round starts
depends on how far the concurrent calls of the rounds before got, which is timing. So each round
works out from the checkpoint it starts with whether its point is reachable, and a reachable
round must crash: that holds whatever the timing (a count of crashes does not). The first round
of each seed is reachable (nothing is prepared and it prepares at a prepare point), so every
storm crashes at least once."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dra_driver.errors import KubeletApiError
from dra_driver.kubeletplugin.crash_points import CRASH_POINTS
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.crashmatrix import MIG_STEPS, MPS_STEPS, TIMESLICE_STEPS
from tests.crashnode import MigLayout, leftovers, load_checkpoint, mig_layout, node_violations
from tests.integration.daemon import Daemon, claim_manifest, write_claims
from tests.integration.test_sharing import advertised, sharing_config
from tests.reliability.report import add
from tests.simnode import reap_mps_daemons

pytestmark = pytest.mark.reliability

POINTS = ["after-started", "after-cdi", "after-completed", "after-unprepare-commit"]
ROUNDS = 25
PREPARE_STEPS = frozenset({"after-started", "after-cdi", "after-completed"})
"""Every prepare of a claim that is not prepared yet passes these."""
UNPREPARE_STEPS = frozenset({"after-unprepare-undo", "after-unprepare-commit"})
"""Every unprepare of a prepared claim passes these."""
RERUN = "make reliability (tests/reliability/test_crash_storm.py)"


@dataclass
class Storm:
    """What a storm did, for its assertions and the report."""

    rounds: int = 0
    reachable: int = 0
    """Rounds whose armed point some claim of the call had to pass."""
    crashes: int = 0
    missed: list[str] = field(default_factory=list)
    """Reachable rounds that did not crash."""
    lost: list[str] = field(default_factory=list)

    def record(self, kind: str) -> None:
        add(
            "crash-storm",
            cases=self.rounds,
            faults=self.rounds,
            crashes=self.crashes,
            lost=len(self.lost),
            details={f"{kind}_rounds_reachable_total": self.reachable},
            rerun=RERUN,
        )


def check(d: Daemon, baseline: MigLayout, storm: Storm, when: str) -> None:
    problems = node_violations(d, baseline)
    storm.lost += [f"{when}: {p}" for p in problems]
    assert problems == [], f"{when}:\n" + "\n".join(problems)


def rounds(
    d: Daemon,
    refs: list[ClaimRef],
    points: list[str],
    rng: random.Random,
    storm: Storm,
    steps: Callable[[ClaimRef], frozenset[str]],
    count: int,
    timeout: float,
) -> MigLayout:
    """Play ``count`` rounds: start armed at a random point, call prepare or unprepare for a
    random batch from three threads, see whether it crashed and whether it had to. ``steps`` says
    which prepare points a claim's prepare passes. Returns the MIG layout no claim holds."""
    baseline: MigLayout | None = None
    for i in range(count):
        point = rng.choice(points)
        d.start("--sim-crash-at", point)
        if baseline is None:
            baseline = mig_layout(d)  # before any claim: the layout that is no claim's
        check(d, baseline, storm, f"round {i}: after the start")  # start-up left it consistent
        batch = rng.sample(refs, rng.randint(1, len(refs)))
        unprep = rng.random() < 0.4
        held = set(load_checkpoint(d).claims)  # every one completed (checked above)
        if unprep:
            reachable = point in UNPREPARE_STEPS and any(r.uid in held for r in batch)
        else:
            reachable = any(r.uid not in held and point in steps(r) for r in batch)

        failed: list[KubeletApiError] = []

        def call(
            chunk: list[ClaimRef], unprep: bool = unprep, failed: list[KubeletApiError] = failed
        ) -> None:
            try:
                with KubeletClient(d.dra_socket, timeout=timeout) as k:
                    (k.unprepare if unprep else k.prepare)(chunk)
            except KubeletApiError as exc:
                failed.append(exc)  # the daemon died under the call, as planned

        threads = [threading.Thread(target=call, args=(batch[i::3],)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout * 3)
        storm.rounds += 1
        storm.reachable += reachable
        if failed:  # the socket closed as the daemon died: wait for it, it may still be dying
            assert d.wait_exit() == -9, failed
            storm.crashes += 1
        else:
            assert d.stop() == 0  # the crash point was not reached this round
            if reachable:
                op = "unprepare" if unprep else "prepare"
                storm.missed.append(f"round {i}: {op} {[r.name for r in batch]} passed {point}")
    assert baseline is not None
    return baseline


def converge(d: Daemon, refs: list[ClaimRef], baseline: MigLayout, storm: Storm) -> None:
    """The kubelet's retries converge: everything prepared once, then everything released."""
    d.start()
    check(d, baseline, storm, "after the storm")
    with KubeletClient(d.dra_socket) as k:
        res = k.prepare(refs)["claims"]
    assert all(r["error"] == "" for r in res.values()), res
    check(d, baseline, storm, "after preparing every claim")
    assert set(load_checkpoint(d).claims) == {r.uid for r in refs}
    with KubeletClient(d.dra_socket) as k:
        assert all(r["error"] == "" for r in k.unprepare(refs)["claims"].values())
    left = leftovers(d, baseline)
    storm.lost += left
    assert left == []
    assert d.stop() == 0


def test_crash_storm(short_tmp: Path) -> None:
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
    storm = Storm()
    try:
        baseline = rounds(d, refs, POINTS, rng, storm, lambda r: PREPARE_STEPS, ROUNDS, timeout=20)
        converge(d, refs, baseline, storm)
    finally:
        d.kill()
        storm.record("whole_gpu")
    assert storm.missed == [], "reachable crash points not reached:\n" + "\n".join(storm.missed)
    assert storm.reachable >= 1  # the first round is (see the module docstring)


SHARING_POINTS = list(CRASH_POINTS)
"""Every point prepare and unprepare can crash at, the sharing ones included."""


def test_crash_storm_with_partitions_and_sharing(short_tmp: Path) -> None:
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
    mps = sharing_config("GpuConfig", "MPS")
    plan = [
        (names[(0, "1g.10gb", 0)], None, MIG_STEPS),
        (names[(0, "2g.20gb", 2)], None, MIG_STEPS),
        (names[(1, "3g.40gb", 0)], mig_mps, MIG_STEPS | MPS_STEPS),
        ("gpu-2", long, TIMESLICE_STEPS),
        ("gpu-2", long, TIMESLICE_STEPS),
        ("gpu-3", mps, MPS_STEPS),
        ("gpu-4", None, frozenset()),
        (names[(5, "7g.80gb", 0)], None, MIG_STEPS),
    ]
    refs = [ClaimRef("default", f"s{i}", f"uid-s{i}") for i in range(len(plan))]
    write_claims(
        d.state,
        *[
            claim_manifest(r.name, r.uid, [("gpu", dev)], "dgx-h100", config=[cfg] if cfg else None)
            for r, (dev, cfg, _) in zip(refs, plan, strict=True)
        ],
    )
    own = {r.uid: PREPARE_STEPS | extra for r, (_, _, extra) in zip(refs, plan, strict=True)}
    storm = Storm()
    try:
        baseline = rounds(d, refs, SHARING_POINTS, rng, storm, lambda r: own[r.uid], 40, timeout=30)
        converge(d, refs, baseline, storm)
    finally:
        d.kill()
        reap_mps_daemons(d.state / "sim", d.model)
        storm.record("sharing")
    assert storm.missed == [], "reachable crash points not reached:\n" + "\n".join(storm.missed)
    assert storm.reachable >= 1  # the first round is (see the module docstring)
