"""A pod's claims allocated together, as the scheduler allocates them: ``explain_pod(claims,
classes, slices, allocated, cel=...)`` returns a ``PodExplanation``.

How upstream does it (Kubernetes 1.34 and 1.35 alike):

- kubernetes ``pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go``:
  ``PreFilter`` reads the pod's claims in ``pod.spec.resourceClaims`` order
  (``podResourceClaims``/``foreachPodResourceClaim``: a ``resourceClaimName`` names the claim, a
  ``resourceClaimTemplateName`` the claim generated for the pod, found in
  ``pod.status.resourceClaimStatuses``); ``Filter`` hands ``Allocate`` the claims without an
  allocation, in that order (``claims.go``, ``claimStore.toAllocate``); an allocated claim is
  not allocated again: its devices count as allocated (``ListAllAllocatedDevices`` /
  ``GatherAllocatedState``) and its ``nodeSelector`` must match the node. ``Allocate``'s answer
  is all or nothing: "cannot allocate all claims".
- k8s.io/dynamic-resource-allocation ``structured/internal/incubating/allocator_incubating.go``
  (and the stable and experimental variants, the same here): ``Allocate`` validates every
  claim's requests first, in claim order (``validateDeviceRequest``; the first error stops
  allocation on the node), then ``allocateOne`` searches the claims one after the other, each
  claim's requests in order: past a claim's last request it goes on with the next claim
  (``allocateOne(deviceIndices{claimIndex: r.claimIndex + 1})``), and when that claim cannot be
  allocated it returns false, so the earlier claim takes back its last device
  (``deallocate()``) and tries its next candidate. So a later claim's failure makes every
  earlier claim try its other choices: the search finds an allocation of all the claims
  whenever one exists. What the claims take is shared while they are allocated together:
  ``allocatingDevices`` (a device taken by one claim is in use for the others, except for a
  request with admin access, which only may not take a device its own claim took:
  ``allocatingDeviceForClaim``) and ``consumedCounters`` (and, for devices that allow multiple
  allocations, ``allocatingCapacity``). Constraints stay per claim (``constraints[claimIndex]``),
  and so does the limit of 32 results.

The search itself is ``search.Search``'s, one per claim, chained through a ``PodShare``; this
module chains them, says which claim could not be placed, and whether that claim fits on its
own (then it is the claims together that do not fit, not an earlier claim's greedy choice: the
search tried every allocation of the claims before it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from dra_driver.scheduler import gates
from dra_driver.scheduler.capacity import Usage
from dra_driver.scheduler.celenv import CelEnvironment
from dra_driver.scheduler.domain import (
    Claim,
    InputError,
    QuantityReader,
    parse_claim,
)
from dra_driver.scheduler.explanation import Explanation
from dra_driver.scheduler.node_read import read_node
from dra_driver.scheduler.outcome import Fatal, GaveUp, Reason
from dra_driver.scheduler.picking import PodShare, TooMany, too_many
from dra_driver.scheduler.search import Search
from dra_driver.scheduler.versions import Scheduler


class _Chain(PodShare):
    """The claims in order: past one claim's last request, the next claim's search. ``build``
    makes each claim's search, sharing this chain."""

    def __init__(
        self,
        usage: Usage,
        claims: Sequence[Claim],
        build: Callable[[Claim, PodShare], Search],
    ) -> None:
        super().__init__(usage)
        self.searches = [build(c, self) for c in claims]
        self.deadline = 0.0
        self.current = 0
        """The claim being searched (after a Fatal: the claim whose error stopped it)."""
        self.reached = 0
        """The furthest claim the search got to."""

    def then(self, done: object) -> bool:
        following = next(i for i, s in enumerate(self.searches) if s is done) + 1
        if following == len(self.searches):
            return True
        self.current = following
        self.reached = max(self.reached, following)
        try:
            ok = self.searches[following].search(self.deadline)
        except TooMany:
            # allocateOne at a claim's end: errAllocationResultMaxSizeExceeded from the next
            # claim is no error, "the next claim just needs to be allocated differently"
            # (allocator_incubating.go): a plain failure, the earlier claims try again
            ok = False
        self.current = following - 1
        return ok


class ClaimInputError(InputError):
    """Claim ``index`` of the pod is malformed (``path`` and ``message`` as InputError)."""

    def __init__(self, index: int, error: InputError) -> None:
        super().__init__(error.path, error.message)
        self.index = index


def _claim(index: int, claim: Mapping[str, Any], q: QuantityReader) -> Claim:
    try:
        return parse_claim(claim, q)
    except InputError as exc:
        raise ClaimInputError(index, exc) from exc


def explain_pod(
    claims: Sequence[Mapping[str, Any]],
    classes: Sequence[Mapping[str, Any]],
    slices: Sequence[Mapping[str, Any]],
    allocated: Sequence[Mapping[str, Any]],
    *,
    cel: CelEnvironment,
    time_limit_s: float = 10.0,
    in_use: Iterable[tuple[str, str, str]] = (),
    clock: Callable[[], float] = time.monotonic,
    scheduler: Scheduler | None = None,
) -> PodExplanation:
    """Allocate ``claims`` (a pod's claims without an allocation, in the pod's order) together
    against one node's ``slices``, as ``Allocate`` does; ``time_limit_s`` bounds the whole
    search (the scheduler's filter timeout bounds the whole call too). ``scheduler`` is the
    version and feature gates modelled (default: the newest), as for ``explain``.
    ClaimInputError for a malformed claim, InputError for other malformed input."""
    read = read_node(classes, slices, allocated, in_use, scheduler)
    scheduler, device_classes, node, state = read.scheduler, read.classes, read.node, read.allocated
    parsed = [gates.as_read(_claim(i, c, read.quantities), scheduler) for i, c in enumerate(claims)]
    chain = _Chain(
        Usage(node, state),
        parsed,
        lambda c, pod: Search(
            c, device_classes, node, state, cel, time_limit_s=time_limit_s, clock=clock, pod=pod
        ),
    )
    fatal: Reason | None = None
    blocked: int | None = None
    # validateDeviceRequest for every claim before the search; the first error stops it
    for i, s in enumerate(chain.searches):
        try:
            found = s.prepare()
        except InputError as exc:  # a selector that does not compile
            raise ClaimInputError(i, exc) from exc
        found = found or gates.refusal(s.claim, scheduler)  # a gate that is off refuses it
        if found is not None and fatal is None:
            fatal, blocked = found, i
    ok = gave_up = False
    if fatal is None and chain.searches:
        chain.deadline = clock() + time_limit_s
        try:
            ok = chain.searches[0].search(chain.deadline)
        except GaveUp:
            gave_up = True
        except Fatal as e:
            fatal, blocked = e.reason, chain.current
        except TooMany:
            fatal, blocked = too_many(chain.searches[chain.current].claim), chain.current
    elif not chain.searches:
        ok = True
    if not ok and blocked is None:
        blocked = chain.reached
    explanations = [
        Explanation(
            s.claim,
            node,
            s.outcome(ok, fatal if i == blocked else None, gave_up),
            time_limit_s,
            device_classes,
            slices,
            scheduler,
        )
        for i, s in enumerate(chain.searches)
    ]
    alone = None
    if blocked and not ok and not gave_up and fatal is None:
        # the claim that could not be placed, on its own: does it fit without the others?
        # (a search of one claim, with a time limit of its own)
        s = Search(
            parsed[blocked],
            device_classes,
            node,
            state,
            cel,
            time_limit_s=time_limit_s,
            clock=clock,
        )
        alone = Explanation(
            parsed[blocked],
            node,
            gates.run(s, scheduler),
            time_limit_s,
            device_classes,
            slices,
            scheduler,
        )
    return PodExplanation(explanations, None if ok else blocked, alone)


def _refs(claims: Sequence[Explanation]) -> str:
    return ", ".join(c.claim.ref for c in claims)


class PodExplanation:
    """The answer of ``explain_pod``: one ``Explanation`` per claim (all fit, or none is
    allocated), the claim that could not be placed (``blocked``), and that claim explained on
    its own (``alone``; only when claims before it were placed)."""

    def __init__(
        self, claims: list[Explanation], blocked: int | None, alone: Explanation | None
    ) -> None:
        self.claims = claims
        self.blocked = blocked
        self.alone = alone
        self.ok = blocked is None
        self.gave_up = any(c.gave_up for c in claims)

    def renamed(self, claims: list[Explanation], alone: Explanation | None) -> PodExplanation:
        """The same answer with each explanation renamed for a look-alike node."""
        return PodExplanation(claims, self.blocked, alone)

    @property
    def fits_alone(self) -> bool | None:
        """Whether the claim that could not be placed fits without the claims before it (None:
        not asked, it was the first, or the search stopped)."""
        return None if self.alone is None else self.alone.ok

    def first_reason(self) -> str:
        """One line: why the pod's claims do not fit together ("fits" when they do); it names
        the claim when there are several."""
        if self.blocked is None:
            return "fits"
        claim = self.claims[self.blocked]
        text = self._reason()
        return text if len(self.claims) == 1 else f"{claim.claim.ref}: {text}"

    def _reason(self) -> str:
        assert self.blocked is not None
        claim = self.claims[self.blocked]
        if self.alone is None:
            return claim.first_reason()
        if not self.alone.ok:
            return self.alone.first_reason()
        earlier = self.claims[: self.blocked]
        them = "it" if len(earlier) == 1 else "them"
        return (
            f"fits alone, but not beside {_refs(earlier)}: the claims were allocated together"
            f" and no allocation of {them} leaves room for it; {claim.first_reason()}"
        )

    def text(self, index: int) -> str:
        """Claim ``index``'s part of the answer: its own text when the pod fits; otherwise
        what happened to it while the claims were allocated together."""
        claim = self.claims[index]
        if self.blocked is None or claim.gave_up:
            return claim.text()
        blocked = self.claims[self.blocked].claim.ref
        if self.claims[self.blocked].outcome.fatal is not None and index != self.blocked:
            return f"not allocated: allocation on this node stopped at an error of {blocked}"
        if index < self.blocked and self.fits_alone is False:
            return f"not allocated: {blocked} does not fit on this node, with or without it"
        if index < self.blocked:
            return (
                f"not allocated: it can be placed, but then {blocked} cannot"
                f" (every allocation of the claims before {blocked} was tried)"
            )
        if index > self.blocked:
            return f"not tried: {blocked} before it could not be placed"
        if claim.error is not None:  # an error of the claim is said as such (explanation.text)
            return claim.text()
        source = self.alone if self.alone is not None and not self.alone.ok else claim
        lines = source.text().splitlines()
        lines[0] = f"does not fit: {self._reason()}"
        return "\n".join(lines)

    def status(self, index: int) -> str:
        """``allocated`` (the pod fits), ``blocked`` (the claim that could not be placed),
        ``placed`` (a claim before it) or ``not-tried`` (a claim after it)."""
        if self.blocked is None:
            return "allocated"
        if index == self.blocked:
            return "blocked"
        return "placed" if index < self.blocked else "not-tried"


__all__ = ["ClaimInputError", "PodExplanation", "explain_pod"]
