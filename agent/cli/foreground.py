"""What the long-running commands (``tessera run``, ``tessera budgets``) share: stopping on a
signal, and a failure turned into one JSON log record and an exit code."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from agent.cli.framework import EXIT_ERROR, Invocation


def stop_on_signals(log: logging.Logger) -> threading.Event:
    """An event that SIGINT and SIGTERM set (each logged as it comes); the command's loop stops
    on it."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal received, shutting down", extra={"fields": {"signal": signum}})
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return stop


def failed(inv: Invocation, log: logging.Logger, what: str, exc: Exception) -> int:
    """The exit code for ``what`` (``agent``, ``budget controller``) failing with ``exc``, logged
    as one record (logs are JSON by then, so the reason is a log record too): a failure to report
    (worded like every command's, ``Invocation.describe``) is ``<what> cannot run`` and exit 2;
    a bug is ``<what> failed with an internal error``, its traceback in the record, exit 1."""
    reason = inv.describe(exc)
    if reason is None:
        log.critical(
            f"{what} failed with an internal error",
            exc_info=exc,
            extra={"fields": {"error": f"{type(exc).__name__}: {exc}"}},
        )
        return 1
    log.error(f"{what} cannot run", extra={"fields": {"error": reason}})
    return EXIT_ERROR
