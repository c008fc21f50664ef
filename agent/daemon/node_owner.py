"""The Node's uid in kube mode: the ResourceSlices' ownerReference (slices then go away with the
Node) and the subject of the Node events.

Read once at start (:meth:`NodeOwner.read`); when that fails (an API-server outage, a Node not
yet registered, RBAC not yet applied) the slices are published without an owner all the same
and :meth:`NodeOwner.follow` keeps reading, with capped backoff, until the uid is known, then
asks the publisher for a round at once (the ownerReference is part of what a slice must hold,
``dra_driver.advertise.slices.spec_equal``, so that round rewrites them)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from agent.logs import fields_
from dra_driver.advertise.publisher import Backoff
from dra_driver.errors import KubeError

if TYPE_CHECKING:  # imported where kube mode starts (build_agent)
    from dra_driver.cluster.kube import KubeClient

OWNER_RETRY_BASE_S = 1.0
OWNER_RETRY_CAP_S = 30.0
"""Between reads of the Node while its uid is unknown: 1 s doubling to 30 s (with jitter), so a
long outage costs one request every 15-30 s and the owner is set within 30 s of its end."""


def node_uid(kube: KubeClient, name: str, log: logging.Logger) -> str | None:
    """The Node's uid for slice ownerReferences; None (logged) when it cannot be read."""
    try:
        uid = kube.request("GET", f"/api/v1/nodes/{name}").get("metadata", {}).get("uid")
    except KubeError as exc:
        log.warning(
            "cannot read the Node; slices get no owner until it can be read",
            extra=fields_(node=name, error=str(exc)),
        )
        return None
    return str(uid) if uid else None


class NodeOwner:
    """The Node's uid (kube mode): the publisher asks :meth:`uid` each round, the Node events
    use it as their subject."""

    def __init__(
        self,
        kube: KubeClient | None,
        name: str,
        log: logging.Logger,
        *,
        backoff: Backoff | None = None,
    ) -> None:
        self.kube = kube
        self.name = name
        self.log = log
        self.backoff = backoff or Backoff(base=OWNER_RETRY_BASE_S, cap=OWNER_RETRY_CAP_S)
        self._uid: str | None = None

    def read(self) -> str | None:
        """Read the uid from the API server (None, logged, when it cannot be read)."""
        if self.kube is not None and self._uid is None:
            self._uid = node_uid(self.kube, self.name, self.log)
        return self._uid

    def uid(self) -> str | None:
        return self._uid

    @property
    def unknown(self) -> bool:
        """Whether there is a Node to read (kube mode) whose uid is not known yet."""
        return self.kube is not None and self._uid is None

    def follow(
        self,
        stop: threading.Event,
        on_known: Callable[[], None],
        wait: Callable[[float], bool] | None = None,
    ) -> None:
        """Until the uid is known or ``stop`` is set: wait (the backoff after each failed read,
        the first counted from the read at start), read again. Once read, log it and call
        ``on_known`` (the publisher's ``poke``). ``wait(seconds)`` returns whether to stop
        (``stop.wait`` unless a test gives its own)."""
        waiting = wait or stop.wait
        failures = 1
        while self.unknown and not stop.is_set():
            if waiting(self.backoff.delay(failures)):
                return
            if self.read() is None:
                failures += 1
                continue
            self.log.info(
                "read the Node: slices are now owned by it",
                extra=fields_(node=self.name, uid=self._uid, reads=failures + 1),
            )
            on_known()
