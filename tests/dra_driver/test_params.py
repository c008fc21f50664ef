"""The opaque config API: every field decoded, every error naming the path, the value and what
is allowed, and the version table as the one seam for a later apiVersion."""

import datetime
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from dra_driver.errors import ParamsError
from dra_driver.kubeletplugin.params import (
    API_VERSION,
    MAX_PARAMETERS_BYTES,
    VERSIONS,
    DeviceConfig,
    Exclusive,
    Mps,
    TimeSlicing,
    validate,
)

GI = 2**30
MI = 2**20
GPU_UUID = "GPU-5f1e2d3c-4b5a-6978-8a9b-0c1d2e3f4a5b"
MIG_UUID = "MIG-0a1b2c3d-4e5f-5a6b-8c7d-9e0f1a2b3c4d"
MIG_NAME = "gpu-0-mig-1g10gb-19-0"


def gpu(sharing: Any = None, kind: str = "GpuConfig") -> dict[str, Any]:
    params: dict[str, Any] = {"apiVersion": API_VERSION, "kind": kind}
    if sharing is not None:
        params["sharing"] = sharing
    return params


def mig(sharing: Any = None) -> dict[str, Any]:
    return gpu(sharing, "MigDeviceConfig")


def mps(**fields: Any) -> dict[str, Any]:
    return {"strategy": "MPS", "mps": fields}


VALID = [
    # defaults: no sharing, empty sharing, strategy without its block
    (gpu(), DeviceConfig("GpuConfig", Exclusive())),
    (gpu({}), DeviceConfig("GpuConfig", Exclusive())),
    (gpu({"strategy": "Exclusive"}), DeviceConfig("GpuConfig", Exclusive())),
    (mig(), DeviceConfig("MigDeviceConfig", Exclusive())),
    (mig({"strategy": "Exclusive"}), DeviceConfig("MigDeviceConfig", Exclusive())),
    (gpu({"strategy": "TimeSlicing"}), DeviceConfig("GpuConfig", TimeSlicing("Default"))),
    (gpu({"strategy": "TimeSlicing", "timeSlicing": {}}), DeviceConfig("GpuConfig", TimeSlicing())),
    (gpu({"strategy": "MPS"}), DeviceConfig("GpuConfig", Mps(None, None, ()))),
    (mig({"strategy": "MPS", "mps": {}}), DeviceConfig("MigDeviceConfig", Mps())),
    # every interval
    *[(gpu({"strategy": "TimeSlicing", "timeSlicing": {"interval": i}}),
       DeviceConfig("GpuConfig", TimeSlicing(i))) for i in ("Default", "Short", "Medium", "Long")],
    # MPS fields at their edges; quantities round up to whole bytes
    (gpu(mps(activeThreadPercentage=1)), DeviceConfig("GpuConfig", Mps(1))),
    (gpu(mps(activeThreadPercentage=100)), DeviceConfig("GpuConfig", Mps(100))),
    (gpu(mps(pinnedMemoryLimit="4Gi")), DeviceConfig("GpuConfig", Mps(None, 4 * GI))),
    (gpu(mps(pinnedMemoryLimit="1Mi")), DeviceConfig("GpuConfig", Mps(None, MI))),
    (gpu(mps(pinnedMemoryLimit="1.5G")), DeviceConfig("GpuConfig", Mps(None, 1_500_000_000))),
    (gpu(mps(pinnedMemoryLimit="1048576.5")), DeviceConfig("GpuConfig", Mps(None, MI + 1))),
    (gpu(mps(pinnedMemoryLimit=MI)), DeviceConfig("GpuConfig", Mps(None, MI))),
    (gpu(mps(pinnedMemoryLimit="9Ei")), DeviceConfig("GpuConfig", Mps(None, 2**63 - 1))),
    (gpu(mps(perDevicePinnedMemoryLimit={})), DeviceConfig("GpuConfig", Mps())),
    (gpu(mps(activeThreadPercentage=50, pinnedMemoryLimit="8Gi",
             perDevicePinnedMemoryLimit={"gpu-1": "2Gi", GPU_UUID: 3 * GI, "gpu-12": "1e9"})),
     DeviceConfig("GpuConfig", Mps(50, 8 * GI, ((GPU_UUID, 3 * GI), ("gpu-1", 2 * GI),
                                               ("gpu-12", 10**9))))),
    (mig(mps(activeThreadPercentage=25,
             perDevicePinnedMemoryLimit={MIG_NAME: "5Gi", MIG_UUID: "1536Mi",
                                         "gpu-7-mig-7g80gb-0-0": "70Gi"})),
     DeviceConfig("MigDeviceConfig", Mps(25, None, (
         (MIG_UUID, 1536 * MI), (MIG_NAME, 5 * GI), ("gpu-7-mig-7g80gb-0-0", 70 * GI))))),
]  # fmt: skip


@pytest.mark.parametrize(("params", "expected"), VALID)
def test_valid_configs_decode_to_typed_values(params, expected):
    cfg = validate(params)
    assert cfg == expected
    assert cfg.sharing_strategy == expected.sharing.strategy


def test_strategy_names_and_defaults_are_explicit():
    assert DeviceConfig("GpuConfig").sharing == Exclusive()
    assert (Exclusive.strategy, TimeSlicing.strategy, Mps.strategy) == (
        "Exclusive", "TimeSlicing", "MPS"
    )  # fmt: skip
    assert TimeSlicing().interval == "Default"
    assert Mps() == Mps(None, None, ())


@pytest.mark.parametrize(
    ("kind", "device", "applies"),
    [("GpuConfig", "gpu", True), ("GpuConfig", "mig", False),
     ("MigDeviceConfig", "mig", True), ("MigDeviceConfig", "gpu", False)],
)  # fmt: skip
def test_each_kind_configures_its_own_devices(kind, device, applies):
    assert validate(gpu(kind=kind)).applies_to(device) is applies


def test_per_device_limit_lookup_by_name_then_uuid_then_default():
    cfg = validate(
        gpu(mps(pinnedMemoryLimit="8Gi",
                perDevicePinnedMemoryLimit={"gpu-1": "2Gi", GPU_UUID: "3Gi"}))
    ).sharing  # fmt: skip
    assert isinstance(cfg, Mps)
    assert cfg.pinned_memory_limit_for("gpu-1") == 2 * GI
    assert cfg.pinned_memory_limit_for("gpu-1", GPU_UUID) == 2 * GI
    assert cfg.pinned_memory_limit_for("gpu-0", GPU_UUID) == 3 * GI
    assert cfg.pinned_memory_limit_for("gpu-0", "GPU-other") == 8 * GI
    assert Mps().pinned_memory_limit_for("gpu-0") is None


P = "parameters"
S = "parameters.sharing"
M = "parameters.sharing.mps"
QTY = "a quantity from 1Mi to 9223372036854775807 bytes"
KEY_GPU = "a GPU's name (gpu-<minor>, e.g. gpu-0) or UUID (GPU-<uuid>)"
KEY_MIG = "a MIG device's name (gpu-<minor>-mig-<profile>-<profileId>-<start>"
NO_TS_ON_MIG = "MIG devices cannot be time-sliced by the driver"
ERRORS = [
    # (id, params, path, the value as shown, what is allowed)
    ("not-object", [1, 2], P, "a list: [1, 2]", "expected an object"),
    ("string", "GpuConfig", P, 'a string: "GpuConfig"', "expected an object"),
    ("null", None, P, "null", "expected an object"),
    ("version-missing", {"kind": "GpuConfig"}, f"{P}.apiVersion", "missing", API_VERSION),
    ("version-unknown", {"apiVersion": "gpu.tessera.dev/v9", "kind": "GpuConfig"},
     f"{P}.apiVersion", '"gpu.tessera.dev/v9" is not supported', API_VERSION),
    ("version-kind", {"apiVersion": 1, "kind": "GpuConfig"}, f"{P}.apiVersion", "1", API_VERSION),
    ("kind-missing", {"apiVersion": API_VERSION}, f"{P}.kind", "missing",
     "GpuConfig, MigDeviceConfig"),
    ("kind-unknown", gpu(kind="TpuConfig"), f"{P}.kind", '"TpuConfig" is not a kind of',
     "GpuConfig, MigDeviceConfig"),
    ("kind-list", gpu(kind=["GpuConfig"]), f"{P}.kind", '["GpuConfig"]', "GpuConfig"),  # type: ignore[arg-type]
    ("unknown-field", {**gpu(), "colour": "red"}, P, "unknown field(s) colour;",
     "apiVersion, kind, sharing"),
    ("unknown-int-key", {**gpu(), 1: 2, "x": 3}, P, "unknown field(s) 1, x;",
     "apiVersion, kind, sharing"),
    ("unknown-key-not-printable", {**gpu(), "a\x1e\nb": 1}, P,
     'unknown field(s) "a\\u001e\\nb";', "apiVersion, kind, sharing"),
    ("sharing-kind", gpu("Exclusive"), S, 'a string: "Exclusive"', "expected an object"),
    ("sharing-null", {**gpu(), "sharing": None}, S, "null", "expected an object"),
    ("sharing-unknown", gpu({"strateg": "MPS"}), S, "unknown field(s) strateg;",
     "strategy, timeSlicing, mps"),
    ("strategy-unknown", gpu({"strategy": "Shared"}), f"{S}.strategy", '"Shared"',
     "Exclusive, TimeSlicing, MPS (default: Exclusive)"),
    ("strategy-case", gpu({"strategy": "mps"}), f"{S}.strategy", '"mps" is not allowed (did you'
     " mean MPS?)", "Exclusive, TimeSlicing, MPS"),
    ("strategy-kind", gpu({"strategy": 1}), f"{S}.strategy", "1", "Exclusive, TimeSlicing, MPS"),
    ("mig-time-slicing", mig({"strategy": "TimeSlicing"}), f"{S}.strategy",
     '"TimeSlicing" is not allowed on a MigDeviceConfig', f"{NO_TS_ON_MIG} (the timeslice is a"
     " whole-GPU setting it cannot make for one MIG device); use MPS or Exclusive"),
    ("mig-time-slicing-block", mig({"strategy": "Exclusive", "timeSlicing": {}}),
     f"{S}.timeSlicing", "not allowed on a MigDeviceConfig", f"{NO_TS_ON_MIG}"),
    ("mig-sharing-unknown", mig({"strategy": "MPS", "timeslicing": {}}), S,
     "unknown field(s) timeslicing;", "allowed: strategy, mps"),
    ("mig-strategy-unknown", mig({"strategy": "Shared"}), f"{S}.strategy", '"Shared"',
     "allowed: Exclusive, MPS (default: Exclusive)"),
    ("time-slicing-without-strategy", gpu({"timeSlicing": {"interval": "Long"}}),
     f"{S}.timeSlicing", "the strategy is Exclusive (the default)",
     "only allowed with strategy TimeSlicing"),
    ("mps-with-other-strategy", gpu({"strategy": "TimeSlicing", "mps": {}}), f"{S}.mps",
     "the strategy is TimeSlicing", "only allowed with strategy MPS"),
    ("time-slicing-kind", gpu({"strategy": "TimeSlicing", "timeSlicing": "Long"}),
     f"{S}.timeSlicing", 'a string: "Long"', "expected an object"),
    ("time-slicing-unknown", gpu({"strategy": "TimeSlicing", "timeSlicing": {"intervall": 1}}),
     f"{S}.timeSlicing", "unknown field(s) intervall;", "allowed: interval"),
    ("interval-unknown", gpu({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Huge"}}),
     f"{S}.timeSlicing.interval", '"Huge"', "Default, Short, Medium, Long (default: Default)"),
    ("interval-kind", gpu({"strategy": "TimeSlicing", "timeSlicing": {"interval": 2}}),
     f"{S}.timeSlicing.interval", "2 is not allowed", "Default, Short, Medium, Long"),
    ("mps-kind", gpu({"strategy": "MPS", "mps": []}), M, "a list: []", "expected an object"),
    ("mps-unknown", gpu(mps(threads=5)), M, "unknown field(s) threads;",
     "activeThreadPercentage, pinnedMemoryLimit, perDevicePinnedMemoryLimit"),
    ("percentage-zero", gpu(mps(activeThreadPercentage=0)), f"{M}.activeThreadPercentage",
     "0 is out of range", "an integer from 1 to 100"),
    ("percentage-high", gpu(mps(activeThreadPercentage=101)), f"{M}.activeThreadPercentage",
     "101 is out of range", "an integer from 1 to 100"),
    ("percentage-negative", gpu(mps(activeThreadPercentage=-5)), f"{M}.activeThreadPercentage",
     "-5 is out of range", "an integer from 1 to 100"),
    ("percentage-string", gpu(mps(activeThreadPercentage="50")), f"{M}.activeThreadPercentage",
     '"50" is a string', "an integer from 1 to 100"),
    ("percentage-float", gpu(mps(activeThreadPercentage=50.0)), f"{M}.activeThreadPercentage",
     "50.0 is a number", "an integer from 1 to 100"),
    ("percentage-bool", gpu(mps(activeThreadPercentage=True)), f"{M}.activeThreadPercentage",
     "true is a boolean", "an integer from 1 to 100"),
    ("percentage-null", gpu(mps(activeThreadPercentage=None)), f"{M}.activeThreadPercentage",
     "null;", "an integer from 1 to 100"),
    ("limit-suffix", gpu(mps(pinnedMemoryLimit="4GB")), f"{M}.pinnedMemoryLimit",
     '"4GB" is not a quantity: unknown suffix \'GB\'', "binary Ki Mi Gi Ti Pi Ei"),
    ("limit-empty", gpu(mps(pinnedMemoryLimit="")), f"{M}.pinnedMemoryLimit",
     '"" is not a quantity: empty', "decimal n u m k M G T P E"),
    ("limit-small", gpu(mps(pinnedMemoryLimit="1023Ki")), f"{M}.pinnedMemoryLimit",
     '"1023Ki" is less than 1Mi', QTY),
    ("limit-no-suffix", gpu(mps(pinnedMemoryLimit=1024)), f"{M}.pinnedMemoryLimit",
     "1024 is less than 1Mi", QTY),
    ("limit-zero", gpu(mps(pinnedMemoryLimit="0")), f"{M}.pinnedMemoryLimit",
     '"0" is less than 1Mi', QTY),
    ("limit-negative", gpu(mps(pinnedMemoryLimit="-4Gi")), f"{M}.pinnedMemoryLimit",
     '"-4Gi" is less than 1Mi', QTY),
    ("limit-huge", gpu(mps(pinnedMemoryLimit="1e30")), f"{M}.pinnedMemoryLimit",
     '"1e30" is too large', QTY),
    ("limit-huge-int", gpu(mps(pinnedMemoryLimit=2**63)), f"{M}.pinnedMemoryLimit",
     "9223372036854775808 is too large", QTY),
    ("limit-float", gpu(mps(pinnedMemoryLimit=1.5e9)), f"{M}.pinnedMemoryLimit",
     "1500000000.0 is a number", f'{QTY}, a string such as "4Gi"'),
    ("limit-bool", gpu(mps(pinnedMemoryLimit=False)), f"{M}.pinnedMemoryLimit",
     "false is a boolean", QTY),
    ("limit-object", gpu(mps(pinnedMemoryLimit={"gpu-0": "1Gi"})), f"{M}.pinnedMemoryLimit",
     '{"gpu-0": "1Gi"} is an object', QTY),
    ("per-device-kind", gpu(mps(perDevicePinnedMemoryLimit=["gpu-0"])),
     f"{M}.perDevicePinnedMemoryLimit", 'a list: ["gpu-0"]', "expected an object of device"),
    ("per-device-bad-key", gpu(mps(perDevicePinnedMemoryLimit={"nvidia0": "1Gi"})),
     f"{M}.perDevicePinnedMemoryLimit", 'key "nvidia0" is not a device name or UUID', KEY_GPU),
    ("per-device-short-uuid", gpu(mps(perDevicePinnedMemoryLimit={"GPU-1234": "1Gi"})),
     f"{M}.perDevicePinnedMemoryLimit", 'key "GPU-1234" is not a device name', KEY_GPU),
    ("per-device-leading-zero", gpu(mps(perDevicePinnedMemoryLimit={"gpu-01": "1Gi"})),
     f"{M}.perDevicePinnedMemoryLimit", 'key "gpu-01" is not a device name', KEY_GPU),
    ("per-device-int-key", gpu(mps(perDevicePinnedMemoryLimit={0: "1Gi"})),
     f"{M}.perDevicePinnedMemoryLimit", "key 0 is not a device name", KEY_GPU),
    ("per-device-long-key", gpu(mps(perDevicePinnedMemoryLimit={"gpu-0-mig-" + "a" * 60 + "-1-0":
                                                                "1Gi"})),
     f"{M}.perDevicePinnedMemoryLimit", "is not a device name", KEY_GPU),
    ("per-device-mig-on-gpu", gpu(mps(perDevicePinnedMemoryLimit={MIG_NAME: "1Gi"})),
     f"{M}.perDevicePinnedMemoryLimit", f'key "{MIG_NAME}" is a MIG device, which a GpuConfig'
     " does not configure", KEY_GPU),
    ("per-device-mig-uuid-on-gpu", gpu(mps(perDevicePinnedMemoryLimit={MIG_UUID: "1Gi"})),
     f"{M}.perDevicePinnedMemoryLimit", f'key "{MIG_UUID}" is a MIG device', KEY_GPU),
    ("per-device-gpu-on-mig", mig(mps(perDevicePinnedMemoryLimit={"gpu-0": "1Gi"})),
     f"{M}.perDevicePinnedMemoryLimit", 'key "gpu-0" is a whole GPU, which a MigDeviceConfig'
     " does not configure", KEY_MIG),
    ("per-device-gpu-uuid-on-mig", mig(mps(perDevicePinnedMemoryLimit={GPU_UUID: "1Gi"})),
     f"{M}.perDevicePinnedMemoryLimit", f'key "{GPU_UUID}" is a whole GPU', KEY_MIG),
    ("per-device-value", gpu(mps(perDevicePinnedMemoryLimit={"gpu-0": "lots"})),
     f'{M}.perDevicePinnedMemoryLimit["gpu-0"]', '"lots" is not a quantity', "e<integer>"),
    ("per-device-small", mig(mps(perDevicePinnedMemoryLimit={MIG_UUID: 5})),
     f'{M}.perDevicePinnedMemoryLimit["{MIG_UUID}"]', "5 is less than 1Mi", QTY),
    ("too-big", {**gpu(), "x": "y" * 11000}, P, "bytes, more than the 10240 allowed", "10240"),
    ("nan", gpu(mps(activeThreadPercentage=float("nan"))), P, "not JSON data", "not JSON data"),
    ("date", gpu(mps(pinnedMemoryLimit=datetime.date(2026, 1, 1))), P, "not JSON data",
     "not JSON serializable"),
]  # fmt: skip


@pytest.mark.parametrize(("params", "path", "value", "allowed"), [e[1:] for e in ERRORS],
                         ids=[e[0] for e in ERRORS])  # fmt: skip
def test_errors_name_the_path_the_value_and_what_is_allowed(params, path, value, allowed):
    with pytest.raises(ParamsError) as e:
        validate(params)
    message = str(e.value)
    assert message.startswith(f"{path}: "), message
    assert value in message, message
    assert allowed in message, message


def test_the_path_is_the_callers():
    with pytest.raises(ParamsError, match=r"^config\[2\]\.opaque\.parameters\.sharing\.mps\."):
        validate(gpu(mps(activeThreadPercentage=0)), "config[2].opaque.parameters")


def test_long_values_are_cut_short_in_messages():
    with pytest.raises(ParamsError) as e:
        validate(gpu({"strategy": "x" * 5000}))
    assert len(str(e.value)) < 300 and '"xxxx' in str(e.value)


def test_the_size_limit_counts_compact_json():
    overhead = len('{"apiVersion":"","kind":"GpuConfig"}')
    at_limit = {"apiVersion": "v" * (MAX_PARAMETERS_BYTES - overhead), "kind": "GpuConfig"}
    with pytest.raises(ParamsError, match="apiVersion:"):  # past the size check
        validate(at_limit)
    with pytest.raises(ParamsError, match="10241 bytes, more than the 10240 allowed"):
        validate({**at_limit, "apiVersion": at_limit["apiVersion"] + "v"})


# -- the conversion seam ---------------------------------------------------------------------
def _decode_fake_v1(obj: dict[str, Any], path: str) -> DeviceConfig:
    """A later version that spells MPS differently, read into the same internal values."""
    if obj.get("kind") != "Gpu":
        raise ParamsError(f"{path}.kind: {obj.get('kind')!r} is not allowed; allowed: Gpu")
    return DeviceConfig("GpuConfig", Mps(active_thread_percentage=obj["mpsThreads"]))


def test_a_new_api_version_is_one_entry_in_the_version_table():
    versions = {**VERSIONS, "gpu.tessera.dev/v1": _decode_fake_v1}
    old = gpu(mps(activeThreadPercentage=30))
    new = {"apiVersion": "gpu.tessera.dev/v1", "kind": "Gpu", "mpsThreads": 30}
    assert validate(old, versions=versions) == validate(new, versions=versions)
    assert validate(old, versions=versions) == validate(old)  # v1alpha1 reads as before
    with pytest.raises(
        ParamsError, match=r"allowed: gpu\.tessera\.dev/v1alpha1, gpu\.tessera\.dev/v1$"
    ):
        validate({**new, "apiVersion": "gpu.tessera.dev/v2"}, versions=versions)
    with pytest.raises(ParamsError, match=r"\.apiVersion: \"gpu\.tessera\.dev/v1\" is not supp"):
        validate(new)  # the default table is untouched


def test_the_version_table_is_read_only():
    with pytest.raises(TypeError):
        VERSIONS["gpu.tessera.dev/v1"] = _decode_fake_v1  # type: ignore[index]


# -- the documentation -----------------------------------------------------------------------
COOKBOOK = Path(__file__).resolve().parents[2] / "docs" / "claims-cookbook.md"


def _reference() -> str:
    doc = COOKBOOK.read_text()
    return doc[doc.index("## Configuration reference") :]


def test_every_config_in_the_reference_validates():
    blocks = re.findall(r"```yaml\n(.*?)```", _reference(), re.DOTALL)
    configs = [yaml.safe_load(b) for b in blocks]
    opaque = [c.get("opaque") or c["config"][0]["opaque"] for c in configs]
    decoded = {validate(o["parameters"]) for o in opaque}
    assert {(d.kind, d.sharing_strategy) for d in decoded} == {
        ("GpuConfig", "Exclusive"), ("GpuConfig", "TimeSlicing"), ("GpuConfig", "MPS"),
        ("MigDeviceConfig", "MPS"),
    }  # fmt: skip


def test_the_reference_lists_every_field():
    rows = re.findall(r"^\| `([a-zA-Z.]+)` \|", _reference(), re.MULTILINE)
    fields = [r for r in rows if r[0].islower()]
    assert fields == [
        "apiVersion", "kind", "powerLimit", "sharing", "sharing.strategy", "sharing.timeSlicing",
        "sharing.timeSlicing.interval", "sharing.mps", "sharing.mps.activeThreadPercentage",
        "sharing.mps.pinnedMemoryLimit", "sharing.mps.perDevicePinnedMemoryLimit",
    ]  # fmt: skip
    for field in fields:  # each is a field the decoder knows: misspelt, it is an unknown field
        *parents, name = field.split(".")
        with pytest.raises(ParamsError) as e:
            validate(_with(parents, {name + "x": 1}))
        assert f"unknown field(s) {name}x;" in str(e.value)
        assert name in str(e.value).split("allowed: ")[1]


def _with(parents: list[str], leaf: dict[str, Any]) -> dict[str, Any]:
    """A valid config with ``leaf`` merged into the object at ``parents``."""
    obj = gpu({"strategy": "MPS", "mps": {}})
    if parents[:2] == ["sharing", "timeSlicing"]:
        obj = gpu({"strategy": "TimeSlicing", "timeSlicing": {}})
    target = obj
    for p in parents:
        target = target[p]
    target.update(leaf)
    return obj
