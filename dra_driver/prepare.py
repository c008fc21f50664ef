"""Prepare and unprepare claims: the per-claim state machine.

Every prepare is a short fixed sequence (see ``Preparer._prepare_one``):

1. read the claim and compute the plan (``plan.plan_claim``, pure): our devices, their configs,
   how each is shared;
2. under the checkpoint lock: a ``PrepareCompleted`` entry is returned unchanged; a
   ``PrepareStarted`` (or recovered) one is rolled back first; the sharing rule
   (``plan.conflicts``) is checked; the claim is recorded as ``PrepareStarted`` with its plan
   (the devices are now reserved);
3. side effects, under the locks of the claim's GPUs (``sharing.effects``): dynamic MIG devices
   created, time-slicing and MPS set up, each recorded as it is made; then the CDI spec
   (idempotent, discoverable by its file name);
4. under the lock: the entry becomes ``PrepareCompleted``.

A failure in step 3 undoes what the claim got to before it answers. A crash between any two
steps is repaired by the next prepare of the claim (the kubelet retries) or by
``reconcile_on_start``. Claims touching different GPUs run concurrently; the same claim from many
callers is serialized by a per-claim lock, side effects on one GPU by a per-GPU lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from agent.errors import TesseraError
from agent.logs import fields_
from agent.nvml.types import MigInstance
from dra_driver.cdi import CdiRequest, CdiWriter
from dra_driver.cdi import SpecEvidence as CdiEvidence
from dra_driver.checkpoint import (
    PREPARE_COMPLETED,
    PREPARE_STARTED,
    Checkpoint,
    CheckpointStore,
    ClaimEntry,
    MpsRecord,
    PreparedDevice,
)
from dra_driver.claims import ClaimIndex, ClaimKey, ClaimSource, parse_allocation
from dra_driver.devices import AdvertisedDevice, DeviceModel
from dra_driver.errors import CdiError, CheckpointError, ClaimError, KubeError, ParamsError
from dra_driver.plan import ClaimPlan, PlannedDevice, SharingPolicy, conflicts, plan_claim
from dra_driver.rebuild import Rebuilt, Unrecovered, decide
from dra_driver.sharing.effects import Effects, mps_edits
from dra_driver.sharing.mps import MpsDaemon

T = TypeVar("T")
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
        """Save, then adopt: memory never runs ahead of the file. Caller holds _cp_lock."""
        self.store.save(cp)
        self._cp = cp

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

    # -- prepare -----------------------------------------------------------------------------
    def prepare(self, claims: Sequence[ClaimKey]) -> dict[str, ClaimResult]:
        """Prepare every claim (concurrently); one result per claim UID, errors per claim."""
        return self._batch(claims, self._prepare_one)

    def unprepare(self, claims: Sequence[ClaimKey]) -> dict[str, ClaimResult]:
        return self._batch(claims, self._unprepare_one)

    def _batch(
        self, claims: Sequence[ClaimKey], fn: Callable[[ClaimKey], ClaimResult]
    ) -> dict[str, ClaimResult]:
        deadline = time.monotonic() + self.deadline_s
        out: dict[str, ClaimResult] = {}
        futures: dict[str, tuple[ClaimKey, Future[ClaimResult]]] = {}
        op = fn.__name__.strip("_").removesuffix("_one")
        for c in claims:
            fut = self._submit(op, fn, c)
            if fut is None:
                out[c.uid] = _shutting_down(c)
            else:
                futures[c.uid] = (c, fut)
        for uid, (claim, fut) in futures.items():
            try:
                out[uid] = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except CancelledError:  # still queued when the agent began to stop
                out[uid] = _shutting_down(claim)
            except FutureTimeout:
                self.observe(op, self.deadline_s, "timeout")
                self.log.warning(
                    f"{op} not done within its deadline; it goes on in the background",
                    extra=fields_(claim=str(claim), deadline_s=self.deadline_s),
                )
                out[uid] = ClaimResult(
                    error=f"claim {claim}: not done within {self.deadline_s:.0f} s; it goes on in"
                    " the background and a retry returns its result"
                )
        return out

    def _submit(
        self, op: str, fn: Callable[[ClaimKey], ClaimResult], claim: ClaimKey
    ) -> Future[ClaimResult] | None:
        """Run one claim on its operation's pool; None once the preparer is closed."""
        with self._running_lock:
            if self._closed:
                return None
            fut = self._pools[op].submit(self._guard, fn, claim)
            self._running[fut] = (claim, op, self._clock())
        fut.add_done_callback(self._finished)
        return fut

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

    def _guard(self, fn: Callable[[ClaimKey], ClaimResult], claim: ClaimKey) -> ClaimResult:
        op = fn.__name__.strip("_").removesuffix("_one")
        started = time.monotonic()
        try:
            result = fn(claim)
        except TesseraError as exc:
            reason = getattr(exc, "reason", None) or _snake(type(exc).__name__)
            self.observe(op, time.monotonic() - started, reason)
            self.log.warning(
                f"{op} failed", extra=fields_(claim=str(claim), error=str(exc), reason=reason)
            )
            return ClaimResult(error=str(exc))
        except Exception as exc:  # last resort: a bug answers this claim, never the whole call
            self.observe(op, time.monotonic() - started, "internal_error")
            self.log.error(
                f"{op} failed with an internal error",
                exc_info=exc,
                extra=fields_(claim=str(claim), error=f"{type(exc).__name__}: {exc}"),
            )
            return ClaimResult(
                error=f"claim {claim}: internal error in the driver ({type(exc).__name__}: {exc});"
                " see the agent's log"
            )
        self.observe(op, time.monotonic() - started, None)
        return result

    def _prepare_one(self, claim: ClaimKey) -> ClaimResult:
        with self.claim_locks.hold(claim.uid):
            existing = self.checkpoint.claims.get(claim.uid)
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
            with self._cp_lock:
                conflicts(self.checkpoint, claim, self.pool, plan.devices, self.sharing)
                self._commit(
                    self.checkpoint.with_claim(
                        self._entry(claim, PREPARE_STARTED, records, pods=plan.pods)
                    )
                )
            self.crash("after-started")
            try:
                entry = self._make(claim, plan, records)
                with self._cp_lock:  # a completion that cannot be written leaves no spec behind
                    self._commit(self.checkpoint.with_claim(entry))
            except TesseraError:
                self._roll_back(self.checkpoint.claims[claim.uid], quiet=True)
                raise
            self.crash("after-completed")
            self.log.info(
                "prepared claim",
                extra=fields_(claim=str(claim), devices=",".join(d.device for d in entry.devices)),
            )
            return ClaimResult(devices=entry.devices)

    def _make(
        self, claim: ClaimKey, plan: ClaimPlan, records: tuple[PreparedDevice, ...]
    ) -> ClaimEntry:
        """Step 3: the side effects and the CDI spec; the completed entry."""

        def save(devices: tuple[PreparedDevice, ...], mps: MpsRecord | None) -> None:
            with self._cp_lock:
                self._commit(
                    self.checkpoint.with_claim(
                        self._entry(claim, PREPARE_STARTED, devices, pods=plan.pods, mps=mps)
                    )
                )

        with self.gpu_locks.hold_all(_gpus(records)):
            applied = self.effects.apply(claim, plan, records, save)
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
        with self.gpu_locks.hold_all(_gpus(entry.devices)):
            try:
                self.effects.undo(entry, self.checkpoint)
                self.cdi.remove(entry.uid)
            except TesseraError as exc:
                self.log.error(
                    "cannot undo a claim's partial prepare; its devices stay held until a retry"
                    " succeeds",
                    extra=fields_(
                        claim=f"{entry.namespace}/{entry.name}", uid=entry.uid, error=str(exc)
                    ),
                )
                if not quiet:
                    raise
                return
            with self._cp_lock:
                self._commit(self.checkpoint.without_claim(entry.uid))

    def _undo(self, entry: ClaimEntry, cp: Checkpoint) -> None:
        """At start (nothing runs concurrently): undo the claim's side effects given the claims
        ``cp`` keeps, and remove its CDI spec."""
        self.effects.undo(entry, cp)
        self.cdi.remove(entry.uid)

    def _write_spec(self, entry: ClaimEntry) -> None:
        self.cdi.write(
            entry.uid,
            self.cdi.build_spec(entry.uid, _cdi_requests(entry.devices), mps_edits(entry.mps)),
        )

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
    def _unprepare_one(self, claim: ClaimKey) -> ClaimResult:
        """Undo the claim's side effects, then release its record: a failure to undo answers
        with the error and keeps the record (its devices stay held; the kubelet retries), and a
        crash in between leaves a record whose undo the retry repeats (every step is
        idempotent). The CDI spec goes last, also one left by an earlier crash."""
        with self.claim_locks.hold(claim.uid):
            entry = self.checkpoint.claims.get(claim.uid)
            if entry is not None:
                # the GPUs' locks until the record is gone (see _roll_back)
                with self.gpu_locks.hold_all(_gpus(entry.devices)):
                    self.effects.undo(entry, self.checkpoint)
                    self.crash("after-unprepare-undo")
                    try:
                        with self._cp_lock:
                            self._commit(self.checkpoint.without_claim(claim.uid))
                    except CheckpointError as exc:
                        raise CheckpointError(
                            f"claim {claim}: its release cannot be recorded ({exc}): it stays"
                            " prepared, its devices held, until the kubelet's retry succeeds"
                        ) from exc
                self.crash("after-unprepare-commit")
                self.log.info("unprepared claim", extra=fields_(claim=str(claim)))
            self.cdi.remove(claim.uid)
            return ClaimResult()

    def close(self, timeout: float) -> list[str]:
        """Stop taking claims and give the running ones up to ``timeout`` seconds to finish.

        New calls are answered with a per-claim "shutting down" error (the kubelet retries them
        with the next agent). Returns the claims still running at the deadline: they are left
        to the next start's reconcile (an interrupted prepare is rolled back and redone)."""
        with self._running_lock:
            self._closed = True
            running = list(self._running)
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        # a queued claim cancelled by the shutdown never counts as done for wait() (only a
        # worker notifies its waiters): wait for the started ones only
        started = [f for f in running if not f.cancelled()]
        _, not_done = wait_futures(started, timeout=max(0.0, timeout))
        with self._running_lock:
            return sorted(str(self._running[f][0]) for f in not_done if f in self._running)
