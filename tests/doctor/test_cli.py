"""`tessera doctor` as an admin runs it: the simulated node passes every check; then each check
is broken in turn and fails (or warns) with its fix, and the exit code says so."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.cli import main
from agent.sim.apiserver import ApiServer
from tests.hardware import needs_no_driver

TESSERA = os.path.join(os.path.dirname(sys.executable), "tessera")
EVERY_CHECK = {
    "driver", "nvml-library", "driver-version", "mig-mode", "device-nodes", "cdi-dir",
    "cdi-runtime", "kubelet-dirs", "cdi-hook", "state-dir", "state-lock", "api-server", "rbac",
}  # fmt: skip


@pytest.fixture
def server() -> Iterator[ApiServer]:
    with ApiServer() as s:
        yield s


@pytest.fixture
def node(tmp_path: Path, server: ApiServer) -> list[str]:
    """The flags of a simulated dgx-a100 (MIG on) in kube mode against the emulator."""
    kubeconfig = server.kubeconfig(tmp_path / "kubeconfig")
    state = tmp_path / "state"
    return ["--simulate", "dgx-a100", "--state-dir", str(state), "--kubeconfig", str(kubeconfig)]


def doctor(*argv: str) -> tuple[int, dict[str, Any], str]:
    """``tessera doctor ARGV -o json`` in this process: exit code, report, stderr."""
    out, err = io.StringIO(), io.StringIO()
    code = main(["doctor", *argv, "-o", "json"], {}, out, err)
    return code, json.loads(out.getvalue()) if out.getvalue() else {}, err.getvalue()


def verdicts(report: dict[str, Any], check: str) -> list[dict[str, Any]]:
    return [c for c in report["checks"] if c["check"] == check]


def the(report: dict[str, Any], check: str, subject: str = "") -> dict[str, Any]:
    found = [c for c in verdicts(report, check) if not subject or c["subject"] == subject]
    assert len(found) == 1, (check, subject, report["checks"])
    return found[0]


HOOK_FREE = ("cdi-hook", "", "warn")
"""The simulated node's one warning: its driver root has no toolkit hook (hook-free specs)."""


def not_ok(report: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The checks that are not ok, but for the simulated node's hook-free warning."""
    found = [(c["check"], c["subject"], c["status"]) for c in report["checks"]]
    return [v for v in found if v[2] != "ok" and v != HOOK_FREE]


def host(node: list[str]) -> Path:
    return Path(node[node.index("--state-dir") + 1]) / "sim" / "host"


def test_the_simulated_node_passes_every_check_in_a_real_process(node):
    run = subprocess.run(
        [TESSERA, "doctor", *node, "-o", "json"],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")},
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    assert report["ok"] is True and report["node"] == "dgx-a100"
    assert {c["check"] for c in report["checks"]} == EVERY_CHECK
    assert not_ok(report) == []
    # the simulated driver root has no toolkit hook: hook-free specs, a warning
    assert the(report, "cdi-hook")["status"] == "warn"
    assert len(verdicts(report, "mig-mode")) == 8  # one per GPU
    assert {c["subject"] for c in verdicts(report, "cdi-runtime")} == {"containerd"}


def test_the_table_names_each_failure_with_its_fix_in_a_real_process(node):
    doctor(*node)  # writes the simulated host
    (host(node) / "dev" / "nvidia-uvm").unlink()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    run = subprocess.run(
        [TESSERA, "doctor", *node, "--host-root", str(host(node))],
        capture_output=True,
        text=True,
        env={**env, "TESSERA_MIG_MODE": "static"},
        timeout=120,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith("FAIL  device-nodes"))
    assert "/dev/nvidia-uvm missing" in lines[i]
    assert lines[i + 1].lstrip().startswith("fix: create the nodes as root on the host")
    assert lines[-1].startswith("some checks failed: ") and "1 fail" in lines[-1]


def test_a_missing_gpu_node_fails_device_nodes(node):
    doctor(*node)
    (host(node) / "dev" / "nvidia3").unlink()
    code, report, _ = doctor(*node, "--host-root", str(host(node)))
    assert code == 1
    assert not_ok(report) == [("device-nodes", "", "fail")]
    assert "/dev/nvidia3 missing" in the(report, "device-nodes")["detail"]


def test_a_file_where_the_cdi_directory_belongs_fails_both_cdi_checks(node, tmp_path):
    (tmp_path / "cdi").write_text("not a directory")
    code, report, _ = doctor(*node, "--cdi-root", str(tmp_path / "cdi"))
    assert code == 1
    assert not_ok(report) == [("cdi-dir", "", "fail"), ("cdi-runtime", "containerd", "fail")]
    assert "a file is in the way" in the(report, "cdi-dir")["detail"]
    assert "--cdi-root" in the(report, "cdi-runtime")["fix"]


def test_containerd_with_cdi_off_fails_cdi_runtime(node):
    doctor(*node)
    config = host(node) / "etc" / "containerd" / "config.toml"
    config.write_text(config.read_text().replace("enable_cdi = true", "enable_cdi = false"))
    code, report, _ = doctor(*node, "--host-root", str(host(node)))
    assert code == 1
    v = the(report, "cdi-runtime", "containerd")
    assert v["status"] == "fail" and "CDI is off" in v["detail"]
    assert "set enable_cdi = true" in v["fix"] and "restart containerd" in v["fix"]


def test_the_hook_check_reports_the_hook_the_agent_would_run(node, tmp_path):
    """No hook under the driver root only warns (hook-free specs); --cdi-hook-path, as the
    agent takes it, is what the check names."""
    code, report, _ = doctor(*node)
    assert code == 0 and "NVIDIA Container Toolkit" in the(report, "cdi-hook")["fix"]
    code, report, _ = doctor(*node, "--cdi-hook-path", "/opt/toolkit/nvidia-cdi-hook")
    assert code == 0 and the(report, "cdi-hook")["status"] == "ok"
    assert "/opt/toolkit/nvidia-cdi-hook" in the(report, "cdi-hook")["detail"]


def test_a_kubelet_registry_that_is_not_there_fails(node, tmp_path):
    code, report, _ = doctor(*node, "--kubelet-registry-dir", str(tmp_path / "elsewhere"))
    assert code == 1
    assert not_ok(report) == [("kubelet-dirs", "registry", "fail")]


HOLD = textwrap.dedent(
    """\
    import sys
    from pathlib import Path
    from agent.statelock import StateLock
    StateLock(Path(sys.argv[1])).acquire()
    print("held", flush=True)
    sys.stdin.read()
    """
)


def test_a_state_lock_held_by_another_process_fails(node):
    state = Path(node[node.index("--state-dir") + 1])
    state.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(state)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        code, report, _ = doctor(*node)
    finally:
        holder.communicate("")
    assert code == 1
    assert not_ok(report) == [("state-lock", "", "fail")]
    assert f"stop PID {holder.pid}" in the(report, "state-lock")["fix"]


def test_a_verb_the_api_server_denies_fails_rbac(node, server):
    server.access.deny("watch", "resourceslices", "resource.k8s.io")
    code, report, _ = doctor(*node)
    assert code == 1
    assert not_ok(report) == [("rbac", "resourceslices.resource.k8s.io", "fail")]
    assert "watch" in the(report, "rbac", "resourceslices.resource.k8s.io")["detail"]


def test_a_pending_mig_mode_warns_and_dynamic_mode_wants_mig_on(node):
    from agent.sim.model import load_model
    from agent.sim.nvml import FakeNvml

    code, report, _ = doctor(*node, "--sim-mig-layout", "none")  # MIG off everywhere
    assert code == 0 and not_ok(report) == []
    state = Path(node[node.index("--state-dir") + 1])
    fake = FakeNvml(load_model("dgx-a100"), state / "sim")
    fake.nvmlInit()
    fake.nvmlDeviceSetMigMode(fake.nvmlDeviceGetHandleByIndex(2), 1)  # A100: needs a reset
    fake.nvmlShutdown()
    code, report, _ = doctor(*node)
    assert code == 0
    assert not_ok(report) == [("mig-mode", "GPU 2", "warn")]
    assert "nvidia-smi -r -i 2" in the(report, "mig-mode", "GPU 2")["fix"]
    code, report, _ = doctor(*node, "--mig-mode", "dynamic")
    assert code == 0
    assert [s for _, s, status in not_ok(report) if status == "warn"] == [
        f"GPU {i}" for i in range(8)
    ]  # MIG off on Ampere: no placements offered (GPU 2 for its pending change)


def test_standalone_mode_skips_the_api_server(node):
    flags = node[: node.index("--kubeconfig")]
    code, report, _ = doctor(*flags, "--no-kube")
    assert code == 0
    assert not_ok(report) == [("api-server", "", "skip"), ("rbac", "", "skip")]


@needs_no_driver
def test_a_machine_without_the_driver_fails_and_skips_the_gpu_checks(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    run = subprocess.run(
        [TESSERA, "doctor", "--state-dir", str(tmp_path / "state"), "--host-root",
         str(tmp_path), "--no-kube", "-o", "json"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    report = json.loads(run.stdout)
    driver = the(report, "driver")
    assert driver["status"] == "fail" and "no NVIDIA driver" in driver["detail"]
    assert "--driver-root" in driver["fix"]
    for check in ("nvml-library", "driver-version", "mig-mode", "device-nodes"):
        assert the(report, check)["status"] == "skip"


def test_next_to_a_running_agent_its_lock_is_as_it_should_be(short_tmp):
    from tests.integration.daemon import Daemon

    agent = Daemon(short_tmp / "state", "l40s-pcie").start()
    try:
        code, report, _ = doctor("--simulate", "l40s-pcie", "--state-dir", str(agent.state),
                                 "--no-kube")  # fmt: skip
        assert agent.proc is not None
        pid = agent.proc.pid
    finally:
        agent.stop()
    assert code == 0, report
    lock = the(report, "state-lock")
    assert lock["status"] == "ok" and f"held by the running agent (PID {pid}" in lock["detail"]
    assert not_ok(report) == [("api-server", "", "skip"), ("rbac", "", "skip")]


def test_a_bad_state_dir_gets_the_same_verdict_with_simulate_as_without(tmp_path):
    """A file where the state directory belongs: the report's failed state-dir check and exit
    1, with --simulate as on a real node; not a one-line error and exit 2 because the simulated
    node could not be written under it."""
    in_the_way = tmp_path / "state"
    in_the_way.write_text("not a directory\n")
    common = ("--state-dir", str(in_the_way), "--no-kube")
    real_code, real, _ = doctor(*common, "--host-root", str(tmp_path))
    sim_code, sim, err = doctor("--simulate", "dgx-a100", *common)
    assert (sim_code, real_code) == (1, 1), err
    assert the(sim, "state-dir") == the(real, "state-dir")
    assert the(sim, "state-dir")["status"] == "fail"
    assert "a file is in the way" in the(sim, "state-dir")["detail"]
    assert {c["check"] for c in sim["checks"]} >= EVERY_CHECK - {"api-server", "rbac"}
