"""Usage of claims that hand GPUs to virtual machines (issue 24, item 5): a ``vfio`` device weighs
the whole GPU and its busy time and energy are unobserved (the host cannot read a GPU bound to
vfio-pci); a ``vgpu`` device weighs its framebuffer's fraction of the GPU's memory, as a memory
share does, and gets the same fraction of the GPU's energy; budgets count both."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.nvml.samples import GpuSample
from agent.sim.apiserver_crd import violations
from agent.telemetry.energy import EnergyAccounting
from agent.telemetry.gpuinfo import GpuInfo
from agent.telemetry.usage_meter import UsageMeter
from agent.usage.budget_plan import ClusterView, plan
from agent.usage.weights import GpuCapacity, Holding, weights
from tests.fakeclock import FakeClock
from tests.telemetry.holders import Claim, Held
from tests.usage.clusterobjs import BUDGETS, budget, check_budget, namespace, report

GIB = 1024**3
H200 = "NVIDIA H200"
VM_GPU, VGPU_GPU = "GPU-vm", "GPU-vgpu"
H200X_35C = 1001
"""An H200X-35C vGPU type: 35 GiB of framebuffer, 4 per 140 GiB H200."""
VGPU_CAPACITY = GpuCapacity(VGPU_GPU, 140 * GIB, vgpu_framebuffers=((H200X_35C, 35 * GIB),))
GPUS = [
    # bound to vfio-pci: NVML does not see it (index -1), the host reads nothing
    GpuInfo(
        -1, VM_GPU, H200, "0000:1b:00.0", 0, capacity=GpuCapacity(VM_GPU, 140 * GIB),
        passthrough=True,
    ),
    GpuInfo(0, VGPU_GPU, H200, "0000:2b:00.0", 1, capacity=VGPU_CAPACITY),
]  # fmt: skip
VFIO = Claim(
    "uid-vfio",
    "team-vm",
    "vm-a",
    (Held("node-a", "gpu-0-vfio", "vfio", VM_GPU, 0, device_class="vfio.gpu.tessera.dev"),),
)
VGPU = Claim(
    "uid-vgpu",
    "team-vm",
    "vm-b",
    (
        Held(
            "node-a",
            "gpu-1-vgpu-1001-0",
            "vgpu",
            VGPU_GPU,
            1,
            device_class="vgpu.gpu.tessera.dev",
            vgpu_type_id=H200X_35C,
        ),
    ),
)
REPORT_CRD: dict[str, Any] = yaml.safe_load((BUDGETS / "gpuusagereport-crd.yaml").read_text())


def weighed(*holdings: Holding) -> dict[str, tuple[float, str]]:
    found, unknown = weights(holdings, [GpuCapacity(VM_GPU, 140 * GIB), VGPU_CAPACITY])
    assert unknown == ()
    return {w.device: (w.weight, w.rule) for w in found}


def test_a_vfio_device_weighs_the_whole_gpu_and_a_vgpu_its_framebuffers_fraction() -> None:
    w = weighed(Holding("a", VFIO.devices[0]), Holding("b", VGPU.devices[0]))
    assert w["gpu-0-vfio"] == (1.0, "whole-gpu")
    assert w["gpu-1-vgpu-1001-0"][0] == pytest.approx(0.25)
    assert w["gpu-1-vgpu-1001-0"][1] == "vgpu-framebuffer"


def test_four_vgpus_fill_their_gpu_and_a_vgpu_of_an_unknown_type_is_not_weighed() -> None:
    held = [
        Holding(f"c{k}", Held("p", f"gpu-1-vgpu-1001-{k}", "vgpu", VGPU_GPU, 1, vgpu_type_id=1001))
        for k in range(4)
    ]
    found, unknown = weights(held, [VGPU_CAPACITY])
    assert sum(w.weight for w in found) == pytest.approx(1.0)
    stranger = Holding("x", Held("p", "gpu-1-vgpu-77-0", "vgpu", VGPU_GPU, 1, vgpu_type_id=77))
    found, unknown = weights([stranger], [VGPU_CAPACITY])
    assert found == () and unknown == (stranger,)


def samples(t: float) -> list[GpuSample]:
    # the sampler's stand-in for the GPU handed to the VM: nothing read (no energy, no utilization)
    return [
        GpuSample(-1, VM_GPU, t),
        GpuSample(0, VGPU_GPU, t, utilization_gpu=0.9, energy_joules=400.0 * t),
    ]


def run_an_hour(tmp_path: Path, wall: FakeClock) -> UsageMeter:
    """An hour of ticks (one a minute) with both VM claims held, as the sampler feeds them."""
    clock = FakeClock(0.0)
    accounting = EnergyAccounting(tmp_path / "energy.json", clock)
    meter = UsageMeter(tmp_path / "usage.json", "boot", logging.getLogger("t"), wall=wall)
    for _ in range(61):
        s = samples(clock.t)
        accounted = accounting.update(s, GPUS, [VFIO, VGPU])
        meter.tick(clock.t, s, GPUS, [VFIO, VGPU], accounted.claims)
        clock.advance(60.0)
        wall.advance(60.0)
    return meter


def test_vm_claims_accrue_gpu_seconds_and_only_the_vgpu_gets_energy(tmp_path: Path) -> None:
    meter = run_an_hour(tmp_path, FakeClock(datetime(2026, 12, 4, 10, 0, tzinfo=UTC).timestamp()))
    c = {k[0]: v for k, v in meter.counters().items()}
    vfio, vgpu = c["uid-vfio"], c["uid-vgpu"]
    assert (vfio.rule, vfio.weight) == ("whole-gpu", 1.0)
    assert vfio.allocated_gpu_seconds == pytest.approx(3600.0)
    assert vfio.unobserved_seconds == pytest.approx(3600.0)  # the host cannot see inside the VM
    assert vfio.busy_gpu_seconds == 0.0 and vfio.energy_joules == 0.0
    assert vgpu.rule == "vgpu-framebuffer" and vgpu.weight == pytest.approx(0.25)
    assert vgpu.allocated_gpu_seconds == pytest.approx(900.0)
    # the GPU's utilization is every vGPU's together: not this one's busy time
    assert vgpu.unobserved_seconds == pytest.approx(3600.0) and vgpu.busy_gpu_seconds == 0.0
    assert vgpu.energy_joules == pytest.approx(0.25 * 400.0 * 3600.0)


def test_budgets_count_the_vm_claims_gpu_hours_by_device_class(tmp_path: Path) -> None:
    start = datetime(2026, 12, 4, 10, 0, tzinfo=UTC)
    meter = run_an_hour(tmp_path, FakeClock(start.timestamp()))
    reported = meter.report(1 << 20)
    assert reported is not None
    obj = report("node-a", *reported[1])
    obj["spec"]["through"] = datetime.fromtimestamp(reported[0], UTC).isoformat()
    assert violations(REPORT_CRD, obj) == []
    b = budget(
        "vms",
        scope={"namespace": "team-vm"},
        period={"type": "CalendarMonth", "timeZone": "UTC"},
        limits={"gpuHours": "100"},
    )
    now = datetime(2026, 12, 4, 11, 5, tzinfo=UTC)
    view = ClusterView([obj], [], [b], [namespace("team-vm")], frozenset({"node-a"}), [], [], None)
    (status,) = [s for s in plan(view, now).statuses if s["metadata"]["name"] == "vms"]
    check_budget(status)
    s = status["status"]
    assert s["used"]["gpuHours"] == "1.250"  # the whole GPU for an hour, a quarter of one
    by_class = {c["deviceClass"]: c["gpuHours"] for c in s["byDeviceClass"]}
    assert by_class == {"vfio.gpu.tessera.dev": "1.000", "vgpu.gpu.tessera.dev": "0.250"}
