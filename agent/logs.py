"""Structured logging: JSON lines by default, plain text for humans.

Fields go in ``extra={"fields": {...}}``; they become top-level keys of the JSON object.

``configure_logging`` installs one handler on the *root* logger, so every record of the process
comes out in the chosen format: Tessera's own loggers (the ``tessera`` tree the composition root
hands out), module loggers of any layer, and the libraries' (grpc, urllib3, the kubernetes
client), Python warnings (``py.warnings``) and exceptions that escape a thread. Libraries log at
WARNING and above unless the level is ``debug``, so their chatter does not drown the agent's.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

_RESERVED = {"ts", "level", "logger", "msg"}
LIBRARY_LOGGERS = ("grpc", "urllib3", "kubernetes", "asyncio")
"""Loggers held at WARNING unless the agent logs at debug."""


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in getattr(record, "fields", {}).items():
            out[key if key not in _RESERVED else f"field_{key}"] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = record.stack_info
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = f"{time.strftime('%H:%M:%S', time.localtime(record.created))} "
        base += f"{record.levelname:<7} {record.name}: {record.getMessage()}"
        extra = getattr(record, "fields", {})
        if extra:
            base += " " + " ".join(f"{k}={v}" for k, v in extra.items())
        if record.exc_info:
            base += "\n" + self.formatException(record.exc_info)
        return base


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler ``configure_logging`` installs (recognised so a second call replaces it)."""


def configure_logging(fmt: str, level: str, stream: IO[str] | None = None) -> logging.Logger:
    """Send every log record of the process to ``stream`` (stderr) in ``fmt`` (``json`` or
    ``text``) from ``level`` up; return the ``tessera`` logger the agent's components log under.

    Meant to be called once, by the process's entry point. It replaces an earlier handler of its
    own (a second call does not duplicate lines) and leaves handlers it did not install alone.
    """
    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(h)
    handler = _Handler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root.addHandler(handler)
    root.setLevel(level.upper())
    library_level = logging.DEBUG if level.lower() == "debug" else logging.WARNING
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(library_level)
    logging.captureWarnings(True)
    threading.excepthook = _log_thread_exception
    tessera = logging.getLogger("tessera")
    tessera.setLevel(logging.NOTSET)
    tessera.propagate = True
    return tessera


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    """An exception that escaped a thread: one structured record instead of a raw traceback."""
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("tessera").error(
        "unhandled exception in a thread",
        exc_info=(args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback),
        extra=fields_(thread=name),
    )


def fields_(**kwargs: Any) -> dict[str, Any]:
    """``log.info("msg", extra=fields_(gpu=0))`` — shorthand for structured fields."""
    return {"fields": kwargs}


class Throttle:
    """Rate-limited records for events a client can cause at will (refused connections, timed-out
    or broken requests): at most one record per ``key`` every ``interval`` seconds, so a flood
    costs a few log lines, not one per attempt. The next record of a key carries ``suppressed``:
    how many were not logged since the last one. Thread-safe."""

    def __init__(
        self,
        log: logging.Logger,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self.interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(
        self,
        level: int,
        key: str,
        msg: str,
        exc_info: BaseException | None = None,
        **fields: Any,
    ) -> bool:
        """Log ``msg`` with ``fields`` unless a record of ``key`` went out less than
        ``interval`` seconds ago; True when it was logged."""
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval:
                self._held[key] = self._held.get(key, 0) + 1
                return False
            self._last[key] = now
            held = self._held.pop(key, 0)
        if held:
            fields["suppressed"] = held
        self.log.log(level, msg, exc_info=exc_info, extra=fields_(**fields))
        return True
