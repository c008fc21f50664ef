"""Telemetry costs.

- /metrics render time on dgx-a100 with 56 MIG devices (all-1g) and 64 claim series (56 held +
  8 recently released, still reported), p50/p99 serially and with 20 concurrent scrapers, next
  to the floor: the same bytes served as a static response by the same HTTP server.
- Sampler CPU per tick, excluding the simulator's own CPU time (measured inside every NVML call
  and subtracted), as a fraction of one core at the default 1 s interval.
- The usage accounting's cost: the sampler's CPU per tick with the ledger fed and without, tick
  by tick in turns in one process, on fake clocks that advance one default interval (1 s) per
  tick, so that each side's writes come at a daemon's rate (the ledger every 15 s, the energy
  state every 15 s) although the ticks run back to back; and the RSS of a process that ticks
  the sampler with the ledger and of one without, in turns (``bench/sampler_memory.py``, which
  says why processes), with the bytes the accounting holds (tracemalloc) beside them.
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from agent.cli.node_access import open_node
from agent.config import Config
from agent.http import HttpEndpoint, Readiness
from agent.node import discover
from agent.nvml.facade import Nvml
from agent.nvml.telemetry import TelemetryReader
from agent.telemetry.agent_metrics import DriverMetrics
from agent.telemetry.energy import EnergyAccounting
from agent.telemetry.gpuinfo import gpu_info
from agent.telemetry.metrics import Exposition, SnapshotCollector
from agent.telemetry.sampler import Sampler
from agent.telemetry.usage_meter import UsageMeter
from bench.common import ms, percentile, report
from bench.table import Figure, measured, ratio_at_most
from dra_driver.kubeletplugin.checkpoint import PREPARE_COMPLETED, ClaimEntry, PreparedDevice

NAME = "telemetry"
REPEATS, SERIAL, WORKERS, PER_WORKER, TICKS = 3, 300, 20, 30, 100
QUICK_REPEATS, QUICK_SERIAL, QUICK_PER_WORKER, QUICK_TICKS = 2, 100, 10, 30
USAGE_START = 1_796_000_000.0 - 1_796_000_000.0 % 900 + 900 - 60
"""The fake wall clock's start for the accounting's cost: a minute before a quarter hour, so the
ticks cross a bucket boundary as a daemon's do every 900 ticks."""
USAGE_TICKS = 150
"""Ticks per round of the accounting's cost: a multiple of the ledger's and the energy
state's 15 s between writes (and of 5), so every round holds as many writes of each."""
MEMORY_TICKS, QUICK_MEMORY_TICKS = 120, 60
"""Ticks of bench/sampler_memory.py: an hour of the ledger's buckets (half one when quick)."""
STATIC_FLOOR = "the same bytes served as a static response by the same HTTP server, in turn"
LOG = logging.getLogger("bench.telemetry")
LOG.addHandler(logging.NullHandler())
LOG.propagate = False


class TimedNvml:
    """The simulator, with the thread CPU time spent inside its nvml* calls added up."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.cpu = 0.0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not (name.startswith("nvml") and callable(attr)):
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return attr(*args, **kwargs)
            finally:
                self.cpu += time.thread_time() - t0

        return timed


def checkpoint(inv: Any, mig: bool) -> tuple[ClaimEntry, ...]:
    """The prepared claims the driver's view would hand telemetry: one per GPU or MIG device."""
    claims: dict[str, ClaimEntry] = {}
    for g in inv.gpus:
        d = g.device
        units = d.mig_instances if mig else (None,)
        for m in units:
            i = len(claims)
            name = f"gpu-{d.minor}"
            if m:
                profile = m.profile_name.replace(".", "")
                name += f"-mig-{profile}-{m.profile_id}-{m.placement.start}"
            dev = PreparedDevice(
                request_names=("gpu",), pool=inv.hostname, device=name, cdi_device_ids=(),
                kind="mig" if m else "gpu", gpu_uuid=d.uuid, gpu_minor=d.minor,
                mig_uuid=m.uuid if m else None,
                gpu_instance_id=m.gpu_instance_id if m else None,
                compute_instance_id=m.compute_instance_id if m else None,
            )  # fmt: skip
            uid = f"uid-{'m' if mig else 'g'}{i:03d}"
            claims[uid] = ClaimEntry(
                uid, "team", f"job-{uid}", PREPARE_COMPLETED, (dev,), time.time()
            )
    return tuple(claims.values())


def get(url: str) -> float:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as r:
        r.read()
    return time.perf_counter() - t0


def scrape_stats(url: str, serial: int, workers: int, per_worker: int) -> dict[str, float]:
    for _ in range(5):
        get(url)
    one = [get(url) for _ in range(serial)]
    many: list[float] = []
    lock = threading.Lock()

    def worker() -> None:
        mine = [get(url) for _ in range(per_worker)]
        with lock:
            many.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {
        "serial_p50_s": percentile(one, 50),
        "serial_p99_s": percentile(one, 99),
        "concurrent_p50_s": percentile(many, 50),
        "concurrent_p99_s": percentile(many, 99),
    }


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each statistic's median over the repeats."""
    return {k: statistics.median(x[k] for x in runs) for k in runs[0]}


def serve(body: Callable[[], tuple[bytes, str]]) -> HttpEndpoint:
    ep = HttpEndpoint("127.0.0.1", 0, Readiness(), metrics=body)
    ep.start()
    return ep


def run(quick: bool) -> list[Figure]:
    with tempfile.TemporaryDirectory(prefix="tt-", dir="/tmp") as tmp:
        return _run(Path(tmp), quick)


class FakeClock:
    """A monotonic and a wall clock that move only when told (:meth:`step`): ticks run back to
    back while every clock-driven write (the energy state's, the ledger's) comes as often per
    tick as in a daemon ticking once a second."""

    def __init__(self, wall: float) -> None:
        self.t = 0.0
        self._offset = wall

    def mono(self) -> float:
        return self.t

    def wall(self) -> float:
        return self._offset + self.t

    def step(self, seconds: float = 1.0) -> None:
        self.t += seconds


def _sampler(
    src: Any,
    nvml: Nvml,
    inv: Any,
    state: Path,
    holders: Callable[[], Any],
    usage: UsageMeter | None = None,
    clock: FakeClock | None = None,
) -> Sampler:
    mono, wall = (time.monotonic, time.time) if clock is None else (clock.mono, clock.wall)
    return Sampler(
        node=inv.hostname,
        read=TelemetryReader(nvml).read,
        gpus=[gpu_info(g.device) for g in inv.gpus],
        holders=holders,
        accounting=EnergyAccounting(state / "energy.json", wall, log=LOG),
        log=LOG,
        usage=usage,
        clock=mono,
        wall=wall,
    )


def _tick_cpu(
    smp: Sampler, timed: TimedNvml, ticks: int, clock: FakeClock | None = None
) -> list[float]:
    """The sampler's CPU time of each of ``ticks`` ticks, the simulator's own excluded (with
    ``clock``: one second of it before each tick)."""
    out = []
    for _ in range(ticks):
        if clock is not None:
            clock.step()
        before_sim, t0 = timed.cpu, time.thread_time()
        smp.tick()
        out.append(time.thread_time() - t0 - (timed.cpu - before_sim))
    return out


def _usage_cost(tmp: Path, rounds: int, ticks: int) -> tuple[list[float], list[float]]:
    """Sampler CPU per tick on dgx-a100 all-1g with its 56 MIG devices held by claims, with the
    usage ledger fed (and written) every tick and without, in turns (the simulator's CPU
    excluded in both): (with, without), one value per round."""
    state = tmp / "usage-a100"
    src = open_node(Config.of(simulate="dgx-a100", sim_mig_layout="all-1g"), state)
    timed = TimedNvml(src.sim)
    nvml = Nvml(timed)
    nvml.init()
    inv = discover(type(src)(**{**src.__dict__, "nvml": nvml}))
    held = checkpoint(inv, mig=True)
    clocks = {"on": FakeClock(USAGE_START), "off": FakeClock(USAGE_START)}
    meter = UsageMeter(state / "usage.json", "bench-boot", LOG, wall=clocks["on"].wall)
    samplers = {
        "on": _sampler(src, nvml, inv, state, lambda: held, meter, clocks["on"]),
        "off": _sampler(src, nvml, inv, state / "off", lambda: held, None, clocks["off"]),
    }
    out: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for name, smp in samplers.items():
            _tick_cpu(smp, timed, 3, clocks[name])
        for _ in range(rounds):
            # tick by tick in turns (the order swapped every tick), so a pause of the machine
            # weighs on both sides alike
            spent: dict[str, float] = {"on": 0.0, "off": 0.0}
            for i in range(ticks):
                for name in ("on", "off") if i % 2 else ("off", "on"):
                    spent[name] += _tick_cpu(samplers[name], timed, 1, clocks[name])[0]
            for name, total in spent.items():
                out[name].append(total / ticks)
    finally:
        nvml.shutdown()
    return out["on"], out["off"]


def _memory(side: str, ticks: int, traced: bool = False) -> dict[str, float]:
    """One run of bench/sampler_memory.py (its own process: see there why)."""
    argv = [sys.executable, "-m", "bench.sampler_memory", side, str(ticks)]
    done = subprocess.run(
        [*argv, "--traced"] if traced else argv, check=True, capture_output=True, text=True
    )
    out: dict[str, float] = json.loads(done.stdout)
    return out


def _memory_cost(rounds: int, ticks: int) -> dict[str, list[dict[str, float]]]:
    """RSS with the usage ledger and without, in turns, ``rounds`` times; then one traced run
    of each (``traced_on``, ``traced_off``)."""
    out: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    for _ in range(rounds):
        for side in ("on", "off"):
            out[side].append(_memory(side, ticks))
    out["traced_on"] = [_memory("on", ticks, traced=True)]
    out["traced_off"] = [_memory("off", ticks, traced=True)]
    return out


def _run(tmp: Path, quick: bool) -> list[Figure]:
    repeats, serial, per_worker, ticks = (
        (QUICK_REPEATS, QUICK_SERIAL, QUICK_PER_WORKER, QUICK_TICKS)
        if quick
        else (REPEATS, SERIAL, PER_WORKER, TICKS)
    )
    # -- /metrics render ----------------------------------------------------------------------
    src = open_node(Config.of(simulate="dgx-a100", sim_mig_layout="all-1g"), tmp / "a100")
    src.nvml.init()
    inv = discover(src)
    whole, migs = checkpoint(inv, mig=False), checkpoint(inv, mig=True)
    current = {"cp": whole}
    sampler = _sampler(src, src.nvml, inv, tmp / "a100", lambda: current["cp"])
    sampler.tick()
    current["cp"] = migs  # the 8 whole-GPU claims are released and kept for retention
    for _ in range(3):
        sampler.tick()
    snap = sampler.latest
    assert snap is not None
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(lambda: sampler.latest))
    DriverMetrics(registry).observe("prepare", 0.003, None)
    rendered = serve(lambda: (generate_latest(registry), CONTENT_TYPE_LATEST))
    live = serve(Exposition(registry, lambda: sampler.latest.tick if sampler.latest else None))
    body = generate_latest(registry)
    static = serve(lambda: (body, CONTENT_TYPE_LATEST))
    try:
        url = "http://{}:{}/metrics"
        runs: dict[str, list[dict[str, float]]] = {"rendered": [], "live": [], "static": []}
        for _ in range(repeats):  # in turn, so load from elsewhere weighs on all three
            for name, ep in (("rendered", rendered), ("live", live), ("static", static)):
                runs[name].append(
                    scrape_stats(url.format(*ep.address), serial, WORKERS, per_worker)
                )
        r, m, f = (medians(runs[name]) for name in ("rendered", "live", "static"))
    finally:
        rendered.stop()
        live.stop()
        static.stop()
        src.nvml.shutdown()
    series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))

    # -- sampler CPU per tick -----------------------------------------------------------------
    cpu: dict[str, dict[str, float]] = {}
    for model, layout in (("dgx-h100", None), ("dgx-a100", "all-1g")):
        state = tmp / f"cpu-{model}"
        s2 = open_node(Config.of(simulate=model, sim_mig_layout=layout), state)
        timed = TimedNvml(s2.sim)
        nvml = Nvml(timed)
        nvml.init()
        inv2 = discover(type(s2)(**{**s2.__dict__, "nvml": nvml}))
        smp = _sampler(s2, nvml, inv2, state, lambda: None)
        for _ in range(5):
            smp.tick()
        timed.cpu = 0.0
        per_tick = _tick_cpu(smp, timed, ticks)
        nvml.shutdown()
        cpu[model] = {
            "tick_cpu_total_s": statistics.fmean(per_tick) + timed.cpu / ticks,
            "simulator_cpu_s": timed.cpu / ticks,
            "sampler_cpu_s": statistics.fmean(per_tick),
            "sampler_cpu_p99_s": percentile(per_tick, 99),
            "fraction_of_core_at_1s": statistics.fmean(per_tick) / 1.0,
        }

    on, off = _usage_cost(tmp, 2 * repeats + 1, USAGE_TICKS)
    memory_ticks = QUICK_MEMORY_TICKS if quick else MEMORY_TICKS
    memory = _memory_cost(repeats + 1, memory_ticks)
    accounting_kib = (
        memory["traced_on"][0]["traced_bytes"] - memory["traced_off"][0]["traced_bytes"]
    ) / 1024

    figures = [
        measured(NAME, f"/metrics p50, one scraper (dgx-a100 all-1g, {series} series)", "ms",
                 [1000 * x["serial_p50_s"] for x in runs["live"]],
                 [1000 * x["serial_p50_s"] for x in runs["static"]], floor_how=STATIC_FLOOR),
        measured(NAME, f"/metrics p50, {WORKERS} concurrent scrapers", "ms",
                 [1000 * x["concurrent_p50_s"] for x in runs["live"]],
                 [1000 * x["concurrent_p50_s"] for x in runs["static"]],
                 floor_how=STATIC_FLOOR),
    ]  # fmt: skip
    for model, c in cpu.items():
        figures.append(
            measured(NAME, f"sampler CPU per tick, {model} (the simulator's excluded)", "ms",
                     [1000 * c["sampler_cpu_s"]])
        )  # fmt: skip
    figures.append(
        measured(NAME, "sampler CPU per tick with usage accounting, dgx-a100 all-1g, 56 claims",
                 "ms", [1000 * x for x in on], [1000 * x for x in off],
                 floor_how="the same sampler without the usage ledger, in turns",
                 goal=ratio_at_most(1.10))
    )  # fmt: skip
    figures.append(
        measured(NAME, f"sampler process RSS with usage accounting, 56 claims,"
                 f" {memory_ticks // 2} min of buckets", "MiB",
                 [x["rss_after_bytes"] / 2**20 for x in memory["on"]],
                 [x["rss_after_bytes"] / 2**20 for x in memory["off"]],
                 floor_how="the same process without the usage ledger, in turns",
                 goal=ratio_at_most(1.10),
                 note=f"the accounting holds {accounting_kib:.0f} KiB (tracemalloc)")
    )  # fmt: skip
    rows = [
        ("dgx-a100 all-1g: series / bytes", f"{series} / {len(body)}"),
        ("render every scrape: serial p50 / p99",
         f"{ms(r['serial_p50_s'])} / {ms(r['serial_p99_s'])}"),
        ("render every scrape: 20 concurrent p50 / p99",
         f"{ms(r['concurrent_p50_s'])} / {ms(r['concurrent_p99_s'])}"),
        ("/metrics serial p50 / p99", f"{ms(m['serial_p50_s'])} / {ms(m['serial_p99_s'])}"),
        ("floor (same bytes, static) serial p50 / p99",
         f"{ms(f['serial_p50_s'])} / {ms(f['serial_p99_s'])}"),
        ("/metrics, 20 concurrent scrapers p50 / p99",
         f"{ms(m['concurrent_p50_s'])} / {ms(m['concurrent_p99_s'])}"),
        ("floor, 20 concurrent scrapers p50 / p99",
         f"{ms(f['concurrent_p50_s'])} / {ms(f['concurrent_p99_s'])}"),
    ]  # fmt: skip
    for model, c in cpu.items():
        rows.append(
            (f"sampler CPU per tick, {model}",
             f"{ms(c['sampler_cpu_s'])} ({c['fraction_of_core_at_1s']:.2%} of a core at 1 s;"
             f" simulator {ms(c['simulator_cpu_s'])} excluded)")
        )  # fmt: skip
    report(
        "telemetry",
        "Telemetry (bench/telemetry.py)",
        rows,
        {
            "series": series,
            "bytes": len(body),
            "render_every_scrape": runs["rendered"],
            "metrics": runs["live"],
            "floor": runs["static"],
            "sampler_cpu": cpu,
            "usage_cpu": {"on_s": on, "off_s": off},
            "usage_memory": memory,
        },
        figures,
    )
    return figures
