"""The doctor's host checks on real files: directories, host paths and their links, device
nodes, the container runtimes' CDI settings, the toolkit's hook and the state lock."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path, PurePosixPath

import pytest

from agent.doctor.host import (
    check_cdi_hook,
    check_kubelet_dirs,
    check_runtimes,
    check_state_dir,
    check_state_lock,
    writable_dir,
)
from agent.doctor.hostfs import holder_in, lock_holder, node_problem, resolve
from agent.doctor.runtime import read_containerd, read_crio
from agent.doctor.verdict import Verdict, exit_code, fail, ok, to_json, to_table, warn
from agent.statelock import LOCK_FILE

# -- verdicts --------------------------------------------------------------------------------


def test_warnings_and_skips_do_not_fail_only_failures_do():
    assert exit_code([ok("a", "x"), warn("b", "y", "z")]) == 0
    assert exit_code([ok("a", "x"), fail("b", "y", "z")]) == 1


def test_the_table_puts_the_fix_under_its_verdict_and_json_has_every_field():
    verdicts = [ok("driver", "fine"), fail("cdi-dir", "not writable", "mount it rw", subject="x")]
    table = to_table("node-1", verdicts).splitlines()
    i = next(n for n, line in enumerate(table) if line.startswith("FAIL  cdi-dir (x)"))
    assert table[i + 1].strip() == "fix: mount it rw"
    assert table[-1] == "some checks failed: 1 ok, 0 warn, 1 fail, 0 skip"
    import json

    data = json.loads(to_json("node-1", verdicts))
    assert data["ok"] is False and data["counts"]["fail"] == 1
    assert data["checks"][1] == {
        "check": "cdi-dir", "status": "fail", "detail": "not writable", "fix": "mount it rw",
        "subject": "x",
    }  # fmt: skip


# -- host paths --------------------------------------------------------------------------------


def test_host_links_are_followed_inside_the_host_root(tmp_path):
    (tmp_path / "run" / "cdi").mkdir(parents=True)
    (tmp_path / "var").mkdir()
    os.symlink("/run", tmp_path / "var" / "run")  # absolute: a host path, not this machine's
    assert resolve(tmp_path, "/var/run/cdi") == PurePosixPath("/run/cdi")
    os.symlink("../run/cdi", tmp_path / "var" / "cdi")
    assert resolve(tmp_path, "/var/cdi/spec.json") == PurePosixPath("/run/cdi/spec.json")
    assert resolve(tmp_path, "/not/there") == PurePosixPath("/not/there")
    os.symlink("/loop", tmp_path / "loop")
    assert resolve(tmp_path, "/loop/x").parts[-1] == "x"  # stops, no endless loop


def test_a_regular_file_is_a_device_node_only_in_the_simulator(tmp_path):
    node = tmp_path / "nvidia0"
    assert node_problem(node, major=195, minor=0, stand_in=False) == "missing"
    node.write_text("")
    assert node_problem(node, major=195, minor=0, stand_in=True) is None
    assert node_problem(node, major=195, minor=0, stand_in=False) == (
        "not a character device (a regular file)"
    )


def test_a_character_device_of_another_number_is_named():
    # /dev/null is 1:3 on Linux
    assert node_problem(Path("/dev/null"), major=1, minor=3, stand_in=False) is None
    assert node_problem(Path("/dev/null"), major=195, minor=0, stand_in=False) == (
        "is device 1:3, expected 195:0"
    )


# -- writable directories ------------------------------------------------------------------------


def test_a_file_in_place_of_a_directory_fails_with_the_flag_in_the_fix(tmp_path):
    (tmp_path / "cdi").write_text("")
    v = writable_dir("cdi-dir", tmp_path / "cdi", "--cdi-root")
    assert v.status == "fail" and "a file is in the way" in v.detail and "--cdi-root" in v.fix


def test_a_full_directory_fails_though_an_empty_file_still_fits(tmp_path, monkeypatch):
    """A full disk still takes an empty file (the write probe): the free space says it."""
    full = os.statvfs_result((4096, 4096, 1000, 0, 0, 1000, 100, 100, 0, 255))
    monkeypatch.setattr(os, "statvfs", lambda path: full)
    v = writable_dir("state-dir", tmp_path, "--state-dir")
    assert v.status == "fail"
    assert v.detail.startswith(f"{tmp_path}: No space left on device (0 bytes free")
    assert f"df -h {tmp_path}" in v.fix


def test_a_missing_directory_passes_when_the_agent_can_create_it(tmp_path):
    v = check_state_dir(tmp_path / "a" / "b")
    assert v.status == "ok" and "the agent creates it" in v.detail
    (tmp_path / "f").write_text("")
    v = check_state_dir(tmp_path / "f" / "state")
    assert v.status == "fail" and "is not a directory" in v.detail


def test_the_kubelet_registry_must_exist_the_plugins_dir_need_not(tmp_path):
    registry, plugins = check_kubelet_dirs(tmp_path / "plugins_registry", tmp_path / "plugins")
    assert registry.status == "fail" and registry.subject == "registry"
    assert "--kubelet-registry-dir" in registry.fix
    assert plugins.status == "ok"
    (tmp_path / "plugins_registry").mkdir()
    assert check_kubelet_dirs(tmp_path / "plugins_registry", tmp_path / "plugins")[0].status == "ok"


# -- container runtimes -------------------------------------------------------------------------


def host_with(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    return tmp_path


def only(verdicts: list[Verdict]) -> Verdict:
    assert len(verdicts) == 1, verdicts
    return verdicts[0]


V2 = '[plugins."io.containerd.grpc.v1.cri"]\n'


def test_containerd_1_7_config_with_cdi_on_reading_the_agents_directory(tmp_path):
    host = host_with(
        tmp_path, {"etc/containerd/config.toml": f"version = 2\n{V2}enable_cdi = true\n"}
    )
    v = only(check_runtimes(host, Path("/var/run/cdi")))
    assert (v.status, v.subject) == ("ok", "containerd")
    assert "/var/run/cdi" in v.detail


def test_var_run_and_run_are_the_same_directory_on_the_host(tmp_path):
    host = host_with(
        tmp_path, {"etc/containerd/config.toml": f"version = 2\n{V2}enable_cdi = true\n"}
    )
    (host / "run").mkdir()
    (host / "var").mkdir(exist_ok=True)
    os.symlink("/run", host / "var" / "run")
    assert only(check_runtimes(host, Path("/run/cdi"))).status == "ok"


def test_containerd_with_cdi_off_fails_saying_where_to_turn_it_on(tmp_path):
    host = host_with(
        tmp_path, {"etc/containerd/config.toml": f"version = 2\n{V2}enable_cdi = false\n"}
    )
    v = only(check_runtimes(host, Path("/var/run/cdi")))
    assert v.status == "fail"
    assert 'enable_cdi = true in [plugins."io.containerd.grpc.v1.cri"]' in v.fix


def test_unset_enable_cdi_depends_on_the_config_version(tmp_path):
    host = host_with(tmp_path, {"etc/containerd/config.toml": "version = 2\n"})
    v = only(check_runtimes(host, Path("/var/run/cdi")))
    assert v.status == "warn" and "containerd 1.7" in v.detail
    (host / "etc/containerd/config.toml").write_text("version = 3\n")  # containerd 2.x: on
    assert only(check_runtimes(host, Path("/var/run/cdi"))).status == "ok"
    (host / "etc/containerd/config.toml").write_text("[plugins.cri]\nsystemd_cgroup = true\n")
    assert only(check_runtimes(host, Path("/var/run/cdi"))).status == "fail"  # version 1: off


def test_a_cdi_root_the_runtime_does_not_read_fails(tmp_path):
    cfg = 'version = 3\n[plugins."io.containerd.cri.v1.runtime"]\ncdi_spec_dirs = ["/etc/cdi"]\n'
    host = host_with(tmp_path, {"etc/containerd/config.toml": cfg})
    v = only(check_runtimes(host, Path("/var/run/cdi")))
    assert v.status == "fail" and "reads CDI specs from /etc/cdi" in v.detail
    assert "--cdi-root" in v.fix


def test_containerd_imports_replace_the_plugin_tables_they_name(tmp_path):
    host = host_with(
        tmp_path,
        {
            "etc/containerd/config.toml": f'version = 2\nimports = ["conf.d/*.toml"]\n{V2}'
            "enable_cdi = false\n",
            "etc/containerd/conf.d/99-nvidia.toml": f"version = 2\n{V2}enable_cdi = true\n",
        },
    )
    cdi = read_containerd(host)
    assert cdi is not None and cdi.enabled is True
    assert cdi.files == ("/etc/containerd/config.toml", "/etc/containerd/conf.d/99-nvidia.toml")


def test_a_config_that_is_not_toml_fails_naming_the_file(tmp_path):
    host = host_with(tmp_path, {"etc/containerd/config.toml": "version = [\n"})
    v = only(check_runtimes(host, Path("/var/run/cdi")))
    assert v.status == "fail" and "/etc/containerd/config.toml is not valid TOML" in v.detail
    host = host_with(tmp_path, {"etc/containerd/config.toml": f"version = 2\n{V2}enable_cdi = 1\n"})
    assert "not true or false" in only(check_runtimes(host, Path("/var/run/cdi"))).detail


def test_crio_drop_ins_apply_in_lexical_order(tmp_path):
    host = host_with(
        tmp_path,
        {
            "etc/crio/crio.conf": '[crio.runtime]\ncdi_spec_dirs = ["/var/run/cdi"]\n',
            "etc/crio/crio.conf.d/10-a.conf": '[crio.runtime]\ncdi_spec_dirs = ["/a"]\n',
            "etc/crio/crio.conf.d/20-b.conf": '[crio.runtime]\ncdi_spec_dirs = ["/b"]\n',
        },
    )
    cdi = read_crio(host)
    assert cdi is not None and cdi.spec_dirs == ("/b",) and cdi.enabled is True
    v = only(check_runtimes(host, Path("/var/run/cdi")))
    assert (v.status, v.subject) == ("fail", "CRI-O")
    assert "[crio.runtime]" in v.fix


def test_crio_defaults_read_var_run_cdi(tmp_path):
    (tmp_path / "usr" / "bin").mkdir(parents=True)
    (tmp_path / "usr" / "bin" / "crio").write_text("")
    assert only(check_runtimes(tmp_path, Path("/var/run/cdi"))).status == "ok"


def test_no_runtime_under_the_host_root_warns_naming_the_flag(tmp_path):
    v = only(check_runtimes(tmp_path, Path("/var/run/cdi")))
    assert v.status == "warn" and "--host-root" in v.fix


# -- the toolkit's hook --------------------------------------------------------------------------


def test_the_hook_the_specs_run_is_named_or_the_hook_free_layout_warned_about():
    v = check_cdi_hook(None)
    assert v.status == "warn" and "hook-free" in v.detail
    assert "NVIDIA Container Toolkit" in v.fix and "--cdi-hook-path" in v.fix
    v = check_cdi_hook("/usr/local/nvidia/toolkit/nvidia-cdi-hook")
    assert v.status == "ok" and "/usr/local/nvidia/toolkit/nvidia-cdi-hook" in v.detail


# -- the state lock -------------------------------------------------------------------------------

HOLD = textwrap.dedent(
    """\
    import sys
    from pathlib import Path
    from agent.statelock import StateLock
    lock = StateLock(Path(sys.argv[1]))
    lock.acquire()
    print("held", flush=True)
    sys.stdin.read()
    """
)


def hold_lock(state: Path, program: list[str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [*program, str(state)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_proc_locks_lines_name_the_holder():
    text = (
        "1: POSIX  ADVISORY  WRITE 99 08:02:1234 0 EOF\n"
        "2: FLOCK  ADVISORY  WRITE 4242 fd:01:1234 0 EOF\n"
        "2: -> FLOCK  ADVISORY  WRITE 77 fd:01:1234 0 EOF\n"
    )
    assert holder_in(text, 0xFD, 1, 1234) == 4242
    assert holder_in(text, 8, 2, 1234) is None  # a POSIX lock is not the agent's flock


def test_a_lock_held_by_something_else_than_an_agent_fails(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    assert check_state_lock(state).status == "ok"  # no lock file yet
    proc = hold_lock(state, [sys.executable, "-c", HOLD])
    try:
        assert lock_holder(state / LOCK_FILE) == proc.pid
        v = check_state_lock(state)
        assert v.status == "fail" and f"PID {proc.pid}" in v.detail
        assert f"stop PID {proc.pid}" in v.fix
    finally:
        proc.communicate("")
    v = check_state_lock(state)
    assert v.status == "ok" and "is free" in v.detail


def test_a_lock_held_by_a_running_agent_is_as_it_should_be(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    program = tmp_path / "bin" / "tessera"  # what `tessera run` is: a script named tessera
    program.parent.mkdir()
    program.write_text(f"#!{sys.executable}\n{HOLD.replace('sys.argv[1]', 'sys.argv[2]')}")
    program.chmod(0o755)
    proc = hold_lock(state, [str(program), "run"])
    try:
        v = check_state_lock(state)
        assert v.status == "ok" and f"held by the running agent (PID {proc.pid}" in v.detail
    finally:
        proc.communicate("")


@pytest.mark.parametrize("text", ["", "not a lock table\n"])
def test_an_unreadable_lock_table_names_no_holder(tmp_path, text):
    (tmp_path / "locks").write_text(text)
    (tmp_path / "agent.lock").write_text("")
    assert lock_holder(tmp_path / "agent.lock", tmp_path / "locks") is None


def test_in_a_pod_without_the_hosts_root_the_runtime_check_is_skipped_with_the_reason():
    """The container-driver overlay mounts no host /: the pod's own /etc says nothing about the
    host's runtime, so the check says so instead of warning about a runtime that is there."""
    v = only(check_runtimes(Path("/"), Path("/var/run/cdi"), in_pod=True))
    assert v.status == "skip" and "host's /" in v.detail and "tessera doctor" in v.detail
    # on the host itself (not in a pod) the same root is the host's: checked as before
    assert check_runtimes(Path("/"), Path("/var/run/cdi"))[0].status != "skip"
