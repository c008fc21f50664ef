"""Fixed thread pools: every worker starts with the first task, and the count never grows."""

from __future__ import annotations

import threading

import pytest

from agent.threadpool import FixedPool


def workers_named(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"{prefix}_")]


def test_a_pool_starts_every_worker_at_its_first_task_and_a_burst_adds_none() -> None:
    pool = FixedPool(6, "fixed-test")
    try:
        assert workers_named("fixed-test") == []  # built, not used: no threads
        assert pool.submit(lambda: 42).result(10) == 42
        started = workers_named("fixed-test")
        assert len(started) == 6 and all(t.is_alive() for t in started)
        # as many concurrent tasks as workers, held together: still the same six threads
        together = threading.Barrier(6, timeout=10)

        def meet(_: int) -> str:
            together.wait()
            return threading.current_thread().name

        assert sorted(pool.map(meet, range(6))) == sorted(t.name for t in started)
        assert workers_named("fixed-test") == started
    finally:
        pool.shutdown(wait=True)
    assert workers_named("fixed-test") == []


def test_a_pool_needs_a_worker() -> None:
    with pytest.raises(ValueError, match="a pool needs at least one worker, not 0"):
        FixedPool(0, "none")
