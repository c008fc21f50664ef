"""The scheduler version and feature gates explain models (dra_driver.scheduler.versions): the
same slices (Tessera's own, from the simulator, in the 1.34 and the 1.35 layout) allocated
under each version, one row per upstream rule, each citing the file and function of
k8s.io/dynamic-resource-allocation (release-1.34 / release-1.35) it follows."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.cli.node_commands import published_slices
from agent.config import Config
from dra_driver.scheduler.celenv import CelEnvironment
from dra_driver.scheduler.explanation import Explanation, explain
from dra_driver.scheduler.versions import (
    DEFAULT_GATES,
    GATES,
    Scheduler,
    VersionError,
    parse_gates,
    server_version,
    version_of,
)
from tests.dra_driver.allocator_helpers import DRIVER, allocated, claim, dev, exact, klass, rslice
from tests.dra_driver.allocator_helpers import first_available as first
from tests.k8sschema import validate as validate_k8s

ROOT = Path(__file__).resolve().parents[2]
A = f'device.attributes["{DRIVER}"]'
CLASSES = [
    *yaml.safe_load_all((ROOT / "deploy/daemonset/deviceclasses.yaml").read_text()),
    klass("any", "true"),
]
MIG = "mig.gpu.tessera.dev"
GPU = "gpu.tessera.dev"
ONE_G = f'{A}.minor == 0 && {A}.profile.startsWith("1g")'
"""The 1g placements of GPU 0 of a DGX A100 (1g.5gb, 1g.5gb+me, 1g.10gb: 18 devices); its 7
memory slices let at most 7 of them be allocated together."""


@functools.cache
def node_slices(model: str, layout: str, **flags: str) -> list[dict[str, Any]]:
    """Tessera's slices of a simulated node in ``layout``, valid for that API server."""
    config = Config.of(simulate=model, node_name="node-a", kube_layout=layout, **flags)
    slices = published_slices(config)
    for s in slices:
        validate_k8s(s, f"{layout}.0")  # raises when the API server would refuse it
    return slices


def dynamic_a100(layout: str) -> list[dict[str, Any]]:
    return node_slices("dgx-a100", layout, mig_mode="dynamic")


def run(
    c: dict[str, Any],
    slices: list[dict[str, Any]],
    scheduler: Scheduler,
    allocs: list[dict[str, Any]] | None = None,
) -> Explanation:
    return explain(c, CLASSES, slices, allocs or [], cel=CelEnvironment(), scheduler=scheduler)


def mig_claim(count: int) -> dict[str, Any]:
    return claim(exact("m", MIG, count=count, selectors=(ONE_G,)))


@dataclass(frozen=True)
class Row:
    id: str
    upstream: str
    """File and function of k8s.io/dynamic-resource-allocation the row follows."""
    claim: dict[str, Any]
    slices: Callable[[], list[dict[str, Any]]]
    versions: dict[str, bool | str]
    """Scheduler version -> fits (True), or a text the reason that it does not fit holds."""
    gates: dict[str, bool] | None = None
    allocs: tuple[dict[str, Any], ...] = ()


ROWS = [
    Row(
        "1.35-layout-counters-enforced-per-pool-in-1.35-not-at-all-in-1.34",
        "1.35 incubating/allocator_incubating.go checkAvailableCounters (the pool's counter"
        " sets); 1.34 the same function reads the device's own slice, which holds none",
        mig_claim(8),
        lambda: dynamic_a100("1.35"),
        {"1.35": "counter gpu-0-counter-set/memory-slice", "1.34": True},
    ),
    Row(
        "1.35-layout-within-the-counters",
        "incubating/allocator_incubating.go allocateDevice, checkAvailableCounters",
        mig_claim(7),
        lambda: dynamic_a100("1.35"),
        {"1.35": True, "1.34": True},
    ),
    Row(
        "1.34-layout-counters-enforced-per-slice-in-1.34",
        "1.34 incubating/allocator_incubating.go checkAvailableCounters (device.slice's"
        " sharedCounters)",
        mig_claim(8),
        lambda: dynamic_a100("1.34"),
        {"1.34": "counter gpu-0-counter-set/memory-slice", "1.35": "0 candidates"},
    ),
    Row(
        "1.34-layout-devices-beside-counters-ignored-by-1.35",
        "1.35 incubating/pools_incubating.go buildPool (a slice with sharedCounters is a"
        " counter-set slice: its devices are not read)",
        mig_claim(7),
        lambda: dynamic_a100("1.34"),
        {"1.34": True, "1.35": "0 candidates"},
    ),
    Row(
        "partitionable-devices-off-a-device-consuming-counters-is-never-allocated",
        "incubating/allocator_incubating.go allocateDevice (!PartitionableDevices &&"
        " ConsumesCounters); 1.35 pools_incubating.go GatherPools skips the counter slice",
        mig_claim(1),
        lambda: dynamic_a100("1.35"),
        {"1.34": "DRAPartitionableDevices off", "1.35": "DRAPartitionableDevices off"},
        gates={"DRAPartitionableDevices": False},
    ),
    Row(
        "partitionable-devices-off-plain-gpus-still-fit",
        "incubating/allocator_incubating.go allocateDevice (no counters consumed)",
        claim(exact("g", GPU, count=8)),
        lambda: node_slices("dgx-h100", "1.35"),
        {"1.34": True, "1.35": True},
        gates={"DRAPartitionableDevices": False},
    ),
    Row(
        "prioritized-list-off-refuses-first-available",
        "incubating/allocator_incubating.go Allocate (has subrequests, but the"
        " DRAPrioritizedList feature is disabled)",
        claim(first("g", exact("a", GPU, count=9), exact("b", GPU))),
        lambda: node_slices("dgx-h100", "1.35"),
        {"1.34": "DRAPrioritizedList is off", "1.35": "DRAPrioritizedList is off"},
        gates={"DRAPrioritizedList": False},
    ),
    Row(
        "prioritized-list-on-picks-the-first-that-fits",
        "incubating/allocator_incubating.go Allocate, allocateOne (subrequests in order)",
        claim(first("g", exact("a", GPU, count=9), exact("b", GPU))),
        lambda: node_slices("dgx-h100", "1.35"),
        {"1.34": True, "1.35": True},
    ),
    Row(
        "admin-access-off-refuses-the-claim",
        "incubating/allocator_incubating.go validateDeviceRequest (admin access is requested,"
        " but the feature is disabled)",
        claim(exact("g", GPU, admin=True)),
        lambda: node_slices("dgx-h100", "1.35"),
        {"1.34": "DRAAdminAccess is off", "1.35": "DRAAdminAccess is off"},
        gates={"DRAAdminAccess": False},
    ),
    Row(
        "consumable-capacity-off-a-share-holds-the-whole-device",
        "kubernetes dynamicresources/allocateddevices.go foreachAllocatedDevice (the shared"
        " callback only with DRAConsumableCapacity); incubating allocator_incubating.go"
        " deviceInUse",
        claim(exact("g", GPU, count=8, capacity={"memory": "8Gi"})),
        lambda: node_slices("dgx-h100", "1.35", sharing="memory-shares"),
        {"1.34": "allocated", "1.35": "allocated"},
        gates={"DRAConsumableCapacity": False},
        allocs=(allocated("a", {"device": "gpu-3", "shareID": "s-1"}),),
    ),
    Row(
        "consumable-capacity-on-a-share-leaves-room",
        "experimental/allocator_experimental.go allocateDevice (allowMultipleAllocations,"
        " consumable_capacity.go CmpRequestOverCapacity)",
        claim(exact("g", GPU, count=8, capacity={"memory": "8Gi"})),
        lambda: node_slices("dgx-h100", "1.35", sharing="memory-shares"),
        {"1.34": True, "1.35": True},
        allocs=(allocated("a", {"device": "gpu-3", "shareID": "s-1"}),),
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
@pytest.mark.parametrize("version", ["1.34", "1.35"])
def test_version_table(row: Row, version: str) -> None:
    allocs = [dict(a) for a in row.allocs]
    for a in allocs:
        for r in a["status"]["allocation"]["devices"]["results"]:
            r["pool"] = "node-a"
    e = run(row.claim, row.slices(), Scheduler.of(version, row.gates), allocs)
    wanted = row.versions[version]
    if wanted is True:
        assert e.ok, e.text()
        return
    assert not e.ok, e.text()
    assert str(wanted) in e.text(), e.text()


# -- rules on hand-made slices (what the simulator never publishes) ------------------------------


def tainted(effect: str) -> list[dict[str, Any]]:
    taint = {"key": "k", "value": "v", "effect": effect}
    return [rslice([dev("gpu-0", attrs={"type": "gpu"}, taints=[taint])])]


@pytest.mark.parametrize(
    ("version", "gates", "effect", "fits"),
    [
        # 1.35 incubating/allocator_incubating.go taintPreventsAllocation: only NoSchedule and
        # NoExecute; 1.34 allTaintsTolerated: every taint
        ("1.35", None, "NoSchedule", False),
        ("1.35", None, "None", True),
        ("1.34", None, "None", False),
        # allocateDevice checks taints only with DRADeviceTaints
        ("1.35", {"DRADeviceTaints": False}, "NoSchedule", True),
        ("1.34", {"DRADeviceTaints": False}, "NoExecute", True),
    ],
)
def test_taints_per_version_and_gate(
    version: str, gates: dict[str, bool] | None, effect: str, fits: bool
) -> None:
    e = run(claim(exact("g", "any")), tainted(effect), Scheduler.of(version, gates))
    assert e.ok is fits, e.text()


def test_undefined_counter_set_makes_the_pool_invalid_in_135_only() -> None:
    """1.35 pools_incubating.go validateDeviceCounterConsumption; 1.34 checks the slice's own
    sets only (checkAvailableCounters)."""
    d = dev("mig-0", attrs={"type": "mig"}, consumes={"elsewhere": {"c": 1}})
    slices = [rslice([d])]
    assert not run(claim(exact("m", "any")), slices, Scheduler.of("1.35")).ok
    assert (
        "consumes counter set elsewhere"
        in run(claim(exact("m", "any")), slices, Scheduler.of("1.35")).text()
    )
    assert run(claim(exact("m", "any")), slices, Scheduler.of("1.34")).ok


def test_skipped_counter_slice_still_counts_toward_the_pool_in_135() -> None:
    """1.35 GatherPools skips a sharedCounters slice without DRAPartitionableDevices, and
    checkSlicesInPool still counts it: the pool is complete and its plain devices fit."""
    slices = [
        rslice([], name="counters", count=2, counters={"s": {"c": 1}}),
        rslice([dev("gpu-0", attrs={"type": "gpu"})], name="devices", count=2),
    ]
    gates = {"DRAPartitionableDevices": False}
    e = run(claim(exact("g", "any")), slices, Scheduler.of("1.35", gates))
    assert e.ok, e.text()
    assert e.to_json()["ignored"] == [
        "ResourceSlice counters is skipped: it holds sharedCounters, and with"
        " DRAPartitionableDevices off the Kubernetes 1.35 scheduler skips it"
    ]


def test_consumable_capacity_off_results_carry_no_share() -> None:
    """Without DRAConsumableCapacity the incubating allocator runs: whole devices, no shareID."""
    slices = node_slices("dgx-h100", "1.35", sharing="memory-shares")
    c = claim(exact("g", GPU, capacity={"memory": "8Gi"}))
    off = run(c, slices, Scheduler.of("1.35", {"DRAConsumableCapacity": False}))
    (result,) = off.allocation()["devices"]["results"]
    assert "shareID" not in result and "consumedCapacity" not in result
    on = run(c, slices, Scheduler.of("1.35"))
    (result,) = on.allocation()["devices"]["results"]
    assert result["consumedCapacity"] == {"memory": "8Gi"}


# -- the model itself --------------------------------------------------------------------------


def test_default_gates_table() -> None:
    """kubernetes pkg/features/kube_features.go (release-1.34, release-1.35)."""
    for version in ("1.34", "1.35"):
        table = {g: (s.stage, s.default) for g, s in DEFAULT_GATES[version].items()}
        assert table == {
            "DRAAdminAccess": ("beta", True),
            "DRAConsumableCapacity": ("alpha", False),
            "DRADeviceTaints": ("alpha", False),
            "DRAPartitionableDevices": ("alpha", False),
            "DRAPrioritizedList": ("beta", True),
        }


@pytest.mark.parametrize(
    ("gates", "allocator"),
    [
        # structured/allocator.go NewAllocator: the first whose SupportedFeatures cover them
        (None, "experimental"),
        ({"DRAConsumableCapacity": False}, "incubating"),
        ({g: False for g in GATES}, "stable"),
        ({g: False for g in GATES} | {"DRADeviceTaints": True}, "incubating"),
    ],
)
def test_allocator_variant(gates: dict[str, bool] | None, allocator: str) -> None:
    for version in ("1.34", "1.35"):
        s = Scheduler.of(version, gates)
        assert s.allocator == allocator
        assert s.to_json()["allocator"] == allocator


@pytest.mark.parametrize(
    ("text", "version", "note"),
    [
        ("1.34", "1.34", None),
        ("v1.35.0", "1.35", None),
        ("v1.35.1-gke.1200", "1.35", None),
        ("1.36", "1.35", "newer than the newest version explain models: modelled as 1.35"),
        ("v2.0.0", "1.35", "newer"),
    ],
)
def test_version_of(text: str, version: str, note: str | None) -> None:
    got, said = version_of(text)
    assert got == version
    assert (said is None) if note is None else (note in str(said))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1.33", "Kubernetes 1.33 is not modelled: explain models 1.34, 1.35"),
        ("latest", "'latest' is not a version"),
    ],
)
def test_version_refused(text: str, message: str) -> None:
    with pytest.raises(VersionError, match=message):
        version_of(text)


def test_server_version_reads_the_emulated_version_git_version_or_major_minor() -> None:
    assert server_version({"gitVersion": "v1.34.2", "major": "1", "minor": "34"}) == "v1.34.2"
    assert server_version({"major": "1", "minor": "35+"}) == "1.35"
    emulating = {"gitVersion": "v1.35.0", "emulationMajor": "1", "emulationMinor": "34"}
    assert server_version(emulating) == "1.34"
    with pytest.raises(VersionError, match="names no version"):
        server_version({})


def test_parse_gates() -> None:
    assert parse_gates("DRADeviceTaints=false, DRAAdminAccess=TRUE") == {
        "DRADeviceTaints": False,
        "DRAAdminAccess": True,
    }
    assert parse_gates("") == {}
    with pytest.raises(VersionError, match="names Foo, not a gate explain models"):
        parse_gates("Foo=true")
    with pytest.raises(VersionError, match=r"is not NAME=true\|false"):
        parse_gates("DRADeviceTaints")
