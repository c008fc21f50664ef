"""The crash matrix (`make reliability`): every crash point x every mode (whole GPU, static MIG,
dynamic MIG, time-slicing, MPS, memory shares, power limits, VFIO passthrough, vGPUs on VFs and
as mdevs) x one claim and a batch; see tests/crashmatrix.py.
Each cell is its own test, so pytest-xdist spreads them (``-n 2``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.crashmatrix import BY_NAME, MODES, POINTS, cells, run_cell, save_cell
from tests.reliability.report import add

pytestmark = pytest.mark.reliability


@pytest.mark.parametrize(
    ("mode", "point", "shape"), [pytest.param(*c, id="/".join(c)) for c in cells()]
)
def test_crash_matrix(short_tmp: Path, mode: str, point: str, shape: str) -> None:
    out = run_cell(short_tmp, BY_NAME[mode], point, shape)
    save_cell(out)
    add(
        "crash-matrix",
        cases=0 if out.fired_in is None else 1,
        faults=len(out.armed),
        crashes=out.crashes,
        lost=len(out.lost),
        details={
            "modes": len(MODES),
            "points": len(POINTS),
            "cells_not_reachable_total": 1 if out.fired_in is None else 0,
        },
        rerun="make reliability (tests/reliability/test_crash_matrix.py)",
    )
    assert out.problems == [], "\n".join(out.problems)
