"""API writes per node in steady state with 64 claims: a real ``tessera run --simulate dgx-h100``
in kube mode (``--sharing time-slicing``: 8 claims on each of its 8 GPUs) against the API-server
emulator over real HTTP; the 64 claims prepared through the kubelet socket; then every write the
emulator receives (any resource: the usage report, ResourceSlices, Events) is counted over a
steady window.

To keep it short, the report interval is shortened (5 s; quick: 2 s) and the figure is the
writes per report interval, which at the default ``--usage-report-interval`` of 60 s is the
writes per minute (the goal: at most 1). Everything else runs at its defaults.

The emulator does not serve CRDs yet: the bench adds ``gpuusagereports`` to its resource table
(as tests/usage_reports.py does) until it does."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

from agent.sim.apiserver import ApiServer
from agent.sim.apiserver_types import RESOURCES, ResourceType
from bench.common import check, report, scratch, terminate
from bench.table import Figure, at_most, measured
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient

NAME = "usage_report"
MODEL, GPUS, PER_GPU = "dgx-h100", 8, 8
DRIVER = "gpu.tessera.dev"
INTERVAL, WINDOW = 5.0, 60.0
QUICK_INTERVAL, QUICK_WINDOW = 2.0, 12.0
GPU_USAGE_REPORTS = ResourceType(
    "gpuusagereports", "GpuUsageReport", group="tessera.dev", version="v1alpha1", status=True
)


def claim(node: str, i: int) -> dict[str, Any]:
    gpu = f"gpu-{i // PER_GPU}"
    sharing = {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}
    parameters = {"apiVersion": f"{DRIVER}/v1alpha1", "kind": "GpuConfig", "sharing": sharing}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": f"c{i}", "namespace": "default", "uid": f"uid-c{i}"},
        "spec": {
            "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}
        },
        "status": {
            "allocation": {
                "devices": {
                    "results": [{"request": "gpu", "driver": DRIVER, "pool": node, "device": gpu}],
                    "config": [
                        {
                            "source": "FromClaim",
                            "opaque": {"driver": DRIVER, "parameters": parameters},
                        }
                    ],
                }
            }
        },
    }


def wait(cond: Any, what: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"never: {what} (the daemon's log is beside its state directory)")
        time.sleep(0.05)


def reported(server: ApiServer, node: str) -> int:
    obj = server.get_object("gpuusagereports", node)
    if obj is None:
        return 0
    return len({u["claimUID"] for b in obj["spec"]["buckets"] for u in b["usage"]})


def run(quick: bool) -> list[Figure]:
    interval, window = (QUICK_INTERVAL, QUICK_WINDOW) if quick else (INTERVAL, WINDOW)
    node = MODEL  # the simulated model's host name
    claims = GPUS * PER_GPU
    with (
        scratch("tessera-bench-usage-") as tmp,
        ApiServer(resources=(*RESOURCES, GPU_USAGE_REPORTS)) as server,
    ):
        server.put_object("nodes", {"metadata": {"name": node}})
        for i in range(claims):
            server.put_object("resourceclaims", claim(node, i))
        state = tmp / "state"
        log = (tmp / "daemon.log").open("w")
        env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
        tessera = os.path.join(os.path.dirname(sys.executable), "tessera")
        proc = subprocess.Popen(
            [tessera, "run", "--simulate", MODEL, "--state-dir", str(state),
             "--kubeconfig", str(server.kubeconfig(tmp / "kubeconfig")),
             "--sharing", "time-slicing", "--usage-report-interval", str(interval),
             "--metrics-address", "127.0.0.1:0", "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=log, env=env,
        )  # fmt: skip
        try:
            socket = state / "kubelet" / "plugins" / DRIVER / "dra.sock"
            wait(socket.exists, "the DRA socket", proc)
            refs = [ClaimRef("default", f"c{i}", f"uid-c{i}") for i in range(claims)]
            with KubeletClient(socket) as k:  # a GPU's sharers per call: each in its deadline
                for g in range(GPUS):
                    part = refs[g * PER_GPU : (g + 1) * PER_GPU]
                    check(k.prepare(part), part)
            wait(lambda: reported(server, node) == claims, "every claim reported", proc)
            server.clear_log()
            time.sleep(window)
            records = server.requests.snapshot()
            writes = server.writes()
            by_resource: dict[str, int] = {}
            for r in records:
                if r.method in ("POST", "PUT", "PATCH", "DELETE"):
                    resource = r.resource or r.path
                    by_resource[resource] = by_resource.get(resource, 0) + 1
            reads = sum(1 for r in records if r.method == "GET")
        finally:
            terminate(proc)
            log.close()
    per_interval = writes / (window / interval)
    figures = [
        measured(
            NAME,
            f"API writes per node per minute, {claims} claims steady (per {interval:g} s"
            " report interval: per minute at the default 60 s)",
            "count",
            [per_interval],
            goal=at_most(1.0, "count"),
        ),
    ]
    rows = [
        ("node / claims", f"{MODEL} / {claims} (time-slicing, {PER_GPU} per GPU)"),
        ("report interval / steady window", f"{interval:g} s / {window:g} s"),
        ("API writes in the window, by resource", str(by_resource or "none")),
        ("API reads in the window", str(reads)),
        ("writes per report interval", f"{per_interval:.2f}"),
    ]
    report(
        NAME,
        "API writes per node in steady state (bench/usage_report.py)",
        rows,
        {
            "claims": claims,
            "interval_s": interval,
            "window_s": window,
            "writes": writes,
            "writes_by_resource": by_resource,
            "reads": reads,
            "writes_per_interval": per_interval,
        },
        figures,
    )
    return figures
