"""No test leaves a thread, a process or a daemon behind: a pytest plugin (registered by
tests/conftest.py) that compares what runs after each test's teardown with what ran before its
setup, and fails the test's teardown naming what is left.

- threads: every thread started since (threads C code made Python-visible, ``_DummyThread``,
  never end from Python's side and are not counted);
- processes: every process started since that is this worker's child, or that carries this
  worker's mark in its environment (``TESTS_LEAK_OWNER``, inherited by what its children start:
  the agent's daemons, the simulated MPS control daemons, which detach from their parent), and is
  not a zombie.

A thread or process that is ending gets a short grace (``GRACE_S``) before it counts. What a
fixture of a wider scope (module, session) starts in its setup lives as long as the fixture: it
is not counted in the tests that use it, and must be gone, with the same grace, once the fixture
is finalized.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

GRACE_S = 3.0
POLL_S = 0.02
MARK = "TESTS_LEAK_OWNER"
"""Environment variable naming the test process whose tests started a process."""


class LeakError(AssertionError):
    """A test (or a fixture) left threads or processes running."""


def _pids() -> set[int]:
    return {int(name) for name in os.listdir("/proc") if name.isdigit()}


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process; None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def _marked(pid: int, mark: bytes) -> bool:
    try:
        return mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:200]


def _describe(thread: threading.Thread) -> str:
    target = getattr(thread, "_target", None)
    where = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', '?')}"
    return f"thread {thread.name!r} ({where if target is not None else type(thread).__qualname__})"


@dataclass
class Snapshot:
    threads: set[threading.Thread] = field(default_factory=set)
    pids: set[int] = field(default_factory=set)

    @staticmethod
    def now() -> Snapshot:
        return Snapshot(set(threading.enumerate()), _pids())


@dataclass(eq=False)  # pytest keys plugins by identity
class LeakCheck:
    """The plugin; one per test process."""

    mark: bytes = b""
    before: Snapshot = field(default_factory=Snapshot)
    kept: dict[int, Snapshot] = field(default_factory=dict)
    """What each live wider-scoped fixture started, by ``id(fixturedef)``."""

    def pytest_configure(self, config: pytest.Config) -> None:
        os.environ[MARK] = str(os.getpid())
        self.mark = f"{MARK}={os.getpid()}".encode()

    def _kept(self) -> Snapshot:
        out = Snapshot()
        for s in self.kept.values():
            out.threads |= s.threads
            out.pids |= s.pids
        return out

    def _running(
        self, since: Snapshot, threads: set[threading.Thread], pids: set[int]
    ) -> list[str]:
        """What of ``threads``/``pids`` (started after ``since``) still runs after the grace."""
        deadline = time.monotonic() + GRACE_S
        left: list[str] = []
        for t in threads:
            if t in since.threads or isinstance(t, threading._DummyThread):
                continue
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                left.append(_describe(t))
        me = os.getpid()
        pending = {p for p in pids - since.pids if self._ours(p, me)}
        while pending and time.monotonic() < deadline:
            pending = {p for p in pending if (s := _stat(p)) is not None and s[0] != "Z"}
            if pending:
                time.sleep(POLL_S)
        left += [f"process {p}: {_cmdline(p)}" for p in sorted(pending)]
        return left

    def _ours(self, pid: int, me: int) -> bool:
        s = _stat(pid)
        if s is None or s[0] == "Z":
            return False
        return s[1] == me or _marked(pid, self.mark)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, Any, Any]:
        self.before = Snapshot.now()
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(
        self, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
    ) -> Generator[None, Any, Any]:
        if fixturedef.scope == "function":
            return (yield)
        start = Snapshot.now()
        try:
            return (yield)
        finally:
            end = Snapshot.now()
            self.kept[id(fixturedef)] = Snapshot(end.threads - start.threads, end.pids - start.pids)

    def pytest_fixture_post_finalizer(
        self, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
    ) -> None:
        started = self.kept.pop(id(fixturedef), None)
        if started is None:
            return
        left = self._running(Snapshot(), started.threads, started.pids)
        if left:
            raise LeakError(f"fixture {fixturedef.argname!r} left running: " + "; ".join(left))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, Any, Any]:
        result = yield
        since = self.before
        kept = self._kept()
        since = Snapshot(since.threads | kept.threads, since.pids | kept.pids)
        left = self._running(since, set(threading.enumerate()), _pids())
        if left:
            raise LeakError(f"{item.nodeid} left running: " + "; ".join(left))
        return result
