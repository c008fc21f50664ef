"""``tessera explain --kubeconfig``: the reads of cluster mode, and the progress line.

Everything is read as raw JSON (the kubernetes client's model classes would take minutes to build
200,000 devices), through plain urllib3 unless the kubeconfig needs the kubernetes client
(:func:`client_for`), a page of at most
``PAGE_LIMIT`` items at a time (limit/continue, as kubectl reads). ResourceSlices go straight
into a :class:`~dra_driver.scheduler.lookalike.SliceIndex` page by page and each page is dropped
once indexed, so memory holds the slices' bytes once, not every page's decoded objects. The
garbage collector is paused while pages are read (:func:`gc_paused`): the decoded pages are
millions of objects that live a moment, and the collections they would set off (each scanning
every object alive) cost more than the decoding (docs/performance.md "explain").
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Protocol

RESOURCE = "/apis/resource.k8s.io/v1"
PAGE_LIMIT = 500
"""Items per list page: kubectl's default chunk size (``--chunk-size=500``)."""


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic collection inside (what was collectable is collected at the end)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Progress:
    """``nodes read`` / ``nodes evaluated`` on one line of stderr, only when it is a terminal
    (a pipe or a file gets nothing), at most every ``interval`` seconds."""

    def __init__(
        self,
        err: IO[str],
        interval: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        isatty = getattr(err, "isatty", None)
        self._err = err if callable(isatty) and isatty() else None
        self._interval = interval
        self._clock = clock
        self._last = float("-inf")
        self._shown = False

    def show(self, text: str, force: bool = False) -> None:
        if self._err is None:
            return
        now = self._clock()
        if not force and now - self._last < self._interval:
            return
        self._last = now
        self._err.write(f"\r\x1b[2K{text}")
        self._err.flush()
        self._shown = True

    def done(self) -> None:
        """Clear the line (the answer follows on stdout)."""
        if self._err is not None and self._shown:
            self._err.write("\r\x1b[2K")
            self._err.flush()
            self._shown = False


class Reads(Protocol):
    """What cluster mode asks of a client: KubeClient's ``request`` and ``close``."""

    def request(
        self, method: str, path: str, query: Mapping[str, str] | None = None, *, fast: bool = False
    ) -> dict[str, Any]: ...

    def close(self) -> None: ...


def client_for(kubeconfig: Path) -> Reads:
    """A client of the kubeconfig's API server: plain urllib3
    (``dra_driver.cluster.kube_reads.Reader``) for a kubeconfig of static credentials, so that
    the command never imports the kubernetes client (about 0.5 s quiet, over a second loaded, of
    a 1.5 s goal on 64 nodes); the kubernetes client (``KubeClient``) for one that needs its
    loader (exec plugins, auth providers: ``dra_driver.cluster.kubeconfig``)."""
    from dra_driver.cluster.kubeconfig import read_kubeconfig

    hint = "pass --kubeconfig FILE of the cluster to explain against"
    endpoint = read_kubeconfig(kubeconfig, hint)
    if endpoint is not None:
        from dra_driver.cluster.kube_reads import Reader

        return Reader(endpoint)
    from dra_driver.cluster.kube import KubeClient

    return KubeClient.from_config(kubeconfig, hint)


class Cluster:
    """The reads of cluster mode, through :func:`client_for`."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kube = client_for(kubeconfig)

    def close(self) -> None:
        self.kube.close()

    def version(self) -> dict[str, Any]:
        """``GET /version``: the API server's version (``gitVersion``, ``major``, ``minor``)."""
        return self.kube.request("GET", "/version")

    def pages(self, path: str) -> Iterator[list[dict[str, Any]]]:
        """Each page's items (limit/continue); a page is decoded with orjson
        (``KubeClient.request(..., fast=True)``)."""
        query: dict[str, str] = {"limit": str(PAGE_LIMIT)}
        while True:
            page = self.kube.request("GET", path, query=query, fast=True)
            yield [i for i in page.get("items") or [] if isinstance(i, dict)]
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return
            query = {"limit": str(PAGE_LIMIT), "continue": str(token)}

    def list(self, path: str) -> list[dict[str, Any]]:
        """Every item of a collection."""
        return [item for page in self.pages(path) for item in page]

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        from dra_driver.errors import KubeError

        api, plural = {
            "ResourceClaim": (RESOURCE, "resourceclaims"),
            "ResourceClaimTemplate": (RESOURCE, "resourceclaimtemplates"),
            "Pod": ("/api/v1", "pods"),
        }[kind]
        try:
            obj = self.kube.request("GET", f"{api}/namespaces/{namespace}/{plural}/{name}")
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise
        obj.setdefault("apiVersion", api.removeprefix("/apis/").removeprefix("/api/"))
        obj.setdefault("kind", kind)
        return obj


def generated_claims(pod: dict[str, Any]) -> dict[str, Any]:
    """``pod`` with each ``resourceClaimTemplateName`` the resource-claim controller has made
    a claim for replaced by that claim's name, as the scheduler finds a pod's claims
    (k8s.io/dynamic-resource-allocation ``resourceclaim.Name``: the claim named in
    ``pod.status.resourceClaimStatuses``). A template without a status entry is kept (the
    scheduler waits for the claim; explain makes it from the template)."""
    status = pod.get("status")
    entries = status.get("resourceClaimStatuses") if isinstance(status, dict) else None
    spec = pod.get("spec")
    if not isinstance(entries, list) or not isinstance(spec, dict):
        return pod
    made = {
        e.get("name"): e["resourceClaimName"]
        for e in entries
        if isinstance(e, dict) and isinstance(e.get("resourceClaimName"), str)
    }
    refs = []
    for ref in spec.get("resourceClaims") or []:
        if (
            isinstance(ref, dict)
            and ref.get("resourceClaimTemplateName")
            and ref.get("name") in made
        ):
            ref = {"name": ref["name"], "resourceClaimName": made[ref["name"]]}
        refs.append(ref)
    return {**pod, "spec": {**spec, "resourceClaims": refs}}


__all__ = [
    "PAGE_LIMIT",
    "RESOURCE",
    "Cluster",
    "Progress",
    "Reads",
    "client_for",
    "gc_paused",
    "generated_claims",
]
