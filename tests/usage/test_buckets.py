"""The ledger's 15-minute UTC buckets (agent/usage/buckets.py) and how the ledger keeps them in
its file (agent/usage/counters.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.usage.buckets import BUCKET_SECONDS, Buckets, Share, pieces, report_buckets, rfc3339
from agent.usage.counters import Interval, UsageLedger

T = 1_796_385_600.0  # 2026-12-04T12:00:00Z, a bucket boundary
KEY = ("uid-1", "gpu.tessera.dev", "NVIDIA H100 80GB HBM3", None)


def share(allocated: float, busy: float = 0.0, energy: float = 0.0, idle: float = 0.0) -> Share:
    return Share(KEY, "team-a", "train-1", allocated, busy, energy, idle)


def test_an_interval_across_a_boundary_is_split_by_seconds():
    assert pieces(T - 1.0, T + 3.0) == [(int(T) - BUCKET_SECONDS, 0.25), (int(T), 0.75)]
    assert pieces(T - 1.0, T) == [(int(T) - BUCKET_SECONDS, 1.0)]  # ends on the boundary
    assert pieces(T, T) == [(int(T), 1.0)]  # no length: the bucket holding the instant
    b = Buckets()
    b.add(T - 1.0, T + 3.0, [share(4.0, busy=2.0, energy=400.0, idle=4.0)])
    (u1,), (u2,) = (list(e.values()) for _, e in b.items())
    assert (u1.allocated, u1.busy, u1.energy, u1.unobserved) == (1.0, 0.5, 100.0, 1.0)
    assert (u2.allocated, u2.busy, u2.energy, u2.unobserved) == (3.0, 1.5, 300.0, 3.0)


def test_a_long_gap_is_spread_over_every_bucket_it_covers():
    b = Buckets()
    b.add(T - 450.0, T + 2 * BUCKET_SECONDS + 450.0, [share(2700.0)])  # 2,700 s at weight 1
    assert [(s - int(T), round(next(iter(e.values())).allocated, 9)) for s, e in b.items()] == [
        (-900, 450.0),
        (0, 900.0),
        (900, 900.0),
        (1800, 450.0),
    ]


def test_a_closed_bucket_never_changes_even_when_the_wall_clock_steps_back():
    b = Buckets()
    b.add(T - 10.0, T + 5.0, [share(15.0)])
    assert b.closed(int(T) - BUCKET_SECONDS) and not b.closed(int(T))
    b.add(T - 20.0, T - 15.0, [share(5.0)])  # the clock stepped back 25 s
    (before,) = next(iter(b.items()))[1].values()
    assert before.allocated == 10.0  # unchanged: the span moved to start at the horizon
    assert b.horizon == T + 10.0


def test_acknowledge_drops_only_closed_buckets_starting_before_the_instant():
    b = Buckets()
    b.add(T - 10.0, T + 5.0, [share(15.0)])
    assert b.acknowledge(T + BUCKET_SECONDS) == 1  # the open one stays
    assert [s for s, _ in b.items()] == [int(T)]
    b.add(T + 5.0, T + BUCKET_SECONDS + 1.0, [share(1.0)])
    assert b.acknowledge(T) == 0  # closed now, but not acknowledged: starts at T
    assert [s for s, _ in b.items()] == [int(T), int(T) + BUCKET_SECONDS]


def test_the_report_form_is_the_contracts_and_bounded_oldest_first():
    b = Buckets()
    mig = ("uid-2", "", "NVIDIA H100 80GB HBM3", "3g.40gb")
    b.add(T - 1.0, T + 1.0, [share(2.0), Share(mig, "team-b", "inf", 1.0, 0.0, 0.0, 2.0)])
    out = report_buckets(b, 1 << 20)
    assert [(x["start"], x["closed"]) for x in out] == [
        ("2026-12-04T11:45:00Z", True),
        ("2026-12-04T12:00:00Z", False),
    ]
    whole, part = out[0]["usage"]
    assert "migProfile" not in whole and part["migProfile"] == "3g.40gb"
    assert whole == {
        "namespace": "team-a",
        "claim": "train-1",
        "claimUID": "uid-1",
        "deviceClass": "gpu.tessera.dev",
        "product": "NVIDIA H100 80GB HBM3",
        "allocatedGpuSeconds": 1.0,
        "busyGpuSeconds": 0.0,
        "energyJoules": 0.0,
        "unobservedSeconds": 0.0,
    }
    assert [x["start"] for x in report_buckets(b, 10)] == ["2026-12-04T11:45:00Z"]
    assert rfc3339(T + 451.25) == "2026-12-04T12:07:31.250000Z"


def test_the_ledger_keeps_its_buckets_in_its_file_and_reads_a_version_1_file(tmp_path: Path):
    path = tmp_path / "usage.json"
    key = ("uid-1", "node-a", "gpu-0")
    ledger = UsageLedger(path, "boot-1")
    ledger.account(T - 2.0, 0.0, [], {})
    iv = Interval(key, "team-a", "train", "GPU-0", 1.0, "whole-gpu", 0.0, 1.0, "H100", None, "c")
    ledger.account(T + 2.0, 4.0, [iv], {})
    through, buckets = ledger.report()  # written and fsynced
    assert through == T + 2.0
    again = UsageLedger(path, "boot-1")
    assert again.buckets.state() == buckets.state()
    assert again.counters()[key].device_class == "c"
    # a file an older agent wrote (version 1: no buckets, no device classes)
    old = json.loads(path.read_text())
    old["version"] = 1
    del old["buckets"]
    for h in old["holdings"]:
        del h["deviceClass"]
    path.write_text(json.dumps(old))
    v1 = UsageLedger(path, "boot-1")
    assert list(v1.buckets.items()) == [] and v1.counters()[key].device_class == ""
    assert v1.credit_gap(T + 12.0, [key], {}).reason == "credited"
    ((start, entries),) = v1.buckets.items()
    assert start == int(T) and entries[("uid-1", "", "H100", None)].allocated == 10.0


def test_a_report_before_anything_was_counted_is_refused(tmp_path: Path):
    with pytest.raises(ValueError, match="counted nothing yet"):
        UsageLedger(tmp_path / "usage.json", "boot-1").report()
