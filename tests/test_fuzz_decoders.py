"""Every decoder of untrusted input raises only its own error, whatever it is fed (hypothesis).

Fed: arbitrary JSON values, arbitrary bytes and text, and valid objects with one random part
replaced (the shape a broken or hostile writer produces). The property: the decoder returns, or
raises the one error class its callers handle; nothing else escapes. `make test` runs a few
hundred cases per decoder; `make reliability` runs the `reliability` profile (thousands).
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.decode import load_json, load_yaml_documents
from agent.errors import DecodeError
from agent.telemetry.energy import decode_state
from dra_driver import params
from dra_driver.checkpoint import (
    Checkpoint,
    ClaimEntry,
    PreparedDevice,
    decode,
    encode,
)
from dra_driver.claims import ClaimKey, DirClaimSource, parse_allocation
from dra_driver.errors import (
    CheckpointCorrupt,
    CheckpointTooNew,
    ClaimError,
    KubeMalformed,
    ParamsError,
)
from dra_driver.kube import _event, _json_object
from dra_driver.publisher import slice_list

DRIVER, NODE = "gpu.tessera.dev", "node-a"
KEY = ClaimKey("default", "c1", "uid-1")

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=30,
)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated(draw: st.DrawFn, valid: Any) -> Any:
    """``valid`` with the value at one random path replaced by a random JSON value."""
    obj = copy.deepcopy(valid)
    path = draw(st.sampled_from(_paths(obj)))
    replacement = draw(json_values)
    if not path:
        return replacement
    parent = obj
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = replacement
    return obj


VALID_CLAIM = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceClaim",
    "metadata": {"name": "c1", "namespace": "default", "uid": "uid-1"},
    "status": {
        "allocation": {
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}
                ]
            },
            "devices": {
                "results": [
                    {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"},
                    {"request": "nic", "driver": "nic.example.com", "pool": NODE, "device": "n0"},
                ],
                "config": [
                    {
                        "source": "FromClass",
                        "requests": ["gpu"],
                        "opaque": {
                            "driver": DRIVER,
                            "parameters": {
                                "apiVersion": params.API_VERSION,
                                "kind": "GpuConfig",
                                "sharing": {"strategy": "Exclusive"},
                            },
                        },
                    }
                ],
            },
        }
    },
}
VALID_PARAMS = VALID_CLAIM["status"]["allocation"]["devices"]["config"][0]["opaque"]["parameters"]  # type: ignore[index]
VALID_SLICES = {
    "metadata": {"resourceVersion": "5"},
    "items": [
        {
            "metadata": {"name": "s-0", "resourceVersion": "4"},
            "spec": {"driver": DRIVER, "nodeName": NODE, "pool": {"name": NODE, "generation": 2}},
        }
    ],
}
VALID_CHECKPOINT = json.loads(
    encode(
        Checkpoint(
            "boot",
            {
                "uid-1": ClaimEntry(
                    "uid-1",
                    "default",
                    "c1",
                    "PrepareCompleted",
                    (
                        PreparedDevice(
                            ("gpu",), NODE, "gpu-0", ("k8s.x/claim=uid-1-gpu-0",), "gpu", "GPU-0", 0
                        ),
                    ),
                    1.0,
                )
            },
        )
    )
)
VALID_ENERGY = {
    "kind": "TesseraEnergyState",
    "version": 1,
    "gpus": {"GPU-0": {"energyJoules": 10.0, "index": 0}},
    "claims": [
        {
            "uid": "uid-1",
            "pool": NODE,
            "device": "gpu-0",
            "namespace": "default",
            "claim": "c1",
            "gpuIndex": 0,
            "gpuUUID": "GPU-0",
            "rule": "exclusive",
            "energyJoules": 1.0,
            "gpuSeconds": 1.0,
            "releasedAt": None,
        }
    ],
}

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
"""How many cases: the profile's (tests/conftest.py: `default` 150, `reliability` 2500)."""


@FUZZ
@given(st.one_of(json_values, mutated(VALID_CLAIM)))
def test_claims_decode_or_raise_claim_error(obj):
    try:
        allocation = parse_allocation(obj, KEY, DRIVER, NODE)
    except ClaimError:
        return
    assert all(d.driver == DRIVER and d.pool == NODE for d in allocation.devices)


@FUZZ
@given(st.one_of(json_values, mutated(VALID_PARAMS)))
def test_opaque_configs_validate_or_raise_params_error(obj):
    with contextlib.suppress(ParamsError):
        params.validate(obj)


def _as_bytes(value: Any) -> bytes:
    return json.dumps(value).encode()


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=200),
        json_values.map(_as_bytes),
        mutated(VALID_CHECKPOINT).map(_as_bytes),
        st.binary(max_size=50).map(lambda b: json.dumps(VALID_CHECKPOINT).encode()[:-40] + b),
    )
)
def test_checkpoints_decode_or_raise_a_checkpoint_error(data):
    with contextlib.suppress(CheckpointCorrupt, CheckpointTooNew):
        decode(data)


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=200), json_values.map(_as_bytes), mutated(VALID_ENERGY).map(_as_bytes)
    )
)
def test_energy_state_decodes_or_raises_what_its_loader_handles(data):
    with contextlib.suppress(DecodeError, ValueError, TypeError, KeyError):
        decode_state(data)


@FUZZ
@given(st.one_of(st.binary(max_size=200), json_values.map(_as_bytes)))
def test_api_answers_decode_or_raise_kube_malformed(data):
    for decoder in (lambda: _json_object(data, "GET", "/x"), lambda: _event(data, "/x")):
        try:
            decoder()
        except KubeMalformed as exc:
            assert exc.temporary


@FUZZ
@given(st.one_of(json_values, mutated(VALID_SLICES)))
def test_slice_lists_decode_or_raise_kube_malformed(obj):
    if not isinstance(obj, dict):
        obj = {"items": obj}
    try:
        items, _ = slice_list(obj)
    except KubeMalformed:
        return
    assert all(isinstance(i["metadata"]["name"], str) for i in items)


yaml_texts = st.one_of(
    st.text(max_size=300),
    json_values.map(lambda v: yaml.safe_dump(v, allow_unicode=True)),
    mutated(VALID_CLAIM).map(lambda v: yaml.safe_dump(v)),
    st.lists(
        st.sampled_from(
            [
                "a: &x [1,2]",
                "b: *x",
                "- {",
                "? x",
                "!!python/object:os.system",
                "c: 0x1f",
                "d: 2026-12-01",
                "e: ~",
                "---",
                "  - 1",
            ]
        ),
        max_size=8,
    ).map("\n".join),
)


@FUZZ
@given(yaml_texts)
def test_yaml_decodes_or_raises_decode_error(text):
    with contextlib.suppress(DecodeError):
        load_yaml_documents(text, "t", 10_000)


@FUZZ
@given(st.one_of(st.binary(max_size=300), json_values.map(_as_bytes)))
def test_json_decodes_or_raises_decode_error(data):
    with contextlib.suppress(DecodeError):
        load_json(data, "t", 10_000)


@pytest.fixture(scope="module")
def claim_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("claims")


@FUZZ
@given(yaml_texts)
def test_claim_files_of_any_content_raise_only_claim_errors(claim_dir, text):
    (claim_dir / "c.yaml").write_text(text, errors="surrogateescape")
    source = DirClaimSource(claim_dir)
    try:
        obj = source.get("default", "c1")
    except ClaimError:
        return
    with contextlib.suppress(ClaimError):
        parse_allocation(obj, KEY, DRIVER, NODE)
