"""The answers of the Kubernetes API, whichever transport brought them: the body read within
limits, decoded into a JSON object, and the wait a failed answer asks for.

Shared by :mod:`dra_driver.cluster.kube` (the kubernetes client's transport) and
:mod:`dra_driver.cluster.kube_reads` (plain urllib3, for reads that must not import the
kubernetes client), so that both treat an answer alike. Imports nothing of the kubernetes client.
"""

from __future__ import annotations

import re
from typing import Any

import urllib3

from agent.decode import load_json, load_json_fast
from agent.errors import DecodeError
from dra_driver.errors import KubeConflict, KubeError, KubeMalformed

DEFAULT_TIMEOUT = (5.0, 30.0)
"""(connect, read) seconds for one request."""
JSON = "application/json"
MAX_BODY_BYTES = 64 * 1024 * 1024
"""The largest answer (or watch line) taken: a node's slices or one claim are far smaller."""
MAX_RETRY_AFTER_S = 60.0
"""The longest wait a server's Retry-After can impose; a longer one is cut to this. Twice the
publisher's backoff cap (30 s): the API server's own answers ask for 1 s (priority and fairness,
max-in-flight), so a server asking for minutes is more likely broken than busy, and the agent
must not stop publishing for longer than its own backoff would on a dead server."""
_SECONDS = re.compile(r"\+?[0-9]+")


def retry_after(status: int, header: str | None, details: Any = None) -> float | None:
    """How many seconds a failed answer asks the client to wait before it tries again, or None
    when it asks nothing. ``header`` is its ``Retry-After``, ``details`` its Status ``details``.

    client-go's rules (kubernetes/client-go ``rest/with_retry.go`` ``checkWait``, and
    ``rest/request.go`` ``retryAfterSeconds``): only a 429 or a 5xx can ask for a wait; the
    header counts only as whole seconds (``strconv.Atoi``): an HTTP date, a fraction or text is
    no request at all; and the next attempt waits the longer of the client's own backoff and
    the server's wait (``withRetry.Before``: ``delay = max(backoff.CalculateBackoff(url),
    retryAfter.Wait)``, kubernetes/kubernetes#108302). apimachinery's ``SuggestsClientDelay``
    (``pkg/api/errors``) reads the same wait from ``details.retryAfterSeconds`` of the Status,
    which the server fills in with the header: used here when the header is missing.

    Ours on top: a negative or zero wait is no request (client-go's ``max`` has the same
    effect), and a wait above :data:`MAX_RETRY_AFTER_S` (client-go takes any ``int``, bounded
    only by its ten retries; Atoi fails on more than 19 digits) is cut to it. Pure."""
    if status != 429 and status < 500:
        return None
    seconds: float | None = None
    if header is not None:
        text = header.strip()
        if _SECONDS.fullmatch(text):
            digits = text.lstrip("+")
            seconds = MAX_RETRY_AFTER_S if len(digits) > 9 else float(int(digits))
    elif isinstance(details, dict):
        value = details.get("retryAfterSeconds")
        if isinstance(value, int) and not isinstance(value, bool):
            seconds = float(value)
    if seconds is None or seconds <= 0:
        return None
    return min(seconds, MAX_RETRY_AFTER_S)


def header_of(headers: Any, name: str) -> str | None:
    """One header of a response (None when absent or not text)."""
    try:
        value = headers.get(name) if headers is not None else None
    except AttributeError:  # not a mapping: no headers to read
        return None
    return value if isinstance(value, str) else None


def read_body(raw: Any, method: str, path: str) -> bytes:
    """The body of urllib3 response ``raw``, at most MAX_BODY_BYTES of it (the kubernetes
    client's wrapper around it would read everything)."""
    try:
        data: bytes = raw.read(MAX_BODY_BYTES + 1)
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise KubeError(0, "ConnectionError", str(exc), method, path) from exc
    if len(data) > MAX_BODY_BYTES:
        raw.close()  # do not drain the rest into memory; the connection is dropped
        raise KubeMalformed(f"an answer larger than {MAX_BODY_BYTES} bytes", method, path)
    return data


def json_object(data: bytes, method: str, path: str, fast: bool = False) -> dict[str, Any]:
    """The JSON object in ``data``; KubeMalformed (naming what was wrong) otherwise."""
    try:
        load = load_json_fast if fast else load_json
        obj = load(data, "the answer", MAX_BODY_BYTES)
    except DecodeError as exc:  # bad JSON or UTF-8, huge integers, deep nesting
        preview = data[:80].decode(errors="replace")
        raise KubeMalformed(f"{exc}: {preview!r}", method, path) from exc
    if not isinstance(obj, dict):
        raise KubeMalformed(
            f"the answer is a JSON {type(obj).__name__}, not an object", method, path
        )
    return obj


def failed(raw: Any, reason: str, method: str, path: str) -> KubeError:
    """The error of a failed (not 2xx) urllib3 response ``raw``: its Status's message and reason
    when the body is one, its ``Retry-After`` (or the Status's ``retryAfterSeconds``);
    KubeConflict for a 409."""
    body = read_body(raw, method, path)
    details = None
    try:
        status = json_object(body, method, path)  # a Status object, if well formed
        message = str(status.get("message", ""))[:1000]
        reason = str(status.get("reason", reason))[:100]
        details = status.get("details")
    except KubeMalformed:
        message = body.decode(errors="replace")[:200]
    wait = retry_after(raw.status, header_of(getattr(raw, "headers", None), "Retry-After"), details)
    cls = KubeConflict if raw.status == 409 else KubeError
    return cls(raw.status, reason, message, method, path, retry_after=wait)
