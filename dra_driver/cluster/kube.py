"""The Kubernetes API boundary: JSON requests through the ``kubernetes`` client's ApiClient.

Objects stay plain dicts (exactly what the API server stores), so fields this client version does
not model survive a read-modify-write. Every failure becomes ``dra_driver.errors.KubeError`` (with
``temporary`` set for 429, 5xx and lost connections) or ``KubeConflict`` for 409.

A 429 or 5xx that asks for a wait (``Retry-After``) carries it on the error as ``retry_after``
(see :func:`retry_after`); the callers that retry wait at least that long.

What comes back is untrusted input: a body that is not a JSON object, one larger than
``MAX_BODY_BYTES``, a watch line that does not parse, is longer than ``MAX_BODY_BYTES`` or is not
a ``{"type": str, "object": {...}}`` event raises ``KubeMalformed`` (temporary: retried with
backoff like a 503), never anything else.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import urllib3
import yaml
from kubernetes import client as kclient
from kubernetes import config as kconfig
from kubernetes.client.exceptions import ApiException

from agent.decode import fields, load_json, load_json_fast
from agent.errors import ConfigError, DecodeError
from dra_driver.errors import KubeConflict, KubeError, KubeMalformed

DEFAULT_TIMEOUT = (5.0, 30.0)
"""(connect, read) seconds for one request."""
JSON = "application/json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
"""The patch type client-go's event recorder sends (built-in types only; CRDs answer 415)."""
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


def _header(headers: Any, name: str) -> str | None:
    """One header of a response (None when absent or not text)."""
    try:
        value = headers.get(name) if headers is not None else None
    except AttributeError:  # not a mapping: no headers to read
        return None
    return value if isinstance(value, str) else None


class KubeClient:
    """A thin JSON client. ``api_client`` carries server address, credentials and TLS."""

    def __init__(
        self, api_client: kclient.ApiClient, timeout: tuple[float, float] = DEFAULT_TIMEOUT
    ) -> None:
        self._api = api_client
        self._timeout = timeout
        self._watches: set[Any] = set()
        self._ended: set[Any] = set()
        """Streams :meth:`end_watches` ended: their iterators finish without an error."""
        self._watch_lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_config(
        cls,
        kubeconfig: Path | None,
        hint: str = "pass --kubeconfig FILE, or --no-kube to run standalone",
    ) -> KubeClient:
        """From a kubeconfig file, else the in-cluster service account; ``hint`` ends the error
        when neither can be loaded (what the command's user can do). Touches no global state."""
        cfg = kclient.Configuration()
        try:
            if kubeconfig is not None:
                kconfig.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
            else:
                kconfig.load_incluster_config(client_configuration=cfg)
        except (kconfig.ConfigException, OSError) as exc:
            where = f"--kubeconfig {kubeconfig}" if kubeconfig else "in-cluster configuration"
            raise ConfigError(f"cannot load {where}: {exc}; {hint}") from exc
        except (yaml.YAMLError, TypeError, AttributeError, ValueError) as exc:
            # the client's loader trips over files that are not kubeconfigs (e.g. plain text)
            raise ConfigError(
                f"--kubeconfig: {kubeconfig} is not a kubeconfig (YAML with clusters, users and"
                f" contexts): {type(exc).__name__}: {' '.join(str(exc).split())}"
            ) from exc
        # urllib3 would retry a timed-out GET three times on its own (four times the read
        # timeout): every failure comes back to the caller at once, which owns retrying (the
        # publisher backs off; a claim read fails that claim and the kubelet retries it)
        cfg.retries = False
        return cls(kclient.ApiClient(cfg))

    def end_watches(self) -> None:
        """End the watch streams open now (their iterators finish, as at the server's
        timeout); the client stays open and new watches run as usual (a watch that went
        silent is restarted this way)."""
        with self._watch_lock:
            open_streams = list(self._watches)
            self._ended.update(open_streams)
        for raw in open_streams:
            with contextlib.suppress(OSError):
                raw.shutdown()

    def abort_watches(self) -> None:
        """End every open watch stream now (their iterators finish); new ones end at once."""
        with self._watch_lock:
            self._closed = True
            open_streams = list(self._watches)
        for raw in open_streams:
            with contextlib.suppress(OSError):  # the stream ended (and closed) meanwhile
                raw.shutdown()

    def close(self) -> None:
        self.abort_watches()
        self._api.close()

    def _send(
        self,
        method: str,
        path: str,
        query: Mapping[str, str] | None,
        body: Any,
        timeout: tuple[float, float] | None,
        content_type: str = JSON,
    ) -> Any:
        params = self._api.param_serialize(
            method,
            path,
            query_params=list((query or {}).items()),
            header_params={"Accept": JSON, "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            resp = self._api.call_api(*params, _request_timeout=timeout or self._timeout)
        except ApiException as exc:
            code = int(exc.status or 0)
            wait = retry_after(code, _header(exc.headers, "Retry-After"))
            raise KubeError(code, str(exc.reason), "", method, path, retry_after=wait) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise KubeError(0, "ConnectionError", str(exc), method, path) from exc
        if not 200 <= resp.status < 300:
            raw = _read(resp, method, path)
            details = None
            try:
                status = _json_object(raw, method, path)  # a Status object, if well formed
                message = str(status.get("message", ""))[:1000]
                reason = str(status.get("reason", resp.reason))[:100]
                details = status.get("details")
            except KubeMalformed:
                message, reason = raw.decode(errors="replace")[:200], str(resp.reason)
            header = _header(getattr(resp.response, "headers", None), "Retry-After")
            wait = retry_after(resp.status, header, details)
            cls = KubeConflict if resp.status == 409 else KubeError
            raise cls(resp.status, reason, message, method, path, retry_after=wait)
        return resp

    def request(
        self,
        method: str,
        path: str,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        timeout: tuple[float, float] | None = None,
        content_type: str = JSON,
        fast: bool = False,
    ) -> dict[str, Any]:
        """One request; the decoded JSON object. ``timeout`` (connect, read) overrides the
        client's for this call; ``content_type`` is the body's (a PATCH names its patch type,
        e.g. :data:`STRATEGIC_MERGE_PATCH`). ``fast`` decodes with orjson
        (``agent.decode.load_json_fast``: for large lists). Raises KubeError (KubeMalformed for
        an answer that is not a JSON object)."""
        resp = self._send(method, path, query, body, timeout, content_type)
        return _json_object(_read(resp, method, path) or b"{}", method, path, fast)

    def watch(
        self, path: str, query: Mapping[str, str], timeout_s: int
    ) -> Iterator[dict[str, Any]]:
        """Watch events (``{"type", "object"}``) until the server ends the stream."""
        q = {**query, "watch": "true", "timeoutSeconds": str(timeout_s)}
        resp = self._send("GET", path, q, None, (self._timeout[0], timeout_s + 10.0))
        raw = resp.response
        with self._watch_lock:
            if self._closed:
                raw.release_conn()
                return
            self._watches.add(raw)
        try:
            buf = b""
            for chunk in raw.stream(4096, decode_content=True):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        yield _event(line, path)
                if len(buf) > MAX_BODY_BYTES:
                    raise KubeMalformed(
                        f"a watch line longer than {MAX_BODY_BYTES} bytes", "WATCH", path
                    )
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            with self._watch_lock:
                ended = self._closed or raw in self._ended
            if ended:
                return
            raise KubeError(0, "ConnectionError", str(exc), "WATCH", path) from exc
        finally:
            with self._watch_lock:
                self._watches.discard(raw)
                self._ended.discard(raw)
            raw.release_conn()


def _read(resp: Any, method: str, path: str) -> bytes:
    """The body, at most MAX_BODY_BYTES of it (read from the urllib3 response under the
    client's wrapper, which would read everything)."""
    raw = resp.response
    try:
        data: bytes = raw.read(MAX_BODY_BYTES + 1)
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise KubeError(0, "ConnectionError", str(exc), method, path) from exc
    if len(data) > MAX_BODY_BYTES:
        raw.close()  # do not drain the rest into memory; the connection is dropped
        raise KubeMalformed(f"an answer larger than {MAX_BODY_BYTES} bytes", method, path)
    return data


def _json_object(data: bytes, method: str, path: str, fast: bool = False) -> dict[str, Any]:
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


def _event(line: bytes, path: str) -> dict[str, Any]:
    """One watch event ``{"type": str, "object": {...}}``; KubeMalformed otherwise."""
    event = _json_object(line, "WATCH", path)
    try:
        fields.text(event.get("type"), "type")
        fields.obj(event.get("object"), "object")
    except fields.FieldError as exc:
        raise KubeMalformed(
            f"a watch line is not an event with a string type and an object ({exc})",
            "WATCH",
            path,
        ) from exc
    return event
