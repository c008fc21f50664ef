"""The base CDI spec's edits for the driver's files: bind mounts of its libraries, binaries,
firmware and sockets, and the NVIDIA Container Toolkit's ``createContainer`` hooks that make the
SONAME links and the loader cache in the container (the rules and their upstream sources are in
:mod:`dra_driver.kubeletplugin.cdi`'s docstring). Pure: the files were found before."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from agent.driverfiles.discover import FIRMWARE_DIR, DriverFiles, Library
from dra_driver.kubeletplugin.cdi_spec import (
    HOOK_ENV,
    HOOK_LIFECYCLE,
    NVIDIA_LIB64,
    SOCKET_OPTIONS,
    hook_argv0,
    mount,
)


@dataclass(frozen=True)
class DriverEdits:
    """The edits for ``files``; ``host`` maps a driver-root path to the host's; ``hook`` is the
    host path of the toolkit's hook binary (None: the hook-free layout, every name a mount)."""

    files: DriverFiles
    host: Callable[[str], str]
    hook: str | None

    def _library_names(self, lib: Library) -> list[str]:
        """The names a container's programs may ask for: the versioned file, its SONAME, and
        its development link where the host has one (libcuda's always, as the toolkit)."""
        names = [lib.filename]
        if lib.soname is not None:
            names.append(lib.soname)
        if lib.dev_link or lib.name == "libcuda.so":
            names.append(lib.name)
        return list(dict.fromkeys(names))

    def library_mounts(self) -> list[dict[str, Any]]:
        """Read-only bind mounts of the driver libraries found under the driver root: the
        versioned files, plus (without a hook) every other name of each, also under
        :data:`NVIDIA_LIB64`."""
        mounts: list[dict[str, Any]] = []
        for lib in self.files.libraries:
            if self.hook is not None:
                mounts.append(mount(self.host(lib.path), lib.path))
                continue
            for name in self._library_names(lib):
                mounts.append(mount(self.host(lib.path), f"{lib.directory}/{name}"))
        if self.hook is None:
            for lib in self.files.libraries:
                for name in self._library_names(lib):
                    mounts.append(mount(self.host(lib.path), f"{NVIDIA_LIB64}/{name}"))
        return mounts

    def file_mounts(self) -> list[dict[str, Any]]:
        """Read-only bind mounts of the binaries, firmware and sockets."""
        f = self.files
        mounts = [mount(self.host(b), b) for b in f.binaries]
        for fw in f.firmware:
            name = PurePosixPath(fw).name
            mounts.append(mount(self.host(fw), f"{FIRMWARE_DIR}/{f.version}/{name}"))
        for sock in f.sockets:
            inside = sock.removeprefix("/var") if sock.startswith("/var/run/") else sock
            mounts.append(mount(self.host(sock), inside, SOCKET_OPTIONS))
        return mounts

    def hooks(self) -> list[dict[str, Any]]:
        """The toolkit's ``create-symlinks`` and ``update-ldcache`` hooks (none without the
        hook binary or libraries)."""
        if self.hook is None or not self.files.libraries:
            return []
        links: list[str] = []
        for lib in self.files.libraries:
            d = lib.directory
            if lib.name == "libcuda.so":  # many programs dlopen libcuda.so: always linked
                links.append(f"{lib.soname or lib.filename}::{d}/{lib.name}")
            if lib.soname is not None and lib.soname != lib.filename:
                links.append(f"{lib.filename}::{d}/{lib.soname}")
            if lib.dev_link and lib.name != "libcuda.so" and lib.soname is not None:
                links.append(f"{lib.soname}::{d}/{lib.name}")
        argv0 = hook_argv0(self.hook)
        out = []
        if links:
            args = [*argv0, "create-symlinks"]
            for link in dict.fromkeys(links):
                args += ["--link", link]
            out.append(self._hook(args))
        folders = [*argv0, "update-ldcache"]
        for d in self.files.library_dirs:
            folders += ["--folder", d]
        out.append(self._hook(folders))
        return out

    def _hook(self, args: list[str]) -> dict[str, Any]:
        return {"hookName": HOOK_LIFECYCLE, "path": self.hook, "args": args, "env": list(HOOK_ENV)}
