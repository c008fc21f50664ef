"""The value converters of settings: one raw string (a flag's or a variable's) becomes a value,
or a ValueError whose message is the phrase that follows the value (``is not a positive whole
number``), which :mod:`agent.config.options` turns into a ConfigError naming the flag or the
variable."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from agent.errors import ConfigError
from dra_driver.errors import QuantityError
from dra_driver.kubeletplugin.crash_points import CRASH_POINTS
from dra_driver.quantity import parse_bytes

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


# -- parsers: one raw string -> value; ValueError("<phrase after the value>") --------------------


def text(raw: str) -> str:
    if not raw:
        raise ValueError("is empty")
    return raw


def path(raw: str) -> Path:
    if not raw:
        raise ValueError("is empty; expected a path")
    return Path(raw)


def boolean(raw: str) -> bool:
    low = raw.strip().lower()
    if low not in TRUE + FALSE:
        raise ValueError("is not a boolean; use one of " + ", ".join(TRUE + FALSE))
    return low in TRUE


def integer(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError("is not a whole number") from None


def non_negative_int(raw: str) -> int:
    value = integer(raw)
    if value < 0:
        raise ValueError("is not a whole number >= 0")
    return value


MAX_MALLOC_ARENAS = 64


def malloc_arenas(raw: str) -> int:
    value = integer(raw)
    if not 0 <= value <= MAX_MALLOC_ARENAS:
        raise ValueError(
            f"is not a number of malloc arenas from 0 (glibc's own) to {MAX_MALLOC_ARENAS}"
        )
    return value


def positive_int(raw: str) -> int:
    value = integer(raw)
    if value < 1:
        raise ValueError("is not a positive whole number")
    return value


def number(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError("is not a finite number")
    return value


def seconds(raw: str) -> float:
    value = number(raw)
    if not value > 0:
        raise ValueError("is not a number of seconds > 0")
    return value


def non_negative_seconds(raw: str) -> float:
    value = number(raw)
    if value < 0:
        raise ValueError("is not a number of seconds >= 0")
    return value


def fraction(raw: str) -> float:
    value = number(raw)
    if not 0 <= value <= 1:
        raise ValueError("is not a fraction from 0 to 1 (e.g. 0.9)")
    return value


def port(raw: str) -> int:
    value = integer(raw)
    if not 0 <= value <= 65535:
        raise ValueError("is not a TCP port (0-65535)")
    return value


@dataclass(frozen=True)
class CrashAt:
    """Where ``--sim-crash-at`` kills the daemon: the ``occurrence``-th time (1: the first) this
    process reaches ``point`` (the claims of one call run concurrently, so a point is reached once
    per claim of a batch, or once per call where the claims share that step)."""

    point: str
    occurrence: int = 1

    def __str__(self) -> str:
        return self.point if self.occurrence == 1 else f"{self.point}:{self.occurrence}"


OCCURRENCE = re.compile(r"[0-9]{1,9}")


def crash_at(raw: str) -> CrashAt:
    """``POINT`` or ``POINT:N``: a crash point of prepare or unprepare and, optionally, which time
    it is reached (N >= 1)."""
    point, sep, count = raw.partition(":")
    if point not in CRASH_POINTS:
        raise ValueError(
            "does not name a crash point (POINT or POINT:N); POINT is one of "
            + ", ".join(CRASH_POINTS)
        )
    if not sep:
        return CrashAt(point)
    if not OCCURRENCE.fullmatch(count) or int(count) < 1:
        raise ValueError(
            "is not POINT:N with N a whole number >= 1 (the N-th time the point is reached, e.g."
            f" {point}:3)"
        )
    return CrashAt(point, int(count))


def host_port(raw: str) -> str:
    """``HOST:PORT`` (``[::1]:9400`` for IPv6), kept as text."""
    _host, sep, number_ = raw.rpartition(":")
    if not sep or not number_.isdigit() or not 0 <= int(number_) <= 65535:
        raise ValueError("is not HOST:PORT (e.g. 127.0.0.1:9400; port 0-65535)")
    return raw


def memory_quantity(raw: str) -> str:
    """A Kubernetes quantity of bytes > 0 (``1Gi``, ``512Mi``), kept as written."""
    try:
        value = parse_bytes(raw)
    except QuantityError as exc:
        raise ValueError(f"is not a quantity of bytes ({exc}); e.g. 1Gi, 512Mi") from None
    if value <= 0:
        raise ValueError("is not a quantity of bytes > 0 (e.g. 1Gi, 512Mi)")
    return raw


def dns_subdomain(raw: str) -> str:
    if not DNS_SUBDOMAIN.fullmatch(raw) or len(raw) > 63:
        raise ValueError(
            "is not a lower-case DNS subdomain of at most 63 characters (e.g. gpu.example.com)"
        )
    return raw


def pod_uid_text(raw: str) -> str:
    """A pod UID as it goes into socket names: a lower-case DNS label."""
    if not DNS_LABEL.fullmatch(raw) or len(raw) > 63:
        raise ValueError(
            "is not a pod UID: lower-case letters, digits and '-', starting and ending with a"
            " letter or digit, at most 63 characters (e.g. 4f1b2c3d-5e6f-4a7b-8c9d-0e1f2a3b4c5d,"
            " what metadata.uid holds)"
        )
    return raw


def parse_host_port(name: str, value: str) -> tuple[str, int]:
    try:
        host_port(value)
    except ValueError as exc:
        raise ConfigError(f"--{name}: {value!r} {exc}") from None
    host, _, number_ = value.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(number_)
