"""Group commit: the claims of one kubelet call share their checkpoint writes, and keep their
own errors (``Transactions.prepare_batch`` and ``unprepare_batch``), on a simulated node through
the real tools (NVML's MIG calls over the simulator, simulated nvidia-smi)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from agent.config import Config
from dra_driver.errors import CheckpointError, SharingError
from dra_driver.kubeletplugin.cdi_spec import validate_spec
from dra_driver.kubeletplugin.checkpoint import PREPARE_COMPLETED, Checkpoint
from dra_driver.kubeletplugin.claim_sources import DirClaimSource
from dra_driver.kubeletplugin.claims import ClaimKey
from dra_driver.kubeletplugin.effects import Applied
from dra_driver.kubeletplugin.prepare import Preparer
from tests.dra_driver.test_rebuild import MODEL, Node, opaque
from tests.simnode import mig_instances, reap_mps_daemons, sharing


class Writes:
    """Counts the checkpoint writes of a preparer (and what each wrote)."""

    def __init__(self, agent: Preparer) -> None:
        self.saved: list[Checkpoint] = []
        save = agent.store.save

        def counting(cp: Checkpoint) -> None:
            save(cp)
            self.saved.append(cp)

        agent.store.save = counting  # type: ignore[method-assign]

    def __len__(self) -> int:
        return len(self.saved)


def _node(tmp_path: Path, config: Config) -> Iterator[Node]:
    n = Node(tmp_path, config)
    yield n
    reap_mps_daemons(n.sim, MODEL)
    n.source.nvml.shutdown()


@pytest.fixture
def static_node(tmp_path: Path) -> Iterator[Node]:
    yield from _node(tmp_path, Config.of(simulate=MODEL))


@pytest.fixture
def dynamic_node(tmp_path: Path) -> Iterator[Node]:
    yield from _node(
        tmp_path, Config.of(simulate=MODEL, mig_mode="dynamic", sharing="time-slicing")
    )


def errors(results: Mapping[str, object]) -> dict[str, str]:
    return {uid: r.error for uid, r in results.items()}  # type: ignore[attr-defined]


def specs(node: Node) -> set[str]:
    return {
        p.name.split("claim_", 1)[1].removesuffix(".json")
        for p in (node.state / "cdi").glob("*-claim_*.json")
    }


def test_a_call_of_whole_gpus_is_one_checkpoint_write_each_way(static_node):
    keys = [static_node.claim(f"c{i}", f"gpu-{i}") for i in range(6)]
    agent = static_node.agent()
    writes = Writes(agent)
    assert errors(agent.prepare(keys)) == {k.uid: "" for k in keys}
    # nothing to undo after a crash but the CDI specs: no durable start, one completion
    assert len(writes) == 1
    assert {e.state for e in writes.saved[0].claims.values()} == {PREPARE_COMPLETED}
    assert specs(static_node) == {k.uid for k in keys}
    for uid in specs(static_node):  # what the prepare path writes is what the schema allows
        validate_spec(json.loads(static_node.spec_path(ClaimKey("", "", uid)).read_text()))
    assert errors(agent.prepare(keys)) == {k.uid: "" for k in keys}  # the kubelet again
    assert len(writes) == 1
    assert errors(agent.unprepare(keys)) == {k.uid: "" for k in keys}
    assert len(writes) == 2 and writes.saved[-1].claims == {}
    assert specs(static_node) == set()
    agent.close(5)


class Syncs:
    """The files and directories fsync'd, in order, by path (every thread's)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: list[str] = []
        real = os.fsync

        def recording(fd: int) -> None:
            real(fd)
            self.paths.append(os.readlink(f"/proc/self/fd/{fd}"))

        monkeypatch.setattr(os, "fsync", recording)

    def index(self, path: Path) -> list[int]:
        return [i for i, p in enumerate(self.paths) if p == str(path)]


def test_a_call_syncs_its_completion_once_and_never_the_derived_specs(
    static_node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call's claims are recorded completed by one durable checkpoint write (file fsync,
    rename, directory fsync); their CDI specs are written atomically but not fsync'd (derived
    state: a power loss is a reboot, after which the start removes the specs of the earlier
    boot and writes the prepared claims' again), and their removal is not synced either."""
    keys = [static_node.claim(f"c{i}", f"gpu-{i}") for i in range(6)]
    agent = static_node.agent()
    syncs = Syncs(monkeypatch)
    assert errors(agent.prepare(keys)) == {k.uid: "" for k in keys}
    cdi = static_node.state / "cdi"
    assert [p for p in syncs.paths if Path(p).parent == cdi or p == str(cdi)] == []
    checkpoint, state_dir = syncs.paths
    assert Path(checkpoint).name.startswith(".checkpoint.json.")
    assert state_dir == str(static_node.state)  # the rename made durable
    assert specs(static_node) == {k.uid for k in keys}
    syncs.paths.clear()
    assert errors(agent.unprepare(keys)) == {k.uid: "" for k in keys}
    release, state_dir = syncs.paths
    assert Path(release).name.startswith(".checkpoint.json.") and state_dir == str(
        static_node.state
    )
    assert specs(static_node) == set()
    agent.close(5)


class Died(BaseException):
    """The agent dying at a checkpoint write (as ``kill -9`` there would leave the disk)."""


def test_dynamic_mig_devices_need_no_durable_start_the_start_sweeps_a_crash(
    dynamic_node: Node,
) -> None:
    """A call of dynamic MIG claims writes the checkpoint once, to complete them: a crash
    before that leaves MIG devices and specs that no completed claim owns, and the next start
    removes them all (the sweep by placement, the specs the checkpoint does not list)."""
    keys = [
        dynamic_node.claim("m0", dynamic_node.placement(0, "1g.10gb", 0)),
        dynamic_node.claim("m1", dynamic_node.placement(0, "2g.20gb", 2)),
        dynamic_node.claim("m2", dynamic_node.placement(1, "3g.40gb", 0)),
    ]
    agent = dynamic_node.agent()
    writes = Writes(agent)
    assert errors(agent.prepare(keys)) == {k.uid: "" for k in keys}
    (completed,) = writes.saved
    assert {e.state for e in completed.claims.values()} == {PREPARE_COMPLETED}
    assert errors(agent.unprepare(keys)) == {k.uid: "" for k in keys}
    assert len(writes) == 2

    def dies(cp: Checkpoint) -> None:
        raise Died

    agent.store.save = dies  # type: ignore[method-assign]
    with pytest.raises(Died):
        agent.prepare(keys)
    assert len(mig_instances(dynamic_node.sim, MODEL, 0)) == 2
    assert specs(dynamic_node) == {k.uid for k in keys}
    agent.close(5)
    again = dynamic_node.agent()  # the next start
    assert again.checkpoint.claims == {}
    assert mig_instances(dynamic_node.sim, MODEL, 0) == ()
    assert mig_instances(dynamic_node.sim, MODEL, 1) == ()
    assert specs(dynamic_node) == set()
    assert errors(again.prepare(keys)) == {k.uid: "" for k in keys}  # the kubelet's retry
    assert errors(again.unprepare(keys)) == {k.uid: "" for k in keys}
    again.close(5)


def test_claims_that_change_the_node_are_started_durably_once_for_the_call(dynamic_node):
    long = opaque("TimeSlicing", interval="Long")
    keys = [
        dynamic_node.claim("m0", dynamic_node.placement(0, "1g.10gb", 0)),
        dynamic_node.claim("m1", dynamic_node.placement(0, "2g.20gb", 2)),
        dynamic_node.claim("m2", dynamic_node.placement(1, "3g.40gb", 0)),
        dynamic_node.claim("t0", "gpu-2", config=long),
        dynamic_node.claim("t1", "gpu-2", config=long),
    ]
    agent = dynamic_node.agent()
    writes = Writes(agent)
    assert errors(agent.prepare(keys)) == {k.uid: "" for k in keys}
    assert len(writes) == 2  # every claim started in one write, completed in one
    started, completed = writes.saved
    assert set(started.claims) == set(completed.claims) == {k.uid for k in keys}
    assert all(e.state == "PrepareStarted" for e in started.claims.values())
    placements = {d.placement for e in started.claims.values() for d in e.devices}
    assert len([p for p in placements if p is not None]) == 3  # recorded before they were made
    assert all(d.mig_uuid for k in keys[:3] for d in completed.claims[k.uid].devices)
    assert len(mig_instances(dynamic_node.sim, MODEL, 0)) == 2
    assert sharing(dynamic_node.sim, MODEL).gpus[2].timeslice == 3
    assert errors(agent.unprepare(keys)) == {k.uid: "" for k in keys}
    assert len(writes) == 3 and writes.saved[-1].claims == {}
    assert mig_instances(dynamic_node.sim, MODEL, 0) == ()
    assert sharing(dynamic_node.sim, MODEL).gpus[2].timeslice == 0  # the last sharer reset it
    assert specs(dynamic_node) == set()
    agent.close(5)


def test_each_claim_of_a_call_keeps_its_own_error(static_node):
    first = static_node.claim("first", "gpu-0")
    rival = static_node.claim("rival", "gpu-0")  # the same GPU, in the same call
    fine = static_node.claim("fine", "gpu-1")
    missing = ClaimKey("jobs", "missing", "uid-missing")
    agent = static_node.agent()
    result = errors(agent.prepare([first, rival, missing, fine]))
    assert result[first.uid] == result[fine.uid] == ""
    assert "gpu-0" in result[rival.uid] and "jobs/first" in result[rival.uid]
    assert "missing" in result[missing.uid] and "not found" in result[missing.uid]
    assert set(agent.checkpoint.claims) == {first.uid, fine.uid} == specs(static_node)
    agent.close(5)


def test_a_claim_whose_side_effects_fail_is_undone_alone(dynamic_node):
    good = dynamic_node.claim("good", dynamic_node.placement(0, "1g.10gb", 0))
    bad = dynamic_node.claim("bad", dynamic_node.placement(1, "1g.10gb", 0))
    agent = dynamic_node.agent()
    apply = agent.effects.apply

    def failing(claim: ClaimKey, *args: object) -> Applied:
        applied = apply(claim, *args)  # type: ignore[arg-type]
        if claim.uid == bad.uid:  # its MIG device is made, then something fails
            raise SharingError("the GPU fell off the bus")
        return applied

    agent.effects.apply = failing  # type: ignore[method-assign]
    result = errors(agent.prepare([good, bad]))
    assert result == {good.uid: "", bad.uid: "the GPU fell off the bus"}
    assert set(agent.checkpoint.claims) == {good.uid} == specs(dynamic_node)
    assert len(mig_instances(dynamic_node.sim, MODEL, 0)) == 1
    assert mig_instances(dynamic_node.sim, MODEL, 1) == ()  # the failed claim's undone
    agent.effects.apply = apply  # type: ignore[method-assign]
    assert errors(agent.prepare([good, bad])) == {good.uid: "", bad.uid: ""}  # the retry
    assert errors(agent.unprepare([good, bad])) == {good.uid: "", bad.uid: ""}
    agent.close(5)


def test_a_failed_completion_write_answers_every_claim_and_the_retry_succeeds(static_node):
    keys = [static_node.claim(f"c{i}", f"gpu-{i}") for i in range(3)]
    agent = static_node.agent()
    save = agent.store.save

    def full(cp: Checkpoint) -> None:
        raise CheckpointError("cannot write checkpoint: No space left on device")

    agent.store.save = full  # type: ignore[method-assign]
    result = errors(agent.prepare(keys))
    assert all("No space left on device" in e for e in result.values()), result
    assert specs(static_node) == set()  # no spec of a claim the kubelet was told failed
    agent.store.save = save  # type: ignore[method-assign]
    assert errors(agent.prepare(keys)) == {k.uid: "" for k in keys}
    assert agent.store.load().checkpoint.claims.keys() == {k.uid for k in keys}
    assert specs(static_node) == {k.uid for k in keys}
    agent.close(5)


def test_a_prepared_uid_asked_for_under_other_names_is_refused_naming_its_claim(static_node):
    held = static_node.claim("held", "gpu-0")
    agent = static_node.agent()
    assert errors(agent.prepare([held])) == {held.uid: ""}
    impostor = ClaimKey("other", "name", held.uid)
    (error,) = errors(agent.prepare([impostor])).values()
    assert error == (
        f"claim {impostor}: UID {held.uid!r} is prepared as {held.namespace}/{held.name}"
    )
    assert errors(agent.prepare([held])) == {held.uid: ""}  # its own names still get it
    agent.close(5)


class SlowFor:
    """The claim files, except that reading ``name`` waits until ``release`` is set (an API
    server slow to answer one claim, within the client's own read timeout)."""

    reads_block = True

    def __init__(self, node: Node, name: str) -> None:
        self.files = DirClaimSource(node.state / "resourceclaims")
        self.name = name
        self.reading = threading.Event()
        self.release = threading.Event()

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        if name == self.name:
            self.reading.set()
            self.release.wait(60)
        return self.files.get(namespace, name)


def test_one_slow_claim_read_does_not_hold_back_the_answers_of_the_others(static_node):
    """The kubelet's answer holds every claim of the call: the claims whose work is done are
    answered with their devices even when another claim of the call is not done by the
    deadline (that one alone says so, and a retry returns its result)."""
    keys = [static_node.claim(f"c{i}", f"gpu-{i}") for i in range(3)]
    slow = SlowFor(static_node, "c1")
    agent = static_node.agent(claims=slow, deadline_s=2.0)
    try:
        try:
            results = agent.prepare(keys)
            assert slow.reading.is_set()
        finally:
            slow.release.set()
        assert results[keys[0].uid].error == "" and results[keys[0].uid].devices
        assert results[keys[2].uid].error == "" and results[keys[2].uid].devices
        assert "not done within 2 s" in results[keys[1].uid].error
        assert {keys[0].uid, keys[2].uid} <= specs(static_node)
        assert errors(agent.prepare(keys)) == {k.uid: "" for k in keys}  # the kubelet's retry
        assert errors(agent.unprepare(keys)) == {k.uid: "" for k in keys}
    finally:
        agent.close(5)
