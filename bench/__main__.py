"""`python -m bench [NAME ...]`: run the named benchmarks (default: all)."""

from __future__ import annotations

import sys

from bench import explain, prepare, rss, sharing, slices, telemetry

BENCHMARKS = {
    "slices": slices.run,
    "prepare": prepare.run,
    "sharing": sharing.run,
    "telemetry": telemetry.run,
    "rss": rss.run,
    "explain": explain.run,
}


def main(argv: list[str]) -> int:
    names = argv or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}")
        return 2
    for name in names:
        BENCHMARKS[name]()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
