"""Figures of the reliability suites, for the report ``make reliability`` prints.

Every suite adds what it did to its own record while it runs::

    add("crash-matrix", cases=1, crashes=1)           # counts are summed over calls
    add("api-faults", faults=12, lost=0, details={"requests_per_minute_in_outage": 41.5})

A record is a JSON file ``<results>/<suite>.json``, where ``<results>`` is
``$TESSERA_RELIABILITY_RESULTS`` or ``bench/results/reliability`` (git ignores it). ``add`` merges
into the file under an exclusive ``flock``, so the tests of one suite may run in several
pytest-xdist workers. ``make reliability`` empties the directory first and prints
``python -m tests.reliability.summary`` last, so the table shows exactly that run.

The counted fields, every one an integer:

- ``cases``: inputs or scenarios tried;
- ``faults``: faults injected (API errors, crashes armed, disk failures);
- ``crashes``: daemon crashes (SIGKILL at a crash point) survived;
- ``lost``: anything lost or left behind (claims, files, MIG instances, MPS daemons,
  slices): the suites assert it is 0, and the report shows it.

``details`` holds other figures (a rate, a maximum); a number there is replaced, not summed,
unless its name ends in ``_total``.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

COUNTS = ("cases", "faults", "crashes", "lost")
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "reliability"


def results_dir() -> Path:
    return Path(os.environ.get("TESSERA_RELIABILITY_RESULTS") or RESULTS)


def _merge(old: dict[str, Any], counts: dict[str, int], details: dict[str, Any]) -> dict[str, Any]:
    new = dict(old)
    for name, value in counts.items():
        new[name] = int(new.get(name, 0)) + value
    merged = dict(new.get("details", {}))
    for name, value in details.items():
        if name.endswith("_total") and isinstance(value, int | float):
            merged[name] = merged.get(name, 0) + value
        else:
            merged[name] = value
    new["details"] = merged
    new["updated_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return new


def add(
    suite: str,
    *,
    cases: int = 0,
    faults: int = 0,
    crashes: int = 0,
    lost: int = 0,
    details: dict[str, Any] | None = None,
    rerun: str = "",
) -> None:
    """Add to ``suite``'s record (see the module docstring)."""
    if not suite or "/" in suite or suite.startswith("."):
        raise ValueError(f"suite name {suite!r} must be a plain file name")
    directory = results_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{suite}.json"
    with open(directory / f".{suite}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            old = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            old = {"suite": suite}
        new = _merge(
            old,
            {"cases": cases, "faults": faults, "crashes": crashes, "lost": lost},
            details or {},
        )
        if rerun:
            new["rerun"] = rerun
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(new, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)


def load_all() -> list[dict[str, Any]]:
    """Every suite's record in the results directory, by suite name."""
    directory = results_dir()
    if not directory.is_dir():
        return []
    records = []
    for path in sorted(directory.glob("*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except ValueError:
            continue
    return records
