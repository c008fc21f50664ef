"""MPS control daemons: one per claim that shares its devices through MPS.

A daemon is started with ``nvidia-cuda-mps-control -d`` in its own directories under
``<state-dir>/mps/<claim UID>/``: ``pipe`` (``CUDA_MPS_PIPE_DIRECTORY``: the control socket and
``nvidia-cuda-mps-control.pid``), ``log`` (``CUDA_MPS_LOG_DIRECTORY``) and ``shm`` (the shared
memory its server and clients use). ``CUDA_VISIBLE_DEVICES`` names the devices by UUID (GPU or
MIG), as NVIDIA recommends. The claim's containers get the pipe and shm directories mounted and
``CUDA_MPS_PIPE_DIRECTORY`` set (the CDI spec). Facts and sources: docs/gpu-facts.md, "Sharing
tools".

- Start: the daemon is up once a client command answers (``get_default_active_thread_percentage``),
  polled until ``ready_timeout_s``; a daemon that never answers is stopped and the prepare fails
  with a clear error. Then the defaults are applied: ``set_default_active_thread_percentage`` and
  ``set_default_device_pinned_mem_limit <uuid> <N>M`` per device (servers started afterwards get
  them: no server exists yet).
- Identity: the PID from the pid file and the process's start time (``psutil``) are recorded in
  the checkpoint, so after an agent restart the same daemon is found again (adopted), never a
  process that reused the PID.
- Stop: ``quit``, then wait for the process to end (bounded); one that does not is terminated,
  then killed. The directories are removed.
- Private shared memory: with ``private_shm`` (real nodes, the agent running as root), the daemon
  is started in a mount namespace of its own where ``shm`` is bind-mounted on ``/dev/shm``, so its
  server and the claim's containers (which get the same directory at ``/dev/shm``) share it and
  nothing else. The simulator's stand-in needs no shared memory.
- Where it runs: the launcher (:mod:`dra_driver.sharing.mps_launch`) starts it, tells whether the
  same one still runs, signals it and lists what it keeps: a local process (standalone mode) or a
  Pod per claim (kube mode, ``dra_driver.cluster.mps_pods``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from agent.fsutil import ensure_dir, read_regular_file
from agent.logs import fields_
from dra_driver.errors import SharingError, ToolError
from dra_driver.sharing.mps_launch import LocalLauncher, MpsLauncher
from dra_driver.sharing.node_tools import Tools, check_uuid

PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL_SOCKET = "control"
"""The UNIX socket the control daemon listens on in its pipe directory."""
MAX_SOCKET_PATH = 107  # sockaddr_un.sun_path holds 108 bytes with the terminating NUL
MIB = 1024 * 1024
MAX_PID_FILE_BYTES = 64
KEY_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


@dataclass(frozen=True)
class MpsSettings:
    """What a claim's daemon applies to the servers it starts."""

    devices: tuple[str, ...]
    """UUIDs (GPU or MIG) the daemon serves (CUDA_VISIBLE_DEVICES)."""
    active_thread_percentage: int | None = None
    pinned_memory_limits: Mapping[str, int] | None = None
    """Bytes per device UUID (rounded down to MiB for the tool; at least 1 MiB)."""


@dataclass(frozen=True)
class MpsDaemon:
    """A running control daemon, as recorded in the checkpoint."""

    key: str
    """The claim UID it belongs to (its directory's name)."""
    pid: int
    started_at: float
    """The process's start time (psutil), which a PID reused by another process will not have."""
    pipe_dir: str
    log_dir: str
    shm_dir: str
    devices: tuple[str, ...]


class MpsControl:
    """Starts, finds and stops MPS control daemons (see the module docstring)."""

    def __init__(
        self,
        tools: Tools,
        root: Path,
        log: logging.Logger,
        *,
        private_shm: bool = False,
        ready_timeout_s: float = 10.0,
        stop_timeout_s: float = 10.0,
        poll_s: float = 0.05,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        launcher: MpsLauncher | None = None,
    ) -> None:
        """``launcher``: where daemons run (None: local processes, see ``private_shm``)."""
        self.tools = tools
        self.launcher = launcher or LocalLauncher(tools, private_shm=private_shm)
        self.root = root
        self.log = log
        self.private_shm = private_shm
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._poll = poll_s
        self._sleep = sleep
        self._clock = clock

    # -- directories -------------------------------------------------------------------------
    def directory(self, key: str) -> Path:
        if not KEY_RE.fullmatch(key):
            raise SharingError(f"MPS daemon key {key[:80]!r} is not a claim UID")
        return self.root / key

    def socket_path_problem(self, key: str) -> str | None:
        """Why the daemon of claim ``key`` could not listen under this root, or None.

        The daemon's control socket is ``<root>/<key>/pipe/control``; a UNIX socket path may
        hold at most 107 bytes, and the daemon fails to start with "AF_UNIX path too long"
        beyond that. Checked before anything is started so the error names the fix."""
        path = self.directory(key) / "pipe" / CONTROL_SOCKET
        size = len(os.fsencode(path))
        if size <= MAX_SOCKET_PATH:
            return None
        fits = len(os.fsencode(self.root)) - (size - MAX_SOCKET_PATH)
        return (
            f"the MPS control socket {path} would be {size} bytes long; a unix socket path may"
            f" be at most {MAX_SOCKET_PATH} bytes: set --mps-root (TESSERA_MPS_ROOT) to a"
            f" directory at most {fits} bytes long"
        )

    def _env(
        self, pipe: Path, log_dir: Path, devices: tuple[str, ...] | None = None
    ) -> dict[str, str]:
        env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(log_dir)}
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(check_uuid(d) for d in devices)
        return env

    # -- commands ----------------------------------------------------------------------------
    def command(self, d: MpsDaemon, line: str, timeout_s: float | None = None) -> str:
        """Send one command to the daemon (``echo line | nvidia-cuda-mps-control``); its reply."""
        env = self._env(Path(d.pipe_dir), Path(d.log_dir))
        result = self.tools.run(
            [str(self.tools.mps_control)], stdin=line + "\n", env=env, timeout_s=timeout_s
        )
        return result.output.strip()

    def _answers(self, d: MpsDaemon) -> bool:
        try:
            self.command(d, "get_default_active_thread_percentage", timeout_s=self._poll * 40)
        except ToolError:
            return False
        return True

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, key: str, settings: MpsSettings) -> MpsDaemon:
        """Start the claim's daemon, wait until it answers, apply the settings. Raises
        SharingError (the daemon is stopped again) or ToolError."""
        base = self.directory(key)
        problem = self.socket_path_problem(key)
        if problem is not None:
            raise SharingError(problem)
        pipe, log_dir, shm = base / "pipe", base / "log", base / "shm"
        for d, mode in ((base, 0o755), (pipe, 0o755), (log_dir, 0o750), (shm, 0o1777)):
            ensure_dir(d, mode)
        (pipe / PID_FILE).unlink(missing_ok=True)  # a stale one would name another process
        env = self._env(pipe, log_dir, settings.devices)
        self.launcher.launch(key, env, shm)
        pid = self._wait_for_pid(pipe / PID_FILE)
        daemon = MpsDaemon(
            key=key,
            pid=pid,
            started_at=self.launcher.started_at(key, pid) or 0.0,
            pipe_dir=str(pipe),
            log_dir=str(log_dir),
            shm_dir=str(shm),
            devices=settings.devices,
        )
        try:
            self._wait_ready(daemon)
            self._apply(daemon, settings)
        except SharingError:
            self.stop(daemon)
            raise
        self.log.info(
            "MPS control daemon started",
            extra=fields_(claim_uid=key, pid=pid, devices=",".join(settings.devices)),
        )
        return daemon

    def _wait_for_pid(self, pid_file: Path) -> int:
        deadline = self._clock() + self.ready_timeout_s
        while True:
            try:
                text = _read_pid_file(pid_file)
            except OSError:
                text = ""
            if text.isdigit():
                return int(text)
            if self._clock() > deadline:
                where = self.launcher.describe(pid_file.parent.parent.name)
                raise SharingError(
                    f"MPS control daemon wrote no PID to {pid_file} within"
                    f" {self.ready_timeout_s:g} s{f' ({where})' if where else ''}",
                    "mps_not_ready",
                )
            self._sleep(self._poll)

    def _wait_ready(self, d: MpsDaemon) -> None:
        deadline = self._clock() + self.ready_timeout_s
        while not self._answers(d):
            if self._clock() > deadline or not self.alive(d):
                raise SharingError(
                    f"MPS control daemon {d.pid} for claim {d.key} did not answer within"
                    f" {self.ready_timeout_s:g} s (log: {d.log_dir}/control.log)",
                    "mps_not_ready",
                )
            self._sleep(self._poll)

    def _apply(self, d: MpsDaemon, s: MpsSettings) -> None:
        if s.active_thread_percentage is not None:
            p = int(s.active_thread_percentage)
            if not 1 <= p <= 100:
                raise SharingError(f"active thread percentage {p} is not 1..100")
            self.command(d, f"set_default_active_thread_percentage {p}")
        for uuid, limit in (s.pinned_memory_limits or {}).items():
            mib = max(1, int(limit) // MIB)
            self.command(d, f"set_default_device_pinned_mem_limit {check_uuid(uuid)} {mib}M")

    def alive(self, d: MpsDaemon) -> bool:
        """Whether the recorded daemon still runs (same PID and same start time)."""
        started = self.launcher.started_at(d.key, d.pid)
        return started is not None and abs(started - d.started_at) < 1.0

    def stop(self, d: MpsDaemon) -> None:
        """Stop the daemon (``quit``, then signals) and remove its directories (and its Pod).
        Idempotent: a daemon already gone only has its directories removed (logged once, when
        stopped)."""
        if not self.alive(d):
            self.remove(d.key)
            return
        try:
            self.command(d, "quit", timeout_s=self.stop_timeout_s / 2)
            quit_taken = True
        except ToolError as exc:  # a daemon that does not answer: no use waiting for it
            quit_taken = False
            self.log.warning(
                "MPS control daemon did not take quit; signalling it",
                extra=fields_(claim_uid=d.key, pid=d.pid, error=str(exc)),
            )
        if not (quit_taken and self._gone(d, self.stop_timeout_s)):
            for force in (False, True):
                self.launcher.kill(d.key, d.pid, force=force)
                if self._gone(d, self.stop_timeout_s / 2):
                    break
        self.remove(d.key)
        self.log.info("MPS control daemon stopped", extra=fields_(claim_uid=d.key, pid=d.pid))

    def remove(self, key: str) -> None:
        """Remove a daemon's directories and what its launcher keeps (after it stopped, or what
        a crash left)."""
        self.launcher.forget(key)
        shutil.rmtree(self.directory(key), ignore_errors=True)

    def _gone(self, d: MpsDaemon, timeout_s: float) -> bool:
        deadline = self._clock() + timeout_s
        while self.alive(d):
            if self._clock() > deadline:
                return False
            self._sleep(self._poll)
        return True

    # -- start-up ----------------------------------------------------------------------------
    def keys_on_disk(self) -> set[str]:
        """The claim UIDs that have a daemon directory or something its launcher keeps (a Pod),
        running or left by a crash."""
        try:
            dirs = {p.name for p in self.root.iterdir() if p.is_dir() and KEY_RE.fullmatch(p.name)}
        except FileNotFoundError:
            dirs = set()
        return dirs | {k for k in self.launcher.claim_keys() if KEY_RE.fullmatch(k)}

    def found(self, key: str) -> MpsDaemon | None:
        """The daemon of a directory that no record names (a crash between start and commit):
        from its pid file, if that process still runs."""
        base = self.directory(key)
        try:
            pid = int(_read_pid_file(base / "pipe" / PID_FILE))
        except (OSError, ValueError):
            return None
        started = self.launcher.found_at(key, pid)
        if started is None:
            return None  # gone, or the PID now belongs to another program
        return MpsDaemon(
            key, pid, started, str(base / "pipe"), str(base / "log"), str(base / "shm"), ()
        )


def _read_pid_file(path: Path) -> str:
    """The text of a daemon's pid file, stripped. The pipe directory is mounted into the claim's
    containers, so what is there may be anything: read as a small regular file only (a FIFO or
    a link put there must not hang or bloat the agent). Raises OSError."""
    return read_regular_file(path, MAX_PID_FILE_BYTES).decode(errors="replace").strip()
