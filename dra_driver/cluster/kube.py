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
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import urllib3
import yaml
from kubernetes import client as kclient
from kubernetes import config as kconfig
from kubernetes.client.exceptions import ApiException

from agent.decode import fields
from agent.errors import ConfigError
from dra_driver.cluster.kube_answers import (
    DEFAULT_TIMEOUT,
    JSON,
    MAX_BODY_BYTES,
    MAX_RETRY_AFTER_S,
    failed,
    header_of,
    json_object,
    read_body,
    retry_after,
)
from dra_driver.errors import KubeError, KubeMalformed

STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
"""The patch type client-go's event recorder sends (built-in types only; CRDs answer 415)."""


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
            wait = retry_after(code, header_of(exc.headers, "Retry-After"))
            raise KubeError(code, str(exc.reason), "", method, path, retry_after=wait) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise KubeError(0, "ConnectionError", str(exc), method, path) from exc
        if not 200 <= resp.status < 300:
            raise failed(resp.response, str(resp.reason), method, path)
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
        return json_object(read_body(resp.response, method, path) or b"{}", method, path, fast)

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


def _event(line: bytes, path: str) -> dict[str, Any]:
    """One watch event ``{"type": str, "object": {...}}``; KubeMalformed otherwise."""
    event = json_object(line, "WATCH", path)
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


__all__ = [
    "DEFAULT_TIMEOUT",
    "JSON",
    "MAX_BODY_BYTES",
    "MAX_RETRY_AFTER_S",
    "STRATEGIC_MERGE_PATCH",
    "KubeClient",
    "retry_after",
]
