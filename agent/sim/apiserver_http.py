"""The HTTP side of the API-server emulator: a threading HTTP/1.1 server and its request handler.

Every request is logged, checked against the armed faults, then routed: discovery documents,
or a resource route (list/watch/create/delete-collection on a collection; get/update/patch/delete
on an object; get/update/patch on ``/status``). A watch is a chunked response of JSON lines: this
module frames it and counts the open watches (stop() waits for them);
:mod:`~agent.sim.apiserver_watch` decides what goes in it and when it ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from agent.sim import apiserver_errors as err
from agent.sim import apiserver_types as types
from agent.sim.apiserver_access import REVIEW_PATHS, AccessRules, review, verb_of
from agent.sim.apiserver_admission import CALLER, Caller, warning_header
from agent.sim.apiserver_crd import custom_write
from agent.sim.apiserver_errors import ApiError
from agent.sim.apiserver_eviction import EvictionLog, evict
from agent.sim.apiserver_faults import (
    MALFORMED_KINDS,
    TRUE,
    FaultInjector,
    RequestLog,
    RequestRecord,
)
from agent.sim.apiserver_json import encode_json
from agent.sim.apiserver_openapi import OpenApi
from agent.sim.apiserver_select import (
    FieldTerm,
    Selection,
    SelectorError,
    parse_fields,
    parse_labels,
)
from agent.sim.apiserver_store import Obj, Store
from agent.sim.apiserver_table import table, wants_table
from agent.sim.apiserver_watch import Cut, Watch

log = logging.getLogger(__name__)

_TRUE = TRUE


@dataclass
class Context:
    """What the handlers of one server share."""

    store: Store
    faults: FaultInjector
    requests: RequestLog
    kube_version: str
    bookmark_interval: float
    watch_timeout: float
    monotonic: Callable[[], float] = time.monotonic
    """Times watches; the real waits between checks are at most ``apiserver_watch.POLL``."""
    access: AccessRules = field(default_factory=AccessRules)
    """Who may do what (everything, unless denied)."""
    evictions: EvictionLog = field(default_factory=EvictionLog)
    """The pod evictions granted."""
    openapi: OpenApi | None = None
    """The /openapi/v3 documents (None: not served)."""
    stopping: threading.Event = field(default_factory=threading.Event)
    watch_count: int = 0
    watch_done: threading.Condition = field(default_factory=threading.Condition)


class HttpServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer that knows its connections, so that stop() can end them."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], ctx: Context) -> None:
        self.ctx = ctx
        self._conn_lock = threading.Lock()
        self._conns: dict[threading.Thread, socket.socket] = {}
        super().__init__(address, Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(
            target=self._serve_connection,
            args=(request, client_address),
            name=f"apiserver-conn-{client_address[1]}",
            daemon=True,
        )
        with self._conn_lock:
            self._conns[thread] = request
        thread.start()

    def _serve_connection(self, request: Any, client_address: Any) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            with self._conn_lock:
                self._conns.pop(threading.current_thread(), None)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("connection from %s ended with an error", client_address, exc_info=True)

    def close_connections(self, timeout: float) -> None:
        """Shut every open connection down and wait (up to ``timeout``) for its thread."""
        with self._conn_lock:
            conns = dict(self._conns)
        for sock in conns.values():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout
        for thread in conns:
            thread.join(max(0.0, deadline - time.monotonic()))


def _json_body(raw: bytes) -> Any:
    """The JSON request body (None when empty); 400 when it is not JSON."""
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise err.bad_request(f"the request body is not valid JSON: {exc}") from None


def _params(query: str) -> dict[str, str]:
    return dict(parse_qsl(query, keep_blank_values=True))


def _int_param(params: dict[str, str], name: str) -> int | None:
    if not params.get(name):
        return None
    try:
        return int(params[name])
    except ValueError:
        raise err.bad_request(f"invalid value for {name}: {params[name]!r}") from None


def selection_for(
    rt: types.ResourceType, namespace: str | None, params: dict[str, str], name: str | None = None
) -> Selection:
    """The Selection a list/watch asks for (400 on an unsupported field or a bad selector)."""
    what = None if rt.fields == types.DEFAULT_FIELDS else f"{rt.api_version}, Kind={rt.kind}"
    try:
        fields = parse_fields(params.get("fieldSelector", ""), rt.fields, what)
        labels = parse_labels(params.get("labelSelector", ""))
    except SelectorError as exc:
        raise err.bad_request(str(exc)) from None
    paths = dict(rt.field_paths)
    fields = [dataclasses.replace(t, field=paths.get(t.field, t.field)) for t in fields]
    if name is not None:
        fields.append(FieldTerm("metadata.name", True, name))
    return Selection(namespace, tuple(fields), tuple(labels))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: HttpServer
    timeout = 30  # an idle keep-alive connection ends after this

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    # ------------------------------------------------------------------------------- plumbing

    def _record(self, status: int) -> None:
        self._responded = True
        self.server.ctx.requests.append(
            RequestRecord(self._method, self._path, self._query, status, self._arrived)
        )

    def _read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length:
            return self.rfile.read(int(length))
        if "chunked" not in self.headers.get("Transfer-Encoding", "").lower():
            return b""
        out = bytearray()
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                self.rfile.readline()
                return bytes(out)
            out += self.rfile.read(size)
            self.rfile.readline()

    def _send(
        self, status: int, data: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        self._record(status)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-cache, private")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        caller = CALLER.get()  # the warnings of admission policies with Warn bindings
        for text in caller.warnings if caller is not None else ():
            self.send_header("Warning", warning_header(text))
        self.end_headers()
        self.wfile.write(data)

    def _send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        data = encode_json(obj)
        self._send(status, data, "application/json", headers)

    def _send_malformed(self, kind: str) -> None:
        """A 200 answer a broken server or proxy could send (see the faults module)."""
        if kind == "bad-line":
            self._record(200)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            line = b'{"type": "ADDED", "object": {"kind": "ResourceSl\n'
            self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n0\r\n\r\n")
            return
        body = b"[]" if kind == "array" else b"<html><body>502 Bad Gateway</body></html>"
        self._send(200, body, "application/json")

    def _send_error(self, error: ApiError) -> None:
        self._send_json(error.code, error.status(), error.headers)

    def _serve(self, method: str) -> None:
        ctx = self.server.ctx
        self._arrived = ctx.monotonic()
        url = urlsplit(self.path)
        self._method, self._path, self._query = method, url.path, url.query
        self._responded = False
        self._stalled = False
        try:
            body = self._read_body()
        except (ValueError, OSError):
            self.close_connection = True
            self._send_error(err.bad_request("malformed request body"))
            return
        fault = ctx.faults.take(method, url.path, url.query)
        if fault is not None:
            if fault.kind == "drop":
                self._record(0)
                self.close_connection = True
                return
            if fault.kind == "stall":
                self._stalled = True  # a watch opens and stays silent (_watch)
                if _params(url.query).get("watch") not in _TRUE:
                    ctx.stopping.wait()
                    self._record(0)
                    self.close_connection = True
                    return
            elif fault.delay:
                ctx.stopping.wait(fault.delay)
            elif fault.kind in MALFORMED_KINDS:
                self._send_malformed(fault.kind)
                return
            elif (error := fault.error) is not None:
                self._send_error(err.injected(error[0], url.path, retry_after=error[1]))
                return
        token = CALLER.set(None)
        try:
            CALLER.set(Caller(ctx.access.caller(self.headers)))
            self._dispatch(method, url.path, _params(url.query), body)
        except ApiError as exc:
            self._send_error(exc)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:
            log.exception("emulated API server failed on %s %s", method, self.path)
            if self._responded:  # mid-stream: all that is left is to hang up
                self.close_connection = True
            else:
                self._send_error(err.internal(f"{type(exc).__name__}: {exc}"))
        finally:
            CALLER.reset(token)

    # ------------------------------------------------------------------------------- routing

    def _discovery(self, path: str) -> Any:
        store = self.server.ctx.store
        known = list(store.types.values())
        segs = [s for s in path.split("/") if s]
        if segs == ["version"]:
            return types.version_info(self.server.ctx.kube_version)
        if segs == ["api"]:
            host, port = self.server.server_address[:2]
            return types.api_versions(known, f"{host!s}:{port}")
        if segs == ["apis"]:
            return types.api_group_list(known)
        if len(segs) == 2 and segs[0] == "apis":
            return types.api_group(known, segs[1])
        if len(segs) == 2 and segs[0] == "api":
            return types.api_resource_list(known, "", segs[1])
        if len(segs) == 3 and segs[0] == "apis":
            return types.api_resource_list(known, segs[1], segs[2])
        return None

    def _dispatch(self, method: str, path: str, params: dict[str, str], raw: bytes) -> None:
        if path in ("/healthz", "/livez", "/readyz"):
            self._send(200, b"ok", "text/plain; charset=utf-8")
            return
        store = self.server.ctx.store
        access = self.server.ctx.access
        if path == "/openapi/v3" or path.startswith("/openapi/v3/"):
            self._openapi(path)
            return
        if path in REVIEW_PATHS:
            self._send_json(201, review(access, method, path, _json_body(raw)))
            return
        try:
            route = types.resolve(list(store.types.values()), path)
        except types.RouteError:
            raise err.path_not_found() from None
        if route is None:
            doc = self._discovery(path) if method == "GET" else None
            if doc is None:
                raise err.path_not_found()
            self._send_json(200, doc)
            return
        body = _json_body(raw)
        rt, ns, name, sub = route.rt, route.namespace, route.name, route.subresource
        watch = method == "GET" and (route.watch_path or params.get("watch") in _TRUE)
        verb = verb_of(method, name is not None and not route.watch_path, watch, name is None)
        resource = rt.plural + (f"/{sub}" if sub else "")
        if not access.allowed(verb, rt.group, resource):
            raise access.forbidden(verb, rt.group, resource, ns, name)
        dry_run = params.get("dryRun") == "All"
        kind = self.headers.get("Content-Type", "application/merge-patch+json")
        headers = custom_write(rt, method, kind, body, params.get("fieldValidation", ""))
        as_table = method == "GET" and wants_table(self.headers.get("Accept", ""))
        if name is None or route.watch_path:
            selection = selection_for(rt, ns, params, name)
            if method == "GET" and (route.watch_path or params.get("watch") in _TRUE):
                self._watch(rt, selection, params)
            elif method == "GET":
                limit = _int_param(params, "limit") or 0
                token = params.get("continue", "")
                page = store.list_objects(rt, selection, limit=limit, token=token)
                if as_table:
                    rv = page.meta["resourceVersion"]
                    self._send_json(200, table(rt, page.value()["items"], rv, store.clock()))
                else:
                    self._send(200, page.body(), "application/json")
            elif method == "POST" and (ns is not None or not rt.namespaced):
                self._send_json(201, store.create(rt, ns, body, dry_run=dry_run), headers)
            elif method == "DELETE":
                self._send_json(200, store.delete_collection(rt, selection))
            else:
                raise err.method_not_allowed(method, f"{rt.qualified} collections")
        elif method == "POST" and sub == "eviction" and ns is not None:
            self._send_json(201, evict(store, rt, self.server.ctx.evictions, ns, name, body))
        elif method == "GET" and sub in (None, "status"):
            got = store.get(rt, ns, name)
            meta = got["metadata"]
            self._send_json(
                200, table(rt, [got], meta["resourceVersion"], store.clock()) if as_table else got
            )
        elif method == "PUT" and sub in (None, "status"):
            found = store.update(rt, ns, name, body, subresource=sub, dry_run=dry_run)
            self._send_json(200, found, headers)
        elif method == "PATCH" and sub in (None, "status"):
            found = store.patch(rt, ns, name, kind, body, subresource=sub, dry_run=dry_run)
            self._send_json(200, found, headers)
        elif method == "DELETE" and sub is None:
            self._send_json(*store.delete(rt, ns, name, body, dry_run=dry_run))
        else:
            raise err.method_not_allowed(method, rt.qualified)

    def _openapi(self, path: str) -> None:
        ctx = self.server.ctx
        data = None if ctx.openapi is None else ctx.openapi.answer(ctx.store.types.values(), path)
        if data is None:
            raise err.path_not_found()
        self._send(200, data, "application/json")

    # ------------------------------------------------------------------------------- watch framing

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def _event(self, kind: str, obj: Obj) -> None:
        self._chunk(
            json.dumps({"type": kind, "object": obj}, separators=(",", ":")).encode() + b"\n"
        )

    def _peer_closed(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _watch(self, rt: types.ResourceType, selection: Selection, params: dict[str, str]) -> None:
        ctx = self.server.ctx
        timeout = _int_param(params, "timeoutSeconds")
        watch = Watch.open(
            ctx.store,
            ctx.faults,
            rt,
            selection,
            params.get("resourceVersion", ""),
            deadline=ctx.monotonic() + (ctx.watch_timeout if timeout is None else timeout),
            monotonic=ctx.monotonic,
            bookmark_interval=ctx.bookmark_interval,
            bookmarks=params.get("allowWatchBookmarks") in _TRUE,
            initial_events_end=params.get("sendInitialEvents") in _TRUE,
            stalled=self._stalled,
        )
        self._record(200)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache, private")
        self.end_headers()
        with ctx.watch_done:
            ctx.watch_count += 1
        try:
            if watch.stream(self._event, self._peer_closed):
                self.close_connection = True
            self.wfile.write(b"0\r\n\r\n")
        except Cut:  # hang up without the last chunk: the client sees the stream broken
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            self.close_connection = True
        finally:
            if ctx.stopping.is_set():
                self.close_connection = True
            with ctx.watch_done:
                ctx.watch_count -= 1
                ctx.watch_done.notify_all()
