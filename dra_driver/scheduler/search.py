"""The backtracking search, as the scheduler's structured allocator does it
(k8s.io/dynamic-resource-allocation ``structured/internal/incubating/
allocator_incubating.go``: Allocate, allocateOne, allocateDevice). The candidates it searches
are ``candidates``'s, the counters and capacity it takes ``capacity``'s, the constraints it keeps
``constraints``'s; what it answers is ``outcome``'s.

The search picks devices as upstream does: requests in claim order, a firstAvailable
request's subrequests in order, each request's devices as combinations in candidate order (never
two orders of the same set; a device that allows multiple allocations may come again, and a
request under a distinctAttribute is searched in upstream's own order: ``resume_at``). A device
is added when it is not taken in this claim (a device that allows multiple allocations never
is), its counters and capacity are left, and every constraint still holds
(``structured/internal/experimental/``, the variant with consumable capacity, for shared
devices and distinctAttribute); on failure the search backtracks, so it
finds an allocation whenever one exists, or stops at ``time_limit_s`` (``GaveUp``).

For the explanation it remembers, per request, the deepest partial allocation that failed and
why each other candidate could not be added to it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from dra_driver.scheduler.candidates import Candidates
from dra_driver.scheduler.capacity import Usage
from dra_driver.scheduler.celenv import CelEnvironment
from dra_driver.scheduler.constraints import Constraints
from dra_driver.scheduler.domain import (
    MAX_RESULTS,
    Allocated,
    Claim,
    DeviceClass,
    Mode,
    Node,
    Request,
)
from dra_driver.scheduler.outcome import (
    Analysis,
    Attempt,
    Fatal,
    GaveUp,
    Outcome,
    Pick,
    Reason,
)
from dra_driver.scheduler.picking import (
    PodShare,
    TooMany,
    in_upstream_order,
    resume_at,
    share_id_of,
    too_many,
)


class Search:
    def __init__(
        self,
        claim: Claim,
        classes: Mapping[str, DeviceClass],
        node: Node,
        allocated: Allocated,
        cel: CelEnvironment,
        *,
        time_limit_s: float,
        clock: Callable[[], float],
        pod: PodShare | None = None,
    ) -> None:
        self.claim = claim
        self.node = node
        self.time_limit_s = time_limit_s
        self.clock = clock
        # one claim alone, or one of a pod's claims sharing what they take (``joint``)
        self.pod = pod or PodShare(Usage(node, allocated))
        self.usage = self.pod.usage
        self.candidates = Candidates(claim, classes, node, allocated, cel, self.usage)
        self.constraints = Constraints()
        # search state
        self.picks: list[Pick] = []
        self._exclusive = self.pod.held
        self.attempts: dict[tuple[int, int], Attempt] = {}
        self._depth: dict[tuple[int, int], int] = {}
        self._blocker: tuple[int, int] | None = None
        self._blocker_depth = -1
        self.selected: dict[int, int] = {}
        self.steps = 0
        self._deadline = 0.0
        self._analyses: list[list[Analysis]] = []

    # -- search ------------------------------------------------------------------------------------
    def run(self) -> Outcome:
        fatal = self.prepare()
        ok = gave_up = False
        if fatal is None:
            try:
                ok = self.search(self.clock() + self.time_limit_s)
            except GaveUp:
                gave_up = True
            except Fatal as e:
                fatal = e.reason
            except TooMany:
                fatal = too_many(self.claim)
        return self.outcome(ok, fatal, gave_up)

    def prepare(self) -> Reason | None:
        """Analyse every request; what stops allocation before the search (an error of the
        claim), or None."""
        groups = self.claim.requests
        analyses = [self._analyse(g.alternatives, g.first_available) for g in groups]
        self._analyses = analyses
        self._owner = {id(a.request): a for alts in analyses for a in alts}
        fatal = None
        # validateDeviceRequest runs for every request and subrequest before the search: an
        # unknown class, an unusable pool or a CEL error while collecting "all" devices is an
        # error of the claim.
        for alts in analyses:
            for a in alts:
                if a.problem is not None and a.problem.kind == "unknown-class":
                    fatal = fatal or a.problem
                if (
                    a.request.mode is Mode.ALL
                    and a.problem is not None
                    and a.problem.kind == "pool"
                ):
                    fatal = fatal or a.problem
                if a.request.mode is Mode.ALL and a.cel_error is not None:
                    fatal = fatal or a.cel_error
        minimum = sum(
            min(
                a.request.count if a.request.mode is Mode.EXACT_COUNT else len(a.all_devices)
                for a in alts
            )
            for alts in analyses
        )
        if fatal is None and minimum > MAX_RESULTS:
            # Allocate: an All request counts every device validateDeviceRequest collected, a
            # firstAvailable request its smallest subrequest
            upstream = (
                f"claim {self.claim.ref}: number of requested devices {minimum} exceeds the"
                f" claim limit of {MAX_RESULTS}"
            )
            fatal = Reason(
                "too-many",
                f"{upstream}: a claim holds at most {MAX_RESULTS} devices (resource.k8s.io/v1"
                " AllocationResultsMaxSize), and an All request counts every device it selects,"
                " allocated or not",
                {"devices": minimum, "limit": MAX_RESULTS, "upstream": upstream},
            )
        return fatal

    def search(self, deadline: float) -> bool:
        """allocateOne from the claim's first request (after ``prepare``); GaveUp past
        ``deadline``, Fatal at an error of the claim."""
        self._deadline = deadline
        return self._request(0)

    def outcome(self, ok: bool, fatal: Reason | None, gave_up: bool) -> Outcome:
        return Outcome(
            ok=ok,
            picks=list(self.picks) if ok else [],
            selected=dict(self.selected) if ok else {},
            analyses=self._analyses,
            attempts=self.attempts,
            blocker=self._blocker,
            fatal=fatal,
            gave_up=gave_up,
            steps=self.steps,
        )

    def _tick(self) -> None:
        self.steps += 1
        if self.clock() > self._deadline:
            raise GaveUp

    def _request(self, gi: int) -> bool:
        if gi == len(self.claim.requests):
            return self.pod.then(self)
        exceeded = self.claim.requests[gi].first_available
        for ai, a in enumerate(self._analyses[gi]):
            if a.cel_error is not None:
                raise Fatal(a.cel_error)
            self.selected[gi] = ai
            if a.problem is not None:
                self._record(gi, ai, a, reason=a.problem)
                exceeded = exceeded and a.problem.kind == "too-many"
                continue
            found = self._try(gi, ai, a)
            if found:
                return True
            exceeded = exceeded and found is None
        del self.selected[gi]
        if exceeded:
            raise TooMany
        return False

    def _try(self, gi: int, ai: int, a: Analysis) -> bool | None:
        """One alternative: True when the claim completes with it, False when not, None when it
        would take the claim over the limit (``TooMany``: a firstAvailable request goes on to
        its next subrequest; any other request passes it up)."""
        mark = len(self.picks)
        try:
            if a.request.mode is Mode.ALL:
                return self._all(gi, ai, a)
            return self._next(gi, ai, a, 0, 0)
        except TooMany:
            if not self.claim.requests[gi].first_available:
                raise
            while len(self.picks) > mark:  # the frames TooMany passed kept their picks
                pick = self.picks[-1]
                self._remove(self._owner[id(pick.request)], pick.device.index)
            return None

    def _analyse(self, alternatives: tuple[Request, ...], first_available: bool) -> list[Analysis]:
        """Each alternative's analysis. In 1.34 and 1.35 ``Allocate`` sets
        ``requestKey.subRequestIndex`` only after ``validateDeviceRequest``, so a second
        subrequest in mode All is collected under the first subrequest's key and reads the
        isSelectable verdicts the first one cached when it is in mode All too: its devices are
        those the first subrequest's class and selectors select (fixed upstream in 1.36,
        kubernetes commit 3caaccc0 "Fix incorrect behavior when using AllocationModeAll with
        PrioritizedList")."""
        out: list[Analysis] = []
        for ai, req in enumerate(alternatives):
            first = alternatives[0]
            reads_first = (
                first_available and ai == 1 and req.mode is Mode.ALL and first.mode is Mode.ALL
            )
            out.append(self.candidates.analyse(req, first if reads_first else None))
        return out

    def _all(self, gi: int, ai: int, a: Analysis) -> bool:
        """allocateOne for an All request: its devices (``all_devices``) in order through
        allocateDevice(must=true). A device that is in use, short of counters, tainted or short
        of capacity ends the request (no error); one that a constraint refuses is an error of
        the claim (``Fatal``). In 1.34 and 1.35 an All subrequest after the first of a
        firstAvailable request takes only its first device and then continues as the first
        subrequest (``_as_first``)."""
        self._tick()
        devices = a.all_devices
        if len(self.picks) + len(devices) > MAX_RESULTS:
            self._record(gi, ai, a, reason=self._too_many(a, len(devices)))
            raise TooMany
        if ai > 0:
            devices = devices[:1]
        added: list[tuple[Analysis, int]] = []
        if not self._take_all(gi, ai, a, a, devices, added):
            return False
        done = self._as_first(gi, ai, a) if ai > 0 else self._request(gi + 1)
        if done:
            return True
        for an, i in reversed(added):
            self._remove(an, i)
        return False

    def _take_all(
        self,
        gi: int,
        ai: int,
        shown: Analysis,
        a: Analysis,
        devices: list[int],
        added: list[tuple[Analysis, int]],
    ) -> bool:
        """Add every one of ``devices`` for ``a`` (must=true), appending to ``added``; on a
        device that cannot be added undo them, record why under (gi, ai) for ``shown`` and
        answer False, or raise ``Fatal`` for a constraint."""
        for idx in devices:
            reason, error = self._must(a, idx)
            if reason is None:
                self._add(a, idx)
                added.append((a, idx))
                continue
            dev = self.node.devices[idx]
            why = Reason(
                reason.kind,
                f"request {a.request.full_name} (allocationMode All) needs every matching"
                f" device, but {dev.name}: {reason.text}",
                {**reason.details, "device": dev.name},
            )
            self._record(gi, ai, shown, reason=why)
            if error:
                upstream = (
                    f"claim {self.claim.ref}, request {a.request.name}: cannot add device"
                    f" {'/'.join(dev.key)} because a claim constraint would not be satisfied"
                )
                raise Fatal(
                    Reason(
                        reason.kind,
                        f"{upstream}: {dev.name}: {reason.text}; allocationMode All takes"
                        " every device it selects, so a constraint that refuses one is an"
                        " error of the claim",
                        {
                            **why.details,
                            "request": a.request.full_name,
                            "deviceID": "/".join(dev.key),
                            "upstream": upstream,
                        },
                    )
                )
            for an, i in reversed(added):
                self._remove(an, i)
            del added[:]
            return False
        return True

    def _must(self, a: Analysis, idx: int) -> tuple[Reason | None, bool]:
        """allocateDevice(must=true) on device ``idx`` for ``a``: why it cannot be added, and
        whether that is an error (a constraint), in upstream's order: in use, counters, taints
        (the static reasons but a missing constrained attribute), constraints, capacity."""
        dev = self.node.devices[idx]
        taken = self._exclusive.get(idx)
        if taken is not None:
            return Reason(
                "taken", f"already chosen for request {taken} of this claim", {"request": taken}
            ), False
        static = a.rejections.get(idx)
        if static is not None and static.kind != "constraint":
            return static, False
        reason = self.usage.check_counters(dev, in_claim=True, picks=self.picks)
        if reason is not None:
            return reason, False
        if static is not None:
            return static, True
        reason = self.constraints.check(a, idx, self.picks)
        if reason is not None:
            return reason, True
        if dev.allow_multiple and self.usage.holds_capacity(idx):
            reason, _ = self.usage.check_capacity(a.request, dev, in_claim=True)
            if reason is not None:
                return reason, False
        return None, False

    def _as_first(self, gi: int, ai: int, a: Analysis) -> bool:
        """The rest of All subrequest ``ai`` > 0 after its first device, as 1.34 and 1.35 run
        it: allocateOne's All path recurses with ``deviceIndices{claimIndex, requestIndex,
        deviceIndex + 1}``, without the subrequest index, so device 1 onwards are the first
        subrequest's (its All devices from index 1, or an ExactCount's remaining count, under
        its name); past the first subrequest's count the request is done (fixed upstream in
        1.36, kubernetes commit 3caaccc0)."""
        first = self._analyses[gi][0]
        req0 = first.request
        need = (len(first.all_devices) if req0.mode is Mode.ALL else req0.count) - 1
        if req0.mode is Mode.ALL and not first.all_devices:
            done = False
        elif need <= 0:
            return self._request(gi + 1)
        elif len(self.picks) + need > MAX_RESULTS:
            self._record(gi, ai, a, reason=self._too_many(first, need))
            raise TooMany
        elif req0.mode is Mode.ALL:
            added: list[tuple[Analysis, int]] = []
            done = self._take_all(gi, ai, a, first, first.all_devices[1:], added)
            if done:
                done = self._request(gi + 1)
                if not done:
                    for an, i in reversed(added):
                        self._remove(an, i)
        else:
            done = self._next(gi, 0, first, 1, 0)
        if not done:
            self._record(
                gi,
                ai,
                a,
                reason=Reason(
                    "no-completion",
                    f"request {a.request.full_name} (allocationMode All, not the first"
                    f" subrequest): Kubernetes 1.34 and 1.35 take its first device"
                    f" ({self.picks[-1].device.name}) and then continue with subrequest"
                    f" {req0.full_name}'s devices ({need} more), which do not fit"
                    " (allocateOne drops the subrequest index; fixed in 1.36)",
                ),
            )
            if self._blocker == (gi, 0):
                self._blocker = (gi, ai)
        return done

    def _too_many(self, a: Analysis, need: int) -> Reason:
        return Reason(
            "too-many",
            f"request {a.request.full_name} needs {need} more devices on top of"
            f" {len(self.picks)}: more than the {MAX_RESULTS} one claim may hold",
        )

    def _next(self, gi: int, ai: int, a: Analysis, k: int, start: int) -> bool:
        """allocateOne for device k of an ExactCount request: try the candidates from
        ``start`` on (combinations, not permutations)."""
        count = a.request.count
        if k == count:
            return self._request(gi + 1)
        self._tick()
        need = count - k
        if len(self.picks) + need > MAX_RESULTS:
            self._record(gi, ai, a, reason=self._too_many(a, need))
            raise TooMany
        cands = a.candidates
        shared = any(self.node.devices[i].allow_multiple for i in cands)
        if len(cands) < count - k and not shared:
            self._record(
                gi,
                ai,
                a,
                reason=Reason(
                    "too-few",
                    f"request {a.request.full_name} needs {count}, {len(cands)}"
                    f" candidate{'s' if len(cands) != 1 else ''}",
                    {"needs": count, "candidates": len(cands)},
                ),
            )
            return False
        # each remaining position needs a candidate of its own unless some can repeat
        repeats = shared or in_upstream_order(a)
        stop = len(cands) if repeats else len(cands) - need + 1
        for ci in range(start, stop):
            idx = cands[ci]
            if self._add(a, idx) is not None:
                continue
            if self._next(gi, ai, a, k + 1, resume_at(a, self.node.devices, ci)):
                return True
            self._remove(a, idx)
        self._record(gi, ai, a)
        return False

    def _check(self, a: Analysis, idx: int) -> Reason | None:
        """allocateDevice's checks against the claim's picks so far, without changing them."""
        dev = self.node.devices[idx]
        reason = self.pod.taken(self.claim, a.request, idx)
        if reason is not None:
            return reason
        reason = self.usage.check_counters(dev, in_claim=True, picks=self.picks)
        if reason is not None:
            return reason
        reason = self.constraints.check(a, idx, self.picks)
        if reason is not None:
            return reason
        if dev.allow_multiple and self.usage.holds_capacity(idx):
            reason, _ = self.usage.check_capacity(a.request, dev, in_claim=True)
            if reason is not None:
                return reason
        return None

    def _add(self, a: Analysis, idx: int) -> Reason | None:
        reason = self._check(a, idx)
        if reason is not None:
            return reason
        dev = self.node.devices[idx]
        req = a.request
        self.usage.take_counters(dev)
        self.constraints.add(a, idx)
        consumed = None
        share_id = None
        if dev.allow_multiple:
            consumed = a.consumed[idx]
            self.usage.take_capacity(idx, consumed)
            nth = sum(1 for p in self.picks if p.device.index == idx)
            share_id = share_id_of(self.claim, req, dev, nth)
        else:
            self._exclusive.setdefault(idx, []).append((self.claim, req.full_name))
        self.picks.append(Pick(req, dev, consumed, share_id))
        return None

    def _remove(self, a: Analysis, idx: int) -> None:
        pick = self.picks.pop()
        dev = pick.device
        assert dev.index == idx
        if dev.allow_multiple:
            self.usage.release_capacity(idx, pick.consumed, self.picks)
        else:
            self._exclusive[idx].pop()
            if not self._exclusive[idx]:
                del self._exclusive[idx]
        self.usage.release_counters(dev)
        self.constraints.remove(a, idx)

    def _record(self, gi: int, ai: int, a: Analysis, reason: Reason | None = None) -> None:
        """Keep the deepest failed state of this request (and of the whole search)."""
        depth = len(self.picks)
        key = (gi, ai)
        if depth > self._blocker_depth:
            self._blocker_depth = depth
            self._blocker = key
        if key in self._depth and self._depth[key] >= depth:
            return
        self._depth[key] = depth
        rejections: dict[int, Reason] = {}
        mine = {p.device.index for p in self.picks if p.request is a.request}
        for idx in a.candidates:
            if idx in mine:
                continue
            why = self._check(a, idx)
            rejections[idx] = why or Reason(
                "no-completion",
                "fits with the devices chosen so far, but no complete allocation includes it",
            )
        self.attempts[key] = Attempt(list(self.picks), rejections, reason)
