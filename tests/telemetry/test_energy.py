"""Energy and usage accounting: monotonic counters, attribution rules, persistence, retention."""

from __future__ import annotations

import json
import logging

import pytest

from agent.nvml.samples import GpuSample, ProcessSample
from agent.telemetry.attribution import holdings, shares
from agent.telemetry.energy import EnergyAccounting
from agent.telemetry.gpuinfo import GpuInfo, gpu_info
from agent.usage.joules import COUNTER, COUNTER_RESET, NONE, POWER, Reading, energy_delta
from tests.fakeclock import FakeClock
from tests.telemetry.holders import Claim, Held

A100_PROFILES = ((19, 14), (14, 28), (9, 42), (5, 56), (0, 98))
H100_PROFILES = ((19, 16), (14, 32), (9, 60), (5, 64), (0, 132))


def gpu(index: int, *, sms: int | None = None, profiles=()) -> GpuInfo:
    return GpuInfo(
        index=index,
        uuid=f"GPU-{index}",
        name="NVIDIA A100-SXM4-40GB",
        pci_bus_id=f"0000:{index:02x}:00.0",
        minor=index,
        multiprocessors=sms,
        profile_multiprocessors=profiles,
    )


def whole(gpu_index: int, device: str | None = None, sharing: str | None = None) -> Held:
    name = device or f"gpu-{gpu_index}"
    return Held("node-a", name, "gpu", f"GPU-{gpu_index}", gpu_index, sharing=sharing)


def mig(
    gpu_index: int, profile: str, profile_id: int, start: int, gi: int, sharing: str | None = None
) -> Held:
    name = f"gpu-{gpu_index}-mig-{profile}-{profile_id}-{start}"
    return Held(
        "node-a", name, "mig", f"GPU-{gpu_index}", gpu_index, gpu_instance_id=gi, sharing=sharing
    )


def claim(uid: str, *devices: Held, pods: tuple[str, ...] = ()) -> Claim:
    return Claim(uid, "team-a", f"job-{uid}", devices, pods)


def checkpoint(*claims: Claim) -> tuple[Claim, ...]:
    """What the driver's view returns: the claims whose prepare completed."""
    return claims


def sample(index: int, t: float, energy: float | None = None, power: float | None = None, **kw):
    return GpuSample(
        index=index, uuid=f"GPU-{index}", timestamp=t, energy_joules=energy, power_watts=power, **kw
    )


def by_claim(acc: EnergyAccounting) -> dict[tuple[str, str], tuple[float, float, str]]:
    return {
        (c.uid, c.device): (c.energy_joules_total, c.gpu_seconds_total, c.rule) for c in acc.usage()
    }


# -- the counter rules -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prev", "now", "expected"),
    [
        (Reading(0, 100.0, 300.0), Reading(1, 400.0, 300.0), (300.0, COUNTER)),
        (Reading(0, 1e6, 300.0), Reading(1, 250.0, 300.0), (250.0, COUNTER_RESET)),
        (Reading(0, 100.0, 300.0), Reading(1, 1e9, 300.0), (300.0, POWER)),
        (Reading(0, 1e9, None), Reading(1, 1e12, None), (0.0, NONE)),
        (Reading(0, 1e6, None), Reading(1, 1e6 + 500, None), (500.0, COUNTER)),
        (Reading(0, 100.0, 200.0), Reading(2, None, 400.0), (600.0, POWER)),
        (Reading(0, None, None), Reading(2, None, 400.0), (800.0, POWER)),
        (Reading(0, 100.0, 200.0), Reading(0, 200.0, 200.0), (0.0, NONE)),
        (Reading(0, None, -50.0), Reading(1, None, 100.0), (50.0, POWER)),
    ],
    ids=[
        "counter",
        "backwards-is-reset",
        "implausible-jump-uses-power",
        "implausible-no-power-counts-nothing",
        "large-counter-ok",
        "missing-counter-trapezoid",
        "one-power-known",
        "no-time-passed",
        "negative-power-clamped",
    ],
)
def test_energy_delta_rules(prev, now, expected):
    joules, source = energy_delta(prev, now)
    assert (round(joules, 6), source) == expected
    assert joules >= 0


def test_implausible_jump_with_a_plausible_new_value_is_a_reset():
    # the counter reset and grew past the old value between two reads: the diff is too large
    joules, source = energy_delta(Reading(0, 10.0, None), Reading(0.001, 1.5, None))
    assert (joules, source) == (1.5, COUNTER_RESET)


# -- scripted run: counters only grow --------------------------------------------------------------


def test_counters_only_grow_across_reset_and_missing_counter(tmp_path):
    clock = FakeClock(1_000_000.0)
    acc = EnergyAccounting(tmp_path / "energy.json", clock)
    gpus = [gpu(0)]
    holders = checkpoint(claim("a", whole(0)))
    counter, last_gpu, last_claim = 50_000.0, -1.0, -1.0
    for t in range(60):
        watts = 200.0 + 10 * (t % 7)
        counter += watts
        energy: float | None = counter
        if t == 20:
            counter = watts  # the driver reloaded: the counter restarts near 0
            energy = counter
        if 30 <= t < 40:
            energy = None  # the counter is not readable: integrate power
        if t == 45:
            energy = 1e15  # a garbage read: not believed
        if t == 46:
            energy = counter
        clock.t += 1
        out = acc.update([sample(0, float(t), energy, watts)], gpus, holders)
        total = out.gpu_energy[0]
        assert total is not None and total >= last_gpu
        (c,) = out.claims
        assert c.energy_joules_total >= last_claim
        assert c.energy_joules_total == pytest.approx(total - 0, rel=1e-9, abs=1e-6)
        last_gpu, last_claim = total, c.energy_joules_total
    # 59 intervals of 200-260 W: all counted once, never a jump
    assert 59 * 200 <= last_gpu <= 59 * 260
    (c,) = acc.usage()
    assert c.gpu_seconds_total == pytest.approx(59.0)
    assert c.rule == "exclusive"


def test_power_only_gpu_integrates_with_the_trapezoid(tmp_path):
    acc = EnergyAccounting(tmp_path / "e.json", FakeClock(1_000_000.0))
    gpus = [gpu(0)]
    for t, w in enumerate([100.0, 200.0, 300.0]):
        out = acc.update([sample(0, float(t), None, w)], gpus, None)
    assert out.gpu_energy[0] == pytest.approx(150.0 + 250.0)


def test_gpu_without_energy_or_power_has_no_total(tmp_path):
    acc = EnergyAccounting(tmp_path / "e.json", FakeClock(1_000_000.0))
    out = acc.update([sample(0, 0.0)], [gpu(0)], None)
    assert out.gpu_energy[0] is None


def test_lost_reads_keep_the_baseline_and_the_next_counter_covers_the_gap(tmp_path):
    acc = EnergyAccounting(tmp_path / "e.json", FakeClock(1_000_000.0))
    gpus = [gpu(0)]
    holders = checkpoint(claim("a", whole(0)))
    acc.update([sample(0, 0.0, 1000.0, 300.0)], gpus, holders)
    acc.update([GpuSample(0, "GPU-0", 1.0, lost=True)], gpus, holders)
    acc.update([GpuSample(0, "GPU-0", 2.0, lost=True)], gpus, holders)
    out = acc.update([sample(0, 3.0, 1900.0, 300.0)], gpus, holders)
    assert out.gpu_energy[0] == pytest.approx(900.0)
    assert by_claim(acc)[("a", "gpu-0")][:2] == pytest.approx((900.0, 3.0))


# -- attribution: the claims' energy sums to the GPU's ---------------------------------------------


def run_window(acc: EnergyAccounting, gpus, holders, samples_at, ticks: int = 30):
    """Tick ``ticks`` + 1 times; returns the GPU energy added over the window (after the first
    tick, whose reading is the baseline)."""
    first = None
    for t in range(ticks + 1):
        out = acc.update(samples_at(float(t)), gpus, holders)
        if first is None:
            first = dict(out.gpu_energy)
    return {i: (out.gpu_energy[i] or 0.0) - (first[i] or 0.0) for i in out.gpu_energy}


def test_exclusive_gpu_energy_all_goes_to_its_claim(tmp_path):
    acc = EnergyAccounting(tmp_path / "e.json", FakeClock(1_000_000.0))
    gpus = [gpu(0), gpu(1)]
    holders = checkpoint(claim("a", whole(0)), claim("b", whole(1)))
    window = run_window(
        acc,
        gpus,
        holders,
        lambda t: [sample(0, t, 1000 + 300 * t, 300.0), sample(1, t, 5 + 120 * t, 120.0)],
    )
    got = by_claim(acc)
    assert got[("a", "gpu-0")][0] == pytest.approx(window[0], rel=0.01)
    assert got[("b", "gpu-1")][0] == pytest.approx(window[1], rel=0.01)
    assert got[("a", "gpu-0")][1] == pytest.approx(30.0)
    assert {r for _, _, r in got.values()} == {"exclusive"}


def test_mig_with_every_slice_held_sums_to_the_gpu(tmp_path):
    """An A100: seven 1g.5gb devices of 14 SMs each are 98 SMs, the whole 7g."""
    acc = EnergyAccounting(tmp_path / "e.json", FakeClock(1_000_000.0))
    gpus = [gpu(0, sms=98, profiles=A100_PROFILES)]
    devices = [mig(0, "1g5gb", 19, s, gi=7 + s) for s in range(7)]
    holders = checkpoint(*(claim(f"c{s}", d) for s, d in enumerate(devices)))
    window = run_window(acc, gpus, holders, lambda t: [sample(0, t, 400 * t, 400.0)], ticks=10)
    got = by_claim(acc)
    assert sum(e for e, _, _ in got.values()) == pytest.approx(window[0], rel=0.01)
    for e, secs, rule in got.values():
        assert rule == "mig-sm-share"
        assert e == pytest.approx(window[0] * 14 / 98)
        assert secs == pytest.approx(10 * 14 / 98)


def test_mig_mixed_profiles_all_held_sum_to_the_gpu(tmp_path):
    """3g + 2g + 2g on an A100: 42 + 28 + 28 = 98 SMs."""
    acc = EnergyAccounting(tmp_path / "e.json", FakeClock(1_000_000.0))
    gpus = [gpu(0, sms=98, profiles=A100_PROFILES)]
    holders = checkpoint(
        claim("big", mig(0, "3g20gb", 9, 4, gi=2)),
        claim("two", mig(0, "2g10gb", 14, 0, gi=3), mig(0, "2g10gb", 14, 2, gi=5)),
    )
    window = run_window(acc, gpus, holders, lambda t: [sample(0, t, 250 * t, 250.0)], ticks=8)
    got = by_claim(acc)
    assert sum(e for e, _, _ in got.values()) == pytest.approx(window[0], rel=0.01)
    assert got[("big", "gpu-0-mig-3g20gb-9-4")][0] == pytest.approx(window[0] * 42 / 98)


def test_mig_idle_share_goes_to_no_one(tmp_path):
    """Seven H100 1g devices are 7 x 16 of 132 SMs; one held device gets 16/132."""
    acc = EnergyAccounting(tmp_path / "e.json", FakeClock(1_000_000.0))
    gpus = [gpu(0, sms=132, profiles=H100_PROFILES)]
    holders = checkpoint(claim("a", mig(0, "1g10gb", 19, 3, gi=9)))
    window = run_window(acc, gpus, holders, lambda t: [sample(0, t, 500 * t, 500.0)], ticks=10)
    e, secs, rule = by_claim(acc)[("a", "gpu-0-mig-1g10gb-19-3")]
    assert e == pytest.approx(window[0] * 16 / 132)
    assert secs == pytest.approx(10 * 16 / 132)
    assert rule == "mig-sm-share"


def test_mig_sms_fall_back_to_the_gpu_instance_then_to_nothing():
    info = GpuInfo(0, "GPU-0", "x", "b", 0, multiprocessors=98, mig_multiprocessors=((3, 28),))
    assert info.mig_device_multiprocessors("odd-name", 3) == 28
    assert info.mig_device_multiprocessors("odd-name", 4) is None
    holders = checkpoint(claim("a", mig(0, "1g5gb", 19, 0, gi=4)))
    held, _ = holdings(holders, [info])
    (s,) = shares(info, held, None)
    assert s.share == 0.0


def procs(*pairs: tuple[int, float | None], gi: int | None = None) -> tuple[ProcessSample, ...]:
    return tuple(ProcessSample(pid, None, gi, None if gi is None else 0, u) for pid, u in pairs)


def test_shared_gpu_is_split_by_the_utilization_of_each_claims_pods(tmp_path):
    pods = {100: "pod-a1", 101: "pod-a2", 200: "pod-b", 300: "pod-c", 999: "pod-elsewhere"}
    acc = EnergyAccounting(tmp_path / "e.json", FakeClock(1_000_000.0), process_pod=pods.get)
    gpus = [gpu(0)]
    shared = whole(0, "gpu-0", sharing="TimeSlicing")
    holders = checkpoint(
        claim("a", shared, pods=("pod-a1", "pod-a2")),
        claim("b", shared, pods=("pod-b",)),
        claim("c", shared, pods=("pod-c",)),
    )
    processes = procs((100, 0.2), (101, 0.1), (200, 0.6), (300, None), (999, 0.5), (400, 0.3))
    window = run_window(
        acc, gpus, holders, lambda t: [sample(0, t, 600 * t, 600.0, processes=processes)]
    )
    got = by_claim(acc)
    assert sum(e for e, _, _ in got.values()) == pytest.approx(window[0], rel=0.01)
    assert got[("a", "gpu-0")][0] == pytest.approx(window[0] / 3)
    assert got[("b", "gpu-0")][0] == pytest.approx(window[0] * 2 / 3)
    assert got[("c", "gpu-0")][:2] == (0.0, 0.0)
    assert sum(s for _, s, _ in got.values()) == pytest.approx(30.0)
    assert {r for _, _, r in got.values()} == {"shared"}
    assert {c.uid: c.share for c in acc.usage()} == pytest.approx({"a": 1 / 3, "b": 2 / 3, "c": 0})


def test_shared_gpu_without_utilization_is_split_evenly(tmp_path):
    acc = EnergyAccounting(
        tmp_path / "e.json", FakeClock(1_000_000.0), process_pod={1: "pod-a"}.get
    )
    gpus = [gpu(0)]
    holders = checkpoint(
        claim("a", whole(0, "gpu-0", sharing="MemoryShare"), pods=("pod-a",)),
        claim("b", whole(0, "gpu-0", sharing="MemoryShare")),
        claim("c", whole(0, "gpu-0", sharing="MemoryShare")),
    )
    processes = procs((1, None))
    window = run_window(
        acc, gpus, holders, lambda t: [sample(0, t, 300 * t, 300.0, processes=processes)]
    )
    got = by_claim(acc)
    assert sum(e for e, _, _ in got.values()) == pytest.approx(window[0], rel=0.01)
    for e, secs, rule in got.values():
        assert (e, secs, rule) == (pytest.approx(window[0] / 3), pytest.approx(10.0), "shared")


def test_the_rule_of_a_holding_never_changes_whatever_the_split(tmp_path):
    """Utilization known, then not, then known again; a second claim joins, then leaves: each
    holding keeps its one rule (a changing label would start a new Prometheus series)."""
    pods = {1: "pod-a", 2: "pod-b"}
    acc = EnergyAccounting(tmp_path / "e.json", FakeClock(1_000_000.0), process_pod=pods.get)
    gpus = [gpu(0)]
    a = claim("a", whole(0, sharing="TimeSlicing"), pods=("pod-a",))
    b = claim("b", whole(0, sharing="TimeSlicing"), pods=("pod-b",))
    busy = procs((1, 0.6), (2, 0.2))
    script = [((a,), busy), ((a, b), busy), ((a, b), ()), ((a, b), procs((1, None))),
              ((a, b), busy), ((a,), ())]  # fmt: skip
    rules: set[tuple[str, str]] = set()
    shares_seen = []
    for t, (holders, processes) in enumerate(script):
        out = acc.update(
            [sample(0, float(t), 100.0 * t, 100.0, processes=processes)], gpus, holders
        )
        rules |= {(c.uid, c.rule) for c in out.claims}
        shares_seen.append({c.uid: c.share for c in out.claims})
    assert rules == {("a", "shared"), ("b", "shared")}
    assert shares_seen[0] == {"a": 1.0}
    assert shares_seen[1] == pytest.approx({"a": 0.75, "b": 0.25})
    assert shares_seen[2] == shares_seen[3] == {"a": 0.5, "b": 0.5}
    assert shares_seen[5] == {"a": 1.0, "b": None}  # b released: its counters stay, no share


def test_exclusive_and_mps_devices_keep_their_rule_and_never_look_up_processes(tmp_path):
    def no_lookups(pid: int) -> str | None:
        raise AssertionError(f"looked up {pid} for a unit one claim holds")

    info = gpu(0, sms=98, profiles=A100_PROFILES)
    held, _ = holdings(
        checkpoint(
            claim("a", whole(1), pods=("pod-a",)),
            claim("b", whole(2, sharing="MPS"), pods=("pod-b",)),
            claim("c", mig(0, "3g20gb", 9, 0, gi=1, sharing="MPS"), pods=("pod-c",)),
        ),
        [info, gpu(1), gpu(2)],
    )
    assert {h.uid: h.rule for h in held} == {
        "a": "exclusive",
        "b": "exclusive",
        "c": "mig-sm-share",
    }
    busy = sample(0, 0.0, processes=procs((1, 0.5), gi=1))
    (c,) = shares(info, [h for h in held if h.gpu_index == 0], busy, no_lookups)
    assert (c.rule, c.share) == ("mig-sm-share", pytest.approx(42 / 98))


def test_a_pod_reserved_by_several_holders_counts_for_each_evenly():
    info = gpu(0)
    shared = whole(0, sharing="TimeSlicing")
    held, _ = holdings(
        checkpoint(
            claim("a", shared, pods=("pod-both",)),
            claim("b", shared, pods=("pod-both", "pod-b")),
        ),
        [info],
    )
    busy = sample(0, 0.0, processes=procs((1, 0.4), (2, 0.2)))
    got = {s.key[0]: s for s in shares(info, held, busy, {1: "pod-both", 2: "pod-b"}.get)}
    assert got["a"].share == pytest.approx(0.2 / 0.6)
    assert got["b"].share == pytest.approx(0.4 / 0.6)


def test_shared_mig_device_counts_only_its_own_processes():
    info = gpu(0, sms=98, profiles=A100_PROFILES)
    device = mig(0, "3g20gb", 9, 0, gi=1, sharing="TimeSlicing")
    held, _ = holdings(
        checkpoint(claim("a", device, pods=("pa",)), claim("b", device, pods=("pb",))), [info]
    )
    processes = procs((1, 0.3), gi=1) + procs((2, 0.1), gi=1) + procs((3, 0.9), gi=2)
    pods = {1: "pa", 2: "pb", 3: "pb"}
    got = {s.key[0]: s for s in shares(info, held, sample(0, 0.0, processes=processes), pods.get)}
    assert got["a"].share == pytest.approx(42 / 98 * 0.75)
    assert got["b"].share == pytest.approx(42 / 98 * 0.25)
    assert got["a"].rule == "shared"


def test_shares_never_sum_above_one():
    info = gpu(0, sms=98, profiles=A100_PROFILES)
    bad = checkpoint(claim("a", whole(0)), claim("b", mig(0, "7g40gb", 0, 0, gi=0)))
    held, _ = holdings(bad, [info])
    assert sum(s.share for s in shares(info, held, None)) == pytest.approx(1.0)


# -- who holds what --------------------------------------------------------------------------------


def test_holdings_map_by_uuid_and_never_to_a_gpu_with_another_uuid():
    # minor 7 is now a GPU with another UUID (the GPU was replaced, or the node's model changed):
    # the device prepared on the old one is on no known GPU, never on the new one
    gpus = [gpu(0), GpuInfo(5, "GPU-new-uuid", "x", "b", 7)]
    replaced = Held("node-a", "gpu-7", "gpu", "GPU-old-uuid", 7)
    nowhere = Held("node-a", "gpu-9", "gpu", "GPU-9", 9)
    cp = checkpoint(claim("b", replaced, nowhere), claim("a", whole(0)))
    held, unknown = holdings(cp, gpus)
    assert [(h.uid, h.device, h.gpu_index) for h in held] == [("a", "gpu-0", 0)]
    assert unknown == [("b", "node-a", "gpu-7"), ("b", "node-a", "gpu-9")]


def test_holdings_fall_back_to_the_minor_only_when_the_uuid_is_not_known():
    gpus = [GpuInfo(5, "GPU-new-uuid", "x", "b", 7)]
    unknown_uuid = Held("node-a", "gpu-7", "gpu", "", 7)
    held, unknown = holdings(checkpoint(claim("b", unknown_uuid)), gpus)
    assert [(h.device, h.gpu_uuid) for h in held] == [("gpu-7", "GPU-new-uuid")]
    assert unknown == []


def test_energy_is_never_charged_by_minor_to_a_gpu_with_another_uuid(tmp_path):
    acc = EnergyAccounting(tmp_path / "e.json", FakeClock(1_000_000.0))
    # the GPU at minor 1 now has another UUID than the one the claim was prepared on
    gpus = [gpu(0), GpuInfo(1, "GPU-replacement", "x", "b", 1)]
    gone = Held("node-a", "gpu-1", "gpu", "GPU-1", 1)
    holders = checkpoint(claim("a", whole(0)), claim("b", gone))
    window = run_window(
        acc,
        gpus,
        holders,
        lambda t: [
            sample(0, t, 1000 + 300 * t, 300.0),
            GpuSample(
                index=1,
                uuid="GPU-replacement",
                timestamp=t,
                energy_joules=50 + 200 * t,
                power_watts=200.0,
            ),
        ],
    )
    assert window[1] == pytest.approx(6000.0)  # the replacement GPU drew energy
    got = by_claim(acc)
    assert ("b", "gpu-1") not in got  # none of it (and none of its time) is the claim's
    assert got[("a", "gpu-0")][0] == pytest.approx(window[0], rel=0.01)


def test_prepared_devices_and_unknown_gpu_logged_once(tmp_path, caplog):
    acc = EnergyAccounting(tmp_path / "e.json", FakeClock(1_000_000.0), log=logging.getLogger("t"))
    stray = Held("node-a", "gpu-9", "gpu", "GPU-9", 9)
    cp = checkpoint(claim("a", whole(0), stray))
    with caplog.at_level(logging.WARNING, logger="t"):
        acc.update([sample(0, 0.0, 1.0)], [gpu(0)], cp)
        out = acc.update([sample(0, 1.0, 2.0)], [gpu(0)], cp)
    assert [(p.device, p.gpu_index, p.claim) for p in out.prepared] == [("gpu-0", 0, "job-a")]
    assert sum("no known GPU" in r.message for r in caplog.records) == 1


def test_unknown_holders_attribute_and_release_nothing(tmp_path):
    clock = FakeClock(1_000_000.0)
    acc = EnergyAccounting(tmp_path / "e.json", clock, retention=0.0)
    gpus = [gpu(0)]
    holders = checkpoint(claim("a", whole(0)))
    acc.update([sample(0, 0.0, 0.0)], gpus, holders)
    acc.update([sample(0, 1.0, 100.0)], gpus, holders)
    for t in range(2, 5):
        clock.t += 10
        out = acc.update([sample(0, float(t), 100.0 * t)], gpus, None)
    assert out.gpu_energy[0] == pytest.approx(400.0)
    assert by_claim(acc)[("a", "gpu-0")][:2] == (100.0, 1.0)
    assert out.prepared == ()


# -- retention -------------------------------------------------------------------------------------


def test_unprepared_claim_keeps_counters_until_retention(tmp_path):
    clock = FakeClock(1_000_000.0)
    acc = EnergyAccounting(tmp_path / "e.json", clock, retention=300.0)
    gpus = [gpu(0)]
    held = checkpoint(claim("a", whole(0)))
    acc.update([sample(0, 0.0, 0.0)], gpus, held)
    acc.update([sample(0, 1.0, 100.0)], gpus, held)
    empty = checkpoint()
    clock.t += 1
    acc.update([sample(0, 2.0, 200.0)], gpus, empty)
    clock.t += 300
    acc.update([sample(0, 3.0, 300.0)], gpus, empty)
    assert by_claim(acc) == {("a", "gpu-0"): (100.0, 1.0, "exclusive")}
    # back within retention: continues from its counters
    acc.update([sample(0, 4.0, 400.0)], gpus, held)
    assert by_claim(acc)[("a", "gpu-0")][:2] == (200.0, 2.0)
    acc.update([sample(0, 5.0, 500.0)], gpus, empty)
    clock.t += 301
    out = acc.update([sample(0, 6.0, 600.0)], gpus, empty)
    assert out.claims == ()


# -- persistence -----------------------------------------------------------------------------------


def test_persistence_across_restart_never_goes_backwards(tmp_path):
    path = tmp_path / "state" / "energy.json"
    clock = FakeClock(1_000_000.0)
    gpus = [gpu(0, sms=98, profiles=A100_PROFILES), gpu(1)]
    holders = checkpoint(claim("a", mig(0, "1g5gb", 19, 0, gi=7)), claim("b", whole(1)))
    acc = EnergyAccounting(path, clock, persist_interval=30.0)
    for t in range(40):
        clock.t += 1
        acc.update([sample(0, t, 1e5 + 400 * t, 400.0), sample(1, t, 300 * t)], gpus, holders)
        if t == 10:
            assert not path.exists()  # not yet: at most every 30 s
    assert path.exists()
    saved = json.loads(path.read_text())
    assert saved["kind"] == "TesseraEnergyState" and saved["version"] == 1
    acc.close()
    before_gpu = {i: acc.gpu_energy(f"GPU-{i}") for i in (0, 1)}
    before = by_claim(acc)

    # the agent restarts (and the driver reloaded: the counters start over)
    acc2 = EnergyAccounting(path, clock, persist_interval=30.0)
    assert by_claim(acc2) == before
    assert {i: acc2.gpu_energy(f"GPU-{i}") for i in (0, 1)} == before_gpu
    for t in range(100, 110):
        clock.t += 1
        out = acc2.update(
            [sample(0, t, 400 * (t - 100), 400.0), sample(1, t, 300 * (t - 100))], gpus, holders
        )
    got = by_claim(acc2)
    for key, (e, secs, _) in got.items():
        assert e > before[key][0] and secs > before[key][1]
    assert out.gpu_energy[0] == pytest.approx(before_gpu[0] + 9 * 400)
    assert out.gpu_energy[1] == pytest.approx(before_gpu[1] + 9 * 300)


def test_released_claims_keep_their_release_time_across_restart(tmp_path):
    path = tmp_path / "energy.json"
    clock = FakeClock(1_000_000.0)
    acc = EnergyAccounting(path, clock, retention=100.0)
    held = checkpoint(claim("a", whole(0)))
    acc.update([sample(0, 0.0, 0.0)], [gpu(0)], held)
    acc.update([sample(0, 1.0, 10.0)], [gpu(0)], held)
    clock.t += 1
    acc.update([sample(0, 2.0, 20.0)], [gpu(0)], checkpoint())
    acc.close()
    clock.t += 60
    acc2 = EnergyAccounting(path, clock, retention=100.0)
    acc2.update([sample(0, 3.0, 30.0)], [gpu(0)], checkpoint())
    assert ("a", "gpu-0") in by_claim(acc2)
    clock.t += 41
    out = acc2.update([sample(0, 4.0, 40.0)], [gpu(0)], checkpoint())
    assert out.claims == ()


@pytest.mark.parametrize("old", ["process-utilization", "even"])
def test_a_state_file_with_an_earlier_rule_is_read_as_shared_and_keeps_counting(tmp_path, old):
    path = tmp_path / "energy.json"
    state = {
        "kind": "TesseraEnergyState", "version": 1, "savedAt": 0.0,
        "gpus": {"GPU-0": {"index": 0, "energyJoules": 5000.0}},
        "claims": [{"uid": "a", "pool": "node-a", "device": "gpu-0", "namespace": "team-a",
                    "claim": "job-a", "gpuIndex": 0, "gpuUUID": "GPU-0", "rule": old,
                    "energyJoules": 1000.0, "gpuSeconds": 40.0, "releasedAt": None}],
    }  # fmt: skip
    path.write_text(json.dumps(state))
    acc = EnergyAccounting(path, FakeClock(1_000_000.0))
    assert by_claim(acc) == {("a", "gpu-0"): (1000.0, 40.0, "shared")}
    holders = checkpoint(claim("a", whole(0, sharing="TimeSlicing")))
    acc.update([sample(0, 0.0, 10.0)], [gpu(0)], holders)
    acc.update([sample(0, 1.0, 110.0)], [gpu(0)], holders)
    assert by_claim(acc) == {("a", "gpu-0"): (1100.0, 41.0, "shared")}
    acc.close()
    assert json.loads(path.read_text())["claims"][0]["rule"] == "shared"


@pytest.mark.parametrize(
    "content",
    [b"{not json", b'{"kind": "Other"}', b'{"kind": "TesseraEnergyState", "version": 9}',
     b'{"kind": "TesseraEnergyState", "version": 1, "gpus": {"G": {"energyJoules": -1}}, '
     b'"claims": []}'],
    ids=["not-json", "wrong-kind", "newer-version", "negative-total"],
)  # fmt: skip
def test_corrupt_state_is_moved_aside(tmp_path, caplog, content):
    path = tmp_path / "energy.json"
    path.write_bytes(content)
    with caplog.at_level(logging.ERROR):
        acc = EnergyAccounting(path, FakeClock(1_000_000.0))
    assert acc.usage() == ()
    assert not path.exists()
    (moved,) = tmp_path.glob("energy.json.corrupt-*")
    assert moved.read_bytes() == content
    assert "corrupt" in caplog.text


def test_unwritable_state_file_is_logged_not_raised(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    acc = EnergyAccounting(blocker / "energy.json", FakeClock(1_000_000.0), persist_interval=0.0)
    with caplog.at_level(logging.WARNING):
        acc.update([sample(0, 0.0, 1.0)], [gpu(0)], None)
        acc.close()
    assert "cannot write the energy state file" in caplog.text


# -- GpuInfo from discovery ------------------------------------------------------------------------


def test_gpu_info_from_a_simulated_a100(tmp_path):
    from agent.nvml.facade import Nvml
    from agent.sim.model import load_model
    from agent.sim.nvml import FakeNvml

    nv = Nvml(FakeNvml(load_model("dgx-a100"), tmp_path))
    nv.init()
    info = gpu_info(nv.devices()[0])
    assert info.multiprocessors == 98
    assert dict(info.profile_multiprocessors)[19] == 14
    assert info.mig_device_multiprocessors("gpu-0-mig-3g20gb-9-4", None) == 42
