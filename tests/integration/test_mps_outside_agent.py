"""In kube mode a claim's MPS control daemon lives outside the agent (a Pod per claim, pinned to
the node): killing the agent's whole PID namespace, as a container restart does, leaves the MPS
server answering its clients, and the next agent adopts it. The API-server emulator has no
kubelet: the simulator's pod runner (agent/sim/podrunner.py) runs the Pods' containers as host
processes, outside the agent's process tree and namespace."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from agent.sim.apiserver import DEFAULT_NAMESPACES, ApiServer
from agent.sim.podrunner import PodRunner
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.integration.daemon import DRIVER, Daemon, claim_manifest
from tests.k8sschema import VERSIONS, validate
from tests.simnode import mps_daemons, reap_mps_daemons

NAMESPACE = "tessera-system"
UNSHARE = ("unshare", "--pid", "--fork", "--mount-proc", "--kill-child")
CLAIM_LABEL = "mps.tessera.dev/claim-uid"


def can_unshare() -> str | None:
    """Why a PID namespace cannot be made here, or None."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    done = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return f"unshare --pid is not permitted here: {done.stderr.strip()[:200]}"
    return None


@pytest.fixture
def cluster(short_tmp: Path) -> Iterator[tuple[ApiServer, PodRunner]]:
    with ApiServer(namespaces=(*DEFAULT_NAMESPACES, NAMESPACE)) as server:
        runner = PodRunner(server.url, "dgx-h100", short_tmp / "pod-logs", dict(os.environ))
        runner.start()
        try:
            yield server, runner
        finally:
            runner.stop()
            reap_mps_daemons(short_tmp / "node" / "sim", "dgx-h100")


def mps_claim(server: ApiServer, node: str, name: str, device: str) -> ClaimRef:
    parameters = {
        "apiVersion": f"{DRIVER}/v1alpha1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 50}},
    }
    opaque = {"driver": DRIVER, "parameters": parameters}
    config = {"source": "FromClaim", "requests": [], "opaque": opaque}
    obj = claim_manifest(name, f"uid-{name}", [("gpu", device)], node, config=[config])
    created: dict[str, Any] = server.put_object("resourceclaims", obj)
    return ClaimRef("default", name, created["metadata"]["uid"])


def call(d: Daemon, method: str, ref: ClaimRef) -> None:
    with KubeletClient(d.dra_socket) as k:
        entry = getattr(k, method)([ref])["claims"][ref.uid]
    assert entry.get("error", "") == "", entry["error"]


def mps_pods(server: ApiServer) -> list[dict[str, Any]]:
    pods = server.objects("pods", NAMESPACE)
    for pod in pods:
        for version in VERSIONS:
            validate(pod, version)
    return pods


def ask(d: Daemon, pipe_dir: str, command: str) -> str:
    """A client's command to the MPS control daemon of ``pipe_dir`` (the simulated tool)."""
    (tool,) = (d.state / "sim").rglob("usr/bin/nvidia-cuda-mps-control")
    done = subprocess.run(
        [str(tool)], input=command + "\n", capture_output=True, text=True, timeout=30,
        env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe_dir}, check=True,
    )  # fmt: skip
    return done.stdout.strip()


def kill_namespace(d: Daemon) -> None:
    """SIGKILL the init of the agent's PID namespace (the agent itself): the kernel then kills
    every process in the namespace, as when a container's runtime tears it down."""
    assert d.proc is not None
    (init,) = psutil.Process(d.proc.pid).children()
    inside = [init, *init.children(recursive=True)]
    init.send_signal(signal.SIGKILL)
    d.wait_exit()
    _, alive = psutil.wait_procs(inside, timeout=10)
    assert alive == [], f"processes of the killed namespace still run: {alive}"


def kill_process_group(d: Daemon) -> None:
    """SIGKILL the agent's whole process group (it leads its own, under ``setsid``)."""
    assert d.proc is not None
    os.killpg(d.proc.pid, signal.SIGKILL)
    d.wait_exit()


def outlives_and_is_adopted(
    short_tmp: Path,
    cluster: tuple[ApiServer, PodRunner],
    prefix: tuple[str, ...],
    kill: Callable[[Daemon], None],
) -> None:
    """Prepare an MPS claim under a kube-mode agent run under ``prefix``, ``kill`` the agent;
    its MPS server answers on, the next agent adopts it, unprepare stops it."""
    server, runner = cluster
    kubeconfig = str(server.kubeconfig(short_tmp))
    env = {"TESSERA_MPS_POD_IMAGE": "ghcr.io/tessera-gpu/tessera:test"}
    d = Daemon(short_tmp / "node", "dgx-h100", "--kubeconfig", kubeconfig, prefix=prefix)
    d.start(env=env)
    try:
        ref = mps_claim(server, d.node, "shared", "gpu-3")
        call(d, "prepare", ref)
        pipe_dir = str(d.state / "mps" / ref.uid / "pipe")
        assert ask(d, pipe_dir, "get_default_active_thread_percentage") == "50.0"

        kill(d)
        assert ask(d, pipe_dir, "get_default_active_thread_percentage") == "50.0"
        (daemon,) = mps_daemons(d.state / "sim", d.model)
        assert daemon.pipe_dir == pipe_dir
        (pod,) = mps_pods(server)
        assert pod["metadata"]["labels"][CLAIM_LABEL] == ref.uid
        assert pod["spec"]["nodeName"] == d.node
        assert runner.pids() == {pod["metadata"]["uid"]: daemon.pid}  # the Pod runs it

        d.start(env=env)
        assert d.wait_log("adopted a running MPS daemon")["claim_uid"] == ref.uid
        assert [x.pid for x in mps_daemons(d.state / "sim", d.model)] == [daemon.pid]
        assert [p["metadata"]["uid"] for p in mps_pods(server)] == [pod["metadata"]["uid"]]

        call(d, "unprepare", ref)
        assert mps_daemons(d.state / "sim", d.model) == []
        assert mps_pods(server) == []
        assert not Path(daemon.pipe_dir).exists()
        assert server.rejected == []
    finally:
        d.kill()


@pytest.mark.timeout(180)
def test_an_mps_server_outlives_the_agents_pid_namespace_and_is_adopted(
    short_tmp: Path, cluster: tuple[ApiServer, PodRunner]
) -> None:
    reason = can_unshare()
    if reason is not None:
        pytest.skip(f"{reason}; test_an_mps_server_outlives_the_agents_process_group checks"
                    " the same without a PID namespace")  # fmt: skip
    # the agent's container goes, with everything in it
    outlives_and_is_adopted(short_tmp, cluster, UNSHARE, kill_namespace)


@pytest.mark.timeout(180)
def test_an_mps_server_outlives_the_agents_process_group(
    short_tmp: Path, cluster: tuple[ApiServer, PodRunner]
) -> None:
    # where no PID namespace can be made: the agent and every process of its group killed.
    # Weaker than the namespace: a local daemon (-d) leaves the group by itself (setsid), so
    # this alone passes with local daemons too; it checks the Pods' adoption without unshare
    outlives_and_is_adopted(short_tmp, cluster, ("setsid",), kill_process_group)


@pytest.mark.timeout(180)
def test_the_start_removes_mps_pods_and_directories_no_claim_owns(
    short_tmp: Path, cluster: tuple[ApiServer, PodRunner]
) -> None:
    server, runner = cluster
    kubeconfig = str(server.kubeconfig(short_tmp))
    env = {"TESSERA_MPS_POD_IMAGE": "ghcr.io/tessera-gpu/tessera:test"}
    d = Daemon(short_tmp / "node", "dgx-h100", "--kubeconfig", kubeconfig)
    d.start(env=env)
    try:
        ref = mps_claim(server, d.node, "orphan", "gpu-2")
        call(d, "prepare", ref)
        (daemon,) = mps_daemons(d.state / "sim", d.model)
        d.kill()
        # the claim is forgotten (no checkpoint, no CDI spec to rebuild it from): its daemon,
        # Pod and directories are orphans
        (d.state / "checkpoint.json").unlink()
        for spec in d.cdi_dir.glob(f"*{ref.uid}*"):
            spec.unlink()
        d.start(env=env)
        assert d.wait_log("removed an MPS daemon no claim owns")["claim_uid"] == ref.uid
        assert mps_daemons(d.state / "sim", d.model) == []
        assert mps_pods(server) == [] and runner.pids() == {}
        assert not Path(daemon.pipe_dir).exists()
    finally:
        d.kill()


@pytest.mark.timeout(180)
def test_an_mps_pod_no_kubelet_runs_fails_the_prepare_naming_it_and_is_removed(
    short_tmp: Path,
) -> None:
    with ApiServer(namespaces=(*DEFAULT_NAMESPACES, NAMESPACE)) as server:  # no pod runner
        kubeconfig = str(server.kubeconfig(short_tmp))
        d = Daemon(short_tmp / "node", "dgx-h100", "--kubeconfig", kubeconfig,
                   "--mps-pod-image", "ghcr.io/tessera-gpu/tessera:test",
                   "--mps-ready-timeout", "1")  # fmt: skip
        d.start()
        try:
            ref = mps_claim(server, d.node, "stuck", "gpu-1")
            with KubeletClient(d.dra_socket) as k:
                error = k.prepare([ref])["claims"][ref.uid]["error"]
            assert "wrote no PID" in error, error
            assert f"(Pod {NAMESPACE}/tessera-mps-{ref.uid}: Pending)" in error, error
            assert mps_pods(server) == []  # the failed prepare was undone
            assert not (d.state / "mps" / ref.uid).exists()
            assert d.checkpoint()["claims"] == {}
        finally:
            d.kill()
