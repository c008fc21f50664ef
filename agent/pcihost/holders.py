"""Which processes hold a device node open, as ``fuser`` finds them: each ``/proc/<pid>/fd/<n>``.

Written here rather than with psutil: ``psutil.Process.open_files()`` returns regular files only
(its documentation, https://psutil.readthedocs.io/en/latest/#psutil.Process.open_files: "Return
regular files opened by process"; psutil 7.2's ``_pslinux.py`` keeps a path only when
``isfile_strict`` says it is a regular file), so it never shows ``/dev/nvidia0``, a character
device; and it compares paths as this process names them, while a container names the same node
by its own path. Here each fd is ``stat``-ed through its ``/proc`` link: a character or block
device matches by its device number (``st_rdev``, the same node however it is named or where it
was made), any other file by its device and inode. The simulator's device nodes are regular
files and match by inode."""

from __future__ import annotations

import os
import stat
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

FileKey = tuple[str, int, int]


@dataclass(frozen=True)
class Holder:
    """A process with a file descriptor open on one of the device nodes asked about."""

    pid: int
    name: str
    """Its command name (``/proc/<pid>/comm``), ``?`` when it could not be read."""


def file_key(st: os.stat_result) -> FileKey:
    """What identifies the file: a device node by its device number, any other by its inode."""
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        return ("dev", stat.S_IFMT(st.st_mode), st.st_rdev)
    return ("inode", st.st_dev, st.st_ino)


def holders(
    proc_root: Path, device_paths: Sequence[Path], *, ignore: Collection[int] = ()
) -> list[Holder]:
    """The processes with a file descriptor open on any of ``device_paths`` (a path that does
    not exist is held by nobody), sorted by PID; ``ignore`` leaves PIDs out (the agent's own,
    whose NVML holds GPU nodes open). A process whose fds cannot be read (gone meanwhile, or not
    permitted: the agent runs privileged on a real node) is left out, as ``fuser`` does."""
    wanted: set[FileKey] = set()
    for path in device_paths:
        try:
            wanted.add(file_key(os.stat(path)))
        except FileNotFoundError:
            continue
    if not wanted:
        return []
    found: list[Holder] = []
    for entry in _listdir(proc_root):
        if not entry.isdigit() or int(entry) in ignore:
            continue
        fd_dir = proc_root / entry / "fd"
        if any(_key(fd_dir / fd) in wanted for fd in _listdir(fd_dir)):
            found.append(Holder(pid=int(entry), name=_comm(proc_root / entry)))
    return sorted(found, key=lambda h: h.pid)


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _key(fd_link: Path) -> FileKey | None:
    try:
        return file_key(os.stat(fd_link))  # follows /proc's link to the open file itself
    except OSError:
        return None


def _comm(pid_dir: Path) -> str:
    try:
        return (pid_dir / "comm").read_text().strip() or "?"
    except OSError:
        return "?"
