"""Benchmarks: `make bench` runs them all, prints a table each and writes JSON to bench/results/."""
