"""Find the NVIDIA driver's user-space files under a driver root, as a container needs them.

A *driver root* is where the driver's files are visible to the agent: ``/`` for a driver
installed on the host and the agent running there, the host's root mounted into the agent's pod
(``/driver-root`` in the DaemonSet), or a containerized driver's root (the GPU operator's
``/run/nvidia/driver`` on the host). Every path this module returns is *root-relative*: absolute
as the driver root itself sees it (``/usr/lib/x86_64-linux-gnu/libcuda.so.550.90.07``), with
every symlink resolved inside the root (an absolute link in a containerized driver's tree points
into that tree, not at the host's ``/``). Prefix it with the driver root to open it, with the
host's view of the same root to name it in a CDI spec; inside the container it is the path
itself.

What is looked for (with where the list comes from):

- **Libraries**: the utility and compute libraries of libnvidia-container's ``nvc_info.c``
  (``utility_libs``, ``compute_libs``; what NVIDIA Container Toolkit mounts for
  ``NVIDIA_DRIVER_CAPABILITIES=compute,utility``, the CUDA images' default), each as the file
  ``<name>.<driver version>``: the toolkit's CDI generator also selects libraries by that version
  suffix (``pkg/nvcdi/driver-nvml.go``, ``getVersionLibs``). Looked up first in the driver root's
  ld cache (``etc/ld.so.cache``, :mod:`agent.driverfiles.ldcache`), then in the standard
  directories (the toolkit's ``pkg/lookup/library.go`` list, and ``usr/lib``). A 32-bit ELF file
  is skipped (RHEL's ``/usr/lib`` holds the 32-bit compat libraries).
- **SONAME links** of each library: the cache entry whose path resolves to it (the cache is
  keyed by SONAME), else the symlinks beside it that resolve to it (``libcuda.so.1`` ->
  ``libcuda.so.<version>``); and whether the development link ``<name>`` (``libcuda.so``) is
  there. The toolkit reads the ELF DT_SONAME and makes a link only where the host has one
  (``internal/discover/symlinks.go``): the links the host has are the same answer.
- **Binaries**: ``nvidia-smi``, ``nvidia-debugdump``, ``nvidia-persistenced`` (``utility_bins``)
  and ``nvidia-cuda-mps-control``, ``nvidia-cuda-mps-server`` (``compute_bins``), executable
  files in the usual ``bin`` directories.
- **GSP firmware**: ``lib/firmware/nvidia/<version>/gsp*.bin`` (libnvidia-container's
  ``NV_FIRMWARE_PATH``; the toolkit's ``newDriverFirmwareDiscoverer``).
- **Sockets**: ``run/nvidia-persistenced/socket`` and ``run/nvidia-fabricmanager/socket`` when
  present (``NV_PERSISTENCED_SOCKET``/``NV_FABRICMANAGER_SOCKET``; the toolkit's
  ``internal/discover/ipc.go`` looks in ``/run`` and ``/var/run``).

Also here: the driver version from ``proc/driver/nvidia/version``, a character device's major from
``proc/devices``, the toolkit's hook binary, and making a missing character device node.
:func:`resolve_in_root` and the readers only read; :func:`make_char_device` writes.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from agent.driverfiles import ldcache
from agent.errors import DecodeError

UTILITY_LIBRARIES = ("libnvidia-ml.so", "libnvidia-cfg.so", "libnvidia-nscq.so")
"""libnvidia-container ``src/nvc_info.c`` ``utility_libs``."""
COMPUTE_LIBRARIES = (
    "libcuda.so",
    "libcudadebugger.so",
    "libnvidia-opencl.so",
    "libnvidia-gpucomp.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-fatbinaryloader.so",
    "libnvidia-allocator.so",
    "libnvidia-compiler.so",
    "libnvidia-pkcs11.so",
    "libnvidia-pkcs11-openssl3.so",
    "libnvidia-nvvm.so",
    "libnvidia-tileiras.so",
)
"""libnvidia-container ``src/nvc_info.c`` ``compute_libs`` (which drivers ship which varies:
``libnvidia-fatbinaryloader`` is gone since 450, ``libnvidia-gpucomp`` came with 535)."""
LIBRARIES = UTILITY_LIBRARIES + COMPUTE_LIBRARIES
BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
"""libnvidia-container ``utility_bins`` (less ``nv-fabricmanager``, a host daemon) and
``compute_bins``; the toolkit's ``newDriverBinariesDiscoverer`` mounts the same."""
LIBRARY_DIRS = (
    "/usr/lib64",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu/nvidia/current",
    "/usr/lib/aarch64-linux-gnu/nvidia/current",
    "/lib64",
    "/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/usr/lib",
)
"""Where libraries are looked for after the ld cache, in order: NVIDIA Container Toolkit's
``pkg/lookup/library.go`` search paths, then ``/usr/lib`` (last: on RHEL it holds 32-bit
libraries)."""
BINARY_DIRS = ("/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin", "/usr/local/sbin")
LD_CACHE = "/etc/ld.so.cache"
VERSION_FILE = "/proc/driver/nvidia/version"
PROC_DEVICES = "/proc/devices"
FIRMWARE_DIR = "/lib/firmware/nvidia"
SOCKETS = ("/run/nvidia-persistenced/socket", "/run/nvidia-fabricmanager/socket")
HOOK_BINARIES = ("nvidia-cdi-hook", "nvidia-ctk")
"""NVIDIA Container Toolkit's CDI hook binaries, preferred first (``nvidia-ctk`` runs the same
hooks as ``nvidia-ctk hook <name>``)."""
HOOK_DIRS = ("/usr/bin", "/usr/local/bin", "/usr/local/nvidia/toolkit")
"""Where the toolkit's packages install the hook (``/usr/bin``) and where the GPU operator puts
its copy on the host (``/usr/local/nvidia/toolkit``)."""
NVML_SONAME = "libnvidia-ml.so.1"
MAX_LINKS = 40
"""Symlinks followed in one lookup before giving up (Linux's own limit)."""
_VERSION_RE = re.compile(r"^NVRM version:.*?\s([0-9]+\.[0-9]+(?:\.[0-9]+)?)\s", re.MULTILINE)
_MAX_READ = 1024 * 1024


@dataclass(frozen=True)
class Library:
    """One driver library found under the driver root."""

    name: str
    """The unversioned name: ``libcuda.so``."""
    path: str
    """The versioned file, root-relative: ``/usr/lib/x86_64-linux-gnu/libcuda.so.550.90.07``."""
    soname: str | None
    """The SONAME programs ask the loader for (``libcuda.so.1``); None when the host has no
    link for one (the file's own name is then its SONAME: ``libnvidia-gpucomp.so.<ver>``)."""
    dev_link: bool
    """The host has the development link ``<name>`` (``libcuda.so``) beside it."""

    @property
    def directory(self) -> str:
        return str(PurePosixPath(self.path).parent)

    @property
    def filename(self) -> str:
        return PurePosixPath(self.path).name


@dataclass(frozen=True)
class DriverFiles:
    """The driver's user-space files under one driver root, root-relative (see the module)."""

    version: str
    libraries: tuple[Library, ...] = ()
    binaries: tuple[str, ...] = ()
    firmware: tuple[str, ...] = ()
    sockets: tuple[str, ...] = ()

    def library(self, name: str) -> Library | None:
        """The library named ``name`` (``libcuda.so``), if found."""
        return next((lib for lib in self.libraries if lib.name == name), None)

    @property
    def library_dirs(self) -> tuple[str, ...]:
        """The directories holding the libraries, in the libraries' order, each once."""
        return tuple(dict.fromkeys(lib.directory for lib in self.libraries))


def under(root: Path | str, rel: str) -> Path:
    """``rel`` (root-relative, absolute) as a path under ``root``."""
    return Path(root) / rel.lstrip("/")


def resolve_in_root(root: Path | str, path: str) -> str | None:
    """``path`` (absolute, as seen from ``root``) with every symlink resolved as if ``root``
    were ``/``: absolute link targets restart at ``root``, ``..`` stops at it. The root-relative
    canonical path of what exists there, or None when it does not exist (or loops)."""
    root = Path(root)
    todo = [p for p in path.split("/") if p not in ("", ".")]
    todo.reverse()
    done: list[str] = []
    links = 0
    while todo:
        part = todo.pop()
        if part == "..":
            if done:
                done.pop()
            continue
        here = root.joinpath(*done, part)
        try:
            st = here.lstat()
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_LINKS:
                return None
            try:
                target = os.readlink(here)
            except OSError:
                return None
            if target.startswith("/"):
                done = []
            todo.extend(reversed([p for p in target.split("/") if p not in ("", ".")]))
            continue
        done.append(part)
    return "/" + "/".join(done)


def _is_file(root: Path, rel: str) -> bool:
    return under(root, rel).is_file()


def _elf_is_32bit(path: Path) -> bool:
    """True for a 32-bit ELF file (EI_CLASS 1); anything else (64-bit, not ELF) is False."""
    try:
        with path.open("rb") as f:
            head = f.read(5)
    except OSError:
        return False
    return head[:4] == b"\x7fELF" and head[4:5] == b"\x01"


def read_ld_cache(root: Path | str) -> list[ldcache.CacheEntry]:
    """The 64-bit entries of the driver root's ld cache; [] when it has none or it cannot be
    read (the standard directories are searched then)."""
    path = under(root, LD_CACHE)
    try:
        with path.open("rb") as f:
            data = f.read(ldcache.MAX_CACHE_BYTES + 1)
        entries = ldcache.parse(data, str(path))
    except (OSError, DecodeError):
        return []
    return [e for e in entries if e.arch is not None]


def find_library(
    root: Path | str, soname: str, cache: Sequence[ldcache.CacheEntry] | None = None
) -> str | None:
    """Where ``soname`` (``libnvidia-ml.so.1``) is under the driver root, the way the root's
    own loader would find it without LD_LIBRARY_PATH: its ld cache, then the standard
    directories. The root-relative path of the file (links resolved), or None."""
    root = Path(root)
    entries = read_ld_cache(root) if cache is None else cache
    candidates = [e.path for e in entries if e.soname == soname]
    candidates += [f"{d}/{soname}" for d in LIBRARY_DIRS]
    for candidate in candidates:
        real = resolve_in_root(root, candidate)
        if real is not None and _is_file(root, real) and not _elf_is_32bit(under(root, real)):
            return real
    return None


class _Index:
    """What one discovery reads more than once, read once: the ld cache's entries with their
    paths resolved, and each library directory's symlinks by what they resolve to."""

    def __init__(self, root: Path, cache: Sequence[ldcache.CacheEntry]) -> None:
        self.root = root
        self.cache = [(e.soname, resolve_in_root(root, e.path)) for e in cache]
        self._links: dict[str, dict[str, list[str]]] = {}

    def links_to(self, directory: str, target: str) -> list[str]:
        """Names of the symlinks in ``directory`` (root-relative) that resolve to ``target``."""
        by_target = self._links.get(directory)
        if by_target is None:
            by_target = self._links[directory] = {}
            try:
                names = sorted(os.listdir(under(self.root, directory)))
            except OSError:
                names = []
            for name in names:
                if under(self.root, f"{directory}/{name}").is_symlink():
                    real = resolve_in_root(self.root, f"{directory}/{name}")
                    if real is not None:
                        by_target.setdefault(real, []).append(name)
        return by_target.get(target, [])


def _find_versioned(index: _Index, name: str, version: str) -> Library | None:
    root = index.root
    filename = f"{name}.{version}"
    candidates = [
        real
        for soname, real in index.cache
        if (soname.startswith(name + ".") or soname == name)
        and real is not None
        and PurePosixPath(real).name == filename
    ]
    candidates += [f"{d}/{filename}" for d in LIBRARY_DIRS]
    for candidate in candidates:
        real = resolve_in_root(root, candidate)
        if real is None or not _is_file(root, real) or _elf_is_32bit(under(root, real)):
            continue
        directory = str(PurePosixPath(real).parent)
        links = index.links_to(directory, real)
        from_cache = [s for s, r in index.cache if s not in (filename, name) and r == real]
        sonames = from_cache or [n for n in links if n != name]
        return Library(
            name=name,
            path=real,
            soname=sonames[0] if sonames else None,
            dev_link=name in links,
        )
    return None


def _executable(root: Path, rel: str) -> bool:
    p = under(root, rel)
    return p.is_file() and os.access(p, os.X_OK)


def find_binary(root: Path | str, name: str) -> str | None:
    """The root-relative path of executable ``name`` in the usual ``bin`` directories."""
    root = Path(root)
    for d in BINARY_DIRS:
        real = resolve_in_root(root, f"{d}/{name}")
        if real is not None and _executable(root, real):
            return real
    return None


def _firmware(root: Path, version: str) -> tuple[str, ...]:
    real_dir = resolve_in_root(root, f"{FIRMWARE_DIR}/{version}")
    if real_dir is None:
        return ()
    try:
        names = sorted(os.listdir(under(root, real_dir)))
    except OSError:
        return ()
    return tuple(
        f"{real_dir}/{n}"
        for n in names
        if n.startswith("gsp") and n.endswith(".bin") and _is_file(root, f"{real_dir}/{n}")
    )


def _sockets(root: Path) -> tuple[str, ...]:
    found = []
    for sock in SOCKETS:
        for candidate in (sock, "/var" + sock):
            real = resolve_in_root(root, candidate)
            try:
                is_socket = real is not None and stat.S_ISSOCK(under(root, real).lstat().st_mode)
            except OSError:
                is_socket = False
            if real is not None and is_socket:
                found.append(real)
                break
    return tuple(found)


def discover_driver_files(root: Path | str, version: str) -> DriverFiles:
    """The files of driver ``version`` under ``root`` (see the module for what and where).
    Missing files are left out: a driver without ``libnvidia-opencl`` simply has none."""
    root = Path(root)
    index = _Index(root, read_ld_cache(root))
    libraries = tuple(lib for name in LIBRARIES if (lib := _find_versioned(index, name, version)))
    binaries = tuple(b for name in BINARIES if (b := find_binary(root, name)))
    return DriverFiles(
        version=version,
        libraries=libraries,
        binaries=binaries,
        firmware=_firmware(root, version),
        sockets=_sockets(root),
    )


def _read(path: Path) -> str | None:
    try:
        with path.open("rb") as f:
            return f.read(_MAX_READ).decode("utf-8", "replace")
    except OSError:
        return None


def read_driver_version(root: Path | str) -> str | None:
    """The kernel module's version from ``proc/driver/nvidia/version`` under ``root``
    (``NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.90.07  ...``, also the open
    modules' ``... Open Kernel Module for x86_64  550.90.07  ...``); None when absent."""
    text = _read(under(root, VERSION_FILE))
    m = _VERSION_RE.search(text or "")
    return m.group(1) if m else None


def read_char_major(root: Path | str, name: str) -> int | None:
    """The major number of character device driver ``name`` (``nvidia-caps``) in the
    ``Character devices:`` part of ``proc/devices`` under ``root``; None when it has none.
    The name must match whole (``nvidia-caps`` is not ``nvidia-caps-imex-channels``)."""
    text = _read(under(root, PROC_DEVICES))
    if text is None:
        return None
    chars = text.split("Character devices:", 1)[-1].split("Block devices:", 1)[0]
    for line in chars.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1] == name and fields[0].isdigit():
            return int(fields[0])
    return None


def find_cdi_hook(
    driver_root: Path | str, *, host_view_is_ours: bool, env: Mapping[str, str]
) -> str | None:
    """The NVIDIA Container Toolkit hook binary, root-relative under the driver root
    (``nvidia-cdi-hook`` first, then ``nvidia-ctk``, in :data:`HOOK_DIRS`); failing that, when
    the agent sees the host's paths as they are (``host_view_is_ours``: no translation), on the
    agent's own ``PATH`` in ``env``. A PATH hit of an agent in a container is not a host path,
    so it is not looked for there."""
    root = Path(driver_root)
    for name in HOOK_BINARIES:
        for d in HOOK_DIRS:
            real = resolve_in_root(root, f"{d}/{name}")
            if real is not None and _executable(root, real):
                return real
    if host_view_is_ours:
        for name in HOOK_BINARIES:
            for d in env.get("PATH", "").split(":"):
                if d.startswith("/"):
                    real = resolve_in_root(root, f"{d}/{name}")
                    if real is not None and _executable(root, real):
                        return real
    return None


def has_dev_dir(driver_root: Path | str) -> bool:
    """Whether the driver root holds the device nodes (a ``dev`` directory), as NVIDIA's DRA
    driver decides (``cmd/gpu-kubelet-plugin/root.go``, ``getDevRoot``): then device nodes are
    ``<root>/dev/...``, else the agent's ``/dev``."""
    return under(driver_root, "/dev").is_dir()


def make_char_device(path: Path, major: int, minor: int, mode: int) -> None:
    """Create character device node ``path`` (``mknod``, like ``nvidia-modprobe``) with
    permissions ``mode``, and its directory (0755) when missing. Raises OSError."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    os.mknod(path, stat.S_IFCHR | (mode & 0o777), os.makedev(major, minor))
    os.chmod(path, mode & 0o777)  # mknod's mode passes through the umask
