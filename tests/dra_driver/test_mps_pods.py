"""The MPS Pod launcher (dra_driver/cluster/mps_pods.py) against the API-server emulator over
real HTTP: the Pod a real node gets, how a daemon's identity is told from a replacement's, and
the errors an MPS claim gets when the Pod cannot be made."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.sim.apiserver import DEFAULT_NAMESPACES, ApiServer
from dra_driver.cluster.kube import KubeClient
from dra_driver.cluster.mps_pods import CLAIM_LABEL, PodLauncher, PodTemplate
from dra_driver.errors import SharingError
from tests.apiclient import api_client
from tests.k8sschema import VERSIONS, validate

NS = "tessera-system"
UID = "0f6a1b2c-3d4e-4f50-8a9b-0c1d2e3f4a5b"
ENV = {
    "CUDA_MPS_PIPE_DIRECTORY": f"/var/lib/tessera/mps/{UID}/pipe",
    "CUDA_VISIBLE_DEVICES": "GPU-1",
}


def template(image: str = "ghcr.io/tessera-gpu/tessera:0.1.0", node: str = "gpu-1") -> PodTemplate:
    return PodTemplate(
        namespace=NS,
        node=node,
        image=image,
        mps_control="/host-root/usr/bin/nvidia-cuda-mps-control",
        driver_root="/host-root",
        driver_root_on_host="/",
        root="/var/lib/tessera/mps",
        tool_env={"PATH": "/usr/bin:/bin"},
        private_shm=True,
    )


@pytest.fixture
def server() -> Iterator[ApiServer]:
    with ApiServer(namespaces=(*DEFAULT_NAMESPACES, NS)) as s:
        yield s


def launcher(server: ApiServer, t: PodTemplate | None = None) -> PodLauncher:
    kube = KubeClient(api_client(server, retries=False))
    return PodLauncher(kube, t or template(), logging.getLogger("test"))


def shm() -> Path:
    return Path(f"/var/lib/tessera/mps/{UID}/shm")


def test_a_real_nodes_mps_pod_is_pinned_runs_the_drivers_tool_and_mounts_host_paths(
    server: ApiServer,
) -> None:
    launcher(server).launch(UID, ENV, shm())
    (pod,) = server.objects("pods", NS)
    for version in VERSIONS:
        validate(pod, version)
    spec = pod["spec"]
    assert pod["metadata"]["name"] == f"tessera-mps-{UID}"
    assert pod["metadata"]["labels"][CLAIM_LABEL] == UID
    assert (spec["nodeName"], spec["restartPolicy"]) == ("gpu-1", "Never")
    (c,) = spec["containers"]
    assert c["command"] == ["/host-root/usr/bin/nvidia-cuda-mps-control", "-f"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env == {**ENV, "PATH": "/usr/bin:/bin"}
    volumes = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
    assert mounts == {
        f"/var/lib/tessera/mps/{UID}": f"/var/lib/tessera/mps/{UID}",  # the same path
        "/host-root": "/",  # the driver, where the agent sees it
        "/dev/shm": str(shm()),  # the claim's shared memory, as its containers get it
    }
    assert server.rejected == []


def test_a_pod_is_running_until_it_ends_or_is_deleted_and_a_new_one_is_another(
    server: ApiServer,
) -> None:
    pods = launcher(server)
    assert pods.started_at(UID, 7) is None  # no Pod
    pods.launch(UID, ENV, shm())
    first = pods.started_at(UID, 7)
    assert first is not None and pods.claim_keys() == {UID}
    pod = server.get_object("pods", f"tessera-mps-{UID}", NS)
    assert pod is not None
    server.put_object("pods", {**pod, "status": {"phase": "Succeeded"}})  # it took quit
    assert pods.started_at(UID, 7) is None
    server.put_object("pods", {**pod, "status": {"phase": "Running"}})
    meta = {**pod["metadata"], "creationTimestamp": "2030-01-01T00:00:00Z"}
    server.put_object("pods", {**pod, "metadata": meta})  # made again: another identity
    assert pods.started_at(UID, 7) not in (None, first)
    pods.forget(UID)
    assert server.objects("pods", NS) == [] and pods.claim_keys() == set()
    pods.forget(UID)  # idempotent: a Pod already gone is no error


def test_only_this_nodes_mps_pods_are_its_claims(server: ApiServer) -> None:
    launcher(server, template(node="gpu-2")).launch("other-claim", ENV, shm())
    pods = launcher(server)
    pods.launch(UID, ENV, shm())
    assert pods.claim_keys() == {UID}


def test_a_pod_left_by_an_earlier_start_is_replaced(server: ApiServer) -> None:
    pods = launcher(server)
    pods.launch(UID, ENV, shm())
    old = server.get_object("pods", f"tessera-mps-{UID}", NS)
    pods.launch(UID, ENV, shm())
    new = server.get_object("pods", f"tessera-mps-{UID}", NS)
    assert old is not None and new is not None
    assert new["metadata"]["uid"] != old["metadata"]["uid"]


def test_without_an_image_an_mps_claim_fails_naming_the_setting(server: ApiServer) -> None:
    with pytest.raises(SharingError, match="--mps-pod-image") as caught:
        launcher(server, template(image="")).launch(UID, ENV, shm())
    assert caught.value.reason == "mps_pod_error"
    assert server.objects("pods", NS) == []


def test_a_refused_create_fails_the_prepare_with_the_api_servers_answer(server: ApiServer) -> None:
    server.faults.add("POST", r"/pods$", "500")
    with pytest.raises(SharingError, match=r"cannot create the MPS Pod .* 500") as caught:
        launcher(server).launch(UID, ENV, shm())
    assert caught.value.reason == "mps_pod_error"


def test_a_pod_that_does_not_run_is_described_for_the_prepares_error(server: ApiServer) -> None:
    pods = launcher(server)
    pods.launch(UID, ENV, shm())
    assert pods.describe(UID) == f"Pod {NS}/tessera-mps-{UID}: Pending"  # no kubelet took it
    pod = server.get_object("pods", f"tessera-mps-{UID}", NS)
    assert pod is not None
    waiting = {"reason": "ErrImagePull", "message": "pull access denied"}
    status = {"phase": "Pending", "containerStatuses": [{"state": {"waiting": waiting}}]}
    server.put_object("pods", {**pod, "status": status})
    assert pods.describe(UID).endswith(": Pending; ErrImagePull: pull access denied")
