"""The size of a node's ResourceSlices (bench/slice_bytes.py): deterministic bytes of the JSON
the driver builds, not timings."""

from __future__ import annotations

import itertools
import json
from typing import Any

from bench.common import pool_bytes, simulated_inventory
from bench.slice_bytes import CUTS, DRIVER, NODE, cuts
from dra_driver.advertise.slices import SlicePolicy, build_slices
from dra_driver.device_model import DevicePolicy, advertised_devices

DYNAMIC = DevicePolicy(driver_name=DRIVER, mig_mode="dynamic")
POLICY = SlicePolicy(driver_name=DRIVER, node_name=NODE)


def test_pool_bytes_is_compact_json_summed_over_slices() -> None:
    slices: list[dict[str, Any]] = [{"a": [1, 2]}, {"b": "c d"}]
    assert pool_bytes(slices) == len('{"a":[1,2]}') + len('{"b":"c d"}')
    assert pool_bytes([]) == 0


def test_dgx_a100_dynamic_pool_is_at_most_150_kb() -> None:
    """Issue 25's budget for the default dynamic-MIG layout of an 8-GPU A100 node."""
    with simulated_inventory("dgx-a100") as inv:
        slices = build_slices(advertised_devices(inv, DYNAMIC), POLICY, 1)
    assert sum(len(s["spec"].get("devices", [])) for s in slices) == 200
    assert pool_bytes(slices) <= 150_000
    assert pool_bytes(slices) == sum(len(json.dumps(s, separators=(",", ":"))) for s in slices)


def test_each_cut_saves_bytes_and_the_last_is_what_the_driver_builds() -> None:
    with simulated_inventory("dgx-a100") as inv:
        steps = cuts(inv, DYNAMIC)
        now = pool_bytes(build_slices(advertised_devices(inv, DYNAMIC), POLICY, 1))
    assert [label for label, _ in steps] == ["before issue 25", *(label for label, _ in CUTS)]
    sizes = [b for _, b in steps]
    assert all(a > b for a, b in itertools.pairwise(sizes)), steps
    assert sizes[-1] == now
    assert sizes[0] > 240_000  # the pool issue 25 measured: 200 devices of about 1.2 KB


def test_advertising_fewer_mig_profiles_cuts_further() -> None:
    chosen = DevicePolicy(driver_name=DRIVER, mig_mode="dynamic", mig_profiles=("3g.20gb",))
    with simulated_inventory("dgx-a100") as inv:
        every = build_slices(advertised_devices(inv, DYNAMIC), POLICY, 1)
        fewer = build_slices(advertised_devices(inv, chosen), POLICY, 1)
    names = [d["name"] for s in fewer for d in s["spec"].get("devices", [])]
    assert len(names) == 16 and all("-mig-3g20gb-" in n for n in names)
    assert pool_bytes(fewer) < pool_bytes(every) / 5
