"""How one request already read by the endpoint's loop is parsed and answered: the stdlib's
request handler, fed the raw bytes and writing through the connection's deadline writer."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from agent.http.probes import Readiness
from agent.logs import Throttle


def handler_class(
    route: Callable[[str], tuple[int, str, bytes]], throttle: Throttle
) -> type[BaseHTTPRequestHandler]:
    """The handler class answering GET with ``route(path)`` -> (status, content type, body);
    refused and failed requests are logged through ``throttle``."""

    class Handler(BaseHTTPRequestHandler):
        """Parses and answers one request already read by the loop (``request`` is the
        raw bytes and the response writer)."""

        _version = "HTTP/1.0"

        @property
        def request_version(self) -> str:
            return self._version

        @request_version.setter
        def request_version(self, version: str) -> None:
            # http.server answers an HTTP/0.9 request (a two-word line, "HTTP/0.9", and a
            # line whose version is bad, which it takes for 0.9 until it knows better) with
            # a bare body: no status line a client could read, even for its errors (400,
            # 431, 505). Every answer here has its status line.
            self._version = "HTTP/1.0" if version == "HTTP/0.9" else version

        def setup(self) -> None:
            raw, writer = self.request
            self.rfile = io.BytesIO(raw)
            self.wfile = writer

        def finish(self) -> None:
            return

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            try:
                code, ctype, body = route(path)
            except Exception as exc:
                throttle(
                    logging.ERROR,
                    "handler",
                    "HTTP request failed",
                    exc_info=exc,
                    path=path,
                    peer=str(self.client_address),
                )
                code, ctype, body = 500, "text/plain; charset=utf-8", b"internal error\n"
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
            return  # access logs off: scrapes every few seconds would drown the real logs

        def log_error(self, format: str, *args: Any) -> None:
            throttle(
                logging.WARNING,
                "bad-request",
                "HTTP request refused",
                peer=str(self.client_address),
                reason=format % args,
            )

    return Handler


def route(
    path: str,
    readiness: Readiness,
    liveness: Readiness,
    metrics: Callable[[], tuple[bytes, str]] | None,
) -> tuple[int, str, bytes]:
    """The answer to GET ``path``: /healthz (liveness: what is wrong, if anything), /metrics,
    /readyz (every check's detail, as JSON), else 404."""
    if path == "/healthz":
        alive, detail = liveness.evaluate(empty_ok=True)
        if alive:
            return 200, "text/plain; charset=utf-8", b"ok\n"
        failing = "".join(f"{name}: {why}\n" for name, why in detail.items())
        return 503, "text/plain; charset=utf-8", failing.encode()
    if path == "/metrics" and metrics is not None:
        body, ctype = metrics()
        return 200, ctype, body
    if path == "/readyz":
        ok, detail = readiness.evaluate()
        body = json.dumps({"ready": ok, "checks": detail}, indent=1).encode() + b"\n"
        return 200 if ok else 503, "application/json", body
    return 404, "text/plain; charset=utf-8", b"not found\n"
