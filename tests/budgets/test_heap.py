"""The reconcile's pause of the garbage collector (dra_driver/budgets/heap.py): off within the
block, back as it was after it, also when the block raises."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from dra_driver.budgets.heap import collector_paused


@pytest.fixture
def collector_on() -> Iterator[None]:
    was_on = gc.isenabled()
    gc.enable()
    yield
    if not was_on:
        gc.disable()


def test_the_collector_is_off_within_the_block_and_on_after(collector_on: None) -> None:
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_the_collector_is_on_again_when_the_block_raises(collector_on: None) -> None:
    with pytest.raises(ValueError, match="planner bug"), collector_paused():
        raise ValueError("planner bug")
    assert gc.isenabled()


def test_a_collector_turned_off_before_stays_off(collector_on: None) -> None:
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()
    gc.enable()
