"""The simulated MPS control daemon (``nvidia-cuda-mps-control -d`` / ``-f``).

In its pipe directory (``CUDA_MPS_PIPE_DIRECTORY``, default ``/tmp/nvidia-mps``) it keeps, as
the real one does:

* ``control``: the UNIX socket clients connect to (left behind at exit, as the real one leaves
  it: a client then finds nobody listening);
* ``control_lock``: held with ``flock`` while the daemon lives, so a second daemon on the same
  directory is refused, and one that was killed leaves no lock behind;
* ``nvidia-cuda-mps-control.pid``: its PID, removed when it exits.

It logs to ``control.log`` in ``CUDA_MPS_LOG_DIRECTORY`` (default ``/var/log/nvidia-mps``) in the
real format (``[2024-04-23 06:04:59.389 Control    72] Cmd:...``), and records itself in the
simulator's sharing state (:mod:`agent.sim.sharing`): pid, directories, the devices of its
``CUDA_VISIBLE_DEVICES`` and the defaults its clients set. It warns in its log about a served GPU
whose compute mode is not Exclusive_Process (NVIDIA's MPS documentation sets it first).

``-d`` double-forks (a new session, reparented away from the caller, standard streams on
``/dev/null``); the starting process returns once the daemon serves, or fails with the reason.
SIGTERM and SIGINT end it cleanly, as ``quit`` does. The client protocol is the simulator's own:
a command line in, the reply text and a NUL byte out.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import selectors
import signal
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from agent.fsutil import atomic_write
from agent.sim.nvml import FakeNvml
from agent.sim.sharing import (
    COMPUTE_MODE_EXCLUSIVE_PROCESS,
    MpsDaemon,
    compute_mode_name,
    start_ticks,
)
from agent.sim.tools.common import ToolError
from agent.sim.tools.mps_commands import execute
from agent.sim.tools.mps_paths import EXIT_FAILURE, LOCK, LOG_FILE, REPLY_END, Paths
from agent.sim.tools.targets import Target, visible_devices

ALREADY_RUNNING = "An instance of this daemon is already running"
READY_TIMEOUT = 30.0
"""Hang guard: how long ``-d`` waits for the daemon it forked to report."""


class ControlLog:
    """``control.log``, one line per event, in the real daemon's format."""

    def __init__(self, path: Path, pid: int) -> None:
        self._file = path.open("a", encoding="utf-8")
        self._pid = pid
        self._lock = threading.Lock()

    def write(self, message: str) -> None:
        now = time.time()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        millis = int(now % 1 * 1000)
        with self._lock:
            for line in message.splitlines() or [""]:
                self._file.write(f"[{stamp}.{millis:03d} Control {self._pid:>5}] {line}\n")
            self._file.flush()

    def close(self) -> None:
        self._file.close()


# -- starting -------------------------------------------------------------------------------


def _lock(paths: Paths) -> int:
    """Create the directories and take the pipe directory's lock; its descriptor (the lock lives
    as long as any process holds it open). ToolError when another daemon holds it."""
    try:
        paths.pipe_dir.mkdir(parents=True, exist_ok=True)
        paths.log_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(paths.pipe_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise ToolError(f"Cannot prepare the MPS directories: {exc}", EXIT_FAILURE) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ToolError(ALREADY_RUNNING, EXIT_FAILURE) from None
    return fd


def _warnings(fake: FakeNvml, devices: list[Target]) -> list[str]:
    """The compute mode of each served whole GPU (MIG devices have none of their own)."""
    out = []
    for t in devices:
        if t.mig:
            continue
        try:
            mode = fake.nvmlDeviceGetComputeMode(fake.nvmlDeviceGetHandleByIndex(t.index))
        except fake.NVMLError as exc:
            out.append(f"WARNING: cannot read the compute mode of GPU {t.uuid}: {exc}")
            continue
        if mode != COMPUTE_MODE_EXCLUSIVE_PROCESS:
            out.append(
                f"WARNING: GPU {t.uuid} ({t.bus_id}) is in compute mode {compute_mode_name(mode)};"
                " MPS expects Exclusive_Process (nvidia-smi -i <GPU> -c EXCLUSIVE_PROCESS)"
            )
    return out


def start(fake: FakeNvml, env: Mapping[str, str], *, foreground: bool) -> int:
    """``-d`` (``foreground`` False) or ``-f``: the exit status of this process."""
    paths = Paths.from_env(env)
    lock_fd = _lock(paths)
    devices, warnings = visible_devices(fake, env.get("CUDA_VISIBLE_DEVICES"))
    warnings += _warnings(fake, devices)
    if foreground:
        return _serve(fake, paths, lock_fd, devices, warnings, ready=None)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the first child: a new session, then the daemon in a second child
        os.close(read_end)
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
        _become_daemon()
        status = 1
        try:
            status = _serve(fake, paths, lock_fd, devices, warnings, ready=write_end)
        finally:
            os._exit(status)  # never return into the caller's code (nor run its atexit hooks)
    os.close(write_end)
    os.close(lock_fd)  # the daemon holds the lock now
    os.waitpid(child, 0)
    report = _read_report(read_end)
    if report == "ok":
        return 0
    raise ToolError(report or "The MPS control daemon did not start", EXIT_FAILURE)


def _become_daemon() -> None:
    os.chdir("/")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def _read_report(fd: int) -> str:
    """What the daemon wrote on the readiness pipe before closing it (bounded wait)."""
    data = b""
    deadline = time.monotonic() + READY_TIMEOUT
    with contextlib.closing(os.fdopen(fd, "rb", buffering=0)) as pipe:
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([pipe], [], [], left)
            if not ready:
                break
            chunk = pipe.read(4096)
            if not chunk:
                break
            data += chunk
    return data.decode(errors="replace").strip()


# -- serving --------------------------------------------------------------------------------


class _Daemon:
    """The serving daemon's state: its record, log and the way to stop it."""

    def __init__(self, fake: FakeNvml, record: MpsDaemon, log: ControlLog) -> None:
        self.fake = fake
        self.record = record
        self.log = log
        self._lock = threading.Lock()
        self.stop_r, self.stop_w = os.pipe()
        os.set_blocking(self.stop_w, False)  # signal.set_wakeup_fd needs it

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self.stop_w, b"x")

    def command(self, line: str) -> tuple[str, bool]:
        with self._lock:
            outcome = execute(self.record, line)
            if outcome.daemon != self.record:
                self.record = outcome.daemon
                self.fake.record_mps_daemon(self.record)
        return outcome.reply, outcome.quit

    def client(self, conn: socket.socket) -> None:
        """Serve one client connection: command lines in, replies out, until it closes."""
        self.log.write("Accepting connection...")
        self.log.write("NEW UI")
        quit_now = False
        with conn, conn.makefile("rb") as lines:
            for raw in lines:
                line = raw.decode(errors="replace").strip()
                if not line:
                    continue
                self.log.write(f"Cmd:{line}")
                reply, quit_now = self.command(line)
                if reply:
                    self.log.write(reply)
                with contextlib.suppress(OSError):
                    conn.sendall(reply.encode() + REPLY_END)
                if quit_now:
                    break
        self.log.write("UI closed")
        if quit_now:
            self.stop()


def _listen(paths: Paths) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with contextlib.suppress(FileNotFoundError):
            paths.control.unlink()  # a dead daemon's socket: we hold the lock
        listener.bind(str(paths.control))
        os.chmod(paths.control, 0o666)
        listener.listen(16)
    except OSError:
        listener.close()
        raise
    return listener


@contextlib.contextmanager
def _signals_wake(fd: int) -> Iterator[None]:
    """SIGTERM and SIGINT write to ``fd`` (so the selector wakes) instead of killing us."""
    signal.set_wakeup_fd(fd, warn_on_full_buffer=False)
    handlers = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        signal.set_wakeup_fd(-1)
        for sig, old in handlers.items():
            signal.signal(sig, old)


def _report(ready: int | None, text: str) -> None:
    """Tell the process that started us (``-d``) how the start went, once."""
    if ready is not None:
        with contextlib.suppress(OSError):
            os.write(ready, text.encode())
        os.close(ready)


def _serve(
    fake: FakeNvml,
    paths: Paths,
    lock_fd: int,
    devices: list[Target],
    warnings: list[str],
    ready: int | None,
) -> int:
    pid = os.getpid()
    try:
        log = ControlLog(paths.log_dir / LOG_FILE, pid)
        listener = _listen(paths)
        atomic_write(paths.pid_file, f"{pid}\n".encode(), mode=0o644)
    except OSError as exc:
        _report(ready, f"Cannot start the MPS control daemon: {exc}")
        return EXIT_FAILURE
    record = MpsDaemon(
        pid=pid,
        start_ticks=start_ticks(pid) or 0,
        pipe_dir=str(paths.pipe_dir),
        log_dir=str(paths.log_dir),
        devices=tuple(t.uuid for t in devices),
    )
    daemon = _Daemon(fake, record, log)
    try:
        fake.record_mps_daemon(record)
        log.write(f"Starting control daemon using socket {paths.control}")
        log.write(
            "To connect CUDA applications to this daemon, set env"
            f" CUDA_MPS_PIPE_DIRECTORY={paths.pipe_dir}"
        )
        for warning in warnings:
            log.write(warning)
        with _signals_wake(daemon.stop_w), selectors.DefaultSelector() as sel:
            sel.register(listener, selectors.EVENT_READ)
            sel.register(daemon.stop_r, selectors.EVENT_READ)
            _report(ready, "ok")
            ready = None
            while not any(key.fd == daemon.stop_r for key, _ in sel.select()):
                conn, _ = listener.accept()
                threading.Thread(target=daemon.client, args=(conn,), daemon=True).start()
    except Exception as exc:
        _report(ready, f"Cannot start the MPS control daemon: {exc}")
        raise
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            if paths.pid_file.read_text().strip() == str(pid):
                paths.pid_file.unlink()
        fake.forget_mps_daemon(pid, record.pipe_dir)
        log.write("Exit")
        log.close()
        os.close(lock_fd)
    return 0
