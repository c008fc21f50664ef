"""Memory soak: a ``tessera run --simulate dgx-a100 --sim-mig-layout all-1g`` (56 MIG devices)
with 64 claims, through 10,000 prepare + unprepare cycles over the kubelet socket while
``/metrics`` is scraped and telemetry gRPC clients watch, reconnect and take snapshots; the
daemon's RSS, open file descriptors and threads sampled throughout (psutil, its PID).

The 64 claims: the node has 56 MIG devices, each held by one claim at a time, so 48 claims stay
prepared for the whole run (six MIG devices of every GPU) and 16 take turns on the other 8 (two
claims per device; 8 threads, one per device, each preparing and unpreparing its two claims in
turn). All 56 devices are held at times, and /metrics carries up to 64 claims' series (released
claims are still reported for a while).

Phases: a warm-up under twice the load (twice the clients, and as many threads again making
idempotent kubelet calls beside the cyclers), for a tenth as many cycles, at least one resync of
the ResourceSlices (``--resync-interval 10``) and until the thread count is stable (see
``warm_up``); then the clients stop and the daemon is left idle for ``QUIET_S``: the *start*
figures (RSS, fds, threads). Then the 10,000 cycles under the measured load (2 scrapers, 4
watchers, 1 Snapshot poller), and idle again: the *end* figures. Goals: steady RSS <= 80 MiB (the
most seen after the warm-up; issue 15), growth < 1 MiB (end - start; issue 25, was 2 MiB), open
fds and threads flat (end = start)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import psutil

from agent.telemetry.api import telemetry_pb2 as pb
from agent.telemetry.api import telemetry_pb2_grpc as pb_grpc
from agent.telemetry.top import target
from bench.common import Claim, Daemon, check, claim, report, scratch
from bench.table import Figure, at_most, below, equal_to, measured
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient

NAME = "rss"
MIB = 1024 * 1024
GPUS = 8
QUIET_S = 3.0
SAMPLE_S = 0.5
SCRAPERS = 2
SCRAPE_PAUSE_S = 0.1
WATCHERS = 4
SAMPLES_PER_WATCH = 3
SNAPSHOT_PAUSE_S = 0.2
IDEMPOTENT_PAUSE_S = 0.005


@dataclass(frozen=True)
class Plan:
    cycles: int
    """Measured cycles, after the warm-up."""
    chunk: int
    """Warm-up cycles between two looks at the thread count."""
    resync_s: float
    """The slices' resync runs this often (default 600 s): a full re-read, so the soak sees many
    and the warm-up at least one (the first is a one-off step of the heap)."""


FULL = Plan(10_000, 250, 10.0)
QUICK = Plan(500, 100, 4.0)
STABLE_CHUNKS = 3
"""The warm-up ends once the thread count has not changed over this many chunks."""


def device(gpu: int, start: int) -> str:
    return f"gpu-{gpu}-mig-1g5gb-19-{start}"


def claims() -> tuple[list[Claim], list[tuple[Claim, Claim]]]:
    """48 claims held throughout, and two claims for each of the 8 devices that take turns."""
    held = [claim(f"h{g}-{s}", device(g, s)) for g in range(GPUS) for s in range(6)]
    turns = [(claim(f"t{g}-a", device(g, 6)), claim(f"t{g}-b", device(g, 6))) for g in range(GPUS)]
    return held, turns


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Sample:
    elapsed: float
    cycles: int
    rss: int
    fds: int
    threads: int


@dataclass
class Soak:
    """The running soak's counters and samples, shared by its threads."""

    ps: Any
    t0: float = field(default_factory=time.monotonic)
    cycles: int = 0
    scrapes: int = 0
    watches: int = 0
    samples_watched: int = 0
    snapshots: int = 0
    samples: list[Sample] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def sample(self) -> Sample:
        s = Sample(
            time.monotonic() - self.t0,
            self.cycles,
            self.ps.memory_info().rss,
            self.ps.num_fds(),
            self.ps.num_threads(),
        )
        with self.lock:
            self.samples.append(s)
        return s

    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            setattr(self, what, getattr(self, what) + n)


def cycler(soak: Soak, k: KubeletClient, pair: tuple[Claim, Claim], cycles: int) -> None:
    for i in range(cycles):
        ref = pair[i % 2].ref
        check(k.prepare([ref]), [ref])
        check(k.unprepare([ref]), [ref])
        soak.count("cycles")


def cycle(soak: Soak, k: KubeletClient, turns: list[tuple[Claim, Claim]], cycles: int) -> None:
    """``cycles`` prepare + unprepare cycles, spread over one thread per device."""
    share = [cycles // len(turns) + (i < cycles % len(turns)) for i in range(len(turns))]
    errors: list[BaseException] = []

    def one(pair: tuple[Claim, Claim], n: int) -> None:
        try:
            cycler(soak, k, pair, n)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=one, args=(p, n), name=f"cycler-{i}")
        for i, (p, n) in enumerate(zip(turns, share, strict=True))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def telemetry_client(target: str) -> tuple[grpc.Channel, Any]:
    """A channel of its own (its own connection, as separate client processes have; channels
    of one process otherwise share one, and its per-connection stream limit) and its stub."""
    channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
    return channel, pb_grpc.TelemetryStub(channel)  # type: ignore[no-untyped-call]


@dataclass(frozen=True)
class Load:
    """Who calls the daemon besides the cyclers; ``extra``: idempotent kubelet calls."""

    metrics: str
    telemetry: str
    times: int = 1
    """Scrapers, watchers and Snapshot pollers are ``times`` as many."""
    extra: tuple[tuple[KubeletClient, ClaimRef, ClaimRef], ...] = ()
    """Threads that prepare a claim already prepared and unprepare one never prepared, in a
    loop: the same pools as the cyclers' calls, changing nothing."""


@contextlib.contextmanager
def load(soak: Soak, spec: Load) -> Iterator[None]:
    """Scrapers of /metrics, Watch clients that reconnect after a few samples, a Snapshot poller,
    the ``extra`` callers and the RSS sampler, until the block ends."""
    metrics, telemetry = spec.metrics, spec.telemetry
    stop = threading.Event()
    errors: list[BaseException] = []

    def guarded(fn: Any) -> Any:
        def body() -> None:
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)
                stop.set()

        return body

    def scrape() -> None:
        while not stop.is_set():
            with urllib.request.urlopen(metrics, timeout=30) as r:
                r.read()
            soak.count("scrapes")
            stop.wait(SCRAPE_PAUSE_S)

    def watch() -> None:
        while not stop.is_set():
            channel, stub = telemetry_client(telemetry)
            call = stub.Watch(pb.WatchRequest(interval_seconds=0))
            try:
                taken = 0
                for _ in call:
                    taken += 1
                    if taken >= SAMPLES_PER_WATCH or stop.is_set():
                        break
            finally:
                call.cancel()
                channel.close()
            soak.count("watches")
            soak.count("samples_watched", taken)

    def snapshots() -> None:
        channel, stub = telemetry_client(telemetry)
        try:
            while not stop.is_set():
                stub.Snapshot(pb.SnapshotRequest(), timeout=30)
                soak.count("snapshots")
                stop.wait(SNAPSHOT_PAUSE_S)
        finally:
            channel.close()

    def sampler() -> None:
        while not stop.wait(SAMPLE_S):
            soak.sample()

    def idempotent(k: KubeletClient, held: ClaimRef, ghost: ClaimRef) -> Callable[[], None]:
        def calls() -> None:
            while not stop.is_set():
                check(k.prepare([held]), [held])
                check(k.unprepare([ghost]), [ghost])
                stop.wait(IDEMPOTENT_PAUSE_S)

        return calls

    workers = [
        *[scrape] * (SCRAPERS * spec.times),
        *[watch] * (WATCHERS * spec.times),
        *[snapshots] * spec.times,
        *(idempotent(*e) for e in spec.extra),
        sampler,
    ]
    threads = [threading.Thread(target=guarded(w), name=w.__name__) for w in workers]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    if errors:
        raise errors[0]


def warm_up(soak: Soak, k: KubeletClient, turns: list[tuple[Claim, Claim]], plan: Plan) -> None:
    """A tenth as many cycles as will be measured, at least one resync of the slices, and then
    chunks until the daemon's thread count has stayed the same for ``STABLE_CHUNKS`` chunks (at
    most half as many cycles as measured). The warm-up's load is twice the measured one (see
    ``_soak``): the daemon's thread pools (gRPC servers, prepare and unprepare workers) grow
    lazily, up to their bounds, to the most concurrent calls they have seen, which is not a leak;
    after the warm-up they hold what the measured load can need."""
    cycle(soak, k, turns, max(plan.cycles // 10, len(turns)))
    counts = [soak.ps.num_threads()]
    while soak.cycles < plan.cycles // 2 and (
        time.monotonic() - soak.t0 < plan.resync_s * 1.5
        or len(counts) <= STABLE_CHUNKS
        or len(set(counts[-STABLE_CHUNKS - 1 :])) > 1
    ):
        cycle(soak, k, turns, plan.chunk)
        counts.append(soak.ps.num_threads())


def rss_at(samples: list[Sample], cycles: int) -> int:
    """The RSS sampled nearest to ``cycles`` cycles."""
    return min(samples, key=lambda s: abs(s.cycles - cycles)).rss


def quiet(soak: Soak) -> Sample:
    """The daemon after ``QUIET_S`` without clients (connections closed, threads idle)."""
    time.sleep(QUIET_S)
    return soak.sample()


def run(quick: bool) -> list[Figure]:
    plan = QUICK if quick else FULL
    held, turns = claims()
    port = free_port()
    with scratch("tr-") as tmp:
        daemon = Daemon(
            tmp, "dgx-a100", "dgx-a100", [*held, *(c for p in turns for c in p)],
            "--sim-mig-layout", "all-1g", "--resync-interval", str(plan.resync_s),
            metrics_address=f"127.0.0.1:{port}",
        )  # fmt: skip
        try:
            return _soak(daemon, held, turns, plan, port)
        finally:
            daemon.stop()


def _soak(
    daemon: Daemon, held: list[Claim], turns: list[tuple[Claim, Claim]], plan: Plan, port: int
) -> list[Figure]:
    soak = Soak(psutil.Process(daemon.pid))
    metrics = f"http://127.0.0.1:{port}/metrics"
    telemetry = target(None, daemon.state)
    refs = [c.ref for c in held]
    with KubeletClient(daemon.socket) as k:
        check(k.prepare(refs), refs)
        first = soak.sample()
        ghosts = [ClaimRef("default", f"ghost-{i}", f"uid-ghost-{i}") for i in range(len(turns))]
        double = Load(
            metrics,
            telemetry,
            times=2,
            extra=tuple((k, h.ref, g) for h, g in zip(held, ghosts, strict=False)),
        )
        with load(soak, double):
            warm_up(soak, k, turns, plan)
        start = quiet(soak)
        warm_cycles = soak.cycles
        with load(soak, Load(metrics, telemetry)):
            cycle(soak, k, turns, plan.cycles)
        end = quiet(soak)
        check(k.unprepare(refs), refs)
    cpu = soak.ps.cpu_times()
    measured_samples = [s for s in soak.samples if s.cycles >= warm_cycles]
    steady = max(s.rss for s in measured_samples)
    span = end.elapsed - start.elapsed
    figures = [
        measured(NAME, "steady RSS, dgx-a100, 56 MIG devices, 64 claims (the most after the"
                 " warm-up)", "MiB", [steady / MIB], goal=at_most(80, "MiB")),
        measured(NAME, f"RSS growth over {soak.cycles - warm_cycles:,} prepare/unprepare cycles",
                 "MiB", [(end.rss - start.rss) / MIB], goal=below(1, "MiB")),
        measured(NAME, "open fds, end - start (idle, after the cycles)", "count",
                 [end.fds - start.fds], goal=equal_to(0)),
        measured(NAME, "threads, end - start (idle, after the cycles)", "count",
                 [end.threads - start.threads], goal=equal_to(0)),
    ]  # fmt: skip
    rows = [
        ("cycles (prepare + unprepare of one claim), 8 threads", f"{soak.cycles:,}"
         f" ({warm_cycles:,} of them warm-up), {span:.0f} s after the warm-up,"
         f" {(soak.cycles - warm_cycles) / span:.0f} cycles/s"),
        ("load alongside", f"{soak.scrapes:,} /metrics scrapes, {soak.watches:,} Watch streams"
         f" ({soak.samples_watched:,} samples), {soak.snapshots:,} Snapshots"),
        ("RSS: claims prepared / start / end / most after warm-up",
         f"{first.rss / MIB:.1f} / {start.rss / MIB:.1f} / {end.rss / MIB:.1f} /"
         f" {steady / MIB:.1f} MiB"),
        ("RSS through the measured cycles, every fifth (under load)",
         " / ".join(f"{rss_at(measured_samples, warm_cycles + plan.cycles * k // 5) / MIB:.1f}"
                    for k in range(1, 6)) + " MiB"),
        ("open fds: start / end", f"{start.fds} / {end.fds}"),
        ("threads: start / end", f"{start.threads} / {end.threads}"),
        ("daemon CPU over the run", f"{cpu.user + cpu.system:.0f} s"),
    ]  # fmt: skip
    report(
        NAME,
        "Daemon memory, descriptors and threads under churn (bench/rss.py)",
        rows,
        {
            "cycles": soak.cycles,
            "warmup_cycles": warm_cycles,
            "scrapes": soak.scrapes,
            "watch_streams": soak.watches,
            "samples_watched": soak.samples_watched,
            "snapshots": soak.snapshots,
            "first": first.__dict__,
            "start": start.__dict__,
            "end": end.__dict__,
            "cpu_seconds": cpu.user + cpu.system,
            "samples": [s.__dict__ for s in soak.samples],
        },
        figures,
    )
    return figures
