"""The simulated ``nvidia-cuda-mps-control``.

::

    nvidia-cuda-mps-control -d        start the control daemon in the background
    nvidia-cuda-mps-control -f        run it in the foreground
    nvidia-cuda-mps-control           client: one command per line on standard input

(see :mod:`agent.sim.tools.mps_daemon` and :mod:`agent.sim.tools.mps_commands`). Both modes use
``CUDA_MPS_PIPE_DIRECTORY`` (default ``/tmp/nvidia-mps``); the daemon also
``CUDA_MPS_LOG_DIRECTORY`` and ``CUDA_VISIBLE_DEVICES``. As the real tool does, it prints its
two failures on standard output and exits 1: ``An instance of this daemon is already running``
(a second daemon on one pipe directory) and ``Cannot find MPS control daemon process`` (a client
with no daemon). The client prints each reply and exits 0.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TextIO

from agent.sim.tools.common import ToolError, require_state_dir
from agent.sim.tools.mps_paths import EXIT_FAILURE, REPLY_END, Paths

TOOL = "nvidia-cuda-mps-control"
NO_DAEMON = "Cannot find MPS control daemon process"
CLIENT_TIMEOUT = 60.0
"""Hang guard on one reply."""
USAGE = """\
Usage: nvidia-cuda-mps-control [-d | -f]    (simulated by Tessera)
    -d    Start the control daemon in the background.
    -f    Run the control daemon in the foreground.
    With no option, read commands from standard input and send them to the control daemon of
    CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps).
"""


def _reply(conn: socket.socket, buffer: bytearray) -> str:
    """Read up to the end of one reply; ToolError when the daemon goes away first."""
    while REPLY_END not in buffer:
        chunk = conn.recv(65536)
        if not chunk:
            raise ToolError("The MPS control daemon closed the connection", EXIT_FAILURE)
        buffer += chunk
    end = buffer.index(REPLY_END)
    text = buffer[:end].decode(errors="replace")
    del buffer[: end + 1]
    return text


def client(paths: Paths, commands: TextIO, out: TextIO) -> int:
    """Send each line of ``commands`` to the daemon and print its replies."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(CLIENT_TIMEOUT)
    with conn:
        try:
            conn.connect(str(paths.control))
        except (FileNotFoundError, ConnectionRefusedError):
            raise ToolError(NO_DAEMON, EXIT_FAILURE) from None
        except OSError as exc:
            raise ToolError(f"{NO_DAEMON} ({exc})", EXIT_FAILURE) from exc
        buffer = bytearray()
        for raw in iter(commands.readline, ""):
            line = raw.strip()
            if not line:
                continue
            conn.sendall(line.encode() + b"\n")
            reply = _reply(conn, buffer)
            if reply:
                out.write(reply if reply.endswith("\n") else reply + "\n")
                out.flush()
            if line.split()[0] == "quit":
                break
    return 0


def main(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    state_dir: str,
    model: str,
    stdin: TextIO = sys.stdin,
    out: TextIO = sys.stdout,
) -> int:
    """Run ``nvidia-cuda-mps-control argv`` for the simulated node in ``state_dir``."""
    try:
        if list(argv) in (["-h"], ["--help"]):
            out.write(USAGE)
            return 0
        if list(argv) in (["-d"], ["-f"]):
            # the simulator only for the daemon: a client starts without loading it
            from agent.sim.tools.mps_daemon import start
            from agent.sim.tools.simulator import open_simulator

            fake = open_simulator(Path(state_dir), model, TOOL, EXIT_FAILURE)
            return start(fake, env, foreground=argv[0] == "-f")
        if argv:
            raise ToolError(
                f"Invalid option {' '.join(argv)!r}; this simulation knows -d, -f and no option"
                " (client)",
                EXIT_FAILURE,
            )
        require_state_dir(Path(state_dir), TOOL, EXIT_FAILURE)
        return client(Paths.from_env(env), stdin, out)
    except ToolError as exc:
        out.write(exc.message + "\n")
        out.flush()
        return exc.code
