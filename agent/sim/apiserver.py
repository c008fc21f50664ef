"""An in-memory Kubernetes API server for tests: real HTTP on 127.0.0.1, the real client unchanged.

::

    with ApiServer() as server:
        kubernetes.config.load_kube_config(config_file=str(server.kubeconfig(tmp_path)))
        ...                                   # or: api_client(server) in tests/apiclient.py
        server.faults.add("POST", r"/resourceslices$", "429")
        assert server.rejected == []

It serves ``resource.k8s.io/v1`` ResourceSlices, ResourceClaims (with ``/status``),
ResourceClaimTemplates and DeviceClasses, core ``v1`` Nodes, Namespaces, Pods (with
``/eviction``, :mod:`~agent.sim.apiserver_eviction`; granted evictions in :attr:`evictions`) and
Events, ``coordination.k8s.io/v1`` Leases and ``apiextensions.k8s.io/v1``
CustomResourceDefinitions, each CRD's custom resource as soon as it is written
(:mod:`~agent.sim.apiserver_crd`: schema, defaults, pruning, CEL rules, status subresource). The
table is :data:`agent.sim.apiserver_types.RESOURCES`. Also: the discovery documents (``/api``,
``/apis``, ``/apis/<group>/<version>``, ``/version``), the ``/openapi/v3`` documents kubectl
validates with (:mod:`~agent.sim.apiserver_openapi`), Tables for ``kubectl get``
(:mod:`~agent.sim.apiserver_table`), and the self reviews (SelfSubjectAccessReview,
SelfSubjectReview). Access follows :attr:`ApiServer.access` (everything
allowed unless a test denies it: then 403, as RBAC answers). The semantics a client can tell
apart follow the real server: status codes and ``Status`` bodies, ``resourceVersion`` conflicts,
``generateName``, field selectors (400 for a field the real server does not support), label
selectors, watches replayed from a bounded history (410 ``Expired`` once compacted), no-op updates
that change nothing, status subresources. Every written object is validated (strictly) against the
Kubernetes JSON schemas of ``validate_versions`` (and a core Event against the server's legacy
namespace rule, a ResourceClaim's ``status.devices`` against its allocation); a failure is 422
and lands in :attr:`rejected`. PATCH takes merge, JSON and strategic merge patches (see
:mod:`~agent.sim.apiserver_patch`); any other type is 415.

After those checks come the ``admissionregistration.k8s.io/v1`` ValidatingAdmissionPolicies
and bindings written to it, with params of any kind it serves (core ``v1`` ConfigMaps among
them), evaluated by :mod:`~agent.sim.apiserver_admission`: a denial is the real server's 403/422,
a Warn binding's failure a ``Warning`` header, an Audit one lands in :attr:`audits`. Requests
come from ``identity`` (by default the agent's service account), or from the user they
impersonate.

Modules: :mod:`~agent.sim.apiserver_types` (resource table, routes, discovery),
:mod:`~agent.sim.apiserver_store` (objects, events), :mod:`~agent.sim.apiserver_strategy` (how a
write turns the old object into the new one), :mod:`~agent.sim.apiserver_checks` (validation of
each write, then admission), :mod:`~agent.sim.apiserver_lists` (list pages, continue tokens),
:mod:`~agent.sim.apiserver_http` (HTTP: requests, routing, responses),
:mod:`~agent.sim.apiserver_watch` (what a watch streams, and when it ends),
:mod:`~agent.sim.apiserver_faults` (faults, request log), :mod:`~agent.sim.apiserver_select`
(selectors), :mod:`~agent.sim.apiserver_patch` (PATCH bodies), the CRD, eviction, OpenAPI and
Table modules named above.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType

import yaml

from agent.sim.apiserver_access import DEFAULT_IDENTITY, AccessRules
from agent.sim.apiserver_admission import Admission, AuditRecord
from agent.sim.apiserver_admission_match import UserInfo
from agent.sim.apiserver_checks import Rejection
from agent.sim.apiserver_eviction import EvictionLog, EvictionRecord
from agent.sim.apiserver_faults import Fault, FaultInjector, RequestLog, RequestRecord
from agent.sim.apiserver_http import Context, HttpServer
from agent.sim.apiserver_openapi import OpenApi
from agent.sim.apiserver_select import Selection
from agent.sim.apiserver_store import Obj, Store
from agent.sim.apiserver_types import RESOURCES, ResourceType, major_minor

__all__ = [
    "RESOURCES",
    "AccessRules",
    "ApiServer",
    "AuditRecord",
    "EvictionRecord",
    "Fault",
    "FaultInjector",
    "Rejection",
    "RequestLog",
    "RequestRecord",
    "ResourceType",
    "UserInfo",
]

DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")


def _utcnow() -> datetime:
    return datetime.now(UTC)


class ApiServer:
    """The emulated API server. ``start()``/``stop()``, or use it as a context manager.

    ``port`` 0 picks a free port (kept across a stop/start, so a written kubeconfig stays good).
    ``kube_version`` (``1.35.0``) is the version it reports at ``/version`` (``gitVersion``,
    ``major``, ``minor`` and the emulated version, as a real one does) and whose OpenAPI it
    serves. ``seed`` drives generated names and UIDs. ``history_size`` is the number of watch
    events kept per resource. ``watch_timeout`` is how long a watch without ``timeoutSeconds``
    lasts (the real server picks 30-60 minutes); ``bookmark_interval`` how often a watch that
    allows bookmarks gets one. ``clock`` stamps objects (creationTimestamp); ``monotonic`` times
    watches (their ``timeoutSeconds`` and bookmarks), so a test can move time on instead of
    waiting.
    """

    def __init__(
        self,
        port: int = 0,
        *,
        validate_versions: Sequence[str] = ("1.34.0", "1.35.0"),
        resources: Sequence[ResourceType] = RESOURCES,
        namespaces: Iterable[str] = DEFAULT_NAMESPACES,
        seed: int = 0,
        history_size: int = 1000,
        kube_version: str = "1.35.0",
        watch_timeout: float = 1800.0,
        bookmark_interval: float = 60.0,
        clock: Callable[[], datetime] = _utcnow,
        monotonic: Callable[[], float] = time.monotonic,
        host: str = "127.0.0.1",
        identity: UserInfo = DEFAULT_IDENTITY,
    ) -> None:
        self._host, self._port = host, port
        self.faults = FaultInjector()
        self.requests = RequestLog()
        self.access = AccessRules(identity)
        """Who may do what: everything unless denied (``access.deny(verb, resource, group)``);
        SelfSubjectAccessReviews answer from it. ``identity`` is who every request is from
        (unless it impersonates another user): what admission policies see."""
        self._admission = Admission(identity)
        self._store = Store(
            resources,
            validate_versions=validate_versions,
            rng=random.Random(seed),
            history_size=history_size,
            clock=clock,
            admission=self._admission,
            kube_version=major_minor(kube_version),
        )
        self._kube_version = kube_version
        self._evictions = EvictionLog()
        self._openapi = OpenApi(kube_version)
        self._watch_timeout = watch_timeout
        self._bookmark_interval = bookmark_interval
        self._monotonic = monotonic
        self._httpd: HttpServer | None = None
        self._thread: threading.Thread | None = None
        self._ctx: Context | None = None
        if "namespaces" in self._store.types:
            for ns in namespaces:
                self.put_object(
                    "namespaces", {"metadata": {"name": ns}, "status": {"phase": "Active"}}
                )

    # ------------------------------------------------------------------------------- lifecycle

    def start(self) -> ApiServer:
        """Listen and serve (in a background thread); returns self."""
        if self._httpd is not None:
            raise RuntimeError("the API server is already running")
        with self._store.lock:
            self._store.closed = False
        self._ctx = Context(
            self._store,
            self.faults,
            self.requests,
            self._kube_version,
            self._bookmark_interval,
            self._watch_timeout,
            monotonic=self._monotonic,
            access=self.access,
            evictions=self._evictions,
            openapi=self._openapi,
        )
        self._httpd = HttpServer((self._host, self._port), self._ctx)
        self._port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"apiserver-{self._port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """End every watch (cleanly), every connection, and stop listening."""
        httpd, ctx, thread = self._httpd, self._ctx, self._thread
        if httpd is None or ctx is None or thread is None:
            return
        ctx.stopping.set()
        self._store.close()
        with ctx.watch_done:
            ctx.watch_done.wait_for(lambda: ctx.watch_count == 0, timeout=timeout)
        httpd.shutdown()
        httpd.server_close()
        httpd.close_connections(timeout)
        thread.join(timeout)
        self._httpd = self._thread = self._ctx = None

    def __enter__(self) -> ApiServer:
        return self if self._httpd is not None else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._httpd is not None

    @property
    def port(self) -> int:
        """The listening port (0 before the first start with ``port=0``)."""
        return self._port

    @property
    def url(self) -> str:
        if not self._port:
            raise RuntimeError("the API server has not been started")
        return f"http://{self._host}:{self._port}"

    def kubeconfig(self, path: Path) -> Path:
        """Write a kubeconfig for this server (plain http, no auth) to ``path`` and return it.

        ``path`` may be a directory: the file is then ``<path>/kubeconfig``.
        """
        path = Path(path)
        if path.is_dir():
            path = path / "kubeconfig"
        path.parent.mkdir(parents=True, exist_ok=True)
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "tessera-sim", "cluster": {"server": self.url}}],
            "users": [{"name": "tessera-sim", "user": {}}],
            "contexts": [
                {
                    "name": "tessera-sim",
                    "context": {
                        "cluster": "tessera-sim",
                        "user": "tessera-sim",
                        "namespace": "default",
                    },
                }
            ],
            "current-context": "tessera-sim",
        }
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    # ------------------------------------------------------------------------------- inspection

    @property
    def rejected(self) -> list[Rejection]:
        """Writes answered 422 Invalid (schema failures and invalid names), oldest first."""
        return self._store.rejected

    @property
    def resource_version(self) -> int:
        """The current (global) resourceVersion."""
        with self._store.lock:
            return self._store.rv

    @property
    def evictions(self) -> list[EvictionRecord]:
        """The pod evictions granted (``POST .../pods/{name}/eviction``), oldest first."""
        return self._evictions.snapshot()

    @property
    def audits(self) -> list[AuditRecord]:
        """What ValidatingAdmissionPolicies with Audit bindings found, oldest first."""
        return self._admission.audits

    def writes(self, resource: str | None = None) -> int:
        """POST/PUT/PATCH/DELETE requests received, about ``resource`` (plural) when given."""
        return self.requests.writes(resource)

    def clear_log(self) -> None:
        """Forget the logged requests."""
        self.requests.clear()

    def compact(self) -> None:
        """Drop the watch history: watching from any older resourceVersion then gets 410."""
        self._store.compact()

    # ------------------------------------------------------------------------------- direct access

    def objects(self, resource: str, namespace: str | None = None) -> list[Obj]:
        """Deep copies of the stored objects of ``resource`` (plural), by namespace and name."""
        return self._store.objects(self._store.type_of(resource), Selection(namespace))

    def get_object(self, resource: str, name: str, namespace: str | None = None) -> Obj | None:
        """A deep copy of one stored object, or None."""
        found = self._store.objects(self._store.type_of(resource), Selection(namespace), name=name)
        return found[0] if found else None

    def put_object(self, resource: str, obj: Obj) -> Obj:
        """Store ``obj`` as is (no validation), creating or replacing it; watchers see it."""
        return self._store.put(self._store.type_of(resource), obj)

    def delete_object(self, resource: str, name: str, namespace: str | None = None) -> Obj | None:
        """Delete at once (finalizers ignored); the last state, or None when there was none."""
        return self._store.remove(self._store.type_of(resource), namespace, name)
