"""A stand-in for the kubelet's pod lifecycle, for the pods a node agent creates for itself.

The API-server emulator has no kubelet: a Pod bound to a node (``spec.nodeName``) stays
``Pending`` for ever. :class:`PodRunner` plays the kubelet of one node, for what the agent asks
of it (its MPS control daemons, docs/architecture.md "MPS in kube mode"):

* every ``sync_s`` it lists the Pods bound to its node (``fieldSelector=spec.nodeName=<node>``,
  all namespaces) over real HTTP, as the kubelet's relist does (the kubelet's PLEG relists
  every second, kubernetes pkg/kubelet/pleg/generic.go ``relistPeriod``);
* a new Pod's one container is run as a host process: its ``command`` + ``args`` with its
  ``env`` values, in a session of its own (outside the runner's process group and far from
  the agent's process tree), standard output and error to ``<log_dir>/<namespace>_<name>.log``;
  the Pod's status becomes ``Running`` with the container's ``running`` state (written through
  ``PUT .../status``, validated by the emulator against the upstream schemas);
* when the process exits, the Pod becomes ``Succeeded`` (exit 0) or ``Failed`` with the
  container's ``terminated`` state: ``restartPolicy`` other than ``Never`` is refused (this
  runner restarts nothing);
* when the Pod is deleted, or gets a ``deletionTimestamp``, its process group is sent SIGTERM,
  then SIGKILL after the Pod's grace (at most ``max_grace_s``), and a terminating Pod is then
  deleted with grace 0, as the kubelet's status manager does once its containers stopped.

What it cannot stand in for, it refuses (the Pod ``Failed``, its ``message`` says why): an image
is not pulled (the process runs on this machine's files), so every volume must be a
``hostPath`` mounted at its own path; more than one container, init containers and
``restartPolicy`` other than ``Never`` are refused. It is the simulator's (a test fixture, or
``tessera sim pods``): the agent only ever talks to the API server and cannot tell it from a
kubelet.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

Obj = dict[str, Any]
PASSED_ENV = ("PATH", "PYTHONPATH")
"""Of the runner's own environment, what its processes get besides the container's env: the
simulator's tools are Python scripts that import this package (a real container gets its PATH
from its image)."""


class PodRefused(Exception):
    """A Pod this runner cannot run as the kubelet would (the reason is its status message)."""


@dataclass
class _Running:
    namespace: str
    name: str
    uid: str
    proc: subprocess.Popen[bytes]
    started: str
    grace_s: float
    stopping_since: float | None = None


@dataclass
class PodRunner:
    """Runs the containers of the Pods bound to ``node`` as host processes (see the module)."""

    server: str
    """The API server's URL (``http://127.0.0.1:PORT``; the emulator asks no credentials)."""
    node: str
    log_dir: Path
    env: Mapping[str, str]
    """The runner's own environment (the caller's: nothing below the CLI reads it); its
    processes get only :data:`PASSED_ENV` of it."""
    sync_s: float = 0.05
    max_grace_s: float = 5.0
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("tessera.podrunner"))
    clock: Callable[[], float] = time.monotonic
    _pods: dict[str, _Running] = field(default_factory=dict)
    _done: set[str] = field(default_factory=set)
    """Pod UIDs whose container ran and ended (never run again: restartPolicy Never)."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> PodRunner:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._loop, name=f"podrunner-{self.node}")
        self._thread.start()
        return self

    def stop(self, *, kill: bool = True) -> None:
        """Stop syncing; ``kill``: end every process it runs (the node goes down)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if kill:
            for run in self._pods.values():
                _signal(run.proc, signal.SIGKILL)
                run.proc.wait(10)

    def __enter__(self) -> PodRunner:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def pids(self) -> dict[str, int]:
        """Pod UID -> the PID of its container's process, for those still running."""
        return {uid: r.proc.pid for uid, r in self._pods.items() if r.proc.poll() is None}

    # -- the sync loop -----------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except (OSError, ValueError) as exc:  # the API server away: try again next round
                self.log.warning("pod runner sync failed: %s", exc)
            self._stop.wait(self.sync_s)

    def sync(self) -> None:
        """One round: start new Pods, report exits, stop deleted ones."""
        selector = urllib.parse.urlencode({"fieldSelector": f"spec.nodeName={self.node}"})
        listed = {p["metadata"]["uid"]: p for p in self._get(f"/api/v1/pods?{selector}")["items"]}
        for uid, pod in listed.items():
            meta = pod["metadata"]
            if meta.get("deletionTimestamp"):
                self._terminate(uid, pod)
            elif uid not in self._pods and uid not in self._done:
                self._run(pod)
            elif uid in self._pods:
                self._refresh(self._pods[uid], pod)
        for uid in sorted(set(self._pods) - set(listed)):  # deleted: stop what is left
            self._terminate(uid, None)

    def _run(self, pod: Obj) -> None:
        meta = pod["metadata"]
        try:
            argv, env = container_command(pod, self.env)
        except PodRefused as exc:
            self._done.add(meta["uid"])
            self._write_status(pod, {"phase": "Failed", "reason": "Refused", "message": str(exc)})
            return
        out = self.log_dir / f"{meta['namespace']}_{meta['name']}.log"
        with out.open("ab") as sink:
            try:
                proc = subprocess.Popen(
                    argv, env=env, stdin=subprocess.DEVNULL, stdout=sink, stderr=sink,
                    cwd="/", start_new_session=True, close_fds=True,
                )  # fmt: skip
            except OSError as exc:
                self._done.add(meta["uid"])
                why = f"cannot run {argv[0]}: {exc.strerror or exc}"
                self._write_status(pod, {"phase": "Failed", "reason": "StartError", "message": why})
                return
        now = _now()
        grace = float(pod["spec"].get("terminationGracePeriodSeconds", 30))
        run = _Running(
            meta["namespace"], meta["name"], meta["uid"], proc, now, min(grace, self.max_grace_s)
        )
        self._pods[meta["uid"]] = run
        self.log.info("pod runner started %s/%s: pid %d", run.namespace, run.name, proc.pid)
        self._write_status(pod, self._status(pod, run))

    def _status(self, pod: Obj, run: _Running) -> Obj:
        container = pod["spec"]["containers"][0]
        code = run.proc.poll()
        state: Obj = {"running": {"startedAt": run.started}}
        phase = "Running"
        if code is not None:
            phase = "Succeeded" if code == 0 else "Failed"
            state = {
                "terminated": {
                    "exitCode": code if code >= 0 else 128 - code,
                    "reason": "Completed" if code == 0 else "Error",
                    "startedAt": run.started,
                    "finishedAt": _now(),
                }
            }
        return {
            "phase": phase,
            "startTime": run.started,
            "containerStatuses": [
                {
                    "name": container["name"],
                    "image": container.get("image", ""),
                    "imageID": "",
                    "ready": code is None,
                    "restartCount": 0,
                    "started": code is None,
                    "state": state,
                }
            ],
        }

    def _refresh(self, run: _Running, pod: Obj) -> None:
        """Write the Pod's phase where its status does not say it yet (its process exited, or
        an earlier write was refused); an exited process's Pod is then done."""
        status = self._status(pod, run)
        if (pod.get("status") or {}).get("phase") == status["phase"]:
            return
        if self._write_status(pod, status) and status["phase"] != "Running":
            self._done.add(run.uid)
            del self._pods[run.uid]

    def _terminate(self, uid: str, pod: Obj | None) -> None:
        """Stop a deleted (``pod`` None) or terminating Pod's process; a terminating Pod whose
        process ended is then deleted for good (grace 0)."""
        run = self._pods.get(uid)
        if run is not None and run.proc.poll() is None:
            if run.stopping_since is None:
                run.stopping_since = self.clock()
                _signal(run.proc, signal.SIGTERM)
                self.log.info("pod runner stopping %s/%s", run.namespace, run.name)
            elif self.clock() - run.stopping_since > run.grace_s:
                _signal(run.proc, signal.SIGKILL)
            return
        if run is not None:
            run.proc.wait()
            del self._pods[uid]
        self._done.add(uid)
        if pod is not None:
            meta = pod["metadata"]
            path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
            body = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0,
                    "preconditions": {"uid": uid}}  # fmt: skip
            with contextlib.suppress(urllib.error.HTTPError):  # gone already, or replaced
                self._call("DELETE", path, body)

    # -- HTTP --------------------------------------------------------------------------------
    def _write_status(self, pod: Obj, status: Obj) -> bool:
        """PUT the Pod's status; False when refused (a conflict or a deleted Pod: the next
        round tries again)."""
        meta = pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
        try:
            self._call("PUT", path, {**pod, "status": status})
        except urllib.error.HTTPError as exc:
            self.log.warning("pod runner cannot write %s: %s", path, exc)
            return False
        return True

    def _get(self, path: str) -> Obj:
        return self._call("GET", path, None)

    def _call(self, method: str, path: str, body: Obj | None) -> Obj:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=10) as resp:
            answer: Obj = json.loads(resp.read() or b"{}")
            return answer


def container_command(pod: Obj, outer: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of ``pod``'s container run on this machine; PodRefused for a
    Pod this runner cannot run as a kubelet would."""
    spec = pod.get("spec") or {}
    containers = spec.get("containers") or []
    if len(containers) != 1 or spec.get("initContainers"):
        raise PodRefused("the simulator's pod runner runs Pods of exactly one container")
    if spec.get("restartPolicy", "Always") != "Never":
        raise PodRefused("the simulator's pod runner restarts nothing: restartPolicy must be Never")
    c = containers[0]
    argv = [*c.get("command", []), *c.get("args", [])]
    if not argv:
        raise PodRefused("the container has no command (the runner pulls no image to find one)")
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    for m in c.get("volumeMounts") or []:
        host = (volumes.get(m["name"]) or {}).get("hostPath", {}).get("path")
        if host is None or os.path.normpath(host) != os.path.normpath(m["mountPath"]):
            raise PodRefused(
                f"volume {m['name']!r}: the simulator's pod runner runs containers on the host's"
                " own files, so a volume must be a hostPath mounted at its own path"
                f" (mountPath {m['mountPath']!r}, hostPath {host!r})"
            )
    env = {k: outer[k] for k in PASSED_ENV if k in outer}
    env.update({e["name"]: e.get("value", "") for e in c.get("env") or []})
    return argv, env


def _signal(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # its session's group: what it forked goes too


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
