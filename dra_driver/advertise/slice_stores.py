"""Where this node's ResourceSlices are kept: ``KubeSliceStore`` (the API server; only slices
with our driver and node, selected by field selectors) and ``DirSliceStore`` (standalone: YAML
files in a directory). ``SliceStore`` is what the publisher needs of either."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import yaml

from agent.decode import fields, load_yaml_documents
from agent.errors import DecodeError
from agent.fsutil import atomic_write, move_aside
from agent.logs import fields_
from dra_driver.errors import KubeConflict, KubeError, KubeMalformed

if TYPE_CHECKING:  # the kubernetes client (0.2 s to import) loads only in kube mode
    from dra_driver.cluster.kube import KubeClient

SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"

Obj = dict[str, Any]


class SliceStore(Protocol):
    """Where slices live. Every method raises KubeError on failure."""

    watchable: bool

    def list(self) -> tuple[list[Obj], str]:
        """Our slices and the list's resourceVersion."""
        ...

    def create(self, obj: Obj) -> Obj: ...

    def replace(self, obj: Obj) -> Obj:
        """Update; ``metadata.resourceVersion`` must match the stored one (else KubeConflict)."""
        ...

    def delete(self, name: str) -> None: ...

    def watch(self, resource_version: str, timeout_s: int) -> Iterator[Obj]: ...

    def abort_watches(self) -> None:
        """Make any running ``watch`` iterator finish now (shutdown)."""
        ...

    def end_watches(self) -> None:
        """Make the running ``watch`` iterators finish now; later watches run as usual."""
        ...


def slice_list(data: Obj, method: str = "GET", url: str = SLICES_PATH) -> tuple[list[Obj], str]:
    """The slices of a list answer and its resourceVersion, checked for what the publisher
    reads (names, pool generations, resourceVersions) with :mod:`agent.decode.fields`;
    KubeMalformed naming the field otherwise. Pure."""
    try:
        items = fields.items(data.get("items"), "items")
        for i, obj in enumerate(fields.objects(items, "items")):
            meta = fields.obj(obj.get("metadata"), f"items[{i}].metadata")
            fields.text(meta.get("name"), f"items[{i}].metadata.name")
            fields.text(meta.get("resourceVersion", ""), f"items[{i}].metadata.resourceVersion")
            spec = fields.obj(obj.get("spec"), f"items[{i}].spec")
            pool = fields.obj(spec.get("pool"), f"items[{i}].spec.pool")
            fields.integer(pool.get("generation", 0), f"items[{i}].spec.pool.generation", low=0)
    except fields.FieldError as exc:
        raise KubeMalformed(f"ResourceSlice list: {exc}", method, url) from exc
    list_meta = data.get("metadata")
    rv = list_meta.get("resourceVersion", "") if isinstance(list_meta, dict) else ""
    return list(items), str(rv)


class KubeSliceStore:
    watchable = True

    def __init__(self, kube: KubeClient, driver: str, node: str) -> None:
        self._kube = kube
        self._selector = f"spec.nodeName={node},spec.driver={driver}"

    def list(self) -> tuple[list[Obj], str]:
        data = self._kube.request("GET", SLICES_PATH, {"fieldSelector": self._selector})
        return slice_list(data, "GET", SLICES_PATH)

    def create(self, obj: Obj) -> Obj:
        return self._kube.request("POST", SLICES_PATH, body=obj)

    def replace(self, obj: Obj) -> Obj:
        return self._kube.request("PUT", f"{SLICES_PATH}/{obj['metadata']['name']}", body=obj)

    def delete(self, name: str) -> None:
        try:
            self._kube.request("DELETE", f"{SLICES_PATH}/{name}")
        except KubeError as exc:
            if exc.status != 404:
                raise

    def watch(self, resource_version: str, timeout_s: int) -> Iterator[Obj]:
        query = {"fieldSelector": self._selector, "allowWatchBookmarks": "true"}
        if resource_version:
            query["resourceVersion"] = resource_version
        return self._kube.watch(SLICES_PATH, query, timeout_s)

    def abort_watches(self) -> None:
        self._kube.abort_watches()

    def end_watches(self) -> None:
        self._kube.end_watches()


MAX_SLICE_FILE_BYTES = 16 * 1024 * 1024


def _int_rv(obj: Obj) -> int:
    """The resourceVersion a standalone slice file carries (0 when it has none or a bad one)."""
    rv = str(obj.get("metadata", {}).get("resourceVersion", "0"))
    return int(rv) if rv.isdigit() and len(rv) < 20 else 0


class DirSliceStore:
    """Standalone mode: one YAML file per slice, replaced atomically.

    The files are ours, but a crash, a full disk or a person may have left one that does not
    decode (within the limits of ``agent.decode``) or is not a slice of the right shape: it is
    moved aside (``<name>.corrupt-<time>``, never overwritten), logged, and publishing goes on as
    if it were not there (the next write replaces it)."""

    watchable = False

    def __init__(
        self,
        directory: Path,
        log: logging.Logger | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = directory
        self._log = log or logging.getLogger("tessera.publisher")
        self._clock = clock

    def _path(self, name: str) -> Path:
        return self.directory / f"{name}.yaml"

    def _load(self, path: Path) -> Obj | None:
        """The slice in ``path``; None (the file moved aside and logged) when it is broken."""
        try:
            raw = path.read_bytes()
            docs = load_yaml_documents(raw.decode("utf-8"), str(path), MAX_SLICE_FILE_BYTES)
            if len(docs) != 1 or not isinstance(docs[0], dict):
                raise DecodeError(f"{path}: not one YAML object")
            obj: Obj = docs[0]
            if obj.get("kind") == "ResourceSlice":
                slice_list({"items": [obj]}, "READ", str(path))
            return obj
        except (OSError, UnicodeDecodeError, DecodeError, KubeMalformed) as exc:
            try:
                moved: Path | None = move_aside(path, self._clock())
            except OSError:
                moved = None
            self._log.error(
                "a standalone ResourceSlice file is broken; moved aside",
                extra=fields_(path=str(path), moved_to=str(moved), reason=str(exc)),
            )
            return None

    def list(self) -> tuple[list[Obj], str]:
        if not self.directory.is_dir():
            return [], "0"
        items = []
        for p in sorted(self.directory.glob("*.yaml")):
            obj = self._load(p)
            if obj is not None and obj.get("kind") == "ResourceSlice":
                items.append(obj)
        rv = max((_int_rv(o) for o in items), default=0)
        return items, str(rv)

    def _write(self, obj: Obj, previous: int) -> Obj:
        stored = copy.deepcopy(obj)
        stored["metadata"]["resourceVersion"] = str(previous + 1)
        atomic_write(self._path(obj["metadata"]["name"]), yaml.safe_dump(stored).encode())
        return stored

    def create(self, obj: Obj) -> Obj:
        name = obj["metadata"]["name"]
        if self._path(name).exists():
            raise KubeConflict(
                409, "AlreadyExists", f"{name} exists", "CREATE", str(self.directory)
            )
        return self._write(obj, 0)

    def replace(self, obj: Obj) -> Obj:
        name = obj["metadata"]["name"]
        path = self._path(name)
        current = self._load(path) if path.exists() else None
        if current is None:
            raise KubeError(404, "NotFound", f"{name} not found", "REPLACE", str(self.directory))
        rv = str(_int_rv(current))
        if obj["metadata"].get("resourceVersion") not in (None, rv):
            raise KubeConflict(409, "Conflict", f"{name} changed", "REPLACE", str(self.directory))
        return self._write(obj, int(rv))

    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def watch(self, resource_version: str, timeout_s: int) -> Iterator[Obj]:
        return iter(())

    def abort_watches(self) -> None:
        return None

    def end_watches(self) -> None:
        return None
