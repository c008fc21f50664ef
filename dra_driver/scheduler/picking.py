"""How the search picks a device, the rules it shares with the pod-wide search: a share's ID
(``share_id_of``), where the next device of a request is searched from when devices may repeat
(``resume_at``: a device that allows multiple allocations, a distinctAttribute), what the claims
of one pod take together (``PodShare``), and the 32-device limit met during the search
(``TooMany``). The search itself is ``search``'s; each rule cites the upstream code it follows.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from dra_driver.scheduler.capacity import Usage
from dra_driver.scheduler.domain import MAX_RESULTS, Claim, Device, Request
from dra_driver.scheduler.outcome import Analysis, Pick, Reason

SHARE_NAMESPACE = uuid.UUID("5b0c5d36-8f3e-4f0b-9a53-7d1e3c2f6a10")
"""Share IDs are uuid5(this, claim/request/device): the same input gives the same allocation.
(Upstream draws a random UUID; any unique ID per device share is valid.)"""


def share_id_of(claim: Claim, req: Request, dev: Device, nth: int = 0) -> str:
    """The shareID of the ``nth`` (from 0) share of ``dev`` in ``claim``, picked for ``req``
    (see SHARE_NAMESPACE): a device that allows multiple allocations may be picked more than
    once in one claim, each time with an ID of its own (allocateDevice: GenerateNewShareID)."""
    key = f"{claim.uid or claim.ref}/{req.full_name}/{'/'.join(dev.key)}"
    if nth:
        key += f"/{nth}"
    return str(uuid.uuid5(SHARE_NAMESPACE, key))


def share_ordinal(picks: Sequence[Pick], i: int) -> int:
    """How many of ``picks`` before the ``i``-th are shares of the same device."""
    index = picks[i].device.index
    return sum(1 for p in picks[:i] if p.device.index == index)


def resume_at(a: Analysis, devices: Sequence[Device], ci: int) -> int:
    """Where the next device of an ExactCount request is searched from, after candidate ``ci``
    (structured/internal/experimental/allocator_experimental.go, allocateOne): upstream tries
    every device from the first at each position, skipping those in use; a device that allows
    multiple allocations is never in use (deviceInUse), so it is tried again. Starting at ``ci``
    for such a device (``ci + 1`` for the others) finds the same first allocation without trying
    two orders of one set, because capacity, counters and matchAttribute do not depend on the
    order. A distinctAttribute constraint does (constraint.go keeps one value per request, the
    last one added), so under one the search restarts at the first candidate, as upstream."""
    if in_upstream_order(a):
        return 0
    return ci if devices[a.candidates[ci]].allow_multiple else ci + 1


def in_upstream_order(a: Analysis) -> bool:
    """Whether the order of a request's picks decides what fits (see ``resume_at``)."""
    return any(c.kind == "distinctAttribute" for c, _, _ in a.constraint_values)


class PodShare:
    """What the claims allocated together take (Allocate's ``allocatingDevices`` and
    ``consumedCounters``, shared by every claim of ``claimsToAllocate``), and what follows a
    claim's last request (``allocateOne`` past a claim's requests: the next claim). One claim
    alone has one of its own, after which nothing follows."""

    def __init__(self, usage: Usage) -> None:
        self.usage = usage
        self.held: dict[int, list[tuple[Claim, str]]] = {}
        """Device index -> (claim, request) holding it, in the order taken."""

    def then(self, done: object) -> bool:
        """Called when the search ``done`` (a ``search.Search``) has a device for every request:
        True ends the search."""
        del done
        return True

    def taken(self, claim: Claim, request: Request, idx: int) -> Reason | None:
        """allocateDevice's "in use" for a device the pod's claims are allocating: taken
        by a request of ``claim`` (admin access too), or of another claim unless ``request``
        has admin access (allocatingDeviceForClaim / allocatingDeviceForAnyClaim)."""
        for owner, name in self.held.get(idx, ()):
            if owner is claim:
                return Reason(
                    "taken", f"already chosen for request {name} of this claim", {"request": name}
                )
        holders = self.held.get(idx)
        if holders and not request.admin_access:
            owner, name = holders[0]
            return Reason(
                "taken-in-pod",
                f"already chosen for request {name} of claim {owner.ref} of this pod",
                {"request": name, "claim": owner.ref},
            )
        return None


class TooMany(Exception):
    """errAllocationResultMaxSizeExceeded (``allocateOne``): the claim would hold more than 32
    devices. Every caller passes it up without trying its other devices, to the loop over a
    firstAvailable request's subrequests, which tries the next one; when all of them exceed,
    it goes on up, and out of ``Allocate`` it is the claim's error "allocation max size
    exceeded"."""


def too_many(claim: Claim) -> Reason:
    """The claim's error when every way to allocate it exceeds the limit (``TooMany`` out of
    ``Allocate``)."""
    return Reason(
        "too-many",
        f"allocation max size exceeded: every way to allocate claim {claim.ref} takes more"
        f" than {MAX_RESULTS} devices",
        {"limit": MAX_RESULTS, "upstream": "allocation max size exceeded"},
    )
