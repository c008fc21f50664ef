"""The simulated /proc of GPU processes in pods: what it holds, that it follows the processes, and
``tessera sim process``. The agent's own parser reads it, as it reads a real node's."""

from __future__ import annotations

import io
import json

import pytest

from agent.cli import main
from agent.errors import ConfigError
from agent.sim.model import load_model
from agent.sim.nvml import FakeNvml
from agent.sim.procfs import CLK_TCK, cgroup_line, stat_line
from agent.sim.telemetry_state import STATE_FILE, telemetry_from_json
from agent.telemetry.owners import ProcessPods, pod_uid, start_time
from tests.fakeclock import FakeClock

GIB = 1024**3
POD_A = "5f1c9b7e-3a2d-4e8f-9c0b-1d2e3f4a5b6c"
POD_B = "0b9e7a3c-5d0e-4c7a-9b1e-2f6d8c4a1e01"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def fake(make_fake, clock) -> FakeNvml:
    return make_fake("dgx-h100", clock=clock)


def test_a_process_in_a_pod_gets_a_cgroup_and_stat_like_a_kubernetes_nodes(fake, clock):
    fake.add_process(0, 4242, GIB, sm_utilization=0.3, pod_uid=POD_A)
    d = fake.proc_root / "4242"
    cgroup = (d / "cgroup").read_text()
    assert cgroup.startswith("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod")
    assert POD_A.replace("-", "_") in cgroup and "/cri-containerd-" in cgroup
    assert cgroup.endswith(".scope\n") and cgroup.count("\n") == 1
    stat = (d / "stat").read_text()
    assert stat.split()[:3] == ["4242", "(python3)", "S"] and len(stat.split()) == 52
    assert start_time(stat) == int(clock.t * CLK_TCK)
    assert pod_uid(cgroup) == POD_A  # the agent's parser reads it
    assert ProcessPods(fake.proc_root)(4242) == POD_A


def test_the_tree_follows_the_processes(fake, make_fake, tmp_path):
    fake.add_process(0, 10, GIB, pod_uid=POD_A)
    fake.add_process(1, 11, GIB, pod_uid=POD_B)
    fake.add_process(2, 12, GIB)  # not in a pod: no entry, as for a PID the agent cannot see
    assert sorted(p.name for p in fake.proc_root.iterdir()) == ["10", "11"]
    fake.remove_process(0, 10)
    assert sorted(p.name for p in fake.proc_root.iterdir()) == ["11"]
    other = make_fake("dgx-h100", directory=fake.state_dir)  # another process on the same node
    other.reload_driver()  # processes end
    assert list(fake.proc_root.iterdir()) == []
    assert ProcessPods(fake.proc_root)(11) is None


def test_a_reused_pid_is_a_new_process_with_a_later_start(fake):
    fake.add_process(0, 77, GIB, pod_uid=POD_A)
    first = start_time((fake.proc_root / "77" / "stat").read_text())
    fake.add_process(1, 77, GIB, pod_uid=POD_A)  # the same process on a second GPU
    assert start_time((fake.proc_root / "77" / "stat").read_text()) == first
    pods = ProcessPods(fake.proc_root)
    assert pods(77) == POD_A
    fake.remove_process(0, 77)
    fake.remove_process(1, 77)
    fake.add_process(0, 77, GIB, pod_uid=POD_B)  # same clock tick, another pod: a new process
    assert start_time((fake.proc_root / "77" / "stat").read_text()) > first
    assert pods(77) == POD_B


def test_pod_uids_and_pids_are_checked(fake):
    with pytest.raises(ConfigError, match="not a pod UID"):
        fake.add_process(0, 1, GIB, pod_uid="../../etc")
    with pytest.raises(ConfigError, match="not a pod UID"):
        fake.add_process(0, 1, GIB, pod_uid=POD_A.upper())
    with pytest.raises(ConfigError, match="positive"):
        fake.add_process(0, 0, GIB)
    assert not (fake.proc_root / "1").exists()


def test_the_state_keeps_pod_and_start_and_reads_files_without_them(fake, make_fake):
    fake.add_process(0, 5, GIB, pod_uid=POD_A)
    path = fake.state_dir / STATE_FILE
    raw = json.loads(path.read_text())
    (proc,) = raw["gpus"][0]["processes"]
    assert (proc["podUID"], proc["startTime"]) == (POD_A, 100_000)
    del proc["podUID"], proc["startTime"]  # a file of an earlier build
    (p,) = telemetry_from_json(raw).gpus[0].processes
    assert (p.pid, p.pod_uid, p.start_time) == (5, None, 0)


def test_pure_lines():
    assert cgroup_line(POD_A, 1) == cgroup_line(POD_A, 1) != cgroup_line(POD_A, 2)
    assert start_time(stat_line(9, 123)) == 123


# -- tessera sim process ----------------------------------------------------------------------


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main(list(argv), environ={}, out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


def test_sim_process_start_and_stop_reach_the_running_simulator(tmp_path, clock):
    fake = FakeNvml(load_model("dgx-h100"), tmp_path / "agent" / "sim", clock=clock)
    fake.nvmlInit()
    d = ["sim", "process", "--state-dir", str(tmp_path / "agent")]
    rc, out, err = run_cli(*d, "start", "--gpu", "3", "--pod-uid", POD_A, "--sm-utilization",
                           "0.4", "--memory-mib", "2048")  # fmt: skip
    assert (rc, err) == (0, "")
    assert out == f"process 10000 started on GPU 3 in pod {POD_A}: 2048 MiB, SM utilization 0.4\n"
    h = fake.nvmlDeviceGetHandleByIndex(3)
    (p,) = fake.nvmlDeviceGetComputeRunningProcesses(h)
    assert (p.pid, p.usedGpuMemory) == (10000, 2 * GIB)
    assert ProcessPods(fake.proc_root)(10000) == POD_A
    rc, out, _ = run_cli(*d, "start", "--gpu", "3", "--pid", "31")
    assert rc == 0 and out == "process 31 started on GPU 3: 512 MiB, SM utilization none\n"
    rc, out, _ = run_cli(*d, "stop", "--gpu", "3", "--pid", "10000")
    assert (rc, out) == (0, "process 10000 on GPU 3 ended\n")
    assert [p.pid for p in fake.nvmlDeviceGetComputeRunningProcesses(h)] == [31]
    assert not (fake.proc_root / "10000").exists()


def test_sim_process_errors_are_one_line(tmp_path, clock):
    FakeNvml(load_model("dgx-h100"), tmp_path / "sim", clock=clock)
    d = ["sim", "process", "--state-dir", str(tmp_path)]
    for args, words in [
        (["start", "--gpu", "0", "--pod-uid", "nope"], "not a pod UID"),
        (["start", "--gpu", "0", "--sm-utilization", "2"], "--sm-utilization"),
        (["stop", "--gpu", "0", "--pid", "5"], "runs no process 5"),
        (["start", "--gpu", "0", "--gi", "1"], "not in MIG mode"),
    ]:
        rc, out, err = run_cli(*d, *args)
        assert (rc, out) == (2, ""), args
        assert words in err and err.count("\n") == 1, err
