"""Which pod runs a GPU process: the pod UID in the process's cgroup, ``<proc-root>/<pid>/cgroup``.

NVML names the processes on a GPU by PID, and the PIDs are the host's (the driver does not
translate them into the caller's PID namespace). :class:`ProcessPods` reads each PID's cgroup
under ``proc_root`` (``/proc``; in a container that is not in the host's PID namespace, the
host's ``/proc`` mounted somewhere, ``--proc-root``) and finds the pod UID the kubelet put in the
path; the accounting maps it to a claim through the claims' pods (``status.reservedFor``).

**The file.** ``/proc/<pid>/cgroup`` has one line per hierarchy, ``hierarchy-ID:controllers:path``
(proc(5)): cgroup v2 has the single line ``0::<path>``; v1 has one line per controller
(``4:memory:<path>``, ``1:name=systemd:<path>``), and a hybrid host has both. The path is
relative to the reader's cgroup namespace root, so an agent in its own cgroup namespace sees
``/../../kubepods.slice/...``: only the path's components are matched, wherever they are. Every
line that names a pod must name the same one; lines that name none (``/``, ``/system.slice/...``)
are ignored.

**The kubelet's names** (kubernetes ``pkg/kubelet/cm``: ``cgroup_manager_linux.go``
``CgroupName.ToSystemd`` / ``ToCgroupfs`` and ``escapeSystemdCgroupName``;
``pod_container_manager_linux.go`` ``podCgroupNamePrefix = "pod"``;
``qos_container_manager_linux.go``: Burstable and BestEffort pods under ``kubepods/burstable`` and
``kubepods/besteffort``, Guaranteed ones directly under ``kubepods``;
https://github.com/kubernetes/kubernetes/blob/master/pkg/kubelet/cm/cgroup_manager_linux.go).
The abstract name ``{kubepods, burstable, pod<uid>}`` becomes, with

- the **systemd** cgroup driver, one slice per level whose name joins every level with ``-``
  after each level's own ``-`` were turned into ``_``:
  ``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid with _>.slice``
  (``kubepods-besteffort-pod…``; Guaranteed ``kubepods-pod…``; a kubelet ``--cgroup-root``
  prefixes every name: ``custom-kubepods-pod…``). The container runtime adds a scope for the
  container: containerd ``cri-containerd-<id>.scope`` (its CRI plugin asks runc for
  ``<slice>:cri-containerd:<id>``, and runc's systemd driver names the unit
  ``<prefix>-<name>.scope``), CRI-O ``crio-<id>.scope``, cri-dockerd ``docker-<id>.scope``;
- the **cgroupfs** driver, the levels as directories: ``/kubepods/burstable/pod<uid>/<id>``
  (``/kubepods/besteffort/pod<uid>/…``; Guaranteed ``/kubepods/pod<uid>/…``).

Only those shapes count: a ``pod<uid>`` directory right below ``kubepods`` (or its QoS level), or
a ``…kubepods[-burstable|-besteffort]-pod<uid>.slice`` component; the UID must look like one (a
UUID, or the 32 hex digits of a static pod's hash).

**The cache.** The answer for a PID is kept per (PID, start time): the start time is field 22 of
``/proc/<pid>/stat`` (clock ticks since boot), read on every call, so a PID the kernel gave to a
new process is looked up again rather than taken for the old one's; the stat file is read again
after the cgroup file, and a start time that changed in between answers None. At most
``max_entries`` answers are kept (the least recently used go first). A PID whose files cannot be
read (the process ended, the PID is not visible, a file is larger than a real one can be) is None,
logged at debug; nothing here raises.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import threading
from pathlib import Path

from agent.logs import fields_

MAX_CGROUP_BYTES = 64 * 1024
"""A real cgroup file is a few hundred bytes (v1: one line per controller); a larger one is not
read any further and names no pod."""
MAX_STAT_BYTES = 4096
"""``/proc/<pid>/stat`` is a few hundred bytes (the command name is at most 64)."""
CACHE_ENTRIES = 4096
STARTTIME_FIELD = 22
"""``/proc/<pid>/stat``: the process's start time after boot, in clock ticks (proc(5))."""

_UID = re.compile(
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32}", re.IGNORECASE
)
_SYSTEMD_POD = re.compile(r"(?:.+-)?kubepods(?:-burstable|-besteffort)?-pod([0-9a-fA-F_]+)\.slice")
_CGROUPFS_POD = re.compile(r"pod([0-9a-fA-F-]+)")
QOS_LEVELS = ("burstable", "besteffort")


def _uid(raw: str) -> str | None:
    return raw if _UID.fullmatch(raw) else None


def pod_in_path(path: str) -> str | None:
    """The pod UID a cgroup path names, in either driver's shape (module docstring); else None.
    Pure."""
    parts = [p for p in path.split("/") if p not in ("", ".", "..")]
    for i, part in enumerate(parts):
        m = _SYSTEMD_POD.fullmatch(part)
        if m is not None:
            return _uid(m.group(1).replace("_", "-"))
        if part != "kubepods":
            continue
        rest = parts[i + 1 :]
        if rest and rest[0] in QOS_LEVELS:
            rest = rest[1:]
        m = _CGROUPFS_POD.fullmatch(rest[0]) if rest else None
        if m is not None:
            return _uid(m.group(1))
    return None


def pod_uid(cgroup: str) -> str | None:
    """The pod UID named by the contents of a ``/proc/<pid>/cgroup`` file (v1, v2 or hybrid);
    None when no line names one or lines name different ones. Pure."""
    found: set[str] = set()
    for line in cgroup.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3 or not fields[0].isdigit():
            continue
        uid = pod_in_path(fields[2].strip())
        if uid is not None:
            found.add(uid)
    return found.pop() if len(found) == 1 else None


def start_time(stat: str) -> int:
    """The start time (field 22) of a ``/proc/<pid>/stat`` line. The command name (field 2) is in
    parentheses and may hold spaces and parentheses itself, so fields are counted after the last
    ``)``. Raises ValueError when the line has no such field. Pure."""
    close = stat.rfind(")")
    if close < 0:
        raise ValueError("no command name in the stat line")
    after = stat[close + 1 :].split()  # fields 3, 4, ...
    index = STARTTIME_FIELD - 3
    if len(after) <= index:
        raise ValueError(f"the stat line has {len(after) + 2} fields, not {STARTTIME_FIELD}")
    value = int(after[index])
    if value < 0:
        raise ValueError(f"negative start time {value}")
    return value


def _read(path: Path, limit: int) -> str:
    """The file's text, at most ``limit`` bytes of it; ValueError when it is larger. Opened
    non-blocking: something that is not a regular file (a FIFO) cannot stall the sampler."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1) or b""  # None: a non-blocking read found nothing yet
    if len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    return data.decode("utf-8", errors="replace")


class ProcessPods:
    """``pods(pid) -> pod uid | None`` for the processes under ``proc_root`` (module docstring).
    Thread-safe."""

    def __init__(
        self,
        proc_root: Path,
        *,
        log: logging.Logger | None = None,
        max_entries: int = CACHE_ENTRIES,
    ) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.proc_root = Path(proc_root)
        self.max_entries = max_entries
        self._log = log or logging.getLogger(__name__)
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[int, int], str | None] = (
            collections.OrderedDict()
        )

    def __call__(self, pid: int) -> str | None:
        if pid <= 0:
            return None
        where = self.proc_root / str(pid)
        try:
            started = start_time(_read(where / "stat", MAX_STAT_BYTES))
        except (OSError, ValueError) as exc:
            self._unreadable(pid, "stat", exc)
            return None
        key = (pid, started)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            cgroup = _read(where / "cgroup", MAX_CGROUP_BYTES)
            again = start_time(_read(where / "stat", MAX_STAT_BYTES))
        except (OSError, ValueError) as exc:
            self._unreadable(pid, "cgroup", exc)
            return None
        if again != started:  # the PID went to another process while we read
            self._log.debug(
                "a process ended while its cgroup was read; not attributed",
                extra=fields_(pid=pid),
            )
            return None
        pod = pod_uid(cgroup)
        with self._lock:
            self._cache[key] = pod
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return pod

    def cached(self) -> int:
        """How many answers are kept."""
        with self._lock:
            return len(self._cache)

    def _unreadable(self, pid: int, what: str, exc: Exception) -> None:
        error = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        self._log.debug(
            "cannot read a GPU process's pod; not attributed",
            extra=fields_(pid=pid, file=what, error=error),
        )
