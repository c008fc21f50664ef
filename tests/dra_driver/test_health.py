"""The health board: what the kubelet's health stream lists as devices come, go and return."""

from __future__ import annotations

from dra_driver.kubeletplugin.health_stream import HEALTHY, UNHEALTHY, HealthBoard
from tests.fakeclock import FakeClock


def listed(board: HealthBoard) -> dict[str, str]:
    return {s.device: s.health for s in board.snapshot()[1]}


def test_devices_of_a_removed_gpu_that_claims_hold_stay_unhealthy_until_unprepared():
    held = {"gpu-3"}
    clock = FakeClock()
    board = HealthBoard("node-a", clock, held=lambda: held)
    board.set_devices(["gpu-1", "gpu-2", "gpu-3"])
    assert listed(board) == {"gpu-1": HEALTHY, "gpu-2": HEALTHY, "gpu-3": HEALTHY}
    version = board.snapshot()[0]
    clock.t += 5
    board.set_devices(["gpu-1"])  # GPUs 2 and 3 left; a claim holds gpu-3
    v2, states = board.snapshot()
    assert v2 > version
    assert {s.device: s.health for s in states} == {"gpu-1": HEALTHY, "gpu-3": UNHEALTHY}
    assert next(s for s in states if s.device == "gpu-3").updated_at == 1005
    board.mark("gpu-3", HEALTHY)  # a watcher cannot heal a device that is not there
    assert listed(board)["gpu-3"] == UNHEALTHY
    held.clear()  # the claim was unprepared
    assert listed(board) == {"gpu-1": HEALTHY}


def test_a_device_that_returns_starts_healthy_and_others_keep_their_state():
    held = {"gpu-3"}
    board = HealthBoard("node-a", FakeClock(), held=lambda: held)
    board.set_devices(["gpu-1", "gpu-3"])
    board.mark("gpu-1", UNHEALTHY)
    board.set_devices(["gpu-1"])
    board.set_devices(["gpu-1", "gpu-3"])
    assert listed(board) == {"gpu-1": UNHEALTHY, "gpu-3": HEALTHY}


def test_without_holders_a_gone_device_is_dropped():
    board = HealthBoard("node-a", FakeClock())
    board.set_devices(["gpu-0", "gpu-1"])
    board.set_devices(["gpu-0"])
    assert listed(board) == {"gpu-0": HEALTHY}
