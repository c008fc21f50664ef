"""Keep this node's ResourceSlices published and correct.

``plan_changes`` (pure) compares what the store holds with what the devices should look like and
says what to create, update and delete; nothing when nothing changed. ``Publisher`` applies plans:
on start, whenever the devices change, when a watch shows someone else touched our slices, and
every resync interval. Conflicts (409) re-read and retry at once; temporary failures (429, 5xx,
lost connections) back off exponentially with jitter, capped, and at least as long as the
server's Retry-After asked (``KubeError.retry_after``, client-go's rule). While backing off,
nothing starts a round early: a device change or a watch event is published when the wait is
over, so a failing server sees at most one attempt per backoff step.

The stores it writes to are in :mod:`dra_driver.advertise.slice_stores`.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent.logs import Throttle, fields_
from dra_driver.advertise.slice_stores import SliceStore
from dra_driver.advertise.slices import SlicePolicy, build_slices, spec_equal
from dra_driver.device_model import DeviceModel
from dra_driver.errors import KubeConflict, KubeError

CONFLICT_RETRIES = 3
OTHER_PUBLISHER_LOG_INTERVAL = 300.0
"""Seconds between two warnings that another publisher writes this node's pool: two agents
undoing each other's devices would otherwise log on every round."""

Obj = dict[str, Any]


@dataclass(frozen=True)
class Plan:
    generation: int
    creates: tuple[Obj, ...] = ()
    updates: tuple[Obj, ...] = ()
    deletes: tuple[str, ...] = ()

    @property
    def writes(self) -> int:
        return len(self.creates) + len(self.updates) + len(self.deletes)


def plan_changes(
    existing: list[Obj], model: DeviceModel, policy: SlicePolicy, floor: int = 0
) -> Plan:
    """What to write so the store holds exactly the slices for ``model``. Pure.

    The pool generation stays when nothing changed, and when exactly one slice changed while
    every other slice is stored as it should be (same names, same generation, nothing to create
    or delete): that one slice is replaced in place, one atomic write, so the scheduler never
    sees the pool half-changed. Otherwise every slice of the pool is written with generation + 1
    (the scheduler only trusts slices of a pool's newest generation). That is the rule of
    Kubernetes' own ResourceSlice controller (k8s.io/dynamic-resource-allocation
    resourceslice/resourceslicecontroller.go, ``syncPool``: "Kept generation because at most one
    update API call is necessary"), except that it also keeps the generation while deleting
    obsolete slices, which this does not. A taint on one GPU's devices or a static MIG layout
    change is thereby one write, not a rewrite of the whole pool to every watcher. Only over a
    pool at the generation this process published (``floor``): a first write, or one over
    another publisher's generation, still moves it on.
    ``floor`` is the highest generation this process already published: generations never go
    back, even when someone deleted every slice of the pool.
    """
    current = max((int(o["spec"]["pool"].get("generation", 0)) for o in existing), default=0)
    current = max(current, floor)
    by_name = {o["metadata"]["name"]: o for o in existing}
    # built once at the next generation: spec_equal ignores the generation
    desired = build_slices(model, policy, current + 1)
    unchanged = len(existing) == len(desired) and all(
        d["metadata"]["name"] in by_name
        and spec_equal(d, by_name[d["metadata"]["name"]])
        and int(by_name[d["metadata"]["name"]]["spec"]["pool"].get("generation", 0)) == current
        for d in desired
    )
    if unchanged:
        return Plan(current)
    # in place only over a pool this process published last (``floor``): a fresh publisher, or
    # one that finds a newer generation (another agent with this node name), bumps it, so that
    # the other sees a generation it did not publish and warns (``_check_pool_owner``)
    in_place = _one_in_place(existing, desired, by_name, current) if current == floor else None
    if in_place is not None:
        return Plan(current, (), (in_place,), ())
    creates, updates = [], []
    for d in desired:  # fresh objects, ours to annotate
        old = by_name.get(d["metadata"]["name"])
        if old is None:
            creates.append(d)
        else:
            d["metadata"]["resourceVersion"] = old["metadata"].get("resourceVersion")
            updates.append(d)
    wanted = {d["metadata"]["name"] for d in desired}
    deletes = tuple(sorted(n for n in by_name if n not in wanted))
    return Plan(current + 1, tuple(creates), tuple(updates), deletes)


def _one_in_place(
    existing: list[Obj], desired: list[Obj], by_name: dict[str, Obj], current: int
) -> Obj | None:
    """The one slice to replace at generation ``current`` when it is the only difference
    between ``existing`` and ``desired`` (built at ``current + 1``); None otherwise."""
    if current < 1 or len(existing) != len(desired):
        return None
    changed: list[Obj] = []
    for d in desired:
        old = by_name.get(d["metadata"]["name"])
        if old is None or int(old["spec"]["pool"].get("generation", 0)) != current:
            return None
        if not spec_equal(d, old):
            changed.append(d)
            if len(changed) > 1:
                return None
    if len(changed) != 1:
        return None
    (d,) = changed
    d["spec"]["pool"]["generation"] = current
    d["metadata"]["resourceVersion"] = by_name[d["metadata"]["name"]]["metadata"].get(
        "resourceVersion"
    )
    return d


def _has_taints(obj: Obj) -> bool:
    spec = obj.get("spec") if isinstance(obj, dict) else None
    devices = spec.get("devices") if isinstance(spec, dict) else None
    return any(isinstance(d, dict) and d.get("taints") for d in devices or [])


@dataclass
class PublisherStats:
    reconciles: int = 0
    creates: int = 0
    updates: int = 0
    deletes: int = 0
    conflicts: int = 0
    errors: int = 0
    last_error: str | None = None

    @property
    def writes(self) -> int:
        return self.creates + self.updates + self.deletes


@dataclass
class Backoff:
    """Capped exponential backoff with jitter (delay in [d/2, d])."""

    base: float = 0.5
    cap: float = 30.0
    rng: random.Random = field(default_factory=random.Random)

    def delay(self, failures: int) -> float:
        d: float = min(self.cap, self.base * 2.0 ** max(0, failures - 1))
        return d * (0.5 + self.rng.random() / 2)


WATCH_SILENCE_S = 90.0
"""A slice watch that delivers nothing (no event, no bookmark) for this long is restarted. The
watch asks for bookmarks (``allowWatchBookmarks``); the API server's watch cache sends one to
every such watcher each minute besides one just before the watch's deadline
(k8s.io/apiserver/pkg/storage/cacher/cacher.go, ``defaultBookmarkFrequency = time.Minute``), so
a healthy watch is never silent for 90 s; bookmarks are a hint, not a promise (API concepts,
"Watch bookmarks"), and a server that sends none only costs a watch restarted from the last
resourceVersion every 90 s. Without this a hung stream (a dead proxy, a stopped feed) hid drift
until the client's read timeout, ``timeout_s`` + 10 s: about 5 minutes."""


class Publisher:
    """Applies plans; ``step(now)`` does one round and says how long until the next."""

    def __init__(
        self,
        store: SliceStore,
        policy: SlicePolicy,
        log: logging.Logger,
        *,
        resync_interval: float = 600.0,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
        node_uid: Callable[[], str | None] = lambda: None,
        on_taints_dropped: Callable[[], None] | None = None,
        watch_silence: float = WATCH_SILENCE_S,
    ) -> None:
        self.store = store
        self.policy = policy
        """The slices' driver, node and layout (``node_uid``, when it gives one, adds the
        Node's uid: :meth:`current_policy`)."""
        self._node_uid = node_uid
        self.log = log
        self.resync_interval = resync_interval
        self.backoff = backoff or Backoff()
        self.clock = clock
        self.stats = PublisherStats()
        self.published_generation: int | None = None
        self._model: DeviceModel | None = None
        self._lock = threading.Lock()
        self._dirty = False
        self._failures = 0
        self._next_at = 0.0
        self._hold_until = 0.0
        """After a failure, no round starts before this (the backoff, or the server's
        Retry-After), whatever asks for one."""
        self._list_rv = ""
        self._wake = threading.Event()
        self.taints_dropped = False
        """The API server stored our devices without their taints (its DRADeviceTaints feature
        gate is off): tainting cannot work there."""
        self._throttle = Throttle(log, OTHER_PUBLISHER_LOG_INTERVAL, clock)
        self.watch_silence = watch_silence
        self._watch_heard: float | None = None
        """When the open watch last delivered something (or opened); None: no watch open."""
        self.watch_restarts = 0
        """Watches ended for their silence (:meth:`check_watch`)."""
        self._on_taints_dropped = on_taints_dropped
        """Called once when ``taints_dropped`` becomes true (the agent then withdraws the devices
        instead: rewriting the taints would only loop, each write dropped again)."""

    @property
    def ready(self) -> bool:
        """True once the current devices have been published."""
        return self.published_generation is not None and not self._dirty

    def current_policy(self) -> SlicePolicy:
        """The policy the next round plans with: ``policy``, owned by the Node once its uid is
        known (the agent reads it at start; slices then go away with the Node)."""
        uid = self._node_uid()
        return self.policy if uid is None else dataclasses.replace(self.policy, node_uid=uid)

    def readiness_checks(self) -> list[tuple[str, Callable[[], tuple[bool, str]]]]:
        """/readyz's check of the publisher: ready once the current devices are published."""
        return [("resourceslices", self._published)]

    def _published(self) -> tuple[bool, str]:
        if self.ready:
            return True, f"published generation {self.published_generation}"
        return False, f"not yet published ({self.stats.last_error or 'pending'})"

    def set_devices(self, model: DeviceModel) -> None:
        with self._lock:
            self._model = model
            self._dirty = True
        self._wake.set()

    def poke(self) -> None:
        """Something may have drifted: reconcile at the next step."""
        with self._lock:
            self._dirty = True
        self._wake.set()

    def reconcile(self) -> Plan:
        """List, plan and apply once, re-reading on conflicts. Raises KubeError."""
        with self._lock:
            model = self._model
        if model is None:
            raise RuntimeError("reconcile before set_devices")
        for attempt in range(CONFLICT_RETRIES + 1):
            existing, self._list_rv = self.store.list()
            self._check_pool_owner(existing)
            plan = plan_changes(
                existing, model, self.current_policy(), self.published_generation or 0
            )
            try:
                self._apply(plan)
                self.stats.reconciles += 1
                self.published_generation = plan.generation
                return plan
            except KubeConflict:
                self.stats.conflicts += 1
                if attempt == CONFLICT_RETRIES:
                    raise
                self.log.info("slice conflict, re-reading", extra=fields_(attempt=attempt + 1))
        raise AssertionError("unreachable")

    def _check_pool_owner(self, existing: list[Obj]) -> None:
        """Warn when the pool has a generation this process did not publish.

        Only this agent writes its node's pool, and it moves the generation only forward from
        the one it last published; a person's edit or a deleted slice leaves it alone (drift,
        repaired quietly). A newer one means another publisher: most likely a second agent
        started with the same node name, the two rewriting each other's devices on every round.
        A restarted agent adopts its slices before it has published anything, so never warns.
        """
        if self.published_generation is None:
            return
        seen = max((int(o["spec"]["pool"].get("generation", 0)) for o in existing), default=0)
        if seen <= self.published_generation:
            return
        self._throttle(
            logging.WARNING,
            "other-publisher",
            "another publisher writes this node's ResourceSlices: its pool has a generation this"
            " agent did not publish. Most likely a second agent runs with the same node name"
            " (--node-name / TESSERA_NODE_NAME, NODE_NAME in the DaemonSet), and the two undo"
            " each other's devices; stop one, or give each node its own name",
            node=self.policy.node_name,
            driver=self.policy.driver_name,
            seen_generation=seen,
            published_generation=self.published_generation,
        )

    def _apply(self, plan: Plan) -> None:
        for obj in plan.creates:
            self._kept(obj, self.store.create(obj))
            self.stats.creates += 1
        for obj in plan.updates:
            self._kept(obj, self.store.replace(obj))
            self.stats.updates += 1
        for name in plan.deletes:
            self.store.delete(name)
            self.stats.deletes += 1
        if plan.writes:
            self.log.info(
                "published ResourceSlices",
                extra=fields_(
                    generation=plan.generation,
                    created=len(plan.creates),
                    updated=len(plan.updates),
                    deleted=len(plan.deletes),
                ),
            )

    def _kept(self, sent: Obj, stored: Obj) -> None:
        """Notice a server that drops the devices' taints (module ``taints_dropped``)."""
        if self.taints_dropped or not _has_taints(sent) or _has_taints(stored):
            return
        self.taints_dropped = True
        self.log.error(
            "the API server dropped the device taints: its DRADeviceTaints feature gate is off;"
            " unhealthy devices are withdrawn instead (enable the gate, or drop --device-taints)",
            extra=fields_(slice=sent["metadata"]["name"]),
        )
        if self._on_taints_dropped is not None:
            self._on_taints_dropped()

    def step(self, now: float) -> float:
        """Reconcile if due (devices changed, drift seen, resync or retry time reached); the
        seconds from its return until the next round is due. Waits count from the end of the
        round: ``now`` plus the time it took on the publisher's clock (a Retry-After of 2 s on
        a round's last request holds the next round 2 s from that answer, not from the round's
        start)."""
        with self._lock:
            due = (self._dirty or now >= self._next_at) and now >= self._hold_until
            if due:
                self._dirty = False
        end = now
        if due and self._model is not None:
            started = self.clock()
            try:
                self.reconcile()
            except KubeError as exc:
                end = now + max(0.0, self.clock() - started)
                self._failed(end, exc, exc.temporary)
            except Exception as exc:  # last resort: a bug must not end publishing for good
                end = now + max(0.0, self.clock() - started)
                self._failed(end, exc, None)
            else:
                end = now + max(0.0, self.clock() - started)
                self._failures = 0
                self._next_at = end + self.resync_interval
        return max(0.0, float(self._next_at) - end)

    def retry_in(self, exc: Exception, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failure in a row: the backoff, or the
        server's Retry-After when ``exc`` carries a longer one."""
        delay = self.backoff.delay(failures)
        return exc.retry_delay(delay) if isinstance(exc, KubeError) else delay

    def _failed(self, now: float, exc: Exception, temporary: bool | None) -> None:
        """Count, log and back off; ``temporary`` None marks an unexpected error (logged with
        its traceback)."""
        self._failures += 1
        self.stats.errors += 1
        self.stats.last_error = str(exc) or type(exc).__name__
        delay = self.retry_in(exc, self._failures)
        with self._lock:
            self._next_at = self._hold_until = now + delay
            self._dirty = False
        fields = fields_(error=self.stats.last_error, retry_in_s=round(delay, 2))
        if isinstance(exc, KubeError) and exc.retry_after is not None:
            fields["fields"]["retry_after_s"] = exc.retry_after
        if temporary is None:
            self.log.error(
                "publishing ResourceSlices failed unexpectedly, will retry",
                exc_info=exc,
                extra=fields,
            )
        else:
            fields["fields"]["temporary"] = temporary
            self.log.warning("publishing ResourceSlices failed, will retry", extra=fields)

    def run(self, stop: threading.Event) -> None:
        """The publisher loop (a thread): rounds, and the watch's silence checked. Returns when
        ``stop`` is set."""
        while not stop.is_set():
            delay = self.step(self.clock())
            delay = min(delay, self.check_watch(self.clock()))
            self._wake.wait(delay)
            self._wake.clear()

    def check_watch(self, now: float) -> float:
        """End the open watch when it has delivered nothing for ``watch_silence`` seconds (the
        watch loop then opens a new one from the last resourceVersion) and reconcile, since a
        change may have been missed; the seconds until the next check is due."""
        heard = self._watch_heard
        if heard is None:
            return self.watch_silence
        silent = now - heard
        if silent < self.watch_silence:
            return self.watch_silence - silent
        self._watch_heard = now
        self.watch_restarts += 1
        self.log.warning(
            "slice watch silent (no event, no bookmark); restarting it",
            extra=fields_(silent_s=round(silent, 1), bound_s=self.watch_silence),
        )
        self.store.end_watches()
        self.poke()
        return self.watch_silence

    def stop(self) -> None:
        """Wake the loops so they see their stop event; end a running watch."""
        self._wake.set()
        self.store.abort_watches()

    def watch_loop(self, stop: threading.Event, timeout_s: int = 300) -> None:
        """Watch our slices; any change we did not expect triggers a reconcile (a thread)."""
        failures = 0
        while not stop.is_set() and self.store.watchable:
            started, events, expired = self.clock(), 0, False
            self._watch_heard = started
            try:
                for event in self.store.watch(self._list_rv, timeout_s):
                    self._watch_heard = self.clock()
                    if stop.is_set():
                        return
                    events += 1
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        # too old (410): start over from a fresh list, at once the first time
                        failures, expired = failures + 1, True
                        self._list_rv = ""
                        self.poke()
                        break
                    failures = 0
                    meta = obj.get("metadata")
                    self._list_rv = (
                        str(meta.get("resourceVersion", "")) if isinstance(meta, dict) else ""
                    )
                    if event.get("type") != "BOOKMARK":
                        self.poke()
            except KubeError as exc:
                self._watch_heard = None
                failures += 1
                self.log.info("slice watch interrupted", extra=fields_(error=str(exc)))
                stop.wait(self.retry_in(exc, failures))
                continue
            self._watch_heard = None
            if expired and failures > 1:
                # a server that answers every watch with an error must not make us spin either
                stop.wait(self.backoff.delay(failures - 1))
            elif events == 0 and self.clock() - started < 1.0:
                failures += 1  # a server that ends streams at once must not make us spin
                stop.wait(self.backoff.delay(failures))

    def cleanup(self) -> int:
        """Delete every slice of ours; returns how many."""
        existing, _ = self.store.list()
        for obj in existing:
            self.store.delete(obj["metadata"]["name"])
        self.log.info("removed ResourceSlices", extra=fields_(count=len(existing)))
        return len(existing)
