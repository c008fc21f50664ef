"""The agent's HTTP endpoint: /healthz, /readyz and /metrics.

Readiness is a set of named checks; /readyz answers 200 only when every check passes and lists
the failing ones otherwise. Nothing on these paths touches NVML or Kubernetes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from agent.errors import ConfigError

Check = Callable[[], tuple[bool, str]]
Exposition = Callable[[], tuple[bytes, str]]
"""Renders /metrics: (body, content type)."""


class Readiness:
    """Named readiness checks, registered by the components that own them."""

    def __init__(self) -> None:
        self._checks: dict[str, Check] = {}
        self._lock = threading.Lock()

    def add(self, name: str, check: Check) -> None:
        with self._lock:
            self._checks[name] = check

    def evaluate(self) -> tuple[bool, dict[str, str]]:
        with self._lock:
            checks = dict(self._checks)
        results = {name: check() for name, check in checks.items()}
        ok = bool(results) and all(passed for passed, _ in results.values())
        return ok, {name: detail for name, (_, detail) in results.items()}


class Server(ThreadingHTTPServer):
    """A listen backlog for many scrapers at once (the stdlib default of 5 makes the sixth
    concurrent connection wait a second for a SYN retry)."""

    request_queue_size = 128
    daemon_threads = True


class HttpEndpoint:
    """A small threaded HTTP server on one address."""

    def __init__(
        self, host: str, port: int, readiness: Readiness, metrics: Exposition | None = None
    ) -> None:
        self.readiness = readiness
        self.metrics = metrics
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/healthz":
                    self._send(200, "text/plain; charset=utf-8", b"ok\n")
                elif path == "/metrics" and endpoint.metrics is not None:
                    body, ctype = endpoint.metrics()
                    self._send(200, ctype, body)
                elif path == "/readyz":
                    ok, detail = endpoint.readiness.evaluate()
                    body = json.dumps({"ready": ok, "checks": detail}, indent=1).encode() + b"\n"
                    self._send(200 if ok else 503, "application/json", body)
                else:
                    self._send(404, "text/plain; charset=utf-8", b"not found\n")

            def _send(self, code: int, ctype: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return  # access logs off: scrapes every few seconds would drown the real logs

        try:
            self._server = Server((host, port), Handler)
        except OSError as exc:
            raise ConfigError(
                f"--metrics-address: cannot listen on {host}:{port}: {exc.strerror}"
            ) from exc
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="http", kwargs={"poll_interval": 0.2}
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop serving; safe before start (shutdown() would wait forever for a serve loop)."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()
