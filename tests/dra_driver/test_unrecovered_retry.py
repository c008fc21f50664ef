"""Claims the start could not rebuild are tried again while the agent runs (issue 23, item 8),
not only at the next start: a claim source that answers again, a claim file back. On a simulated
node through the real tools; the retry loop's waits are recorded, never slept."""

from __future__ import annotations

import random
import threading
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.daemon.unrecovered import follow_unrecovered
from dra_driver.advertise.publisher import Backoff
from dra_driver.errors import KubeError
from dra_driver.kubeletplugin.checkpoint import CheckpointStore
from dra_driver.kubeletplugin.claim_sources import DirClaimSource
from tests.dra_driver.test_rebuild import Node, ok, opaque
from tests.simnode import mps_daemons, reap_mps_daemons

MODEL = "dgx-h100"


class Outage:
    """The claim index: the claim files, or a connection refused while ``down``."""

    origin = "api"

    def __init__(self, files: DirClaimSource) -> None:
        self.files = files
        self.down = True

    def by_uid(self, uids: Collection[str]) -> dict[str, dict[str, Any]]:
        if self.down:
            raise KubeError(0, "ConnectionError", "connection refused", "GET", "/apis/...")
        return self.files.by_uid(uids)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    yield n
    reap_mps_daemons(n.sim, MODEL)
    n.source.nvml.shutdown()


def test_an_unrecovered_claim_is_rebuilt_while_running_once_its_claim_can_be_read(node):
    first = node.agent()
    key = node.claim("a", "gpu-5", config=opaque("MPS"))
    ok(first, "prepare", key)
    first.close(0)
    node.corrupt_checkpoint()
    outage = Outage(DirClaimSource(node.state / "resourceclaims"))
    node.index = outage
    agent = node.agent()
    try:
        assert [u.reason for u in agent.unrecovered()] == ["claim_source_unavailable"]
        assert [u.reason for u in agent.retry_unrecovered()] == ["claim_source_unavailable"]
        outage.down = False  # the API server answers again; no restart, no kubelet call
        assert agent.retry_unrecovered() == [] and agent.unrecovered() == []
        entry = agent.checkpoint.claims[key.uid]
        assert (entry.namespace, entry.name, entry.recovered) == ("jobs", "a", False)
        saved = CheckpointStore(node.state / "checkpoint.json", "boot").load()  # as Node.agent
        assert saved.checkpoint.claims[key.uid].name == "a"  # saved, not only in memory
        assert len(mps_daemons(node.sim, MODEL)) == 1  # its MPS daemon adopted, not a second
        ok(agent, "unprepare", key)
        assert not mps_daemons(node.sim, MODEL)
    finally:
        agent.close(0)


def test_the_retries_back_off_and_end_once_every_claim_is_rebuilt(node):
    first = node.agent()
    key = node.claim("a", "gpu-5")
    ok(first, "prepare", key)
    first.close(0)
    node.corrupt_checkpoint()
    outage = Outage(DirClaimSource(node.state / "resourceclaims"))
    node.index = outage
    agent = node.agent()
    waits: list[float] = []
    stop = threading.Event()

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        outage.down = len(waits) < 4  # answers from the 4th retry on
        return stop.is_set()

    try:
        follow_unrecovered(
            agent, stop, backoff=Backoff(base=30.0, cap=600.0, rng=random.Random(1)), wait=wait
        )
        assert len(waits) == 4 and waits == sorted(waits) and 15.0 <= waits[0] <= 30.0
        assert agent.unrecovered() == [] and agent.checkpoint.claims[key.uid].name == "a"
    finally:
        agent.close(0)
