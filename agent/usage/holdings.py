"""One holding's counters as the usage ledger (:mod:`agent.usage.counters`) keeps them in
memory, and what stays the same about a holding while it is held.

- :class:`Held`: a holding's identity and the fields that do not change while it is held (the
  claim's names, its GPU, its weight, its product, MIG profile and DeviceClass). The sampler
  makes these once per change of who holds what and hands the ledger the same tuple every tick,
  with only the numbers that change (energy and busy time); the ledger finds the records and
  bucket entries they count into once per such tuple (``python -m bench telemetry`` measures
  the sampler's CPU per tick with the ledger fed: one pass per held device).
- :class:`Record`: one holding's counters, mutable, updated in place every interval.
"""

from __future__ import annotations

from typing import NamedTuple

from agent.usage.buckets import EntryKey, Share
from agent.usage.ledger_file import Counters, HoldingKey


class Held(NamedTuple):
    """What stays the same about one holding while it is held (see the module docstring)."""

    key: HoldingKey
    namespace: str
    claim: str
    gpu_uuid: str
    weight: float
    """The share of the physical GPU the device holds (0-1)."""
    rule: str
    product: str = ""
    """The GPU's product name (what a price table matches)."""
    mig_profile: str | None = None
    """A MIG device's profile (``1g.10gb``, what a price table matches); None for a GPU."""
    device_class: str = ""
    """The DeviceClass its claim's request named ("" when not known)."""

    @property
    def entry_key(self) -> EntryKey:
        """The key of its entries in the buckets."""
        return (self.key[0], self.device_class, self.product, self.mig_profile)


class Record:
    """One holding's counters as the ledger updates them every interval (mutable; the ledger's
    own: nothing outside :mod:`agent.usage.counters` holds one)."""

    __slots__ = (
        "allocated",
        "busy",
        "claim",
        "device_class",
        "energy",
        "gpu_uuid",
        "mig_profile",
        "namespace",
        "product",
        "released_at",
        "rule",
        "unobserved",
        "weight",
    )

    def __init__(self, c: Counters) -> None:
        self.namespace, self.claim, self.gpu_uuid = c.namespace, c.claim, c.gpu_uuid
        self.weight, self.rule = c.weight, c.rule
        self.allocated, self.busy = c.allocated_gpu_seconds, c.busy_gpu_seconds
        self.energy, self.unobserved = c.energy_joules, c.unobserved_seconds
        self.released_at = c.released_at
        self.product, self.mig_profile, self.device_class = (
            c.product,
            c.mig_profile,
            c.device_class,
        )

    def hold(self, h: Held) -> bool:
        """Take ``h``'s fields (held again, or still held); True when its weight changed."""
        self.released_at = None
        self.namespace, self.claim, self.gpu_uuid = h.namespace, h.claim, h.gpu_uuid
        self.rule, self.product = h.rule, h.product
        self.mig_profile, self.device_class = h.mig_profile, h.device_class
        if self.weight == h.weight:
            return False
        self.weight = h.weight
        return True

    def share(self, uid: str, allocated: float, busy: float, energy: float, idle: float) -> Share:
        """One interval's counters as its bucket entry counts them."""
        key = (uid, self.device_class, self.product, self.mig_profile)
        return Share(key, self.namespace, self.claim, allocated, busy, energy, idle)

    def frozen(self) -> Counters:
        return Counters(
            self.namespace,
            self.claim,
            self.gpu_uuid,
            self.weight,
            self.rule,
            self.allocated,
            self.busy,
            self.energy,
            self.unobserved,
            self.released_at,
            self.product,
            self.mig_profile,
            self.device_class,
        )


ZERO = Counters("", "", "", 0.0, "")
"""A new holding's counters."""
