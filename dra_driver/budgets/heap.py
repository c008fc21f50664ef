"""How a reconcile keeps Python's cyclic garbage collector off the view it has just read.

A reconcile decodes the whole view (10,000 nodes' reports, 100,000 claims and pods: about 580 MiB
and 1.6 million tracked objects, bench/budgets.py) and then plans over it, allocating hundreds
of thousands of objects more. CPython starts a full (generation 2) collection once the objects
that reached generation 2 since the last one outnumber a quarter of those it then kept, which
the decoded view always does: a collection during the plan then walks every object of the view
only to find that nothing in it is garbage (it is all reachable from the view). That cost 1.6 s
of CPU in one plan (docs/performance.md, "The budget controller's reconcile").

``gc.freeze()`` alone (https://docs.python.org/3/library/gc.html#gc.freeze) is not enough: it
hides the view from the collector, but then the next full collection keeps only the plan's
objects, and since the trigger is relative to what the last one kept, full collections come
every few thousand allocations: measured, 5 of them and 0.45 s of CPU in one plan. So
:func:`collector_paused` turns the collector off for the reconcile (``gc.disable``), and back
on when it ends. Reference counting still frees everything acyclic at once; the plan keeps what
it builds, so the little cyclic garbage a reconcile may leave (an exception's traceback, an
HTTP connection) waits seconds, not longer, for the next collection.

It lives here, in the controller's plumbing, not in the planner: the planner is pure and does
not know how big its input is or who else runs in the process.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Within the block, no cyclic garbage collection runs (unless it was off already, it is
    on again after it)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
