"""Lifecycle under load, with real daemons: a rolling update hands the state directory over
while the kubelet keeps calling, and SIGTERM during a storm of prepares leaves a checkpoint the
next start agrees with.

The kubelet is :class:`dra_driver.testkubelet.plugin_manager.PluginManager`: it registers every
plugin of
the driver it finds in the registry directory and sends each call to the newest connected one,
as kubelet 1.33+ does (docs/gpu-facts.md, "The kubelet and several plugins of a driver")."""

from __future__ import annotations

import json
import random
import signal
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dra_driver.errors import KubeletApiError
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from dra_driver.testkubelet.plugin_manager import PluginManager
from tests.integration.daemon import DRIVER, Daemon, claim_manifest, write_claims
from tests.integration.test_sharing import advertised

MODEL = "dgx-h100"
FAST = ("--telemetry-interval", "0.2")
REPAIRS = (
    "rolled back an interrupted prepare",
    "removed orphaned CDI spec",
    "restored the CDI spec of a prepared claim",
    "kept the CDI spec of a claim the checkpoint cannot vouch for: its devices stay held"
    " until the claim is unprepared or prepared again",
    "re-wrote the missing CDI spec of a prepared claim",
)
"""What a start's reconcile logs when it had to change something."""


def until(what: str, check: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)


def claims(state: Path, devices: list[str]) -> list[ClaimRef]:
    """One allocated claim per device, written where the standalone agent reads claims."""
    refs = [ClaimRef("default", f"c{i}", str(uuid.uuid4())) for i in range(len(devices))]
    write_claims(
        state,
        *[
            claim_manifest(r.name, r.uid, [("gpu", dev)], MODEL)
            for r, dev in zip(refs, devices, strict=True)
        ],
    )
    return refs


def prepared_on_disk(d: Daemon) -> dict[str, dict[str, Any]]:
    """The checkpoint's claims, after checking that it agrees with the CDI specs on disk:
    every claim is completed, has its spec (naming its devices), and no other spec exists."""
    cp: dict[str, dict[str, Any]] = d.checkpoint()["claims"]
    specs = sorted(name.split("claim_", 1)[1].removesuffix(".json") for name in d.cdi_files())
    assert specs == sorted(cp), "the CDI specs on disk are not the checkpoint's claims"
    for uid, entry in cp.items():
        assert entry["state"] == "PrepareCompleted", (uid, entry["state"])
        assert entry["devices"], uid
        spec = json.loads((d.cdi_dir / f"k8s.{DRIVER}-claim_{uid}.json").read_text())
        assert {dev["name"] for dev in spec["devices"]} >= {
            e["cdiDeviceIDs"][0].split("=", 1)[1] for e in entry["devices"]
        }
    return cp


def log_time(d: Daemon, msg: str) -> str:
    return str(d.wait_log(msg)["ts"])


@dataclass
class Kubelet:
    """Worker threads that prepare and unprepare their own claims in turn through the plugin
    manager, recording every failure and where each call went."""

    manager: PluginManager
    mine: list[list[ClaimRef]]
    prepared: dict[str, bool] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    done: list[int] = field(default_factory=list)
    """Calls answered, per worker."""
    sent_to: list[Path | None] = field(default_factory=list)
    """The endpoint each worker sent its latest call to."""
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        self.done = [0] * len(self.mine)
        self.sent_to = [None] * len(self.mine)
        for i in range(len(self.mine)):
            thread = threading.Thread(target=self._work, args=(i,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _work(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            claim = self.mine[i][n % len(self.mine[i])]
            prepare = not self.prepared.get(claim.uid, False)
            try:
                self.manager.sync()
                plugin = self.manager.pick()
                self.sent_to[i] = plugin.endpoint
                client = self.manager.client(plugin)
                call = client.prepare if prepare else client.unprepare
                error = call([claim], plugin.api)["claims"][claim.uid]["error"]
            except KubeletApiError as exc:
                error = str(exc)
            if error:
                self.failures.append(f"{'prepare' if prepare else 'unprepare'} {claim}: {error}")
            else:
                self.prepared[claim.uid] = prepare
            self.done[i] += 1
            n += 1

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)


def test_two_agents_hand_over_while_the_kubelet_keeps_preparing_and_unpreparing(short_tmp):
    """A rolling update: the new agent registers while the old one serves, the kubelet sends
    the new calls to it, they wait there until the old agent (SIGTERM) has answered its calls
    and released the state directory; no call fails, and the checkpoint holds exactly the
    claims left prepared, each with its CDI spec."""
    refs = claims(short_tmp, [f"gpu-{i}" for i in range(6)])
    old = Daemon(short_tmp, MODEL, *FAST, pod_uid=str(uuid.uuid4()))
    new = Daemon(short_tmp, MODEL, *FAST, pod_uid=str(uuid.uuid4()))
    manager = PluginManager(old.registry_dir, DRIVER)
    kubelet = Kubelet(manager, [refs[0:2], refs[2:4], refs[4:6]])
    try:
        old.start()
        manager.sync()
        kubelet.start()
        until("every worker had calls answered by the old agent", lambda: min(kubelet.done) >= 2)
        new.start(wait=False)
        waiting = new.wait_log("waiting for the state directory")
        assert f"of pod {old.pod_uid}" in waiting["holder"]
        # ready while it waits, or the DaemonSet would never delete the old pod
        with urllib.request.urlopen(waiting["healthz"].replace("/healthz", "/readyz")) as r:
            body = json.loads(r.read())
        assert r.status == 200 and body["checks"]["state-dir"].startswith("waiting for PID")
        until(
            "the kubelet sends every worker's calls to the new agent",
            lambda: all(e == new.dra_socket for e in kubelet.sent_to),
        )
        before = list(kubelet.done)  # every call the old agent got is answered by now
        assert old.proc is not None
        old.proc.send_signal(signal.SIGTERM)
        assert old.wait_exit() == 0
        new.wait_log("agent started")
        until(
            "every worker had three more calls answered by the new agent",
            lambda: all(d >= b + 3 for d, b in zip(kubelet.done, before, strict=True)),
        )
        kubelet.finish()
        assert kubelet.failures == []
        # the old agent let go before the new one took the directory (clocks of one machine)
        assert log_time(old, "released the state directory") <= log_time(
            new, "took over the state directory"
        )
        assert new.wait_log("took over the state directory")["previous"].endswith(
            f"of pod {old.pod_uid}"
        )
        assert not old.reg_socket.exists() and not old.dra_socket.exists()
        cp = prepared_on_disk(new)
        assert set(cp) == {uid for uid, yes in kubelet.prepared.items() if yes}
        assert new.stop() == 0
    finally:
        kubelet.finish()
        manager.close()
        new.kill()
        old.kill()


def test_sigterm_during_a_storm_of_prepares_leaves_a_consistent_checkpoint(short_tmp):
    """Many concurrent prepare calls (several claims per call, more claims than the preparer has
    workers), SIGTERM in the middle: claims are either fully prepared (completed in the
    checkpoint, with their CDI spec) or not at all, every claim a call was told is prepared is
    there, and the next start's reconcile finds nothing to repair."""
    rng = random.Random(20261201)
    d = Daemon(short_tmp, MODEL, *FAST)
    d.start("--sim-mig-layout", "all-1g")  # 8 GPUs x 7 MIG devices; the next start keeps them
    devices = sorted(dev["name"] for dev in advertised(d))
    assert len(devices) == 56, devices
    refs = claims(short_tmp, devices)
    told: set[str] = set()
    answers = [0]
    lock = threading.Lock()

    def storm(batch: list[ClaimRef]) -> None:
        with KubeletClient(d.dra_socket, timeout=45) as kubelet:
            for _ in range(3):  # the kubelet retries what failed
                try:
                    result = kubelet.prepare(batch)["claims"]
                except KubeletApiError:
                    return  # the agent is gone: nothing was answered
                with lock:
                    answers[0] += 1
                    told.update(uid for uid, r in result.items() if not r["error"])

    batches = [refs[i : i + 3] for i in range(0, len(refs), 3)]
    rng.shuffle(batches)
    # one batch is never sent, so the storm cannot be over before SIGTERM whatever the speed of a
    # prepare (calls of several claims share their checkpoint writes and are fast)
    held_back, batches = batches[0], batches[1:]
    threads = [threading.Thread(target=storm, args=(b,), daemon=True) for b in batches]
    try:
        for t in threads:
            t.start()
        until("the storm is under way", lambda: answers[0] >= 3 and bool(told))
        assert d.stop() == 0  # SIGTERM, then the in-flight claims finish
        for t in threads:
            t.join(60)
        stopped = d.wait_log("agent stopped")
        assert stopped["unfinished"] == []
        cp = prepared_on_disk(d)
        assert told <= set(cp), "a claim the kubelet was told is prepared is not in the checkpoint"
        assert cp and not {r.uid for r in held_back} & set(cp)
        d.start()  # the next start's reconcile agrees: nothing to roll back, remove or restore
        repairs = [r for r in d.logs if r.get("msg") in REPAIRS]
        assert repairs == []
        assert prepared_on_disk(d) == cp
        assert d.stop() == 0
    finally:
        d.kill()
