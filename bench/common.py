"""Shared helpers: timing statistics, the floor of two fsync'd writes, a standalone daemon with
claims, simulated nodes, and the detailed JSON results (``bench/results/<name>.json``)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import yaml

from agent.cli.node_access import open_node
from agent.config import Config
from agent.discovery.inventory import NodeInventory
from agent.fsutil import atomic_write
from agent.node import discover
from bench.table import Figure
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient

RESULTS = Path(__file__).resolve().parent / "results"
"""The detailed results, one JSON file per benchmark (git ignores the directory)."""
DRIVER = "gpu.tessera.dev"
FSYNC_FLOOR = (
    "two fsync'd small-file writes (file + directory) in the daemon's state directory,"
    " interleaved with the calls; the figure's percentile of them"
)


def pool_bytes(slices: Sequence[dict[str, Any]]) -> int:
    """A pool's size as compact JSON (``separators=(",", ":")``), summed over its slices: what
    a ResourceSlice weighs on the wire and, near enough, in etcd and every watcher's memory."""
    return sum(
        len(json.dumps(s, separators=(",", ":"), ensure_ascii=False).encode()) for s in slices
    )


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def stat(xs: Sequence[float]) -> dict[str, float]:
    """p50, p99 and count of seconds."""
    return {"p50_s": percentile(xs, 50), "p99_s": percentile(xs, 99), "runs": len(xs)}


def timings(fn: Callable[[], object], runs: int, warmup: int = 3) -> dict[str, float]:
    """Wall-clock seconds of ``fn`` over ``runs`` runs: p50, p99, mean, min."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return {
        "runs": runs,
        "p50_s": percentile(samples, 50),
        "p99_s": percentile(samples, 99),
        "mean_s": statistics.fmean(samples),
        "min_s": min(samples),
    }


def two_fsync_writes(directory: Path) -> Callable[[], float]:
    """The floor of a prepare: a function that writes two small files the way the checkpoint
    and the CDI spec are written (``atomic_write``: temporary file, fsync, rename, fsync of the
    directory) in ``directory`` and returns the seconds it took."""

    def once() -> float:
        t0 = time.perf_counter()
        atomic_write(directory / "floor-a.json", b'{"checkpoint": 1}' * 20)
        atomic_write(directory / "floor-b.json", b'{"cdi": 1}' * 40)
        return time.perf_counter() - t0

    return once


@contextmanager
def simulated_inventory(model: str, layout: str | None = None) -> Iterator[NodeInventory]:
    with tempfile.TemporaryDirectory(prefix="tessera-bench-") as tmp:
        src = open_node(Config.of(simulate=model, sim_mig_layout=layout), Path(tmp))
        src.nvml.init()
        try:
            yield discover(src)
        finally:
            src.nvml.shutdown()


def report(
    name: str,
    title: str,
    rows: list[tuple[str, str]],
    data: dict[str, Any],
    figures: Sequence[Figure] = (),
) -> None:
    """Write the benchmark's detail to ``bench/results/<name>.json``: its rows (what
    ``python -m bench NAME`` prints), its data and its figures."""
    RESULTS.mkdir(exist_ok=True)
    doc = {
        "title": title,
        "rows": [list(r) for r in rows],
        "figures": [f.to_json() for f in figures],
        "data": data,
    }
    (RESULTS / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")


def detail_lines(name: str) -> list[str]:
    """The rows ``report`` wrote for ``name``, as text (none when it wrote nothing)."""
    try:
        doc = json.loads((RESULTS / f"{name}.json").read_text())
    except FileNotFoundError:
        return []
    rows = [(str(k), str(v)) for k, v in doc["rows"]]
    title = str(doc["title"])
    width = max((len(k) for k, _ in rows), default=0)
    return ["", title, "-" * len(title), *(f"  {k:<{width}}  {v}" for k, v in rows)]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


# -- a standalone daemon with claims ----------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    """A claim allocated one device of the node (standalone mode reads it from a file)."""

    ref: ClaimRef
    device: str
    config: dict[str, Any] | None = None
    """Opaque parameters of the driver (a GpuConfig), from the claim."""
    memory: str | None = None
    """A memory share: the allocation's consumedCapacity.memory (and a shareID)."""

    def manifest(self, pool: str) -> dict[str, Any]:
        result: dict[str, Any] = {
            "request": "gpu",
            "driver": DRIVER,
            "pool": pool,
            "device": self.device,
        }
        if self.memory is not None:
            result["shareID"] = str(uuid.uuid4())
            result["consumedCapacity"] = {"memory": self.memory}
        config = [] if self.config is None else [
            {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": self.config}}
        ]  # fmt: skip
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": self.ref.name, "namespace": "default", "uid": self.ref.uid},
            "spec": {
                "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x"}}]}
            },
            "status": {"allocation": {"devices": {"results": [result], "config": config}}},
        }


def claim(name: str, device: str, **kwargs: Any) -> Claim:
    return Claim(ClaimRef("default", name, f"uid-{name}"), device, **kwargs)


def tessera() -> str:
    """The ``tessera`` of this virtual environment."""
    return os.path.join(os.path.dirname(sys.executable), "tessera")


def check(response: dict[str, Any], refs: Sequence[ClaimRef]) -> None:
    """Raise when a claim of a prepare or unprepare response failed."""
    errors = {r.uid: response["claims"][r.uid]["error"] for r in refs}
    if any(errors.values()):
        raise RuntimeError(f"a claim failed: {errors}")


TMPFS = Path("/dev/shm")
"""Where a benchmark daemon's CDI root goes when it is a tmpfs (see ``cdi_root``)."""


def cdi_root(state: Path) -> Path:
    """The CDI root of a benchmark daemon: on a tmpfs, as on a real node (``/var/run/cdi``, where
    ``--cdi-root`` points by default, is one; ``--simulate`` puts it under the state directory,
    on that directory's disk). A spec is written without fsync (derived state: docs/reliability.md),
    so what the disk adds is the file's creation: 0.05 to 0.4 ms on this project's machine, none
    on a tmpfs. Under the state directory when there is no tmpfs at /dev/shm."""
    try:
        on_tmpfs = any(
            line.split()[1:3] == [str(TMPFS), "tmpfs"]
            for line in Path("/proc/mounts").read_text().splitlines()
        )
    except OSError:
        on_tmpfs = False
    if not on_tmpfs:
        return state / "cdi"
    return Path(tempfile.mkdtemp(prefix=f"tessera-bench-cdi-{state.name}-", dir=TMPFS))


class Daemon:
    """``tessera run --simulate MODEL`` in standalone mode with ``claims``, as a subprocess; its
    log (warnings and up) goes to ``<state>.log`` beside the state directory; its CDI root on a
    tmpfs (``cdi_root``)."""

    def __init__(
        self,
        tmp: Path,
        model: str,
        pool: str,
        claims: Sequence[Claim],
        *extra: str,
        metrics_address: str = "127.0.0.1:0",
        started: Callable[[int], None] | None = None,
        wrap: Sequence[str] = (),
    ) -> None:
        """``started``: told the daemon's PID (a reaper must leave it to its Popen); ``wrap``:
        a command the daemon runs under (a profiler: ``py-spy record ... --``)."""
        name = Path(model).stem
        self.state = tmp / f"{name}-{len(list(tmp.iterdir()))}"
        (self.state / "resourceclaims").mkdir(parents=True)
        (self.state / "resourceclaims" / "claims.yaml").write_text(
            yaml.dump_all([c.manifest(pool) for c in claims], Dumper=yaml.CSafeDumper)
        )
        self.claims = list(claims)
        self.log: IO[str] = (self.state.parent / f"{self.state.name}.log").open("w")
        self.cdi = cdi_root(self.state)
        self.proc = subprocess.Popen(
            [*wrap, tessera(), "run", "--simulate", model, "--state-dir", str(self.state),
             "--no-kube", "--cdi-root", str(self.cdi),
             "--metrics-address", metrics_address, "--log-level", "warning", *extra],
            stdout=subprocess.DEVNULL, stderr=self.log,
        )  # fmt: skip
        if started is not None:
            started(self.proc.pid)
        self.socket = self.state / "kubelet" / "plugins" / DRIVER / "dra.sock"
        deadline = time.monotonic() + 60
        while not self.socket.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"daemon did not start; its log: {self.log.name}")
            time.sleep(0.05)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, unprepare: bool = True) -> None:
        """Unprepare every claim (unless told not to), then stop the daemon."""
        if unprepare and self.proc.poll() is None and self.socket.exists():
            with contextlib.suppress(Exception), KubeletClient(self.socket) as k:
                k.unprepare([c.ref for c in self.claims])
        if self.proc.poll() is None:
            terminate(self.proc)
        self.log.close()
        if not self.cdi.is_relative_to(self.state):
            shutil.rmtree(self.cdi, ignore_errors=True)


def terminate(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if the process has not exited within 30 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


@contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """A temporary directory under /tmp (short paths: unix sockets live in it)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
