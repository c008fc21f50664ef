"""Prepare and unprepare claims: the object the kubelet plugin and the agent use.

:class:`Preparer` builds its parts and hands each its dependencies:

- ``batch.BatchRunner``: a kubelet call's claims as one batch on the operation's thread pool,
  answered per claim under the call's deadline; the stuck list and shutdown;
- ``transaction.Transactions``: the per-claim state machine of prepare and unprepare, with the
  group commit of a batch's checkpoint writes (its module docstring tells the steps);
- ``reconcile.Reconciler``: the start's reconcile and the rebuild of a lost checkpoint;
- ``ledger.Ledger``: the checkpoint held in memory and its lock, shared by the two above.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from dra_driver.device_model import DeviceModel
from dra_driver.kubeletplugin.batch import BatchRunner, ClaimResult, Observer
from dra_driver.kubeletplugin.cdi import CdiWriter
from dra_driver.kubeletplugin.checkpoint import (
    Checkpoint,
    CheckpointStore,
    ClaimEntry,
)
from dra_driver.kubeletplugin.claim_sources import ClaimIndex, ClaimSource
from dra_driver.kubeletplugin.claims import ClaimKey
from dra_driver.kubeletplugin.device_metadata import DeviceMetadataWriter
from dra_driver.kubeletplugin.effects import Effects
from dra_driver.kubeletplugin.ledger import Ledger, holds_devices
from dra_driver.kubeletplugin.locks import ClaimLocks
from dra_driver.kubeletplugin.mps_watch import WATCH_INTERVAL_S
from dra_driver.kubeletplugin.plan import SharingPolicy
from dra_driver.kubeletplugin.rebuild import Unrecovered
from dra_driver.kubeletplugin.reconcile import Reconciler
from dra_driver.kubeletplugin.records import Records
from dra_driver.kubeletplugin.transaction import CrashHook, Transactions

__all__ = ["ClaimLocks", "ClaimResult", "CrashHook", "Observer", "Preparer"]


class Preparer:
    def __init__(
        self,
        *,
        driver_name: str,
        pool: str,
        claims: ClaimSource,
        store: CheckpointStore,
        cdi: CdiWriter,
        devices: Callable[[], DeviceModel],
        log: logging.Logger,
        effects: Effects | None = None,
        sharing: SharingPolicy | None = None,
        crash_hook: CrashHook = lambda point: None,
        observe: Observer = lambda op, seconds, reason: None,
        workers: int = 8,
        deadline_s: float = 40.0,
        boot_time: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        index: ClaimIndex | None = None,
        on_unprepared: Callable[[ClaimEntry], None] = lambda entry: None,
        metadata: DeviceMetadataWriter | None = None,
    ) -> None:
        """``index`` finds claims by UID (``claims`` itself when it can; the API server or the
        claim files), to rebuild a lost checkpoint from the CDI specs that survived.
        ``on_unprepared`` is told of each claim whose release was recorded, on the kubelet
        call's thread: it must only queue (kube mode: the claim's usage summary).
        ``metadata`` writes the KEP-5304 device metadata of VM devices (vfio, vgpu) that
        KubeVirt's virt-launcher reads; None: none is written."""
        self.driver_name = driver_name
        self.pool = pool
        self.claims = claims
        self.store = store
        self.cdi = cdi
        self.devices = devices
        self.log = log
        self.effects = effects or Effects(
            mig=None, settings=None, mps=None, devices=devices, log=log
        )
        """Side effects of sharing and dynamic MIG; without tools, claims that need them fail."""
        self.sharing = sharing or SharingPolicy()
        self.crash = crash_hook
        self.observe = observe
        self.deadline_s = deadline_s
        self.boot_time = boot_time
        self.index = index
        self.claim_locks = ClaimLocks()
        self.gpu_locks = ClaimLocks()
        self._ledger = Ledger(store, clock)
        records = Records(pool, cdi)
        self._transactions = Transactions(
            driver_name=driver_name,
            pool=pool,
            claims=claims,
            devices=devices,
            sharing=self.sharing,
            effects=self.effects,
            cdi=cdi,
            records=records,
            ledger=self._ledger,
            claim_locks=self.claim_locks,
            gpu_locks=self.gpu_locks,
            crash=crash_hook,
            log=log,
            on_unprepared=on_unprepared,
            metadata=metadata,
        )
        self._reconciler = Reconciler(
            driver_name=driver_name,
            pool=pool,
            cdi=cdi,
            devices=devices,
            effects=self.effects,
            sharing=self.sharing,
            records=records,
            ledger=self._ledger,
            index=index,
            boot_time=boot_time,
            log=log,
            metadata=metadata,
        )
        self._runner = BatchRunner(
            handlers={
                "prepare": self._transactions.prepare_batch,
                "unprepare": self._transactions.unprepare_batch,
            },
            log=log,
            observe=observe,
            workers=workers,
            deadline_s=deadline_s,
            clock=clock,
        )

    # -- checkpoint access -------------------------------------------------------------------
    @property
    def checkpoint(self) -> Checkpoint:
        return self._ledger.checkpoint

    def prepared_claims(self) -> tuple[ClaimEntry, ...]:
        """The claims whose prepare completed: who holds which device now (a read-only view for
        telemetry; entries are immutable)."""
        return tuple(e for e in self.checkpoint.claims.values() if holds_devices(e))

    def holder_changes(self) -> Mapping[str, float]:
        """Claim UID -> when it last came into :meth:`prepared_claims` or left it (the
        ``clock`` given; the last few minutes' changes), for the usage meter to count a holding
        from or to that moment."""
        return self._ledger.holder_changes

    def unrecovered(self) -> list[Unrecovered]:
        """The claims whose prepared state could not be rebuilt at start and that are still
        held (their devices stay reserved until the kubelet unprepares or prepares them): for
        /readyz, the metrics and the operator."""
        return self._reconciler.unrecovered()

    def retry_unrecovered(self) -> list[Unrecovered]:
        """Try again to rebuild the claims :meth:`unrecovered` lists; those still unrecovered
        (``reconcile.Reconciler.retry_unrecovered``; the agent calls it with backoff)."""
        return self._reconciler.retry_unrecovered(self.claim_locks)

    # -- start-up ----------------------------------------------------------------------------
    def reconcile_on_start(self) -> None:
        """Load the checkpoint and make reality match it, logging every action
        (``reconcile.Reconciler.reconcile_on_start``)."""
        self._reconciler.reconcile_on_start()

    # -- calls -------------------------------------------------------------------------------
    def prepare(self, claims: Sequence[ClaimKey]) -> dict[str, ClaimResult]:
        """Prepare the claims of one kubelet call together (see
        ``transaction.Transactions.prepare_batch``); one result per claim UID, errors per
        claim."""
        return self._runner.call("prepare", claims)

    def unprepare(self, claims: Sequence[ClaimKey]) -> dict[str, ClaimResult]:
        return self._runner.call("unprepare", claims)

    def watch_mps(self, stop: threading.Event, interval_s: float = WATCH_INTERVAL_S) -> None:
        """Until ``stop``: every ``interval_s`` seconds, start again each prepared claim's MPS
        daemon found gone (``mps_watch``)."""
        while not stop.wait(interval_s):
            self._transactions.mps_watch.revive()

    def failing_mps(self) -> list[str]:
        """The prepared claims whose MPS daemon is gone and could not be started again."""
        return self._transactions.mps_watch.failing()

    def stuck(self) -> list[str]:
        """The claims whose prepare or unprepare has run longer than the call deadline (a
        worker that is stuck: for /readyz, the metrics and the log)."""
        return self._runner.stuck()

    @property
    def closing(self) -> threading.Event:
        """Set once :meth:`close` has stopped taking claims and cancelled the queued ones."""
        return self._runner.closing

    def close(self, timeout: float) -> list[str]:
        """Stop taking claims and give the running ones up to ``timeout`` seconds to finish.

        New calls are answered with a per-claim "shutting down" error (the kubelet retries them
        with the next agent). Returns the claims still running at the deadline: they are left
        to the next start's reconcile (an interrupted prepare is rolled back and redone)."""
        return self._runner.close(timeout)
