"""One node's API writes, counted at the API-server emulator over real HTTP from a real
``tessera run --simulate dgx-a100 --mig-mode dynamic`` in kube mode: at its first start, in a
steady window, at a clean stop and at a restart with the same devices
(``bench/scale_model.py`` multiplies them by 10,000 nodes).

The report interval is shortened (``--usage-report-interval``) so the window holds several
reports: the figure is every write of the window per report written in it (one report an
interval), which at the default interval of 60 s is the writes per minute. Everything else runs
at its defaults."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.sim.apiserver import ApiServer, RequestRecord
from agent.sim.apiserver_types import RESOURCES
from bench.common import scratch, terminate
from bench.usage_report import GPU_USAGE_REPORTS

MODEL = "dgx-a100"
WRITE_METHODS = ("POST", "PUT", "PATCH", "DELETE")


@dataclass(frozen=True)
class DaemonWrites:
    """Writes by resource in each phase of the run."""

    start: dict[str, int]
    steady: dict[str, int]
    stop: dict[str, int]
    restart: dict[str, int]
    interval_s: float
    window_s: float

    def steady_per_interval(self) -> float:
        """Every write of the steady window per report written in it: what one report interval
        costs (= per minute at the default 60 s). Counting per report rather than per window
        length keeps the interval's drift under load (each starts after the last report's
        requests) out of the figure."""
        reports = self.steady.get("PUT gpuusagereports", 0)
        return sum(self.steady.values()) / reports if reports else float("inf")


def writes_by_resource(records: list[RequestRecord]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        if r.method in WRITE_METHODS:
            key = f"{r.method} {r.resource or r.path}"
            out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def _wait(cond: Callable[[], bool], what: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while not cond():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"never: {what} (the daemon's log is beside its state directory)")
        time.sleep(0.05)


def _lists(server: ApiServer) -> int:
    """Lists of ResourceSlices (not watches) the server answered: a publisher's round."""
    return sum(
        1
        for r in server.requests.snapshot()
        if r.method == "GET" and r.resource == "resourceslices" and not r.watch
    )


def _published(server: ApiServer) -> bool:
    """Every slice of the pool is stored (as many as their ``resourceSliceCount``)."""
    stored = server.objects("resourceslices")
    return bool(stored) and len(stored) == stored[0]["spec"]["pool"]["resourceSliceCount"]


class _Agent:
    def __init__(self, tmp: Path, server: ApiServer, interval: float, n: int) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
        tessera = os.path.join(os.path.dirname(sys.executable), "tessera")
        self.state = tmp / "state"
        self.log = (tmp / f"daemon-{n}.log").open("w")
        self.proc = subprocess.Popen(
            [tessera, "run", "--simulate", MODEL, "--mig-mode", "dynamic",
             "--state-dir", str(self.state),
             "--kubeconfig", str(server.kubeconfig(tmp / "kubeconfig")),
             "--usage-report-interval", str(interval),
             "--metrics-address", "127.0.0.1:0", "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=self.log, env=env,
        )  # fmt: skip

    def stop(self) -> None:
        terminate(self.proc)
        self.log.close()


def measure(interval: float, window: float) -> DaemonWrites:
    node = MODEL  # the simulated model's host name
    with (
        scratch("tessera-bench-scale-") as tmp,
        ApiServer(resources=(*RESOURCES, GPU_USAGE_REPORTS)) as server,
    ):
        server.put_object("nodes", {"metadata": {"name": node}})
        agent = _Agent(tmp, server, interval, 0)
        try:
            _wait(lambda: _published(server), "every slice of the pool", agent.proc)
            _wait(lambda: server.get_object("gpuusagereports", node) is not None,
                  "the first usage report", agent.proc)  # fmt: skip
            start = writes_by_resource(server.requests.snapshot())
            server.clear_log()
            time.sleep(window)
            steady = writes_by_resource(server.requests.snapshot())
            server.clear_log()
        finally:
            agent.stop()
        stop = writes_by_resource(server.requests.snapshot())
        server.clear_log()
        agent = _Agent(tmp, server, interval, 1)
        try:
            _wait(lambda: _lists(server) > 0, "the restarted publisher's first round", agent.proc)
            time.sleep(min(interval, 2.0) / 2)  # its round's writes, if any, land by then
            restart = {
                k: v
                for k, v in writes_by_resource(server.requests.snapshot()).items()
                if "gpuusagereports" not in k  # the periodic report: in the steady figure
            }
        finally:
            agent.stop()
    return DaemonWrites(start, steady, stop, restart, interval, window)
