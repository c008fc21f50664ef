"""The kubelet plugin's socket names (classic and per pod), the removal of stale sockets other
instances left, and the gate that holds DRA calls until the agent holds its state."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from dra_driver.claims import ClaimKey
from dra_driver.health import HealthBoard
from dra_driver.plugin import Gate, PluginServer, socket_paths

DRIVER = "gpu.tessera.dev"
ME = "4f1b2c3d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"
OLD = "0a1b2c3d-0000-4000-8000-00000000000a"
OLDER = "0a1b2c3d-0000-4000-8000-00000000000b"


def test_classic_names_and_per_pod_names_as_the_upstream_helper_makes_them(tmp_path):
    reg, plugins = tmp_path / "registry", tmp_path / "plugins"
    assert socket_paths(reg, plugins, DRIVER) == (
        reg / f"{DRIVER}-reg.sock",
        plugins / DRIVER / "dra.sock",
    )
    assert socket_paths(reg, plugins, DRIVER, ME) == (
        reg / f"{DRIVER}-{ME}-reg.sock",
        plugins / DRIVER / f"dra-{ME}.sock",
    )


def server(short_tmp: Path, instance: str | None, now: float = 10_000.0) -> PluginServer:
    return PluginServer(
        driver_name=DRIVER,
        registry_dir=short_tmp / "r",
        plugins_dir=short_tmp / "p",
        preparer=None,  # type: ignore[arg-type]  # no call reaches it here
        health=HealthBoard(pool="node"),
        log=logging.getLogger("tessera.test.plugin"),
        instance=instance,
        clock=lambda: now,
    )


def stale(path: Path, mtime: float) -> Path:
    """A socket file nobody listens on (a crashed agent's), last changed at ``mtime``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
    os.utime(path, (mtime, mtime))
    return path


def test_stale_sockets_of_other_instances_go_live_and_foreign_ones_stay(short_tmp):
    plugin = server(short_tmp, ME, now=10_000.0)
    reg, dra = plugin.reg_socket.parent, plugin.dra_socket.parent
    gone = [
        stale(reg / f"{DRIVER}-{OLD}-reg.sock", 1_000.0),
        stale(dra / f"dra-{OLD}.sock", 1_000.0),
        stale(reg / f"{DRIVER}-reg.sock", 1_000.0),  # a classic agent's, before the switch
        stale(dra / "dra.sock", 1_000.0),
    ]
    kept = [
        stale(reg / f"{DRIVER}-{OLDER}-reg.sock", 9_995.0),  # too young: maybe between bind
        stale(reg / f"{DRIVER}-other-reg.sock", 1_000.0),  # driver "gpu.tessera.dev-other"?
        stale(reg / f"other.example.com-{OLD}-reg.sock", 1_000.0),  # another driver's
    ]
    not_a_socket = dra / f"dra-{OLDER}.sock"
    not_a_socket.write_text("")
    os.utime(not_a_socket, (1_000.0, 1_000.0))
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # the old pod, still serving
    live.bind(str(dra / "dra-live.sock"))
    live.listen()
    os.utime(dra / "dra-live.sock", (1_000.0, 1_000.0))
    try:
        assert sorted(plugin.remove_stale_sockets()) == sorted(gone)
    finally:
        live.close()
    assert not any(p.exists() for p in gone)
    assert all(p.exists() for p in [*kept, not_a_socket, dra / "dra-live.sock"])


def test_serving_removes_stale_peers_only_in_a_rolling_update(short_tmp):
    old = time.time() - 60
    classic = server(short_tmp, None, now=time.time())
    peer = stale(classic.reg_socket.parent / f"{DRIVER}-{OLD}-reg.sock", old)
    classic.serve()
    try:
        assert peer.exists()  # the classic agent behaves as it always did
        assert classic.sockets_intact() == (True, "serving")
    finally:
        classic.stop(0)
    rolling = server(short_tmp, ME, now=time.time())
    rolling.serve()
    try:
        assert not peer.exists()
        assert rolling.reg_socket.exists() and rolling.dra_socket.exists()
    finally:
        rolling.stop(0)
    assert not rolling.reg_socket.exists() and not rolling.dra_socket.exists()


class Context:
    """The part of grpc.ServicerContext the gate reads."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining


CLAIMS = [ClaimKey("default", "a", "uid-a"), ClaimKey("default", "b", "uid-b")]


def test_an_open_gate_lets_calls_through_and_a_closed_one_answers_each_claim():
    gate = Gate()
    gate.waiting_for = "the state directory /var/lib/tessera (PID 1 of pod old)"
    # 5 s left of the kubelet's deadline is the reserve for the call itself: no wait at all
    refused = gate.refused(CLAIMS, Context(5.0), most=40.0)
    assert refused == {
        c.uid: f"claim {c}: the agent is taking over from the one before it and is still"
        " waiting for the state directory /var/lib/tessera (PID 1 of pod old); the kubelet"
        " retries the call"
        for c in CLAIMS
    }
    gate.open()
    assert gate.refused(CLAIMS, Context(5.0), most=40.0) == {}


def test_a_waiting_call_goes_through_when_the_gate_opens():
    gate = Gate()
    results: list[dict[str, str]] = []
    waiter = threading.Thread(
        target=lambda: results.append(gate.refused(CLAIMS, Context(None), most=60.0))
    )
    waiter.start()
    gate.open()
    waiter.join(10)
    assert results == [{}]


def test_shutting_down_wakes_the_waiting_calls_with_a_retryable_answer():
    gate = Gate()
    results: list[dict[str, str]] = []
    waiter = threading.Thread(
        target=lambda: results.append(gate.refused(CLAIMS, Context(45.0), most=40.0))
    )
    waiter.start()
    gate.abort()
    waiter.join(10)
    assert results == [
        {
            c.uid: f"claim {c}: the agent is shutting down; the kubelet retries it with the"
            " next agent"
            for c in CLAIMS
        }
    ]
    assert not waiter.is_alive()


class Budget(Gate):
    """A gate that never opens and records how long a call would wait at it."""

    def __init__(self) -> None:
        super().__init__()
        self.budgets: list[float] = []

    def wait(self, timeout: float) -> bool:
        self.budgets.append(timeout)
        return False


@pytest.mark.parametrize(
    ("remaining", "budget"),
    [(None, 40.0), (60.0, 40.0), (45.0, 40.0), (20.0, 15.0), (3.0, -2.0)],
    ids=["no-deadline", "long-deadline", "kubelet-45s", "short", "none-left"],
)
def test_a_call_waits_within_its_deadline_less_a_reserve_for_the_call(remaining, budget):
    gate = Budget()
    assert gate.refused(CLAIMS[:1], Context(remaining), most=40.0)
    assert gate.budgets == [budget]
