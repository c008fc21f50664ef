"""The batches of kubelet calls: thread pools, deadlines, per-claim answers, the stuck list and
shutdown.

The claims of one kubelet call are one batch (:class:`Batch`), run on its operation's pool (one
thread per call being worked on) while the caller waits for each claim's future until the call's
deadline: a claim not done by then is answered with an error while the batch goes on (a retry
returns its result). Prepare and unprepare have pools of their own, so an unprepare never queues
behind prepares of other claims (a slow claim read holds a prepare worker, never an unprepare
one). What a batch does with its claims is the handler's business (``transaction``): it answers
each claim through the batch (:meth:`Batch.fail`, :meth:`Batch.succeed`) and runs per-claim
steps concurrently with :meth:`Batch.each`, or with :meth:`Batch.waves` where the claims done
should go on without waiting for a slow one (the claim reads of a prepare).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import (
    ALL_COMPLETED,
    FIRST_COMPLETED,
    CancelledError,
    Future,
    InvalidStateError,
    ThreadPoolExecutor,
)
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from agent.errors import TesseraError
from agent.logs import fields_
from agent.threadpool import FixedPool
from dra_driver.kubeletplugin.checkpoint import PreparedDevice
from dra_driver.kubeletplugin.claims import ClaimKey

T = TypeVar("T")
R = TypeVar("R")
Observer = Callable[[str, float, str | None], None]
"""``observe(operation, seconds, error reason or None)`` after every claim (for metrics)."""
OPERATIONS = ("prepare", "unprepare")
GROUP_WINDOW_S = 0.5
"""How long :meth:`Batch.waves` waits for every item before going on with those done: claims read
within it share their checkpoint writes (group commit; a read takes milliseconds from files and
tens of milliseconds from a healthy API server); a claim read later goes on in a later wave as
soon as it is read, so one slow read never holds back the others' answers."""
_CANCEL_POLL_S = 1.0
"""A future cancelled by the pool's shutdown never wakes ``wait`` (only a worker notifies its
waiters): how often a wave that waits looks for those."""


@dataclass(frozen=True)
class ClaimResult:
    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class NotRun(Exception):
    """A claim's step that never began: the agent is stopping."""


def shutting_down(claim: ClaimKey) -> ClaimResult:
    return ClaimResult(
        error=f"claim {claim}: the agent is shutting down; the kubelet retries it with the next"
        " agent"
    )


def _snake(name: str) -> str:
    """``CdiError`` -> ``cdi_error``."""
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


class Batch:
    """The claims of one kubelet call, each with the future its caller waits on."""

    def __init__(
        self,
        op: str,
        claims: list[tuple[ClaimKey, Future[ClaimResult]]],
        started: float,
        *,
        steps: ThreadPoolExecutor,
        observe: Observer,
        log: logging.Logger,
    ) -> None:
        """``steps`` runs the batch's claims concurrently (claim reads, side effects, CDI
        specs, undo); ``observe`` and ``log`` hear of every claim's answer."""
        self.op = op
        self.claims = claims
        self.started = started
        self._futures = {c.uid: f for c, f in claims}
        self._steps = steps
        self._observe = observe
        self._log = log

    def answer(self, claim: ClaimKey, result: ClaimResult) -> None:
        """Answer ``claim`` (its first answer counts)."""
        fut = self._futures[claim.uid]
        if not fut.done():
            with suppress(InvalidStateError):  # cancelled meanwhile: the agent is stopping
                fut.set_result(result)

    def open(self) -> list[tuple[ClaimKey, Future[ClaimResult]]]:
        return [(c, f) for c, f in self.claims if not f.done()]

    def fail(self, claim: ClaimKey, exc: BaseException) -> None:
        """Answer ``claim`` with its error (see :meth:`failed`)."""
        self.answer(claim, self.failed(claim, exc))

    def failed(self, claim: ClaimKey, exc: BaseException) -> ClaimResult:
        """A claim's error answer, logged and counted: its own message for a TesseraError,
        "internal error" (with the traceback in the log) for a bug."""
        seconds = time.monotonic() - self.started
        if isinstance(exc, TesseraError):
            reason = getattr(exc, "reason", None) or _snake(type(exc).__name__)
            self._observe(self.op, seconds, reason)
            self._log.warning(
                f"{self.op} failed", extra=fields_(claim=str(claim), error=str(exc), reason=reason)
            )
            return ClaimResult(error=str(exc))
        self._observe(self.op, seconds, "internal_error")
        self._log.error(
            f"{self.op} failed with an internal error",
            exc_info=exc,
            extra=fields_(claim=str(claim), error=f"{type(exc).__name__}: {exc}"),
        )
        return ClaimResult(
            error=f"claim {claim}: internal error in the driver ({type(exc).__name__}: {exc});"
            " see the agent's log"
        )

    def succeed(self, claim: ClaimKey, result: ClaimResult) -> None:
        self._observe(self.op, time.monotonic() - self.started, None)
        self.answer(claim, result)

    def each(
        self, items: Sequence[T], fn: Callable[[T], R], finish: bool = True
    ) -> list[R | BaseException]:
        """``fn`` of every item, concurrently on the operation's step pool (inline for one
        item); an exception is returned in the item's place. Once the agent is stopping, an
        item not yet begun is run inline when ``finish`` (a claim already started finishes)
        and is ``NotRun`` otherwise."""

        outcome = partial(_outcome, fn)

        if len(items) <= 1:
            return [outcome(i) for i in items]
        futures: list[Future[R | BaseException] | None] = []
        for item in items:
            try:
                futures.append(self._steps.submit(outcome, item))
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
            results.append(outcome(item) if finish else NotRun())
        return results

    def waves(
        self,
        items: Sequence[T],
        fn: Callable[[T], R],
        window: float = GROUP_WINDOW_S,
        *,
        concurrent: bool = True,
    ) -> Iterator[list[tuple[T, R | BaseException | NotRun]]]:
        """``fn`` of every item, concurrently on the operation's step pool (inline for one
        item), handed back in waves of ``(item, outcome)`` in the items' order: the first wave
        holds those done within ``window`` seconds (all of them, normally), each later wave
        those done by the time the previous one was handled (at least one; the caller handles a
        wave before asking for the next). An exception is returned in the item's place; an item
        the stopping agent never began is ``NotRun``. ``concurrent=False``: every item in this
        thread, one wave (items each done in microseconds)."""

        outcome = partial(_outcome, fn)

        if len(items) <= 1 or not concurrent:  # one wave, in this thread
            yield [(i, outcome(i)) for i in items]
            return
        pending: dict[Future[R | BaseException], int] = {}
        ready: list[tuple[int, R | BaseException | NotRun]] = []
        for n, item in enumerate(items):
            try:
                pending[self._steps.submit(outcome, item)] = n
            except RuntimeError:  # shut down: the agent is stopping
                ready.append((n, NotRun()))
        first = True
        while pending or ready:
            done: set[Future[R | BaseException]] = set()
            while pending and not done:
                done, _ = wait_futures(
                    pending,
                    timeout=window if first else _CANCEL_POLL_S,
                    return_when=ALL_COMPLETED if first else FIRST_COMPLETED,
                )
                done |= {f for f in pending if f.cancelled()}
                first = False
            for fut in done:
                n = pending.pop(fut)
                try:
                    ready.append((n, fut.result()))
                except CancelledError:
                    ready.append((n, NotRun()))
            ready.sort(key=lambda r: r[0])
            yield [(items[n], result) for n, result in ready]
            ready = []


class BatchRunner:
    """Runs each call's claims as one batch on its operation's pool, under the call deadline."""

    def __init__(
        self,
        *,
        handlers: Mapping[str, Callable[[Batch], None]],
        log: logging.Logger,
        observe: Observer,
        workers: int,
        deadline_s: float,
        clock: Callable[[], float],
    ) -> None:
        """``handlers`` does a batch of each operation (``OPERATIONS``); ``clock`` times the
        claims for :meth:`stuck`."""
        self._handlers = dict(handlers)
        self._log = log
        self._observe = observe
        self._deadline_s = deadline_s
        self._clock = clock
        # unprepare never queues behind prepares of other claims (a slow claim read holds a
        # prepare worker, never an unprepare one)
        # every worker from the start: the thread count never grows with the load seen
        self._pools = {op: FixedPool(workers, op) for op in OPERATIONS}
        """One thread per call being worked on (a batch)."""
        self._steps = {op: FixedPool(workers, f"{op}-step") for op in OPERATIONS}
        """The claims of a batch, concurrently (claim reads, side effects, CDI specs, undo)."""
        self._running: dict[Future[ClaimResult], tuple[ClaimKey, str, float]] = {}
        self._running_lock = threading.Lock()
        self._closed = False
        self.closing = threading.Event()
        """Set once ``close`` has stopped taking claims and cancelled the queued ones."""

    def call(self, op: str, claims: Sequence[ClaimKey]) -> dict[str, ClaimResult]:
        """Run one call's claims as one batch in the background and wait for each claim's
        result until the call's deadline: a claim not done by then is answered with an error
        while the batch goes on (a retry returns its result)."""
        deadline = time.monotonic() + self._deadline_s
        first: dict[str, ClaimKey] = {}  # a UID named twice is one claim (its first naming)
        for c in claims:
            first.setdefault(c.uid, c)
        unique = list(first.values())
        futures = self._submit(op, unique)
        if futures is None:
            return {c.uid: shutting_down(c) for c in unique}
        out: dict[str, ClaimResult] = {}
        for claim, fut in futures:
            try:
                out[claim.uid] = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except CancelledError:  # still queued when the agent began to stop
                out[claim.uid] = shutting_down(claim)
            except FutureTimeout:
                self._observe(op, self._deadline_s, "timeout")
                self._log.warning(
                    f"{op} not done within its deadline; it goes on in the background",
                    extra=fields_(claim=str(claim), deadline_s=self._deadline_s),
                )
                out[claim.uid] = ClaimResult(
                    error=f"claim {claim}: not done within {self._deadline_s:.0f} s; it goes on"
                    " in the background and a retry returns its result"
                )
        return out

    def _submit(
        self, op: str, claims: list[ClaimKey]
    ) -> list[tuple[ClaimKey, Future[ClaimResult]]] | None:
        """Start the batch on its operation's pool; one future per claim, answered as soon as
        that claim is done. None once the runner is closed."""
        batch = Batch(
            op,
            [(c, Future()) for c in claims],
            time.monotonic(),
            steps=self._steps[op],
            observe=self._observe,
            log=self._log,
        )
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

    def _runner_done(self, batch: Batch, runner: Future[None]) -> None:
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
            f"{op} {claim}" for claim, op, started in running if now - started > self._deadline_s
        )

    def _finished(self, fut: Future[ClaimResult]) -> None:
        with self._running_lock:
            self._running.pop(fut, None)

    def _run(self, batch: Batch) -> None:
        """The batch, on its pool's thread; a bug answers every claim not yet answered."""
        try:
            self._handlers[batch.op](batch)
        except Exception as exc:  # last resort: never leave a claim unanswered
            for claim, _ in batch.open():
                batch.fail(claim, exc)
        except BaseException as exc:  # not ours to handle: the callers get it
            for _, fut in batch.open():
                with suppress(InvalidStateError):
                    fut.set_exception(exc)
            raise

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
        self.closing.set()
        # a queued claim cancelled by the shutdown never counts as done for wait() (only a
        # worker notifies its waiters): wait for the started ones only
        started = [f for f in running if not f.cancelled()]
        _, not_done = wait_futures(started, timeout=max(0.0, timeout))
        with self._running_lock:
            return sorted(str(self._running[f][0]) for f in not_done if f in self._running)


def _outcome(fn: Callable[[T], R], item: T) -> R | BaseException:
    """``fn(item)``, or the exception it raised (each item's failure is its own)."""
    try:
        return fn(item)
    except Exception as exc:
        return exc
