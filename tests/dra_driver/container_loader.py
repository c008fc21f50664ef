"""A container as the dynamic loader sees it: an image's file tree, a CDI spec's mounts and hooks
applied to it, and glibc's search for a SONAME.

Images (the parts of NVIDIA's CUDA base images that matter to the loader, from their Dockerfiles
in gitlab.com/nvidia/container-images/cuda, ``dist/<version>/{ubuntu2204,ubi9}/base/Dockerfile``):

- both: ``ENV LD_LIBRARY_PATH /usr/local/nvidia/lib:/usr/local/nvidia/lib64`` and
  ``/etc/ld.so.conf.d/nvidia.conf`` naming the same two directories;
- Ubuntu: merged /usr (``lib -> usr/lib``), Debian's multiarch
  ``ld.so.conf.d/x86_64-linux-gnu.conf``, and glibc's default directories as Debian builds it:
  ``/lib/x86_64-linux-gnu``, ``/usr/lib/x86_64-linux-gnu``, ``/lib``, ``/usr/lib`` (what
  ``ld.so --help`` prints on Debian and Ubuntu);
- UBI: ``lib64 -> usr/lib64``, and glibc's default directories for x86_64 (``slibdir=/lib64``,
  ``libdir=/usr/lib64``): ``/lib64``, ``/usr/lib64``.

Each image's ``/etc/ld.so.cache`` is what ``ldconfig`` made when the image was built: the
NVIDIA files are not in it (they arrive at container start).

Applying a spec: a bind mount puts the host file at its container path (recorded, so a
resolved path can be traced back to the host file); ``create-symlinks --link T::L`` makes link
L -> T; ``update-ldcache --folder D`` writes ``/etc/ld.so.conf.d/00-nvcr-*.conf`` with the
folders and re-runs ldconfig over the configured directories then the default ones, which caches
every ``lib*.so.N`` link found there (ldconfig keys a library by its SONAME; the links the hook
made are named so). The toolkit's hook does just that (``internal/ldconfig/ldconfig.go``).

Resolving a SONAME as glibc's ``_dl_map_object`` does for a name without a slash:
``LD_LIBRARY_PATH`` directories, then ``/etc/ld.so.cache``, then the default directories.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from agent.driverfiles.discover import resolve_in_root, under
from agent.driverfiles.ldcache import CacheEntry, build, parse

CUDA_LD_LIBRARY_PATH = ("/usr/local/nvidia/lib", "/usr/local/nvidia/lib64")


@dataclass
class Image:
    root: Path
    ld_library_path: tuple[str, ...]
    default_dirs: tuple[str, ...]
    mounted: dict[str, str] = field(default_factory=dict)
    """Container path (canonical) -> the host file bound there."""

    # -- building --------------------------------------------------------------------------
    def _conf_dirs(self) -> list[str]:
        conf = self.root / "etc/ld.so.conf.d"
        dirs: list[str] = []
        if conf.is_dir():
            for f in sorted(conf.glob("*.conf")):
                dirs += [ln.strip() for ln in f.read_text().splitlines() if ln.strip()]
        return dirs

    def ldconfig(self) -> None:
        """Rebuild ``/etc/ld.so.cache`` from the configured then the default directories:
        every ``lib*.so.<N>`` there (a file, or a link to one) under its own name, the first
        directory winning."""
        entries: dict[str, CacheEntry] = {}
        for d in [*self._conf_dirs(), *self.default_dirs]:
            real_dir = resolve_in_root(self.root, d)
            if real_dir is None or not under(self.root, real_dir).is_dir():
                continue
            for p in sorted(under(self.root, real_dir).iterdir()):
                name = p.name
                if not name.startswith("lib") or ".so." not in name or name in entries:
                    continue
                if resolve_in_root(self.root, f"{d}/{name}") is not None and p.exists():
                    entries[name] = CacheEntry(name, f"{d}/{name}")
        (self.root / "etc").mkdir(exist_ok=True)
        (self.root / "etc/ld.so.cache").write_bytes(build(entries.values()))

    def put(self, path: str, data: bytes = b"") -> None:
        p = self._create_path(path)
        p.write_bytes(data)

    def _create_path(self, path: str) -> Path:
        """``path`` in the image, its existing parents' links followed inside the image (as
        runc's securejoin does) and missing parents made."""
        parts = PurePosixPath(path).parts[1:]
        cur = "/"
        for part in parts[:-1]:
            nxt = resolve_in_root(self.root, f"{cur.rstrip('/')}/{part}")
            if nxt is None:
                under(self.root, f"{cur.rstrip('/')}/{part}").mkdir()
                nxt = f"{cur.rstrip('/')}/{part}"
            cur = nxt
        return under(self.root, f"{cur.rstrip('/')}/{parts[-1]}")

    # -- a CDI spec ------------------------------------------------------------------------
    def apply(self, spec: dict[str, Any], host: Path) -> None:
        """Apply ``spec``'s top-level edits (the base spec's driver files): bind mounts read
        from ``host`` (the host's /), then its createContainer hooks."""
        edits = spec.get("containerEdits", {})
        for m in edits.get("mounts", []):
            src = under(host, m["hostPath"])
            assert src.exists(), f"hostPath {m['hostPath']} does not exist on the host"
            dst = self._create_path(m["containerPath"])
            if dst.is_symlink():
                dst.unlink()
            dst.write_bytes(b"")  # the mount point runc makes for a file
            rel = "/" + dst.relative_to(self.root).as_posix()
            self.mounted[rel] = m["hostPath"]
        for hook in edits.get("hooks", []):
            assert hook["hookName"] == "createContainer"
            args = list(hook["args"])
            if args[:2] == ["nvidia-ctk", "hook"]:
                args = args[2:]
            else:
                assert args[0] == PurePosixPath(hook["path"]).name
                args = args[1:]
            name, rest = args[0], args[1:]
            pairs = list(zip(rest[::2], rest[1::2], strict=True))
            if name == "create-symlinks":
                for flag, value in pairs:
                    assert flag == "--link"
                    target, link = value.split("::")
                    p = self._create_path(link)
                    if p.is_symlink() or p.exists():
                        p.unlink()
                    p.symlink_to(target)
            elif name == "update-ldcache":
                folders = [v for flag, v in pairs if flag == "--folder"]
                assert len(folders) == len(pairs)
                self.put("/etc/ld.so.conf.d/00-nvcr-test.conf", "\n".join(folders).encode())
                self.ldconfig()
            else:
                raise AssertionError(f"unknown hook {name}")

    # -- the loader ------------------------------------------------------------------------
    def _found(self, path: str) -> str | None:
        real = resolve_in_root(self.root, path)
        return real if real is not None and under(self.root, real).is_file() else None

    def resolve(self, soname: str, *, env: bool = True) -> str | None:
        """The container path (canonical) glibc's loader would open for ``soname``; None when
        it finds none. ``env``: the image's LD_LIBRARY_PATH is in effect."""
        for d in self.ld_library_path if env else ():
            if found := self._found(f"{d}/{soname}"):
                return found
        cache = self.root / "etc/ld.so.cache"
        if cache.exists():
            for e in parse(cache.read_bytes()):
                if e.soname == soname and e.arch == "x86_64" and (found := self._found(e.path)):
                    return found
        for d in self.default_dirs:
            if found := self._found(f"{d}/{soname}"):
                return found
        return None

    def host_file(self, soname: str, *, env: bool = True) -> str | None:
        """The host file the loader would map for ``soname`` (through the mounts)."""
        found = self.resolve(soname, env=env)
        return None if found is None else self.mounted.get(found)


def ubuntu_cuda_image(root: Path) -> Image:
    """nvidia/cuda:*-base-ubuntu22.04, as far as the loader is concerned."""
    shutil.rmtree(root, ignore_errors=True)
    (root / "usr/lib/x86_64-linux-gnu").mkdir(parents=True)
    (root / "lib").symlink_to("usr/lib")
    (root / "lib64").mkdir()
    (root / "usr/lib/x86_64-linux-gnu/libc.so.6").write_bytes(b"")
    img = Image(
        root,
        CUDA_LD_LIBRARY_PATH,
        ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib", "/usr/lib"),
    )
    img.put("/etc/ld.so.conf", b"include /etc/ld.so.conf.d/*.conf\n")
    img.put(
        "/etc/ld.so.conf.d/x86_64-linux-gnu.conf",
        b"/usr/local/lib/x86_64-linux-gnu\n/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n",
    )
    img.put("/etc/ld.so.conf.d/nvidia.conf", b"/usr/local/nvidia/lib\n/usr/local/nvidia/lib64\n")
    img.ldconfig()
    return img


def ubi_cuda_image(root: Path) -> Image:
    """nvidia/cuda:*-base-ubi9, as far as the loader is concerned."""
    shutil.rmtree(root, ignore_errors=True)
    (root / "usr/lib64").mkdir(parents=True)
    (root / "usr/lib").mkdir(parents=True)
    (root / "lib64").symlink_to("usr/lib64")
    (root / "lib").symlink_to("usr/lib")
    (root / "usr/lib64/libc.so.6").write_bytes(b"")
    img = Image(root, CUDA_LD_LIBRARY_PATH, ("/lib64", "/usr/lib64"))
    img.put("/etc/ld.so.conf", b"include ld.so.conf.d/*.conf\n")
    img.put("/etc/ld.so.conf.d/nvidia.conf", b"/usr/local/nvidia/lib\n/usr/local/nvidia/lib64\n")
    img.ldconfig()
    return img
