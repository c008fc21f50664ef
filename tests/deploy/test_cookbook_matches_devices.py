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

from agent.cli.node_access import open_node
from agent.cli.node_commands import advertise, slices_for
from agent.config import Config
from agent.discovery.inventory import NodeInventory
from agent.node import discover
from agent.sim.model import model_names
from dra_driver.device_model import MIG_MODES, SHARING_MODES, AdvertisedDevice, DeviceModel
from dra_driver.errors import ClaimError, ParamsError
from dra_driver.kubeletplugin.checkpoint import Checkpoint, ClaimEntry, PreparedDevice
from dra_driver.kubeletplugin.claims import Allocation, ClaimKey, parse_allocation
from dra_driver.kubeletplugin.plan import (
    MEMORY_SHARE,
    MPS,
    TIME_SLICING,
    ClaimPlan,
    conflicts,
    plan_claim,
)
from dra_driver.scheduler.celenv import CelEnvironment
from dra_driver.scheduler.explanation import Explanation, explain

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "daemonset" / "examples"
CLASSES = ROOT / "deploy" / "daemonset" / "deviceclasses.yaml"
DOMAIN = "gpu.tessera.dev"

# -- the simulated nodes, discovered once per process ------------------------------------------

_INVENTORIES: dict[tuple[str, str | None], NodeInventory] = {}
_PUBLISHED: dict[tuple[str, str | None, str, str], tuple[DeviceModel, list[dict[str, Any]]]] = {}


@dataclass(frozen=True)
class Node:
    """A simulated node: model, --mig-mode, --sharing, --sim-mig-layout (None: the model's
    default); for gpu-and-nic.yaml, the PCIe root of the other driver's NIC (None: the root of
    the node's last whole GPU); ``busy``: devices another claim holds (as the scheduler sees
    them: allocated to ``default/busy``)."""

    model: str
    mig_mode: str = "static"
    sharing: str = "none"
    layout: str | None = None
    nic_root: str | None = None
    busy: tuple[str, ...] = ()

    def __str__(self) -> str:
        layout = f"/{self.layout}" if self.layout else ""
        nic = f"/nic@{self.nic_root}" if self.nic_root else ""
        busy = f"/busy:{','.join(self.busy)}" if self.busy else ""
        return f"{self.model}/{self.mig_mode}/{self.sharing}{layout}{nic}{busy}"

    def config(self) -> Config:
        return Config.of(
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


def held(node: Node) -> list[dict[str, Any]]:
    """The claim that holds the node's busy devices, as the scheduler's allocated state has it."""
    if not node.busy:
        return []
    results = [
        {"request": "held", "driver": DOMAIN, "pool": node.model, "device": name}
        for name in node.busy
    ]
    allocation = {"devices": {"results": results}}
    return [
        {"metadata": {"namespace": "default", "name": "busy"}, "status": {"allocation": allocation}}
    ]


def run(name: str, node: Node) -> list[tuple[dict[str, Any], Explanation, list[dict[str, Any]]]]:
    """Each claim of the example explained on the node, with the slices it was explained on:
    the installed DeviceClasses and those the example defines; the NIC driver's slice and
    class when the claim asks for a NIC; the node's busy devices held by another claim."""
    docs = documents(EXAMPLES / name)
    out = []
    for claim in claims(docs):
        node_classes, node_slices = scene(docs, claim, node)
        e = explain(claim, node_classes, node_slices, held(node), cel=CelEnvironment())
        out.append((claim, e, node_slices))
    return out


def scene(
    docs: list[dict[str, Any]], claim: dict[str, Any], node: Node
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The DeviceClasses and ResourceSlices a claim of the example is allocated against on the
    node (see ``run``)."""
    classes = [d for d in documents(CLASSES) + docs if d["kind"] == "DeviceClass"]
    _, slices = published(node)
    if NIC_CLASS["metadata"]["name"] in class_names(claim):
        return [*classes, NIC_CLASS], [*slices, nic_slice(node.model, nic_root(node, slices))]
    return classes, list(slices)


def matched_values(
    constraint: dict[str, Any], results: list[dict[str, Any]], devices: dict[str, dict[str, Any]]
) -> set[str]:
    """The values of a matchAttribute constraint's attribute on the devices allocated for the
    requests it names (all requests when it names none; ``gpu`` covers ``gpu/hopper``). A
    driver's own attributes are published without its domain (``nvlinkClique`` for
    ``gpu.tessera.dev/nvlinkClique``), standard ones with theirs."""
    named = constraint.get("requests")
    picked = [r for r in results if not named or r["request"].split("/", 1)[0] in named]
    return set(attribute_values(constraint["matchAttribute"], picked, devices))


def attribute_values(
    name: str, results: list[dict[str, Any]], devices: dict[str, dict[str, Any]]
) -> list[str]:
    """The attribute ``name`` of each allocated device, in result order."""
    values = []
    for r in results:
        attrs = devices[r["device"]]["attributes"]
        domain, _, bare = name.partition("/")
        value = attrs.get(name) or (attrs.get(bare) if domain == r["driver"] else None)
        assert value is not None, f"{r['device']} has no {name}"
        values.append(str(next(iter(value.values()))))
    return values


def taken_by_driver(
    claim: dict[str, Any], allocation: dict[str, Any], node: Node, uid: str = "uid-example"
) -> Allocation:
    """The allocation as the driver reads it from the claim's status (its devices, and the class
    and claim configs for it in the order it applies them)."""
    key = ClaimKey("default", claim["metadata"]["name"], uid)
    obj = {"metadata": {"uid": key.uid}, "status": {"allocation": allocation}}
    return parse_allocation(obj, key, node.config().driver.driver_name, node.model)


# -- where each example fits, and where it does not (and why) -----------------------------------


@dataclass(frozen=True)
class Fit:
    """The example allocates on the node; the driver shares the device(s) as ``expect`` says
    (None: exclusive; a plan.py sharing), and ``requests`` are the (sub)requests the allocation
    answers (None: not checked). Nowhere is an example allocated and then refused at prepare
    (test_no_example_is_allocated_where_the_driver_refuses_it)."""

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


def sharing_seen(mode: str) -> str:
    """A selector on the ``sharing`` attribute, as the allocator shows what it saw."""
    return f'device.attributes["gpu.tessera.dev"].sharing="{mode}"'


NOT_TIME_SLICING = "class-selector", sharing_seen("none")
MEMORY_SHARES = Node("dgx-h100", sharing="memory-shares")
TIME_SLICING_NODE = Node("dgx-h100", sharing="time-slicing")

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
    ],
    "time-slicing-shared.yaml": [
        *[Fit(Node(m, sharing="time-slicing"), expect=TIME_SLICING) for m in WHOLE],
    ],
    "mps.yaml": [
        *[Fit(Node(m), expect=MPS) for m in WHOLE],
        Fit(Node("dgx-h100", sharing="time-slicing"), expect=MPS),
    ],
    "memory-share-8gi.yaml": [
        *[Fit(Node(m, sharing="memory-shares"), expect=MEMORY_SHARE) for m in WHOLE],
    ],
    "memory-shares-on-two-gpus.yaml": [  # two different GPUs: the constraint
        *[Fit(Node(m, sharing="memory-shares"), expect=MEMORY_SHARE) for m in WHOLE],
    ],
    "mps-on-mig.yaml": [
        Fit(Node("dgx-a100"), expect=MPS),
        Fit(Node("dgx-h100", layout="balanced"), expect=MPS),
        *[Fit(Node(m, "dynamic"), expect=MPS) for m in MIG_DYNAMIC],
    ],
    "two-gpus-one-numa.yaml": [
        *[Fit(Node(m)) for m in WHOLE],  # mixed: the A100 pair on NUMA 0 (or the L4s on 1)
        Fit(Node("dgx-h100", "dynamic")),
        # free: gpu-3 on socket 0, gpu-6 and gpu-7 on socket 1; the first free GPU is not the one
        # to take (the constraint check above sees the pair is on one NUMA node)
        Fit(Node("dgx-h100", busy=("gpu-0", "gpu-1", "gpu-2", "gpu-4", "gpu-5"))),
    ],
    "power-capped-gpu.yaml": [
        Fit(Node("l40s-pcie"), requests=("gpu/efficient",)),  # 350 W, takes 100..350 W
        Fit(Node("mixed"), requests=("gpu/efficient",)),  # an A100 PCIe (300 W), not an L4
        Fit(Node("dgx-h100"), requests=("gpu/any",)),  # 700 W
        Fit(Node("hgx-h200"), requests=("gpu/any",)),
        Fit(Node("dgx-h100", "dynamic"), requests=("gpu/any",)),
        Fit(Node("dgx-h100", sharing="time-slicing"), requests=("gpu/any",)),  # held alone
    ],
    "prefer-hopper.yaml": [
        Fit(Node("dgx-h100"), requests=("gpu/hopper",)),
        Fit(Node("hgx-h200"), requests=("gpu/hopper",)),
        Fit(Node("dgx-h100", "dynamic"), requests=("gpu/hopper",)),
        Fit(Node("mixed"), requests=("gpu/ampere",)),  # an A100 80GB PCIe, not an L4
        Fit(Node("dgx-a100", layout="none"), requests=("gpu/ampere",)),  # MIG off: whole A100s
    ],
    "mig-1g-and-3g.yaml": [
        Fit(Node("dgx-a100")),  # each GPU: 3g.20gb, 2g.10gb, 2x 1g.5gb
        Fit(Node("dgx-h100", layout="balanced")),
        Fit(Node("hgx-h200", layout="balanced")),
        *[Fit(Node(m, "dynamic")) for m in MIG_DYNAMIC],  # two placements that do not overlap
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
        # the guard: memory shares of one GPU are not four GPUs (test_whole_gpu_examples_...)
        Misfit(MEMORY_SHARES, "request-selector", sharing_seen("memory-shares")),
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
    "time-slicing.yaml": [
        Misfit(Node("dgx-a100"), *NO_WHOLE_GPU),
        # a memory-shares node never time-slices a GPU: the class does not select its GPUs
        Misfit(MEMORY_SHARES, "class-selector", sharing_seen("memory-shares")),
    ],
    "time-slicing-shared.yaml": [
        Misfit(Node("dgx-a100"), *NO_WHOLE_GPU),
        Misfit(Node("dgx-a100", sharing="time-slicing"), *NO_WHOLE_GPU),
        *[Misfit(Node(m), *NOT_TIME_SLICING) for m in WHOLE],  # without --sharing time-slicing
        Misfit(MEMORY_SHARES, "class-selector", sharing_seen("memory-shares")),
    ],
    "mps.yaml": [
        Misfit(Node("dgx-a100"), *NO_WHOLE_GPU),
        Misfit(MEMORY_SHARES, "class-selector", sharing_seen("memory-shares")),
    ],
    "memory-shares-on-two-gpus.yaml": [
        Misfit(Node("dgx-a100"), *NO_WHOLE_GPU),
        *[Misfit(Node(m), "request-selector", sharing_seen("none")) for m in WHOLE],
        Misfit(TIME_SLICING_NODE, "request-selector", sharing_seen("time-slicing")),
    ],
    "memory-share-8gi.yaml": [
        Misfit(Node("dgx-a100", sharing="memory-shares"), *NO_WHOLE_GPU),
        Misfit(Node("dgx-a100"), *NO_WHOLE_GPU),
        # a GPU of another mode: exclusive, or time-sliced (where a share that does not
        # time-slice would be refused at prepare)
        *[Misfit(Node(m), "request-selector", sharing_seen("none")) for m in WHOLE],
        Misfit(TIME_SLICING_NODE, "request-selector", sharing_seen("time-slicing")),
    ],
    "mps-on-mig.yaml": [
        Misfit(Node("dgx-h100"), *NO_MIG),
        Misfit(Node("hgx-h200"), *NO_MIG),
        Misfit(Node("l40s-pcie"), *NO_MIG),
        Misfit(Node("mixed"), *NO_MIG),
    ],
    "two-gpus-one-numa.yaml": [
        Misfit(Node("dgx-a100"), *NO_WHOLE_GPU),
        # the guard: memory shares of one GPU are not two GPUs (test_whole_gpu_examples_...)
        Misfit(MEMORY_SHARES, "request-selector", sharing_seen("memory-shares")),
        # one GPU free on each socket: the constraint, not the count, is why
        Misfit(
            Node("l40s-pcie", busy=("gpu-1", "gpu-3")),
            "constraint",
            "matchAttribute resource.kubernetes.io/numaNode: 1, but gpu-0 has 0",
        ),
    ],
    "power-capped-gpu.yaml": [
        Misfit(Node("dgx-a100"), *NO_WHOLE_GPU),
        # a memory share is never capped: neither subrequest takes a memory-shares GPU
        Misfit(MEMORY_SHARES, "request-selector", sharing_seen("memory-shares")),
        # the mixed server's A100s are taken: its L4s (40..72 W) cannot take a 250 W cap
        Misfit(
            Node("mixed", busy=("gpu-0", "gpu-1")),
            "request-selector",
            'device.attributes["gpu.tessera.dev"].powerLimitMaxWatts=72',
        ),
    ],
    "prefer-hopper.yaml": [
        # neither subrequest: the L40S is Ada Lovelace
        *[
            Misfit(Node("l40s-pcie"), "class-selector", f"class {g}.gpu.tessera.dev selector #0")
            for g in ("hopper", "ampere")
        ],
        Misfit(Node("l40s-pcie"), "class-selector", 'architecture="Ada Lovelace"'),
        Misfit(Node("dgx-a100"), *NO_WHOLE_GPU),  # Ampere, but every GPU is in MIG mode
        # the mixed server's A100s are taken: the L4s left are Ada Lovelace
        Misfit(Node("mixed", busy=("gpu-0", "gpu-1")), "allocated", "claim default/busy"),
    ],
    "mig-1g-and-3g.yaml": [
        Misfit(Node("dgx-h100"), *NO_MIG),
        Misfit(Node("hgx-h200"), *NO_MIG),
        Misfit(Node("l40s-pcie"), *NO_MIG),
        Misfit(Node("mixed"), *NO_MIG),
        Misfit(Node("dgx-h100", layout="all-1g"), "request-selector", 'profile="1g.10gb"'),
        # gpu-0's 1g devices and every other GPU's 3g are taken: a 1g and a 3g are free, but
        # never on one GPU
        Misfit(
            Node(
                "dgx-a100",
                busy=(
                    "gpu-0-mig-1g5gb-19-2",
                    "gpu-0-mig-1g5gb-19-3",
                    *[f"gpu-{i}-mig-3g20gb-9-4" for i in range(1, 8)],
                ),
            ),
            "constraint",
            "matchAttribute gpu.tessera.dev/parentUUID: GPU-",
        ),
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
        for constraint in claim["spec"]["devices"].get("constraints", []):
            if "distinctAttribute" in constraint:
                picked = [r for r in results if r["request"] in constraint["requests"]]
                values = attribute_values(constraint["distinctAttribute"], picked, devices)
                assert len(set(values)) == len(values), (constraint, values, results)
                continue
            values = matched_values(constraint, results, devices)
            assert len(values) == 1, (constraint, values, results)
        written = claim.get("status", {}).get("allocation")
        if written is not None and written["devices"]["results"][0]["pool"] == node.model:
            assert results == written["devices"]["results"], "the example's allocation is stale"
        taken = taken_by_driver(claim, allocation, node)
        assert taken.devices, f"{name} asks this driver for nothing"
        plan = plan_claim(taken, model, config.driver.sharing_policy())
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


# -- nothing allocated that prepare refuses ------------------------------------------------------

EVERY_MODE = [
    Node(m, mig, sharing) for m in model_names() for mig in MIG_MODES for sharing in SHARING_MODES
]
"""Every simulated model under every --mig-mode and --sharing (at its default MIG layout)."""


def prepared(uid: str, plan: ClaimPlan, pool: str) -> ClaimEntry:
    """The checkpoint's record of a prepared claim, as prepare writes it (records.py
    ``Records.device``; the CDI ids play no part in who may share a device)."""
    devices = []
    for p in plan.devices:
        d = p.device
        placement = None
        if p.dynamic and d.mig_profile_id is not None and d.mig_placement_start is not None:
            placement = (d.mig_profile_id, d.mig_placement_start, d.mig_placement_size or 0)
        devices.append(
            PreparedDevice(
                request_names=p.request_names,
                pool=pool,
                device=d.name,
                cdi_device_ids=(),
                kind=d.kind,
                gpu_uuid=d.parent_uuid,
                gpu_minor=d.gpu_minor,
                placement=placement,
                sharing=p.sharing,
                interval=p.interval,
                share_id=p.share_id,
                memory_bytes=p.memory_bytes,
            )
        )
    return ClaimEntry(uid, "default", "first", "PREPARE_COMPLETED", tuple(devices), 0.0)


def refusals(docs: list[dict[str, Any]], claim: dict[str, Any], node: Node) -> list[str]:
    """Why the driver would refuse the claim where the allocator places it on the node (nothing:
    it prepares it), and a second claim of the same spec that the allocator places beside the
    first (the scheduler seeing the first one's allocation, as with a template's claims)."""
    model, _ = published(node)
    policy = node.config().driver.sharing_policy()
    classes, slices = scene(docs, claim, node)
    first = explain(claim, classes, slices, [], cel=CelEnvironment())
    if not first.ok:
        return []
    try:
        plan = plan_claim(taken_by_driver(claim, first.allocation(), node), model, policy)
    except (ClaimError, ParamsError) as e:
        return [f"{node}: {e}"]
    second_claim = {**claim, "metadata": {**claim["metadata"], "name": "second"}}
    allocated = {"metadata": claim["metadata"], "status": {"allocation": first.allocation()}}
    second = explain(second_claim, classes, slices, [allocated], cel=CelEnvironment())
    if not second.ok:
        return []
    key = ClaimKey("default", "second", "uid-second")
    checkpoint = Checkpoint("boot", {}).with_claim(prepared("uid-example", plan, node.model))
    try:
        taken = taken_by_driver(second_claim, second.allocation(), node, key.uid)
        beside = plan_claim(taken, model, policy)
        conflicts(checkpoint, key, node.model, beside.devices, policy)
    except (ClaimError, ParamsError) as e:
        return [f"{node}, a second claim: {e}"]
    return []


@pytest.mark.parametrize("name", sorted(FITS))
def test_no_example_is_allocated_where_the_driver_refuses_it(name: str) -> None:
    """On every model under every mode, wherever the allocator places a claim of the example
    (and a second one beside it) the driver prepares them: the example selects only devices
    whose node can do what it asks."""
    docs = documents(EXAMPLES / name)
    found = [
        r for node in EVERY_MODE for claim in claims(docs) for r in refusals(docs, claim, node)
    ]
    assert found == []


# -- memory shares are not whole GPUs -----------------------------------------------------------

WHOLE_GPU_EXAMPLES = {"two-gpus-one-numa.yaml": 2, "four-nvlink-gpus.yaml": 4}
"""The examples that ask for several whole GPUs in one request, and how many."""
NOT_A_SHARE = (
    '!("sharing" in device.attributes["gpu.tessera.dev"]) || '
    'device.attributes["gpu.tessera.dev"].sharing != "memory-shares"'
)
"""Their guard: a selector that keeps them off memory-share GPUs."""


def without_guard(claim: dict[str, Any]) -> dict[str, Any]:
    """The claim with its NOT_A_SHARE selectors left out (every request has had one)."""
    requests = []
    for r in claim["spec"]["devices"]["requests"]:
        kept = [s for s in r["exactly"]["selectors"] if s["cel"]["expression"] != NOT_A_SHARE]
        assert len(kept) == len(r["exactly"]["selectors"]) - 1, r
        requests.append({**r, "exactly": {**r["exactly"], "selectors": kept}})
    return {**claim, "spec": {"devices": {**claim["spec"]["devices"], "requests": requests}}}


def chosen_devices(e: Explanation) -> list[str]:
    return [r["device"] for r in e.allocation()["devices"]["results"]] if e.ok else []


@pytest.mark.parametrize("name", sorted(WHOLE_GPU_EXAMPLES))
def test_whole_gpu_examples_never_get_one_gpu_twice(name: str) -> None:
    """Under --sharing memory-shares every GPU allows multiple allocations, and the scheduler
    tries a GPU again for the next device of a request (structured/internal/experimental/
    allocator_experimental.go, allocateOne): without its selector on `sharing` the example gets
    shares of gpu-0 alone; with it, nothing there (MISFITS says with which reason)."""
    docs = documents(EXAMPLES / name)
    (claim,) = claims(docs)
    classes, slices = scene(docs, claim, MEMORY_SHARES)
    bare = explain(without_guard(claim), classes, slices, [], cel=CelEnvironment())
    assert chosen_devices(bare) == ["gpu-0"] * WHOLE_GPU_EXAMPLES[name], bare.text()
    guarded = explain(claim, classes, slices, [], cel=CelEnvironment())
    assert not guarded.ok, guarded.text()


@pytest.mark.parametrize("name", sorted(WHOLE_GPU_EXAMPLES))
def test_the_guard_changes_nothing_on_the_other_modes(name: str) -> None:
    """On every model under every --mig-mode and every --sharing but memory-shares, the example
    allocates exactly what it allocated before the guard (or fails as it did): its GPUs are
    whole there, and the `sharing` test is true of each."""
    docs = documents(EXAMPLES / name)
    (claim,) = claims(docs)
    for node in [n for n in EVERY_MODE if n.sharing != "memory-shares"]:
        classes, slices = scene(docs, claim, node)
        before = explain(without_guard(claim), classes, slices, [], cel=CelEnvironment())
        after = explain(claim, classes, slices, [], cel=CelEnvironment())
        assert (after.ok, chosen_devices(after)) == (before.ok, chosen_devices(before)), node
        if after.ok:
            assert len(set(chosen_devices(after))) == WHOLE_GPU_EXAMPLES[name], node


def test_distinct_attribute_does_not_keep_a_request_of_four_on_four_gpus() -> None:
    """Why the guard is a selector and not a distinctAttribute on the GPU's uuid: upstream's
    constraint keeps one value per request (the last device added; constraint.go,
    distinctAttributeConstraint.add), so a request of four on a memory-shares node gets gpu-0,
    gpu-1, gpu-0, gpu-1. (It also needs DRAConsumableCapacity, without which the API server
    refuses the claim.) Across requests it does keep devices apart:
    memory-shares-on-two-gpus.yaml."""
    docs = documents(EXAMPLES / "four-nvlink-gpus.yaml")
    (claim,) = claims(docs)
    bare = without_guard(claim)
    constraint = {"requests": ["gpus"], "distinctAttribute": f"{DOMAIN}/uuid"}
    devices = {**bare["spec"]["devices"]}
    devices["constraints"] = [*devices["constraints"], constraint]
    classes, slices = scene(docs, claim, MEMORY_SHARES)
    e = explain({**bare, "spec": {"devices": devices}}, classes, slices, [], cel=CelEnvironment())
    assert chosen_devices(e) == ["gpu-0", "gpu-1", "gpu-0", "gpu-1"], e.text()


# -- the DeviceClasses ---------------------------------------------------------------------------

GENERATIONS = {
    "hopper.gpu.tessera.dev": {"NVIDIA H100 80GB HBM3", "NVIDIA H200"},
    "ampere.gpu.tessera.dev": {"NVIDIA A100-SXM4-40GB", "NVIDIA A100 80GB PCIe"},
    "ada.gpu.tessera.dev": {"NVIDIA L40S", "NVIDIA L4"},
}
"""Each generation class and the simulated products it is for (by product, not architecture,
so that the table does not restate the selector)."""


VM_CLASSES = {"vfio.gpu.tessera.dev": "vfio", "vgpu.gpu.tessera.dev": "vgpu"}
"""The classes of VM devices and the device type each is for."""


def meant_for(class_name: str, device: dict[str, Any]) -> bool:
    """Whether the class is meant to select the device (a ResourceSlice device)."""
    kind = device["attributes"]["type"]["string"]
    if class_name == "gpu.tessera.dev":
        return kind == "gpu"
    if class_name == "shared-gpu.tessera.dev":  # time-sliced: not where GPUs are memory shares
        return kind == "gpu" and device["attributes"]["sharing"]["string"] != "memory-shares"
    if class_name == "mig.gpu.tessera.dev":
        return kind == "mig"
    if class_name in VM_CLASSES:
        return kind == VM_CLASSES[class_name]
    return (
        kind == "gpu" and device["attributes"]["productName"]["string"] in GENERATIONS[class_name]
    )


INSTALLED = [d for d in documents(CLASSES) if d["kind"] == "DeviceClass"]
CLASS_NODES = [
    *[Node(m, mode) for m in model_names() for mode in ("static", "dynamic")],
    Node("dgx-a100", layout="none"),  # MIG off: eight whole A100s
    *[Node(m, sharing=mode) for m in WHOLE for mode in ("time-slicing", "memory-shares")],
]
SELECTED_AT_DEFAULTS = {
    # class: devices selected on dgx-a100, dgx-h100, hgx-h200, l40s-pcie, mixed
    "gpu.tessera.dev": (0, 8, 8, 4, 4),
    "mig.gpu.tessera.dev": (32, 0, 0, 0, 0),
    "shared-gpu.tessera.dev": (0, 8, 8, 4, 4),
    "hopper.gpu.tessera.dev": (0, 8, 8, 0, 0),
    "ampere.gpu.tessera.dev": (0, 0, 0, 0, 2),
    "ada.gpu.tessera.dev": (0, 0, 0, 4, 2),
    # no VM devices without --virtualization (tests/deploy/test_vm_classes.py: with it)
    "vfio.gpu.tessera.dev": (0, 0, 0, 0, 0),
    "vgpu.gpu.tessera.dev": (0, 0, 0, 0, 0),
}


def class_claim(class_name: str, config: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    request = {"name": "gpu", "exactly": {"deviceClassName": class_name}}
    devices: dict[str, Any] = {"requests": [request]}
    if config:
        devices["config"] = config
    return {"metadata": {"name": "by-class", "namespace": "default"}, "spec": {"devices": devices}}


def selected_by(class_name: str, node: Node) -> set[str]:
    """The devices of the node the class's selectors accept, as the allocator decides: every
    device it did not reject for its class selector."""
    _, slices = published(node)
    e = explain(class_claim(class_name), INSTALLED, slices, [], cel=CelEnvironment())
    ((alt,),) = [r["alternatives"] for r in e.to_json()["requests"]]
    devices = alt["devices"]
    assert len(devices) == len(slice_devices(slices))
    return {
        d["device"]
        for d in devices
        if d["reason"] is None or d["reason"]["kind"] != "class-selector"
    }


def test_the_installed_classes_are_the_documented_ones() -> None:
    """Every class in deviceclasses.yaml is in the tables here and in the cookbook; the names
    users already have (gpu.tessera.dev, mig.gpu.tessera.dev) stay."""
    names = [c["metadata"]["name"] for c in INSTALLED]
    assert set(names) == set(SELECTED_AT_DEFAULTS) and len(names) == len(set(names))
    assert {"gpu.tessera.dev", "mig.gpu.tessera.dev"} <= set(names)
    cookbook = (ROOT / "docs" / "claims-cookbook.md").read_text()
    assert all(f"`{n}`" in cookbook for n in names), "document each class in the cookbook"


@pytest.mark.parametrize("node", CLASS_NODES, ids=str)
@pytest.mark.parametrize("class_name", list(SELECTED_AT_DEFAULTS))
def test_each_class_selects_exactly_the_devices_it_is_for(class_name: str, node: Node) -> None:
    _, slices = published(node)
    meant = {n for n, d in slice_devices(slices).items() if meant_for(class_name, d)}
    assert selected_by(class_name, node) == meant


@pytest.mark.parametrize("class_name", list(SELECTED_AT_DEFAULTS))
def test_each_class_selects_what_the_table_says_on_each_model(class_name: str) -> None:
    counts = tuple(len(selected_by(class_name, Node(m))) for m in model_names())
    assert model_names() == ["dgx-a100", "dgx-h100", "hgx-h200", "l40s-pcie", "mixed"]
    assert counts == SELECTED_AT_DEFAULTS[class_name]


SHARED = "shared-gpu.tessera.dev"
MPS_CONFIG = {
    "opaque": {
        "driver": DOMAIN,
        "parameters": {
            "apiVersion": "gpu.tessera.dev/v1alpha1",
            "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 25}},
        },
    }
}


def plan_by_class(node: Node, config: list[dict[str, Any]] | None = None) -> Any:
    claim = class_claim(SHARED, config)
    model, slices = published(node)
    e = explain(claim, INSTALLED, slices, [], cel=CelEnvironment())
    assert e.ok, e.text()
    taken = taken_by_driver(claim, e.allocation(), node)
    assert [c.source for c in taken.configs] == ["FromClass"] + ["FromClaim"] * len(config or [])
    return plan_claim(taken, model, node.config().driver.sharing_policy())


@pytest.mark.parametrize(
    "node", [*[Node(m) for m in WHOLE], Node("dgx-h100", sharing="time-slicing")], ids=str
)
def test_the_shared_class_config_reaches_the_driver_as_time_slicing(node: Node) -> None:
    """The class's own config (no config in the claim) is what the driver applies: the GPU is
    time-sliced at the Default interval."""
    (planned,) = plan_by_class(node).devices
    assert (planned.sharing, planned.interval) == (TIME_SLICING, "Default")


def test_a_claim_config_wins_over_the_shared_class_config() -> None:
    (planned,) = plan_by_class(Node("dgx-h100"), [MPS_CONFIG]).devices
    assert (planned.sharing, planned.thread_percentage) == (MPS, 25)


def test_the_shared_class_takes_no_gpu_of_a_memory_shares_node() -> None:
    """Its config time-slices, which a memory-shares node never does: the class selects none of
    its GPUs (the claim waits, with the reason, instead of being refused at prepare)."""
    assert selected_by(SHARED, MEMORY_SHARES) == set()
    assert len(selected_by(SHARED, TIME_SLICING_NODE)) == 8


def test_mps_example_limits_reach_the_driver() -> None:
    """mps.yaml: half the SMs and 8 GiB per client, over the class's time-slicing."""
    node = Node("dgx-h100")
    model, _ = published(node)
    ((claim, e, _),) = run("mps.yaml", node)
    plan = plan_claim(taken_by_driver(claim, e.allocation(), node), model)
    (planned,) = plan.devices
    assert (planned.sharing, planned.thread_percentage) == (MPS, 50)
    assert planned.pinned_memory_bytes == 8 * 1024**3


@pytest.mark.parametrize("class_name", list(SELECTED_AT_DEFAULTS))
def test_no_class_is_allocated_where_the_driver_refuses_it(class_name: str) -> None:
    """A claim that names only the class (the class's own config, if any, applies) is prepared
    wherever the allocator places it, on every model under every mode."""
    claim = class_claim(class_name)
    assert [r for node in EVERY_MODE for r in refusals([], claim, node)] == []


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
    check_attribute_table(advertised)


CARRIED_ON: dict[str, Callable[[AdvertisedDevice], bool]] = {
    "all": lambda d: True,
    "all (MIG, VM devices: the GPU's)": lambda d: True,
    "all but vGPUs": lambda d: d.kind != "vgpu",
    "all but MIG": lambda d: d.kind != "mig",
    "all but MIG (VM devices: the GPU's)": lambda d: d.kind != "mig",
    "whole GPUs": lambda d: d.kind == "gpu",
    "GPUs, MIG": lambda d: d.kind in ("gpu", "mig"),
    "MIG": lambda d: d.kind == "mig",
    "MIG, vGPUs": lambda d: d.kind in ("mig", "vgpu"),
    "GPUs, static MIG, vfio": lambda d: d.kind in ("gpu", "vfio") or d.uuid is not None,
    "vfio": lambda d: d.kind == "vfio",
    "vGPUs": lambda d: d.kind == "vgpu",
}
"""The cookbook's "on" column: which devices carry an attribute (conditional rows, "GPUs with
NVLink", are not here)."""


def check_attribute_table(advertised: DeviceModel) -> None:
    """Each attribute of the cookbook's table is on exactly the devices its row says."""
    table = attribute_table()
    assert "nvlinkLinks" in table and "pcieRoot" not in table  # qualified names stay whole
    assert "vgpuType" in table and "iommuGroup" in table
    for name, on in table.items():
        if on not in CARRIED_ON:
            continue  # conditional rows ("GPUs with NVLink"), other tables' rows
        for d in advertised.devices:
            carried = {k.removeprefix(f"{DOMAIN}/") for k, _ in d.attributes}
            assert (name in carried) == CARRIED_ON[on](d), (name, on, d.name)
