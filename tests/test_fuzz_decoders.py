"""Every decoder of untrusted input raises only its own error, whatever it is fed (hypothesis).

Fed: arbitrary JSON values, arbitrary bytes and text, valid objects with one random part
replaced (the shape a broken or hostile writer produces), and, for the opaque config, near-valid
configs of every kind and strategy (the API's own words in the wrong places, extra keys of any
kind, random quantity text). The property: the decoder returns, or
raises the one error class its callers handle; nothing else escapes. `make test` runs a few
hundred cases per decoder; `make reliability` runs the `reliability` profile (thousands).
"""

from __future__ import annotations

import contextlib
import copy
import functools
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
from agent.telemetry.faults import decode_faults
from agent.telemetry.owners import pod_uid, start_time
from dra_driver.advertise.slice_stores import slice_list
from dra_driver.cluster.kube import _event
from dra_driver.cluster.kube_answers import json_object as _json_object
from dra_driver.errors import (
    CheckpointCorrupt,
    CheckpointTooNew,
    ClaimError,
    KubeMalformed,
    ParamsError,
    QuantityError,
)
from dra_driver.kubeletplugin import params
from dra_driver.kubeletplugin.checkpoint import (
    Checkpoint,
    ClaimEntry,
    PreparedDevice,
    decode,
    encode,
)
from dra_driver.kubeletplugin.claim_sources import DirClaimSource
from dra_driver.kubeletplugin.claims import ClaimKey, parse_allocation
from dra_driver.quantity import parse_bytes, parse_quantity
from tests.json_values import json_paths
from tests.json_values import json_values as json_values_of

DRIVER, NODE = "gpu.tessera.dev", "node-a"
GPU_UUID = "GPU-5f1e2d3c-4b5a-6978-8a9b-0c1d2e3f4a5b"
MIG_UUID = "MIG-0a1b2c3d-4e5f-5a6b-8c7d-9e0f1a2b3c4d"
KEY = ClaimKey("default", "c1", "uid-1")

json_values = json_values_of(text=20, keys=12, items=5, leaves=30)


@st.composite
def mutated(draw: st.DrawFn, valid: Any) -> Any:
    """``valid`` with the value at one random path replaced by a random JSON value."""
    obj = copy.deepcopy(valid)
    path = draw(st.sampled_from(json_paths(obj)))
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


# One valid opaque config of every kind and strategy, every field set.
VALID_CONFIGS = [
    VALID_PARAMS,
    {
        "apiVersion": params.API_VERSION,
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}},
    },
    {
        "apiVersion": params.API_VERSION,
        "kind": "GpuConfig",
        "sharing": {
            "strategy": "MPS",
            "mps": {
                "activeThreadPercentage": 50,
                "pinnedMemoryLimit": "4Gi",
                "perDevicePinnedMemoryLimit": {"gpu-1": "2Gi", GPU_UUID: 1073741824},
            },
        },
    },
    {"apiVersion": params.API_VERSION, "kind": "MigDeviceConfig"},
    {
        "apiVersion": params.API_VERSION,
        "kind": "MigDeviceConfig",
        "sharing": {
            "strategy": "MPS",
            "mps": {
                "activeThreadPercentage": 10,
                "pinnedMemoryLimit": "1.5G",
                "perDevicePinnedMemoryLimit": {"gpu-0-mig-1g10gb-19-0": "5Gi", MIG_UUID: "1e9"},
            },
        },
    },
]
quantity_texts = st.one_of(
    st.text(alphabet="0123456789+-.eEnumkKMGTPi ", max_size=24),
    st.sampled_from(["4Gi", "1Mi", "1023Ki", "0", "-1Gi", "9Ei", "1e30", "1e101", "1.5", ".", ""]),
    st.text(max_size=70),
)
# the words of the API and its near misses: a near-valid config is one of them in the wrong place
near_words = st.sampled_from(
    [
        "GpuConfig", "MigDeviceConfig", "gpuconfig", "Exclusive", "TimeSlicing", "timeslicing",
        "MPS", "mps", "Mps", "Default", "Short", "Medium", "Long", "strategy", "timeSlicing",
        "interval", "activeThreadPercentage", "pinnedMemoryLimit", "perDevicePinnedMemoryLimit",
        "sharing", "gpu-0", "gpu-01", "gpu-0-mig-1g10gb-19-0", GPU_UUID, MIG_UUID, "GPU-", "MIG-",
        params.API_VERSION, "gpu.tessera.dev/v1",
    ]
)  # fmt: skip
near_values = st.one_of(
    near_words,
    quantity_texts,
    st.integers(-2, 102),
    st.just(2**63),
    st.builds(dict) | st.builds(list),
)


@st.composite
def near_valid(draw: st.DrawFn, valid: Any) -> Any:
    """``valid`` with one to three changes: a part replaced by a near miss, or an object given
    extra keys of any JSON-able kind (YAML keys may be numbers, booleans or null)."""
    obj = copy.deepcopy(valid)
    keys = near_words | st.integers() | st.booleans() | st.none() | st.text(max_size=5)
    for _ in range(draw(st.integers(1, 3))):
        paths = json_paths(obj)
        objects = [p for p in paths if isinstance(_at(obj, p), dict)]
        if len(paths) == 1 or (objects and draw(st.booleans())):
            target = _at(obj, draw(st.sampled_from(objects)))
            target.update(draw(st.dictionaries(keys, near_values, min_size=1, max_size=3)))
        else:
            path = draw(st.sampled_from(paths[1:]))
            _at(obj, path[:-1])[path[-1]] = draw(near_values)
    return obj


def _at(obj: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        obj = obj[step]
    return obj


def test_the_fuzzed_configs_start_valid():
    kinds = {(c.kind, c.sharing_strategy) for c in map(params.validate, VALID_CONFIGS)}
    assert kinds == {
        ("GpuConfig", "Exclusive"), ("GpuConfig", "TimeSlicing"), ("GpuConfig", "MPS"),
        ("MigDeviceConfig", "Exclusive"), ("MigDeviceConfig", "MPS"),
    }  # fmt: skip


@FUZZ
@given(
    st.one_of(
        json_values,
        *[mutated(v) for v in VALID_CONFIGS],
        *[near_valid(v) for v in VALID_CONFIGS],
    )
)
def test_opaque_configs_validate_or_raise_params_error(obj):
    with contextlib.suppress(ParamsError):
        params.validate(obj)


@FUZZ
@given(quantity_texts, quantity_texts, st.sampled_from(VALID_CONFIGS[2::2]))
def test_random_memory_limits_validate_or_raise_params_error(limit, per_device, valid):
    obj = copy.deepcopy(valid)
    mps = obj["sharing"]["mps"]
    mps["pinnedMemoryLimit"] = limit
    mps["perDevicePinnedMemoryLimit"] = dict.fromkeys(mps["perDevicePinnedMemoryLimit"], per_device)
    try:
        cfg = params.validate(obj)
    except ParamsError:
        return
    assert isinstance(cfg.sharing, params.Mps)
    assert cfg.sharing.pinned_memory_limit_bytes == parse_bytes(limit) >= 2**20


@FUZZ
@given(quantity_texts)
def test_quantities_parse_or_raise_quantity_error_and_their_text_round_trips(text):
    try:
        q = parse_quantity(text)
    except QuantityError:
        return
    again = parse_quantity(str(q))
    assert again == q and str(again) == str(q)


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


VALID_FAULTS = {"version": 1, "bootId": "b", "gpus": {"GPU-0": {"xid": 48, "since": 1.7e9}}}


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=200), json_values.map(_as_bytes), mutated(VALID_FAULTS).map(_as_bytes)
    )
)
def test_sticky_faults_decode_or_raise_decode_error(data):
    with contextlib.suppress(DecodeError):
        boot, faults = decode_faults(data, "faults.json")
        assert isinstance(boot, str)
        assert all(isinstance(x, int) and x > 0 for x, _ in faults.values())


POD = "5f1c9b7e-3a2d-4e8f-9c0b-1d2e3f4a5b6c"
cgroup_parts = st.sampled_from(
    ["kubepods", "kubepods.slice", "burstable", "besteffort", f"pod{POD}", f"pod{POD[:-3]}",
     f"kubepods-burstable-pod{POD.replace('-', '_')}.slice", "kubepods-pod_.slice", "..", ".",
     "", "cri-containerd-ab.scope", "system.slice", ":", "0::", "\n", "\x00", "pod"]
) | st.text(max_size=12)  # fmt: skip
cgroup_texts = st.one_of(
    st.text(max_size=300),
    st.lists(
        st.tuples(st.sampled_from(["0", "12", "x", ""]), st.sampled_from(["", "memory", "::"]),
                  st.lists(cgroup_parts, max_size=8).map("/".join)),
        max_size=6,
    ).map(lambda lines: "\n".join(":".join(t) for t in lines)),
)  # fmt: skip


@FUZZ
@given(cgroup_texts)
def test_cgroup_files_name_one_pod_or_none(text):
    uid = pod_uid(text)
    assert uid is None or uid in text.replace("_", "-")


@FUZZ
@given(st.text(max_size=300) | st.lists(st.text(max_size=8), max_size=60).map(" ".join))
def test_stat_lines_parse_or_raise_value_error(text):
    with contextlib.suppress(ValueError):
        assert start_time(text) >= 0


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


class _NoLeftovers:
    """A node with no MIG instances or MPS daemons; every device has its /dev/nvidia node."""

    def mig_instance(self, device: Any) -> None:
        return None

    def mps_daemon(self, uid: str) -> None:
        return None

    def mps_pipe_dir(self, uid: str) -> str:
        return f"/var/lib/tessera/mps/{uid}/pipe"

    def device_nodes(self, uid: str, devices: Any) -> dict[str, tuple[str, ...]]:
        return {d.device: (f"/dev/nvidia{d.gpu_minor}",) for d in devices}


@functools.cache
def _l40s_model() -> Any:
    import tempfile

    from agent.cli.node_access import open_node
    from agent.config import Config
    from agent.node import discover
    from dra_driver.device_model import DevicePolicy, advertised_devices

    source = open_node(Config.of(simulate="l40s-pcie", node_name=NODE), Path(tempfile.mkdtemp()))
    source.nvml.init()
    try:
        return advertised_devices(discover(source), DevicePolicy())
    finally:
        source.nvml.shutdown()


def _rebuild(obj: Any) -> Any:
    from dra_driver.kubeletplugin.cdi_spec import SpecEvidence
    from dra_driver.kubeletplugin.plan import SharingPolicy
    from dra_driver.kubeletplugin.rebuild import decide

    spec = SpecEvidence("uid-1", ("gpu-0",), 0.0, (("gpu-0", ("/dev/nvidia0",)),))
    return decide(
        spec,
        obj if isinstance(obj, dict) else None,
        driver=DRIVER,
        pool=NODE,
        model=_l40s_model(),
        sharing=SharingPolicy(),
        record=lambda uid, p: PreparedDevice(
            p.request_names,
            NODE,
            p.device.name,
            (),
            p.device.kind,
            p.device.parent_uuid,
            p.device.gpu_minor,
        ),
        leftovers=_NoLeftovers(),
        rebuilt_from="cdi-spec+claim-files",
    )


def test_the_fuzzed_claim_starts_rebuildable():
    from dra_driver.kubeletplugin.rebuild import Rebuilt

    assert isinstance(_rebuild(VALID_CLAIM), Rebuilt)


@FUZZ
@given(st.one_of(json_values, mutated(VALID_CLAIM)))
def test_a_rebuild_from_any_claim_object_is_rebuilt_or_unrecovered_never_an_exception(obj):
    from dra_driver.kubeletplugin.rebuild import REASONS, Rebuilt

    outcome = _rebuild(obj)
    if isinstance(outcome, Rebuilt):
        assert [d.device for d in outcome.entry.devices] == ["gpu-0"]
    else:
        assert outcome.reason in REASONS and outcome.uid == "uid-1"
