"""``tessera budgets`` as real processes, two replicas, against the API-server emulator (real
HTTP): one becomes leader and the Lease says so; a leader killed with SIGKILL is replaced once its
lease expires; a leader stopped with SIGTERM releases the Lease and the other takes over at once.

Nothing here measures time: each step waits for the Lease's holder to change (bounded only so a
broken controller fails instead of hanging). The at-once handover is shown by the lease duration:
in that phase it is far longer than the test's patience, so only a release can hand it over.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.sim.apiserver import ApiServer
from tests.budgets import cluster
from tests.k8sschema import VERSIONS, validate

NS, LEASE = "tessera-system", "tessera-budgets"
PATIENCE_S = 60.0
"""How long a step may take before the test fails (never a measurement)."""


class Replica:
    def __init__(self, kubeconfig: Path, name: str, lease_duration: float) -> None:
        tessera = os.path.join(os.path.dirname(sys.executable), "tessera")
        env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
        env["POD_NAME"] = name  # what the Deployment's downward API sets
        self.name = name
        self.logs: list[dict[str, Any]] = []
        self.proc = subprocess.Popen(
            [tessera, "budgets", "--kubeconfig", str(kubeconfig),
             "--lease-duration", str(lease_duration), "--lease-renew-period", "0.5",
             "--lease-retry-period", "0.2", "--reconcile-interval", "1",
             "--metrics-address", "127.0.0.1:0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            try:
                self.logs.append(json.loads(line))
            except ValueError:
                self.logs.append({"msg": "NOT JSON", "line": line})

    def log(self, msg: str) -> dict[str, Any]:
        deadline = time.monotonic() + PATIENCE_S
        while time.monotonic() < deadline:
            for rec in list(self.logs):
                if rec.get("msg") == msg:
                    return rec
            time.sleep(0.05)
        raise AssertionError(f"{self.name}: no log {msg!r}: {self.logs[-5:]}")

    @property
    def identity(self) -> str:
        return str(self.log("budget controller starting")["identity"])

    def probe(self, path: str) -> tuple[int, str]:
        url = str(self.log("HTTP endpoint serving")["url"]) + path
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def metric(self, name: str) -> float:
        url = str(self.log("HTTP endpoint serving")["url"]) + "/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    return float(sample.value)
        raise AssertionError(f"no {name} in {url}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._reader.join(timeout=30)
        assert self.proc.stderr is not None
        self.proc.stderr.close()


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[ApiServer, Path]]:
    with cluster.server() as server:
        yield server, server.kubeconfig(tmp_path)


def holder(server: ApiServer) -> tuple[str, int]:
    lease = server.get_object("leases", LEASE, NS)
    if lease is None:
        return "", 0
    for version in VERSIONS:
        validate(lease, version)
    spec = lease["spec"]
    return str(spec.get("holderIdentity") or ""), int(spec.get("leaseTransitions") or 0)


def wait_holder(server: ApiServer, among: set[str]) -> tuple[str, int]:
    deadline = time.monotonic() + PATIENCE_S
    while time.monotonic() < deadline:
        who, transitions = holder(server)
        if who in among:
            return who, transitions
        time.sleep(0.05)
    raise AssertionError(f"the Lease's holder {holder(server)} never became one of {among}")


def test_one_replica_leads_and_a_killed_leader_is_replaced_after_its_lease_expires(
    api: tuple[ApiServer, Path],
) -> None:
    server, kubeconfig = api
    replicas = [Replica(kubeconfig, f"budgets-{i}", lease_duration=3) for i in range(2)]
    try:
        ids = {r.identity: r for r in replicas}
        assert all(i.startswith(r.name + "_") for i, r in ids.items())  # pod name + suffix
        first, transitions = wait_holder(server, set(ids))
        leader, standby = ids[first], next(r for r in replicas if r.identity != first)
        leader.log("became the leader")
        assert leader.metric("tessera_budget_leader") == 1
        assert standby.metric("tessera_budget_leader") == 0
        for r in (leader, standby):  # both serve their probes: a standby is ready, and alive
            assert r.probe("/healthz")[0] == 200
            status, body = r.probe("/readyz")
            assert status == 200 and ("standby" if r is standby else "leader") in body
        leader.proc.send_signal(signal.SIGKILL)  # no release: the lease must expire
        leader.proc.wait(timeout=30)
        _, after = wait_holder(server, {standby.identity})
        assert after == transitions + 1
        standby.log("became the leader")  # the Lease is written before the gauge is set
        assert standby.metric("tessera_budget_leader") == 1
    finally:
        for r in replicas:
            r.stop()
    assert all(rec.get("msg") != "NOT JSON" for r in replicas for rec in r.logs)


def test_a_leader_stopped_with_sigterm_hands_over_at_once(api: tuple[ApiServer, Path]) -> None:
    server, kubeconfig = api
    # a lease far longer than the test's patience: only a release can hand it over in time
    replicas = [Replica(kubeconfig, f"budgets-{i}", lease_duration=3600) for i in range(2)]
    try:
        ids = {r.identity: r for r in replicas}
        first, transitions = wait_holder(server, set(ids))
        leader, standby = ids[first], next(r for r in replicas if r.identity != first)
        standby.log("budget controller starting")
        leader.proc.send_signal(signal.SIGTERM)
        assert leader.proc.wait(timeout=PATIENCE_S) == 0
        assert leader.log("budget controller stopped")["released_lease"] is True
        _, after = wait_holder(server, {standby.identity})
        assert after == transitions + 1
    finally:
        for r in replicas:
            r.stop()
