"""The state directory's lock: one holder, a bounded wait that a stop event ends, the holder's
record, and writes that only the holder makes (the guard).

Two StateLock objects in one process conflict like two processes: flock locks belong to the
open file description, and each StateLock opens the file itself."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from agent.errors import StateDirInUse, StateDirLost, StateDirNotHeld
from agent.statelock import Holder, StateLock


class Tries(threading.Event):
    """A stop event that tells the test each time a waiting acquire has tried and goes to
    sleep (the handshake: the waiter has really found the lock taken)."""

    def __init__(self) -> None:
        super().__init__()
        self.tried = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.tried.set()
        return super().wait(timeout)


def acquire_in_thread(lock: StateLock, **kw) -> tuple[threading.Thread, list[bool]]:
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(lock.acquire(wait=True, **kw)))
    thread.start()
    return thread, result


def test_a_second_holder_is_refused_with_the_first_ones_pid(tmp_path):
    first = StateLock(tmp_path)
    assert first.acquire() and first.held
    with pytest.raises(StateDirInUse) as refused:
        StateLock(tmp_path).acquire()
    assert refused.value.holder == os.getpid()
    assert refused.value.path == str(tmp_path / "agent.lock")
    first.release()


def test_a_waiting_acquire_gets_the_lock_once_the_holder_lets_go(tmp_path):
    old, new = StateLock(tmp_path, "pod-old"), StateLock(tmp_path, "pod-new")
    old.acquire()
    stop = Tries()
    thread, result = acquire_in_thread(new, stop=stop, poll=0.01)
    assert stop.tried.wait(10)  # it tried, found the lock taken, and waits
    assert not new.held and result == []
    assert new.holder() == Holder(os.getpid(), "pod-old")
    old.release()
    thread.join(10)
    assert result == [True] and new.held
    assert old.holder() == Holder(os.getpid(), "pod-new")  # the record names the new holder
    assert str(old.holder()) == f"PID {os.getpid()} of pod pod-new"
    new.release()


def test_a_stop_event_ends_the_wait_without_the_lock(tmp_path):
    holder = StateLock(tmp_path)
    holder.acquire()
    waiter = StateLock(tmp_path)
    stop = Tries()
    thread, result = acquire_in_thread(waiter, stop=stop, poll=0.01)
    assert stop.tried.wait(10)
    stop.set()
    thread.join(10)
    assert result == [False] and not waiter.held and holder.held
    holder.release()


def test_a_timeout_of_zero_is_one_attempt(tmp_path):
    holder = StateLock(tmp_path)
    holder.acquire()
    assert StateLock(tmp_path).acquire(wait=True, timeout=0) is False
    holder.release()
    again = StateLock(tmp_path)
    assert again.acquire(wait=True, timeout=0) is True
    again.release()


def test_the_record_without_a_pod_and_of_nobody():
    assert str(Holder(12)) == "PID 12"
    assert str(Holder(None)) == "a process whose PID is not recorded"


def test_writes_under_the_guard_only_while_the_lock_is_ours(tmp_path):
    lock = StateLock(tmp_path)
    # never taken (a rolling update's successor)
    with pytest.raises(StateDirNotHeld) as refused, lock.guard():
        pytest.fail("the guard let a write through without the lock")
    assert refused.value.temporary and str(tmp_path / "agent.lock") in str(refused.value)
    lock.acquire()
    with lock.guard():
        pass
    lock.release()
    with pytest.raises(StateDirNotHeld), lock.guard():  # handed over already
        pytest.fail("the guard let a write through after the release")


def test_no_write_once_the_state_directory_was_deleted_or_replaced(tmp_path: Path) -> None:
    """Another agent could lock the file now at the path: a write there (which would recreate
    the directory) is refused until a restart takes the directory again."""
    state = tmp_path / "state"
    state.mkdir()
    lock = StateLock(state)
    lock.acquire()
    shutil.rmtree(state)
    with pytest.raises(StateDirLost) as refused, lock.guard():
        pytest.fail("the guard let a write through into a deleted state directory")
    assert isinstance(refused.value, StateDirNotHeld) and refused.value.temporary
    assert "deleted or replaced while the agent runs" in str(refused.value)
    state.mkdir()
    (state / "agent.lock").write_text("")  # replaced: a file the lock is not on
    with pytest.raises(StateDirLost), lock.guard():
        pytest.fail("the guard let a write through past a replaced lock file")
    lock.release()
    again = StateLock(state)  # the restart
    again.acquire()
    with again.guard():
        pass
    again.release()


def test_release_waits_for_a_write_in_progress(tmp_path):
    lock = StateLock(tmp_path)
    lock.acquire()
    writing, finish = threading.Event(), threading.Event()
    order: list[str] = []

    def write() -> None:
        with lock.guard():
            writing.set()
            finish.wait(10)
            order.append("written")

    writer = threading.Thread(target=write)
    writer.start()
    assert writing.wait(10)
    releaser = threading.Thread(target=lambda: (lock.release(), order.append("released")))
    releaser.start()
    releaser.join(0.2)  # a release that did not wait would be done by now
    assert releaser.is_alive() and lock.held
    finish.set()
    writer.join(10)
    releaser.join(10)
    assert order == ["written", "released"] and not lock.held
    successor = StateLock(tmp_path)
    assert successor.acquire()  # and the next holder gets it
    successor.release()


def test_the_checkpoint_is_written_only_by_the_holder_of_the_state_directory(tmp_path):
    from dra_driver.errors import CheckpointError
    from dra_driver.kubeletplugin.checkpoint import Checkpoint, CheckpointStore

    lock = StateLock(tmp_path)
    path = tmp_path / "checkpoint.json"
    store = CheckpointStore(path, "boot", guard=lock.guard)
    with pytest.raises(CheckpointError) as refused:
        store.save(Checkpoint("boot"))
    assert f"cannot write checkpoint {path}" in str(refused.value)
    assert "does not hold" in str(refused.value) and not path.exists()
    path.write_text('{"version": 1, "kind": "Checkp')  # corrupt: moving it aside is a write too
    with pytest.raises(CheckpointError, match="cannot move aside the corrupt checkpoint"):
        store.load()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.json"]  # left alone
    lock.acquire()
    assert store.load().corrupt_moved_to is not None
    store.save(Checkpoint("boot"))
    assert store.load().checkpoint == Checkpoint("boot")
    lock.release()
