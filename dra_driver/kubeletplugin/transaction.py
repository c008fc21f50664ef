"""Prepare and unprepare claims: the per-claim state machine, run a batch (a kubelet call) at a
time.

The claims of one kubelet call are one batch (``Transactions.prepare_batch``) and share their
checkpoint writes (group commit):

1. each claim is read and planned (``plan.plan_claim``, pure: our devices, their configs, how
   each is shared); a ``PrepareCompleted`` entry is answered as it is; a ``PrepareStarted`` (or
   recovered) one is rolled back first;
2. under the checkpoint lock, each claim is checked against the holders so far
   (``plan.conflicts``) and recorded as ``PrepareStarted`` with its plan (its devices are now
   reserved); one write makes the batch's records durable when some claim changes the node in
   a way only its record can undo (time-slicing, MPS, ``Effects.changes_node``): a claim whose
   only effects are its CDI spec and dynamic MIG devices needs no durable start (a crash
   before it completes leaves a spec the checkpoint does not list and MIG instances no
   completed claim owns, which the next start removes and sweeps);
3. each claim's side effects, under the locks of its GPUs (``sharing.effects``): dynamic MIG
   devices created, time-slicing and MPS set up (an MPS daemon recorded as soon as it runs);
   then, for VM devices, their KEP-5304 metadata (``device_metadata``), then its CDI spec
   (idempotent, discoverable by its file name);
4. one write records every claim that got there as ``PrepareCompleted``.

A failure in step 3 undoes what that claim got to before it answers; the others go on. A crash
between any two steps is repaired by the next prepare of the claim (the kubelet retries) or by
``reconcile_on_start`` (``reconcile``). Claims of a batch and of concurrent batches touching
different GPUs run concurrently; the same claim from many callers is serialized by a per-claim
lock, side effects on one GPU by a per-GPU lock. Unprepare is batched the same way
(``Transactions.unprepare_batch``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agent.errors import TesseraError
from agent.logs import fields_
from dra_driver.device_model import DeviceModel
from dra_driver.errors import CheckpointError, ClaimError, KubeError, ParamsError
from dra_driver.kubeletplugin.batch import Batch, ClaimResult, NotRun, shutting_down
from dra_driver.kubeletplugin.cdi import CdiWriter
from dra_driver.kubeletplugin.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    ClaimEntry,
    MpsRecord,
    PreparedDevice,
)
from dra_driver.kubeletplugin.claim_sources import ClaimSource
from dra_driver.kubeletplugin.claims import ClaimKey, parse_allocation
from dra_driver.kubeletplugin.device_metadata import (
    DeviceMetadataWriter,
    pod_claim_name,
    prepare_metadata,
)
from dra_driver.kubeletplugin.effects import Effects
from dra_driver.kubeletplugin.ledger import Ledger
from dra_driver.kubeletplugin.locks import ClaimLocks
from dra_driver.kubeletplugin.mps_watch import MpsWatch
from dra_driver.kubeletplugin.plan import ClaimPlan, SharingPolicy, conflicts, plan_claim
from dra_driver.kubeletplugin.records import Records, claim_entry, claim_key, gpus

CrashHook = Callable[[str], None]


@dataclass(frozen=True)
class _Planned:
    """A claim read and planned (step 1 of its prepare)."""

    claim: ClaimKey
    plan: ClaimPlan
    records: tuple[PreparedDevice, ...]
    changes_node: bool
    """Whether its prepare changes the node beyond its CDI spec (its start must be durable)."""
    pod_claim_name: str | None = None
    """The pod's name for the claim, when made from its template (KEP-5304 metadata path)."""
    spec_only: bool = False
    """Whether its prepare writes its CDI spec and nothing else (no device made, no setting,
    no tool run): a step of microseconds, run in the batch's own thread (see ``_make_all``)."""


def _by_gpu(
    entries: Sequence[ClaimEntry], changes_node: Callable[[ClaimEntry], bool]
) -> list[list[ClaimEntry]]:
    """The entries to undo in groups that may run concurrently: the claims that share a GPU
    (transitively) in one group, in their order, when one of them changes the node; all the
    claims that change nothing on the node in one more group."""
    plain = [e for e in entries if not changes_node(e)]
    groups: list[tuple[set[str], list[ClaimEntry]]] = []
    for e in entries:
        if not changes_node(e):
            continue
        these = gpus(e.devices) or {f"claim:{e.uid}"}
        touching = [g for g in groups if g[0] & these]
        merged_gpus, merged = set(these), []
        for g in touching:
            groups.remove(g)
            merged_gpus |= g[0]
            merged += g[1]
        groups.append((merged_gpus, sorted([*merged, e], key=entries.index)))
    return ([plain] if plain else []) + [g[1] for g in groups]


class Transactions:
    """Prepare and unprepare batches of claims against the checkpoint (``ledger``)."""

    def __init__(
        self,
        *,
        driver_name: str,
        pool: str,
        claims: ClaimSource,
        devices: Callable[[], DeviceModel],
        sharing: SharingPolicy,
        effects: Effects,
        cdi: CdiWriter,
        records: Records,
        ledger: Ledger,
        claim_locks: ClaimLocks,
        gpu_locks: ClaimLocks,
        crash: CrashHook,
        log: logging.Logger,
        on_unprepared: Callable[[ClaimEntry], None] = lambda entry: None,
        metadata: DeviceMetadataWriter | None = None,
    ) -> None:
        """``on_unprepared`` is told of each claim whose release was recorded (it must not
        block: the kubelet's call is still open; an exception from it is logged, never the
        call's). ``metadata`` writes the KEP-5304 files of VM devices (None: none)."""
        self._metadata = metadata
        self._on_unprepared = on_unprepared
        self._driver_name = driver_name
        self._pool = pool
        self._claims = claims
        self._devices = devices
        self._sharing = sharing
        self._effects = effects
        self._cdi = cdi
        self._records = records
        self._ledger = ledger
        self._claim_locks = claim_locks
        self._gpu_locks = gpu_locks
        self._crash = crash
        self._log = log
        self.mps_watch = MpsWatch(
            effects=effects,
            ledger=ledger,
            claim_locks=claim_locks,
            gpu_locks=gpu_locks,
            log=log,
        )
        """Prepared claims' MPS daemons: a gone one started again (by a repeated prepare and
        the agent's watch loop)."""

    # -- prepare -----------------------------------------------------------------------------
    def prepare_batch(self, batch: Batch) -> None:
        """Prepare a call's claims with one checkpoint write to start them and one to complete
        them (group commit):

        1. every claim read and planned (concurrently); an already prepared one is answered;
           steps 2 to 4 go on with the claims read within ``batch.GROUP_WINDOW_S`` (all of
           them, normally), and again for each claim read later, as soon as it is read (one
           slow read never holds back the others' answers);
        2. under the checkpoint lock, each is checked against the holders so far and recorded
           as ``PrepareStarted`` (the devices are reserved); ONE write makes the records
           durable, and only when some claim changes the node in a way only its record can
           undo (time-slicing, MPS, a whole GPU taken out of MIG mode): a claim whose only
           effects are its CDI spec and dynamic MIG devices needs no durable start, since a
           crash before its completion leaves a spec that the checkpoint does not list as
           completed and MIG instances no completed claim owns, which the next start removes
           and sweeps;
        3. each claim's side effects and CDI spec (concurrently, under its GPUs' locks); a
           failure undoes that claim alone;
        4. ONE write records them all as ``PrepareCompleted``; then they are answered. The
           specs are not fsync'd (derived state: ``CdiWriter._atomic``), the completion is.
        """
        with self._claim_locks.hold_all(c.uid for c, _ in batch.claims):
            keys = [c for c, _ in batch.claims]
            # claims read within the group window go on together; one read later goes on as
            # soon as it is read, so a slow read never holds back the others' answers
            reads = batch.waves(keys, self._plan, concurrent=self._claims.reads_block)
            for wave in reads:
                planned: list[_Planned] = []
                for claim, outcome in wave:
                    if isinstance(outcome, NotRun):
                        batch.answer(claim, shutting_down(claim))
                    elif isinstance(outcome, BaseException):
                        batch.fail(claim, outcome)
                    elif isinstance(outcome, ClaimResult):
                        batch.succeed(claim, outcome)
                    else:
                        planned.append(outcome)
                self._complete(batch, planned)

    def _complete(self, batch: Batch, planned: list[_Planned]) -> None:
        """Steps 2 to 4 of the claims read and planned together (one wave of a batch)."""
        started = self._start(batch, planned)
        if not started:
            return
        self._crash("after-started")
        made: list[ClaimEntry] = []
        entries = self._make_all(batch, started)
        for p, entry in zip(started, entries, strict=True):
            if isinstance(entry, BaseException):
                if isinstance(entry, TesseraError):
                    self._roll_back(self._ledger.checkpoint.claims[p.claim.uid], quiet=True)
                batch.fail(p.claim, entry)
            else:
                made.append(entry)
        if not made:
            return
        try:
            self._ledger.update(lambda cp: cp.with_claims(made))
        except TesseraError as exc:  # e.g. the disk is full: no spec may stay behind
            for e in made:
                self._roll_back(self._ledger.checkpoint.claims[e.uid], quiet=True)
                batch.fail(claim_key(e), exc)
            return
        self._crash("after-completed")
        for e in made:
            self._log.info(
                "prepared claim",
                extra=fields_(
                    claim=str(claim_key(e)), devices=",".join(d.device for d in e.devices)
                ),
            )
            batch.succeed(claim_key(e), ClaimResult(devices=e.devices))

    def _plan(self, claim: ClaimKey) -> _Planned | ClaimResult:
        """Step 1 of one claim: its result when it is prepared already, else its plan (an
        interrupted or recovered earlier prepare of it rolled back first)."""
        existing = self._ledger.checkpoint.claims.get(claim.uid)
        if (
            existing is not None
            and not existing.recovered  # recovered: its names are not known
            and (existing.namespace, existing.name) != (claim.namespace, claim.name)
        ):
            raise ClaimError(
                f"claim {claim}: UID {claim.uid!r} is prepared as"
                f" {existing.namespace}/{existing.name}",
                "uid_mismatch",
            )
        if (
            existing is not None
            and existing.state == PREPARE_COMPLETED
            and not existing.recovered  # identity unknown: prepared again from the claim
        ):
            existing = self.mps_watch.ensure(existing)  # success only with its daemon
            self._ensure_spec(existing)
            return ClaimResult(devices=existing.devices)
        try:
            obj = self._claims.get(claim.namespace, claim.name)
        except KubeError as exc:
            raise ClaimError(f"claim {claim}: cannot read it: {exc}", "api_error") from exc
        allocation = parse_allocation(obj, claim, self._driver_name, self._pool)
        try:
            plan = plan_claim(allocation, self._devices(), self._sharing)
        except ParamsError as exc:
            raise ClaimError(
                f"claim {claim}: invalid configuration: {exc}", "invalid_config"
            ) from exc
        if existing is not None:  # left by a crash, or recovered: roll back first
            self._roll_back(existing)
        records = tuple(self._records.device(claim.uid, p) for p in plan.devices)
        changes = self._effects.changes_node(plan)
        spec_only = not changes and self._effects.spec_only(plan) and self._metadata is None
        return _Planned(claim, plan, records, changes, pod_claim_name(obj), spec_only)

    def _start(self, batch: Batch, planned: list[_Planned]) -> list[_Planned]:
        """Step 2: reserve the planned claims' devices (each checked against the holders so
        far, this batch's included) and make the start durable when some claim needs it;
        returns the claims started, answering the others."""
        if not planned:
            return []
        with self._ledger.lock:
            cp, started = self._ledger.checkpoint, []
            for p in planned:
                try:
                    conflicts(cp, p.claim, self._pool, p.plan.devices, self._sharing)
                except TesseraError as exc:
                    batch.fail(p.claim, exc)
                    continue
                entry = claim_entry(p.claim, PREPARE_STARTED, p.records, pods=p.plan.pods)
                cp = cp.with_claim(entry)
                started.append(p)
            if not any(p.changes_node for p in started):
                self._ledger.adopt(cp)  # nothing to undo after a crash: see prepare_batch
                return started
            try:
                self._ledger.commit(cp)
            except TesseraError as exc:
                for p in started:
                    batch.fail(p.claim, exc)
                return []
        return started

    def _make_all(self, batch: Batch, started: list[_Planned]) -> list[ClaimEntry | BaseException]:
        """Step 3 of every started claim, in their order: concurrently those that make
        something on the node (NVML, node tools, sysfs: their waits overlap), in the batch's own
        thread those that only write their spec (a hand-off to another thread would cost more
        than the write: 64 whole GPUs in one call, ``python -m bench prepare``). The base CDI
        spec every claim's spec needs is made sure of once, first: when it cannot be written,
        every claim fails with that error (and is rolled back)."""
        try:
            self._records.ensure_base()
        except TesseraError as exc:
            return [exc for _ in started]
        slow = [p for p in started if not p.spec_only]
        done = dict(zip((id(p) for p in slow), batch.each(slow, self._make), strict=True))
        out: list[ClaimEntry | BaseException] = []
        for p in started:
            if p.spec_only:
                try:
                    out.append(self._make(p))
                except Exception as exc:  # as batch.each: each claim's failure is its own
                    out.append(exc)
            else:
                out.append(done[id(p)])
        return out

    def _make(self, p: _Planned) -> ClaimEntry:
        """Step 3 of one claim: its side effects and its CDI spec; the completed entry (not yet
        recorded)."""
        claim, plan = p.claim, p.plan

        def save(devices: tuple[PreparedDevice, ...], mps: MpsRecord | None) -> None:
            entry = claim_entry(claim, PREPARE_STARTED, devices, pods=plan.pods, mps=mps)
            self._ledger.update(lambda cp: cp.with_claim(entry))

        with self._gpu_locks.hold_all(gpus(p.records)):
            applied = self._effects.apply(claim, plan, p.records, save)
        devices = applied.devices
        if self._metadata is not None:  # before the completion: a crash leaves it to the start
            advertised = {d.device.name: d.device for d in plan.devices}
            devices = prepare_metadata(
                self._metadata, claim, p.pod_claim_name, devices, advertised.get
            )
        entry = claim_entry(claim, PREPARE_COMPLETED, devices, pods=plan.pods, mps=applied.mps)
        if entry.devices:  # not fsync'd: derived state (CdiWriter._atomic)
            self._records.write_spec(entry, fresh=True)  # the base: _make_all
        self._crash("after-cdi")
        return entry

    def _roll_back(self, entry: ClaimEntry, quiet: bool = False) -> None:
        """Undo whatever ``entry`` got to and forget it (a failed, interrupted or recovered
        prepare). When undoing fails, the entry stays (its devices stay held) and the error
        is raised: the claim's next prepare or unprepare tries again.

        The GPUs' locks are held until the entry is gone: another claim's undo on the same GPU
        then sees this one either holding the GPU or gone, never gone in the settings and
        still there in the checkpoint (two time-sliced claims unprepared at once must not
        each leave the interval to the other)."""
        claim = f"{entry.namespace}/{entry.name}"
        with self._gpu_locks.hold_all(gpus(entry.devices)):
            try:
                self._effects.undo(entry, self._ledger.checkpoint)
                self._cdi.remove(entry.uid)
                if self._metadata is not None:
                    self._metadata.remove(entry.uid)
            except TesseraError as exc:
                self._log.error(
                    "cannot undo a claim's partial prepare; its devices stay held until a retry"
                    " succeeds",
                    extra=fields_(claim=claim, uid=entry.uid, error=str(exc)),
                )
                if not quiet:
                    raise
                return
            try:
                self._ledger.update(lambda cp: cp.without_claim(entry.uid))
            except TesseraError as exc:
                # Undone, but the checkpoint cannot say so (a full disk): forget it here all the
                # same. A started record left in the file is rolled back again at the next start
                # (undo is idempotent), and any write before that (every claim that changes the
                # node writes its start first) rewrites the file without it.
                with self._ledger.lock:
                    self._ledger.adopt(self._ledger.checkpoint.without_claim(entry.uid))
                self._log.warning(
                    "undid a claim's partial prepare; the checkpoint cannot record it yet",
                    extra=fields_(claim=claim, uid=entry.uid, error=str(exc)),
                )
                if not quiet:
                    raise

    def _ensure_spec(self, entry: ClaimEntry) -> None:
        """A prepared claim is only prepared with its CDI spec: one deleted since is written
        again from the record (the container runtime needs it to start the pod)."""
        if entry.devices and not self._cdi.path(entry.uid).exists():
            self._records.write_spec(entry)
            self._log.warning(
                "re-wrote the missing CDI spec of a prepared claim",
                extra=fields_(claim=f"{entry.namespace}/{entry.name}", uid=entry.uid),
            )

    # -- unprepare ---------------------------------------------------------------------------
    def unprepare_batch(self, batch: Batch) -> None:
        """Unprepare a call's claims with one checkpoint write: undo each claim's side effects,
        then release every undone claim's record in ONE write, then remove their CDI specs
        (one directory sync). A failure to undo answers that claim with the error and keeps
        its record (its devices stay held; the kubelet retries), and a crash in between leaves
        records whose undo the retry repeats (every step is idempotent). The CDI spec goes
        last, also one an earlier crash left.

        The locks of every GPU the claims hold are kept until their records are gone, and the
        claims of one GPU are undone one after the other, each seeing the ones before it
        released: another claim's undo on the same GPU then sees this one either holding the
        GPU or gone, never gone from the GPU's settings and still recorded (two time-sliced
        claims unprepared at once must not each leave the interval to the other)."""
        keys = [c for c, _ in batch.claims]
        with self._claim_locks.hold_all(c.uid for c in keys):
            entries = [
                e for c in keys if (e := self._ledger.checkpoint.claims.get(c.uid)) is not None
            ]
            failed: set[str] = set()
            released: list[ClaimEntry] = []
            with self._gpu_locks.hold_all(g for e in entries for g in gpus(e.devices)):
                undone: set[str] = set()
                guard = threading.Lock()

                def undo_group(group: list[ClaimEntry]) -> list[tuple[ClaimEntry, Exception]]:
                    errors = []
                    for e in group:
                        with guard:
                            remaining = self._ledger.checkpoint.without_claims(undone)
                        try:
                            self._effects.undo(e, remaining)
                        except Exception as exc:
                            errors.append((e, exc))
                            continue
                        self._crash("after-unprepare-undo")
                        with guard:
                            undone.add(e.uid)
                    return errors

                # the MPS daemons first, all at once: each is its claim's alone, and a wedged
                # one takes the stop's whole timeout (about 10 s); stopped one after another in
                # the GPU's serial undo, six of them outlasted the kubelet's call. A failure
                # here is the undo's to report (it stops the daemon again)
                batch.each([e for e in entries if e.mps is not None], self._effects.stop_mps)
                groups = _by_gpu(entries, self._effects.changes_node_of)
                for outcome in batch.each(groups, undo_group):
                    if isinstance(outcome, BaseException):  # a bug outside undo itself
                        raise outcome
                    for e, exc in outcome:
                        failed.add(e.uid)
                        batch.fail(claim_key(e), exc)
                released = [e for e in entries if e.uid in undone]
                if released:
                    try:
                        self._ledger.update(lambda cp: cp.without_claims(e.uid for e in released))
                    except CheckpointError as exc:  # e.g. the disk is full
                        for e in released:
                            failed.add(e.uid)
                            kept = CheckpointError(
                                f"claim {claim_key(e)}: its release cannot be recorded ({exc}):"
                                " it stays prepared, its devices held, until the kubelet's retry"
                                " succeeds"
                            )
                            kept.__cause__ = exc
                            batch.fail(claim_key(e), kept)
                        released = []
            if released:
                self._crash("after-unprepare-commit")
            for e in released:
                self._log.info("unprepared claim", extra=fields_(claim=str(claim_key(e))))
                try:
                    self._on_unprepared(e)
                except Exception as exc:  # a summary's bug must never fail the unprepare
                    self._log.error(
                        "unprepared-claim hook failed",
                        extra=fields_(claim=str(claim_key(e)), error=repr(exc)),
                    )
            rest = [c for c in keys if c.uid not in failed]
            removed = self._cdi.remove_many([c.uid for c in rest])
            if self._metadata is not None:
                removed = self._metadata.remove_many([c.uid for c in rest]) | removed
            for c in rest:
                error = removed.get(c.uid)
                if error is not None:
                    batch.fail(c, error)
                else:
                    batch.succeed(c, ClaimResult())
