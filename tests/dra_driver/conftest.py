"""Fixtures for the DRA driver tests: simulated inventories and a tiny counter allocator.

``inventory(model, layout=None)`` discovers a simulated node once per session (through the real
NVML facade over the simulator, as the agent does); ``layout`` is a ``sim_mig_layout``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import pytest

from agent.cli.node_access import open_node
from agent.config import Config
from agent.discovery.inventory import NodeInventory
from agent.node import discover
from dra_driver.device_model import AdvertisedDevice, DeviceModel

Inventory = Callable[..., NodeInventory]


@pytest.fixture(scope="session")
def inventory(tmp_path_factory: pytest.TempPathFactory) -> Inventory:
    cache: dict[tuple[str, str | None], NodeInventory] = {}

    def get(model: str, layout: str | None = None) -> NodeInventory:
        key = (model, layout)
        if key not in cache:
            state = tmp_path_factory.mktemp(f"{model}-{layout or 'default'}")
            src = open_node(Config.of(simulate=model, sim_mig_layout=layout), state)
            src.nvml.init()
            try:
                cache[key] = discover(src)
            finally:
                src.nvml.shutdown()
        return cache[key]

    return get


def _fits(model: DeviceModel, devices: Iterable[AdvertisedDevice]) -> bool:
    """Whether the devices can all be allocated together: for every counter, the sum of what
    they consume is at most the counter's value (what the scheduler checks)."""
    capacity = {(cs.name, c): int(q) for cs in model.counter_sets for c, q in cs.counters}
    used: dict[tuple[str, str], int] = {}
    for dev in devices:
        for set_name, counters in dev.consumes_counters:
            for c, q in counters:
                key = (set_name, c)
                if key not in capacity:
                    return False
                used[key] = used.get(key, 0) + int(q)
    return all(v <= capacity[k] for k, v in used.items())


Fits = Callable[[DeviceModel, Iterable[AdvertisedDevice]], bool]


@pytest.fixture(scope="session")
def fits() -> Fits:
    """``fits(model, devices)``: the pure allocator check above."""
    return _fits


def assert_pairs_fit_unless_they_clash(
    fits: Fits, model: DeviceModel, devs: Iterable[AdvertisedDevice]
) -> None:
    """Every two MIG placements of ``devs`` fit together in ``model`` exactly when their memory
    slices do not overlap and they are not both ``+me`` (profile 20: one media extension)."""
    for a, b in itertools.combinations(list(devs), 2):
        assert a.mig_placement_start is not None and b.mig_placement_start is not None
        a_end = a.mig_placement_start + (a.mig_placement_size or 0)
        b_end = b.mig_placement_start + (b.mig_placement_size or 0)
        overlap = a.mig_placement_start < b_end and b.mig_placement_start < a_end
        both_me = a.mig_profile_id == b.mig_profile_id == 20
        assert fits(model, [a, b]) == (not overlap and not both_me), (a.name, b.name)
