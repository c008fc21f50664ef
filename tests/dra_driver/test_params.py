import pytest

from dra_driver.errors import ParamsError
from dra_driver.params import API_VERSION, DeviceConfig, validate


def test_minimal_and_explicit_configs():
    assert validate({"apiVersion": API_VERSION, "kind": "GpuConfig"}) == DeviceConfig("GpuConfig")
    cfg = validate(
        {"apiVersion": API_VERSION, "kind": "MigDeviceConfig", "sharing": {"strategy": "Exclusive"}}
    )
    assert cfg.kind == "MigDeviceConfig" and cfg.sharing_strategy == "Exclusive"
    assert cfg.applies_to("mig") and not cfg.applies_to("gpu")


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"apiVersion": "gpu.tessera.dev/v9", "kind": "GpuConfig"},
         "apiVersion: 'gpu.tessera.dev/v9'"),
        ({"apiVersion": API_VERSION, "kind": "TpuConfig"}, "kind: 'TpuConfig' is not one of"),
        ({"apiVersion": API_VERSION, "kind": "GpuConfig", "colour": "red"},
         "unknown field(s) colour"),
        ({"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": {"strategy": "MPS"}},
         "sharing.strategy: 'MPS' is not supported"),
        ({"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": {"strateg": "x"}},
         "parameters.sharing: unknown field(s) strateg"),
        ({"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": "Exclusive"},
         "expected an object"),
        ([1, 2], "expected an object"),
        ({"apiVersion": API_VERSION, "kind": "GpuConfig", "x": "y" * 11000}, "more than the 10240"),
    ],
    ids=["version", "kind", "unknown-field", "strategy", "nested-unknown", "not-object", "list",
         "too-big"],
)  # fmt: skip
def test_bad_params_name_path_value_and_allowed(params, needle):
    with pytest.raises(ParamsError) as e:
        validate(params)
    assert needle in str(e.value)
