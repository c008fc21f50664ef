"""A hostile node's MPS daemons (issue 23, item 10): wedged daemons (stopped with SIGSTOP: they
take no ``quit``, and SIGTERM waits until they run again) are stopped at once, each claim
answered for what happened to it, within the kubelet's deadline; a daemon killed under a
prepared claim is noticed."""

from __future__ import annotations

import os
import signal
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


def test_six_wedged_daemons_on_one_gpu_are_stopped_within_the_call_deadline(shares_node):
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
