"""Structured logging: JSON lines by default, plain text for humans.

Fields go in ``extra={"fields": {...}}``; they become top-level keys of the JSON object.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO, Any

_RESERVED = {"ts", "level", "logger", "msg"}


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


def configure_logging(fmt: str, level: str, stream: IO[str] | None = None) -> logging.Logger:
    """Configure the ``tessera`` logger tree (not the root logger) and return it."""
    logger = logging.getLogger("tessera")
    logger.handlers.clear()
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False
    return logger


def fields_(**kwargs: Any) -> dict[str, Any]:
    """``log.info("msg", extra=fields_(gpu=0))`` — shorthand for structured fields."""
    return {"fields": kwargs}
