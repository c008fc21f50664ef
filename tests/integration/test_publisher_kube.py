"""The publisher against the API-server emulator over real HTTP, through the production client."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from agent.cli.node_access import open_node
from agent.config import Config
from agent.node import discover
from agent.sim.apiserver import ApiServer
from dra_driver.advertise.publisher import Backoff, Publisher
from dra_driver.advertise.slice_stores import KubeSliceStore
from dra_driver.advertise.slices import SlicePolicy
from dra_driver.cluster.kube import KubeClient
from dra_driver.device_model import DevicePolicy, advertised_devices
from tests.apiclient import api_client

LOG = logging.getLogger("test.kube")
DRIVER = "gpu.tessera.dev"
NODE = "node-a"


def model(tmp_path_factory, name, mig_mode="static", layout=None):
    src = open_node(Config.of(simulate=name, sim_mig_layout=layout), tmp_path_factory.mktemp(name))
    src.nvml.init()
    try:
        return advertised_devices(discover(src), DevicePolicy(mig_mode=mig_mode))
    finally:
        src.nvml.shutdown()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {
        "h100": model(tmp_path_factory, "dgx-h100"),
        "h100-1g": model(tmp_path_factory, "dgx-h100", layout="all-1g"),
        "a100-dyn": model(tmp_path_factory, "dgx-a100", mig_mode="dynamic"),
    }


@pytest.fixture
def server(request, tmp_path) -> Iterator[ApiServer]:
    """An emulator of Kubernetes 1.35, or of the version a test passes (``indirect``)."""
    with ApiServer(kube_version=getattr(request, "param", "1.35.0")) as s:
        s.put_object("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        yield s


@pytest.fixture
def make_publisher(server, tmp_path) -> Iterator[Callable[..., Publisher]]:
    clients: list[KubeClient] = []

    def make(devices, layout="1.35", node_uid=None) -> Publisher:
        kube = KubeClient.from_config(server.kubeconfig(tmp_path))
        clients.append(kube)
        policy = SlicePolicy(DRIVER, NODE, node_uid=node_uid, layout=layout)
        p = Publisher(
            KubeSliceStore(kube, DRIVER, NODE),
            policy,
            LOG,
            resync_interval=600.0,
            backoff=Backoff(base=0.05, cap=0.5, rng=random.Random(7)),
        )
        p.set_devices(devices)
        return p

    yield make
    for c in clients:
        c.close()


def ours(server):
    return [
        o
        for o in server.objects("resourceslices")
        if o["spec"]["driver"] == DRIVER and o["spec"].get("nodeName") == NODE
    ]


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("server", "layout"),
    [("1.35.0", "1.35"), ("1.34.0", "1.34")],
    indirect=["server"],
    ids=["1.35", "1.34"],
)
def test_first_publish_is_valid_and_owned_by_the_node(server, make_publisher, models, layout):
    uid = server.get_object("nodes", NODE)["metadata"]["uid"]
    p = make_publisher(models["a100-dyn"], layout=layout, node_uid=uid)
    plan = p.reconcile()
    slices = ours(server)
    # every write passed the 1.34 and 1.35 schemas and its server's own rules (a 1.35 server
    # refuses the 1.34 layout's slices: devices beside their counter sets)
    assert server.rejected == []
    assert len(slices) == plan.writes == slices[0]["spec"]["pool"]["resourceSliceCount"]
    assert server.writes("resourceslices") == plan.writes
    for s in slices:
        assert s["metadata"]["ownerReferences"][0]["uid"] == uid
        assert s["spec"]["pool"]["generation"] == 1


def test_other_drivers_and_nodes_are_never_touched(server, make_publisher, models):
    foreign = []
    for driver, node in (("nic.example.com", NODE), (DRIVER, "node-b")):
        obj = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{driver}"},
            "spec": {
                "driver": driver,
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": [],
            },
        }
        foreign.append(server.put_object("resourceslices", obj)["metadata"]["resourceVersion"])
    p = make_publisher(models["h100"])
    p.reconcile()
    p.cleanup()
    left = {
        o["metadata"]["name"]: o["metadata"]["resourceVersion"]
        for o in server.objects("resourceslices")
    }
    assert sorted(left.values()) == sorted(foreign)


def test_restart_adopts_and_steady_state_writes_nothing(server, make_publisher, models):
    make_publisher(models["a100-dyn"]).reconcile()
    server.clear_log()
    again = make_publisher(models["a100-dyn"])
    now = 0.0
    while now <= 600.0:
        now += again.step(now) or 60.0
    assert server.writes("resourceslices") == 0
    assert again.ready and again.published_generation == 1


def test_one_device_change_is_one_pass(server, make_publisher, models):
    """A change within the pool's one slice: one write, in place, at the same generation."""
    p = make_publisher(models["h100"])
    p.reconcile()
    server.clear_log()
    p.set_devices(models["h100-1g"])
    p.step(0.0)
    assert server.writes("resourceslices") == 1
    (s,) = ours(server)
    assert s["spec"]["pool"]["generation"] == 1 and len(s["spec"]["devices"]) == 56


@pytest.fixture
def running(make_publisher, models) -> Iterator[Publisher]:
    p = make_publisher(models["h100"])
    stop = threading.Event()
    threads = [
        threading.Thread(target=p.run, args=(stop,)),
        threading.Thread(target=p.watch_loop, args=(stop, 2)),
    ]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: p.ready)
        yield p
    finally:
        stop.set()
        p.stop()
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads)


def test_drift_is_repaired_through_the_watch(server, running):
    (s,) = ours(server)
    s["spec"]["devices"] = s["spec"]["devices"][:1]
    server.put_object("resourceslices", s)  # someone else edits our slice
    wait_for(lambda: len(ours(server)[0]["spec"]["devices"]) == 8)
    assert ours(server)[0]["spec"]["pool"]["generation"] == 1  # one slice: repaired in place
    server.delete_object("resourceslices", s["metadata"]["name"])  # or deletes it
    wait_for(lambda: len(ours(server)) == 1)
    assert ours(server)[0]["spec"]["pool"]["generation"] == 2


@pytest.mark.parametrize(
    ("method", "kind"),
    [("POST", "500"), ("POST", "drop"), ("POST", "429"), ("GET", "503"), ("PUT", "409"),
     ("GET", "garbage"), ("GET", "array"), ("POST", "garbage"), ("GET", "bad-line")],
    ids=["post-500", "post-drop", "post-429", "list-503", "put-409", "list-not-json",
         "list-json-array", "post-not-json", "list-unterminated"],
)  # fmt: skip
def test_recovers_after_faults(server, make_publisher, models, method, kind):
    p = make_publisher(models["h100"])
    if method == "PUT":  # a conflict needs an existing slice to update
        p.reconcile()
        p.set_devices(models["h100-1g"])
    server.faults.add(method, r"/resourceslices", kind, times=2)
    now = 0.0
    for _ in range(10):
        now += p.step(now)
        if p.ready:
            break
    assert p.ready, p.stats
    assert not server.faults.pending()
    assert p.stats.errors >= 1 or kind == "409"  # every failed round is counted
    (s,) = ours(server)
    expected = 56 if method == "PUT" else 8
    assert len(s["spec"]["devices"]) == expected
    assert server.rejected == []


def test_daemon_publishes_in_kube_mode_and_cleans_up(server, short_tmp):
    tmp_path = short_tmp
    kubeconfig = server.kubeconfig(tmp_path)
    tessera = os.path.join(os.path.dirname(sys.executable), "tessera")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    proc = subprocess.Popen(
        [tessera, "run", "--simulate", "dgx-a100", "--mig-mode", "dynamic",
         "--node-name", NODE, "--state-dir", str(tmp_path / "state"),
         "--kubeconfig", str(kubeconfig), "--cleanup-on-exit",
         "--metrics-address", "127.0.0.1:0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        wait_for(lambda: len(ours(server)) == 5, timeout=60)
        node_uid = server.get_object("nodes", NODE)["metadata"]["uid"]
        assert all(s["metadata"]["ownerReferences"][0]["uid"] == node_uid for s in ours(server))
        assert server.rejected == []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert ours(server) == []
        assert proc.stderr is not None
        logs = [json.loads(line) for line in proc.stderr.read().splitlines()]
        assert any(r["msg"] == "removed ResourceSlices" and r["count"] == 5 for r in logs)
        # the slice watch is interrupted on shutdown, not abandoned mid-read
        assert not any(r["msg"] == "tasks did not stop in time" for r in logs)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr:
            proc.stderr.close()


def test_recovers_after_a_timeout(server, models):
    """The server answers too late: the request times out, the next round succeeds."""
    kube = KubeClient(api_client(server, retries=False), timeout=(1.0, 0.5))
    try:
        p = Publisher(
            KubeSliceStore(kube, DRIVER, NODE),
            SlicePolicy(DRIVER, NODE),
            LOG,
            backoff=Backoff(base=0.05, cap=0.5, rng=random.Random(7)),
        )
        p.set_devices(models["h100"])
        server.faults.add("POST", r"/resourceslices", "slow:1.5")
        now = p.step(0.0)
        assert not p.ready and "ConnectionError" in (p.stats.last_error or "")
        for _ in range(5):
            if p.ready:
                break
            time.sleep(0.5)  # let the slow request finish on the server side
            now += p.step(now)
        assert p.ready
        (s,) = ours(server)
        assert len(s["spec"]["devices"]) == 8
    finally:
        kube.close()


@pytest.mark.parametrize(
    "answer",
    [
        {"items": "not a list"},
        {"items": [1]},
        {"items": [{"metadata": {"name": 5}, "spec": {"pool": {}}}]},
        {"items": [{"metadata": {"name": "s"}, "spec": {"pool": {"generation": "2"}}}]},
        {"items": [{"metadata": {"name": "s"}, "spec": {"pool": {"generation": -1}}}]},
        {"items": [{"metadata": {"name": "s", "resourceVersion": 3}, "spec": {"pool": {}}}]},
    ],
    ids=["items-string", "item-number", "name-number", "generation-text", "generation-negative",
         "rv-number"],
)  # fmt: skip
def test_a_list_of_the_wrong_shape_is_a_temporary_error_naming_the_field(answer):
    from dra_driver.advertise.slice_stores import slice_list
    from dra_driver.errors import KubeMalformed

    with pytest.raises(KubeMalformed) as e:
        slice_list(answer)
    assert e.value.temporary and "ResourceSlice list: items" in str(e.value)


def test_the_watch_survives_a_line_that_does_not_parse(server, running):
    """One unparsable line on the watch: the stream ends with a temporary error, the watch is
    opened again and still repairs drift."""
    server.faults.add("GET", r"/resourceslices", "bad-line", query_regex="watch=true")
    wait_for(lambda: not server.faults.pending())
    (s,) = ours(server)
    s["spec"]["devices"] = s["spec"]["devices"][:1]
    server.put_object("resourceslices", s)
    wait_for(lambda: len(ours(server)[0]["spec"]["devices"]) == 8)


def test_a_second_agent_publishing_for_the_same_node_name_warns(
    server, make_publisher, models, caplog
):
    """Two agents started with one node name (a copied --node-name, a cloned machine) write the
    same pool and undo each other's devices. Each sees a pool generation it did not publish
    and warns, saying what to do; a person's edit of a slice (drift, repaired) and a restarted
    agent adopting its slices do not warn."""
    first = make_publisher(models["h100"])
    first.reconcile()
    make_publisher(models["h100"]).reconcile()  # a restart: adopts the same slices, no write
    (s,) = ours(server)
    s["spec"]["devices"] = s["spec"]["devices"][:1]
    server.put_object("resourceslices", s)  # a person's edit
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        first.reconcile()
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        second = make_publisher(models["h100-1g"])  # same node name, other devices
        second.reconcile()
        first.reconcile()
        second.reconcile()
    warned = [r for r in caplog.records if "another publisher" in r.getMessage()]
    assert len(warned) == 2, [r.getMessage() for r in caplog.records]
    for record in warned:
        assert record.levelno == logging.WARNING
        fields = record.fields
        assert fields["node"] == NODE and fields["driver"] == DRIVER
        assert fields["seen_generation"] > fields["published_generation"]
        assert "--node-name" in record.getMessage()
    assert server.rejected == []
