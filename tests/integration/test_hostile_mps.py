"""A hostile node's MPS daemons (issue 23, item 10): wedged daemons (stopped with SIGSTOP: they
take no ``quit``, and SIGTERM waits until they run again) are stopped at once, each claim
answered for what happened to it, within the kubelet's deadline; a daemon killed under a
prepared claim is noticed."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.daemon import Daemon
from tests.integration.test_sharing import claim, ok, prepare, unprepare
from tests.simnode import mps_daemons, reap_mps_daemons

SHARES = ("dgx-h100", "--sharing", "memory-shares", "--memory-share-min", "10Gi")


@pytest.fixture
def shares_node(short_tmp: Path) -> Iterator[Daemon]:
    d = Daemon(short_tmp, SHARES[0], *SHARES[1:]).start()
    yield d
    d.kill()
    reap_mps_daemons(d.state / "sim", d.model)


def test_six_wedged_daemons_on_one_gpu_are_stopped_within_the_call_deadline(
    shares_node: Daemon,
) -> None:
    """Each wedged daemon takes about 10 s to stop (quit unanswered for 5 s, SIGTERM waited on
    for 5 s, then SIGKILL); one after another, six took 60 s and every claim was answered "not
    done within 40 s", also those already undone."""
    d = shares_node
    refs = [claim(d, f"w{i}", "gpu-6", memory="10Gi") for i in range(6)]
    answers = prepare(d, *refs)
    for ref in refs:
        ok(answers, ref)
    daemons = mps_daemons(d.state / "sim", d.model)
    assert len(daemons) == 6
    for daemon in daemons:
        os.kill(daemon.pid, signal.SIGSTOP)  # wedged
    answers = unprepare(d, *refs)
    assert {ref.uid: answers[ref.uid].get("error", "") for ref in refs} == {
        ref.uid: "" for ref in refs
    }
    assert mps_daemons(d.state / "sim", d.model) == []
    assert d.checkpoint()["claims"] == {}


def live_daemon_of(d: Daemon, uid: str) -> int | None:
    """The PID of the claim's running MPS daemon (its pipe directory names the claim)."""
    for daemon in mps_daemons(d.state / "sim", d.model):
        if f"/{uid}/" in f"{daemon.pipe_dir}/":
            return daemon.pid
    return None


def kill_daemon_of(d: Daemon, uid: str) -> int:
    pid = live_daemon_of(d, uid)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    for _ in range(200):  # a hang guard of 10 s: until the simulator no longer lists it
        if all(x.pid != pid for x in mps_daemons(d.state / "sim", d.model)):
            return pid
        threading.Event().wait(0.05)
    raise AssertionError(f"MPS daemon {pid} did not die")


def test_a_repeated_prepare_starts_a_killed_daemon_again_before_it_says_success(
    shares_node: Daemon,
) -> None:
    d = shares_node
    ref = claim(d, "m", "gpu-6", memory="10Gi")
    ok(prepare(d, ref), ref)
    killed = kill_daemon_of(d, ref.uid)
    ok(prepare(d, ref), ref)  # the kubelet asks again: success only with a daemon
    pid = live_daemon_of(d, ref.uid)
    assert pid is not None and pid != killed
    assert d.checkpoint()["claims"][ref.uid]["mps"]["pid"] == pid


def test_a_killed_daemon_is_noticed_and_started_again_without_a_call(shares_node: Daemon) -> None:
    d = shares_node
    ref = claim(d, "m", "gpu-6", memory="10Gi")
    ok(prepare(d, ref), ref)
    killed = kill_daemon_of(d, ref.uid)
    rec = d.wait_log("the MPS daemon of a prepared claim is gone; starting it again")
    assert (rec["uid"], rec["pid"]) == (ref.uid, killed)
    started = d.wait_log("started the MPS daemon of a prepared claim again (it was gone)")
    assert started["claim_uid"] == ref.uid and live_daemon_of(d, ref.uid) == started["pid"]
