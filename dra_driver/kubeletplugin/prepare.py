"""Prepare and unprepare claims: the per-claim state machine, run a kubelet call at a time.

The claims of one kubelet call are one batch (``Preparer._prepare_batch``) and share their
checkpoint writes (group commit):

1. each claim is read and planned (``plan.plan_claim``, pure: our devices, their configs, how
   each is shared); a ``PrepareCompleted`` entry is answered as it is; a ``PrepareStarted`` (or
   recovered) one is rolled back first;
2. under the checkpoint lock, each claim is checked against the holders so far
   (``plan.conflicts``) and recorded as ``PrepareStarted`` with its plan (its devices are now
   reserved); one write makes the batch's records durable when some claim changes the node
   (dynamic MIG, time-slicing, MPS): a claim whose only effect is its CDI spec needs no durable
   start (a crash before it completes leaves a spec the checkpoint does not list, which the
   next start removes);
3. each claim's side effects, under the locks of its GPUs (``sharing.effects``): dynamic MIG
   devices created, time-slicing and MPS set up (an MPS daemon recorded as soon as it runs);
   then its CDI spec (idempotent, discoverable by its file name);
4. one write records every claim that got there as ``PrepareCompleted``.

A failure in step 3 undoes what that claim got to before it answers; the others go on. A crash
between any two steps is repaired by the next prepare of the claim (the kubelet retries) or by
``reconcile_on_start``. Claims of a batch and of concurrent batches touching different GPUs run
concurrently; the same claim from many callers is serialized by a per-claim lock, side effects
on one GPU by a per-GPU lock. Unprepare is batched the same way (``_unprepare_batch``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import CancelledError, Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from agent.errors import TesseraError
from agent.logs import fields_
from agent.nvml.types import MigInstance
from dra_driver.device_model import AdvertisedDevice, DeviceModel
from dra_driver.errors import CdiError, CheckpointError, ClaimError, KubeError, ParamsError
from dra_driver.kubeletplugin.cdi import CdiRequest, CdiWriter
from dra_driver.kubeletplugin.cdi import SpecEvidence as CdiEvidence
from dra_driver.kubeletplugin.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    Checkpoint,
    CheckpointStore,
    ClaimEntry,
    MpsRecord,
    PreparedDevice,
)
from dra_driver.kubeletplugin.claims import ClaimIndex, ClaimKey, ClaimSource, parse_allocation
from dra_driver.kubeletplugin.effects import Effects, mps_edits
from dra_driver.kubeletplugin.plan import (
    ClaimPlan,
    PlannedDevice,
    SharingPolicy,
    conflicts,
    plan_claim,
)
from dra_driver.kubeletplugin.rebuild import Rebuilt, Unrecovered, decide
from dra_driver.sharing.mps import MpsDaemon

T = TypeVar("T")
R = TypeVar("R")
CrashHook = Callable[[str], None]
Observer = Callable[[str, float, str | None], None]
"""``observe(operation, seconds, error reason or None)`` after every claim (for metrics)."""
CRASH_POINTS = (
    "after-started",
    "after-gi-create",
    "after-ci-create",
    "after-compute-policy",
    "after-mps-start",
    "after-cdi",
    "after-completed",
    "after-unprepare-undo",
    "after-unprepare-commit",
)


@dataclass(frozen=True)
class ClaimResult:
    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


def _cdi_requests(devices: Sequence[PreparedDevice]) -> list[CdiRequest]:
    """What the CDI spec of a claim's recorded devices contains."""
    return [
        CdiRequest(
            device_name=d.device,
            gpu_minor=d.gpu_minor,
            gpu_instance_id=d.gpu_instance_id,
            compute_instance_id=d.compute_instance_id,
        )
        for d in devices
    ]


def _gpus(devices: Iterable[PreparedDevice]) -> set[str]:
    return {d.gpu_uuid for d in devices if d.gpu_uuid}


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
        return self._cdi.device_nodes(uid, _cdi_requests(devices))


class _NotRun(Exception):
    """A claim's step that never began: the agent is stopping."""


@dataclass(frozen=True)
class _Planned:
    """A claim read and planned (step 1 of its prepare)."""

    claim: ClaimKey
    plan: ClaimPlan
    records: tuple[PreparedDevice, ...]
    changes_node: bool
    """Whether its prepare changes the node beyond its CDI spec (its start must be durable)."""


class _Batch:
    """The claims of one kubelet call, each with the future its caller waits on."""

    def __init__(
        self, op: str, claims: list[tuple[ClaimKey, Future[ClaimResult]]], started: float
    ) -> None:
        self.op = op
        self.claims = claims
        self.started = started
        self._futures = {c.uid: f for c, f in claims}

    def answer(self, claim: ClaimKey, result: ClaimResult) -> None:
        """Answer ``claim`` (its first answer counts)."""
        fut = self._futures[claim.uid]
        if not fut.done():
            with suppress(InvalidStateError):  # cancelled meanwhile: the agent is stopping
                fut.set_result(result)

    def open(self) -> list[tuple[ClaimKey, Future[ClaimResult]]]:
        return [(c, f) for c, f in self.claims if not f.done()]


def _key(entry: ClaimEntry) -> ClaimKey:
    return ClaimKey(entry.namespace, entry.name, entry.uid)


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
        gpus = _gpus(e.devices) or {f"claim:{e.uid}"}
        touching = [g for g in groups if g[0] & gpus]
        merged_gpus, merged = set(gpus), []
        for g in touching:
            groups.remove(g)
            merged_gpus |= g[0]
            merged += g[1]
        groups.append((merged_gpus, sorted([*merged, e], key=entries.index)))
    return ([plain] if plain else []) + [g[1] for g in groups]


def _shutting_down(claim: ClaimKey) -> ClaimResult:
    return ClaimResult(
        error=f"claim {claim}: the agent is shutting down; the kubelet retries it with the next"
        " agent"
    )


class ClaimLocks:
    """One lock per key (a claim UID, a GPU UUID), kept only while some call uses it: the same
    claim from several callers is serialized, and a claim that is gone leaves nothing behind."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}

    @contextmanager
    def hold(self, uid: str) -> Iterator[None]:
        with self._guard:
            lock, users = self._locks.get(uid) or (threading.Lock(), 0)
            self._locks[uid] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, users = self._locks[uid]
                if users == 1:
                    del self._locks[uid]
                else:
                    self._locks[uid] = (lock, users - 1)

    @contextmanager
    def hold_all(self, keys: Iterable[str]) -> Iterator[None]:
        """Hold the locks of every key, taken in sorted order (so two callers never wait on
        each other the other way round)."""
        with ExitStack() as stack:
            for key in sorted(set(keys)):
                stack.enter_context(self.hold(key))
            yield

    def __len__(self) -> int:
        with self._guard:
            return len(self._locks)


def _snake(name: str) -> str:
    """``CdiError`` -> ``cdi_error``."""
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


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
    ) -> None:
        """``index`` finds claims by UID (``claims`` itself when it can; the API server or the
        claim files), to rebuild a lost checkpoint from the CDI specs that survived."""
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
        self._clock = clock
        self._cp_lock = threading.Lock()
        self.claim_locks = ClaimLocks()
        self.gpu_locks = ClaimLocks()
        # unprepare never queues behind prepares of other claims (a slow claim read holds a
        # prepare worker, never an unprepare one)
        self._pools = {
            "prepare": ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prepare"),
            "unprepare": ThreadPoolExecutor(max_workers=workers, thread_name_prefix="unprepare"),
        }
        """One thread per call being worked on (a batch)."""
        self._steps = {
            op: ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"{op}-step")
            for op in self._pools
        }
        """The claims of a batch, concurrently (claim reads, side effects, CDI specs, undo)."""
        self._running: dict[Future[ClaimResult], tuple[ClaimKey, str, float]] = {}
        self._running_lock = threading.Lock()
        self._closed = False
        self._cp: Checkpoint | None = None
        self.index = index
        self._unrecovered: dict[str, Unrecovered] = {}

    # -- checkpoint access -------------------------------------------------------------------
    @property
    def checkpoint(self) -> Checkpoint:
        if self._cp is None:
            raise RuntimeError("reconcile_on_start() first")
        return self._cp

    def prepared_claims(self) -> tuple[ClaimEntry, ...]:
        """The claims whose prepare completed: who holds which device now (a read-only view for
        telemetry; entries are immutable)."""
        return tuple(
            e
            for e in self.checkpoint.claims.values()
            if e.state == PREPARE_COMPLETED and not e.recovered
        )

    def unrecovered(self) -> list[Unrecovered]:
        """The claims whose prepared state could not be rebuilt at start and that are still
        held (their devices stay reserved until the kubelet unprepares or prepares them): for
        /readyz, the metrics and the operator."""
        claims = self.checkpoint.claims
        return [
            u
            for uid, u in sorted(self._unrecovered.items())
            if uid in claims and claims[uid].recovered
        ]

    def _commit(self, cp: Checkpoint) -> None:
        """Save, then adopt: memory never runs ahead of the file, except for the started
        records of claims that change nothing on the node (``_start``). Caller holds
        _cp_lock."""
        self.store.save(cp)
        self._cp = cp

    def _update(self, change: Callable[[Checkpoint], Checkpoint]) -> None:
        """Commit ``change`` of the checkpoint as it is now."""
        with self._cp_lock:
            self._commit(change(self.checkpoint))

    # -- start-up ----------------------------------------------------------------------------
    def reconcile_on_start(self) -> None:
        """Load the checkpoint and make reality match it, logging every action.

        CDI specs of ours on disk are evidence of prepared claims. A spec the checkpoint does
        not list is removed only when the checkpoint proves the claim released (it was read from
        this boot's file) or the spec predates this boot (no container survives a reboot).
        Otherwise (the checkpoint is missing or was corrupt) the claim is recorded as recovered:
        its devices stay held until the kubelet unprepares or prepares it again, so lost state
        never gives a device out twice."""
        result = self.store.load()
        cp = result.checkpoint
        if result.corrupt_moved_to is not None:
            self.log.error(
                "checkpoint was corrupt; moved aside; claims whose CDI specs are on disk keep"
                " their devices",
                extra=fields_(moved_to=str(result.corrupt_moved_to), reason=result.corrupt_reason),
            )
        if result.rebooted:
            self.log.warning("node rebooted since the checkpoint: prepared state discarded")
        if result.migrated_from is not None:
            self.log.info("checkpoint migrated", extra=fields_(from_version=result.migrated_from))
        with self._cp_lock:
            for entry in list(cp.claims.values()):
                if entry.state == PREPARE_STARTED:
                    rest = cp.without_claim(entry.uid)
                    if self._start_step("roll back", entry, partial(self._undo, entry, rest)):
                        cp = rest
                        self.log.warning(
                            "rolled back an interrupted prepare",
                            extra=fields_(claim=f"{entry.namespace}/{entry.name}", uid=entry.uid),
                        )
            for uid in sorted(self.cdi.claim_uids() - set(cp.claims)):
                cp = self._unlisted_spec(cp, uid, result.authoritative)
            cp = self._rebuild(cp)
            try:
                self.effects.sweep(cp)
            except TesseraError as exc:
                self.log.error(
                    "cannot sweep partitions and MPS daemons no claim owns; retried at the next"
                    " start",
                    extra=fields_(error=str(exc)),
                )
            for entry in list(cp.claims.values()):
                restored = self._start_step("restore", entry, partial(self.effects.restore, entry))
                changed = restored is not None and restored[0] != entry
                if restored is not None and changed:
                    cp = cp.with_claim(restored[0])
                current = cp.claims[entry.uid]
                if current.devices and (changed or current.uid not in self.cdi.claim_uids()):
                    self._write_spec(current)
                    self.log.warning(
                        "restored the CDI spec of a prepared claim",
                        extra=fields_(
                            claim=f"{entry.namespace}/{entry.name}",
                            uid=entry.uid,
                            reason="its devices were made again" if changed else "it was missing",
                        ),
                    )
            self._commit(cp)

    def _start_step(self, what: str, entry: ClaimEntry, step: Callable[[], T]) -> tuple[T] | None:
        """One claim's step at start: ``(its result,)``, or None when it failed; a failure is
        logged (the claim's next prepare or unprepare tries again, and a rolled-back claim
        keeps its devices until then) and never keeps the agent from starting."""
        try:
            return (step(),)
        except TesseraError as exc:
            self.log.error(
                f"cannot {what} a claim's sharing and partitions at start",
                extra=fields_(
                    claim=f"{entry.namespace}/{entry.name}", uid=entry.uid, error=str(exc)
                ),
            )
            return None

    def _unlisted_spec(self, cp: Checkpoint, uid: str, authoritative: bool) -> Checkpoint:
        """Decide about the CDI spec of a claim the checkpoint does not list (see
        ``reconcile_on_start``); returns the checkpoint with a recovered entry if it is kept."""
        try:
            names, written_at = self.cdi.evidence(uid)
        except CdiError as exc:
            names, written_at = (), self.boot_time  # unreadable: not proof of anything
            self.log.warning("cannot read a CDI spec", extra=fields_(uid=uid, error=str(exc)))
        if authoritative or written_at < self.boot_time:
            self.cdi.remove(uid)
            why = "released in the checkpoint" if authoritative else "written before this boot"
            self.log.warning("removed orphaned CDI spec", extra=fields_(uid=uid, reason=why))
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
        if self.index is None:
            source_error = "no claim source to look claims up by UID"
        else:
            try:
                found = dict(self.index.by_uid(uids))
            except (KubeError, ClaimError) as exc:
                source_error = str(exc)
        origin = f"cdi-spec+{self.index.origin if self.index is not None else 'nothing'}"
        leftovers = _NodeLeftovers(self.effects, self.cdi)
        model = self.devices()
        for uid in uids:
            outcome: Rebuilt | Unrecovered
            try:
                spec = self.cdi.read_evidence(uid)
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
                self.log.warning(
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
                self.log.error(
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
                driver=self.driver_name,
                pool=self.pool,
                model=model,
                sharing=self.sharing,
                record=self._record,
                leftovers=leftovers,
                rebuilt_from=origin,
            )
            if isinstance(outcome, Rebuilt):
                conflicts(accounted, outcome.key, self.pool, outcome.plan.devices, self.sharing)
        except ClaimError as exc:
            return Unrecovered(spec.uid, "conflict", str(exc))
        except TesseraError as exc:  # reading a MIG device or MPS daemon failed
            return Unrecovered(spec.uid, "leftovers_inconsistent", str(exc))
        return outcome

    def _recovered_device(self, uid: str, name: str) -> PreparedDevice:
        """A device named in a recovered CDI spec, described as the node advertises it now."""
        try:
            d = self.devices().device(name)
        except (KeyError, ClaimError):
            return PreparedDevice((), self.pool, name, (), "gpu", "", -1)
        return self._record(uid, PlannedDevice(d, (), None))

    # -- calls -------------------------------------------------------------------------------
    def prepare(self, claims: Sequence[ClaimKey]) -> dict[str, ClaimResult]:
        """Prepare the claims of one kubelet call together (see ``_prepare_batch``); one result
        per claim UID, errors per claim."""
        return self._call("prepare", claims)

    def unprepare(self, claims: Sequence[ClaimKey]) -> dict[str, ClaimResult]:
        return self._call("unprepare", claims)

    def _call(self, op: str, claims: Sequence[ClaimKey]) -> dict[str, ClaimResult]:
        """Run one call's claims as one batch in the background and wait for each claim's
        result until the call's deadline: a claim not done by then is answered with an error
        while the batch goes on (a retry returns its result)."""
        deadline = time.monotonic() + self.deadline_s
        first: dict[str, ClaimKey] = {}  # a UID named twice is one claim (its first naming)
        for c in claims:
            first.setdefault(c.uid, c)
        unique = list(first.values())
        futures = self._submit(op, unique)
        if futures is None:
            return {c.uid: _shutting_down(c) for c in unique}
        out: dict[str, ClaimResult] = {}
        for claim, fut in futures:
            try:
                out[claim.uid] = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except CancelledError:  # still queued when the agent began to stop
                out[claim.uid] = _shutting_down(claim)
            except FutureTimeout:
                self.observe(op, self.deadline_s, "timeout")
                self.log.warning(
                    f"{op} not done within its deadline; it goes on in the background",
                    extra=fields_(claim=str(claim), deadline_s=self.deadline_s),
                )
                out[claim.uid] = ClaimResult(
                    error=f"claim {claim}: not done within {self.deadline_s:.0f} s; it goes on in"
                    " the background and a retry returns its result"
                )
        return out

    def _submit(
        self, op: str, claims: list[ClaimKey]
    ) -> list[tuple[ClaimKey, Future[ClaimResult]]] | None:
        """Start the batch on its operation's pool; one future per claim, answered as soon as
        that claim is done. None once the preparer is closed."""
        batch = _Batch(op, [(c, Future()) for c in claims], time.monotonic())
        with self._running_lock:
            if self._closed:
                return None
            now = self._clock()
            for claim, fut in batch.claims:
                self._running[fut] = (claim, op, now)
                fut.add_done_callback(self._finished)
            runner = self._pools[op].submit(self._run, batch)
        runner.add_done_callback(partial(self._runner_done, batch))
        return batch.claims

    def _runner_done(self, batch: _Batch, runner: Future[None]) -> None:
        """A batch cancelled before it ran (the agent is stopping) cancels its claims."""
        if runner.cancelled():
            for _, fut in batch.claims:
                fut.cancel()

    def stuck(self) -> list[str]:
        """The claims whose prepare or unprepare has run longer than the call deadline (a
        worker that is stuck: for /readyz, the metrics and the log)."""
        now = self._clock()
        with self._running_lock:
            running = list(self._running.values())
        return sorted(
            f"{op} {claim}" for claim, op, started in running if now - started > self.deadline_s
        )

    def _finished(self, fut: Future[ClaimResult]) -> None:
        with self._running_lock:
            self._running.pop(fut, None)

    def _run(self, batch: _Batch) -> None:
        """The batch, on its pool's thread; a bug answers every claim not yet answered."""
        try:
            if batch.op == "prepare":
                self._prepare_batch(batch)
            else:
                self._unprepare_batch(batch)
        except Exception as exc:  # last resort: never leave a claim unanswered
            for claim, _ in batch.open():
                batch.answer(claim, self._failed(batch, claim, exc))
        except BaseException as exc:  # not ours to handle: the callers get it
            for _, fut in batch.open():
                with suppress(InvalidStateError):
                    fut.set_exception(exc)
            raise

    def _failed(self, batch: _Batch, claim: ClaimKey, exc: BaseException) -> ClaimResult:
        """A claim's error answer, logged and counted: its own message for a TesseraError,
        "internal error" (with the traceback in the log) for a bug."""
        seconds = time.monotonic() - batch.started
        if isinstance(exc, TesseraError):
            reason = getattr(exc, "reason", None) or _snake(type(exc).__name__)
            self.observe(batch.op, seconds, reason)
            self.log.warning(
                f"{batch.op} failed", extra=fields_(claim=str(claim), error=str(exc), reason=reason)
            )
            return ClaimResult(error=str(exc))
        self.observe(batch.op, seconds, "internal_error")
        self.log.error(
            f"{batch.op} failed with an internal error",
            exc_info=exc,
            extra=fields_(claim=str(claim), error=f"{type(exc).__name__}: {exc}"),
        )
        return ClaimResult(
            error=f"claim {claim}: internal error in the driver ({type(exc).__name__}: {exc});"
            " see the agent's log"
        )

    def _succeeded(self, batch: _Batch, claim: ClaimKey, result: ClaimResult) -> None:
        self.observe(batch.op, time.monotonic() - batch.started, None)
        batch.answer(claim, result)

    def _each(
        self, batch: _Batch, items: Sequence[T], fn: Callable[[T], R], finish: bool = True
    ) -> list[R | BaseException]:
        """``fn`` of every item, concurrently on the operation's step pool (inline for one
        item); an exception is returned in the item's place. Once the agent is stopping, an
        item not yet begun is run inline when ``finish`` (a claim already started finishes)
        and is ``_NotRun`` otherwise."""

        def outcome(item: T) -> R | BaseException:
            try:
                return fn(item)
            except Exception as exc:
                return exc

        if len(items) <= 1:
            return [outcome(i) for i in items]
        futures: list[Future[R | BaseException] | None] = []
        for item in items:
            try:
                futures.append(self._steps[batch.op].submit(outcome, item))
            except RuntimeError:  # shut down: the agent is stopping
                futures.append(None)
        results: list[R | BaseException] = []
        for item, fut in zip(items, futures, strict=True):
            if fut is not None:
                try:
                    results.append(fut.result())
                    continue
                except CancelledError:
                    pass
            results.append(outcome(item) if finish else _NotRun())
        return results

    # -- prepare -----------------------------------------------------------------------------
    def _prepare_batch(self, batch: _Batch) -> None:
        """Prepare a call's claims with one checkpoint write to start them and one to complete
        them (group commit):

        1. every claim read and planned (concurrently); an already prepared one is answered;
        2. under the checkpoint lock, each is checked against the holders so far and recorded
           as ``PrepareStarted`` (the devices are reserved); ONE write makes the records
           durable, and only when some claim changes the node (dynamic MIG, time-slicing, MPS,
           a whole GPU taken out of MIG mode): a claim whose only effect is its CDI spec needs
           no durable start, since a crash before its completion leaves a spec that the
           checkpoint does not list as completed, which the next start removes;
        3. each claim's side effects and CDI spec (concurrently, under its GPUs' locks); a
           failure undoes that claim alone;
        4. ONE write records them all as ``PrepareCompleted``; then they are answered.
        """
        with self.claim_locks.hold_all(c.uid for c, _ in batch.claims):
            planned: list[_Planned] = []
            keys = [c for c, _ in batch.claims]
            plans = self._each(batch, keys, self._plan, finish=False)
            for claim, outcome in zip(keys, plans, strict=True):
                if isinstance(outcome, _NotRun):
                    batch.answer(claim, _shutting_down(claim))
                elif isinstance(outcome, BaseException):
                    batch.answer(claim, self._failed(batch, claim, outcome))
                elif isinstance(outcome, ClaimResult):
                    self._succeeded(batch, claim, outcome)
                else:
                    planned.append(outcome)
            started = self._start(batch, planned)
            if not started:
                return
            self.crash("after-started")
            made: list[ClaimEntry] = []
            entries = self._each(batch, started, self._make)
            for p, entry in zip(started, entries, strict=True):
                if isinstance(entry, BaseException):
                    if isinstance(entry, TesseraError):
                        self._roll_back(self.checkpoint.claims[p.claim.uid], quiet=True)
                    batch.answer(p.claim, self._failed(batch, p.claim, entry))
                else:
                    made.append(entry)
            if not made:
                return
            try:
                self._update(lambda cp: cp.with_claims(made))
            except TesseraError as exc:  # e.g. the disk is full: no spec may stay behind
                for e in made:
                    self._roll_back(self.checkpoint.claims[e.uid], quiet=True)
                    batch.answer(_key(e), self._failed(batch, _key(e), exc))
                return
            self.crash("after-completed")
            for e in made:
                self.log.info(
                    "prepared claim",
                    extra=fields_(
                        claim=str(_key(e)), devices=",".join(d.device for d in e.devices)
                    ),
                )
                self._succeeded(batch, _key(e), ClaimResult(devices=e.devices))

    def _plan(self, claim: ClaimKey) -> _Planned | ClaimResult:
        """Step 1 of one claim: its result when it is prepared already, else its plan (an
        interrupted or recovered earlier prepare of it rolled back first)."""
        existing = self.checkpoint.claims.get(claim.uid)
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
            self._ensure_spec(existing)
            return ClaimResult(devices=existing.devices)
        try:
            obj = self.claims.get(claim.namespace, claim.name)
        except KubeError as exc:
            raise ClaimError(f"claim {claim}: cannot read it: {exc}", "api_error") from exc
        allocation = parse_allocation(obj, claim, self.driver_name, self.pool)
        try:
            plan = plan_claim(allocation, self.devices(), self.sharing)
        except ParamsError as exc:
            raise ClaimError(
                f"claim {claim}: invalid configuration: {exc}", "invalid_config"
            ) from exc
        if existing is not None:  # left by a crash, or recovered: roll back first
            self._roll_back(existing)
        records = tuple(self._record(claim.uid, p) for p in plan.devices)
        return _Planned(claim, plan, records, self.effects.changes_node(plan))

    def _start(self, batch: _Batch, planned: list[_Planned]) -> list[_Planned]:
        """Step 2: reserve the planned claims' devices (each checked against the holders so
        far, this batch's included) and make the start durable when some claim needs it;
        returns the claims started, answering the others."""
        if not planned:
            return []
        with self._cp_lock:
            cp, started = self.checkpoint, []
            for p in planned:
                try:
                    conflicts(cp, p.claim, self.pool, p.plan.devices, self.sharing)
                except TesseraError as exc:
                    batch.answer(p.claim, self._failed(batch, p.claim, exc))
                    continue
                entry = self._entry(p.claim, PREPARE_STARTED, p.records, pods=p.plan.pods)
                cp = cp.with_claim(entry)
                started.append(p)
            if not any(p.changes_node for p in started):
                self._cp = cp  # nothing to undo after a crash: see _prepare_batch
                return started
            try:
                self._commit(cp)
            except TesseraError as exc:
                for p in started:
                    batch.answer(p.claim, self._failed(batch, p.claim, exc))
                return []
        return started

    def _make(self, p: _Planned) -> ClaimEntry:
        """Step 3 of one claim: its side effects and its CDI spec; the completed entry (not yet
        recorded)."""
        claim, plan = p.claim, p.plan

        def save(devices: tuple[PreparedDevice, ...], mps: MpsRecord | None) -> None:
            entry = self._entry(claim, PREPARE_STARTED, devices, pods=plan.pods, mps=mps)
            self._update(lambda cp: cp.with_claim(entry))

        with self.gpu_locks.hold_all(_gpus(p.records)):
            applied = self.effects.apply(claim, plan, p.records, save)
        entry = self._entry(
            claim, PREPARE_COMPLETED, applied.devices, pods=plan.pods, mps=applied.mps
        )
        if entry.devices:
            self._write_spec(entry)
        self.crash("after-cdi")
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
        with self.gpu_locks.hold_all(_gpus(entry.devices)):
            try:
                self.effects.undo(entry, self.checkpoint)
                self.cdi.remove(entry.uid)
            except TesseraError as exc:
                self.log.error(
                    "cannot undo a claim's partial prepare; its devices stay held until a retry"
                    " succeeds",
                    extra=fields_(claim=claim, uid=entry.uid, error=str(exc)),
                )
                if not quiet:
                    raise
                return
            try:
                self._update(lambda cp: cp.without_claim(entry.uid))
            except TesseraError as exc:
                # Undone, but the checkpoint cannot say so (a full disk): forget it here all the
                # same. A started record left in the file is rolled back again at the next start
                # (undo is idempotent), and any write before that (every claim that changes the
                # node writes its start first) rewrites the file without it.
                with self._cp_lock:
                    self._cp = self.checkpoint.without_claim(entry.uid)
                self.log.warning(
                    "undid a claim's partial prepare; the checkpoint cannot record it yet",
                    extra=fields_(claim=claim, uid=entry.uid, error=str(exc)),
                )
                if not quiet:
                    raise

    def _undo(self, entry: ClaimEntry, cp: Checkpoint) -> None:
        """At start (nothing runs concurrently): undo the claim's side effects given the claims
        ``cp`` keeps, and remove its CDI spec."""
        self.effects.undo(entry, cp)
        self.cdi.remove(entry.uid)

    def _write_spec(self, entry: ClaimEntry) -> None:
        self.cdi.write_claim(entry.uid, _cdi_requests(entry.devices), mps_edits(entry.mps))

    def _ensure_spec(self, entry: ClaimEntry) -> None:
        """A prepared claim is only prepared with its CDI spec: one deleted since is written
        again from the record (the container runtime needs it to start the pod)."""
        if entry.devices and not self.cdi.path(entry.uid).exists():
            self._write_spec(entry)
            self.log.warning(
                "re-wrote the missing CDI spec of a prepared claim",
                extra=fields_(claim=f"{entry.namespace}/{entry.name}", uid=entry.uid),
            )

    def _record(self, uid: str, p: PlannedDevice) -> PreparedDevice:
        """The checkpoint's record of planned device ``p`` for claim ``uid`` (a dynamic MIG
        device's UUID and instance ids are added once it is created)."""
        d = p.device
        placement = None
        if p.dynamic and d.mig_profile_id is not None and d.mig_placement_start is not None:
            placement = (d.mig_profile_id, d.mig_placement_start, d.mig_placement_size or 0)
        return PreparedDevice(
            request_names=p.request_names,
            pool=self.pool,
            device=d.name,
            cdi_device_ids=(self.cdi.device_id(uid, d.name), self.cdi.base_device_id),
            kind=d.kind,
            gpu_uuid=d.parent_uuid,
            gpu_minor=d.gpu_minor,
            mig_uuid=d.uuid if d.kind == "mig" else None,
            gpu_instance_id=d.gpu_instance_id,
            compute_instance_id=d.compute_instance_id,
            placement=placement,
            sharing=p.sharing,
            interval=p.interval,
            share_id=p.share_id,
            memory_bytes=p.memory_bytes,
        )

    @staticmethod
    def _entry(
        claim: ClaimKey,
        state: str,
        devices: tuple[PreparedDevice, ...],
        pods: tuple[str, ...] = (),
        mps: MpsRecord | None = None,
    ) -> ClaimEntry:
        return ClaimEntry(
            uid=claim.uid,
            namespace=claim.namespace,
            name=claim.name,
            state=state,
            devices=devices,
            updated_at=time.time(),
            mps=mps,
            pods=pods,
        )

    # -- unprepare ---------------------------------------------------------------------------
    def _unprepare_batch(self, batch: _Batch) -> None:
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
        with self.claim_locks.hold_all(c.uid for c in keys):
            entries = [e for c in keys if (e := self.checkpoint.claims.get(c.uid)) is not None]
            failed: set[str] = set()
            released: list[ClaimEntry] = []
            with self.gpu_locks.hold_all(g for e in entries for g in _gpus(e.devices)):
                undone: set[str] = set()
                guard = threading.Lock()

                def undo_group(group: list[ClaimEntry]) -> list[tuple[ClaimEntry, Exception]]:
                    errors = []
                    for e in group:
                        with guard:
                            remaining = self.checkpoint.without_claims(undone)
                        try:
                            self.effects.undo(e, remaining)
                        except Exception as exc:
                            errors.append((e, exc))
                            continue
                        self.crash("after-unprepare-undo")
                        with guard:
                            undone.add(e.uid)
                    return errors

                groups = _by_gpu(entries, self.effects.changes_node_of)
                for outcome in self._each(batch, groups, undo_group):
                    if isinstance(outcome, BaseException):  # a bug outside undo itself
                        raise outcome
                    for e, exc in outcome:
                        failed.add(e.uid)
                        batch.answer(_key(e), self._failed(batch, _key(e), exc))
                released = [e for e in entries if e.uid in undone]
                if released:
                    try:
                        self._update(lambda cp: cp.without_claims(e.uid for e in released))
                    except CheckpointError as exc:  # e.g. the disk is full
                        for e in released:
                            failed.add(e.uid)
                            kept = CheckpointError(
                                f"claim {_key(e)}: its release cannot be recorded ({exc}): it"
                                " stays prepared, its devices held, until the kubelet's retry"
                                " succeeds"
                            )
                            kept.__cause__ = exc
                            batch.answer(_key(e), self._failed(batch, _key(e), kept))
                        released = []
            if released:
                self.crash("after-unprepare-commit")
            for e in released:
                self.log.info("unprepared claim", extra=fields_(claim=str(_key(e))))
            rest = [c for c in keys if c.uid not in failed]
            removed = self.cdi.remove_many([c.uid for c in rest])
            for c in rest:
                error = removed.get(c.uid)
                if error is not None:
                    batch.answer(c, self._failed(batch, c, error))
                else:
                    self._succeeded(batch, c, ClaimResult())

    def close(self, timeout: float) -> list[str]:
        """Stop taking claims and give the running ones up to ``timeout`` seconds to finish.

        New calls are answered with a per-claim "shutting down" error (the kubelet retries them
        with the next agent). Returns the claims still running at the deadline: they are left
        to the next start's reconcile (an interrupted prepare is rolled back and redone)."""
        with self._running_lock:
            self._closed = True
            running = list(self._running)
        for pool in [*self._pools.values(), *self._steps.values()]:
            pool.shutdown(wait=False, cancel_futures=True)
        # a queued claim cancelled by the shutdown never counts as done for wait() (only a
        # worker notifies its waiters): wait for the started ones only
        started = [f for f in running if not f.cancelled()]
        _, not_done = wait_futures(started, timeout=max(0.0, timeout))
        with self._running_lock:
            return sorted(str(self._running[f][0]) for f in not_done if f in self._running)
