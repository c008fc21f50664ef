"""The publisher's plans and loop against the standalone store and a scripted failing store."""

from __future__ import annotations

import copy
import dataclasses
import logging
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dra_driver.advertise.publisher import Backoff, Publisher, plan_changes
from dra_driver.advertise.slice_stores import DirSliceStore
from dra_driver.advertise.slices import SlicePolicy
from dra_driver.device_model import DeviceModel, DevicePolicy, advertised_devices
from dra_driver.device_types import DeviceTaint
from dra_driver.errors import KubeConflict, KubeError
from tests.dra_driver.conftest import Inventory

LOG = logging.getLogger("test.publisher")
POLICY = SlicePolicy(driver_name="gpu.tessera.dev", node_name="node-a")


@pytest.fixture
def h100(inventory):
    return advertised_devices(inventory("dgx-h100"), DevicePolicy())


@pytest.fixture
def a100_dynamic(inventory):
    return advertised_devices(inventory("dgx-a100"), DevicePolicy(mig_mode="dynamic"))


def publisher(store, model, **kw) -> Publisher:
    """A publisher whose own clock stands still: ``step(now)`` is the only time that passes."""
    kw.setdefault("clock", lambda: 0.0)
    p = Publisher(store, POLICY, LOG, backoff=Backoff(rng=random.Random(1)), **kw)
    p.set_devices(model)
    return p


def test_plan_from_empty_creates_everything_at_generation_1(a100_dynamic):
    plan = plan_changes([], a100_dynamic, POLICY)
    assert plan.generation == 1 and not plan.updates and not plan.deletes
    assert len(plan.creates) == plan.creates[0]["spec"]["pool"]["resourceSliceCount"] > 1


def test_first_publish_then_nothing_to_write(tmp_path, h100):
    store = DirSliceStore(tmp_path)
    p = publisher(store, h100)
    assert p.reconcile().writes == 1
    again = p.reconcile()
    assert again.writes == 0 and again.generation == 1
    (obj,) = store.list()[0]
    assert obj["spec"]["pool"] == {"name": "node-a", "generation": 1, "resourceSliceCount": 1}


def test_restart_adopts_published_slices_without_writing(tmp_path, a100_dynamic):
    first = publisher(DirSliceStore(tmp_path), a100_dynamic)
    created = first.reconcile().writes
    second = publisher(DirSliceStore(tmp_path), a100_dynamic)
    assert created > 1
    assert second.reconcile().writes == 0
    assert second.stats.writes == 0


def test_ten_minutes_of_steady_state_write_nothing(tmp_path, h100):
    p = publisher(DirSliceStore(tmp_path), h100, resync_interval=30.0)
    now = 0.0
    while now <= 600.0:  # t = 0, 30, ..., 600
        now += p.step(now) or 30.0
    assert p.stats.writes == 1  # the first publish only
    assert p.stats.reconciles == 21  # start + one resync every 30 s


def test_a_change_within_one_slice_is_one_write_in_place(tmp_path, inventory, h100):
    """A one-slice pool whose devices change: the slice is replaced at the same generation
    (one atomic write: the scheduler never sees the pool half-changed), as Kubernetes' own
    ResourceSlice controller does."""
    store = DirSliceStore(tmp_path)
    p = publisher(store, h100)
    p.reconcile()
    changed = advertised_devices(inventory("dgx-h100", "all-1g"), DevicePolicy())
    p.set_devices(changed)
    plan = p.reconcile()
    assert plan.generation == 1 and plan.writes == 1 and len(plan.updates) == 1
    (obj,) = store.list()[0]
    assert len(obj["spec"]["devices"]) == 56 and obj["spec"]["pool"]["generation"] == 1
    assert p.reconcile().writes == 0


TAINT = DeviceTaint("gpu.tessera.dev/unhealthy", "xid-79", "NoSchedule", "2026-01-02T03:04:05Z")


def _tainted(model: DeviceModel, minor: int) -> DeviceModel:
    return DeviceModel(
        devices=tuple(
            dataclasses.replace(
                d,
                taints=(
                    DeviceTaint(
                        "gpu.tessera.dev/unhealthy", "xid-79", "NoSchedule", "2026-01-02T03:04:05Z"
                    ),
                ),
            )
            if d.gpu_minor == minor
            else d
            for d in model.devices
        ),
        counter_sets=model.counter_sets,
    )


def test_a_taint_on_one_gpu_rewrites_its_slice_alone_and_a_wider_change_the_pool(
    tmp_path, a100_dynamic
):
    """dgx-a100 in dynamic MIG mode is a 5-slice pool: a taint on GPU 0's devices (all in one
    slice) is one write at the same generation; a change to GPUs in three slices bumps the
    generation and rewrites every slice, so the scheduler never mixes old and new slices."""
    store = DirSliceStore(tmp_path)
    p = publisher(store, a100_dynamic)
    n = p.reconcile().writes
    assert n == 5
    p.set_devices(_tainted(a100_dynamic, 0))
    plan = p.reconcile()
    assert (plan.generation, plan.writes, len(plan.updates)) == (1, 1, 1)
    assert {o["spec"]["pool"]["generation"] for o in store.list()[0]} == {1}
    p.set_devices(_tainted(_tainted(a100_dynamic, 2), 7))  # GPU 0 back, 2 and 7 tainted
    plan = p.reconcile()
    assert (plan.generation, plan.writes) == (2, 5)
    assert {o["spec"]["pool"]["generation"] for o in store.list()[0]} == {2}


def test_drift_is_repaired(tmp_path, h100):
    store = DirSliceStore(tmp_path)
    p = publisher(store, h100)
    p.reconcile()
    (obj,) = store.list()[0]
    edited = copy.deepcopy(obj)
    edited["spec"]["devices"] = edited["spec"]["devices"][:2]
    store.replace(edited)  # someone else edits our slice
    stray = copy.deepcopy(obj)
    stray["metadata"]["name"] = "node-a-leftover"
    store.create(stray)  # and an old slice of ours lingers
    plan = p.reconcile()
    assert plan.deletes == ("node-a-leftover",) and len(plan.updates) == 1
    (fixed,) = store.list()[0]
    assert len(fixed["spec"]["devices"]) == 8 and fixed["spec"]["pool"]["generation"] == 2


def test_cleanup_removes_every_slice(tmp_path, a100_dynamic):
    store = DirSliceStore(tmp_path)
    p = publisher(store, a100_dynamic)
    n = p.reconcile().writes
    assert p.cleanup() == n and store.list()[0] == []


def test_standalone_files_are_whole_yaml_documents(tmp_path, h100):
    publisher(DirSliceStore(tmp_path), h100).reconcile()
    (path,) = tmp_path.glob("*.yaml")
    assert yaml.safe_load(path.read_text())["kind"] == "ResourceSlice"
    assert not list(tmp_path.glob(".*.tmp"))  # no temp files left behind


class Scripted(DirSliceStore):
    """A store whose next calls fail as scripted (a list of exceptions, consumed in order)."""

    def __init__(self, path, faults):
        super().__init__(path)
        self.faults = list(faults)

    def _maybe_fail(self):
        if self.faults:
            raise self.faults.pop(0)

    def create(self, obj):
        self._maybe_fail()
        return super().create(obj)

    def replace(self, obj):
        self._maybe_fail()
        return super().replace(obj)


def test_conflict_rereads_and_retries_at_once(tmp_path, h100):
    store = Scripted(tmp_path, [KubeConflict(409, "Conflict", "", "POST", "/x")])
    p = publisher(store, h100)
    assert p.step(0.0) == 600.0
    assert p.ready and p.stats.conflicts == 1 and p.stats.writes == 1


def test_temporary_failures_back_off_exponentially_then_recover(tmp_path, h100):
    faults = [KubeError(503, "ServiceUnavailable", "", "POST", "/x") for _ in range(4)]
    p = publisher(Scripted(tmp_path, faults), h100)
    now, delays = 0.0, []
    for _ in range(4):
        delays.append(p.step(now))
        now += delays[-1]
        assert not p.ready
    assert all(0.5 * 0.5 * 2**i <= d <= 0.5 * 2**i for i, d in enumerate(delays))
    assert p.step(now) == 600.0 and p.ready
    assert p.stats.errors == 4 and "503" in (p.stats.last_error or "")


def test_backoff_is_capped():
    b = Backoff(base=0.5, cap=30.0, rng=random.Random(3))
    assert all(15.0 <= b.delay(n) <= 30.0 for n in range(8, 40))


class Counting(Scripted):
    """A scripted store that counts the rounds the publisher starts (each begins with a list)."""

    def __init__(self, path: Path, faults: list[Exception]) -> None:
        super().__init__(path, faults)
        self.lists = 0

    def list(self) -> tuple[list[dict[str, Any]], str]:
        self.lists += 1
        return super().list()


def too_many_requests(seconds: float | None) -> KubeError:
    return KubeError(429, "TooManyRequests", "", "POST", "/x", retry_after=seconds)


def test_a_retry_after_longer_than_the_backoff_holds_the_next_round(
    tmp_path: Path, h100: DeviceModel, inventory: Inventory
) -> None:
    store = Counting(tmp_path, [too_many_requests(7.0)])
    p = publisher(store, h100)
    assert p.step(0.0) == 7.0  # the server's 7 s, not the first backoff step (at most 0.5 s)
    assert store.lists == 1 and not p.ready
    # a device change and a watch event during the wait start nothing early
    p.set_devices(advertised_devices(inventory("dgx-h100", "all-1g"), DevicePolicy()))
    p.poke()
    assert p.step(6.9) == pytest.approx(0.1)
    assert store.lists == 1
    assert p.step(7.0) == 600.0 and p.ready and store.lists == 2
    (obj,) = store.list()[0]
    assert len(obj["spec"]["devices"]) == 56  # the change waited for the retry, and made it


def test_the_wait_counts_from_the_failure_not_from_the_start_of_the_round(
    tmp_path: Path, h100: DeviceModel
) -> None:
    """A round that took 0.5 s before its 429: the Retry-After of 2 s counts from the 429."""
    clock = [0.0]

    class SlowList(Counting):
        def list(self) -> tuple[list[dict[str, Any]], str]:
            clock[0] += 0.5  # the list takes half a second; the create then fails
            return super().list()

    store = SlowList(tmp_path, [too_many_requests(2.0)])
    p = publisher(store, h100, clock=lambda: clock[0])
    assert p.step(0.0) == 2.0  # from the end of the round, at 0.5
    assert p.step(2.4) == pytest.approx(0.1) and store.lists == 1
    assert p.step(2.5) == 600.0  # the resync, from the end of this round (at 3.0)
    assert p.ready and store.lists == 2


def test_a_backoff_longer_than_the_retry_after_wins(tmp_path: Path, h100: DeviceModel) -> None:
    faults = [KubeError(503, "ServiceUnavailable", "", "POST", "/x") for _ in range(5)]
    faults.append(too_many_requests(1.0))
    p = publisher(Scripted(tmp_path, faults), h100)
    now = 0.0
    for _ in range(5):
        now += p.step(now)
    expected = Backoff(rng=random.Random(1))
    for n in range(1, 6):
        expected.delay(n)  # the same random draws as the five backoffs so far
    sixth = expected.delay(6)
    assert p.step(now) == pytest.approx(sixth) and sixth >= 8.0  # 16 s with jitter, not 1 s
    assert p.stats.errors == 6


def test_a_device_change_during_a_backoff_waits_for_it(
    tmp_path: Path, h100: DeviceModel, inventory: Inventory
) -> None:
    store = Counting(tmp_path, [KubeError(503, "ServiceUnavailable", "", "POST", "/x")] * 2)
    p = publisher(store, h100)
    first = p.step(0.0)
    p.set_devices(advertised_devices(inventory("dgx-h100", "all-1g"), DevicePolicy()))
    assert p.step(first / 2) == pytest.approx(first / 2) and store.lists == 1
    second = p.step(first)
    assert store.lists == 2 and second >= 0.5  # the second step of the backoff
    assert p.step(first + second) == 600.0 and p.ready


class RecordingStop(threading.Event):
    """A stop event whose waits return at once: each timeout is recorded, and it is set after
    ``waits`` of them (the loop then ends). No time passes."""

    def __init__(self, waits: int) -> None:
        super().__init__()
        self.waits: list[float] = []
        self._limit = waits

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(float(timeout or 0.0))
        if len(self.waits) >= self._limit:
            self.set()
        return self.is_set()


class Watching(DirSliceStore):
    """A watchable store whose watches play scripted outcomes: an exception, or a list of
    events, in order."""

    watchable = True

    def __init__(self, path: Path, outcomes: list[Any]) -> None:
        super().__init__(path)
        self.outcomes = list(outcomes)
        self.watches: list[str] = []

    def watch(self, resource_version: str, timeout_s: int) -> Iterator[dict[str, Any]]:
        self.watches.append(resource_version)
        outcome = self.outcomes.pop(0) if self.outcomes else []
        if isinstance(outcome, Exception):
            raise outcome
        return iter(outcome)


def test_the_watch_waits_out_a_retry_after(tmp_path: Path, h100: DeviceModel) -> None:
    store = Watching(
        tmp_path, [too_many_requests(5.0), KubeError(0, "ConnectionError", "", "WATCH", "/x")]
    )
    p = publisher(store, h100)
    stop = RecordingStop(waits=2)
    p.watch_loop(stop)
    assert stop.waits[0] == 5.0  # the server's wait, not the first backoff step
    assert 0.5 <= stop.waits[1] <= 1.0  # then the backoff's second step
    assert len(store.watches) == 2


def test_a_watch_that_keeps_expiring_is_backed_off_after_the_first_relist(
    tmp_path: Path, h100: DeviceModel
) -> None:
    expired = [{"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}]
    store = Watching(tmp_path, [expired, expired, expired])
    p = publisher(store, h100)
    p._list_rv = "41"
    stop = RecordingStop(waits=2)
    p.watch_loop(stop)
    assert store.watches == ["41", "", ""]  # the first 410 starts over at once, from a new list
    assert 0.25 <= stop.waits[0] <= 0.5 and 0.5 <= stop.waits[1] <= 1.0


def test_every_gpu_of_a_dynamic_node_is_one_slice_so_a_taint_on_any_is_one_write(
    tmp_path, a100_dynamic
):
    """Slices hold whole GPUs where they fit (dgx-a100 dynamic: 4 slices of two GPUs' 50
    devices, not 64/64/64/8 with GPU 7 split), so a taint on any one GPU is one write."""
    minors = sorted({d.gpu_minor for d in a100_dynamic.devices})
    for minor in minors:
        store = DirSliceStore(tmp_path / f"gpu-{minor}")
        p = publisher(store, a100_dynamic)
        p.reconcile()
        p.set_devices(_tainted(a100_dynamic, minor))
        plan = p.reconcile()
        assert (plan.generation, plan.writes) == (1, 1), minor
    slices = [o for o in DirSliceStore(tmp_path / "gpu-0").list()[0] if o["spec"].get("devices")]
    for obj in slices:
        gpus = {d["name"].split("-")[1] for d in obj["spec"]["devices"]}
        assert len(obj["spec"]["devices"]) == 25 * len(gpus)  # whole GPUs only
