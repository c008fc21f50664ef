"""The plan of a claim (how each device is shared) and the one rule for who may hold what."""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dra_driver.device_model import GIB, DeviceModel, DevicePolicy, advertised_devices
from dra_driver.errors import ClaimError, ParamsError
from dra_driver.kubeletplugin.checkpoint import (
    PREPARE_COMPLETED,
    Checkpoint,
    ClaimEntry,
    PreparedDevice,
)
from dra_driver.kubeletplugin.claims import AllocatedDevice, Allocation, ClaimKey, OpaqueConfig
from dra_driver.kubeletplugin.plan import (
    MEMORY_SHARE,
    MPS,
    TIME_SLICING,
    ClaimPlan,
    SharingPolicy,
    conflicts,
    limits,
    plan_claim,
)

POOL = "node-a"
CLAIM = ClaimKey("ns", "a", "uid-a")


def gpu_config(strategy: str, **fields: Any) -> dict[str, Any]:
    sharing: dict[str, Any] = {"strategy": strategy}
    if fields:
        sharing["timeSlicing" if strategy == "TimeSlicing" else "mps"] = fields
    return {"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig", "sharing": sharing}


def mig_config(**mps: Any) -> dict[str, Any]:
    sharing: dict[str, Any] = {"strategy": "MPS"}
    if mps:
        sharing["mps"] = mps
    return {"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "MigDeviceConfig", "sharing": sharing}


def allocation(
    *devices: str,
    config: dict[str, Any] | None = None,
    consumed: int | None = None,
    claim: ClaimKey = CLAIM,
) -> Allocation:
    return Allocation(
        claim=claim,
        devices=tuple(
            AllocatedDevice("gpu", "gpu.tessera.dev", POOL, d, consumed_memory=consumed)
            for d in devices
        ),
        configs=(OpaqueConfig("FromClaim", (), config),) if config is not None else (),
        pods=("pod-1",),
    )


@pytest.fixture
def h100(inventory) -> DeviceModel:
    return advertised_devices(inventory("dgx-h100"), DevicePolicy(mig_mode="dynamic"))


def held(plan: ClaimPlan, uid: str, name: str = "b") -> Checkpoint:
    """A checkpoint where claim ``uid`` completed with the plan's devices."""
    devices = tuple(
        PreparedDevice(
            request_names=("gpu",),
            pool=POOL,
            device=p.device.name,
            cdi_device_ids=(),
            kind=p.device.kind,
            gpu_uuid=p.device.parent_uuid,
            gpu_minor=p.device.gpu_minor,
            placement=(p.device.mig_profile_id or 0, p.device.mig_placement_start or 0,
                       p.device.mig_placement_size or 0) if p.dynamic else None,
            sharing=p.sharing,
            interval=p.interval,
            memory_bytes=p.memory_bytes,
        )
        for p in plan.devices
    )  # fmt: skip
    entry = ClaimEntry(uid, "ns", name, PREPARE_COMPLETED, devices, 0.0)
    return Checkpoint("boot", {uid: entry})


def test_a_device_without_config_is_exclusive_and_the_pods_are_kept(h100):
    plan = plan_claim(allocation("gpu-0"), h100)
    (p,) = plan.devices
    assert (p.sharing, p.interval, p.request_names) == (None, None, ("gpu",))
    assert plan.pods == ("pod-1",) and not plan.uses_mps


def test_a_planned_device_carries_the_device_class_of_its_first_request(h100):
    devices = (
        AllocatedDevice("a", "gpu.tessera.dev", POOL, "gpu-0", device_class="gpu.tessera.dev"),
        AllocatedDevice("b", "gpu.tessera.dev", POOL, "gpu-0", device_class="other"),
        AllocatedDevice("c", "gpu.tessera.dev", POOL, "gpu-1"),
    )
    plan = plan_claim(Allocation(CLAIM, devices, ()), h100)
    assert [(p.device.name, p.device_class) for p in plan.devices] == [
        ("gpu-0", "gpu.tessera.dev"),
        ("gpu-1", ""),
    ]


def test_time_slicing_and_mps_come_from_the_config(h100):
    ts = plan_claim(allocation("gpu-0", config=gpu_config("TimeSlicing", interval="Long")), h100)
    assert (ts.devices[0].sharing, ts.devices[0].interval) == (TIME_SLICING, "Long")
    mps = plan_claim(
        allocation(
            "gpu-0",
            "gpu-1",
            config=gpu_config(
                "MPS",
                activeThreadPercentage=40,
                pinnedMemoryLimit="8Gi",
                perDevicePinnedMemoryLimit={"gpu-1": "16Gi"},
            ),
        ),
        h100,
    )
    assert [(p.sharing, p.pinned_memory_bytes) for p in mps.devices] == [
        (MPS, 8 * GIB),
        (MPS, 16 * GIB),
    ]
    assert mps.uses_mps and mps.mps_thread_percentage == 40


def test_mps_on_a_dynamic_mig_device(h100):
    name = next(d.name for d in h100.devices if d.kind == "mig")
    plan = plan_claim(allocation(name, config=mig_config(activeThreadPercentage=25)), h100)
    (p,) = plan.devices
    assert p.dynamic and p.sharing == MPS and p.thread_percentage == 25


def test_a_per_device_limit_for_a_device_the_claim_does_not_have_is_refused(h100):
    config = gpu_config("MPS", perDevicePinnedMemoryLimit={"gpu-7": "1Gi"})
    with pytest.raises(ParamsError, match=r"'gpu-7' is not a device of this claim; its devices"):
        plan_claim(allocation("gpu-0", config=config), h100)


def test_memory_shares_take_the_consumed_memory_as_limit_and_thread_share(h100):
    policy = SharingPolicy(mode="memory-shares", memory_share_min=GIB)
    total = int(dict(h100.device("gpu-0").capacity)["memory"])
    plan = plan_claim(allocation("gpu-0", consumed=total // 4), h100, policy)
    (p,) = plan.devices
    assert p.sharing == MEMORY_SHARE and p.memory_bytes == total // 4
    assert p.pinned_memory_bytes == total // 4 and p.thread_percentage == 25
    default = plan_claim(allocation("gpu-0"), h100, policy).devices[0]
    assert default.memory_bytes == GIB  # no consumedCapacity: the request policy's default
    too_big = allocation("gpu-0", consumed=total + 1)
    with pytest.raises(ClaimError, match="does not fit its"):
        plan_claim(too_big, h100, policy)


def test_memory_shares_refuse_time_slicing_naming_the_class_that_asked_it(h100):
    """The refusal says what the claim asked, where that came from and what the node offers."""
    policy = SharingPolicy(mode="memory-shares")
    by_class = Allocation(
        CLAIM,
        (AllocatedDevice("gpu", "gpu.tessera.dev", POOL, "gpu-0", device_class="shared"),),
        (OpaqueConfig("FromClass", (), gpu_config("TimeSlicing")),),
    )
    with pytest.raises(ClaimError) as e:
        plan_claim(by_class, h100, policy)
    assert e.value.reason == "sharing_mismatch"
    assert str(e.value).startswith(
        "claim ns/a (uid-a): gpu-0: the claim asks to time-slice it with strategy TimeSlicing (the"
        " config of its class shared), but this node runs --sharing memory-shares, which shares"
        " every whole GPU by memory, each claim through an MPS daemon of its own, and never"
        " time-slices one; use MPS or leave sharing unset"
    )
    with pytest.raises(ClaimError, match=r"TimeSlicing \(its own config\)"):
        plan_claim(allocation("gpu-0", config=gpu_config("TimeSlicing")), h100, policy)


def test_memory_shares_refuse_an_explicit_exclusive_config(h100):
    """A shared GPU cannot be had exclusively by saying so: the config is refused, not ignored
    (the scheduler may place other shares on the GPU)."""
    policy = SharingPolicy(mode="memory-shares")
    with pytest.raises(ClaimError, match=r"asks to hold it alone with strategy Exclusive"):
        plan_claim(allocation("gpu-0", config=gpu_config("Exclusive")), h100, policy)
    plain = plan_claim(allocation("gpu-0"), h100, policy)  # no config: a share
    assert [p.sharing for p in plain.devices] == [MEMORY_SHARE]


@pytest.mark.parametrize(
    ("config", "how"),
    [
        (None, "without time-slicing it (no config)"),
        (gpu_config("MPS"), "with MPS (its own config)"),
    ],
)
def test_time_slicing_refuses_a_share_of_memory_that_does_not_time_slice(h100, config, how):
    """Under --sharing time-slicing a claim that consumed part of a GPU's memory shares the GPU
    with the claims placed on the rest: it is refused at once, naming the mismatch, instead of
    being prepared alone and the next share being refused as if the GPU were allocated twice."""
    policy = SharingPolicy(mode="time-slicing")
    total = int(dict(h100.device("gpu-0").capacity)["memory"])
    with pytest.raises(ClaimError) as e:
        plan_claim(allocation("gpu-0", config=config, consumed=8 * GIB), h100, policy)
    assert e.value.reason == "sharing_mismatch"
    shared = f"{8 * GIB} of its {total} bytes of memory"
    field = "(consumedCapacity 'memory', its allocation results together)"
    assert f"asks a share of {shared} {field} {how}" in str(e.value)
    assert "runs --sharing time-slicing, which shares a whole GPU between claims only when" in (
        str(e.value)
    )
    # the whole memory (what a claim that requests none consumes) is a GPU of its own
    (whole,) = plan_claim(allocation("gpu-0", config=config, consumed=total), h100, policy).devices
    assert whole.sharing == (MPS if config else None)
    sliced = allocation("gpu-0", config=gpu_config("TimeSlicing"), consumed=8 * GIB)
    assert [p.sharing for p in plan_claim(sliced, h100, policy).devices] == [TIME_SLICING]
    # elsewhere the mode gives no share of memory to refuse: no consumedCapacity, exclusive
    assert plan_claim(allocation("gpu-0", consumed=8 * GIB), h100).devices[0].sharing is None


def test_an_exclusive_device_is_never_held_twice(h100):
    first = plan_claim(allocation("gpu-0"), h100)
    cp = held(first, "uid-b")
    with pytest.raises(ClaimError, match=r"already prepared for claim ns/b \(uid-b\)") as e:
        conflicts(cp, CLAIM, POOL, first.devices, SharingPolicy())
    assert e.value.reason == "device_busy"


@pytest.mark.parametrize("policy", ["none", "memory-shares"])
def test_time_sliced_claims_share_only_under_time_slicing(h100, policy):
    ts = plan_claim(allocation("gpu-0", config=gpu_config("TimeSlicing")), h100)
    with pytest.raises(ClaimError, match="already prepared"):
        conflicts(held(ts, "uid-b"), CLAIM, POOL, ts.devices, SharingPolicy(mode=policy))


def test_time_sliced_claims_share_at_the_same_interval(h100):
    policy = SharingPolicy(mode="time-slicing")
    default = plan_claim(allocation("gpu-0", config=gpu_config("TimeSlicing")), h100, policy)
    long = plan_claim(
        allocation("gpu-0", config=gpu_config("TimeSlicing", interval="Long")), h100, policy
    )
    conflicts(held(default, "uid-b"), CLAIM, POOL, default.devices, policy)  # no error
    with pytest.raises(ClaimError, match=r"at interval Default; claim ns/a .* asks Long"):
        conflicts(held(default, "uid-b"), CLAIM, POOL, long.devices, policy)
    exclusive = plan_claim(allocation("gpu-0"), h100, policy)
    with pytest.raises(ClaimError, match=r"held exclusively by claim ns/b .* asks to time-slice"):
        conflicts(held(exclusive, "uid-b"), CLAIM, POOL, default.devices, policy)
    mps = plan_claim(allocation("gpu-0", config=gpu_config("MPS")), h100, policy)
    with pytest.raises(ClaimError, match=r"held with MPS by claim ns/b"):
        conflicts(held(mps, "uid-b"), CLAIM, POOL, default.devices, policy)


def test_memory_shares_fit_the_gpu_memory(h100):
    policy = SharingPolicy(mode="memory-shares")
    total = int(dict(h100.device("gpu-0").capacity)["memory"])
    half = plan_claim(allocation("gpu-0", consumed=total // 2), h100, policy)
    cp = held(half, "uid-b")
    conflicts(cp, CLAIM, POOL, half.devices, policy)  # the other half fits
    more = plan_claim(allocation("gpu-0", consumed=total // 2 + 1), h100, policy)
    with pytest.raises(ClaimError, match="memory shares would total"):
        conflicts(cp, CLAIM, POOL, more.devices, policy)


def test_a_whole_gpu_and_its_mig_devices_are_never_held_at_once(h100):
    mig = next(d.name for d in h100.devices if d.kind == "mig" and d.gpu_minor == 0)
    mig_plan = plan_claim(allocation(mig), h100)
    whole = plan_claim(allocation("gpu-0"), h100)
    with pytest.raises(ClaimError, match="a whole GPU and its MIG devices are never held"):
        conflicts(held(mig_plan, "uid-b"), CLAIM, POOL, whole.devices, SharingPolicy())
    with pytest.raises(ClaimError, match="a whole GPU and its MIG devices are never held"):
        conflicts(held(whole, "uid-b"), CLAIM, POOL, mig_plan.devices, SharingPolicy())
    other_gpu = plan_claim(allocation("gpu-1"), h100)
    conflicts(held(mig_plan, "uid-b"), CLAIM, POOL, other_gpu.devices, SharingPolicy())


def test_overlapping_placements_are_refused_and_disjoint_ones_are_not(h100):
    def placement(profile: str, start: int) -> str:
        return next(
            d.name
            for d in h100.devices
            if d.kind == "mig"
            and d.gpu_minor == 0
            and dict(d.attributes)["profile"]["string"] == profile
            and d.mig_placement_start == start
        )

    small = plan_claim(allocation(placement("1g.10gb", 0)), h100)
    cp = held(small, "uid-b")
    overlapping = plan_claim(allocation(placement("2g.20gb", 0)), h100)
    with pytest.raises(ClaimError, match=r"\(slices 0-1\) overlaps .* \(slices 0-0\)"):
        conflicts(cp, CLAIM, POOL, overlapping.devices, SharingPolicy())
    disjoint = plan_claim(allocation(placement("2g.20gb", 2)), h100)
    conflicts(cp, CLAIM, POOL, disjoint.devices, SharingPolicy())


def test_a_claim_does_not_conflict_with_itself(h100):
    plan = plan_claim(allocation("gpu-0"), h100)
    conflicts(held(plan, CLAIM.uid), CLAIM, POOL, plan.devices, SharingPolicy())


def test_limits_name_devices_by_uuid_once_known(h100):
    plan = plan_claim(
        allocation("gpu-0", "gpu-1", config=gpu_config("MPS", pinnedMemoryLimit="2Gi")), h100
    )
    uuids = {"gpu-0": "GPU-aaaa0000", "gpu-1": "GPU-bbbb1111"}
    assert limits(plan.devices, uuids) == {"GPU-aaaa0000": 2 * GIB, "GPU-bbbb1111": 2 * GIB}
    assert limits(plan.devices, {"gpu-0": "GPU-aaaa0000"}) == {"GPU-aaaa0000": 2 * GIB}


# -- which config a device gets, and what that costs for a claim with many ----------------------

INTERVALS = ("Default", "Short", "Medium", "Long")


def old_effective_config(alloc: Allocation, requests: list[str], kind: str) -> Any:
    """The rule as first written: every request in order, every config that applies to it in
    order, the last one for the device's kind wins (validated on every visit)."""
    from dra_driver.kubeletplugin import params
    from dra_driver.kubeletplugin.claims import configs_for

    config = None
    for r in requests:
        for c in configs_for(alloc, r):
            cfg = params.validate(c.parameters)
            if cfg.applies_to(kind):
                config = cfg
    return config


@st.composite
def many_configs(draw: st.DrawFn) -> Allocation:
    names = ["a", "b", "a/x", "a/y", "b/x", "c"]
    devices = ["gpu-0", "gpu-1", "gpu-2-mig-1g10gb-19-0"]
    results = draw(
        st.lists(st.tuples(st.sampled_from(names), st.sampled_from(devices)), max_size=12)
    )
    configs = draw(
        st.lists(
            st.tuples(
                st.lists(st.sampled_from([*names, "zzz"]), max_size=3, unique=True),
                st.sampled_from(["GpuConfig", "MigDeviceConfig"]),
                st.sampled_from(INTERVALS),
                st.sampled_from(["FromClass", "FromClaim"]),
            ),
            max_size=8,
        )
    )
    opaque = [
        OpaqueConfig(
            source,
            tuple(reqs),
            gpu_config("TimeSlicing", interval=interval)
            if kind == "GpuConfig"
            else {"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": kind},
        )
        for reqs, kind, interval, source in configs
    ]
    opaque.sort(key=lambda c: 0 if c.source == "FromClass" else 1)  # as parse_allocation does
    return Allocation(
        claim=CLAIM,
        devices=tuple(AllocatedDevice(r, "gpu.tessera.dev", POOL, d) for r, d in results),
        configs=tuple(opaque),
    )


def test_each_device_gets_the_config_the_rule_gives_it(h100):
    @settings(deadline=None)
    @given(many_configs())
    def check(alloc: Allocation) -> None:
        plan = plan_claim(alloc, h100)
        for p in plan.devices:
            assert p.config == old_effective_config(alloc, list(p.request_names), p.device.kind)
            assert list(p.request_names) == list(
                dict.fromkeys(d.request for d in alloc.devices if d.device == p.device.name)
            )

    check()


def test_a_claim_with_thousands_of_requests_and_configs_plans_in_milliseconds(h100):
    """5000 requests of one GPU and 500 configs (a claim file of 360 KB, under the 1 MiB a
    file may have) took 12 s when every config was validated again for every request."""
    alloc = Allocation(
        claim=CLAIM,
        devices=tuple(
            AllocatedDevice(f"r{i}", "gpu.tessera.dev", POOL, "gpu-0") for i in range(5000)
        ),
        configs=tuple(
            OpaqueConfig("FromClaim", (), gpu_config("TimeSlicing", interval=INTERVALS[i % 4]))
            for i in range(500)
        ),
    )
    started = time.monotonic()
    (planned,) = plan_claim(alloc, h100).devices
    assert time.monotonic() - started < 1.0
    assert planned.interval == INTERVALS[499 % 4] and len(planned.request_names) == 5000
