"""Daemon memory: RSS of a `tessera run --simulate dgx-a100` (56 MIG devices, all-1g) after
BENCH_RSS_SECONDS (default 600 s = 10 minutes) at the default 1 s telemetry interval, with claims
prepared and /metrics scraped every 15 s, like a Prometheus server would."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import yaml

from bench.common import report
from dra_driver.kubelet_calls import ClaimRef
from dra_driver.kubelet_client import KubeletClient

DRIVER = "gpu.tessera.dev"


def _claims(state: Path) -> list[ClaimRef]:
    docs, refs = [], []
    for gpu in range(8):
        for start in range(7):
            i = gpu * 7 + start
            dev = f"gpu-{gpu}-mig-1g5gb-19-{start}"
            docs.append({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": f"c{i}", "namespace": "default", "uid": f"uid-{i:03d}"},
                "spec": {"devices": {"requests": [
                    {"name": "mig", "exactly": {"deviceClassName": "x"}}]}},
                "status": {"allocation": {"devices": {"results": [
                    {"request": "mig", "driver": DRIVER, "pool": "dgx-a100", "device": dev}]}}},
            })  # fmt: skip
            refs.append(ClaimRef("default", f"c{i}", f"uid-{i:03d}"))
    (state / "resourceclaims").mkdir(parents=True)
    (state / "resourceclaims" / "claims.yaml").write_text(yaml.safe_dump_all(docs))
    return refs


def run() -> None:
    seconds = float(os.environ.get("BENCH_RSS_SECONDS", "600"))
    tmp = Path(tempfile.mkdtemp(prefix="tr-", dir="/tmp"))
    state = tmp / "s"
    refs = _claims(state)
    tessera = os.path.join(os.path.dirname(sys.executable), "tessera")
    proc = subprocess.Popen(
        [tessera, "run", "--simulate", "dgx-a100", "--sim-mig-layout", "all-1g",
         "--state-dir", str(state), "--no-kube", "--metrics-address", "127.0.0.1:19409",
         "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        sock = state / "kubelet" / "plugins" / DRIVER / "dra.sock"
        while not sock.exists():
            if proc.poll() is not None:
                raise RuntimeError("daemon did not start")
            time.sleep(0.1)
        with KubeletClient(sock) as k:
            res = k.prepare(refs)
        assert not any(c["error"] for c in res["claims"].values()), res
        ps = psutil.Process(proc.pid)
        rss_start = ps.memory_info().rss
        samples = [(0.0, rss_start)]
        t0 = time.monotonic()
        while (elapsed := time.monotonic() - t0) < seconds:
            with urllib.request.urlopen("http://127.0.0.1:19409/metrics", timeout=10) as r:
                r.read()
            samples.append((elapsed, ps.memory_info().rss))
            time.sleep(min(15.0, max(0.0, seconds - elapsed)))
        rss_end = ps.memory_info().rss
        samples.append((time.monotonic() - t0, rss_end))
        cpu = ps.cpu_times()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    mib = 1024 * 1024
    rows = [
        ("run length", f"{seconds:.0f} s at 1 s telemetry interval, 56 MIG devices, 56 claims"),
        ("RSS after start (claims prepared)", f"{rss_start / mib:.1f} MiB"),
        (f"RSS after {seconds:.0f} s", f"{rss_end / mib:.1f} MiB"),
        ("peak RSS seen", f"{max(r for _, r in samples) / mib:.1f} MiB"),
        (
            "RSS at 1/3, 2/3 of the run",
            " / ".join(
                f"{samples[min(len(samples) - 1, len(samples) * k // 3)][1] / mib:.1f} MiB"
                for k in (1, 2)
            ),
        ),
        ("daemon CPU over the run", f"{(cpu.user + cpu.system) / seconds:.1%} of one core"),
    ]
    report(
        "rss",
        "Daemon memory over time (bench/rss.py)",
        rows,
        {
            "seconds": seconds,
            "rss_start_bytes": rss_start,
            "rss_end_bytes": rss_end,
            "rss_samples": samples,
            "cpu_seconds": cpu.user + cpu.system,
        },
    )
