"""Fault injection and the request log of the API-server emulator.

A test arms faults with :meth:`FaultInjector.add`; the next ``times`` requests that match (method,
path regex, optionally query regex) get the fault instead of (``"409"``, ``"429"``, ``"500"``,
``"503"``, ``"drop"``) or before (``"slow:<seconds>"``: a response that hangs, which a client with
a shorter read timeout sees as a timeout) their normal answer. A ``429`` carries ``Retry-After:
1``, as the API server's own (priority and fairness, max-in-flight); ``"429:<value>"``,
``"500:<value>"`` and ``"503:<value>"`` carry ``Retry-After: <value>`` instead, taken as written
(a number of seconds, or anything else a broken server might send). Malformed answers a broken
proxy or server could send, each with status 200: ``"garbage"`` (a body that is not JSON),
``"array"`` (a JSON array where an object belongs), ``"bad-line"`` (a chunked stream, as a watch
answers, whose one line is not JSON). ``"stall"`` is for a watch: the stream opens (200, its
headers) and then nothing comes, no event and no bookmark, whatever changes, until the watches
are cut or the client goes away (a hung connection through a proxy, or a server whose watch
stopped being fed); any other request it holds until the server stops.

Beyond single requests: :meth:`FaultInjector.start_outage` answers *every* request with one kind
(``"503"``, ``"drop"``, ...) until :meth:`FaultInjector.end_outage`, and cuts the open watches
as it starts; :meth:`FaultInjector.cut_watches` alone ends every open watch stream mid-stream (the
connection closed without the stream's last chunk, as when a server or a proxy dies).

:class:`RequestLog` records ``(method, path, query, status, at)`` for every request; status 0
means the connection was dropped without an answer, ``at`` is when the request arrived (the
server's monotonic clock).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple, overload
from urllib.parse import parse_qsl

from agent.sim.apiserver_types import resource_of

ERROR_KINDS = ("409", "429", "500", "503")
RETRY_AFTER_KINDS = ("429", "500", "503")
"""Error kinds that may carry their own Retry-After: ``"429:<value>"``."""
MALFORMED_KINDS = ("garbage", "array", "bad-line")
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
TRUE = frozenset({"1", "t", "T", "true", "TRUE", "True"})
"""What a boolean query parameter (``watch``) counts as true (Go's ``strconv.ParseBool``)."""
_HEADER_VALUE = re.compile(r"[!-~]{1,64}")
"""What a Retry-After value of a fault may be: 1-64 visible ASCII characters (no spaces)."""


@dataclass
class Fault:
    """One armed fault; ``remaining`` counts down as matching requests consume it."""

    method: str | None
    path: re.Pattern[str] | None
    query: re.Pattern[str] | None
    kind: str
    remaining: int

    @property
    def delay(self) -> float:
        """Seconds a ``slow:<seconds>`` fault waits (0 for the other kinds)."""
        return float(self.kind.split(":", 1)[1]) if self.kind.startswith("slow:") else 0.0

    @property
    def error(self) -> tuple[str, str | None] | None:
        """``(status code, Retry-After or None for the default)`` of an error kind, else None."""
        code, _, retry_after = self.kind.partition(":")
        if code not in ERROR_KINDS:
            return None
        return code, retry_after or None

    def matches(self, method: str, path: str, query: str) -> bool:
        if self.method is not None and self.method != method:
            return False
        if self.path is not None and not self.path.search(path):
            return False
        return self.query is None or bool(self.query.search(query))


def check_kind(kind: str) -> None:
    """Raise ValueError unless ``kind`` is a fault kind."""
    if kind in ERROR_KINDS or kind in MALFORMED_KINDS or kind in ("drop", "stall"):
        return
    code, _, retry_after = kind.partition(":")
    if code in RETRY_AFTER_KINDS and _HEADER_VALUE.fullmatch(retry_after):
        return
    if kind.startswith("slow:"):
        try:
            seconds = float(kind[5:])
        except ValueError:
            seconds = -1.0
        if seconds >= 0:
            return
    raise ValueError(
        f"unknown fault kind {kind!r}: use one of {', '.join(ERROR_KINDS + MALFORMED_KINDS)},"
        " drop, stall, slow:<seconds>, or 429:<retry-after> (also 500: and 503:)"
    )


class FaultInjector:
    """The armed faults of one server (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._outage: Fault | None = None
        self._cuts = 0

    def add(
        self,
        method: str | None,
        path_regex: str | None,
        kind: str,
        times: int = 1,
        *,
        query_regex: str | None = None,
    ) -> Fault:
        """Arm ``kind`` for the next ``times`` requests matching ``method`` and the regexes.

        ``method`` None matches every method; ``path_regex`` (searched in the URL path, without
        the query) None matches every path; ``query_regex`` is searched in the raw query string.
        """
        check_kind(kind)
        if times < 1:
            raise ValueError(f"times must be at least 1, not {times}")
        fault = Fault(
            method.upper() if method else None,
            re.compile(path_regex) if path_regex is not None else None,
            re.compile(query_regex) if query_regex is not None else None,
            kind,
            times,
        )
        with self._lock:
            self._faults.append(fault)
        return fault

    def start_outage(self, kind: str = "503") -> None:
        """From now on answer every request with ``kind`` (armed faults wait), until
        :meth:`end_outage`; open watches are cut, as a server that goes down cuts them."""
        check_kind(kind)
        with self._lock:
            self._outage = Fault(None, None, None, kind, 1)
        self.cut_watches()

    def end_outage(self) -> None:
        """Answer normally again (armed faults apply again)."""
        with self._lock:
            self._outage = None

    @property
    def outage(self) -> str | None:
        """The kind every request is answered with now, or None when there is no outage."""
        with self._lock:
            return self._outage.kind if self._outage is not None else None

    def cut_watches(self) -> None:
        """End every open watch stream now, without its last chunk (the client sees the
        connection lost mid-stream); watches opened afterwards are not affected."""
        with self._lock:
            self._cuts += 1

    @property
    def cuts(self) -> int:
        """How many times the watches were cut: a stream ends when this changes under it."""
        with self._lock:
            return self._cuts

    def take(self, method: str, path: str, query: str) -> Fault | None:
        """The outage's fault while there is one; else consume and return the first armed
        fault matching the request, or None."""
        with self._lock:
            if self._outage is not None:
                return self._outage
            for fault in self._faults:
                if fault.matches(method, path, query):
                    fault.remaining -= 1
                    if fault.remaining <= 0:
                        self._faults.remove(fault)
                    return fault
        return None

    def pending(self) -> list[Fault]:
        """The faults still armed."""
        with self._lock:
            return list(self._faults)

    def clear(self) -> None:
        """Disarm every fault and end an outage."""
        with self._lock:
            self._faults.clear()
            self._outage = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._faults)


class RequestRecord(NamedTuple):
    """One request: method, URL path, raw query string, HTTP status (0: dropped), and when it
    arrived (seconds on the server's monotonic clock)."""

    method: str
    path: str
    query: str
    status: int
    at: float = 0.0

    @property
    def watch(self) -> bool:
        """A watch request (``watch=true``, or the legacy ``/watch/`` paths)."""
        return self.method == "GET" and (self.params.get("watch") in TRUE or "/watch/" in self.path)

    @property
    def params(self) -> dict[str, str]:
        """The query parameters (last value wins)."""
        return dict(parse_qsl(self.query, keep_blank_values=True))

    @property
    def resource(self) -> str | None:
        """The resource (plural) the request is about, if any."""
        return resource_of(self.path)


class RequestLog:
    """Thread-safe log of every request the server answered (or dropped)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[RequestRecord] = []

    def append(self, record: RequestRecord) -> None:
        with self._lock:
            self._records.append(record)

    def snapshot(self) -> list[RequestRecord]:
        with self._lock:
            return list(self._records)

    def clear(self) -> None:
        with self._lock:
            self._records.clear()

    def count(self, method: str | None = None, resource: str | None = None) -> int:
        """Requests with ``method`` (any when None) about ``resource`` (any when None)."""
        return sum(
            1
            for r in self.snapshot()
            if (method is None or r.method == method)
            and (resource is None or r.resource == resource)
        )

    def writes(self, resource: str | None = None) -> int:
        """POST/PUT/PATCH/DELETE requests (answered or not), about ``resource`` when given."""
        return sum(
            1
            for r in self.snapshot()
            if r.method in WRITE_METHODS and (resource is None or r.resource == resource)
        )

    def __iter__(self) -> Iterator[RequestRecord]:
        return iter(self.snapshot())

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    @overload
    def __getitem__(self, index: int) -> RequestRecord: ...

    @overload
    def __getitem__(self, index: slice) -> list[RequestRecord]: ...

    def __getitem__(self, index: int | slice) -> RequestRecord | list[RequestRecord]:
        with self._lock:
            return self._records[index]
