"""``python -m bench.sampler_memory on|off TICKS``: one process, the sampler of dgx-a100 all-1g
with its 56 MIG devices held by claims, ticked ``TICKS`` times with the usage ledger fed
(``on``) or without it (``off``); prints JSON: the process's RSS before the sampler was made and
after its ticks, its peak RSS, and (``--traced``) the bytes Python allocations hold after the
ticks that were made from the sampler's creation on (tracemalloc), instead of RSS.

Why a process per side (``bench/telemetry.py`` runs them in turns): the goal is about the
agent's memory, and RSS is what a node pays; in one process the two samplers' heaps would mix
(freed arenas reused by the other). The two processes differ only in the ledger. ``--traced``
isolates the accounting's own bytes (a run under tracemalloc, whose bookkeeping inflates RSS,
so it is a separate run).

The ledger's wall clock is a fake one that advances ``STEP`` seconds per tick, so ``TICKS``
ticks leave the ledger holding as many 15-minute buckets as ``TICKS`` x ``STEP`` seconds of a
daemon's life between two acknowledged reports (its memory grows with the buckets, not with the
ticks: each holds one entry per claim and device), and it is written every tick (every 15 s);
the ticks themselves run back to back (a real second per tick would take an hour).
"""

from __future__ import annotations

import gc
import json
import resource
import sys
import tempfile
import tracemalloc
from pathlib import Path

import psutil

from agent.cli.node_access import open_node
from agent.config import Config
from agent.node import discover
from agent.telemetry.usage_meter import UsageMeter
from agent.usage.buckets import BUCKET_SECONDS
from bench.telemetry import LOG, _sampler, checkpoint

START = 1_796_000_000.0 - 1_796_000_000.0 % BUCKET_SECONDS + BUCKET_SECONDS / 2
"""The fake wall clock's first second: mid-bucket."""
STEP = 30.0
"""Fake wall-clock seconds per tick."""


class _Wall:
    """A wall clock that each reading advances by ``STEP`` (the meter reads it once a tick)."""

    def __init__(self) -> None:
        self.t = START

    def __call__(self) -> float:
        self.t += STEP
        return self.t


def measure(on: bool, ticks: int, traced: bool) -> dict[str, float]:
    """The figures of one process (the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="tm-", dir="/tmp") as tmp:
        state = Path(tmp)
        src = open_node(Config.of(simulate="dgx-a100", sim_mig_layout="all-1g"), state)
        src.nvml.init()
        inv = discover(src)
        held = checkpoint(inv, mig=True)
        gc.collect()
        proc = psutil.Process()
        before = proc.memory_info().rss
        if traced:
            tracemalloc.start()
        meter = UsageMeter(state / "usage.json", "bench-boot", LOG, wall=_Wall()) if on else None
        smp = _sampler(src, src.nvml, inv, state, lambda: held, meter)
        for _ in range(ticks):
            smp.tick()
        gc.collect()
        rss = proc.memory_info().rss
        out = {
            "rss_before_bytes": float(before),
            "rss_after_bytes": float(rss),
            # ru_maxrss is the kernel's high-water mark, updated lazily: never below the RSS now
            "peak_rss_bytes": float(
                max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss)
            ),
        }
        if traced:
            out["traced_bytes"] = float(tracemalloc.get_traced_memory()[0])
            tracemalloc.stop()
        src.nvml.shutdown()
        return out


def main(argv: list[str]) -> int:
    traced = "--traced" in argv
    args = [a for a in argv if a != "--traced"]
    if len(args) != 2 or args[0] not in ("on", "off") or not args[1].isdigit():
        print(
            f"usage: python -m bench.sampler_memory on|off TICKS [--traced]; got {argv}",
            file=sys.stderr,
        )
        return 2
    print(json.dumps(measure(args[0] == "on", int(args[1]), traced)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
