"""Sharing and partitioning through the kubelet gRPC socket (a real daemon subprocess per node):

- dynamic MIG: prepare and unprepare of one claim per profile of GPU 0, every profile, on the
  simulated dgx-a100 and dgx-h100 (``--mig-mode dynamic``), next to the simulator's own cost of
  the same change measured in the same run (``MigControl`` create + destroy over the simulated
  NVML, no daemon), so the driver's part is the difference, and the ratio is checked against
  the goal (``MIG_GOAL``: within 2x); in between, the NVML calls the driver itself makes for the
  change (``DynamicMig.ensure`` + ``release``: the lookups that let a crash between steps be
  found again come on top of the bare create + destroy), still without the daemon; the three
  are measured in turn in every round, so load from elsewhere weighs on all of them alike. The
  table shows each node's worst profile;
- memory shares: 8 claims of 8 GiB on one GPU (``--sharing memory-shares``), prepared by one
  call for all 8 (and, in a full run, by 8 concurrent calls and by 8 calls in a row); total
  time, next to the same tool runs without the daemon.

(MPS prepare-to-ready is a mode of ``bench/prepare.py``.) Every claim is unprepared before its
daemon stops; MPS control daemons still running under a state directory afterwards (there should
be none) are killed and counted. The benchmark makes itself the child subreaper of what the
daemon starts and reaps exited MPS daemons at once (a node whose init reaps them promptly); see
docs/performance.md.
"""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import floors
from bench.common import (
    Claim,
    Daemon,
    check,
    claim,
    ms,
    percentile,
    report,
    scratch,
    simulated_inventory,
    stat,
)
from bench.table import Figure, measured, ratio_at_most
from dra_driver.device_model import AdvertisedDevice, DevicePolicy, advertised_devices
from dra_driver.testkubelet.client import KubeletClient

NAME = "sharing"
MIG_MODELS = ("dgx-a100", "dgx-h100")
MIG_GOAL = 2.0
"""Issues 10 and 25: prepare + unprepare (p50) within this factor of the simulator's create +
destroy (p50), measured in the same run."""
SHARE_MODEL = "dgx-h100"
SHARES = 8
SHARE_MEMORY = "8Gi"
MIG_FLOOR = (
    "the simulator's own MIG create + destroy of the same placement (MigControl, no daemon),"
    " in turn with the calls"
)
SHARE_FLOOR = (
    "the simulator's tools doing what a prepare of the 8 shares runs (compute mode, 8 MPS"
    " daemons started and configured), without the daemon, in turn"
)


@dataclass(frozen=True)
class Plan:
    repeats: int
    mig_rounds: int
    """Prepare + unprepare pairs per profile and repeat (placements taken in turn)."""
    share_ways: tuple[str, ...]
    share_rounds: int


FULL = Plan(3, 10, ("one_call", "concurrent", "sequential"), 3)
QUICK = Plan(2, 3, ("one_call",), 1)


# -- dynamic MIG ---------------------------------------------------------------------------------
def mig_placements(model: str) -> tuple[str, dict[str, list[AdvertisedDevice]]]:
    """The node name and GPU 0's placement devices by profile, in advertised order."""
    with simulated_inventory(model) as inv:
        devices = advertised_devices(inv, DevicePolicy(mig_mode="dynamic")).devices
        pool = inv.hostname
    by_profile: dict[str, list[AdvertisedDevice]] = {}
    for d in devices:
        if d.kind == "mig" and d.gpu_minor == 0:
            profile = str(dict(d.attributes)["profile"]["string"])
            by_profile.setdefault(profile, []).append(d)
    return pool, by_profile


Timings = dict[str, list[float]]
"""Seconds by what: prepare, unprepare, create, destroy, calls."""


def mig_through_daemon(
    tmp: Path,
    model: str,
    pool: str,
    by_profile: dict[str, list[AdvertisedDevice]],
    plan: Plan,
    reaper: floors.Reaper,
) -> dict[str, list[Timings]]:
    """Per profile and repeat: prepare and unprepare through the daemon, the bare create and
    destroy, and the driver's own NVML calls for the change, measured in turn in every round."""
    claims = {
        d.name: claim(f"m-{d.name}", d.name) for devices in by_profile.values() for d in devices
    }
    daemon = Daemon(
        tmp, model, pool, list(claims.values()), "--mig-mode", "dynamic", started=reaper.started
    )
    out: dict[str, list[Timings]] = {}
    try:
        with KubeletClient(daemon.socket) as k, floors.bare_mig(tmp / f"raw-{model}", model) as mig:
            for profile, devices in by_profile.items():
                for repeat in range(plan.repeats):
                    t: Timings = {
                        n: [] for n in ("prepare", "unprepare", "create", "destroy", "calls")
                    }
                    warm = 1 if repeat == 0 else 0
                    for i in range(plan.mig_rounds + warm):
                        d = devices[i % len(devices)]
                        ref = claims[d.name].ref
                        t0 = time.perf_counter()
                        check(k.prepare([ref]), [ref])
                        t1 = time.perf_counter()
                        check(k.unprepare([ref]), [ref])
                        t2 = time.perf_counter()
                        create, gi = mig.create(d)
                        destroy = mig.destroy(gi)
                        calls = mig.driver_calls(d)
                        if i >= warm:  # the first round of a profile warms up
                            t["prepare"].append(t1 - t0)
                            t["unprepare"].append(t2 - t1)
                            t["create"].append(create)
                            t["destroy"].append(destroy)
                            t["calls"].append(calls)
                    out.setdefault(profile, []).append(t)
    finally:
        daemon.stop()
    return out


def pairs(t: Timings, a: str, b: str) -> list[float]:
    return [x + y for x, y in zip(t[a], t[b], strict=True)]


def p50(xs: list[float]) -> float:
    return percentile(xs, 50)


# -- memory shares -------------------------------------------------------------------------------
def memory_shares(tmp: Path, plan: Plan, reaper: floors.Reaper) -> tuple[Timings, int]:
    with simulated_inventory(SHARE_MODEL) as inv:
        pool = inv.hostname
    claims: list[Claim] = [claim(f"share-{i}", "gpu-0", memory=SHARE_MEMORY) for i in range(SHARES)]
    refs = [c.ref for c in claims]
    daemon = Daemon(
        tmp, SHARE_MODEL, pool, claims, "--sharing", "memory-shares", started=reaper.started
    )
    totals: Timings = {how: [] for how in (*plan.share_ways, "undo", "tools")}
    """Seconds by way of preparing; "tools_<way>": the tool runs without the daemon timed
    just before that way (also all together in "tools")."""
    try:
        with (
            KubeletClient(daemon.socket) as k,
            ThreadPoolExecutor(SHARES) as pool_,
            floors.bare_mps(tmp / "raw-shares", SHARE_MODEL, SHARES) as bare,
        ):
            check(k.prepare(refs[:1]), refs[:1])  # warm up
            check(k.unprepare(refs[:1]), refs[:1])
            if plan.share_rounds > 1:
                bare.start_stop()  # warm up (not in a quick look)
            for _ in range(plan.share_rounds):
                for how in plan.share_ways:
                    tools = bare.start_stop()[0]  # in turn with each way
                    totals["tools"].append(tools)
                    totals.setdefault(f"tools_{how}", []).append(tools)
                    t0 = time.perf_counter()
                    if how == "concurrent":
                        for r in pool_.map(lambda ref: (ref, k.prepare([ref])), refs):
                            check(r[1], [r[0]])
                    elif how == "sequential":
                        for ref in refs:
                            check(k.prepare([ref]), [ref])
                    else:
                        check(k.prepare(refs), refs)
                    totals[how].append(time.perf_counter() - t0)
                    running = len(floors.mps_daemons(daemon.state))
                    if running != SHARES:
                        raise RuntimeError(f"{running} MPS daemons run for {SHARES} shares")
                    t0 = time.perf_counter()
                    check(k.unprepare(refs), refs)
                    totals["undo"].append(time.perf_counter() - t0)
    finally:
        daemon.stop()
    return totals, floors.kill_mps_daemons(daemon.state)


# -- the run ---------------------------------------------------------------------------------
def run(quick: bool) -> list[Figure]:
    plan = QUICK if quick else FULL
    with scratch("tbs-") as tmp, floors.Reaper().running() as reaper:
        return _run(tmp, plan, reaper)


def _run(tmp: Path, plan: Plan, reaper: floors.Reaper) -> list[Figure]:
    data: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "load_average_before": os.getloadavg()},
        "dynamic_mig": {},
    }
    rows: list[tuple[str, str]] = []
    figures: list[Figure] = []
    met = total = 0
    for model in MIG_MODELS:
        pool, by_profile = mig_placements(model)
        timings = mig_through_daemon(tmp, model, pool, by_profile, plan, reaper)
        per_profile: dict[str, Figure] = {}
        for profile, repeats in timings.items():
            f = measured(
                NAME,
                f"dynamic MIG prepare + unprepare p50, {model}, {profile}",
                "ms",
                [1000 * p50(pairs(t, "prepare", "unprepare")) for t in repeats],
                [1000 * p50(pairs(t, "create", "destroy")) for t in repeats],
                floor_how=MIG_FLOOR,
                goal=ratio_at_most(MIG_GOAL),
            )
            per_profile[profile] = f
            met += bool(f.met)
            total += 1
            everything = {k: [x for t in repeats for x in t[k]] for k in repeats[0]}
            data["dynamic_mig"].setdefault(model, {})[profile] = {
                "prepare": stat(everything["prepare"]),
                "unprepare": stat(everything["unprepare"]),
                "pair": stat(pairs(everything, "prepare", "unprepare")),
                "simulator_create": stat(everything["create"]),
                "simulator_destroy": stat(everything["destroy"]),
                "simulator_pair": stat(pairs(everything, "create", "destroy")),
                "driver_calls": stat(everything["calls"]),
                "ratio_p50": f.ratio,
            }
            d = data["dynamic_mig"][model][profile]
            rows.append(
                (
                    f"{model} {profile}: prepare / unprepare / simulator create+destroy /"
                    " the driver's NVML calls, p50 (p99)",
                    " / ".join(
                        f"{ms(d[key]['p50_s'])} ({ms(d[key]['p99_s'])})"
                        for key in ("prepare", "unprepare", "simulator_pair", "driver_calls")
                    )
                    + f"; {f.ratio:.2f}x",
                )
            )
        worst = max(per_profile.values(), key=lambda f: f.ratio or 0.0)
        figures.append(dataclasses.replace(worst, name=worst.name.replace(", ", ", worst: ", 1)))
    data["dynamic_mig"]["goal"] = {"factor": MIG_GOAL, "met": met, "profiles": total}
    rows.append((f"dynamic MIG prepare+unprepare within {MIG_GOAL:g}x of the simulator (p50)",
                 f"{met} of {total} profiles"))  # fmt: skip
    shares, leftovers = memory_shares(tmp, plan, reaper)
    data["memory_shares"] = {
        "claims": SHARES,
        "memory": SHARE_MEMORY,
        **{k: stat(v) for k, v in shares.items()},
    }
    figures.append(
        measured(
            NAME,
            f"memory shares: {SHARES} x {SHARE_MEMORY} of one GPU prepared in one call",
            "s",
            shares["one_call"],
            shares["tools_one_call"],
            floor_how=SHARE_FLOOR,
        )
    )
    for how, label in (
        ("concurrent", f"{SHARES} concurrent calls"),
        ("sequential", f"{SHARES} calls in a row"),
        ("one_call", f"one call for all {SHARES}"),
        ("undo", f"unprepare all {SHARES} (one call)"),
        ("tools", f"the same tool runs for {SHARES} without the daemon"),
    ):
        if shares.get(how):
            s = stat(shares[how])
            rows.append(
                (
                    f"{SHARES} x {SHARE_MEMORY} shares of one GPU, {label}: total p50 (max)",
                    f"{ms(s['p50_s'])} ({ms(max(shares[how]))}) over {s['runs']} rounds",
                )
            )
    data["leftover_mps_daemons_killed"] = leftovers
    data["machine"]["load_average_after"] = os.getloadavg()
    rows.append(("MPS daemons left running after unprepare, killed", str(leftovers)))
    report(NAME, "Sharing and partitioning through the kubelet socket (bench/sharing.py)",
           rows, data, figures)  # fmt: skip
    if leftovers:
        raise RuntimeError(f"{leftovers} MPS daemons were left running after unprepare")
    return figures
