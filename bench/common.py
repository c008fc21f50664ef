"""Shared helpers: timing statistics, the table printer, JSON results, simulated nodes."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agent.config import Config
from agent.daemon import open_node
from agent.discovery.inventory import NodeInventory
from agent.node import discover

RESULTS = Path(__file__).resolve().parent / "results"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


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


@contextmanager
def simulated_inventory(model: str, layout: str | None = None) -> Iterator[NodeInventory]:
    with tempfile.TemporaryDirectory(prefix="tessera-bench-") as tmp:
        src = open_node(Config(simulate=model, sim_mig_layout=layout), Path(tmp))
        src.nvml.init()
        try:
            yield discover(src)
        finally:
            src.nvml.shutdown()


def report(name: str, title: str, rows: list[tuple[str, str]], data: dict[str, Any]) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}")
    print("-" * len(title))
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"
