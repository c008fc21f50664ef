"""--virtualization and --virtualization-gpus: flags, variables, the DevicePolicy they make, and
the combinations refused at start with the offending values named (design24 section 2)."""

from __future__ import annotations

import io

import pytest

from agent.cli import main
from agent.config import load_config
from agent.errors import ConfigError
from dra_driver.device_model import DevicePolicy


def test_defaults_offer_vms_nothing() -> None:
    c = load_config({}, {})
    assert (c.driver.virtualization, c.driver.virtualization_gpus) == ("none", ())
    policy = c.driver.device_policy()
    assert (policy.virtualization, policy.virtualization_gpus) == ("none", ())
    assert policy == DevicePolicy()


def test_flags_and_variables_reach_the_device_policy() -> None:
    uuid = "GPU-ABCDEF01-2345-6789-abcd-ef0123456789"
    by_flags = load_config(
        {"virtualization": "passthrough", "virtualization_gpus": ["0", uuid]}, {}
    )
    policy = by_flags.driver.device_policy()
    assert policy.virtualization == "passthrough"
    assert policy.virtualization_gpus == ("0", "gpu-abcdef01-2345-6789-abcd-ef0123456789")
    env = {"TESSERA_VIRTUALIZATION": "vgpu", "TESSERA_VIRTUALIZATION_GPUS": "00000000:1B:00.0, 3"}
    by_env = load_config({}, env).driver.device_policy()
    assert (by_env.virtualization, by_env.virtualization_gpus) == ("vgpu", ("0000:1b:00.0", "3"))
    # a flag beats the variable
    flagged = load_config({"virtualization": "passthrough"}, env)
    assert flagged.driver.virtualization == "passthrough"


def test_a_bad_mode_names_the_value_and_the_choices() -> None:
    with pytest.raises(ConfigError) as e:
        load_config({}, {"TESSERA_VIRTUALIZATION": "kvm"})
    assert str(e.value) == "TESSERA_VIRTUALIZATION='kvm' is not one of none, passthrough, vgpu"


def test_a_bad_gpu_names_the_entry_and_what_a_gpu_is() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(
            {}, {"TESSERA_VIRTUALIZATION": "passthrough", "TESSERA_VIRTUALIZATION_GPUS": "0,gpu7"}
        )
    assert str(e.value).startswith("TESSERA_VIRTUALIZATION_GPUS='gpu7' is not a GPU: give its")
    with pytest.raises(ConfigError) as e:
        load_config({"virtualization": "passthrough", "virtualization_gpus": ["1b:00"]}, {})
    assert str(e.value).startswith("--virtualization-gpus: '1b:00' is not a GPU")
    assert "0000:1b:00.0" in str(e.value)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {"virtualization": "passthrough", "sharing": "time-slicing"},
            "--virtualization passthrough and --sharing time-slicing go against each other",
        ),
        (
            {"virtualization": "vgpu", "sharing": "memory-shares"},
            "--virtualization vgpu and --sharing memory-shares go against each other",
        ),
        (
            {"virtualization": "vgpu", "mig_mode": "dynamic"},
            "--virtualization vgpu and --mig-mode dynamic go against each other",
        ),
        (
            {"virtualization_gpus": ["0", "1"]},
            "--virtualization-gpus 0,1: needs --virtualization passthrough or vgpu",
        ),
    ],
)
def test_combinations_refused_at_start(given: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(given, {})
    assert str(e.value).startswith(message)


@pytest.mark.parametrize(
    "given",
    [
        {"virtualization": "passthrough", "mig_mode": "dynamic"},
        {"virtualization": "vgpu", "mig_mode": "static"},
        {"virtualization": "passthrough", "sharing": "none"},
    ],
)
def test_combinations_taken(given: dict[str, object]) -> None:
    load_config(given, {}).driver.device_policy()


def test_the_cli_refuses_with_the_message_and_exit_2() -> None:
    out, err = io.StringIO(), io.StringIO()
    argv = ["slices", "--simulate", "l40s-pcie", "--virtualization", "passthrough"]
    code = main([*argv, "--sharing", "memory-shares"], {}, out, err)
    assert code == 2 and out.getvalue() == ""
    assert "--virtualization passthrough and --sharing memory-shares" in err.getvalue()
