"""Where a claim's MPS control daemon runs: the launcher :class:`~dra_driver.sharing.mps.MpsControl`
starts, identifies and stops it through.

:class:`MpsLauncher` is the one interface; two implementations, chosen in the composition root
(agent/daemon/wiring.py ``sharing_effects``):

* :class:`LocalLauncher` (standalone mode): ``nvidia-cuda-mps-control -d`` run by the agent; the
  daemon double-forks into a session of its own but stays in the agent's PID namespace (and, in
  a container, its cgroup): a container restart kills it.
* ``dra_driver.cluster.mps_pods.PodLauncher`` (kube mode): a Pod per claim pinned to the node,
  which outlives the agent's container (docs/architecture.md, "MPS in kube mode").

Everything else about a daemon (its directories, waiting until it answers, its settings,
``quit``) is the same either way and stays in ``MpsControl``: it talks to the daemon through its
pipe directory, which is on the host in both cases.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import psutil

from dra_driver.sharing.node_tools import Tools


class MpsLauncher(Protocol):
    """Starts a claim's control daemon and tells whether the same one still runs."""

    def launch(self, key: str, env: Mapping[str, str], shm: Path) -> None:
        """Start claim ``key``'s daemon with ``env`` (its pipe, log and device variables) and
        ``shm`` as its /dev/shm where shared memory is private. Returns once it is started (it
        writes its PID file when up); raises SharingError or ToolError."""

    def started_at(self, key: str, pid: int) -> float | None:
        """The identity of what runs as claim ``key``'s daemon (recorded ``pid``) now: a time
        that a replacement would not have; None when nothing runs."""

    def found_at(self, key: str, pid: int) -> float | None:
        """As :meth:`started_at`, for a daemon no record names (found by its PID file): only
        when ``pid`` is sure to be a control daemon's."""

    def kill(self, key: str, pid: int, *, force: bool) -> None:
        """Stop a daemon that did not take ``quit`` (``force``: at once)."""

    def forget(self, key: str) -> None:
        """Remove what the launcher keeps for claim ``key`` (after its daemon stopped)."""

    def claim_keys(self) -> set[str]:
        """The claims the launcher keeps something for (running or not)."""

    def describe(self, key: str) -> str:
        """Where claim ``key``'s daemon runs and how it is, for an error ("" when nothing
        more than its directories can be said)."""


class LocalLauncher:
    """The daemon as the agent's own process (``-d``); see the module."""

    def __init__(self, tools: Tools, *, private_shm: bool) -> None:
        """``private_shm``: run it in a mount namespace of its own with ``shm`` on /dev/shm
        (real nodes; the simulator's stand-in needs no shared memory)."""
        self.tools = tools
        self.private_shm = private_shm

    def launch(self, key: str, env: Mapping[str, str], shm: Path) -> None:
        self.tools.run(self._argv(shm), env=env)

    def _argv(self, shm: Path) -> list[str]:
        mps = str(self.tools.mps_control)
        if not self.private_shm:
            return [mps, "-d"]
        # a mount namespace of its own with the claim's directory as /dev/shm; the paths are
        # positional parameters of the script, never part of it
        return [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            "/bin/sh",
            "-c",
            'mount --bind "$1" /dev/shm && exec "$2" -d',
            "tessera-mps",
            str(shm),
            mps,
        ]

    def started_at(self, key: str, pid: int) -> float | None:
        """The process's start time (psutil); None when there is no such process or it has
        exited (a zombie, which a daemon reparented to an init that does not reap stays)."""
        try:
            proc = psutil.Process(pid)
            if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                return None
            return float(proc.create_time())
        except psutil.Error:
            return None

    def found_at(self, key: str, pid: int) -> float | None:
        """As :meth:`started_at`, when ``pid`` runs nvidia-cuda-mps-control (else the PID now
        belongs to another program)."""
        try:
            if not any("nvidia-cuda-mps-control" in p for p in psutil.Process(pid).cmdline()):
                return None
        except psutil.Error:
            return None
        return self.started_at(key, pid)

    def kill(self, key: str, pid: int, *, force: bool) -> None:
        with contextlib.suppress(psutil.Error):  # gone already
            psutil.Process(pid).send_signal(signal.SIGKILL if force else signal.SIGTERM)

    def forget(self, key: str) -> None:
        """Nothing: a local daemon leaves only its directories."""

    def claim_keys(self) -> set[str]:
        return set()

    def describe(self, key: str) -> str:
        return ""
