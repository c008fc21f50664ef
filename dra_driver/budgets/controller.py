"""The controller's loop: hold the Lease, reconcile on the leader, never crash.

Every tick tries to acquire or renew the Lease (:class:`~dra_driver.cluster.lease.LeaseElector`:
a candidate every ``retry_period_s``, the leader every ``renew_period_s``). The leader reconciles
every ``reconcile_interval_s``: it reads the cluster (:func:`~dra_driver.budgets.view.read_view`),
plans (the pure planner, ``agent.usage.budget_plan.plan``) and writes the plan
(:class:`~dra_driver.budgets.execute.Executor`), checking before each batch that it still holds the
Lease, renewing it there when due (a long reconcile does not let it lapse).

Failures: an API error, a price table that does not validate, a lost lease mid-plan are logged,
counted (``tessera_budget_reconcile_errors_total``) and retried at the next interval; the truth is
in the cluster, so nothing is lost. An unexpected exception from the planner is logged with its
traceback and counted the same way: a bug in one budget's arithmetic must not stop leader election
or the other replica would take over and hit it too, while this one stays up and visible.

A clean stop (:meth:`BudgetController.run` returns when ``stop`` is set) releases the Lease so the
other replica takes over at its next try instead of after the lease expires.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from agent.errors import DecodeError
from agent.logs import fields_
from agent.usage.budget_plan import ClusterView, Plan
from dra_driver.budgets.budget_metrics import BudgetMetrics
from dra_driver.budgets.execute import Executor, Outcome
from dra_driver.budgets.heap import collector_paused
from dra_driver.budgets.view import PricesRef, read_view
from dra_driver.cluster.kube import KubeClient
from dra_driver.cluster.lease import LeaseElector
from dra_driver.errors import KubeError

Planner = Callable[[ClusterView, datetime], Plan]


@dataclass(frozen=True)
class ControllerSettings:
    prices: PricesRef
    reconcile_interval_s: float = 30.0


def _uids(budgets: Any) -> dict[str, str]:
    out = {}
    for b in budgets:
        meta = b.get("metadata") or {}
        out[str(meta.get("name", ""))] = str(meta.get("uid", ""))
    return out


class BudgetController:
    """``clock``: Unix time (what the planner and Events see); ``monotonic``: the schedule."""

    def __init__(
        self,
        kube: KubeClient,
        elector: LeaseElector,
        planner: Planner,
        metrics: BudgetMetrics,
        settings: ControllerSettings,
        log: logging.Logger,
        clock: Callable[[], float],
        monotonic: Callable[[], float],
    ) -> None:
        self._kube = kube
        self.elector = elector
        self._planner = planner
        self.metrics = metrics
        self.settings = settings
        self._log = log
        self._clock = clock
        self._monotonic = monotonic
        self._executor = Executor(kube, elector.identity, clock)
        self._next_reconcile: float | None = None
        self._last_renew_try: float | None = None
        self._was_leader = False
        self._last_tick: float | None = None
        self._reached_api = False

    # -- probes ------------------------------------------------------------------------------

    def ready(self) -> tuple[bool, str]:
        """/readyz: the API server answered at least once (leader or standby)."""
        if self._reached_api:
            return True, "leader" if self.elector.is_leader() else "standby"
        return False, "the API server has not answered yet"

    def alive(self, max_gap_s: float) -> tuple[bool, str]:
        """/healthz: the loop ticked within ``max_gap_s`` (a wedged loop is restarted)."""
        if self._last_tick is None:
            return True, "starting"
        gap = self._monotonic() - self._last_tick
        if gap > max_gap_s:
            return False, f"the controller loop last ran {gap:.0f} s ago"
        return True, "ok"

    # -- the loop ----------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Tick until ``stop`` is set, then release the Lease."""
        try:
            while not stop.is_set():
                stop.wait(self.tick())
        finally:
            released = self.elector.release()
            self.metrics.leader.set(0)
            self._log.info(
                "budget controller stopped",
                extra=fields_(identity=self.elector.identity, released_lease=released),
            )

    def tick(self) -> float:
        """One turn: the Lease, then a reconcile when one is due; the seconds to the next."""
        now = self._monotonic()
        self._last_tick = now
        leading = self._acquire_or_renew()
        self.metrics.leader.set(1 if leading else 0)
        if leading != self._was_leader:
            self._log.info(
                "became the leader" if leading else "not the leader",
                extra=fields_(identity=self.elector.identity, holder=self.elector.holder),
            )
            self._was_leader = leading
            self._next_reconcile = now if leading else None
            if not leading:
                self.metrics.forget_plan()
        timing = self.elector.timing
        if not leading:
            return timing.retry_period_s
        if self._next_reconcile is not None and now >= self._next_reconcile:
            self.reconcile()
            self._next_reconcile = now + self.settings.reconcile_interval_s
        after = self._monotonic()
        due = self._next_reconcile if self._next_reconcile is not None else after
        renew = (self._last_renew_try or after) + timing.renew_period_s
        return max(0.0, min(due, renew) - after)

    def _acquire_or_renew(self) -> bool:
        self._last_renew_try = self._monotonic()
        try:
            leading = self.elector.try_acquire_or_renew()
        except KubeError as exc:
            self.metrics.errors.inc()
            self._log.warning(
                "cannot reach the lease",
                extra=fields_(lease=self.elector.path, error=str(exc), status=exc.status),
            )
            return self.elector.is_leader()
        self._reached_api = True
        return leading

    def still_leader(self) -> bool:
        """The check before each write batch: renews the Lease when a renewal is due."""
        last = self._last_renew_try
        if last is None or self._monotonic() - last >= self.elector.timing.renew_period_s:
            self._acquire_or_renew()
        return self.elector.is_leader()

    def reconcile(self) -> Outcome | None:
        """Read, plan, write: the outcome, or None when it failed before writing."""
        started = self._monotonic()
        try:
            return self._reconcile()
        except (KubeError, DecodeError) as exc:
            self.metrics.errors.inc()
            self._log.warning(
                "reconcile failed; retrying next interval", extra=fields_(error=str(exc))
            )
            return None
        except Exception as exc:  # a planner bug: see the module docstring
            self.metrics.errors.inc()
            self._log.error(
                "reconcile failed with an internal error",
                exc_info=exc,
                extra=fields_(error=f"{type(exc).__name__}: {exc}"),
            )
            return None
        finally:
            self.metrics.duration.observe(max(0.0, self._monotonic() - started))

    def _reconcile(self) -> Outcome:
        view = read_view(self._kube, self.settings.prices)
        self._reached_api = True
        # the view just read is large and all alive: no garbage collection should walk it while
        # planning (measured: 1.6 s of CPU once; dra_driver/budgets/heap.py says why and how;
        # bench/budgets.py measures the plan this way)
        with collector_paused():
            return self._plan_and_write(view)

    def _plan_and_write(self, view: ClusterView) -> Outcome:
        now = datetime.fromtimestamp(self._clock(), UTC)
        plan = self._planner(view, now)
        self.metrics.show_gauges(plan.gauges)
        self.metrics.show_namespaces(view.summaries, now)
        self.metrics.show_oldest_unfolded(plan.oldest_unfolded_bucket, now)
        outcome = self._executor.execute(plan, self.still_leader, _uids(view.budgets))
        for e in outcome.evicted:
            self.metrics.evictions.labels(e.budget).inc()
            self._log.info(
                "evicted a pod for an exhausted budget",
                extra=fields_(budget=e.budget, namespace=e.namespace, pod=e.pod),
            )
        for e in outcome.refused:
            self._log.info(
                "eviction refused (a disruption budget); retrying next interval",
                extra=fields_(budget=e.budget, namespace=e.namespace, pod=e.pod),
            )
        self._log_outcome(outcome)
        return outcome

    def _log_outcome(self, outcome: Outcome) -> None:
        written: Mapping[str, int] = outcome.written
        if outcome.failed is None:
            self.metrics.last_reconcile.set(self._clock())
            self._log.debug("reconciled", extra=fields_(**written))
            return
        self.metrics.errors.inc()
        if outcome.lost_lease:
            self._log.warning(
                "lost the lease mid-reconcile; writing nothing more",
                extra=fields_(stopped_at=outcome.failed, **written),
            )
            return
        error = outcome.error
        self._log.warning(
            "a write failed; the next reconcile plans again",
            extra=fields_(
                stopped_at=outcome.failed,
                error=str(error),
                status=None if error is None else error.status,
                **written,
            ),
        )
