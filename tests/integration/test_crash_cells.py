"""The fast slice of the crash matrix (tests/crashmatrix.py; the whole matrix runs in `make
reliability`): a crash inside a batch of whole GPUs and one inside a batch of dynamic MIG
devices (a GPU instance made, its compute instance not), and in a batch of power-capped GPUs on
either side of the cap, each restarted, retried and checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.crashmatrix import BY_NAME, MODES, POINTS, SHAPES, cells, run_cell


@pytest.mark.parametrize(
    ("mode", "point"),
    [
        ("whole-gpu", "after-cdi"),
        ("dynamic-mig", "after-gi-create"),
        ("power-limit", "after-power-recorded"),  # the limit to set back durable, not yet capped
        ("power-limit", "after-power-limit"),  # capped, the claim not yet completed
    ],
)
def test_a_crash_inside_a_batch_leaves_a_node_the_retries_make_whole(
    short_tmp: Path, mode: str, point: str
) -> None:
    out = run_cell(short_tmp, BY_NAME[mode], point, "batch")
    assert out.problems == [], "\n".join(out.problems)
    assert out.fired_in == "prepare" and out.crashes == 1


def test_the_matrix_covers_every_point_in_every_mode() -> None:
    """Every crash point the driver has is armed in every mode (a batch at least), and a mode's
    unreachable points are points the driver has: a renamed point cannot leave a stale entry
    that silently stops covering it."""
    run = set(cells())
    for m in MODES:
        assert m.unreachable <= set(POINTS), f"{m.name}: {sorted(m.unreachable - set(POINTS))}"
        for point in POINTS:
            assert (m.name, point, "batch") in run
            assert ((m.name, point, "single") in run) == (point not in m.unreachable)
        assert len(m.batch) >= 3 and len(m.single) == 1
    assert set(BY_NAME) == {m.name for m in MODES} and SHAPES == ("single", "batch")
