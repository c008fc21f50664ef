"""Which container runtime on the host reads CDI specs, and from where: containerd's and CRI-O's
configuration files, read under the host root and parsed with ``tomllib``.

containerd (``/etc/containerd/config.toml``; its ``imports``, globs allowed, relative to the
file's directory, are read after it and replace the plugin tables they name, as containerd 1.x
merges them: ``services/server/config/config.go`` ``mergeConfig`` in containerd/containerd):

==================  ===================================  ===========================
config ``version``  table                                ``enable_cdi`` when unset
==================  ===================================  ===========================
3 (containerd 2.x)  ``plugins."io.containerd.cri.v1.runtime"``   true
2                   ``plugins."io.containerd.grpc.v1.cri"``      containerd 1.7: false;
                                                                 2.x: true (it migrates v2)
1 / no version      ``plugins.cri`` (containerd 1.x only)         false
==================  ===================================  ===========================

``cdi_spec_dirs`` defaults to ``["/etc/cdi", "/var/run/cdi"]`` in every version. Sources:
containerd/containerd ``pkg/cri/config/config_unix.go`` (1.7: ``EnableCDI: false``),
``internal/cri/config/config_unix.go`` (2.x: ``EnableCDI: true``) and ``docs/cri/config.md``
(config versions 2 and 3 and their tables).

CRI-O has CDI on with no switch (cncf-tags/container-device-interface ``README.md``, "CRI-O
configuration"); ``cdi_spec_dirs`` is in the ``[crio.runtime]`` table, default
``["/etc/cdi", "/var/run/cdi"]`` (cri-o/cri-o ``docs/crio.conf.5.md``), read from
``/etc/crio/crio.conf`` and then the drop-ins in ``/etc/crio/crio.conf.d`` in lexical order, the
last one that sets it winning (``docs/crio.conf.d.5.md``).

The parsing (:func:`containerd_cdi`, :func:`crio_cdi`) is pure; :func:`read_containerd` and
:func:`read_crio` read the files.
"""

from __future__ import annotations

import glob
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from agent.doctor.hostfs import on_host

DEFAULT_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")
CONTAINERD_CONFIG = "/etc/containerd/config.toml"
CONTAINERD_SIGNS = ("/run/containerd/containerd.sock", "/usr/bin/containerd",
                    "/usr/local/bin/containerd")  # fmt: skip
"""Besides its configuration file, what shows that containerd is installed on the host."""
CRIO_CONFIG = "/etc/crio/crio.conf"
CRIO_DROP_INS = "/etc/crio/crio.conf.d"
CRIO_SIGNS = ("/var/run/crio/crio.sock", "/run/crio/crio.sock", "/usr/bin/crio",
              "/usr/local/bin/crio")  # fmt: skip
CONTAINERD_TABLES = {3: "io.containerd.cri.v1.runtime", 2: "io.containerd.grpc.v1.cri", 1: "cri"}
MAX_IMPORTS = 64


@dataclass(frozen=True)
class RuntimeCdi:
    """How one container runtime is set up for CDI."""

    runtime: str
    """``containerd`` or ``CRI-O``."""
    files: tuple[str, ...]
    """The host paths of the configuration files read, in order (none: built-in defaults)."""
    enabled: bool | None
    """CDI on or off; None: not set, and what that means depends on the runtime's version."""
    spec_dirs: tuple[str, ...]
    """Where the runtime reads CDI specs (host paths)."""
    table: str
    """Where the settings go: ``[plugins."io.containerd.grpc.v1.cri"]``, ``[crio.runtime]``."""
    unset_means: str = ""
    """When ``enabled`` is None: what an unset ``enable_cdi`` means (versions)."""
    problem: str | None = None
    """A configuration that cannot be read as the runtime would (bad TOML, wrong types)."""


class ConfigProblem(Exception):
    """A runtime configuration that does not parse; the message says where and what."""


def _table(doc: Mapping[str, Any], *keys: str) -> Mapping[str, Any]:
    node: Any = doc
    for key in keys:
        node = node.get(key, {}) if isinstance(node, Mapping) else {}
    return node if isinstance(node, Mapping) else {}


def _spec_dirs(table: Mapping[str, Any], where: str) -> tuple[str, ...]:
    dirs = table.get("cdi_spec_dirs", list(DEFAULT_SPEC_DIRS))
    if not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs):
        raise ConfigProblem(f"cdi_spec_dirs in {where} is {dirs!r}, not a list of paths")
    return tuple(dirs)


def containerd_cdi(doc: Mapping[str, Any], files: Sequence[str]) -> RuntimeCdi:
    """containerd's CDI settings from its merged configuration document (pure)."""
    version = doc.get("version", 1)
    if not isinstance(version, int) or version not in CONTAINERD_TABLES:
        raise ConfigProblem(f"version = {version!r} in {files[0]}: containerd knows 1, 2 and 3")
    name = CONTAINERD_TABLES[version]
    where = f'[plugins."{name}"]'
    table = _table(doc, "plugins", name)
    enabled = table.get("enable_cdi")
    if enabled is not None and not isinstance(enabled, bool):
        raise ConfigProblem(f"enable_cdi in {where} is {enabled!r}, not true or false")
    unset = {
        3: "on (containerd 2.x)",
        2: "off on containerd 1.7, on on containerd 2.x",
        1: "off (containerd 1.x)",
    }[version]
    if enabled is None and version == 3:
        enabled = True
    if enabled is None and version == 1:
        enabled = False
    return RuntimeCdi(
        "containerd", tuple(files), enabled, _spec_dirs(table, where), where, unset_means=unset
    )


def crio_cdi(docs: Sequence[tuple[str, Mapping[str, Any]]]) -> RuntimeCdi:
    """CRI-O's CDI settings from its configuration files in the order it reads them (pure)."""
    dirs: tuple[str, ...] = DEFAULT_SPEC_DIRS
    for name, doc in docs:
        table = _table(doc, "crio", "runtime")
        if "cdi_spec_dirs" in table:
            dirs = _spec_dirs(table, f"[crio.runtime] of {name}")
    return RuntimeCdi("CRI-O", tuple(n for n, _ in docs), True, dirs, "[crio.runtime]")


def _load(host_root: Path, path: PurePosixPath | str) -> dict[str, Any]:
    try:
        with open(on_host(host_root, path), "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigProblem(f"{path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigProblem(f"cannot read {path}: {exc.strerror or exc}") from None


def _exists(host_root: Path, path: str) -> bool:
    return os.path.exists(on_host(host_root, path))  # an unreadable path counts as missing


def _imports(host_root: Path, parent: str, doc: Mapping[str, Any]) -> list[str]:
    """The host paths a containerd configuration imports (globs expanded, sorted per pattern)."""
    raw = doc.get("imports", [])
    if not isinstance(raw, list) or not all(isinstance(i, str) for i in raw):
        raise ConfigProblem(f"imports in {parent} is {raw!r}, not a list of paths")
    out: list[str] = []
    for item in raw:
        path = PurePosixPath(parent).parent / item  # an absolute item replaces the directory
        if "*" in item:
            found = glob.glob(str(on_host(host_root, path)))
            out += sorted("/" + str(Path(f).relative_to(host_root)) for f in found)
        else:
            out.append(str(path))
    return out


def read_containerd(host_root: Path) -> RuntimeCdi | None:
    """containerd's CDI settings on the host under ``host_root``; None when containerd is not
    there (no configuration file, socket or binary)."""
    if not _exists(host_root, CONTAINERD_CONFIG):
        if not any(_exists(host_root, s) for s in CONTAINERD_SIGNS):
            return None
        return containerd_cdi({"version": 2}, ())  # built-in defaults: depends on the version
    try:
        doc = _load(host_root, CONTAINERD_CONFIG)
        files = [CONTAINERD_CONFIG]
        pending = _imports(host_root, CONTAINERD_CONFIG, doc)
        plugins = dict(_table(doc, "plugins"))
        while pending and len(files) < MAX_IMPORTS:
            path = pending.pop(0)
            if path in files:
                continue
            imported = _load(host_root, path)
            files.append(path)
            plugins.update(_table(imported, "plugins"))  # a plugin table replaces the main one
            pending += _imports(host_root, path, imported)
        return containerd_cdi({**doc, "plugins": plugins}, files)
    except ConfigProblem as exc:
        return RuntimeCdi("containerd", (CONTAINERD_CONFIG,), None, (), "", problem=str(exc))


def read_crio(host_root: Path) -> RuntimeCdi | None:
    """CRI-O's CDI settings on the host under ``host_root``; None when CRI-O is not there."""
    try:
        drop_ins = on_host(host_root, CRIO_DROP_INS).iterdir()
        names = sorted(p.name for p in drop_ins if p.is_file())
    except OSError:  # none (or unreadable: reading the files would say so)
        names = []
    paths = ([CRIO_CONFIG] if _exists(host_root, CRIO_CONFIG) else []) + [
        f"{CRIO_DROP_INS}/{n}" for n in names
    ]
    if not paths and not any(_exists(host_root, s) for s in CRIO_SIGNS):
        return None
    try:
        return crio_cdi([(p, _load(host_root, p)) for p in paths])
    except ConfigProblem as exc:
        return RuntimeCdi("CRI-O", tuple(paths), True, (), "[crio.runtime]", problem=str(exc))
