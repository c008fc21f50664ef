"""A slice watch that hangs (issue 23, item 8): a stream that stays open and delivers nothing, no
event and no bookmark, is ended after ``WATCH_SILENCE_S`` on the publisher's clock and opened
again, and the drift it hid is repaired at once. The API-server emulator's ``stall`` fault makes
the hung stream (real HTTP); the publisher's clock is a fake one, moved by the test."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from agent.sim.apiserver import ApiServer
from dra_driver.advertise.publisher import WATCH_SILENCE_S, Publisher
from dra_driver.advertise.slice_stores import KubeSliceStore
from dra_driver.advertise.slices import SlicePolicy
from dra_driver.cluster.kube import KubeClient
from dra_driver.device_model import DeviceModel
from tests.fakeclock import FakeClock

LOG = logging.getLogger("test.watch")
DRIVER, NODE = "gpu.tessera.dev", "node-a"


def wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


@pytest.fixture
def server() -> Iterator[ApiServer]:
    with ApiServer() as s:
        s.put_object("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        yield s


def watches(server: ApiServer) -> list[dict[str, str]]:
    return [r.params for r in server.requests.snapshot() if r.watch]


def test_a_silent_watch_is_restarted_and_the_drift_it_hid_repaired(server, tmp_path, caplog):
    clock = FakeClock()
    kube = KubeClient.from_config(server.kubeconfig(tmp_path / "kubeconfig"))
    p = Publisher(
        KubeSliceStore(kube, DRIVER, NODE),
        SlicePolicy(DRIVER, NODE, layout="1.35"),
        LOG,
        clock=clock,
    )
    p.set_devices(DeviceModel(devices=(), counter_sets=()))
    p.step(clock())
    (published,) = server.objects("resourceslices")
    server.faults.add("GET", r"/resourceslices$", "stall", query_regex="watch=")
    stop = threading.Event()
    loop = threading.Thread(target=p.watch_loop, args=(stop,))
    loop.start()
    try:
        wait_for(lambda: len(watches(server)) == 1)
        assert watches(server)[0]["allowWatchBookmarks"] == "true"
        server.delete_object("resourceslices", published["metadata"]["name"])  # drift, unseen
        clock.advance(WATCH_SILENCE_S - 1)
        assert p.check_watch(clock()) == pytest.approx(1.0)  # quiet, not yet silent too long
        assert p.watch_restarts == 0 and len(watches(server)) == 1
        clock.advance(1)
        with caplog.at_level(logging.WARNING, logger=LOG.name):
            p.check_watch(clock())
        assert p.watch_restarts == 1
        assert "slice watch silent (no event, no bookmark); restarting it" in caplog.messages
        wait_for(lambda: len(watches(server)) == 2)  # opened again, from where it was
        assert watches(server)[1]["resourceVersion"] == watches(server)[0]["resourceVersion"]
        p.step(clock())  # the restart asked for a round: the deleted slice is back
        assert len(server.objects("resourceslices")) == 1
        assert server.rejected == []
    finally:
        stop.set()
        p.stop()
        loop.join(10)
        kube.close()
    assert not loop.is_alive()
