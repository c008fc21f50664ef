"""The checkpoint as the agent holds it in memory, and the lock its changes are made under.

Memory never runs ahead of the file (a change is saved, then adopted), except for the started
records of claims that change nothing on the node but dynamic MIG devices (``transaction``: a
crash before they complete leaves a CDI spec the checkpoint does not list, which the next start
removes, and MIG instances no completed claim owns, which it sweeps), and
for a claim undone whose release cannot be written (a full disk: its started record left in the
file is rolled back again at the next start), and for the start's checkpoint when it cannot be
saved (``reconcile``: the next start repeats what this one did).

It also notes when each claim came to hold devices (its prepare completed) or stopped, on the
monotonic clock, for the last ``CHANGES_KEPT_S`` seconds: the usage meter counts a holding that
came or went between two telemetry ticks from or to that moment, not from or to a tick (see
``agent.telemetry.usage_meter``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

from dra_driver.kubeletplugin.checkpoint import (
    PREPARE_COMPLETED,
    Checkpoint,
    CheckpointStore,
    ClaimEntry,
)

CHANGES_KEPT_S = 300.0
"""How long :attr:`Ledger.holder_changes` keeps a claim's change (the usage meter reads it at the
next telemetry tick; one later than this counts from or to that tick instead)."""
CHANGES_KEPT = 4096
"""The most changes it keeps (the newest): its memory stays bounded whatever the churn."""


def holds_devices(entry: ClaimEntry) -> bool:
    """Whether a claim holds its devices: its prepare completed, and it is not one the start
    could not rebuild (what :meth:`Preparer.prepared_claims` lists)."""
    return entry.state == PREPARE_COMPLETED and not entry.recovered


def holding(cp: Checkpoint) -> frozenset[str]:
    """The UIDs of the claims holding devices in ``cp``."""
    return frozenset(uid for uid, e in cp.claims.items() if holds_devices(e))


class Ledger:
    """The current checkpoint (none until the start's reconcile commits one)."""

    def __init__(
        self,
        store: CheckpointStore,
        clock: Callable[[], float] = time.monotonic,
        changes_kept: int = CHANGES_KEPT,
    ) -> None:
        self.store = store
        self._changes_kept = changes_kept
        self.lock = threading.Lock()
        """Held across a read of :attr:`checkpoint` and the commit of its change."""
        self._clock = clock
        self._cp: Checkpoint | None = None
        self._holding: frozenset[str] = frozenset()
        self.holder_changes: Mapping[str, float] = {}
        """Claim UID -> when it last came to hold devices or stopped (``clock``), since the
        start's reconcile, for ``CHANGES_KEPT_S``. Replaced, never changed: any thread reads it."""

    @property
    def checkpoint(self) -> Checkpoint:
        if self._cp is None:
            raise RuntimeError("reconcile_on_start() first")
        return self._cp

    def commit(self, cp: Checkpoint) -> None:
        """Save, then adopt: memory never runs ahead of the file, except for the started
        records of claims that change nothing on the node (see :meth:`adopt`). Caller holds
        :attr:`lock`."""
        self.store.save(cp)
        self.adopt(cp)

    def adopt(self, cp: Checkpoint) -> None:
        """Hold ``cp`` without saving it (what a crash would lose is nothing to undo). Caller
        holds :attr:`lock`."""
        now = holding(cp)
        if self._cp is not None and now != self._holding:
            t = self._clock()
            kept = {u: at for u, at in self.holder_changes.items() if at >= t - CHANGES_KEPT_S}
            kept.update(dict.fromkeys(now ^ self._holding, t))
            if len(kept) > self._changes_kept:
                newest = sorted(kept.items(), key=lambda item: item[1])
                kept = dict(newest[len(newest) - self._changes_kept :])
            self.holder_changes = kept  # before the checkpoint: a reader of both sees the time
        self._holding = now
        self._cp = cp

    def update(self, change: Callable[[Checkpoint], Checkpoint]) -> None:
        """Commit ``change`` of the checkpoint as it is now."""
        with self.lock:
            self.commit(change(self.checkpoint))
