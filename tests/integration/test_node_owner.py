"""The Node's uid, the ResourceSlices' owner, when the API server is out at start (issue 23,
item 8): the agent keeps reading the Node until it has its uid, then has the publisher rewrite
its slices with the ownerReference. Real HTTP to the API-server emulator; waits are recorded,
never slept."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Iterator

import pytest

from agent.daemon.node_owner import NodeOwner
from agent.sim.apiserver import ApiServer
from dra_driver.advertise.publisher import Backoff, Publisher
from dra_driver.advertise.slice_stores import KubeSliceStore
from dra_driver.advertise.slices import SlicePolicy
from dra_driver.cluster.kube import KubeClient
from dra_driver.device_model import DeviceModel

LOG = logging.getLogger("test.owner")
DRIVER, NODE = "gpu.tessera.dev", "node-a"


@pytest.fixture
def server() -> Iterator[ApiServer]:
    with ApiServer() as s:
        s.put_object("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        yield s


@pytest.fixture
def kube(server, tmp_path) -> Iterator[KubeClient]:
    client = KubeClient.from_config(server.kubeconfig(tmp_path))
    yield client
    client.close()


def test_slices_published_during_an_outage_of_node_reads_get_their_owner(server, kube, caplog):
    node_path = rf"^/api/v1/nodes/{NODE}$"
    server.faults.add("GET", node_path, "503", times=4)  # the start's read and 3 retries fail
    owner = NodeOwner(kube, NODE, LOG, backoff=Backoff(base=1.0, cap=8.0, rng=random.Random(3)))
    assert owner.read() is None
    publisher = Publisher(
        KubeSliceStore(kube, DRIVER, NODE),
        SlicePolicy(DRIVER, NODE, layout="1.35"),
        LOG,
        node_uid=owner.uid,
    )
    publisher.set_devices(DeviceModel(devices=(), counter_sets=()))
    publisher.step(0.0)
    (unowned,) = server.objects("resourceslices")
    assert "ownerReferences" not in unowned["metadata"]  # published all the same

    waits: list[float] = []
    stop = threading.Event()

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        return stop.is_set()

    with caplog.at_level(logging.INFO, logger=LOG.name):
        owner.follow(stop, on_known=publisher.poke, wait=wait)
    uid = server.get_object("nodes", NODE)["metadata"]["uid"]
    assert owner.uid() == uid
    assert len(waits) == 4 and waits == sorted(waits)  # backed off between the reads
    assert all(0.5 <= w <= 8.0 for w in waits)
    assert any(
        r.getMessage() == "read the Node: slices are now owned by it" for r in caplog.records
    )
    publisher.step(1.0)  # poked: a round at once, not at the next resync
    (owned,) = server.objects("resourceslices")
    assert owned["metadata"]["ownerReferences"][0]["uid"] == uid
    assert server.rejected == []


def test_following_stops_with_the_agent_while_the_node_cannot_be_read(server, kube):
    server.faults.start_outage("503")
    owner = NodeOwner(kube, NODE, LOG, backoff=Backoff(base=1.0, cap=8.0, rng=random.Random(3)))
    stop = threading.Event()
    waits: list[float] = []

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        if len(waits) == 6:
            stop.set()
        return stop.is_set()

    owner.follow(stop, on_known=lambda: pytest.fail("no uid was read"), wait=wait)
    assert owner.uid() is None and len(waits) == 6
    assert max(waits) <= 8.0  # capped: a long outage is retried every few seconds
