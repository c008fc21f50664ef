"""Running the node's NVIDIA tools: a deadline on every run, arguments that are never a shell.

The tools are looked up under the driver root (``<driver-root>/usr/bin/nvidia-smi``) unless
given explicitly (``--nvidia-smi``, ``--mps-control``). Only validated values reach an argument
list (UUIDs, small integers, words from a fixed set); nothing is run through a shell, so no claim
content can become a command. A run that fails, times out or cannot start raises ``ToolError``
naming the command, its exit status and the first line of what it printed.

Each tool runs in a session (so a process group) of its own: at its deadline the whole group is
killed, the children it started too, and the error is the tool's own ("no answer within N s"),
raised at the tool's deadline, not when the kubelet's call gives up.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dra_driver.errors import ToolError

UUID_RE = re.compile(r"(GPU|MIG)-[0-9a-fA-F-]{8,64}")
"""A GPU or MIG device UUID: all that is ever put on a tool's command line about a device."""
TOOL_DIRS = ("usr/bin", "usr/sbin", "bin")
DEFAULT_TIMEOUT_S = 20.0


def check_uuid(uuid: str) -> str:
    """``uuid`` when it is a device UUID, else ToolError (nothing else goes to a tool)."""
    if not UUID_RE.fullmatch(uuid):
        raise ToolError(f"{uuid[:80]!r} is not a GPU or MIG device UUID")
    return uuid


def find_tool(name: str, driver_root: Path, explicit: Path | None) -> Path:
    """Where ``name`` is: ``explicit`` if given, else under the driver root's bin directories
    (the path may not exist: running it then fails with a clear ToolError)."""
    if explicit is not None:
        return explicit
    for d in TOOL_DIRS:
        candidate = driver_root / d / name
        if candidate.is_file():
            return candidate
    return driver_root / TOOL_DIRS[0] / name


@dataclass(frozen=True)
class ToolResult:
    code: int
    output: str
    """Standard output and standard error together (the tools mix them)."""


@dataclass(frozen=True)
class Tools:
    """The node's sharing tools and how to run them."""

    nvidia_smi: Path
    mps_control: Path
    env: Mapping[str, str] = field(default_factory=dict)
    """The environment of every run (PATH, LD_LIBRARY_PATH to the driver's libraries)."""
    timeout_s: float = DEFAULT_TIMEOUT_S

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        check: bool = True,
    ) -> ToolResult:
        """Run ``argv`` (no shell) with a deadline; ToolError when it cannot run, times out, or
        (``check``) exits non-zero."""
        command = " ".join(argv)
        deadline = timeout_s or self.timeout_s
        try:
            # a session (and so a process group) of its own: at the deadline the whole group is
            # killed, the tool's children too (subprocess.run kills only the direct child, and
            # leaves a child that hangs, say the tool's helper, running)
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={**self.env, **(env or {})},
                text=True,
                close_fds=True,
                start_new_session=True,
            )
        except OSError as exc:
            raise ToolError(
                f"{command}: cannot run it: {exc.strerror or exc}", command=command
            ) from exc
        try:
            stdout, stderr = proc.communicate(stdin, timeout=deadline)
        except subprocess.TimeoutExpired:
            said = _kill_group(proc)
            first = next((line for line in said.splitlines() if line.strip()), "")
            printed = f" (it printed: {first.strip()[:300]})" if first else ""
            raise ToolError(
                f"{command}: no answer within {deadline:g} s; killed it and its children{printed}",
                command=command,
            ) from None
        done = subprocess.CompletedProcess(list(argv), proc.returncode, stdout, stderr)
        output = (done.stdout or "") + (done.stderr or "")
        if check and done.returncode != 0:
            first = next((line for line in output.splitlines() if line.strip()), "no output")
            raise ToolError(
                f"{command}: exit status {done.returncode}: {first.strip()[:300]}",
                command=command,
                code=done.returncode,
            )
        return ToolResult(done.returncode, output)


KILL_WAIT_S = 5.0
"""How long a killed tool's output is waited for: a child that left the tool's session (a
daemon's ``setsid``) may still hold the pipes, and is not waited for longer."""


def _kill_group(proc: subprocess.Popen[str]) -> str:
    """Kill ``proc``'s whole process group (its session's, started by ``run``), reap it and
    return what it printed before."""
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        stdout, stderr = proc.communicate(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:  # pipes held by a process outside the group
        proc.kill()
        proc.wait()
        return ""
    return (stdout or "") + (stderr or "")


def tool_env(driver_root: Path) -> dict[str, str]:
    """The environment the tools run in: a plain PATH and, for a driver root other than ``/``,
    its library directories first on LD_LIBRARY_PATH (the tools load libnvidia-ml.so.1)."""
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    if driver_root.resolve() != Path("/"):
        libs = [str(driver_root / d) for d in ("usr/lib/x86_64-linux-gnu", "usr/lib64", "usr/lib")]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    return env
