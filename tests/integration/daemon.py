"""A `tessera run --simulate` daemon as a real subprocess, with its sockets and files."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

DRIVER = "gpu.tessera.dev"


LIMIT_NOFILE = (
    "import os, resource, sys; n = int(sys.argv[1]);"
    " resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); os.execv(sys.argv[2], sys.argv[2:])"
)
"""Run argv[2:] with an open-file limit of argv[1] (soft and hard)."""


class Daemon:
    def __init__(
        self,
        state: Path,
        model: str,
        *extra: str,
        nofile: int | None = None,
        pod_uid: str | None = None,
        prefix: tuple[str, ...] = (),
    ) -> None:
        """``nofile``: run the daemon with this open-file limit (soft and hard). ``pod_uid``:
        run it with ``--rolling-update`` as the agent of that pod (its sockets carry the UID).
        ``prefix``: a command the daemon runs under (``unshare --pid --fork``: a container's
        PID namespace)."""
        self.prefix = prefix
        self.state = state
        self.model = model
        self.extra = list(extra)
        if pod_uid is not None:
            self.extra += ["--rolling-update", "--pod-uid", pod_uid]
        self.pod_uid = pod_uid
        self.nofile = nofile
        self.proc: subprocess.Popen[str] | None = None
        self.logs: list[dict[str, Any]] = []
        self.raw: list[str] = []
        """Every stderr line as written (the daemon's logs must all be JSON)."""
        self.umask: int | None = None
        """The daemon's umask (a test's); None: the test process's."""
        self.since = 0
        """Where :meth:`wait_log` starts looking in :attr:`logs`: a daemon shared by the tests of
        a module (:class:`SharedDaemon`) answers each test from the lines written in it."""
        self._reader: threading.Thread | None = None

    @property
    def node(self) -> str:
        return self.model  # the simulated model's host name

    @property
    def registry_dir(self) -> Path:
        return self.state / "kubelet" / "plugins_registry"

    @property
    def reg_socket(self) -> Path:
        part = f"-{self.pod_uid}" if self.pod_uid else ""
        return self.registry_dir / f"{DRIVER}{part}-reg.sock"

    @property
    def dra_socket(self) -> Path:
        part = f"-{self.pod_uid}" if self.pod_uid else ""
        return self.state / "kubelet" / "plugins" / DRIVER / f"dra{part}.sock"

    @property
    def cdi_dir(self) -> Path:
        return self.state / "cdi"

    def start(self, *extra: str, wait: bool = True, env: dict[str, str] | None = None) -> Daemon:
        """``env``: ``TESSERA_*`` variables for the daemon (the test's own are not passed)."""
        tessera = os.path.join(os.path.dirname(sys.executable), "tessera")
        env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")} | (env or {})
        args = [tessera, "run", "--simulate", self.model, "--state-dir", str(self.state),
                "--metrics-address", "127.0.0.1:0", *self.extra, *extra]  # fmt: skip
        if self.nofile is not None:  # set in the child by a small exec wrapper
            args = [sys.executable, "-c", LIMIT_NOFILE, str(self.nofile), *args]
        args = [*self.prefix, *args]
        if "--kubeconfig" not in args:
            args.append("--no-kube")
        self.logs = []
        self.raw = []
        self.since = 0
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            # no preexec_fn: that makes Python fork() instead of vfork(), and gRPC's fork
            # handlers in this process then wait forever for a test's gRPC thread that needs the
            # GIL the forking thread holds (seen as a hung worker in a full run)
            umask=-1 if self.umask is None else self.umask,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if wait:
            self.wait_log("agent started")
        return self

    def status(self, field: str) -> int:
        """A number from the daemon's /proc/<pid>/status (``Threads``)."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
        raise AssertionError(f"no {field} in /proc/{self.proc.pid}/status")

    def descriptors(self) -> int:
        """How many file descriptors the daemon has open."""
        assert self.proc is not None
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self.raw.append(line)
            try:
                self.logs.append(json.loads(line))
            except ValueError:
                self.logs.append({"msg": line.rstrip()})

    def wait_log(self, msg: str, timeout: float = 60, since: int | None = None) -> dict[str, Any]:
        """The first log record with message ``msg`` from line ``since`` on (default
        :attr:`since`), waiting up to ``timeout`` seconds for it."""
        first = self.since if since is None else since
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for rec in self.logs[first:]:
                if rec.get("msg") == msg:
                    return rec
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}: {self.logs[-5:]}")
            time.sleep(0.05)
        raise AssertionError(f"no log {msg!r} in {timeout}s")

    def metrics_url(self, path: str = "/readyz") -> str:
        """``http://host:port<path>`` of the running daemon (from its "agent started" line)."""
        return self.wait_log("agent started", since=0)["healthz"].replace("/healthz", path)

    def fault(self, *args: str) -> str:
        """``tessera sim fault --state-dir STATE ARGS`` on this daemon's simulated node, run in
        this process; asserts it succeeded and returns what it printed."""
        from agent.cli import main

        out, err = io.StringIO(), io.StringIO()
        code = main(["sim", "fault", "--state-dir", str(self.state), *args], {}, out, err)
        assert code == 0, err.getvalue()
        return out.getvalue()

    def scrape(self) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        """The daemon's /metrics, parsed: sample name -> {sorted label pairs: value}."""
        with urllib.request.urlopen(self.metrics_url("/metrics"), timeout=10) as r:
            text = r.read().decode()
        out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return out

    def wait_exit(self, timeout: float = 30) -> int:
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:  # hung: say where, for the next look
            stacks = self.stacks()
            self.proc.kill()
            said = list(self.logs)[-15:]
            raise AssertionError(
                f"the daemon did not exit within {timeout} s; its threads:\n{stacks}\n"
                f"its last log lines: {said}"
            ) from exc
        if self._reader is not None:
            self._reader.join(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return code

    def stacks(self) -> str:
        """Every thread's stack of the running daemon (``py-spy dump``, installed with the test
        extra; it needs ptrace rights over the daemon), or why there are none."""
        assert self.proc is not None
        spy = Path(sys.executable).parent / "py-spy"
        if not spy.exists():
            return f"(no stacks: {spy} is not installed)"
        try:
            done = subprocess.run(
                [str(spy), "dump", "--pid", str(self.proc.pid)],
                capture_output=True,
                text=True,
                timeout=20,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"(no stacks: py-spy: {exc})"
        return done.stdout + done.stderr

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.wait_exit() if self.proc is not None else 0
        self.proc.send_signal(signal.SIGTERM)
        return self.wait_exit()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.wait_exit()

    def checkpoint(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.state / "checkpoint.json").read_text())
        return data

    def cdi_files(self) -> list[str]:
        """The claims' CDI spec files (the base spec with the driver's files is not one)."""
        if not self.cdi_dir.exists():
            return []
        return sorted(p.name for p in self.cdi_dir.glob("*-claim_*.json"))

    def base_spec(self) -> dict[str, Any]:
        """The base CDI spec: the driver's files every prepared device names."""
        spec: dict[str, Any] = json.loads((self.cdi_dir / f"k8s.{DRIVER}-driver.json").read_text())
        return spec


def claim_manifest(
    name: str,
    uid: str,
    devices: list[tuple[str, str]],
    pool: str,
    namespace: str = "default",
    config: list[dict[str, Any]] | None = None,
    allocated: bool = True,
    reserved_for: list[tuple[str, str]] | None = None,
) -> dict[str, Any]:
    """A ResourceClaim with status.allocation: ``devices`` = [(request, device name)];
    ``reserved_for`` = [(pod name, pod uid)] adds ``status.reservedFor`` (the pods that use it)."""
    requests = sorted({r.split("/")[0] for r, _ in devices}) or ["gpu"]
    obj: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": uid},
        "spec": {
            "devices": {
                "requests": [
                    {"name": r, "exactly": {"deviceClassName": "gpu.tessera.dev"}} for r in requests
                ]
            }
        },
    }
    if allocated:
        obj["status"] = {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": r, "driver": DRIVER, "pool": pool, "device": d}
                        for r, d in devices
                    ],
                    "config": config or [],
                }
            }
        }
    if reserved_for:
        obj.setdefault("status", {})["reservedFor"] = [
            {"resource": "pods", "name": pod, "uid": uid} for pod, uid in reserved_for
        ]
    return obj


def write_claims(state: Path, *claims: dict[str, Any]) -> None:
    d = state / "resourceclaims"
    d.mkdir(parents=True, exist_ok=True)
    for c in claims:
        meta = c["metadata"]
        (d / f"{meta['namespace']}-{meta['name']}.yaml").write_text(yaml.safe_dump(c))


class SharedDaemon:
    """One daemon for the tests of a module that neither kill nor reconfigure it (a module-scoped
    fixture starts it and closes it): a daemon start costs about a second of CPU. Each test gets
    it through :meth:`lend`, which answers :meth:`Daemon.wait_log` from the test's own log lines
    and, after the test, checks that the test left the node as it found it: the daemon still
    running, no claim in the checkpoint, no claim's CDI spec (the claim files the test wrote are
    removed). A test that leaves anything fails in its teardown; the daemon is then stopped, and
    the module's later tests that want it fail naming that test."""

    def __init__(self, state: Path, model: str, *extra: str) -> None:
        self.daemon: Daemon | None = Daemon(state, model, *extra).start()
        self.state = state
        self.model = model
        self.spoiled_by = ""

    @contextlib.contextmanager
    def lend(self, test: str) -> Iterator[Daemon]:
        d = self.daemon
        if d is None:
            raise AssertionError(f"the shared {self.model} daemon was stopped: {self.spoiled_by}")
        d.since = len(d.logs)
        yield d
        claims = self.state / "resourceclaims"
        if claims.exists():
            shutil.rmtree(claims)
        left = self.left(d)
        if left:
            self.spoiled_by = f"{test} left {left}"
            self.close()
            raise AssertionError(f"the test left the shared {self.model} daemon unclean: {left}")

    @staticmethod
    def left(d: Daemon) -> list[str]:
        """What a test left on the daemon's node (empty: clean)."""
        if d.proc is None or d.proc.poll() is not None:
            return ["the daemon is not running"]
        left = [f"CDI spec {name}" for name in d.cdi_files()]
        checkpoint = d.state / "checkpoint.json"
        if checkpoint.exists():
            left += [f"checkpointed claim {uid}" for uid in d.checkpoint()["claims"]]
        return left

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.kill()
            self.daemon = None
