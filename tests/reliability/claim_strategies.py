"""Generated ResourceClaims for the bad-input suites: allocations that point at wrong pools,
devices, drivers and nodes, huge lists, values of the wrong type, and opaque configs near the
valid ones (``tests/test_fuzz_decoders.py`` has the config strategies)."""

from __future__ import annotations

import copy
import functools
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from dra_driver.device_model import DeviceModel
from tests.json_values import json_paths, json_values
from tests.reliability.doors import hostile_text, valid_label
from tests.test_fuzz_decoders import VALID_CONFIGS, _at, near_valid

DRIVER = "gpu.tessera.dev"
FUZZ_DEVICES = [f"gpu-{i}" for i in range(6)]
"""The devices the generated claims of the daemon's doors take (gpu-7 is the good claim's)."""
MIG_DEVICES = ["gpu-0-mig-1g10gb-19-0", "gpu-1-mig-3g40gb-9-4", "gpu-2-mig-7g80gb-0-0"]

small_json = json_values(text=20, keys=6, items=3, leaves=4)
"""A JSON value of the wrong kind, small (generating large ones is what costs)."""
devices = st.one_of(
    st.sampled_from(FUZZ_DEVICES),
    st.sampled_from(FUZZ_DEVICES),
    st.sampled_from([*MIG_DEVICES, "gpu-8", "gpu-00", "GPU-0", "nic-0", "gpu-0 "]),
    hostile_text,
)
drivers = st.one_of(
    st.just(DRIVER),
    st.just(DRIVER),
    st.sampled_from(["nic.example.com", "GPU.TESSERA.DEV", f"{DRIVER}/", f"{DRIVER}\x00", ""]),
    hostile_text,
)
requests = st.one_of(st.sampled_from(["gpu", "gpu/a", "gpu/b", "other", "gpu/"]), hostile_text)
quantities = st.one_of(
    st.sampled_from(["4Gi", "80Gi", "1", "0", "-1Gi", "1e30", "9Ei", "", "x"]),
    st.integers(-1, 2**70),
    small_json,
)


def pools(node: str) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.just(node),
        st.just(node),
        st.sampled_from(["other-node", node.upper(), f"{node}/", ""]),
        hostile_text,
    )


names = st.one_of(valid_label, valid_label, valid_label, valid_label, hostile_text)
"""Claim names: the gRPC door refuses hostile ones before a claim is read (its own suite)."""


@st.composite
def mutated(draw: st.DrawFn, valid: Any) -> Any:
    """A copy of ``valid`` with the value at one random path below the top replaced by a small
    JSON value of any kind (a copy: its parts may be shared, VALID_CONFIGS' own among them)."""
    obj = copy.deepcopy(valid)
    paths = json_paths(obj)[1:]
    if not paths:
        return obj
    path = draw(st.sampled_from(paths))
    _at(obj, path[:-1])[path[-1]] = draw(small_json)
    return obj


def wrong(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly ``strategy``, sometimes another JSON value (a number for a string, a list for an
    object)."""
    return st.one_of(strategy, strategy, strategy, strategy, strategy, small_json)


def results(node: str) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {
            "request": wrong(requests),
            "driver": wrong(drivers),
            "pool": wrong(pools(node)),
            "device": wrong(devices),
        },
        optional={
            "adminAccess": wrong(st.booleans()),
            "shareID": wrong(st.uuids().map(str) | hostile_text),
            "consumedCapacity": wrong(st.fixed_dictionaries({"memory": quantities})),
        },
    )


parameters = st.one_of(
    *[near_valid(v) for v in VALID_CONFIGS],
    st.sampled_from(VALID_CONFIGS),
    st.sampled_from(VALID_CONFIGS),
    small_json,
)
configs = st.fixed_dictionaries(
    {
        "source": wrong(st.sampled_from(["FromClass", "FromClaim", "fromclaim"])),
        "requests": wrong(st.lists(requests, max_size=3)),
        "opaque": wrong(st.fixed_dictionaries({"driver": drivers, "parameters": parameters})),
    }
)


def selectors(node: str) -> st.SearchStrategy[Any]:
    def term(n: Any) -> dict[str, Any]:
        return {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [n]}]}
            ]
        }

    return st.one_of(
        st.just(term(node)),
        st.sampled_from(["other-node", node.upper()]).map(term),
        hostile_text.map(term),
        small_json,
    )


@st.composite
def claim_objects(
    draw: st.DrawFn, node: str, name: str | None = None, uid: str | None = None
) -> dict[str, Any]:
    """A ResourceClaim with an allocation for ``node``: mostly of the right shape with wrong or
    hostile values, sometimes huge lists, sometimes one part replaced by any JSON value."""
    result_list = draw(st.lists(results(node), max_size=5))
    if result_list and draw(st.integers(0, 9)) == 0:  # a huge list: one result many times
        result_list *= draw(st.sampled_from([100, 1_000, 5_000]))
    allocation: dict[str, Any] = {
        "devices": {"results": result_list, "config": draw(st.lists(configs, max_size=4))}
    }
    if draw(st.booleans()):
        allocation["nodeSelector"] = draw(selectors(node))
    obj: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": name if name is not None else draw(names),
            "namespace": draw(st.sampled_from(["fuzz", "default"]) | names),
            "uid": uid if uid is not None else draw(st.uuids().map(str) | valid_label),
        },
        "status": {"allocation": allocation},
    }
    if draw(st.booleans()):
        obj["status"]["reservedFor"] = draw(
            wrong(
                st.lists(
                    st.fixed_dictionaries(
                        {"resource": wrong(st.just("pods")), "name": names, "uid": wrong(names)}
                    ),
                    max_size=3,
                )
            )
        )
    if len(result_list) <= 5 and draw(st.integers(0, 4)) == 0:
        obj = draw(mutated(obj))
    return obj


@functools.cache
def device_model(model: str, mig_mode: str = "static") -> DeviceModel:
    """The devices a simulated node of ``model`` advertises (built once per process)."""
    from agent.cli.node_access import open_node
    from agent.config import Config
    from agent.node import discover
    from dra_driver.device_model import DevicePolicy, advertised_devices

    source = open_node(Config.of(simulate=model, node_name=model), Path(tempfile.mkdtemp()))
    source.nvml.init()
    try:
        return advertised_devices(discover(source), DevicePolicy(mig_mode=mig_mode))
    finally:
        source.nvml.shutdown()


@st.composite
def tame_claims(draw: st.DrawFn, node: str, name: str, uid: str) -> dict[str, Any]:
    """A claim of this driver's devices on ``node``, with valid or near-valid opaque configs:
    most are prepared (their configs' sharing is set up, then undone)."""
    chosen = draw(st.lists(st.sampled_from(FUZZ_DEVICES), min_size=1, max_size=3, unique=True))
    request = draw(st.sampled_from(["gpu", "gpu/a"]))
    config = draw(
        st.lists(
            st.fixed_dictionaries(
                {
                    "source": st.sampled_from(["FromClass", "FromClaim"]),
                    "requests": st.sampled_from([[], ["gpu"], ["other"]]),
                    "opaque": st.fixed_dictionaries(
                        {
                            "driver": st.just(DRIVER),
                            "parameters": st.sampled_from(VALID_CONFIGS)
                            | st.sampled_from(VALID_CONFIGS).flatmap(near_valid),
                        }
                    ),
                }
            ),
            max_size=2,
        )
    )
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "fuzz", "uid": uid},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": request, "driver": DRIVER, "pool": node, "device": d}
                        for d in chosen
                    ],
                    "config": config,
                }
            }
        },
    }
