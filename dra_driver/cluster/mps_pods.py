"""A claim's MPS control daemon as a Pod of its own, pinned to the node (kube mode).

The agent's container is restarted on every crash and rolling upgrade, and a process it starts
lives in its PID namespace and cgroup: the runtime kills it with the container, and the clients
lose their MPS server under running workloads. A Pod per claim does not share the agent's
container, so it outlives it. NVIDIA's DRA driver does the same with a Deployment per claim,
``nodeName`` set to its node, a privileged container running ``nvidia-cuda-mps-control -f``
(NVIDIA/k8s-dra-driver-gpu, ``templates/mps-control-daemon.tmpl.yaml``); Tessera writes its own
Pod (:meth:`PodLauncher.manifest`):

* ``tessera-mps-<claim UID>`` in the agent's namespace (``--mps-pod-namespace``), labelled
  ``app.kubernetes.io/name: tessera-mps`` and ``mps.tessera.dev/claim-uid: <UID>`` so it is
  found again; ``spec.nodeName`` is the node (no scheduler involved), ``restartPolicy: Never``
  (``quit`` ends it for good; a daemon that dies is the agent's to notice, not the kubelet's
  to restart behind the checkpoint's back), every taint tolerated (a NoExecute taint must not
  take the MPS server from workloads that stay), ``system-node-critical`` as the agent's own;
* its one container runs the agent's ``nvidia-cuda-mps-control -f`` (foreground: the container
  lives as long as the daemon) from the driver root, mounted from the host at the path the
  agent sees it at, with the environment the agent's own runs get (PATH, LD_LIBRARY_PATH) and
  the daemon's (``CUDA_MPS_PIPE_DIRECTORY``, ``CUDA_MPS_LOG_DIRECTORY``,
  ``CUDA_VISIBLE_DEVICES``); privileged, as the agent is (the device cgroup: /dev/nvidia*);
* the claim's directory under ``--mps-root`` (pipe, log, shm) is a hostPath mounted at its own
  path: the agent talks to the daemon through the pipe directory, the CDI spec mounts it into
  the claim's containers by that host path; with private shared memory the claim's ``shm``
  directory is also the Pod's ``/dev/shm``.

Identity: the Pod's ``creationTimestamp`` is what the checkpoint records as the daemon's start
(``MpsRecord.started_at``): a Pod made again for the same claim has another. A Pod counts as
running while it exists, is not being deleted and has not ended (``Succeeded``/``Failed``).

RBAC: create, get, list and delete of pods in that namespace (deploy/daemonset/rbac.yaml, role
``tessera-mps``); no watch (one GET per question), no update or patch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from agent.logs import fields_
from dra_driver.cluster.kube import KubeClient
from dra_driver.errors import KubeConflict, KubeError, SharingError

APP = "tessera-mps"
CLAIM_LABEL = "mps.tessera.dev/claim-uid"
NAME_PREFIX = "tessera-mps-"
CONTAINER = "mps-control-daemon"
GRACE_S = 10
"""The Pod's termination grace: a daemon is sent ``quit`` before its Pod is deleted, so the
kubelet's SIGTERM only ever reaches one that did not take it."""


@dataclass(frozen=True)
class PodTemplate:
    """What every MPS Pod of this node has in common."""

    namespace: str
    node: str
    image: str
    mps_control: str
    """The tool's path as the agent sees it (under its driver root)."""
    driver_root: str
    """The driver root as the agent sees it; the Pod mounts it at the same path."""
    driver_root_on_host: str
    """Where the same files are on the host (the hostPath)."""
    root: str
    """``--mps-root``: the same path on the host and in the agent (the CDI specs need it)."""
    tool_env: Mapping[str, str]
    private_shm: bool


class PodLauncher:
    """:class:`dra_driver.sharing.mps_launch.MpsLauncher` with a Pod per claim (the module)."""

    def __init__(self, kube: KubeClient, template: PodTemplate, log: logging.Logger) -> None:
        self.kube = kube
        self.t = template
        self.log = log

    def _path(self, key: str | None = None) -> str:
        base = f"/api/v1/namespaces/{self.t.namespace}/pods"
        return base if key is None else f"{base}/{NAME_PREFIX}{key}"

    def manifest(self, key: str, env: Mapping[str, str], shm: Path) -> dict[str, Any]:
        """The claim's Pod (pure)."""
        directory = str(Path(self.t.root) / key)
        volumes: list[dict[str, Any]] = [
            {"name": "mps", "hostPath": {"path": directory, "type": "Directory"}},
            {
                "name": "driver-root",
                "hostPath": {"path": self.t.driver_root_on_host, "type": "Directory"},
            },
        ]
        mounts: list[dict[str, Any]] = [
            {"name": "mps", "mountPath": directory},
            {"name": "driver-root", "mountPath": self.t.driver_root, "readOnly": True},
        ]
        if self.t.private_shm:
            volumes.append({"name": "shm", "hostPath": {"path": str(shm), "type": "Directory"}})
            mounts.append({"name": "shm", "mountPath": "/dev/shm"})
        variables = {**self.t.tool_env, **env}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": NAME_PREFIX + key,
                "namespace": self.t.namespace,
                "labels": {
                    "app.kubernetes.io/name": APP,
                    "app.kubernetes.io/managed-by": "tessera",
                    CLAIM_LABEL: key,
                },
            },
            "spec": {
                "nodeName": self.t.node,
                "restartPolicy": "Never",
                "priorityClassName": "system-node-critical",
                "tolerations": [{"operator": "Exists"}],
                "terminationGracePeriodSeconds": GRACE_S,
                "automountServiceAccountToken": False,
                "enableServiceLinks": False,
                "containers": [
                    {
                        "name": CONTAINER,
                        "image": self.t.image,
                        "command": [self.t.mps_control, "-f"],
                        "env": [{"name": k, "value": v} for k, v in sorted(variables.items())],
                        "securityContext": {"privileged": True},
                        "volumeMounts": mounts,
                    }
                ],
                "volumes": volumes,
            },
        }

    # -- the launcher ------------------------------------------------------------------------
    def launch(self, key: str, env: Mapping[str, str], shm: Path) -> None:
        if not self.t.image:
            raise SharingError(
                "MPS claims need --mps-pod-image (TESSERA_MPS_POD_IMAGE) in kube mode: the image"
                " of the Pod that runs the claim's MPS control daemon (the agent's own image)",
                "mps_pod_error",
            )
        body = self.manifest(key, env, shm)
        try:
            try:
                self.kube.request("POST", self._path(), body=body)
            except KubeConflict:  # a Pod of an earlier start of this claim: replace it
                self._delete(key, grace=0)
                self.kube.request("POST", self._path(), body=body)
        except KubeError as exc:
            raise SharingError(
                f"cannot create the MPS Pod {NAME_PREFIX}{key} in namespace"
                f" {self.t.namespace}: {exc}",
                "mps_pod_error",
            ) from exc
        self.log.info(
            "MPS Pod created",
            extra=fields_(claim_uid=key, pod=NAME_PREFIX + key, namespace=self.t.namespace),
        )

    def started_at(self, key: str, pid: int) -> float | None:
        try:
            pod = self.kube.request("GET", self._path(key))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise SharingError(
                f"cannot read the MPS Pod {NAME_PREFIX}{key}: {exc}", "mps_pod_error"
            ) from exc
        meta = pod.get("metadata") or {}
        phase = (pod.get("status") or {}).get("phase")
        if meta.get("deletionTimestamp") or phase in ("Succeeded", "Failed"):
            return None
        created = str(meta.get("creationTimestamp", ""))
        try:
            return datetime.fromisoformat(created).timestamp()
        except ValueError:
            return None

    def found_at(self, key: str, pid: int) -> float | None:
        return self.started_at(key, pid)

    def kill(self, key: str, pid: int, *, force: bool) -> None:
        self._delete(key, grace=0 if force else None)

    def forget(self, key: str) -> None:
        self._delete(key, grace=None)

    def claim_keys(self) -> set[str]:
        """The claims with an MPS Pod on this node; none (logged) when the API cannot say."""
        query = {
            "labelSelector": f"app.kubernetes.io/name={APP}",
            "fieldSelector": f"spec.nodeName={self.t.node}",
        }
        try:
            pods = self.kube.request("GET", self._path(), query=query).get("items") or []
        except KubeError as exc:
            self.log.warning(
                "cannot list the MPS Pods; orphans stay until the next start",
                extra=fields_(error=str(exc)),
            )
            return set()
        return {
            str(p["metadata"]["labels"][CLAIM_LABEL])
            for p in pods
            if CLAIM_LABEL in ((p.get("metadata") or {}).get("labels") or {})
        }

    def describe(self, key: str) -> str:
        """The Pod's name and phase, and why it is not running where its status says."""
        name = f"Pod {self.t.namespace}/{NAME_PREFIX}{key}"
        try:
            pod = self.kube.request("GET", self._path(key))
        except KubeError as exc:
            return f"{name}: {exc}"
        status = pod.get("status") or {}
        why = [str(status.get("phase") or "Pending")]
        if status.get("message"):
            why.append(str(status["message"])[:300])
        for c in status.get("containerStatuses") or []:
            waiting = (c.get("state") or {}).get("waiting") or {}
            if waiting.get("reason"):
                why.append(f"{waiting['reason']}: {str(waiting.get('message', ''))[:300]}")
        return f"{name}: {'; '.join(why)}"

    def _delete(self, key: str, grace: int | None) -> None:
        body = None
        if grace is not None:
            body = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": grace}
        try:
            self.kube.request("DELETE", self._path(key), body=body)
        except KubeError as exc:
            if exc.status == 404:
                return
            raise SharingError(
                f"cannot delete the MPS Pod {NAME_PREFIX}{key}: {exc}", "mps_pod_error"
            ) from exc
