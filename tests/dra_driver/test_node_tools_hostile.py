"""What a hostile node broke in running tools and reading MPS files (issue 23, item 10): a
hanging tool's children outlived its deadline (only the direct child was killed, and a child
holding the output pipes kept the call waiting for it); a FIFO as a daemon's pid file (the pipe
directory is mounted into the claim's containers) blocked the agent."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import psutil
import pytest

from dra_driver.errors import ToolError
from dra_driver.sharing.mps import PID_FILE, MpsControl
from dra_driver.sharing.node_tools import Tools

GRANDCHILD = """\
import os, subprocess, sys, time
holds_pipes = sys.argv[2] == "holds"
out = None if holds_pipes else subprocess.DEVNULL
child = subprocess.Popen(["sleep", "120"], stdout=out, stderr=out)
with open(sys.argv[1], "w") as f:
    f.write(str(child.pid))
print("started a child", flush=True)
time.sleep(120)
"""


def hanging_tool(tmp_path: Path) -> Path:
    """A tool that starts a child of its own, writes the child's PID and hangs."""
    script = tmp_path / "tool.py"
    script.write_text(GRANDCHILD)
    return script


def wait_pid(path: Path) -> int:
    return int(path.read_text())


def dead(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("holds", ["holds", "detached"])
@pytest.mark.timeout(60)  # before the fix, a child holding the pipes kept run() for 120 s
def test_a_hanging_tool_is_killed_with_its_children_at_its_own_deadline(
    tmp_path: Path, holds: str
) -> None:
    tools = Tools(nvidia_smi=Path("/bin/false"), mps_control=Path("/bin/false"), timeout_s=1.0)
    pid_file = tmp_path / "child.pid"
    argv = [sys.executable, str(hanging_tool(tmp_path)), str(pid_file), holds]
    with pytest.raises(ToolError) as info:
        tools.run(argv, env={"PATH": os.environ["PATH"]})
    # the tool's own failure, with what it printed before it hung
    assert "no answer within 1 s" in str(info.value)
    assert "started a child" in str(info.value)
    grandchild = wait_pid(pid_file)
    psutil.wait_procs([psutil.Process(grandchild)], timeout=10) if not dead(grandchild) else None
    assert dead(grandchild), "the tool's child outlived the tool's deadline"


def test_a_tool_that_answers_in_time_is_not_touched(tmp_path: Path) -> None:
    tools = Tools(nvidia_smi=Path("/bin/false"), mps_control=Path("/bin/false"))
    result = tools.run([sys.executable, "-c", "print('ok')"], env={"PATH": os.environ["PATH"]})
    assert (result.code, result.output) == (0, "ok\n")


@pytest.mark.timeout(60)
def test_a_fifo_or_a_link_as_a_daemon_pid_file_is_no_daemon(tmp_path: Path) -> None:
    """The pipe directory is the claim's containers' too: what is there may be anything."""
    control = MpsControl(
        Tools(nvidia_smi=Path("/bin/false"), mps_control=Path("/bin/false")),
        tmp_path,
        logging.getLogger("test"),
    )
    fifo_pipe = tmp_path / "uid-fifo" / "pipe"
    fifo_pipe.mkdir(parents=True)
    os.mkfifo(fifo_pipe / PID_FILE)
    assert control.found("uid-fifo") is None
    link_pipe = tmp_path / "uid-link" / "pipe"
    link_pipe.mkdir(parents=True)
    (link_pipe / PID_FILE).symlink_to("/dev/zero")
    assert control.found("uid-link") is None
    real = tmp_path / "uid-real" / "pipe"
    real.mkdir(parents=True)
    (real / PID_FILE).write_text(f"{os.getpid()}\n")
    assert control.found("uid-real") is None  # this process is alive but no MPS daemon
