"""What the claims cookbook says devices carry is what the simulated models advertise."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from agent.config import Config
from agent.daemon import open_node
from agent.node import discover
from agent.sim.model import model_names
from dra_driver.devices import AdvertisedDevice, DevicePolicy, advertised_devices

ROOT = Path(__file__).resolve().parents[2]
DOMAIN = "gpu.tessera.dev"


def devices(model: str, mig_mode: str, state: str) -> tuple[AdvertisedDevice, ...]:
    src = open_node(Config(simulate=model), Path(state))
    src.nvml.init()
    try:
        inv = discover(src)
    finally:
        src.nvml.shutdown()
    return advertised_devices(inv, DevicePolicy(mig_mode=mig_mode)).devices


def attribute_table() -> dict[str, str]:
    """attribute name -> the cookbook's "on" column."""
    doc = (ROOT / "docs" / "claims-cookbook.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            for name in re.findall(r"`([^`]+)`", cells[0]):
                rows[name] = cells[2]
    return rows


def names(d: AdvertisedDevice) -> set[str]:
    return {k.removeprefix(f"{DOMAIN}/") for k, _ in d.attributes}


@pytest.mark.parametrize("mig_mode", ["static", "dynamic"])
@pytest.mark.parametrize("model", model_names())
def test_attribute_table_says_which_devices_carry_each_attribute(model, mig_mode, tmp_path):
    advertised = devices(model, mig_mode, str(tmp_path))
    wanted = {
        "all": lambda d: True,
        "all (MIG: the parent's)": lambda d: True,
        "whole GPUs": lambda d: d.kind == "gpu",
        "MIG": lambda d: d.kind == "mig",
        "GPUs, static MIG": lambda d: d.kind == "gpu" or d.uuid is not None,
    }
    table = attribute_table()
    assert "nvlinkLinks" in table and "pcieRoot" not in table  # qualified names stay whole
    for name, on in table.items():
        if on not in wanted:
            continue  # conditional rows ("GPUs with NVLink")
        for d in advertised:
            assert (name in names(d)) == wanted[on](d), (name, on, d.name)


@pytest.mark.parametrize("model", ["dgx-a100", "dgx-h100"])
def test_the_mig_example_selects_a_device_on_the_mig_models(model, tmp_path):
    """examples/mig-1g.yaml: `profile.startsWith("1g.") && memory >= <quantity>` (evaluated by
    hand here until the CEL evaluator exists) finds a MIG device on the default layouts."""
    claim = yaml.safe_load((ROOT / "deploy/daemonset/examples/mig-1g.yaml").read_text())
    (selector,) = claim["spec"]["devices"]["requests"][0]["exactly"]["selectors"]
    expression = selector["cel"]["expression"]
    assert 'profile.startsWith("1g.")' in expression
    (gib,) = re.findall(r'quantity\("(\d+)Gi"\)', expression)
    floor = int(gib) * 1024**3
    src = open_node(Config(simulate=model, sim_mig_layout="balanced"), tmp_path)
    src.nvml.init()
    try:
        inv = discover(src)
    finally:
        src.nvml.shutdown()
    matching = [
        d
        for d in advertised_devices(inv, DevicePolicy(mig_mode="static")).devices
        if d.kind == "mig"
        and str(dict(d.attributes)["profile"]["string"]).startswith("1g.")
        and int(dict(d.capacity)["memory"]) >= floor
    ]
    assert matching, f"the example selects nothing on {model}"
