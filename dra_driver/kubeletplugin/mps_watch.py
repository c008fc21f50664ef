"""Whether each prepared claim's MPS daemon still runs, and starting one found gone again.

A daemon killed under a prepared claim (the OOM killer, a person, a crash of its own) left the
claim's containers without MPS while a repeated prepare said success, /readyz stayed 200 and
nothing was logged until the agent restarted. Now:

- a repeated prepare of a claim whose daemon is gone starts it again before it answers (and
  fails with why when it cannot): success always means a daemon (``ensure``);
- the agent's watch loop (``Preparer.watch_mps``) looks at every prepared claim's daemon every
  ``WATCH_INTERVAL_S`` seconds and starts a gone one again (``revive``), logging both;
- the claims whose daemon could not be started again are /readyz's ``mps-daemons`` check
  (``failing``) until a later round or the claim's prepare succeeds.

Starting one again is ``Effects.restore``, as at the agent's start; the new PID is committed to
the checkpoint. Each claim's lock is held throughout (a prepare or unprepare of it waits), and
its GPUs' locks while the daemon starts (as for a prepare)."""

from __future__ import annotations

import logging
import threading

from agent.errors import TesseraError
from agent.logs import Throttle, fields_
from dra_driver.kubeletplugin.checkpoint import PREPARE_COMPLETED, ClaimEntry
from dra_driver.kubeletplugin.effects import Effects
from dra_driver.kubeletplugin.ledger import Ledger
from dra_driver.kubeletplugin.locks import ClaimLocks
from dra_driver.kubeletplugin.records import claim_key, gpus

UNKNOWN_LOG_INTERVAL_S = 60.0
"""At most one warning a minute per claim whose daemon's state cannot be read."""
WATCH_INTERVAL_S = 5.0
"""How often the watch loop looks at the daemons: a signal-0 probe and a start-time read of each
(``MpsControl.alive``), cheap next to the sampler's once-a-second NVML reads."""


class MpsWatch:
    """See the module docstring."""

    def __init__(
        self,
        *,
        effects: Effects,
        ledger: Ledger,
        claim_locks: ClaimLocks,
        gpu_locks: ClaimLocks,
        log: logging.Logger,
    ) -> None:
        self._effects = effects
        self._ledger = ledger
        self._claim_locks = claim_locks
        self._gpu_locks = gpu_locks
        self._log = log
        self._throttle = Throttle(log, UNKNOWN_LOG_INTERVAL_S)
        self._failing: dict[str, str] = {}
        self._lock = threading.Lock()

    def ensure(self, entry: ClaimEntry) -> ClaimEntry:
        """``entry`` with a running daemon: one found gone is started again and the new one
        recorded. The caller holds the claim's lock. Raises TesseraError when it cannot be
        started (the claim is then answered with the error, never with success)."""
        if entry.mps is None or self._effects.mps_alive(entry):
            self._forget(entry.uid)
            return entry
        self._log.warning(
            "the MPS daemon of a prepared claim is gone; starting it again",
            extra=fields_(claim=str(claim_key(entry)), uid=entry.uid, pid=entry.mps.pid),
        )
        try:
            with self._gpu_locks.hold_all(gpus(entry.devices)):
                restored = self._effects.restore(entry)
                self._ledger.update(lambda cp: cp.with_claim(restored))
        except TesseraError as exc:
            with self._lock:
                self._failing[entry.uid] = f"{claim_key(entry)}: {exc}"
            raise
        self._forget(entry.uid)
        return restored

    def revive(self) -> None:
        """One round of the watch loop: every prepared claim's daemon found gone is started
        again; one that cannot be is logged and listed by ``failing``."""
        for entry in list(self._ledger.checkpoint.claims.values()):
            if not _watched(entry) or self._alive(entry):
                continue
            with self._claim_locks.hold_all([entry.uid]):
                current = self._ledger.checkpoint.claims.get(entry.uid)
                if current is None or not _watched(current):
                    continue  # unprepared meanwhile
                try:
                    self.ensure(current)
                except TesseraError as exc:
                    self._log.error(
                        "cannot start the MPS daemon of a prepared claim again; retried",
                        extra=fields_(
                            claim=str(claim_key(current)), uid=current.uid, error=str(exc)
                        ),
                    )
        with self._lock:  # claims unprepared since they failed are no one's concern
            for uid in [u for u in self._failing if u not in self._ledger.checkpoint.claims]:
                del self._failing[uid]

    def _alive(self, entry: ClaimEntry) -> bool:
        """Whether the claim's daemon runs; True (left alone this round) when that cannot be
        told: in kube mode it is its Pod's state, and an API outage must neither end this loop
        nor start a second daemon beside one that may well run."""
        try:
            return self._effects.mps_alive(entry)
        except TesseraError as exc:
            self._throttle(
                logging.WARNING,
                entry.uid,
                "cannot tell whether a prepared claim's MPS daemon runs; asked again next round",
                claim=str(claim_key(entry)),
                uid=entry.uid,
                error=str(exc),
            )
            return True

    def failing(self) -> list[str]:
        """The claims whose daemon is gone and could not be started again, with why."""
        with self._lock:
            return sorted(self._failing.values())

    def _forget(self, uid: str) -> None:
        with self._lock:
            self._failing.pop(uid, None)


def _watched(entry: ClaimEntry) -> bool:
    return entry.mps is not None and entry.state == PREPARE_COMPLETED and not entry.recovered
