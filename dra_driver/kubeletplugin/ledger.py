"""The checkpoint as the agent holds it in memory, and the lock its changes are made under.

Memory never runs ahead of the file (a change is saved, then adopted), except for the started
records of claims that change nothing on the node but dynamic MIG devices (``transaction``: a
crash before they complete leaves a CDI spec the checkpoint does not list, which the next start
removes, and MIG instances no completed claim owns, which it sweeps), and
for a claim undone whose release cannot be written (a full disk: its started record left in the
file is rolled back again at the next start), and for the start's checkpoint when it cannot be
saved (``reconcile``: the next start repeats what this one did).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from dra_driver.kubeletplugin.checkpoint import Checkpoint, CheckpointStore


class Ledger:
    """The current checkpoint (none until the start's reconcile commits one)."""

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self.lock = threading.Lock()
        """Held across a read of :attr:`checkpoint` and the commit of its change."""
        self._cp: Checkpoint | None = None

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
        self._cp = cp

    def adopt(self, cp: Checkpoint) -> None:
        """Hold ``cp`` without saving it (what a crash would lose is nothing to undo). Caller
        holds :attr:`lock`."""
        self._cp = cp

    def update(self, change: Callable[[Checkpoint], Checkpoint]) -> None:
        """Commit ``change`` of the checkpoint as it is now."""
        with self.lock:
            self.commit(change(self.checkpoint))
