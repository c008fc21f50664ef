"""The DeviceClasses and examples under deploy/daemonset, evaluated by the real allocator on the
ResourceSlices our driver publishes for simulated nodes (built as ``tessera slices --simulate``
builds them): each example allocates on the nodes it is written for, and the driver takes the
allocation with the example's configs; on every other model it fails with the reason a user
would be shown. What the claims cookbook says devices carry is what the models advertise."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.cli.node import advertise, slices_for
from agent.config import Config
from agent.daemon import open_node
from agent.discovery.inventory import NodeInventory
from agent.node import discover
from agent.sim.model import model_names
from dra_driver.allocator.explain import Explanation, explain
from dra_driver.celenv import CelEnvironment
from dra_driver.claims import ClaimKey, parse_allocation
from dra_driver.devices import AdvertisedDevice, DeviceModel
from dra_driver.errors import ParamsError
from dra_driver.plan import MEMORY_SHARE, MPS, TIME_SLICING, plan_claim

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "daemonset" / "examples"
CLASSES = ROOT / "deploy" / "daemonset" / "deviceclasses.yaml"
DOMAIN = "gpu.tessera.dev"
REFUSED = "refused"
"""``Fit.expect``: the allocator allocates, but preparing refuses the example's config there."""

# -- the simulated nodes, discovered once per process ------------------------------------------

_INVENTORIES: dict[tuple[str, str | None], NodeInventory] = {}
_PUBLISHED: dict[tuple[str, str | None, str, str], tuple[DeviceModel, list[dict[str, Any]]]] = {}


@dataclass(frozen=True)
class Node:
    """A simulated node: model, --mig-mode, --sharing, --sim-mig-layout (None: the model's
    default); for gpu-and-nic.yaml, the PCIe root of the other driver's NIC (None: the root of
    the node's last whole GPU)."""

    model: str
    mig_mode: str = "static"
    sharing: str = "none"
    layout: str | None = None
    nic_root: str | None = None

    def __str__(self) -> str:
        layout = f"/{self.layout}" if self.layout else ""
        nic = f"/nic@{self.nic_root}" if self.nic_root else ""
        return f"{self.model}/{self.mig_mode}/{self.sharing}{layout}{nic}"

    def config(self) -> Config:
        return Config(
            simulate=self.model,
            mig_mode=self.mig_mode,
            sharing=self.sharing,
            sim_mig_layout=self.layout,
        )


def inventory(node: Node) -> NodeInventory:
    """The node's discovered inventory (slow: once per model and MIG layout per process; the
    driver settings do not change what is discovered)."""
    key = (node.model, node.layout)
    if key not in _INVENTORIES:
        with tempfile.TemporaryDirectory(prefix="tessera-cookbook-") as tmp:
            src = open_node(node.config(), Path(tmp))
            src.nvml.init()
            try:
                _INVENTORIES[key] = discover(src)
            finally:
                src.nvml.shutdown()
    return _INVENTORIES[key]


def published(node: Node) -> tuple[DeviceModel, list[dict[str, Any]]]:
    """What the driver advertises on the node and the ResourceSlices it publishes for it."""
    key = (node.model, node.layout, node.mig_mode, node.sharing)
    if key not in _PUBLISHED:
        config, inv = node.config(), inventory(node)
        model = advertise(config, inv)
        _PUBLISHED[key] = (model, slices_for(config, inv.hostname, model))
    return _PUBLISHED[key]


# -- another driver's NIC, for gpu-and-nic.yaml ------------------------------------------------

NIC_DRIVER = "rdma.example.com"
NIC_CLASS: dict[str, Any] = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": "rdma.example.com"},
    "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{NIC_DRIVER}"'}}]},
}
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"


def nic_slice(node_name: str, pcie_root: str) -> dict[str, Any]:
    """The ResourceSlice a NIC DRA driver would publish: one RDMA NIC on ``pcie_root``, with
    the standard attribute under its qualified name (as the example's constraint names it)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node_name}-{NIC_DRIVER}"},
        "spec": {
            "driver": NIC_DRIVER,
            "nodeName": node_name,
            "pool": {"name": node_name, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "mlx5-0",
                    "attributes": {
                        PCIE_ROOT: {"string": pcie_root},
                        "linkLayer": {"string": "InfiniBand"},
                    },
                }
            ],
        },
    }


def slice_devices(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in slices for d in s["spec"].get("devices", [])}


def nic_root(node: Node, slices: list[dict[str, Any]]) -> str:
    """Where the NIC sits: the node's given root, else the last whole GPU's (so the allocator
    has to pass over the GPUs before it), else the last device's."""
    if node.nic_root is not None:
        return node.nic_root
    devices = list(slice_devices(slices).values())
    gpus = [d for d in devices if d["attributes"]["type"]["string"] == "gpu"] or devices
    return str(gpus[-1]["attributes"][PCIE_ROOT]["string"])


# -- the examples --------------------------------------------------------------------------------


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def claims(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The claims of a file: ResourceClaims as written, templates' claim specs as a claim."""
    out = []
    for d in docs:
        if d["kind"] == "ResourceClaim":
            out.append(d)
        elif d["kind"] == "ResourceClaimTemplate":
            meta = {"name": d["metadata"]["name"], "namespace": d["metadata"]["namespace"]}
            out.append({"metadata": meta, "spec": d["spec"]["spec"]})
    return out


def class_names(claim: dict[str, Any]) -> set[str]:
    return {
        alt["deviceClassName"]
        for r in claim["spec"]["devices"]["requests"]
        for alt in r.get("firstAvailable", [r.get("exactly", {})])
    }


def run(name: str, node: Node) -> list[tuple[dict[str, Any], Explanation, list[dict[str, Any]]]]:
    """Each claim of the example explained on the node, with the slices it was explained on:
    the installed DeviceClasses and those the example defines; the NIC driver's slice and
    class when the claim asks for a NIC."""
    docs = documents(EXAMPLES / name)
    classes = [d for d in documents(CLASSES) + docs if d["kind"] == "DeviceClass"]
    _, slices = published(node)
    out = []
    for claim in claims(docs):
        node_slices, node_classes = list(slices), classes
        if NIC_CLASS["metadata"]["name"] in class_names(claim):
            node_slices.append(nic_slice(node.model, nic_root(node, slices)))
            node_classes = [*classes, NIC_CLASS]
        e = explain(claim, node_classes, node_slices, [], cel=CelEnvironment())
        out.append((claim, e, node_slices))
    return out


# -- where each example fits, and where it does not (and why) -----------------------------------


@dataclass(frozen=True)
class Fit:
    """The example allocates on the node; the driver shares the device(s) as ``expect`` says
    (None: exclusive; a plan.py sharing; REFUSED), and ``requests`` are the (sub)requests the
    allocation answers (None: not checked)."""

    node: Node
    expect: str | None = None
    requests: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Misfit:
    """The example does not allocate on the node: some device of the failing request (or the
    claim as a whole) is rejected with a reason of ``kind`` (the allocator's JSON reason kinds)
    whose text contains ``text``."""

    node: Node
    kind: str
    text: str


def models_except(*skip: str) -> list[str]:
    return [m for m in model_names() if m not in skip]


WHOLE = ("dgx-h100", "hgx-h200", "l40s-pcie", "mixed")
"""The models whose GPUs are advertised whole at their default MIG layout (dgx-a100's are all in
MIG mode, so it advertises MIG devices only)."""
MIG_DYNAMIC = ("dgx-a100", "dgx-h100", "hgx-h200")
"""The MIG-capable models: with --mig-mode dynamic every profile x placement is a device."""
NO_WHOLE_GPU = "class-selector", 'device.attributes["gpu.tessera.dev"].type="mig"'
"""A whole-GPU class on a node whose GPUs are all in MIG mode: what the class selector saw."""
NO_MIG = "class-selector", 'device.attributes["gpu.tessera.dev"].type="gpu"'
NOT_SHARED = "class-selector", "device.allowMultipleAllocations=false"

FITS: dict[str, list[Fit]] = {
    "allocated-gpu-claim.yaml": [Fit(Node(m)) for m in model_names()],  # sample-gpu's spec
    "sample-gpu.yaml": [
        *[Fit(Node(m), requests=("gpu/whole",)) for m in WHOLE],
        Fit(Node("dgx-a100"), requests=("gpu/mig",)),
        Fit(Node("dgx-a100", "dynamic"), requests=("gpu/mig",)),
        Fit(Node("dgx-h100", "dynamic"), requests=("gpu/whole",)),
    ],
    "single-gpu.yaml": [Fit(Node(m)) for m in WHOLE],
    "four-nvlink-gpus.yaml": [
        Fit(Node("dgx-h100")),
        Fit(Node("hgx-h200")),
        Fit(Node("dgx-h100", "dynamic")),
    ],
    "gpu-and-nic.yaml": [Fit(Node(m)) for m in WHOLE],
    "mig-1g.yaml": [
        Fit(Node("dgx-a100")),  # a 1g.5gb
        Fit(Node("dgx-h100", layout="balanced")),  # a 1g.10gb
        *[Fit(Node(m, "dynamic")) for m in MIG_DYNAMIC],
    ],
    "dynamic-mig-2g.yaml": [Fit(Node("dgx-h100", "dynamic"))],
    "time-slicing.yaml": [
        *[Fit(Node(m), expect=TIME_SLICING) for m in WHOLE],
        Fit(Node("dgx-h100", sharing="time-slicing"), expect=TIME_SLICING),
        Fit(Node("dgx-h100", "dynamic"), expect=TIME_SLICING),
        # "works with any --sharing except memory-shares"
        Fit(Node("dgx-h100", sharing="memory-shares"), expect=REFUSED),
    ],
    "time-slicing-shared.yaml": [
        *[Fit(Node(m, sharing="time-slicing"), expect=TIME_SLICING) for m in WHOLE],
        # the class selects any shared GPU; preparing refuses time-slicing among memory shares
        Fit(Node("dgx-h100", sharing="memory-shares"), expect=REFUSED),
    ],
    "mps.yaml": [
        *[Fit(Node(m), expect=MPS) for m in WHOLE],
        Fit(Node("dgx-h100", sharing="time-slicing"), expect=MPS),
    ],
    "memory-share-8gi.yaml": [
        *[Fit(Node(m, sharing="memory-shares"), expect=MEMORY_SHARE) for m in WHOLE],
        # time-slicing GPUs allow multiple allocations too, so the scheduler places it; with no
        # sharing config the driver prepares the GPU unshared (a second claim on it would be
        # refused at prepare: "already prepared for claim ...")
        Fit(Node("dgx-h100", sharing="time-slicing")),
    ],
    "mps-on-mig.yaml": [
        Fit(Node("dgx-a100"), expect=MPS),
        Fit(Node("dgx-h100", layout="balanced"), expect=MPS),
        *[Fit(Node(m, "dynamic"), expect=MPS) for m in MIG_DYNAMIC],
    ],
}
"""Each example that asks for devices, and the nodes it is written for."""

MISFITS: dict[str, list[Misfit]] = {
    "allocated-gpu-claim.yaml": [],
    "sample-gpu.yaml": [],
    "single-gpu.yaml": [Misfit(Node("dgx-a100"), *NO_WHOLE_GPU)],
    "four-nvlink-gpus.yaml": [
        Misfit(Node("dgx-a100"), *NO_WHOLE_GPU),
        # no NVLink at all, and Ada (8.9) is not newer than 8.9.0
        Misfit(
            Node("l40s-pcie"),
            "request-selector",
            '"nvlinkClique" in device.attributes["gpu.tessera.dev"]=false, '
            'device.attributes["gpu.tessera.dev"].cudaComputeCapability=8.9.0',
        ),
        # the bridged A100 pair has a clique but is Ampere (8.0), and only two GPUs
        Misfit(Node("mixed"), "request-selector", "cudaComputeCapability=8.0.0"),
    ],
    "gpu-and-nic.yaml": [
        Misfit(Node("dgx-a100"), *NO_WHOLE_GPU),
        Misfit(
            Node("dgx-h100", nic_root="pci0000:ff"),
            "constraint",
            "matchAttribute resource.kubernetes.io/pcieRoot: pci0000:ff, but gpu-0 has pci0000:16",
        ),
    ],
    "mig-1g.yaml": [
        Misfit(Node("dgx-h100"), *NO_MIG),  # no MIG instances without --mig-mode dynamic
        Misfit(Node("hgx-h200"), *NO_MIG),
        Misfit(Node("l40s-pcie"), *NO_MIG),  # no MIG at all
        Misfit(Node("l40s-pcie", "dynamic"), *NO_MIG),
        Misfit(Node("mixed"), *NO_MIG),
    ],
    "dynamic-mig-2g.yaml": [
        # the A100-40GB's 2g profile is 2g.10gb, the H200's 2g.35gb
        Misfit(Node("dgx-a100"), "request-selector", 'profile="2g.10gb"'),
        Misfit(Node("dgx-a100", "dynamic"), "request-selector", 'profile="2g.10gb"'),
        Misfit(Node("hgx-h200", "dynamic"), "request-selector", 'profile="2g.35gb"'),
        Misfit(Node("dgx-h100"), *NO_MIG),
        Misfit(Node("hgx-h200"), *NO_MIG),
        Misfit(Node("l40s-pcie"), *NO_MIG),
        Misfit(Node("mixed"), *NO_MIG),
    ],
    "time-slicing.yaml": [Misfit(Node("dgx-a100"), *NO_WHOLE_GPU)],
    "time-slicing-shared.yaml": [
        Misfit(Node("dgx-a100"), *NO_WHOLE_GPU),
        Misfit(Node("dgx-a100", sharing="time-slicing"), *NO_WHOLE_GPU),
        *[Misfit(Node(m), *NOT_SHARED) for m in WHOLE],  # without --sharing time-slicing
    ],
    "mps.yaml": [Misfit(Node("dgx-a100"), *NO_WHOLE_GPU)],
    "memory-share-8gi.yaml": [
        Misfit(Node("dgx-a100", sharing="memory-shares"), *NO_WHOLE_GPU),
        Misfit(Node("dgx-a100"), *NO_WHOLE_GPU),
        # without --sharing memory-shares (or time-slicing) a GPU is exclusive
        *[
            Misfit(Node(m), "request-selector", "(saw device.allowMultipleAllocations=false)")
            for m in WHOLE
        ],
    ],
    "mps-on-mig.yaml": [
        Misfit(Node("dgx-h100"), *NO_MIG),
        Misfit(Node("hgx-h200"), *NO_MIG),
        Misfit(Node("l40s-pcie"), *NO_MIG),
        Misfit(Node("mixed"), *NO_MIG),
    ],
}
"""Each example on the nodes it is not written for, and the reason it does not fit there."""


def test_every_example_and_model_is_in_one_table() -> None:
    """A new example or model cannot go unchecked: every example that asks for devices, on
    every model at its defaults, either fits or misfits (and no node is in both tables)."""
    asking = {p.name for p in EXAMPLES.glob("*.yaml") if claims(documents(p))}
    assert asking == set(FITS) == set(MISFITS), "add the example to FITS and MISFITS"
    for name in sorted(asking):
        fit = {str(f.node) for f in FITS[name]}
        misfit = {str(m.node) for m in MISFITS[name]}
        assert not fit & misfit, (name, fit & misfit)
        for model in model_names():
            assert str(Node(model)) in fit | misfit, f"{name} on {model}: in neither table"


@pytest.mark.parametrize(
    ("name", "fit"),
    [pytest.param(n, f, id=f"{n}@{f.node}") for n, fits in FITS.items() for f in fits],
)
def test_each_example_allocates_and_the_driver_takes_its_config(name: str, fit: Fit) -> None:
    """The allocator allocates every claim of the example on the node, and preparing the
    allocation (status.allocation as the scheduler would write it, parsed by the driver) with
    the example's class and claim configs plans the sharing the example says."""
    node = fit.node
    model, _ = published(node)
    config = node.config()
    for claim, e, slices in run(name, node):
        assert e.ok, f"{name} on {node}:\n{e.text()}"
        allocation = e.allocation()
        results = allocation["devices"]["results"]
        devices = slice_devices(slices)
        assert all(r["device"] in devices for r in results), results
        if fit.requests is not None:
            assert tuple(r["request"] for r in results) == fit.requests, results
        if "nic" in {r["request"] for r in results}:
            # the constraint held: the GPU chosen is the one on the NIC's root
            roots = {devices[r["device"]]["attributes"][PCIE_ROOT]["string"] for r in results}
            assert len(roots) == 1, (roots, results)
        written = claim.get("status", {}).get("allocation")
        if written is not None and written["devices"]["results"][0]["pool"] == node.model:
            assert results == written["devices"]["results"], "the example's allocation is stale"
        key = ClaimKey("default", claim["metadata"]["name"], "uid-example")
        obj = {"metadata": {"uid": key.uid}, "status": {"allocation": allocation}}
        taken = parse_allocation(obj, key, config.driver_name, node.model)
        assert taken.devices, f"{name} asks this driver for nothing"
        if fit.expect == REFUSED:
            with pytest.raises(ParamsError):
                plan_claim(taken, model, config.sharing_policy())
            continue
        plan = plan_claim(taken, model, config.sharing_policy())
        assert {p.sharing for p in plan.devices} == {fit.expect}, (name, node, plan)


@pytest.mark.parametrize(
    ("name", "misfit"),
    [pytest.param(n, m, id=f"{n}@{m.node}") for n, ms in MISFITS.items() for m in ms],
)
def test_each_example_fails_elsewhere_with_the_reason_a_user_sees(
    name: str, misfit: Misfit
) -> None:
    (result,) = [e for _, e, _ in run(name, misfit.node)]
    assert not result.ok, f"{name} allocates on {misfit.node}:\n{result.text()}"
    j = result.to_json()
    reasons = [j["fatal"]] if j["fatal"] else []
    for request in j["requests"]:
        for alt in request["alternatives"]:
            reasons += [d["reason"] for d in alt["devices"] if d["reason"]]
    of_kind = [r["text"] for r in reasons if r["kind"] == misfit.kind]
    assert of_kind, f"no {misfit.kind} reason: {sorted({r['kind'] for r in reasons})}"
    assert any(misfit.text in t for t in of_kind), (misfit.text, sorted(set(of_kind))[:3])


# -- the cookbook's attribute table --------------------------------------------------------------


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


@pytest.mark.parametrize("mig_mode", ["static", "dynamic"])
@pytest.mark.parametrize("model", model_names())
def test_attribute_table_says_which_devices_carry_each_attribute(model: str, mig_mode: str) -> None:
    advertised, _ = published(Node(model, mig_mode))
    wanted: dict[str, Callable[[AdvertisedDevice], bool]] = {
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
        for d in advertised.devices:
            carried = {k.removeprefix(f"{DOMAIN}/") for k, _ in d.attributes}
            assert (name in carried) == wanted[on](d), (name, on, d.name)
