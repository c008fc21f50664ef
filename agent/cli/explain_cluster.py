"""``tessera explain --kubeconfig``: the reads of cluster mode, and the progress line.

Everything is read as raw JSON through ``dra_driver.cluster.kube.KubeClient`` (the kubernetes
client's model classes would take minutes to build 200,000 devices), a page of at most
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

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


class Cluster:
    """The reads of cluster mode, through dra_driver.cluster.kube.KubeClient."""

    def __init__(self, kubeconfig: Path) -> None:
        from dra_driver.cluster.kube import KubeClient

        self.kube = KubeClient.from_config(kubeconfig)

    def close(self) -> None:
        self.kube.close()

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

        plural = {
            "ResourceClaim": "resourceclaims",
            "ResourceClaimTemplate": "resourceclaimtemplates",
        }
        try:
            obj = self.kube.request(
                "GET", f"{RESOURCE}/namespaces/{namespace}/{plural[kind]}/{name}"
            )
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise
        obj.setdefault("apiVersion", "resource.k8s.io/v1")
        obj.setdefault("kind", kind)
        return obj


__all__ = ["PAGE_LIMIT", "RESOURCE", "Cluster", "Progress", "gc_paused"]
