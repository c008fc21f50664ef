"""The simulated node's ``/proc`` for its GPU processes that run in pods.

A simulated process with a pod (``SimProcess.pod_uid``) gets, under ``<sim dir>/proc/<pid>/``, what
Linux shows for a container's process on a Kubernetes node with the systemd cgroup driver,
cgroup v2 and containerd (proc(5); the kubelet's and containerd's naming, with its upstream
sources, is in the docstring of ``agent/telemetry/owners.py``, which reads it)::

    cgroup  0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid, - as _>.slice/
            cri-containerd-<64 hex>.scope
    stat    <pid> (<comm>) S <ppid> ... field 22: start time in clock ticks since boot ...

so the agent (``--proc-root`` pointed here, the default with ``--simulate``) finds the pod as it
would on a real node. A process without a pod has no directory (the agent then knows no pod for
it, as for a PID it cannot see). The tree follows the telemetry state: :func:`sync_proc` writes
the directories of the processes that have a pod and removes every other PID's, so a process
that ends (``remove_process``, a driver reload) disappears from it.

A process that holds a GPU's device node (``tessera sim fault hold-gpu``, a real process) gets
``fd/0``, ``comm`` and ``stat``, so a holder scan (``/proc/<pid>/fd``, as ``fuser`` does it)
finds it. Its ``fd/0`` links to the real process's own ``/proc/<pid>/fd/0``: a real ``/proc`` fd
link is a kernel "magic link" that ``stat`` follows to the open file whatever its name, and the
agent's scan (:func:`agent.pcihost.holders.holders`) matches by that ``stat``, so through it the
simulated link resolves to the simulated node the process holds while it lives, and to nothing
once it ended (before the next rewrite removes the directory). A plain link to
``/dev/nvidia<minor>`` resolved to nothing on a machine without NVIDIA GPUs: the holder was never
found.

``cgroup_line``, ``stat_line`` and ``container_id`` are pure; ``sync_proc`` does the I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from agent.sim.telemetry_state import SimProcess
from agent.sim.tree import remove, symlink, write_text, write_tree
from agent.sim.vmstate import Holder

CLK_TCK = 100
"""Clock ticks per second of ``stat``'s start time (``getconf CLK_TCK`` on Linux)."""
COMM = "python3"
STAT_FIELDS = 52
"""Fields of a ``/proc/<pid>/stat`` line on Linux 5.x and later."""


def container_id(pod_uid: str, pid: int) -> str:
    """A containerd container id (64 hex digits) for the process's container (pure)."""
    return hashlib.sha256(f"{pod_uid}/{pid}".encode()).hexdigest()


def cgroup_line(pod_uid: str, pid: int) -> str:
    """``/proc/<pid>/cgroup`` of a Burstable pod's container: cgroup v2, systemd driver,
    containerd (pure)."""
    pod_slice = f"kubepods-burstable-pod{pod_uid.replace('-', '_')}.slice"
    scope = f"cri-containerd-{container_id(pod_uid, pid)}.scope"
    return f"0::/kubepods.slice/kubepods-burstable.slice/{pod_slice}/{scope}\n"


def stat_line(pid: int, start_time: int, comm: str = COMM) -> str:
    """``/proc/<pid>/stat``: pid, (comm), state, ppid, pgrp, session, ..., starttime (field 22),
    the rest 0 (pure)."""
    fields = [str(pid), f"({comm})", "S", "1", str(pid), str(pid)]
    fields += ["0"] * (21 - len(fields))
    fields.append(str(start_time))
    fields += ["0"] * (STAT_FIELDS - len(fields))
    return " ".join(fields) + "\n"


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (a zombie, ended but not yet reaped, does
    not): the real ``/proc/<pid>/stat``'s state field."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def sync_proc(root: Path, processes: Iterable[SimProcess], held: Iterable[Holder] = ()) -> None:
    """Make ``root`` hold exactly the directories of ``processes`` that run in a pod, and of the
    live processes of ``held``: their ``fd/0`` (a link to the real process's, see the module
    docstring; what ``fuser`` reads), ``comm`` and ``stat``."""
    want = {p.pid: p for p in processes if p.pod_uid is not None}
    holders = {h.pid: f"/proc/{h.pid}/fd/0" for h in held if process_alive(h.pid)}

    def write(root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        for entry in root.iterdir():
            if entry.name.isdigit() and int(entry.name) not in want | holders.keys():
                remove(entry)
        for pid, node in sorted(holders.items()):
            if pid not in want:
                write_text(root / str(pid) / "comm", "sleep\n")
                write_text(root / str(pid) / "stat", stat_line(pid, 0, "sleep"))
            symlink(root / str(pid) / "fd" / "0", node)
        for pid, p in sorted(want.items()):
            assert p.pod_uid is not None
            # the cgroup first: a reader that sees the new start time sees the new cgroup too
            write_text(root / str(pid) / "cgroup", cgroup_line(p.pod_uid, pid))
            write_text(root / str(pid) / "stat", stat_line(pid, p.start_time))

    write_tree(root, "/proc", "proc tree", write)
