"""--mig-profiles: which MIG profiles dynamic MIG advertises; the flag, the variable, the
DevicePolicy they make, names refused at start (malformed, or with --mig-mode static), and a
profile the node does not have refused by the one-shot commands, naming what it has."""

from __future__ import annotations

import io
import json

import pytest

from agent.cli import main
from agent.config import load_config
from agent.errors import ConfigError


def test_default_advertises_every_profile() -> None:
    c = load_config({"mig_mode": "dynamic"}, {})
    assert c.driver.mig_profiles == () and c.driver.device_policy().mig_profiles == ()


def test_flags_and_the_variable_reach_the_device_policy() -> None:
    by_flags = load_config({"mig_mode": "dynamic", "mig_profiles": ["1g.10gb", "3G.40GB"]}, {})
    assert by_flags.driver.device_policy().mig_profiles == ("1g.10gb", "3g.40gb")
    env = {"TESSERA_MIG_MODE": "dynamic", "TESSERA_MIG_PROFILES": "1g.5gb+me, 7g.40gb"}
    assert load_config({}, env).driver.device_policy().mig_profiles == ("1g.5gb+me", "7g.40gb")


@pytest.mark.parametrize("raw", ["1g10gb", "gpu-0", "1g.10gb+", "3g"])
def test_a_malformed_name_is_refused_with_the_form_allowed(raw: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config({}, {"TESSERA_MIG_MODE": "dynamic", "TESSERA_MIG_PROFILES": raw})
    assert str(e.value).startswith(f"TESSERA_MIG_PROFILES={raw!r} is not a MIG profile name")
    assert "1g.10gb" in str(e.value)


def test_static_mode_refuses_the_setting() -> None:
    with pytest.raises(ConfigError) as e:
        load_config({"mig_profiles": ["1g.10gb"]}, {})
    assert str(e.value).startswith("--mig-profiles 1g.10gb: needs --mig-mode dynamic")


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), {}, out, err)
    return code, out.getvalue(), err.getvalue()


def test_tessera_slices_advertises_only_the_chosen_profiles() -> None:
    code, out, err = run(
        "slices", "--simulate", "dgx-a100", "--mig-mode", "dynamic", "--mig-profiles", "3g.20gb"
    )
    assert code == 0, err
    text = json.dumps(json.loads(out) if out.lstrip().startswith(("{", "[")) else out)
    assert "gpu-0-mig-3g20gb-9-0" in text and "gpu-0-mig-3g20gb-9-4" in text
    assert "mig-1g5gb" not in text and "mig-7g40gb" not in text


def test_a_profile_the_node_lacks_is_refused_naming_what_it_has() -> None:
    code, out, err = run(
        "slices", "--simulate", "dgx-a100", "--mig-mode", "dynamic", "--mig-profiles", "2g.20gb"
    )
    assert code == 2 and out == ""
    assert "--mig-profiles 2g.20gb: no GPU of this node has it" in err
    assert "1g.10gb, 1g.5gb, 1g.5gb+me, 2g.10gb, 3g.20gb, 4g.20gb, 7g.40gb" in err
