"""Prepare/unprepare latency through the kubelet gRPC socket (a real daemon subprocess), single
claim and a batch of 64, next to the floor measured in the same run: two fsync'd small file writes
in the same directory (what a prepare must at least do: checkpoint + CDI spec)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from agent.fsutil import atomic_write
from bench.common import ms, percentile, report, timings
from dra_driver.kubelet_calls import ClaimRef
from dra_driver.kubelet_client import KubeletClient

DRIVER = "gpu.tessera.dev"
NODE = "bench-64"
GPUS = 64
SINGLE_RUNS = 60
BATCH_RUNS = 10


def model_64() -> dict[str, Any]:
    """A node with 64 L4 cards: 8 root complexes, each with a switch of 8 GPUs."""
    gpus = []
    for r in range(8):
        root = 0x10 + r * 0x10
        for p in range(8):
            gpus.append(
                {
                    "bus": f"0000:{root + 3 + p:02x}:00.0",
                    "product": "L4",
                    "numa": r // 4,
                    "parent": f"pci0000:{root:02x}/0000:{root:02x}:01.0/0000:{root + 1:02x}:00.0"
                    f"/0000:{root + 2:02x}:{p:02x}.0",
                }
            )
    return {
        "name": NODE,
        "description": "benchmark node: 64x L4",
        "hostname": NODE,
        "driverVersion": "550.90.07",
        "cudaDriverVersion": 12040,
        "numaNodes": {0: "0-31", 1: "32-63"},
        "nvlink": {"kind": "none"},
        "gpus": gpus,
    }


def claim(i: int) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": f"c{i}", "namespace": "default", "uid": f"uid-{i:04d}"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x"}}]}},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": f"gpu-{i}"}
                    ]
                }
            }
        },
    }


def floor(directory: Path, runs: int) -> dict[str, float]:
    def two_writes() -> None:
        atomic_write(directory / "a.json", b'{"checkpoint": 1}' * 20)
        atomic_write(directory / "b.json", b'{"cdi": 1}' * 40)

    return timings(two_writes, runs)


def run() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="tb-", dir="/tmp"))
    try:
        _run(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(tmp: Path) -> None:
    model_file = tmp / "bench-64.yaml"
    model_file.write_text(yaml.safe_dump(model_64()))
    state = tmp / "s"
    (state / "resourceclaims").mkdir(parents=True)
    (state / "resourceclaims" / "claims.yaml").write_text(
        yaml.safe_dump_all([claim(i) for i in range(GPUS)])
    )
    tessera = os.path.join(os.path.dirname(sys.executable), "tessera")
    proc = subprocess.Popen(
        [tessera, "run", "--simulate", str(model_file), "--state-dir", str(state), "--no-kube",
         "--metrics-address", "127.0.0.1:0", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    sock = state / "kubelet" / "plugins" / DRIVER / "dra.sock"
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("daemon did not start")
            time.sleep(0.05)
        refs = [ClaimRef("default", f"c{i}", f"uid-{i:04d}") for i in range(GPUS)]
        with KubeletClient(sock) as k:
            k.prepare(refs[:1])  # warm up
            k.unprepare(refs[:1])
            prep, unprep = [], []
            for _ in range(SINGLE_RUNS):
                t0 = time.perf_counter()
                r = k.prepare(refs[:1])
                prep.append(time.perf_counter() - t0)
                assert r["claims"]["uid-0000"]["error"] == "", r
                t0 = time.perf_counter()
                k.unprepare(refs[:1])
                unprep.append(time.perf_counter() - t0)
            bprep, bunprep = [], []
            for _ in range(BATCH_RUNS):
                t0 = time.perf_counter()
                r = k.prepare(refs)
                bprep.append(time.perf_counter() - t0)
                assert not any(c["error"] for c in r["claims"].values()), r
                t0 = time.perf_counter()
                k.unprepare(refs)
                bunprep.append(time.perf_counter() - t0)
        fl = floor(state, 200)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)

    def stat(xs: list[float]) -> dict[str, float]:
        return {"p50_s": percentile(xs, 50), "p99_s": percentile(xs, 99), "runs": len(xs)}

    data = {
        "floor_two_fsync_writes": fl,
        "prepare_single": stat(prep),
        "unprepare_single": stat(unprep),
        "prepare_batch64": stat(bprep),
        "unprepare_batch64": stat(bunprep),
    }
    f50 = fl["p50_s"]
    rows = [("floor: two fsync'd writes, p50 / p99", f"{ms(f50)} / {ms(fl['p99_s'])}")]
    for key, label in [
        ("prepare_single", "prepare, 1 claim"),
        ("unprepare_single", "unprepare, 1 claim"),
        ("prepare_batch64", "prepare, 64 claims in one call"),
        ("unprepare_batch64", "unprepare, 64 claims in one call"),
    ]:
        s = data[key]
        ratio = s["p50_s"] / f50
        data[key]["ratio_to_floor_p50"] = ratio
        rows.append(
            (f"{label}: p50 / p99", f"{ms(s['p50_s'])} / {ms(s['p99_s'])}  ({ratio:.1f}x floor)")
        )
    report("prepare", "Prepare through the kubelet socket (bench/prepare.py)", rows, data)
