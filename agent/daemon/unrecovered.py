"""Claims the start could not rebuild (a lost checkpoint, the claim source unreachable, a
device not advertised yet) are tried again while the agent runs, with backoff, until every one
is rebuilt or released: before, only the next start tried again, and their devices stayed held
(reported by /readyz's ``unrecovered-claims`` check) until someone restarted the agent."""

from __future__ import annotations

import threading
from collections.abc import Callable

from dra_driver.advertise.publisher import Backoff
from dra_driver.kubeletplugin.prepare import Preparer

RETRY_BASE_S = 30.0
RETRY_CAP_S = 600.0
"""Between tries: 30 s doubling to 10 minutes (with jitter). A try lists the claims across
namespaces when the API server is the source (``KubeClaimSource.by_uid``), so it is not made
often; a claim's own prepare or unprepare settles it at once anyway."""


def follow_unrecovered(
    preparer: Preparer,
    stop: threading.Event,
    *,
    backoff: Backoff | None = None,
    wait: Callable[[float], bool] | None = None,
) -> None:
    """Until no claim is unrecovered or ``stop`` is set: wait (the backoff, growing with each
    try that leaves some), try again (``Preparer.retry_unrecovered``). ``wait(seconds)``
    returns whether to stop (``stop.wait`` unless a test gives its own)."""
    backoff = backoff or Backoff(base=RETRY_BASE_S, cap=RETRY_CAP_S)
    waiting = wait or stop.wait
    tries = 0
    while preparer.unrecovered() and not stop.is_set():
        tries += 1
        if waiting(backoff.delay(tries)):
            return
        preparer.retry_unrecovered()
