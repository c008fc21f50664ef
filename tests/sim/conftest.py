"""Fixtures for the simulator tests: a fresh FakeNvml per test, its state in tmp_path."""

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.sim.apiserver import ApiServer
from agent.sim.model import load_model
from agent.sim.nvml import FakeNvml
from tests.sim.tools_helpers import NodeFactory

MakeFake = Callable[..., FakeNvml]


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def make_fake(state_dir: Path) -> MakeFake:
    """``make_fake(model, init=True, state_dir=..., mig_layout=...)`` -> an (initialized) fake."""

    def make(
        model: str, *, init: bool = True, directory: Path | None = None, **kw: Any
    ) -> FakeNvml:
        fake = FakeNvml(load_model(model), directory or state_dir, **kw)
        if init:
            fake.nvmlInit()
        return fake

    return make


@pytest.fixture(scope="session")
def sim_nodes(tmp_path_factory: pytest.TempPathFactory) -> NodeFactory:
    """``sim_nodes(model)`` -> a fresh simulated node whose driver root has the stand-in tools."""
    return NodeFactory(tmp_path_factory.mktemp("sim-nodes"))


@pytest.fixture
def server() -> Iterator[ApiServer]:
    """A fresh API-server emulator (modules needing another, e.g. on a fake clock, override it)."""
    with ApiServer() as s:
        yield s
