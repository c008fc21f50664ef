"""Which pod runs a GPU process: cgroup parsing (both drivers, both cgroup versions), the
per-(PID, start time) cache, and unreadable or hostile files."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from agent.telemetry.owners import (
    MAX_CGROUP_BYTES,
    ProcessPods,
    pod_in_path,
    pod_uid,
    start_time,
)

UID = "5f1c9b7e-3a2d-4e8f-9c0b-1d2e3f4a5b6c"
SYSTEMD = UID.replace("-", "_")
OTHER = "0b9e7a3c-5d0e-4c7a-9b1e-2f6d8c4a1e01"
CID = "4f3c2b1a" * 8


def stat_line(pid: int, start: int, comm: str = "python3") -> str:
    """A /proc/<pid>/stat line with 52 fields: start time is field 22."""
    fields = [str(pid), f"({comm})", "S", *["0"] * 18, str(start), *["0"] * 30]
    return " ".join(fields) + "\n"


@pytest.mark.parametrize(
    "cgroup",
    [
        # cgroup v2, systemd driver: containerd, CRI-O, cri-dockerd; every QoS class
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD}.slice/"
        f"cri-containerd-{CID}.scope\n",
        f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{SYSTEMD}.slice/"
        f"crio-{CID}.scope\n",
        f"0::/kubepods.slice/kubepods-pod{SYSTEMD}.slice/docker-{CID}.scope\n",
        # cgroup v2 seen from the agent's own cgroup namespace
        f"0::/../../kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD}.slice/"
        f"cri-containerd-{CID}.scope\n",
        # a kubelet --cgroup-root prefixes every slice name
        f"0::/custom.slice/custom-kubepods.slice/custom-kubepods-pod{SYSTEMD}.slice/"
        f"cri-containerd-{CID}.scope\n",
        # cgroup v2, cgroupfs driver
        f"0::/kubepods/burstable/pod{UID}/{CID}\n",
        f"0::/kubepods/besteffort/pod{UID}/{CID}\n",
        f"0::/kubepods/pod{UID}/{CID}\n",
        # cgroup v1 (one line per controller), systemd and cgroupfs drivers
        "".join(
            f"{n}:{c}:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD}"
            f".slice/cri-containerd-{CID}.scope\n"
            for n, c in [(12, "memory"), (11, "cpu,cpuacct"), (4, "devices"), (1, "name=systemd")]
        ),
        "".join(
            f"{n}:{c}:/kubepods/besteffort/pod{UID}/{CID}\n"
            for n, c in [(9, "pids"), (8, "memory"), (2, "cpuset"), (1, "name=systemd")]
        ),
        # v1 with a controller left at the root, and a hybrid host's v2 line
        f"5:rdma:/\n4:memory:/kubepods/pod{UID}/{CID}\n0::/\n",
        # the pod's own cgroup, not a container's
        f"0::/kubepods.slice/kubepods-pod{SYSTEMD}.slice\n",
    ],
    ids=[
        "v2-systemd-containerd-burstable", "v2-systemd-crio-besteffort",
        "v2-systemd-docker-guaranteed", "v2-systemd-cgroup-namespace", "v2-systemd-cgroup-root",
        "v2-cgroupfs-burstable", "v2-cgroupfs-besteffort", "v2-cgroupfs-guaranteed",
        "v1-systemd", "v1-cgroupfs", "v1-root-controller-and-hybrid", "pod-cgroup",
    ],
)  # fmt: skip
def test_the_pod_is_found_in_every_driver_and_cgroup_version(cgroup):
    assert pod_uid(cgroup) == UID


def test_a_static_pods_hash_is_a_uid():
    static = "6c2b4f0e8d1a3b5c7e9f0a1b2c3d4e5f"
    assert pod_uid(f"0::/kubepods/burstable/pod{static}/{CID}\n") == static


@pytest.mark.parametrize(
    "cgroup",
    [
        "",
        "0::/\n",
        "0::/system.slice/containerd.service\n",
        "0::/user.slice/user-1000.slice/session-3.scope\n",
        "0::/init.scope\n",
        f"0::/system.slice/docker-{CID}.scope\n",  # a container outside Kubernetes
        f"0::/somewhere/pod{UID}/{CID}\n",  # pod<uid> not below kubepods
        f"0::/kubepods/guaranteed/pod{UID}/{CID}\n",  # no such QoS level
        f"0::/kubepods/burstable/{CID}/pod{UID}\n",  # too deep
        f"0::/kubepods.slice/kubepods-burstable-pod{UID}\n",  # not a slice
        "0::/kubepods.slice/kubepods-burstable-podnot_a_uid.slice\n",
        f"0::/kubepods/pod{UID[:-1]}/{CID}\n",  # one digit short
        f"0::/kubepods/pod{UID}zz/{CID}\n",
        f"kubepods/pod{UID}\n",  # not a cgroup line
        f"x:memory:/kubepods/pod{UID}/{CID}\n",
        "\x00\xff garbage \n::::\n" * 50,
        # two lines naming different pods: no answer is better than a wrong one
        f"4:memory:/kubepods/pod{UID}/{CID}\n3:cpu:/kubepods/pod{OTHER}/{CID}\n",
    ],
)
def test_paths_that_name_no_pod_or_several_answer_none(cgroup):
    assert pod_uid(cgroup) is None


def test_path_components_not_substrings_are_matched():
    assert pod_in_path(f"/kubepods/burstable/pod{UID}/{CID}") == UID
    assert pod_in_path(f"/notkubepods/pod{UID}") is None
    assert pod_in_path(f"/kubepods-extra/pod{UID}") is None


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (stat_line(42, 123456), 123456),
        (stat_line(42, 7, comm="a b) c (d"), 7),  # spaces and parentheses in the name
        (stat_line(42, 0, comm=""), 0),
    ],
)
def test_start_time_is_field_22_counted_after_the_command_name(line, expected):
    assert start_time(line) == expected


@pytest.mark.parametrize(
    "line",
    ["", "42 python3 S 1", "42 (python3) S 1 2 3", "42 (x) " + "z " * 30, "42 (x" + " 1" * 30],
)
def test_a_malformed_stat_line_raises_value_error(line):
    with pytest.raises(ValueError):
        start_time(line)


# -- ProcessPods: files under a proc root ----------------------------------------------------------


def put(root: Path, pid: int, start: int, cgroup: str | bytes) -> None:
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "stat").write_text(stat_line(pid, start))
    raw = cgroup.encode() if isinstance(cgroup, str) else cgroup
    (d / "cgroup").write_bytes(raw)


def v2(uid: str) -> str:
    return (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
        f"{uid.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n"
    )


def test_a_pid_maps_to_its_pod_and_is_cached_per_start_time(tmp_path):
    put(tmp_path, 100, 5000, v2(UID))
    pods = ProcessPods(tmp_path)
    assert pods(100) == UID
    (tmp_path / "100" / "cgroup").unlink()  # a cached answer needs only the stat file
    assert pods(100) == UID
    assert pods.cached() == 1


def test_a_reused_pid_with_another_start_time_is_looked_up_again(tmp_path):
    put(tmp_path, 100, 5000, v2(UID))
    pods = ProcessPods(tmp_path)
    assert pods(100) == UID
    put(tmp_path, 100, 9000, v2(OTHER))  # the process ended; the kernel gave 100 to a new one
    assert pods(100) == OTHER
    put(tmp_path, 100, 9500, "0::/system.slice/sshd.service\n")  # and now a host process
    assert pods(100) is None


def test_a_process_that_is_no_pods_is_cached_as_none(tmp_path):
    put(tmp_path, 7, 10, "0::/system.slice/nvidia-persistenced.service\n")
    pods = ProcessPods(tmp_path)
    assert pods(7) is None
    (tmp_path / "7" / "cgroup").write_text(v2(UID))  # same process: the answer stands
    assert pods(7) is None


def test_the_cache_is_bounded_least_recently_used_first(tmp_path):
    for pid in range(1, 6):
        put(tmp_path, pid, pid * 10, v2(UID))
    pods = ProcessPods(tmp_path, max_entries=3)
    for pid in (1, 2, 3, 1, 4, 5):  # 1 is used again: 2 and 3 are the least recent
        assert pods(pid) == UID
    assert pods.cached() == 3
    for pid in range(1, 6):
        (tmp_path / str(pid) / "cgroup").write_text(v2(OTHER))
    assert [pods(pid) for pid in (1, 4, 5)] == [UID, UID, UID]  # still cached
    assert pods(2) == OTHER  # evicted: read again
    assert pods.cached() == 3


def test_missing_and_unreadable_files_answer_none_and_log_at_debug_only(tmp_path, caplog):
    put(tmp_path, 1, 10, v2(UID))
    (tmp_path / "2").mkdir()  # no files at all
    (tmp_path / "3").mkdir()
    (tmp_path / "3" / "stat").write_text(stat_line(3, 10))  # stat but no cgroup
    (tmp_path / "4").mkdir()
    (tmp_path / "4" / "stat").write_text("garbage")
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "stat").mkdir()  # a directory where a file belongs
    put(tmp_path, 6, 10, v2(UID))
    (tmp_path / "6" / "cgroup").chmod(0)
    pods = ProcessPods(tmp_path, log=logging.getLogger("owners"))
    with caplog.at_level(logging.DEBUG, logger="owners"):
        got = {pid: pods(pid) for pid in (2, 3, 4, 5, 999, 0, -1)}
    assert got == dict.fromkeys(got)
    if os.geteuid() != 0:  # root reads a mode-0 file anyway
        assert pods(6) is None
    assert pods(1) == UID
    assert caplog.records and {r.levelno for r in caplog.records} == {logging.DEBUG}
    assert all("pid" in r.fields for r in caplog.records)  # type: ignore[attr-defined]
    assert ProcessPods(tmp_path / "no-such-root")(1) is None


def test_a_huge_cgroup_file_is_not_read_past_the_limit(tmp_path):
    line = f"0::/kubepods/pod{UID}/{CID}\n"
    put(tmp_path, 1, 10, line + "x" * (MAX_CGROUP_BYTES * 16))
    put(tmp_path, 2, 10, line + "y" * (MAX_CGROUP_BYTES - len(line)))  # at the limit: fine
    pods = ProcessPods(tmp_path)
    assert pods(1) is None
    assert pods(2) == UID


def test_a_fifo_instead_of_a_file_does_not_block(tmp_path):
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "stat").write_text(stat_line(1, 10))
    os.mkfifo(tmp_path / "1" / "cgroup")  # no writer: a blocking open would wait forever
    assert ProcessPods(tmp_path)(1) is None


def test_undecodable_bytes_do_not_hide_a_good_line(tmp_path):
    put(tmp_path, 1, 10, b"\xff\xfe\n" + v2(UID).encode())
    assert ProcessPods(tmp_path)(1) == UID
