"""holders: processes with a device node open, found through /proc/<pid>/fd as fuser does.

Real processes (this one and a child) hold real files: a regular file stands in for a device
node (as in the simulator), and /dev/null, a character device, is matched by its device number
through another path to the same node."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from agent.pcihost.holders import Holder, holders

PROC = Path("/proc")


def test_a_child_holding_the_node_is_named(tmp_path: Path) -> None:
    node = tmp_path / "nvidia0"
    node.write_text("")
    other = tmp_path / "nvidia1"
    other.write_text("")
    script = f"import sys; f = open({str(node)!r}); print('open', flush=True); sys.stdin.read()"
    with subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdout is not None and child.stdin is not None
        try:
            assert child.stdout.readline() == "open\n"  # the child holds the node now
            comm = (PROC / str(child.pid) / "comm").read_text().strip()
            assert Holder(pid=child.pid, name=comm) in holders(PROC, [tmp_path / "absent", node])
            assert child.pid not in [h.pid for h in holders(PROC, [other])]
        finally:
            child.stdin.close()
            child.wait()
    assert child.pid not in [h.pid for h in holders(PROC, [node])]


def test_a_character_device_matches_by_device_number_under_another_name(tmp_path: Path) -> None:
    alias = tmp_path / "null-alias"
    alias.symlink_to("/dev/null")
    with open("/dev/null"):
        assert os.getpid() in [h.pid for h in holders(PROC, [alias])]
        assert os.getpid() not in [h.pid for h in holders(PROC, [alias], ignore={os.getpid()})]


def test_nothing_holds_what_does_not_exist(tmp_path: Path) -> None:
    assert holders(PROC, [tmp_path / "vfio" / "7"]) == []
