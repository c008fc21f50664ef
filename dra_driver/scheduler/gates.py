"""What a DRA feature gate that is off does to a claim, as the modelled scheduler reads it
(:mod:`dra_driver.scheduler.versions` names the gates; the slices' side is
:mod:`dra_driver.scheduler.pools` and :mod:`dra_driver.scheduler.slice_layout`).

k8s.io/dynamic-resource-allocation ``structured/internal/incubating/allocator_incubating.go``
(the same in release-1.34 and release-1.35): ``Allocate`` refuses a request with
``firstAvailable`` when DRAPrioritizedList is off, ``validateDeviceRequest`` one with
``adminAccess`` when DRAAdminAccess is off; both are errors of the claim, not "does not fit".
Without DRAConsumableCapacity the incubating allocator runs, which has no capacity requests:
a request's ``capacity`` is not read.
"""

from __future__ import annotations

import dataclasses

from dra_driver.scheduler.domain import Claim, RequestGroup
from dra_driver.scheduler.outcome import Outcome, Reason
from dra_driver.scheduler.search import Search
from dra_driver.scheduler.versions import (
    ADMIN_ACCESS,
    CONSUMABLE_CAPACITY,
    PRIORITIZED_LIST,
    Scheduler,
)


def refusal(claim: Claim, scheduler: Scheduler) -> Reason | None:
    """The error the modelled scheduler answers this claim with because of a gate that is off
    (the first, in request order), or None."""
    for group in claim.requests:
        if group.first_available and not scheduler.enabled(PRIORITIZED_LIST):
            return Reason(
                "feature-gate",
                f"claim {claim.ref}, request {group.name}: has subrequests (firstAvailable), but"
                f" {PRIORITIZED_LIST} is off in the modelled Kubernetes {scheduler.version}"
                " scheduler, which refuses the claim",
                {"gate": PRIORITIZED_LIST, "request": group.name},
            )
        for req in group.alternatives:
            if req.admin_access and not scheduler.enabled(ADMIN_ACCESS):
                return Reason(
                    "feature-gate",
                    f"claim {claim.ref}, request {req.full_name}: admin access is requested, but"
                    f" {ADMIN_ACCESS} is off in the modelled Kubernetes {scheduler.version}"
                    " scheduler, which refuses the claim",
                    {"gate": ADMIN_ACCESS, "request": req.full_name},
                )
    return None


def run(search: Search, scheduler: Scheduler) -> Outcome:
    """``search.run()``, or, when a gate that is off refuses the claim, that error (before any
    search, as Allocate and validateDeviceRequest answer it) with each request's candidates."""
    refused = refusal(search.claim, scheduler)
    if refused is None:
        return search.run()
    analyses = [
        [search.candidates.analyse(r) for r in g.alternatives] for g in search.claim.requests
    ]
    return Outcome(False, [], {}, analyses, {}, None, refused, False, 0)


def as_read(claim: Claim, scheduler: Scheduler) -> Claim:
    """``claim`` with what the modelled scheduler does not read left out: capacity requests
    without DRAConsumableCapacity."""
    if scheduler.enabled(CONSUMABLE_CAPACITY):
        return claim
    if not any(r.capacity for g in claim.requests for r in g.alternatives):
        return claim
    groups = tuple(
        RequestGroup(
            g.name,
            tuple(dataclasses.replace(r, capacity={}) for r in g.alternatives),
            g.first_available,
        )
        for g in claim.requests
    )
    return dataclasses.replace(claim, requests=groups)


__all__ = ["as_read", "refusal", "run"]
