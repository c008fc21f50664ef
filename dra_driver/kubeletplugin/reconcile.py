"""The start's reconcile: load the checkpoint and make the node match it.

An interrupted prepare (``PrepareStarted``) is rolled back; a CDI spec of ours the checkpoint
does not list is removed or kept as a recovered claim; recovered claims are rebuilt from what
survived (``rebuild.decide``); partitions and MPS daemons no claim owns are swept; every claim's
sharing, partitions and CDI spec are restored. Nothing else runs while it does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from agent.errors import TesseraError
from agent.logs import fields_
from agent.nvml.types import MigInstance
from dra_driver.device_model import AdvertisedDevice, DeviceModel
from dra_driver.errors import CdiError, CheckpointError, ClaimError, KubeError
from dra_driver.kubeletplugin.cdi import CdiWriter
from dra_driver.kubeletplugin.cdi_spec import SpecEvidence as CdiEvidence
from dra_driver.kubeletplugin.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    Checkpoint,
    ClaimEntry,
    PreparedDevice,
)
from dra_driver.kubeletplugin.claim_sources import ClaimIndex
from dra_driver.kubeletplugin.device_metadata import DeviceMetadataWriter
from dra_driver.kubeletplugin.effects import Effects
from dra_driver.kubeletplugin.ledger import Ledger
from dra_driver.kubeletplugin.locks import ClaimLocks
from dra_driver.kubeletplugin.plan import PlannedDevice, SharingPolicy, conflicts
from dra_driver.kubeletplugin.rebuild import Rebuilt, Unrecovered, decide
from dra_driver.kubeletplugin.records import Records, cdi_requests
from dra_driver.sharing.mps import MpsDaemon

T = TypeVar("T")


class _NodeLeftovers:
    """What survives of claims' side effects on this node (``rebuild.Leftovers``)."""

    def __init__(self, effects: Effects, cdi: CdiWriter) -> None:
        self._effects = effects
        self._cdi = cdi

    def mig_instance(self, device: AdvertisedDevice) -> MigInstance | None:
        return self._effects.mig_instance(device)

    def mps_daemon(self, uid: str) -> MpsDaemon | None:
        return self._effects.mps_daemon(uid)

    def mps_pipe_dir(self, uid: str) -> str | None:
        return self._effects.mps_pipe_dir(uid)

    def device_nodes(
        self, uid: str, devices: tuple[PreparedDevice, ...]
    ) -> dict[str, tuple[str, ...]]:
        return self._cdi.device_nodes(uid, cdi_requests(devices))


class Reconciler:
    """The start's reconcile, and the claims it could not rebuild (:meth:`unrecovered`)."""

    def __init__(
        self,
        *,
        driver_name: str,
        pool: str,
        cdi: CdiWriter,
        devices: Callable[[], DeviceModel],
        effects: Effects,
        sharing: SharingPolicy,
        records: Records,
        ledger: Ledger,
        index: ClaimIndex | None,
        boot_time: float,
        log: logging.Logger,
        metadata: DeviceMetadataWriter | None = None,
    ) -> None:
        """``index`` finds claims by UID, to rebuild a lost checkpoint from the CDI specs that
        survived; a spec written before ``boot_time`` predates this boot. ``metadata``: the
        KEP-5304 files of VM devices, those of claims the checkpoint does not hold swept."""
        self._metadata = metadata
        self._driver_name = driver_name
        self._pool = pool
        self._cdi = cdi
        self._devices = devices
        self._effects = effects
        self._sharing = sharing
        self._records = records
        self._ledger = ledger
        self._index = index
        self._boot_time = boot_time
        self._log = log
        self._unrecovered: dict[str, Unrecovered] = {}

    def unrecovered(self) -> list[Unrecovered]:
        """The claims whose prepared state could not be rebuilt at start and that are still
        held (their devices stay reserved until the kubelet unprepares or prepares them): for
        /readyz, the metrics and the operator."""
        claims = self._ledger.checkpoint.claims
        return [
            u
            for uid, u in sorted(self._unrecovered.items())
            if uid in claims and claims[uid].recovered
        ]

    def reconcile_on_start(self) -> None:
        """Load the checkpoint and make reality match it, logging every action.

        CDI specs of ours on disk are evidence of prepared claims. A spec the checkpoint does
        not list is removed only when the checkpoint proves the claim released (it was read from
        this boot's file) or the spec predates this boot (no container survives a reboot).
        Otherwise (the checkpoint is missing or was corrupt) the claim is recorded as recovered:
        its devices stay held until the kubelet unprepares or prepares it again, so lost state
        never gives a device out twice."""
        result = self._ledger.store.load()
        cp = result.checkpoint
        if result.corrupt_moved_to is not None:
            self._log.error(
                "checkpoint was corrupt; moved aside; claims whose CDI specs are on disk keep"
                " their devices",
                extra=fields_(moved_to=str(result.corrupt_moved_to), reason=result.corrupt_reason),
            )
        if result.rebooted:
            self._log.warning("node rebooted since the checkpoint: prepared state discarded")
        if result.migrated_from is not None:
            self._log.info("checkpoint migrated", extra=fields_(from_version=result.migrated_from))
        with self._ledger.lock:
            for entry in list(cp.claims.values()):
                if entry.state == PREPARE_STARTED:
                    rest = cp.without_claim(entry.uid)
                    if self._start_step("roll back", entry, partial(self._undo, entry, rest)):
                        cp = rest
                        self._log.warning(
                            "rolled back an interrupted prepare",
                            extra=fields_(claim=f"{entry.namespace}/{entry.name}", uid=entry.uid),
                        )
            for uid in sorted(self._cdi.claim_uids() - set(cp.claims)):
                cp = self._unlisted_spec(cp, uid, result.authoritative)
            cp = self._rebuild(cp)
            self._sweep_metadata(cp)
            try:
                self._effects.sweep(cp)
            except TesseraError as exc:
                self._log.error(
                    "cannot sweep partitions and MPS daemons no claim owns; retried at the next"
                    " start",
                    extra=fields_(error=str(exc)),
                )
            cp = self._restore(cp, list(cp.claims))
            self._settle(cp)

    def _sweep_metadata(self, cp: Checkpoint) -> None:
        """Remove the KEP-5304 files of every claim ``cp`` does not hold (recovered ones are
        held): an interrupted prepare's, or an unprepare's that crashed before removing them."""
        if self._metadata is None:
            return
        try:
            removed = self._metadata.sweep(set(cp.claims))
        except CdiError as exc:
            self._log.error(
                "cannot sweep device metadata no claim owns; retried at the next start",
                extra=fields_(error=str(exc)),
            )
            return
        for uid in removed:
            self._log.warning("removed orphaned device metadata", extra=fields_(uid=uid))

    def _restore(self, cp: Checkpoint, uids: list[str]) -> Checkpoint:
        """Set the sharing of the claims ``uids`` again and make what is gone of their devices
        (MPS daemons, MIG devices), rewriting a CDI spec that changed or is missing."""
        for uid in uids:
            entry = cp.claims[uid]
            restored = self._start_step("restore", entry, partial(self._effects.restore, entry))
            changed = restored is not None and restored[0] != entry
            if restored is not None and changed:
                cp = cp.with_claim(restored[0])
            current = cp.claims[entry.uid]
            if current.devices and (changed or current.uid not in self._cdi.claim_uids()):
                self._records.write_spec(current)
                self._log.warning(
                    "restored the CDI spec of a prepared claim",
                    extra=fields_(
                        claim=f"{entry.namespace}/{entry.name}",
                        uid=entry.uid,
                        reason="its devices were made again" if changed else "it was missing",
                    ),
                )
        return cp

    def retry_unrecovered(self, claim_locks: ClaimLocks) -> list[Unrecovered]:
        """While the agent runs: try again to rebuild the claims :meth:`unrecovered` lists (the
        claim source may answer now, a device may be advertised again), as the start does, under
        those claims' locks (a prepare or unprepare of one waits, and one that came first has
        settled it); a claim rebuilt gets its sharing restored and is saved. The claims still
        unrecovered."""
        uids = sorted(u.uid for u in self.unrecovered())
        if not uids:
            return []
        with claim_locks.hold_all(uids), self._ledger.lock:
            cp = self._ledger.checkpoint
            if not any(u in cp.claims and cp.claims[u].recovered for u in uids):
                return self.unrecovered()
            reported = dict(self._unrecovered)
            rebuilt = self._rebuild(cp)
            done = [u for u in uids if u in rebuilt.claims and not rebuilt.claims[u].recovered]
            if done:
                rebuilt = self._restore(rebuilt, done)
                try:
                    self._ledger.commit(rebuilt)
                except CheckpointError as exc:
                    self._unrecovered = reported  # still held as before: tried again later
                    self._log.error(
                        "cannot save the claims rebuilt while running; tried again later",
                        extra=fields_(uids=done, error=str(exc)),
                    )
        return self.unrecovered()

    def _settle(self, cp: Checkpoint) -> None:
        """The start's checkpoint: saved only when the file does not hold it already (a restart
        on a full disk writes nothing it has). When it cannot be saved (a full or read-only
        disk) the agent still starts with it in memory, logged: what this start undid is undone
        again at the next one, and every claim that needs a write fails, saying why, until the
        disk has room (/readyz's ``disk`` check)."""
        if self._ledger.store.holds(cp):
            self._ledger.adopt(cp)
            return
        try:
            self._ledger.commit(cp)
        except CheckpointError as exc:
            self._log.error(
                "cannot save the checkpoint at start; running with it in memory",
                extra=fields_(error=str(exc)),
            )
            self._ledger.adopt(cp)

    def _start_step(self, what: str, entry: ClaimEntry, step: Callable[[], T]) -> tuple[T] | None:
        """One claim's step at start: ``(its result,)``, or None when it failed; a failure is
        logged (the claim's next prepare or unprepare tries again, and a rolled-back claim
        keeps its devices until then) and never keeps the agent from starting."""
        try:
            return (step(),)
        except TesseraError as exc:
            self._log.error(
                f"cannot {what} a claim's sharing and partitions at start",
                extra=fields_(
                    claim=f"{entry.namespace}/{entry.name}", uid=entry.uid, error=str(exc)
                ),
            )
            return None

    def _undo(self, entry: ClaimEntry, cp: Checkpoint) -> None:
        """At start (nothing runs concurrently): undo the claim's side effects given the claims
        ``cp`` keeps, and remove its CDI spec."""
        self._effects.undo(entry, cp)
        self._cdi.remove(entry.uid)
        if self._metadata is not None:
            self._metadata.remove(entry.uid)

    def _unlisted_spec(self, cp: Checkpoint, uid: str, authoritative: bool) -> Checkpoint:
        """Decide about the CDI spec of a claim the checkpoint does not list (see
        ``reconcile_on_start``); returns the checkpoint with a recovered entry if it is kept."""
        try:
            names, written_at = self._cdi.evidence(uid)
        except CdiError as exc:
            # unreadable: not proof of anything, but when it was written still counts (a spec
            # cut short by a power loss is empty, and from before this boot)
            names, written_at = (), self._cdi.written_at(uid, default=self._boot_time)
            self._log.warning("cannot read a CDI spec", extra=fields_(uid=uid, error=str(exc)))
        if authoritative or written_at < self._boot_time:
            self._cdi.remove(uid)
            why = "released in the checkpoint" if authoritative else "written before this boot"
            self._log.warning("removed orphaned CDI spec", extra=fields_(uid=uid, reason=why))
            return cp
        entry = ClaimEntry(
            uid=uid,
            namespace="",
            name="",
            state=PREPARE_COMPLETED,
            devices=tuple(self._recovered_device(uid, n) for n in names),
            updated_at=time.time(),
            recovered=True,
        )
        return cp.with_claim(entry)  # _rebuild tries to account for it next

    def _rebuild(self, cp: Checkpoint) -> Checkpoint:
        """Rebuild every recovered entry (kept from a spec the checkpoint cannot vouch for, now
        or at an earlier start) from its spec, its claim and the node's leftovers
        (``rebuild.decide``); one that cannot be is kept as it is (its devices stay held), logged
        with the reason and listed by ``unrecovered``. Runs before the sweep, so the MPS daemons
        and MIG instances of rebuilt claims are theirs, and before restore, which sets their
        time-slices again and starts daemons or makes MIG devices that are gone."""
        uids = sorted(uid for uid, e in cp.claims.items() if e.recovered)
        if not uids:
            return cp
        found: dict[str, dict[str, object]] = {}
        source_error = None
        if self._index is None:
            source_error = "no claim source to look claims up by UID"
        else:
            try:
                found = dict(self._index.by_uid(uids))
            except (KubeError, ClaimError) as exc:
                source_error = str(exc)
        origin = f"cdi-spec+{self._index.origin if self._index is not None else 'nothing'}"
        leftovers = _NodeLeftovers(self._effects, self._cdi)
        model = self._devices()
        for uid in uids:
            outcome: Rebuilt | Unrecovered
            try:
                spec = self._cdi.read_evidence(uid)
            except CdiError as exc:
                outcome = Unrecovered(uid, "spec_unreadable", str(exc))
            else:
                if source_error is not None:
                    outcome = Unrecovered(uid, "claim_source_unavailable", source_error)
                else:
                    outcome = self._decide(cp, spec, found.get(uid), origin, leftovers, model)
            if isinstance(outcome, Rebuilt):
                cp = cp.with_claim(outcome.entry)
                self._unrecovered.pop(uid, None)
                self._log.warning(
                    "rebuilt a prepared claim from what survived",
                    extra=fields_(
                        claim=str(outcome.key),
                        uid=uid,
                        devices=",".join(d.device for d in outcome.entry.devices),
                        rebuilt_from=origin,
                        adopted=list(outcome.adopted),
                    ),
                )
            else:
                self._unrecovered[uid] = outcome
                self._log.error(
                    "cannot rebuild a prepared claim: its devices stay held until the kubelet"
                    " unprepares or prepares it",
                    extra=fields_(
                        uid=uid,
                        reason=outcome.reason,
                        detail=outcome.detail,
                        devices=",".join(d.device for d in cp.claims[uid].devices),
                    ),
                )
        return cp

    def _decide(
        self,
        cp: Checkpoint,
        spec: CdiEvidence,
        obj: dict[str, object] | None,
        origin: str,
        leftovers: _NodeLeftovers,
        model: DeviceModel,
    ) -> Rebuilt | Unrecovered:
        """One claim's rebuild, checked against the claims accounted for so far (those rebuilt,
        and those the checkpoint listed): not against entries still recovered, whose sharing is
        unknown (two time-sliced claims of one GPU are rebuilt one after the other)."""
        accounted = Checkpoint(cp.boot_id, {u: e for u, e in cp.claims.items() if not e.recovered})
        try:
            outcome = decide(
                spec,
                obj,
                driver=self._driver_name,
                pool=self._pool,
                model=model,
                sharing=self._sharing,
                record=self._records.device,
                leftovers=leftovers,
                rebuilt_from=origin,
            )
            if isinstance(outcome, Rebuilt):
                conflicts(accounted, outcome.key, self._pool, outcome.plan.devices, self._sharing)
        except ClaimError as exc:
            return Unrecovered(spec.uid, "conflict", str(exc))
        except TesseraError as exc:  # reading a MIG device or MPS daemon failed
            return Unrecovered(spec.uid, "leftovers_inconsistent", str(exc))
        return outcome

    def _recovered_device(self, uid: str, name: str) -> PreparedDevice:
        """A device named in a recovered CDI spec, described as the node advertises it now."""
        try:
            d = self._devices().device(name)
        except (KeyError, ClaimError):
            return PreparedDevice((), self._pool, name, (), "gpu", "", -1)
        return self._records.device(uid, PlannedDevice(d, (), None))
