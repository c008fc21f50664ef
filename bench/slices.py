"""ResourceSlices: their size (compact JSON bytes of dgx-a100's pool in dynamic MIG mode, what
each cut of issue 25 saved, every simulated model and mode: bench/slice_bytes.py), build time
for dgx-a100 in dynamic MIG mode, and API writes per situation (first publish, 10 simulated
minutes of steady state, one device change), counted at the API-server emulator over real
HTTP."""

from __future__ import annotations

import itertools
import logging
import tempfile
from pathlib import Path

from agent.sim.apiserver import ApiServer
from bench.common import ms, pool_bytes, report, simulated_inventory, timings
from bench.slice_bytes import cuts, every_model
from bench.table import Figure, at_most, equal_to, measured
from dra_driver.advertise.publisher import Publisher
from dra_driver.advertise.slice_stores import KubeSliceStore
from dra_driver.advertise.slices import SlicePolicy, build_slices
from dra_driver.cluster.kube import KubeClient
from dra_driver.device_model import DeviceModel, DevicePolicy, advertised_devices

DRIVER, NODE = "gpu.tessera.dev", "bench-node"
NAME = "slices"
REPEATS, BUILDS = 3, 200
QUICK_REPEATS, QUICK_BUILDS = 2, 50
BYTES_GOAL_KB = 150
"""Issue 25: dgx-a100's default dynamic-MIG pool, at most 150 KB of compact JSON."""
CHOSEN_PROFILES = ("1g.10gb", "3g.20gb")
"""An admin's ``--mig-profiles`` for the size row (two of the A100 40GB's seven profiles)."""


def without_gpu(model: DeviceModel, minor: int) -> DeviceModel:
    """The device model with one GPU (its devices and counter set) gone."""
    return DeviceModel(
        devices=tuple(d for d in model.devices if d.gpu_minor != minor),
        counter_sets=tuple(c for c in model.counter_sets if c.name != f"gpu-{minor}-counter-set"),
    )


def run(quick: bool) -> list[Figure]:
    repeats, builds = (QUICK_REPEATS, QUICK_BUILDS) if quick else (REPEATS, BUILDS)
    dynamic = DevicePolicy(driver_name=DRIVER, mig_mode="dynamic")
    policy = SlicePolicy(driver_name=DRIVER, node_name=NODE)
    with simulated_inventory("dgx-a100") as inv:
        model = advertised_devices(inv, dynamic)
        slices = build_slices(model, policy, 1)
        saved = cuts(inv, dynamic)
        chosen = DevicePolicy(driver_name=DRIVER, mig_mode="dynamic", mig_profiles=CHOSEN_PROFILES)
        chosen_bytes = pool_bytes(build_slices(advertised_devices(inv, chosen), policy, 1))
        runs = [
            timings(lambda: build_slices(advertised_devices(inv, dynamic), policy, 1), builds)
            for _ in range(repeats)
        ]

    log = logging.getLogger("bench")
    log.addHandler(logging.NullHandler())
    log.propagate = False
    with ApiServer() as server, tempfile.TemporaryDirectory() as tmp:
        kube = KubeClient.from_config(server.kubeconfig(Path(tmp)))
        pub = Publisher(KubeSliceStore(kube, DRIVER, NODE), policy, log, resync_interval=600.0)
        # (the publisher is driven step by step on a simulated clock: no threads, no waiting)
        pub.set_devices(model)
        pub.step(0.0)
        first = server.writes("resourceslices")
        server.clear_log()
        now, steps = 0.0, 0
        while now < 600.0:  # ten simulated minutes at the default 600 s resync
            now += max(pub.step(now), 1.0)
            steps += 1
        steady = server.writes("resourceslices")
        # the same ten minutes with a 30 s resync: reads, still no writes
        pub.resync_interval = 30.0
        for t in range(0, 600, 30):
            pub.step(600.0 + t)
        steady_30 = server.writes("resourceslices")
        reads_30 = server.requests.count("GET", "resourceslices")
        server.clear_log()
        # one device change in static mode: the MIG layout changes -> one pass, one slice
        with simulated_inventory("dgx-a100") as inv:
            a = advertised_devices(inv, DevicePolicy(driver_name=DRIVER))
        with simulated_inventory("dgx-a100", "all-1g") as inv:
            b = advertised_devices(inv, DevicePolicy(driver_name=DRIVER))
        pub.set_devices(a)
        pub.step(2000.0)
        server.clear_log()
        pub.set_devices(b)
        pub.step(2001.0)
        change = server.writes("resourceslices")
        # dynamic mode: one GPU disappears from a 5-slice pool -> every slice moves generation
        pub.set_devices(model)
        pub.step(3000.0)
        server.clear_log()
        pub.set_devices(without_gpu(model, 7))
        pub.step(3001.0)
        change_dynamic = server.writes("resourceslices")
        kube.close()

    devices = sum(len(s["spec"].get("devices", [])) for s in slices)
    size = pool_bytes(slices)
    models = every_model()
    figures = [
        measured(NAME, "slices, dgx-a100 dynamic MIG, compact JSON bytes", "KB", [size / 1000],
                 goal=at_most(BYTES_GOAL_KB, "KB")),
        measured(NAME, f"build, dgx-a100 dynamic MIG ({devices} devices, {len(slices)} slices),"
                 " p50", "ms", [1000 * r["p50_s"] for r in runs]),
        measured(NAME, "API writes, first publish", "count", [first],
                 goal=equal_to(len(slices))),
        measured(NAME, "API writes, 2 x 10 simulated minutes steady (resync 600 s, 30 s)", "count",
                 [steady + steady_30], goal=equal_to(0)),
        measured(NAME, "API writes, one device change (static MIG, 1 slice)", "count",
                 [change], goal=equal_to(1)),
        measured(NAME, f"API writes, one GPU gone (dynamic MIG, {len(slices)}-slice pool)",
                 "count", [change_dynamic], goal=equal_to(len(slices))),
    ]  # fmt: skip
    rows = [
        ("dgx-a100 dynamic: devices / slices", f"{devices} / {len(slices)}"),
        ("dgx-a100 dynamic: compact JSON bytes", f"{size:,}"),
        *(
            (f"  {label}", f"{after:,} ({after - before:+,})")
            for (_, before), (label, after) in itertools.pairwise(saved)
        ),
        (f"  --mig-profiles {','.join(CHOSEN_PROFILES)}", f"{chosen_bytes:,}"),
        *((f"{m} {mode}: devices, bytes", f"{n}, {b:,}") for m, mode, n, b in models),
        (
            "build time p50 / p99, each repeat",
            ", ".join(f"{ms(r['p50_s'])} / {ms(r['p99_s'])}" for r in runs),
        ),
        ("API writes: first publish", str(first)),
        ("API writes: 10 min steady state (resync 600 s)", str(steady)),
        ("API writes: 10 min steady state (resync 30 s)", f"{steady_30} ({reads_30} lists)"),
        ("API writes: one device change (static, 1 slice)", str(change)),
        ("API writes: one GPU gone (dynamic, whole pool)", str(change_dynamic)),
    ]
    report(
        "slices",
        "ResourceSlices (bench/slices.py)",
        rows,
        {
            "devices": devices,
            "slices": len(slices),
            "bytes": size,
            "bytes_by_cut": saved,
            "bytes_mig_profiles": {"profiles": list(CHOSEN_PROFILES), "bytes": chosen_bytes},
            "bytes_by_model": [
                {"model": m, "mig_mode": mode, "devices": n, "bytes": b} for m, mode, n, b in models
            ],
            "build": runs,
            "writes_first_publish": first,
            "writes_steady_10min_resync600": steady,
            "writes_steady_10min_resync30": steady_30,
            "lists_steady_10min_resync30": reads_30,
            "writes_one_device_change": change,
            "writes_one_gpu_gone_dynamic": change_dynamic,
        },
        figures,
    )
    return figures
