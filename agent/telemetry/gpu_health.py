"""GPU health from what the sampler sees: failed reads, XIDs, resets, and a probe before recovery.

State is kept per GPU UUID (indexes can shift when the inventory is read again). The rules, in
the order the sampler applies them each tick (reads first, then the XIDs drained since the last
tick, then :meth:`HealthTracker.evaluate` per GPU):

- **Lost**: a failed read (an exception, or NVML's GpuIsLost: ``sample.lost``) makes the GPU
  unhealthy with cause ``gpu-lost`` for as long as reads fail.
- **Fatal XID** (``FATAL_XIDS``): unhealthy with cause ``xid-<n>``, sticky until a recovery is
  *observed*: (a) the GPU's reads failed after (or in the tick of) the XID and it answers again,
  or (b) a reset or re-bind of the GPU was reported (:meth:`HealthTracker.observe_reset`).
  A later fatal XID replaces the cause; a fatal XID while lost names the cause (``xid-79``).
- **Application XIDs** (``APPLICATION_XIDS`` plus the configured ones) and XIDs in neither set
  are counted and logged; the GPU stays healthy (the workload faulted, not the GPU).
- **Handed to a virtual machine** (:meth:`HealthTracker.handed_over`): unbinding the GPU from
  nvidia for vfio-pci makes NVML lose it, so the ticks before the inventory says so may fail to
  read it. That is not a loss: ``gpu-lost`` (and a probe) is cleared at once, and the GPU is not
  evaluated while a VM has it (nothing on the host reads it). A fatal XID stays: only a reset
  clears it (binding it to nvidia again is a re-bind, so that reset is observed then).
- **Probe**: after an observed recovery the GPU stays unhealthy (same cause) until
  ``probe_reads`` consecutive ticks read it successfully with nothing disqualifying
  (:func:`probe_problem`: a row remapping still pending after the reset). A failed read or a
  fatal XID during the probe starts over.

Why (sources in docs/gpu-facts.md "XIDs and recovery"): NVIDIA's XID catalog gives every XID in
``FATAL_XIDS`` a GPU reset (or node reboot) as the immediate action, so nothing short of a reset
makes such a GPU usable again; XID 79 means the GPU fell off the bus, after which its NVML calls
fail until a reset brings it back. The NVIDIA k8s-device-plugin skips the same six application
XIDs, but it never recovers a device (only a restart of the plugin does).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from agent.nvml.samples import GpuSample

FATAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95})
"""Hardware or fatal XIDs: the GPU is unhealthy until a reset is observed (48 DBE, 63/64 row
remapping, 74 NVLink, 79 fallen off the bus, 92 high SBE rate, 94/95 contained/uncontained
ECC)."""
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
"""Caused by the workload (graphics engine exception, MMU fault, stopped/preempted context,
video decoder, context switch timeout): counted, the GPU stays healthy."""
PROBE_READS = 2
"""Consecutive good reads (one per tick) a recovering GPU needs before it is healthy again."""
GPU_LOST = "gpu-lost"


def xid_cause(xid: int) -> str:
    return f"xid-{xid}"


def application_xids(extra: frozenset[int] | None) -> frozenset[int]:
    """The built-in application XIDs plus ``extra`` (checked by :func:`parse_xids`)."""
    if extra and extra & FATAL_XIDS:
        raise ValueError(f"fatal XIDs are not application XIDs: {sorted(extra & FATAL_XIDS)}")
    return APPLICATION_XIDS | (extra or frozenset())


def parse_xids(raw: str) -> frozenset[int]:
    """``--application-xids``: ``1,2,3`` -> frozenset; ValueError as a phrase that follows the
    value (agent.config), naming the bad item or the fatal XIDs."""
    out = set()
    for item in (i.strip() for i in raw.split(",")):
        if not item:
            continue
        if not item.isdigit() or int(item) < 1:
            raise ValueError(
                f"is not a comma-separated list of XID numbers (e.g. 1,2,3): {item!r} is not a"
                " whole number > 0"
            )
        out.add(int(item))
    fatal = sorted(out & FATAL_XIDS)
    if fatal:
        raise ValueError(
            f"names fatal XID(s) {', '.join(map(str, fatal))}: a GPU with one needs a reset, so"
            " it cannot be treated as an application XID (fatal:"
            f" {', '.join(map(str, sorted(FATAL_XIDS)))})"
        )
    return frozenset(out)


def xid_kind(xid: int, application: frozenset[int]) -> str:
    """``fatal``, ``application`` or ``unknown`` (unknown XIDs keep the GPU healthy too)."""
    if xid in FATAL_XIDS:
        return "fatal"
    return "application" if xid in application else "unknown"


def probe_problem(sample: GpuSample) -> str | None:
    """Why a successful read does not count towards recovery; None when it does."""
    if sample.lost:
        return "the GPU is lost"
    if sample.remap_pending:
        return "row remapping still pending (a reset should have applied it)"
    return None


@dataclass(frozen=True)
class GpuHealth:
    """One GPU's health, as reported to ``on_health_change`` when it changes."""

    uuid: str
    index: int
    healthy: bool
    cause: str | None
    """``xid-<n>`` or ``gpu-lost`` while unhealthy; None when healthy."""
    since: float
    """Wall-clock seconds when the GPU entered this health (kept while only the cause
    changes)."""


@dataclass
class _State:
    healthy: bool = True
    cause: str | None = None
    since: float = 0.0
    fatal_xid: int | None = None
    lost: bool = False
    lost_after_fatal: bool = False
    reset_seen: bool = False
    probing: bool = False
    good_reads: int = 0
    probe_note: str | None = None
    restored_since: float | None = None
    """Set by ``restore``: the ``since`` of the restored fault, used at its first report."""


class HealthTracker:
    """The health rules of the module docstring, per GPU UUID. Thread-safe: ``observe_reset``
    may come from another thread than the sampler's."""

    def __init__(self, probe_reads: int = PROBE_READS) -> None:
        if probe_reads < 1:
            raise ValueError("probe_reads must be at least 1")
        self.probe_reads = probe_reads
        self._states: dict[str, _State] = {}
        self._lock = threading.Lock()

    def fatal_xid(self, uuid: str, xid: int) -> None:
        """A fatal XID was seen on this GPU (call after the tick's reads, before evaluate)."""
        with self._lock:
            st = self._states.setdefault(uuid, _State())
            st.fatal_xid = xid
            st.lost_after_fatal = st.lost  # a failed read in this tick counts
            st.reset_seen = False
            st.probing, st.good_reads = False, 0

    def sticky(self) -> dict[str, tuple[int, float]]:
        """The fatal XIDs that hold GPUs unhealthy now: UUID -> (XID, since). What must
        survive a restart of the agent (:mod:`agent.telemetry.faults`)."""
        with self._lock:
            return {
                u: (st.fatal_xid, st.since)
                for u, st in self._states.items()
                if st.fatal_xid is not None
            }

    def restore(self, uuid: str, xid: int, since: float) -> None:
        """A fatal XID an earlier agent saw on this GPU and no recovery cleared: the GPU is
        unhealthy from its first tick on (reported then, with the original ``since``), until
        a recovery is observed as for any fatal XID."""
        with self._lock:
            st = self._states.setdefault(uuid, _State())
            st.fatal_xid, st.restored_since = xid, since
            st.lost_after_fatal, st.reset_seen = False, False

    def observe_reset(self, uuid: str) -> None:
        """A reset or re-bind of this GPU was observed: its fatal XID no longer holds; the
        probe decides (see the module docstring)."""
        with self._lock:
            self._states.setdefault(uuid, _State()).reset_seen = True

    def handed_over(self, uuid: str, index: int, now: float) -> GpuHealth | None:
        """The GPU was handed to a virtual machine: failed reads are no loss (see the module
        docstring); the new health when it changed, else None."""
        with self._lock:
            st = self._states.setdefault(uuid, _State(since=now))
            st.lost, st.lost_after_fatal = False, False
            st.probing, st.good_reads, st.probe_note = False, 0, None
            return self._report(st, uuid, index, now)

    def evaluate(self, uuid: str, index: int, sample: GpuSample, now: float) -> GpuHealth | None:
        """Apply this tick's read of the GPU; the new health when it changed (health or cause),
        else None."""
        with self._lock:
            st = self._states.setdefault(uuid, _State(since=now))
            self._apply(st, sample)
            return self._report(st, uuid, index, now)

    def _report(self, st: _State, uuid: str, index: int, now: float) -> GpuHealth | None:
        """Take the verdict on ``st`` (the caller holds the lock); the new health when it
        changed (health or cause), else None."""
        healthy, cause = self._verdict(st)
        if healthy == st.healthy and cause == st.cause:
            return None
        if healthy != st.healthy:
            st.since = now if st.restored_since is None else st.restored_since
        st.restored_since = None
        st.healthy, st.cause = healthy, cause
        return GpuHealth(uuid=uuid, index=index, healthy=healthy, cause=cause, since=st.since)

    def current(self, uuid: str, index: int) -> GpuHealth:
        with self._lock:
            st = self._states.get(uuid) or _State()
            return GpuHealth(uuid, index, st.healthy, st.cause, st.since)

    def probe_note(self, uuid: str) -> str | None:
        """Why the running probe did not count the latest read (None: it did, or no probe)."""
        with self._lock:
            st = self._states.get(uuid)
            return st.probe_note if st is not None else None

    def _apply(self, st: _State, sample: GpuSample) -> None:
        if sample.lost:
            st.lost, st.lost_after_fatal = True, True
            st.probing, st.good_reads, st.probe_note = False, 0, None
            return
        answered_again = st.lost
        st.lost = False
        if st.reset_seen or (answered_again and (st.fatal_xid is None or st.lost_after_fatal)):
            # a recovery was observed: the fatal XID no longer holds, the probe starts
            st.fatal_xid, st.lost_after_fatal, st.reset_seen = None, False, False
            if not st.healthy:
                st.probing, st.good_reads = True, 0
        if not st.probing:
            return
        st.probe_note = probe_problem(sample)
        st.good_reads = 0 if st.probe_note else st.good_reads + 1
        if st.good_reads >= self.probe_reads:
            st.probing, st.good_reads = False, 0

    @staticmethod
    def _verdict(st: _State) -> tuple[bool, str | None]:
        if st.fatal_xid is not None:
            return False, xid_cause(st.fatal_xid)
        if st.lost:
            return False, GPU_LOST
        if st.probing:
            return False, st.cause or GPU_LOST
        return True, None
