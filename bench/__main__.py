"""``python -m bench [--quick] [NAME ...]``: run the named benchmarks (default: all of them) and
print one table of their figures (docs/performance.md).

Every benchmark writes its detail to ``bench/results/<name>.json``; a run of all of them also
writes the table's figures to ``bench/results.json`` (both are git-ignored output). Naming
benchmarks prints their detail before the table and leaves ``bench/results.json`` alone, so that
file always describes one whole run. ``--quick`` (``make bench QUICK=1``) takes fewer repeats and
samples: a quick look, not numbers to publish. A benchmark that fails is reported, the others
still run, and the exit code is 1."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import (
    budgets,
    coldstart,
    explain,
    prepare,
    rss,
    scale_model,
    sharing,
    slices,
    telemetry,
    usage_report,
)
from bench.common import RESULTS, detail_lines
from bench.table import Figure, machine, render, results

Benchmark = Callable[[bool], list[Figure]]
BENCHMARKS: dict[str, Benchmark] = {
    "coldstart": coldstart.run,
    "prepare": prepare.run,
    "rss": rss.run,
    "sharing": sharing.run,
    "telemetry": telemetry.run,
    "slices": slices.run,
    "explain": explain.run,
    "budgets": budgets.run,
    "usage_report": usage_report.run,
    "scale_model": scale_model.run,
}
RESULTS_JSON = Path(__file__).resolve().parent / "results.json"


def parse(argv: list[str], benchmarks: dict[str, Benchmark]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats and samples")
    parser.add_argument("names", nargs="*", metavar="NAME", help=", ".join(benchmarks))
    return parser.parse_args(argv)


def main(
    argv: list[str],
    benchmarks: dict[str, Benchmark] = BENCHMARKS,
    results_json: Path = RESULTS_JSON,
) -> int:
    args = parse(argv, benchmarks)
    names: list[str] = args.names or list(benchmarks)
    unknown = [n for n in names if n not in benchmarks]
    if unknown:
        print(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(benchmarks)}")
        return 2
    load = os.getloadavg()
    started, t0 = time.time(), time.monotonic()
    figures: list[Figure] = []
    ran: dict[str, dict[str, Any]] = {}
    print(f"benchmarks: {', '.join(names)}{' (quick)' if args.quick else ''};"
          f" load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)  # fmt: skip
    for name in names:
        b0 = time.monotonic()
        try:
            found = benchmarks[name](args.quick)
        except Exception as exc:
            traceback.print_exc()
            ran[name] = {"wall_s": time.monotonic() - b0, "error": f"{type(exc).__name__}: {exc}"}
            print(f"{name}: FAILED after {ran[name]['wall_s']:.0f} s: {ran[name]['error']}")
            continue
        figures.extend(found)
        wall = time.monotonic() - b0
        ran[name] = {"wall_s": wall, "figures": len(found), "detail": f"bench/results/{name}.json"}
        print(f"{name}: {len(found)} figures in {wall:.0f} s (detail: {RESULTS.name}/{name}.json;"
              f" load average now {os.getloadavg()[0]:.2f})", flush=True)  # fmt: skip
    wall = time.monotonic() - t0
    if args.names:
        for name in names:
            if "error" not in ran[name]:
                print("\n".join(detail_lines(name)))
    print()
    print("\n".join(render(figures)))
    info = machine(load)
    print(
        f"wall time {wall:.0f} s; {info['cpus']} CPUs; load average before"
        f" {load[0]:.2f}, after {info['load_average_after'][0]:.2f}"
    )
    failed = [n for n, r in ran.items() if "error" in r]
    if not args.names:
        doc = results(
            figures,
            quick=args.quick,
            started=started,
            wall_s=wall,
            benchmarks=ran,
            machine_info=info,
        )
        results_json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"figures written to {results_json}")
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
