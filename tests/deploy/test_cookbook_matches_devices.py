"""What the claims cookbook says devices carry is what the simulated models advertise."""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.config import Config
from agent.daemon import open_node
from agent.discovery.inventory import NodeInventory
from agent.node import discover
from agent.sim.model import model_names
from dra_driver.claims import AllocatedDevice, Allocation, ClaimKey, OpaqueConfig
from dra_driver.devices import AdvertisedDevice, DevicePolicy, advertised_devices
from dra_driver.errors import ParamsError
from dra_driver.plan import MEMORY_SHARE, MPS, TIME_SLICING, SharingPolicy, plan_claim
from dra_driver.quantity import parse_bytes
from tests.deploy import cel

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


# -- every example finds devices, and the driver accepts its config, on the nodes it is for ----
EXAMPLES = ROOT / "deploy" / "daemonset" / "examples"
CLASSES = ROOT / "deploy" / "daemonset" / "deviceclasses.yaml"
REFUSED = "refused"


@dataclass(frozen=True)
class Node:
    """A simulated node (model, --mig-mode, --sharing) and how the driver must share the
    device an example gets there: None (exclusive), a plan.py sharing or REFUSED."""

    model: str
    mig_mode: str = "static"
    sharing: str = "none"
    expect: str | None = None

    def __str__(self) -> str:
        return f"{self.model}/{self.mig_mode}/{self.sharing}"


WHERE: dict[str, list[Node]] = {
    "allocated-gpu-claim.yaml": [Node("dgx-h100")],
    "sample-gpu.yaml": [
        Node(m) for m in ("dgx-h100", "dgx-a100", "hgx-h200", "l40s-pcie", "mixed")
    ],
    "single-gpu.yaml": [Node("dgx-h100"), Node("l40s-pcie")],
    "four-nvlink-gpus.yaml": [Node("dgx-h100"), Node("hgx-h200")],
    "gpu-and-nic.yaml": [Node("dgx-h100")],  # the GPU; the NIC is another driver's
    "mig-1g.yaml": [Node("dgx-a100"), Node("dgx-a100", "dynamic"), Node("dgx-h100", "dynamic")],
    "dynamic-mig-2g.yaml": [Node("dgx-h100", "dynamic")],
    "time-slicing.yaml": [
        Node("dgx-h100", expect=TIME_SLICING),
        Node("dgx-h100", sharing="time-slicing", expect=TIME_SLICING),
        Node("dgx-h100", "dynamic", expect=TIME_SLICING),
        # "works with any --sharing except memory-shares"
        Node("dgx-h100", sharing="memory-shares", expect=REFUSED),
    ],
    "time-slicing-shared.yaml": [Node("dgx-h100", sharing="time-slicing", expect=TIME_SLICING)],
    "mps.yaml": [
        Node("dgx-h100", expect=MPS),
        Node("dgx-h100", sharing="time-slicing", expect=MPS),
        Node("l40s-pcie", expect=MPS),
    ],
    "memory-share-8gi.yaml": [
        Node("dgx-h100", sharing="memory-shares", expect=MEMORY_SHARE),
        Node("hgx-h200", sharing="memory-shares", expect=MEMORY_SHARE),
    ],
    "mps-on-mig.yaml": [
        Node("dgx-a100", expect=MPS),
        Node("dgx-a100", "dynamic", expect=MPS),
        Node("dgx-h100", "dynamic", expect=MPS),
    ],
}
"""Each example that asks this driver for devices, and the nodes it is written for."""

_INVENTORIES: dict[str, NodeInventory] = {}


def inventory(model: str) -> NodeInventory:
    """The model's discovered inventory (default MIG layout), discovered once per process."""
    if model not in _INVENTORIES:
        with tempfile.TemporaryDirectory(prefix="tessera-cookbook-") as tmp:
            src = open_node(Config(simulate=model), Path(tmp))
            src.nvml.init()
            try:
                _INVENTORIES[model] = discover(src)
            finally:
                src.nvml.shutdown()
    return _INVENTORIES[model]


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def claim_specs(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ResourceClaim specs of a file (templates' included)."""
    out = []
    for d in docs:
        if d["kind"] == "ResourceClaim":
            out.append(d["spec"])
        elif d["kind"] == "ResourceClaimTemplate":
            out.append(d["spec"]["spec"])
    return out


def device_classes(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """This driver's DeviceClasses: the installed ones and those the example defines."""
    found = [d for d in documents(CLASSES) + docs if d["kind"] == "DeviceClass"]
    return {c["metadata"]["name"]: c["spec"] for c in found}


def consumed_memory(device: AdvertisedDevice, requested: str | None) -> int | None:
    """What the scheduler records in consumedCapacity.memory (upstream
    dynamic-resource-allocation, structured: calculateConsumedCapacity): only on a device that
    allows multiple allocations; the request rounded up by the request policy, else the
    policy's default, else the whole capacity."""
    if not device.allow_multiple_allocations:
        return None
    total = int(dict(device.capacity)["memory"])
    policy = dict(device.request_policies).get("memory")
    if requested is None:
        return parse_bytes(policy.default) if policy is not None else total
    want = parse_bytes(requested)
    if policy is None:
        return want
    low, step = parse_bytes(policy.min), parse_bytes(policy.step)
    return low if want <= low else low + -(-(want - low) // step) * step


def fits(device: AdvertisedDevice, requests: dict[str, str]) -> bool:
    """The request's capacity requirements against the device (a filter, like a CEL
    ``compareTo(quantity(...)) >= 0``, after rounding by the request policy)."""
    for name, quantity in requests.items():
        if name not in dict(device.capacity):
            return False
        amount = consumed_memory(device, quantity) if name == "memory" else None
        if (amount or parse_bytes(quantity)) > int(dict(device.capacity)[name]):
            return False
    return True


def test_every_example_that_asks_for_devices_names_its_nodes():
    asking = {p.name for p in EXAMPLES.glob("*.yaml") if claim_specs(documents(p))}
    assert asking == set(WHERE), "add the example to WHERE with the nodes it is written for"


@pytest.mark.parametrize(
    ("name", "node"),
    [pytest.param(n, node, id=f"{n}@{node}") for n, nodes in WHERE.items() for node in nodes],
)
def test_each_example_selects_devices_and_the_driver_takes_its_config(name, node):
    """Every request of the example for this driver finds ``count`` devices the node advertises
    (the class's and the request's CEL selectors, its capacity requests), and preparing the first
    of them with the example's configs plans the sharing the example says."""
    docs = documents(EXAMPLES / name)
    classes = device_classes(docs)
    policy = DevicePolicy(mig_mode=node.mig_mode, sharing=node.sharing)
    model = advertised_devices(inventory(node.model), policy)
    views = [(d, cel.device_view(d, DOMAIN)) for d in model.devices]
    checked = 0
    for spec in claim_specs(docs):
        allocated = []
        for request in spec["devices"]["requests"]:
            # firstAvailable: the first subrequest that finds its devices (the scheduler's order)
            for exactly in request.get("firstAvailable", [request.get("exactly")]):
                cls = classes.get(exactly["deviceClassName"])
                if cls is None:
                    break  # another driver's class (the NIC of gpu-and-nic.yaml)
                expressions = [s["cel"]["expression"] for s in cls["selectors"]]
                expressions += [s["cel"]["expression"] for s in exactly.get("selectors", [])]
                memory = exactly.get("capacity", {}).get("requests", {})
                found = [
                    d
                    for d, view in views
                    if all(cel.evaluate(e, view) for e in expressions) and fits(d, memory)
                ]
                count = exactly.get("count", 1)
                if len(found) >= count:
                    break
            if cls is None:
                continue
            assert len(found) >= count, f"{name}: request {request['name']} finds {found} on {node}"
            device = found[0]
            allocated.append(
                AllocatedDevice(
                    request=request["name"],
                    driver=DOMAIN,
                    pool=node.model,
                    device=device.name,
                    consumed_memory=consumed_memory(device, memory.get("memory")),
                )
            )
            checked += 1
        configs = [
            OpaqueConfig(source, tuple(c.get("requests", ())), c["opaque"]["parameters"])
            for source, entries in (
                ("FromClass", [c for r in spec["devices"]["requests"]
                               for c in classes.get(r.get("exactly", {}).get("deviceClassName"), {})
                               .get("config", [])]),
                ("FromClaim", spec["devices"].get("config", [])),
            )
            for c in entries
            if c["opaque"]["driver"] == DOMAIN
        ]  # fmt: skip
        allocation = Allocation(
            ClaimKey("default", "example", "uid-example"), tuple(allocated), tuple(configs)
        )
        sharing = SharingPolicy(mode=node.sharing, dynamic_mig=node.mig_mode == "dynamic")
        if node.expect == REFUSED:
            with pytest.raises(ParamsError):
                plan_claim(allocation, model, sharing)
            continue
        plan = plan_claim(allocation, model, sharing)
        assert {p.sharing for p in plan.devices} == {node.expect}, (name, node, plan)
    assert checked, f"{name} asks this driver for nothing"
