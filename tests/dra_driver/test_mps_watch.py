"""``MpsWatch``: a prepared claim's MPS daemon that is gone and cannot be started again fails
the claim's repeated prepare and /readyz's ``mps-daemons`` check, until it can (the daemons
themselves, killed and started again for real, are in tests/integration/test_hostile_mps.py)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dra_driver.errors import SharingError
from dra_driver.kubeletplugin.checkpoint import (
    PREPARE_COMPLETED,
    Checkpoint,
    CheckpointStore,
    ClaimEntry,
)
from dra_driver.kubeletplugin.checkpoint_records import MpsRecord
from dra_driver.kubeletplugin.effects import Effects
from dra_driver.kubeletplugin.ledger import Ledger
from dra_driver.kubeletplugin.locks import ClaimLocks
from dra_driver.kubeletplugin.mps_watch import MpsWatch


class DeadDaemons(Effects):
    """Every daemon is gone; starting one again fails until ``fixed``, then gets PID 4242."""

    def __init__(self) -> None:
        no_model: Any = None  # never asked for: nothing here plans devices
        super().__init__(
            mig=None, settings=None, mps=None, devices=lambda: no_model, log=logging.getLogger("t")
        )
        self.fixed = False
        self.restored: list[str] = []

    def mps_alive(self, entry: ClaimEntry) -> bool:
        return entry.mps is not None and entry.mps.pid == 4242

    def restore(self, entry: ClaimEntry) -> ClaimEntry:
        self.restored.append(entry.uid)
        if not self.fixed:
            raise SharingError("MPS control daemon wrote no PID within 10 s", "mps_not_ready")
        assert entry.mps is not None
        return replace(entry, mps=replace(entry.mps, pid=4242))


def entry(uid: str) -> ClaimEntry:
    mps = MpsRecord(pid=7, started_at=1.0, pipe_dir="/p", log_dir="/l", shm_dir="/s", devices=())
    return ClaimEntry(uid, "jobs", uid, PREPARE_COMPLETED, (), 0.0, mps=mps)


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    ledger = Ledger(CheckpointStore(tmp_path / "checkpoint.json", "boot"))
    ledger.commit(Checkpoint("boot").with_claim(entry("uid-a")))
    return ledger


def test_a_daemon_that_cannot_be_started_again_is_failing_until_it_can(ledger: Ledger) -> None:
    effects = DeadDaemons()
    watch = MpsWatch(
        effects=effects,
        ledger=ledger,
        claim_locks=ClaimLocks(),
        gpu_locks=ClaimLocks(),
        log=logging.getLogger("t"),
    )
    with pytest.raises(SharingError, match="wrote no PID"):  # a repeated prepare
        watch.ensure(ledger.checkpoint.claims["uid-a"])
    assert watch.failing() == ["jobs/uid-a (uid-a): MPS control daemon wrote no PID within 10 s"]
    watch.revive()  # the watch loop's round: still failing, tried again
    assert effects.restored == ["uid-a", "uid-a"] and len(watch.failing()) == 1
    effects.fixed = True
    watch.revive()
    assert watch.failing() == []
    assert ledger.checkpoint.claims["uid-a"].mps.pid == 4242  # type: ignore[union-attr]
    watch.revive()  # running now: left alone
    assert effects.restored == ["uid-a", "uid-a", "uid-a"]


def test_an_unprepared_claim_is_no_longer_failing(ledger: Ledger) -> None:
    watch = MpsWatch(
        effects=DeadDaemons(),
        ledger=ledger,
        claim_locks=ClaimLocks(),
        gpu_locks=ClaimLocks(),
        log=logging.getLogger("t"),
    )
    watch.revive()
    assert len(watch.failing()) == 1
    ledger.commit(ledger.checkpoint.without_claim("uid-a"))
    watch.revive()
    assert watch.failing() == []


class Unknowable(DeadDaemons):
    """Whether a daemon runs cannot be told (kube mode: its Pod cannot be read, the API server
    down)."""

    def mps_alive(self, entry: ClaimEntry) -> bool:
        raise SharingError("cannot read the MPS Pod tessera-mps-uid-a: 503", "mps_pod_error")


def test_a_round_that_cannot_tell_whether_a_daemon_runs_skips_it_and_the_loop_goes_on(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    """In kube mode the daemon's liveness is its Pod's: an API outage must neither end the
    watch loop (its thread) nor start a second daemon beside one that may well run."""
    effects = Unknowable()
    watch = MpsWatch(
        effects=effects,
        ledger=ledger,
        claim_locks=ClaimLocks(),
        gpu_locks=ClaimLocks(),
        log=logging.getLogger("t"),
    )
    with caplog.at_level(logging.WARNING, "t"):
        watch.revive()
    assert effects.restored == [] and watch.failing() == []
    assert "cannot tell whether" in caplog.records[-1].getMessage()
