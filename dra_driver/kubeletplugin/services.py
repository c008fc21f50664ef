"""The gRPC services of the DRA socket: ``DRAPlugin`` (v1 and v1beta1, one implementation) and
``v1alpha1.DRAResourceHealth``, and the :class:`Gate` they wait at.

Each call runs on the server's thread pool (``server.PluginServer``); claim work runs on the
preparer's own pool under a deadline, so a slow claim never stalls other calls. The kubelet's
request is checked before the preparer sees it (:meth:`DraService._admit`). Health-watch streams
are bounded (``max_streams``, more are refused with RESOURCE_EXHAUSTED). Until the agent holds
its state, DRA calls and health streams wait at the gate, bounded by the kubelet's deadline.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import grpc

from agent.logs import Throttle
from dra_driver.errors import ClaimError
from dra_driver.kubeletapi import health_v1alpha1_pb2, health_v1alpha1_pb2_grpc
from dra_driver.kubeletplugin.batch import ClaimResult
from dra_driver.kubeletplugin.claims import ClaimKey, check_claim_key
from dra_driver.kubeletplugin.health_stream import HealthBoard
from dra_driver.kubeletplugin.prepare import Preparer

LOG_INTERVAL = 10.0
"""Seconds between two log records of refused health-watch streams."""
HANDOVER_RESERVE_S = 5.0
"""Of the kubelet's deadline for a call, what a wait at the gate leaves for the call itself."""
MAX_CLAIMS_PER_CALL = 1024
"""Claims one NodePrepareResources or NodeUnprepareResources call may name (the kubelet sends
the claims of one pod); a call naming more is refused with INVALID_ARGUMENT, so a request of
16 MiB cannot queue hundreds of thousands of claims or ask for an answer too large to send."""


class Gate:
    """Closed until the agent may touch its state; DRA calls wait here (:meth:`wait`).

    :meth:`waiting_for` says what it waits for (the state directory and who holds it), for
    the answer a call gets when the wait runs out. :meth:`abort` (shutting down) wakes every
    waiter with False."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = False
        self._aborted = False
        self._waiting_for = "the agent is still starting"

    def waiting_for(self, why: str) -> None:
        """Why the gate is closed, in the words a refused call is answered with (the agent
        taking over from another, or still starting)."""
        with self._cond:
            self._waiting_for = why

    @property
    def is_open(self) -> bool:
        with self._cond:
            return self._open

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    def wait(self, timeout: float) -> bool:
        """Whether the gate is open within ``timeout`` seconds (False at once once aborted)."""
        with self._cond:
            self._cond.wait_for(lambda: self._open or self._aborted, max(0.0, timeout))
            return self._open and not self._aborted

    def refused(self, claims: Sequence[ClaimKey], context: Any, most: float) -> dict[str, str]:
        """Wait for the gate within the call's deadline (less a reserve for the call itself, at
        most ``most`` seconds): {} when open, else each claim's retryable error."""
        if self.is_open:
            return {}
        left = context.time_remaining() if context is not None else None
        budget = most if left is None else min(most, left - HANDOVER_RESERVE_S)
        if self.wait(budget):
            return {}
        with self._cond:
            aborted, waiting_for = self._aborted, self._waiting_for
        why = (
            "the agent is shutting down; the kubelet retries it with the next agent"
            if aborted
            else f"{waiting_for}; the kubelet retries the call"
        )
        return {c.uid: f"claim {c}: {why}" for c in claims}


class DraService:
    """DRAPlugin for one API version; the message classes come from that version's module."""

    def __init__(
        self,
        pb2: ModuleType,
        preparer: Preparer,
        gate: Gate,
        handover_wait: float,
        throttle: Throttle | None = None,
    ) -> None:
        self.pb2 = pb2
        self.preparer = preparer
        self.gate = gate
        self.handover_wait = handover_wait
        self.throttle = throttle or Throttle(preparer.log, LOG_INTERVAL)

    def _admit(
        self, request: Any, context: Any, op: str
    ) -> tuple[list[ClaimKey], dict[str, ClaimResult]]:
        """The request's claims the preparer may see, and the answers of those refused here.

        The kubelet's request is input like any other: a call naming more than
        MAX_CLAIMS_PER_CALL claims is refused whole (INVALID_ARGUMENT); a claim whose UID,
        namespace or name Kubernetes could not have made is answered with an error naming the
        field and the value (``claims[2].uid: '../x' is not a claim UID ...``), to prepare and
        to unprepare alike (the preparer makes file names of UIDs and logs the names); a claim
        named twice is taken once, and one UID given to two different claims answers that UID
        with an error naming both (the answer is keyed by UID: one of them would be lost). The
        first refusal of a UID is its answer."""
        claims = request.claims
        if len(claims) > MAX_CLAIMS_PER_CALL:
            self.throttle(
                logging.WARNING,
                f"{op}-too-many-claims",
                f"{op} call refused: too many claims",
                claims=len(claims),
                max_claims=MAX_CLAIMS_PER_CALL,
            )
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the call names {len(claims)} claims; at most {MAX_CLAIMS_PER_CALL} are taken in"
                " one call",
            )
        first: dict[str, tuple[int, ClaimKey]] = {}
        refused: dict[str, ClaimResult] = {}
        for i, c in enumerate(claims):
            key = ClaimKey(c.namespace, c.name, c.uid)
            if key.uid in refused:
                continue
            try:
                check_claim_key(key, f"claims[{i}]")
            except ClaimError as exc:
                refused[key.uid] = ClaimResult(error=f"claim refused: {exc}")
                continue
            if key.uid in first:
                j, other = first[key.uid]
                if other != key:
                    refused[key.uid] = ClaimResult(
                        error=f"claims[{j}] and claims[{i}] have the same UID {key.uid!r} but"
                        f" name different claims ({other.namespace}/{other.name} and"
                        f" {key.namespace}/{key.name}); neither is taken"
                    )
                continue
            first[key.uid] = (i, key)
        for result in refused.values():
            self.preparer.observe(op, 0.0, "invalid_claim")
            self.throttle(
                logging.WARNING,
                f"{op}-invalid-claim",
                f"{op} failed: the kubelet's request names an invalid claim",
                error=result.error,
                reason="invalid_claim",
            )
        return [k for _, k in first.values() if k.uid not in refused], refused

    def _device(self, d: Any) -> Any:
        device = self.pb2.Device(
            request_names=list(d.request_names),
            pool_name=d.pool,
            device_name=d.device,
            cdi_device_ids=list(d.cdi_device_ids),
        )
        # the allocation's share ID, echoed so the kubelet matches the device to its result
        # (v1 only: v1beta1 has no such field)
        if d.share_id is not None and "share_id" in self.pb2.Device.DESCRIPTOR.fields_by_name:
            device.share_id = d.share_id
        return device

    def NodePrepareResources(self, request: Any, context: Any) -> Any:
        keys, invalid = self._admit(request, context, "prepare")
        refused = self.gate.refused(keys, context, self.handover_wait)
        results: dict[str, ClaimResult] = invalid | (
            {uid: ClaimResult(error=e) for uid, e in refused.items()}
            if refused
            else self.preparer.prepare(keys)
        )
        resp = self.pb2.NodePrepareResourcesResponse()
        for uid, r in results.items():
            entry = resp.claims[uid]
            entry.error = r.error
            entry.devices.extend(self._device(d) for d in r.devices)
        return resp

    def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        keys, invalid = self._admit(request, context, "unprepare")
        refused = self.gate.refused(keys, context, self.handover_wait)
        results = invalid | (
            {uid: ClaimResult(error=e) for uid, e in refused.items()}
            if refused
            else self.preparer.unprepare(keys)
        )
        resp = self.pb2.NodeUnprepareResourcesResponse()
        for uid, r in results.items():
            resp.claims[uid].error = r.error
        return resp


class HealthService(health_v1alpha1_pb2_grpc.DRAResourceHealthServicer):
    """``NodeWatchResources``: at most ``max_streams`` at once. The kubelet opens one per plugin;
    more are refused with RESOURCE_EXHAUSTED, and the DRA server has ``max_streams`` threads
    beyond the ones prepare and unprepare use, so health streams can never starve them."""

    def __init__(
        self,
        board: HealthBoard,
        stop: threading.Event,
        resend_interval: float,
        max_streams: int = 4,
        log: logging.Logger | None = None,
        gate: Gate | None = None,
    ) -> None:
        self.board = board
        self.stop = stop
        self.gate = gate
        self.resend_interval = resend_interval
        self.max_streams = max_streams
        self.throttle = Throttle(log or logging.getLogger("tessera.plugin"), LOG_INTERVAL)
        self._streams = 0
        self._lock = threading.Lock()

    def _enter(self) -> bool:
        with self._lock:
            if self._streams >= self.max_streams:
                return False
            self._streams += 1
            return True

    def _leave(self) -> None:
        with self._lock:
            self._streams -= 1

    def NodeWatchResources(self, request: Any, context: Any) -> Iterator[Any]:
        if not self._enter():
            self.throttle(
                logging.WARNING,
                "health-streams",
                "health-watch stream refused: too many are open",
                peer=context.peer(),
                max_streams=self.max_streams,
            )
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many health-watch streams: {self.max_streams} are open (the agent's"
                " --kubelet-health-streams; the kubelet opens one); retry when one ends",
            )
        # a stream that ends (the kubelet restarted) wakes its thread at once, freeing its place
        context.add_callback(self.board.wake_all)
        try:
            yield from self._watch(context)
        finally:
            self._leave()

    def _watch(self, context: Any) -> Iterator[Any]:
        pb = health_v1alpha1_pb2
        seen = -1
        # before the agent holds its state, it knows nothing to say about its devices
        while self.gate is not None and not self.gate.is_open:
            if self.stop.is_set() or not context.is_active():
                return
            self.gate.wait(1.0)
        while not self.stop.is_set() and context.is_active():
            version, states = self.board.snapshot()
            if version != seen:
                seen = version
                yield pb.NodeWatchResourcesResponse(
                    devices=[
                        pb.DeviceHealth(
                            device=pb.DeviceIdentifier(pool_name=s.pool, device_name=s.device),
                            health=s.health,
                            last_updated_time=s.updated_at,
                            health_check_timeout_seconds=int(self.resend_interval * 3),
                        )
                        for s in states
                    ]
                )
            if not self.board.wait_change(seen, self.resend_interval):
                seen = -1  # nothing changed: resend the full list anyway
