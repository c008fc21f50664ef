"""The simulated nvidia-cuda-mps-control, run as the installed executable: the daemon's life,
its client, its commands and what it records in the simulated state."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.sim.sharing import live_daemons
from tests.sim.tools_helpers import (
    TIMEOUT,
    NodeFactory,
    SimNode,
    clean_env,
    exited,
    run,
    session_members,
    wait_for,
)

ALREADY = "An instance of this daemon is already running\n"
NO_DAEMON = "Cannot find MPS control daemon process\n"


class Mps:
    """One pipe/log directory pair and the daemons started on it (killed if a test fails)."""

    def __init__(self, node: SimNode, base: Path, name: str) -> None:
        self.node = node
        self.pipe = base / name / "pipe"
        self.log = base / name / "log"
        self.started: list[int] = []

    def env(self, **extra: str) -> dict[str, str]:
        return clean_env(
            CUDA_MPS_PIPE_DIRECTORY=str(self.pipe), CUDA_MPS_LOG_DIRECTORY=str(self.log), **extra
        )

    def start(self, **extra: str) -> int:
        result = run(self.node.mps_control, "-d", env=self.env(**extra))
        assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
        pid = self.pid()
        assert pid is not None
        self.started.append(pid)
        return pid

    def pid(self) -> int | None:
        try:
            return int((self.pipe / "nvidia-cuda-mps-control.pid").read_text())
        except FileNotFoundError:
            return None

    def send(self, *commands: str) -> subprocess.CompletedProcess[str]:
        text = "".join(c + "\n" for c in commands)
        return run(self.node.mps_control, env=self.env(), stdin=text)

    def ask(self, command: str) -> str:
        result = self.send(command)
        assert (result.returncode, result.stderr) == (0, ""), result
        return result.stdout

    def quit(self) -> None:
        """``echo quit | nvidia-cuda-mps-control``, then wait for the daemon to be gone."""
        pid = self.pid()
        assert pid is not None
        assert self.ask("quit") == ""
        wait_for(lambda: exited(pid), "the daemon to exit")

    def control_log(self) -> str:
        return (self.log / "control.log").read_text()

    def record(self) -> object:
        (daemon,) = [
            d for d in self.node.fake.sharing_state.mps_daemons if d.pipe_dir == str(self.pipe)
        ]
        return daemon

    def kill_leftovers(self) -> None:
        for pid in self.started:
            if not exited(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def node(sim_nodes: NodeFactory) -> SimNode:
    return sim_nodes("dgx-h100")


@pytest.fixture
def mps_dirs(node: SimNode, short_tmp: Path) -> Iterator[Callable[..., Mps]]:
    made: list[Mps] = []

    def make(name: str = "a", on: SimNode | None = None) -> Mps:
        mps = Mps(on or node, short_tmp, name)
        made.append(mps)
        return mps

    yield make
    for mps in made:
        mps.kill_leftovers()


def uuids(node: SimNode, *indices: int) -> list[str]:
    return [node.fake.model.gpus[i].uuid for i in indices]


def test_the_daemon_lifecycle(node: SimNode, mps_dirs):
    mps = mps_dirs()
    gpu2, gpu5 = uuids(node, 2, 5)
    pid = mps.start(CUDA_VISIBLE_DEVICES=f"{gpu2},{gpu5}")
    # a daemon: its own session, not a child of ours, in the directories of its environment
    assert os.getsid(pid) != os.getsid(0) and not exited(pid)
    assert stat.S_ISSOCK((mps.pipe / "control").stat().st_mode)
    log = mps.control_log()
    assert f"Control {pid:>5}] Starting control daemon using socket {mps.pipe}/control\n" in log
    assert f"set env CUDA_MPS_PIPE_DIRECTORY={mps.pipe}\n" in log
    record = mps.record()
    assert (record.pid, record.devices, record.log_dir) == (pid, (gpu2, gpu5), str(mps.log))
    assert live_daemons(node.fake.sharing_state) == [record]

    second = run(node.mps_control, "-d", env=mps.env())
    assert (second.returncode, second.stdout) == (1, ALREADY)
    assert mps.pid() == pid

    assert mps.ask("get_server_list") == ""
    assert mps.ask("get_default_active_thread_percentage") == "100.0\n"
    assert mps.ask("set_default_active_thread_percentage 25") == "25.0\n"
    assert mps.ask("get_default_active_thread_percentage") == "25.0\n"
    assert mps.ask("set_default_device_pinned_mem_limit 0 2G") == ""
    assert mps.ask(f"set_default_device_pinned_mem_limit {gpu5} 512M") == ""
    assert mps.ask("get_default_device_pinned_mem_limit 0") == "2G\n"
    assert mps.ask("get_default_device_pinned_mem_limit 1") == "512M\n"
    record = mps.record()
    assert record.active_thread_percentage == 25.0
    assert dict(record.pinned_mem_limits) == {gpu2: 2048, gpu5: 512}
    assert "Cmd:set_default_active_thread_percentage 25\n" in mps.control_log()

    sid = os.getsid(pid)
    assert mps.ask("quit") == ""
    wait_for(lambda: exited(pid), "the daemon to exit")
    assert mps.pid() is None  # the pid file goes, the socket stays (as the real one leaves it)
    assert (mps.pipe / "control").exists()
    assert session_members(sid) == []  # nothing of the daemon's is left running
    assert node.fake.sharing_state.mps_daemons == ()
    assert mps.control_log().endswith("Exit\n")
    assert mps.send("get_server_list").stdout == NO_DAEMON
    # and a new daemon on the same directory starts with the defaults again
    mps.start()
    assert mps.ask("get_default_active_thread_percentage") == "100.0\n"
    mps.quit()


def test_a_client_without_a_daemon(node: SimNode, mps_dirs):
    mps = mps_dirs()
    result = mps.send("get_server_list")
    assert (result.returncode, result.stdout) == (1, NO_DAEMON)
    assert not mps.pipe.exists()  # a client creates nothing


def test_sigterm_ends_the_daemon_cleanly(node: SimNode, mps_dirs):
    mps = mps_dirs()
    pid = mps.start()
    sid = os.getsid(pid)
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: exited(pid), "the daemon to exit")
    assert mps.pid() is None and session_members(sid) == []
    assert node.fake.sharing_state.mps_daemons == ()
    assert mps.control_log().endswith("Exit\n")
    assert mps.send("get_server_list").returncode == 1


def test_a_killed_daemon_leaves_nothing_that_stops_the_next_one(node: SimNode, mps_dirs):
    mps = mps_dirs()
    pid = mps.start()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: exited(pid), "the daemon to die")
    assert mps.pid() == pid  # stale files, a stale record
    assert live_daemons(node.fake.sharing_state) == []
    assert mps.send("get_server_list").stdout == NO_DAEMON
    new = mps.start()
    assert new != pid and mps.ask("get_server_list") == ""
    assert [d.pid for d in node.fake.sharing_state.mps_daemons] == [new]
    mps.quit()


def test_several_daemons_in_different_pipe_directories(node: SimNode, mps_dirs):
    first, second = mps_dirs("one"), mps_dirs("two")
    gpu0, gpu1 = uuids(node, 0, 1)
    pids = first.start(CUDA_VISIBLE_DEVICES="0"), second.start(CUDA_VISIBLE_DEVICES=gpu1)
    assert first.ask("set_default_active_thread_percentage 50") == "50.0\n"
    assert second.ask("get_default_active_thread_percentage") == "100.0\n"
    daemons = {d.pipe_dir: d for d in live_daemons(node.fake.sharing_state)}
    assert {k: (d.pid, d.devices) for k, d in daemons.items()} == {
        str(first.pipe): (pids[0], (gpu0,)),
        str(second.pipe): (pids[1], (gpu1,)),
    }
    first.quit()
    assert second.ask("get_default_active_thread_percentage") == "100.0\n"
    assert [d.pid for d in live_daemons(node.fake.sharing_state)] == [pids[1]]
    second.quit()


def test_the_compute_mode_warning(node: SimNode, mps_dirs):
    ready, not_ready = uuids(node, 3, 4)
    assert run(node.smi, "-i", ready, "-c", "EXCLUSIVE_PROCESS").returncode == 0
    mps = mps_dirs()
    mps.start(CUDA_VISIBLE_DEVICES=f"{ready},{not_ready}")
    log = mps.control_log()
    assert f"WARNING: GPU {not_ready} " in log and "compute mode Default" in log
    assert ready not in log.replace(f"WARNING: GPU {not_ready}", "").split("WARNING")[-1]
    assert log.count("WARNING") == 1
    mps.quit()


def test_mig_devices_and_cuda_visible_devices_forms(sim_nodes: NodeFactory, mps_dirs):
    a100 = sim_nodes("dgx-a100")
    fake = a100.fake
    mig = fake.nvmlDeviceGetUUID(
        fake.nvmlDeviceGetMigDeviceHandleByIndex(fake.nvmlDeviceGetHandleByIndex(6), 1)
    )
    mps = mps_dirs("mig", on=a100)
    mps.start(CUDA_VISIBLE_DEVICES=mig[:12])  # a unique prefix, as CUDA accepts
    assert mps.record().devices == (mig,)
    assert "WARNING" not in mps.control_log()  # a MIG device has no compute mode to check
    assert mps.ask(f"set_default_device_pinned_mem_limit {mig} 4G") == ""
    assert mps.ask("get_default_device_pinned_mem_limit 0") == "4G\n"
    reply = mps.ask("get_default_device_pinned_mem_limit 1")
    assert "Invalid device '1'" in reply and f"0={mig}" in reply
    mps.quit()

    other = mps_dirs("bad", on=a100)
    other.start(CUDA_VISIBLE_DEVICES="GPU-nope,0")
    assert other.record().devices == ()
    assert "entry 'GPU-nope' matches no device" in other.control_log()
    other.quit()


def test_the_interactive_form(node: SimNode, mps_dirs):
    mps = mps_dirs()
    pid = mps.start()
    with subprocess.Popen(
        [str(node.mps_control)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=mps.env(),
    ) as client:
        assert client.stdin and client.stdout
        client.stdin.write("set_default_active_thread_percentage 12.5\n")
        client.stdin.flush()
        assert client.stdout.readline() == "12.5\n"  # answered before the next line is typed
        client.stdin.write("get_default_active_thread_percentage\nquit\n")
        client.stdin.flush()
        assert client.stdout.readline() == "12.5\n"
        assert client.wait(TIMEOUT) == 0
    wait_for(lambda: exited(pid), "the daemon to exit")


@pytest.mark.parametrize(
    ("command", "reply"),
    [
        ("set_default_active_thread_percentage 0", "Invalid percentage '0'"),
        ("set_default_active_thread_percentage 101", "Invalid percentage '101'"),
        ("set_default_active_thread_percentage lots", "Invalid percentage 'lots'"),
        ("set_default_device_pinned_mem_limit 0 2GB", "Invalid limit '2GB'"),
        ("set_default_device_pinned_mem_limit 0 1.5G", "Invalid limit '1.5G'"),
        ("set_default_device_pinned_mem_limit 7 1G", "Invalid device '7'"),
        ("set_default_device_pinned_mem_limit 0", "usage: set_default_device_pinned_mem_limit"),
        ("start_server -uid 0", "Unrecognized command 'start_server -uid 0'"),
    ],
)
def test_bad_commands_get_a_reply_and_change_nothing(node: SimNode, mps_dirs, command, reply):
    mps = mps_dirs()
    mps.start(CUDA_VISIBLE_DEVICES="0")
    before = mps.record()
    result = mps.send(command, "get_default_active_thread_percentage")
    assert result.returncode == 0
    first, second = result.stdout.splitlines()
    assert first.startswith(reply) and second == "100.0"
    assert mps.record() == before
    mps.quit()


def test_refuses_to_run_when_its_simulated_node_is_gone(node: SimNode, mps_dirs):
    mps = mps_dirs()
    shutil.rmtree(node.state_dir)
    for result in (run(node.mps_control, "-d", env=mps.env()), mps.send("get_server_list")):
        assert result.returncode == 1
        assert "simulated node it belongs to is gone" in result.stdout
        assert str(node.state_dir) in result.stdout
    assert not mps.pipe.exists() and not node.state_dir.exists()


def test_bad_options(node: SimNode):
    result = run(node.mps_control, "-x")
    assert result.returncode == 1 and "Invalid option '-x'" in result.stdout
    assert run(node.mps_control, "-h").returncode == 0
