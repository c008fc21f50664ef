"""Writing the simulator's file trees (sysfs, driver root): idempotent, atomic per entry, and
quiet when nothing changed, so a reader running at the same time never sees a gap."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from agent.errors import ConfigError


def write_text(path: Path, text: str) -> None:
    """Write ``text`` atomically; leave the file alone when it already holds it."""
    try:
        with open(path) as f:  # not Path.read_text: a restart checks hundreds of these
            if f.read() == text:
                return
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def symlink(link: Path, target: str) -> None:
    """Point ``link`` at ``target`` (relative), atomically replacing what was there."""
    with contextlib.suppress(OSError):  # not a link, or none there
        if os.readlink(link) == target:
            return
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(target)
    os.replace(tmp, link)


def remove(path: Path) -> None:
    """Remove a file, link or directory tree if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.is_symlink() or path.exists():
        path.unlink()


def write_tree(root: Path, real: str, what: str, write: Callable[[Path], None]) -> None:
    """Run ``write(root)``, refusing to write over the real ``real`` (``/sys``, ``/``) and
    turning I/O failures into a ConfigError that names ``what`` and the root."""
    root = Path(root)
    if os.path.realpath(root) == real:
        raise ConfigError(f"refusing to write a simulated {what} over the real {real}")
    try:
        write(root)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the simulated {what} under {root}: {exc.strerror or exc}"
        ) from exc
