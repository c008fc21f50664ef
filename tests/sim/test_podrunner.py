"""The simulator's pod runner (agent/sim/podrunner.py): the kubelet's part for Pods bound to its
node, over real HTTP to the API-server emulator, with real processes."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from agent.sim.apiserver import ApiServer
from agent.sim.podrunner import PodRefused, PodRunner, container_command
from tests.k8sschema import VERSIONS, validate


def pod(name: str, command: list[str], node: str = "node-1", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "c",
                    "image": "x",
                    "command": command,
                    "env": [{"name": "A", "value": "1"}],
                }
            ],
            **spec,
        },
    }


def test_a_container_runs_its_command_with_its_env_and_the_runners_path() -> None:
    argv, env = container_command(pod("p", ["/bin/echo", "hi"]), {"PATH": "/bin", "HOME": "/x"})
    assert argv == ["/bin/echo", "hi"]
    assert env == {"PATH": "/bin", "A": "1"}  # nothing else of the runner's environment


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"restartPolicy": "Always"}, "restartPolicy must be Never"),
        ({"initContainers": [{"name": "i"}]}, "exactly one container"),
        (
            {
                "volumes": [{"name": "v", "hostPath": {"path": "/var/lib/x"}}],
                "containers": [
                    {
                        "name": "c",
                        "command": ["true"],
                        "volumeMounts": [{"name": "v", "mountPath": "/elsewhere"}],
                    }
                ],
            },
            "a volume must be a hostPath mounted at its own path",
        ),
    ],
)
def test_what_it_cannot_stand_in_for_is_refused(change: dict[str, Any], why: str) -> None:
    obj = pod("p", ["true"])
    obj["spec"].update(change)
    with pytest.raises(PodRefused, match=why):
        container_command(obj, {})


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[ApiServer, PodRunner]]:
    with ApiServer() as server:
        runner = PodRunner(server.url, "node-1", tmp_path / "logs", dict(os.environ)).start()
        try:
            yield server, runner
        finally:
            runner.stop()


def wait(cond: Any, what: str) -> None:
    done = threading.Event()
    for _ in range(400):
        if cond():
            return
        done.wait(0.05)
    raise AssertionError(f"not within 20 s: {what}")


def phase(server: ApiServer, name: str) -> str | None:
    obj = server.get_object("pods", name, "default")
    return None if obj is None else (obj.get("status") or {}).get("phase")


def test_a_bound_pod_runs_until_deleted_and_its_process_group_goes(
    cluster: tuple[ApiServer, PodRunner],
) -> None:
    server, runner = cluster
    server.put_object("pods", pod("sleeper", ["/bin/sh", "-c", "sleep 600 & wait"]))
    server.put_object("pods", pod("elsewhere", ["/bin/sleep", "600"], node="node-2"))
    wait(lambda: phase(server, "sleeper") == "Running", "the Pod running")
    running = server.get_object("pods", "sleeper", "default")
    assert running is not None
    for version in VERSIONS:
        validate(running, version)
    (pid,) = runner.pids().values()
    shell = psutil.Process(pid)
    wait(lambda: len(shell.children()) == 1, "the shell's child started")
    procs = [shell, *shell.children()]
    assert phase(server, "elsewhere") is None  # another node's: not this runner's
    server.delete_object("pods", "sleeper", "default")
    _, alive = psutil.wait_procs(procs, timeout=20)
    assert alive == [] and runner.pids() == {}


def test_a_pod_whose_process_exits_succeeds_or_fails_by_its_exit_status(
    cluster: tuple[ApiServer, PodRunner],
) -> None:
    server, _ = cluster
    server.put_object("pods", pod("ok", ["/bin/true"]))
    server.put_object("pods", pod("bad", ["/bin/sh", "-c", "exit 3"]))
    server.put_object("pods", pod("refused", ["true"], restartPolicy="Always"))
    wait(lambda: phase(server, "ok") == "Succeeded", "ok Succeeded")
    wait(lambda: phase(server, "bad") == "Failed", "bad Failed")
    wait(lambda: phase(server, "refused") == "Failed", "refused Failed")
    bad = server.get_object("pods", "bad", "default")
    assert bad is not None
    (status,) = bad["status"]["containerStatuses"]
    assert status["state"]["terminated"]["exitCode"] == 3
    refused = server.get_object("pods", "refused", "default")
    assert refused is not None and "restartPolicy" in refused["status"]["message"]
    assert server.rejected == []
