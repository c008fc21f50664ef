"""Issue 12 end to end, in kube mode against the API-server emulator: a kubelet client holds the
health stream for the whole test while faults come from `tessera sim fault`, and each effect is
read where its user reads it — the scheduler (ResourceSlices in the API), the kubelet (the
health stream), the SRE (/metrics) and the operator (Events on the Node).

Timing is counted in the sampler's own ticks (``tessera_sampler_ticks_total``), never in
wall-clock gaps: everything an XID causes must be visible by the second tick after it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.sim.apiserver import ApiServer
from dra_driver.testkubelet.client import KubeletClient
from tests.integration.daemon import DRIVER, Daemon
from tests.k8sschema import validate as validate_k8s

MODEL = "l40s-pcie"
TICK = "1.0"
"""Long enough that polling (many times a tick) sees each effect in the tick it appears."""
TAINT = f"{DRIVER}/unhealthy"


def metrics(d: Daemon) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    return d.scrape()


def healthy(m: dict[str, dict[tuple[tuple[str, str], ...], float]], gpu: int) -> float:
    (value,) = [v for k, v in m["tessera_gpu_healthy"].items() if ("gpu", str(gpu)) in k]
    return value


def ticks(m: dict[str, dict[tuple[tuple[str, str], ...], float]]) -> int:
    (value,) = m["tessera_sampler_ticks_total"].values()
    return int(value)


class HealthStream:
    """The kubelet's health stream, held open by a thread: the latest complete device list."""

    def __init__(self, socket: Path) -> None:
        self.latest: dict[str, str] = {}
        self._client = KubeletClient(socket)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for listed in self._client.watch_health(timeout=300):
            self.latest = {x["deviceName"]: x["health"] for x in listed}
            if self._stop.is_set():
                return

    def close(self) -> None:
        self._stop.set()
        self._client.close()
        self._thread.join(10)


def slice_devices(server: ApiServer) -> dict[str, dict[str, Any]]:
    return {
        dev["name"]: dev
        for s in server.objects("resourceslices")
        for dev in s["spec"].get("devices") or []
    }


def of_gpu(names: object, minor: int) -> set[str]:
    return {n for n in names if n == f"gpu-{minor}" or n.startswith(f"gpu-{minor}-")}  # type: ignore[attr-defined]


def events(server: ApiServer, node: str, reason: str) -> list[dict[str, Any]]:
    found = [
        e
        for e in server.objects("events", "default")
        if e["involvedObject"]["name"] == node and e["reason"] == reason
    ]
    for e in found:
        for version in ("1.34.0", "1.35.0"):
            validate_k8s(e, version)
    return found


def first_ticks(
    d: Daemon, checks: dict[str, Callable[[], bool]], timeout: float = 60
) -> dict[str, int]:
    """The sampler tick at which each check first held (polled many times a tick)."""
    seen: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < len(checks):
        assert d.proc is not None and d.proc.poll() is None, f"the agent died: {d.logs[-5:]}"
        assert time.monotonic() < deadline, f"never: {sorted(set(checks) - set(seen))}"
        now = ticks(metrics(d))
        for what, check in checks.items():
            if what not in seen and check():
                seen[what] = now
        threading.Event().wait(0.05)
    return seen


def wait_ticks(d: Daemon, n: int) -> None:
    start = ticks(metrics(d))
    first_ticks(d, {f"{n} ticks": lambda: ticks(metrics(d)) >= start + n})


@pytest.fixture
def server() -> Iterator[ApiServer]:
    with ApiServer() as s:
        s.put_object("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": MODEL}})
        yield s


def test_health_and_hotplug_reach_the_scheduler_the_kubelet_metrics_and_node_events(
    server: ApiServer, short_tmp: Path
) -> None:
    d = Daemon(
        short_tmp, MODEL, "--kubeconfig", str(server.kubeconfig(short_tmp / "kubeconfig")),
        "--telemetry-interval", TICK, "--device-taints", "--rediscovery-debounce", "0.2",
    ).start()  # fmt: skip
    stream = HealthStream(d.dra_socket)
    node = d.node
    try:
        d.wait_log("published ResourceSlices")
        names = set(slice_devices(server))
        gpu0, gpu2, gpu3 = of_gpu(names, 0), of_gpu(names, 2), of_gpu(names, 3)
        assert gpu0 and gpu2 and gpu3
        first_ticks(d, {"stream": lambda: set(stream.latest) == names})
        writes = server.writes("resourceslices")

        # an application XID: counted, nothing else
        d.fault("xid", "--gpu", "1", "--xid", "13")
        wait_ticks(d, 3)
        assert server.writes("resourceslices") == writes
        assert not any("taints" in x for x in slice_devices(server).values())
        assert set(stream.latest.values()) == {"HEALTHY"}
        assert healthy(metrics(d), 1) == 1 and events(server, node, "GpuUnhealthy") == []

        # XID 79: everything within 2 ticks
        start = ticks(metrics(d))
        d.fault("xid", "--gpu", "0", "--xid", "79")
        seen = first_ticks(
            d,
            {
                "tainted": lambda: all(
                    [(t["key"], t["value"]) for t in slice_devices(server)[n].get("taints", [])]
                    == [(TAINT, "xid-79")]
                    for n in gpu0
                ),
                "stream": lambda: {n for n, h in stream.latest.items() if h == "UNHEALTHY"} == gpu0,
                "metric": lambda: healthy(metrics(d), 0) == 0,
                "event": lambda: len(events(server, node, "GpuUnhealthy")) == 1,
            },
        )
        assert max(seen.values()) <= start + 2, (start, seen)
        (warning,) = events(server, node, "GpuUnhealthy")
        assert warning["type"] == "Warning" and "GPU 0 (GPU-" in warning["message"]
        assert "xid-79" in warning["message"]
        untainted = {n for n, x in slice_devices(server).items() if "taints" not in x}
        assert untainted == names - gpu0

        d.fault("recover", "--gpu", "0")
        first_ticks(
            d,
            {
                "untainted": lambda: not any("taints" in x for x in slice_devices(server).values()),
                "stream": lambda: set(stream.latest.values()) == {"HEALTHY"},
                "metric": lambda: healthy(metrics(d), 0) == 1,
                "event": lambda: len(events(server, node, "GpuHealthy")) == 1,
            },
        )

        # a fatal XID on a GPU that still answers: sticky until a re-bind is observed
        d.fault("xid", "--gpu", "2", "--xid", "48")
        first_ticks(d, {"tainted": lambda: "taints" in slice_devices(server)[min(gpu2)]})
        d.fault("recover", "--gpu", "2")  # it was never lost: nothing to observe
        wait_ticks(d, 4)
        assert "taints" in slice_devices(server)[min(gpu2)] and healthy(metrics(d), 2) == 0
        d.fault("rebind", "--gpu", "2")
        first_ticks(
            d,
            {
                "untainted": lambda: "taints" not in slice_devices(server)[min(gpu2)],
                "metric": lambda: healthy(metrics(d), 2) == 1,
            },
        )

        # a GPU leaves and comes back: the slices follow, the Node hears of both
        d.fault("remove-gpu", "--gpu", "3")
        first_ticks(
            d,
            {
                "withdrawn": lambda: set(slice_devices(server)) == names - gpu3,
                "event": lambda: len(events(server, node, "GpuRemoved")) == 1,
            },
        )
        (removed,) = events(server, node, "GpuRemoved")
        assert removed["type"] == "Warning" and "GPU 3 (GPU-" in removed["message"]
        d.fault("add-gpu", "--gpu", "3")
        first_ticks(
            d,
            {
                "back": lambda: set(slice_devices(server)) == names,
                "event": lambda: len(events(server, node, "GpuAdded")) == 1,
                "stream": lambda: stream.latest.get(min(gpu3)) == "HEALTHY",
            },
        )
        changed = sorted(e["message"] for e in events(server, node, "DevicesChanged"))
        assert len(changed) == 2 and all(min(gpu3) in m for m in changed)
        assert "added" in changed[0] and "removed" in changed[1]
        assert server.rejected == []
        assert d.stop() == 0
    finally:
        stream.close()
        d.kill()
