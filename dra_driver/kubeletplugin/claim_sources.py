"""Where the driver reads a ResourceClaim object from: the API server or claim files.

``KubeClaimSource`` reads from the API server (names validated before they go into a URL; a read
has its own deadline, shorter than the kubelet's), ``DirClaimSource`` from
``<state-dir>/resourceclaims/*.yaml`` (standalone mode: manifests that carry
``status.allocation``). The directory source reads only regular files, never through a symbolic
link, of at most ``MAX_CLAIM_FILE_BYTES`` (a FIFO or device never blocks it), decodes them with
limits (no YAML aliases, bounded integers and nesting: ``agent.decode``), and a file that cannot
be read only affects the claims it holds: the others are found, and a claim that is not found
names the unreadable files. What a claim's allocation says is ``claims.py``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from agent.decode import load_yaml_documents
from agent.errors import DecodeError
from agent.fsutil import FileRefused, read_regular_file
from dra_driver.errors import ClaimError, KubeError
from dra_driver.kubeletplugin.claims import check_claim_names, shown

if TYPE_CHECKING:  # the kubernetes client costs 0.2 s to import, which only kube mode needs
    from dra_driver.cluster.kube import KubeClient

MAX_CLAIM_FILE_BYTES = 1024 * 1024
CLAIM_READ_TIMEOUT = (5.0, 15.0)
"""(connect, read) seconds for reading one claim: well inside the kubelet's 45 s."""
MAX_LISTED_FILES = 10
"""A claim that is not found names at most this many unreadable claim files."""


class ClaimSource(Protocol):
    reads_block: bool
    """Whether a read waits on something slow (the API server): a batch's claims are then read
    concurrently, else one after the other in the batch's thread (a claim file is read in
    microseconds, less than a hand-off to another thread costs)."""

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        """The claim object; ClaimError when it does not exist or cannot be read, KubeError
        when the API server cannot be reached. Bounded in time."""
        ...


class ClaimIndex(Protocol):
    origin: str
    """Where the claims come from, for the record of a rebuilt entry (``api``, ``claim-files``)."""

    def by_uid(self, uids: Collection[str]) -> dict[str, dict[str, Any]]:
        """The claim objects whose ``metadata.uid`` is one of ``uids`` (those found), for
        rebuilding prepared state that names claims only by UID. ClaimError or KubeError when
        the source cannot be read."""
        ...


def _uid_of(doc: Mapping[str, Any]) -> str | None:
    meta = doc.get("metadata")
    uid = meta.get("uid") if isinstance(meta, dict) else None
    return uid if isinstance(uid, str) else None


CLAIMS_PATH = "/apis/resource.k8s.io/v1/resourceclaims"
LIST_PAGE = 500
"""Claims per page when listing across namespaces (the API server's chunking: ``limit`` and
``continue``, so a cluster with many claims is read in bounded pieces)."""
MAX_LIST_PAGES = 1000


class KubeClaimSource:
    origin = "api"
    reads_block = True

    def __init__(
        self,
        kube: KubeClient,
        timeout: tuple[float, float] = CLAIM_READ_TIMEOUT,
        page: int = LIST_PAGE,
    ) -> None:
        self._kube = kube
        self._timeout = timeout
        self._page = page

    def by_uid(self, uids: Collection[str]) -> dict[str, dict[str, Any]]:
        """List ResourceClaims across namespaces, page by page, keeping those of ``uids``
        (RBAC: ``list`` on ``resourceclaims``). Stops early once all are found.

        The UID is matched here: ResourceClaims select only on the fields every object has,
        ``metadata.name`` and ``metadata.namespace`` (kubernetes.io/docs/concepts/overview/
        working-with-objects/field-selectors/; the resourceclaim registry's selectable fields
        are the object meta's), and an unsupported field selector is an error, so none is
        sent. Pages use ``limit``/``continue`` (API chunking), so the answer stays bounded."""
        wanted = set(uids)
        found: dict[str, dict[str, Any]] = {}
        token = ""
        for _ in range(MAX_LIST_PAGES):
            if not wanted - set(found):
                break
            query = {"limit": str(self._page)} | ({"continue": token} if token else {})
            page = self._kube.request("GET", CLAIMS_PATH, query=query, timeout=self._timeout)
            items = page.get("items")
            for doc in items if isinstance(items, list) else []:
                uid = _uid_of(doc) if isinstance(doc, dict) else None
                if uid is not None and uid in wanted:
                    found[uid] = doc
            meta = page.get("metadata")
            token = str(meta.get("continue") or "") if isinstance(meta, dict) else ""
            if not token:
                break
        return found

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        check_claim_names(namespace, name)
        try:
            return self._kube.request(
                "GET",
                f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}",
                timeout=self._timeout,
            )
        except KubeError as exc:
            if exc.status == 404:
                raise ClaimError(f"claim {namespace}/{name} not found", "not_found") from exc
            raise


class _ClaimFile:
    """One claim file's documents, and its ResourceClaims by (namespace, name) (the first of a
    name in the file, as a scan in order finds it)."""

    __slots__ = ("claims", "docs")

    def __init__(self, docs: list[dict[str, Any]]) -> None:
        self.docs = docs
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        for doc in docs:
            meta = doc.get("metadata")
            if doc.get("kind") != "ResourceClaim" or not isinstance(meta, dict):
                continue
            namespace, name = meta.get("namespace", "default"), meta.get("name")
            if isinstance(namespace, str) and isinstance(name, str):
                self.claims.setdefault((namespace, name), doc)


class DirClaimSource:
    """Standalone mode: ResourceClaim manifests (with status.allocation) in a directory.

    Parsed files are cached by their bytes, so a batch of claims parses each file once, and
    each file's claims are indexed by name (a claim is found without a scan of the others).
    Only regular files are read (never through a symbolic link; opened without blocking,
    checked before reading), at most ``MAX_CLAIM_FILE_BYTES`` each. A file that cannot be read
    or decoded is remembered with why; it hides only the claims it holds, and a claim not found
    names such files."""

    origin = "claim-files"
    reads_block = False

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._cache: dict[str, tuple[bytes, _ClaimFile | str]] = {}
        self._lock = threading.Lock()

    def _file(self, name: str) -> _ClaimFile | str:
        """The claim documents of one file, or why it cannot be read. Read with
        ``read_regular_file``: a symbolic link is not followed (whoever can write the directory
        must not make the driver read a file elsewhere), only a regular file of at most
        ``MAX_CLAIM_FILE_BYTES`` is read. The parse is cached by the file's bytes: reading 1 MiB
        is cheap beside decoding it for every claim of a batch."""
        path = self.directory / name
        try:
            data = read_regular_file(path, MAX_CLAIM_FILE_BYTES)
        except FileRefused as exc:
            return f"cannot open it: {exc.strerror}"
        except OSError as exc:
            return f"cannot read it: {exc.strerror or exc}"
        with self._lock:
            cached = self._cache.get(name)
        if cached is not None and cached[0] == data:
            return cached[1]
        decoded = self._decode(path, data)
        result = decoded if isinstance(decoded, str) else _ClaimFile(decoded)
        with self._lock:
            self._cache[name] = (data, result)
        return result

    @staticmethod
    def _decode(path: Path, data: bytes) -> list[dict[str, Any]] | str:
        if len(data) > MAX_CLAIM_FILE_BYTES:
            return f"more than {MAX_CLAIM_FILE_BYTES} bytes"
        try:
            docs = load_yaml_documents(data.decode("utf-8"), str(path), MAX_CLAIM_FILE_BYTES)
        except UnicodeDecodeError as exc:
            return f"not UTF-8 text ({exc.reason} at byte {exc.start})"
        except DecodeError as exc:
            return str(exc).removeprefix(f"{path}: ")
        return [d for d in docs if isinstance(d, dict)]

    def _files(self) -> Iterator[tuple[str, _ClaimFile | str]]:
        """Every claim file's documents (or why it cannot be read), in name order, read as
        they are asked for."""
        try:
            names = sorted(n for n in os.listdir(self.directory) if n.endswith((".yaml", ".yml")))
        except FileNotFoundError:
            return
        except OSError as exc:
            raise ClaimError(
                f"cannot list claim files in {self.directory}: {exc.strerror or exc}",
                "claim_source",
            ) from exc
        for name in names:
            yield name, self._file(name)

    def by_uid(self, uids: Collection[str]) -> dict[str, dict[str, Any]]:
        """The claim documents whose ``metadata.uid`` is one of ``uids``."""
        wanted = set(uids)
        found: dict[str, dict[str, Any]] = {}
        for _, result in self._files():
            if isinstance(result, str):
                continue
            for doc in result.docs:
                uid = _uid_of(doc)
                if doc.get("kind") == "ResourceClaim" and uid is not None and uid in wanted:
                    found[uid] = doc
        return found

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        broken: dict[str, str] = {}
        for file_name, result in self._files():
            if isinstance(result, str):
                broken[file_name] = result
            elif (doc := result.claims.get((namespace, name))) is not None:
                return doc
        hint = ""
        if broken:
            listed = sorted(broken.items())[:MAX_LISTED_FILES]
            hint = "; unreadable claim files: " + "; ".join(
                f"{n if n.isprintable() else shown(n)}: {why}" for n, why in listed
            )
            if len(broken) > MAX_LISTED_FILES:
                hint += f"; and {len(broken) - MAX_LISTED_FILES} more"
        raise ClaimError(
            f"claim {namespace}/{name} not found in {self.directory}{hint}", "not_found"
        )
