"""Rediscovery through the running daemon: GPUs leaving and returning (udev events from the
simulator), and an administrator's MIG change (seen by the periodic re-read), without a restart."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from agent.cli import main
from dra_driver.errors import KubeletApiError
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.integration.daemon import Daemon, claim_manifest, write_claims
from tests.k8sschema import validate as validate_k8s

VERSIONS = ("1.34.0", "1.35.0")
DEADLINE_S = 30.0


def sim(d: Daemon, *args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["sim", "fault", "--state-dir", str(d.state), *args], {}, out, err)
    return code, out.getvalue(), err.getvalue()


def slices(d: Daemon) -> list[dict[str, Any]]:
    out = []
    for path in sorted((d.state / "resourceslices").glob("*.yaml")):
        try:
            out.append(yaml.safe_load(path.read_text()))
        except (OSError, yaml.YAMLError):  # replaced while read: read again at the next poll
            return []
    return out


def devices(d: Daemon) -> dict[str, dict[str, Any]]:
    """The advertised devices by name, from the newest generation's slices."""
    found = [s for s in slices(d) if s]
    if not found:
        return {}
    newest = max(s["spec"]["pool"]["generation"] for s in found)
    return {
        dev["name"]: dev
        for s in found
        if s["spec"]["pool"]["generation"] == newest
        for dev in s["spec"].get("devices", [])
    }


def wait_for(what: str, check: Callable[[], bool], timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout}s: {what}")


def prepare(d: Daemon, k: KubeletClient, name: str, uid: str, device: str) -> None:
    write_claims(d.state, claim_manifest(name, uid, [("gpu", device)], d.node, namespace="ml"))
    res = k.prepare([ClaimRef("ml", name, uid)])
    assert res["claims"][uid]["error"] == "", res


def index_of(d: Daemon, name: str) -> int:
    return int(devices(d)[name]["attributes"]["index"]["int"])


class HealthWatch:
    """The kubelet's health stream, read in a thread: the latest device list."""

    def __init__(self, socket: Path) -> None:
        self.latest: dict[str, str] = {}
        self._client = KubeletClient(socket)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for devs in self._client.watch_health(timeout=120):
                self.latest = {x["deviceName"]: x["health"] for x in devs}
        except KubeletApiError:  # closed by the test, or the daemon went away
            return

    def close(self) -> None:
        self._client.close()


def test_a_removed_gpu_leaves_the_slices_and_returns_without_touching_other_claims(short_tmp):
    d = Daemon(
        short_tmp, "dgx-h100", "--telemetry-interval", "0.2", "--rediscovery-debounce", "0.3",
        "--rediscovery-interval", "0",  # only udev's events trigger here
    ).start()  # fmt: skip
    health = None
    try:
        wait_for("slices published", lambda: "gpu-3" in devices(d))
        with KubeletClient(d.dra_socket) as k:
            prepare(d, k, "other", "uid-other", "gpu-1")
            prepare(d, k, "held", "uid-held", "gpu-3")
            other_entry = d.checkpoint()["claims"]["uid-other"]
            (other_spec,) = d.cdi_dir.glob("*uid-other*.json")
            other_bytes = other_spec.read_bytes()
            uuid3 = devices(d)["gpu-3"]["attributes"]["uuid"]["string"]
            assert index_of(d, "gpu-4") == 4
            health = HealthWatch(d.dra_socket)
            wait_for("health stream", lambda: health.latest.get("gpu-3") == "HEALTHY")

            code, out, err = sim(d, "remove-gpu", "--gpu", "3")
            assert code == 0, err
            assert "GPU 3 removed" in out
            changed = d.wait_log("node inventory changed")  # not just withdrawn as lost
            wait_for(
                "GPU 4 re-indexed", lambda: "gpu-4" in devices(d) and index_of(d, "gpu-4") == 3
            )
            advertised = devices(d)
            assert sorted(advertised) == [f"gpu-{i}" for i in (0, 1, 2, 4, 5, 6, 7)]
            assert index_of(d, "gpu-4") == 3  # NVML indexes shift; names stay
            for s in slices(d):
                for version in VERSIONS:
                    validate_k8s(s, version)
            assert changed["gpus_removed"] == [uuid3]
            assert changed["devices_removed"] == ["gpu-3"]
            assert changed["gpus_added"] == [] and changed["devices_added"] == []

            # the claim on the removed GPU stays until unprepared, and the kubelet hears why
            wait_for("gpu-3 unhealthy", lambda: health.latest.get("gpu-3") == "UNHEALTHY")
            assert health.latest["gpu-1"] == "HEALTHY"
            assert "uid-held" in d.checkpoint()["claims"]
            # the other GPU's claim: untouched
            assert d.checkpoint()["claims"]["uid-other"] == other_entry
            assert other_spec.read_bytes() == other_bytes
            # a new claim cannot have the removed GPU
            write_claims(d.state, claim_manifest("late", "uid-late", [("gpu", "gpu-3")], d.node))
            res = k.prepare([ClaimRef("default", "late", "uid-late")])
            assert "gpu-3" in res["claims"]["uid-late"]["error"], res

            res = k.unprepare([ClaimRef("ml", "held", "uid-held")])
            assert res["claims"]["uid-held"]["error"] == "", res
            assert "uid-held" not in d.checkpoint()["claims"]

            code, out, err = sim(d, "add-gpu", "--gpu", "3")
            assert code == 0, err
            wait_for("gpu-3 back", lambda: "gpu-3" in devices(d))
            assert index_of(d, "gpu-4") == 4
            assert devices(d)["gpu-3"]["attributes"]["uuid"]["string"] == uuid3
            wait_for("gpu-3 healthy again", lambda: health.latest.get("gpu-3") == "HEALTHY")
            back = [r for r in d.logs if r.get("msg") == "node inventory changed"][-1]
            assert back["gpus_added"] == [uuid3] and back["devices_added"] == ["gpu-3"]
            assert back["rebound"] == [devices(d)["gpu-3"]["attributes"][
                "resource.kubernetes.io/pciBusID"]["string"]]  # fmt: skip

            assert d.checkpoint()["claims"]["uid-other"] == other_entry
            assert other_spec.read_bytes() == other_bytes
            res = k.unprepare([ClaimRef("ml", "other", "uid-other")])
            assert res["claims"]["uid-other"]["error"] == "", res
            assert not other_spec.exists()
    finally:
        if health is not None:
            health.close()
        d.kill()
    # one record per rediscovery that changed something: exactly the two
    assert len([r for r in d.logs if r.get("msg") == "node inventory changed"]) == 2


def test_an_admin_mig_change_on_a_static_node_is_re_advertised(short_tmp):
    d = Daemon(
        short_tmp, "dgx-a100", "--telemetry-interval", "0.2", "--rediscovery-interval", "0.3"
    ).start()
    try:
        wait_for("slices published", lambda: bool(devices(d)))
        before = sorted(n for n in devices(d) if n.startswith("gpu-0-"))
        assert len(before) == 4  # the balanced layout: 3g, 2g and two 1g

        code, out, err = sim(d, "mig-layout", "--gpu", "0", "--layout", "all-1g")
        assert (code, out) == (0, "GPU 0: MIG layout all-1g created\n"), err

        def seven_1g() -> bool:
            names = [n for n in devices(d) if n.startswith("gpu-0-")]
            return len(names) == 7 and all("-mig-1g5gb-19-" in n for n in names)

        wait_for("GPU 0 re-advertised as 7 x 1g.5gb", seven_1g)
        others = sorted(n for n in devices(d) if n.startswith("gpu-1-"))
        assert len(others) == 4  # the balanced layout on the other GPUs is unchanged
        for s in slices(d):
            for version in VERSIONS:
                validate_k8s(s, version)
        d.wait_log("node inventory changed")
        after = sorted(n for n in devices(d) if n.startswith("gpu-0-"))
        # an administrator's layout change is several NVML calls (as nvidia-smi's is), so a
        # re-read may fall between them: the records, in order, add up to the change, each
        # naming only what changed since the one before (make test saw two records once)
        records = [r for r in d.logs if r.get("msg") == "node inventory changed"]
        seen = set(before)
        for changed in records:
            assert changed["gpus_added"] == [] and changed["gpus_removed"] == []
            # periodic re-reads that find nothing new log nothing
            assert changed["devices_removed"] or changed["devices_added"]
            assert set(changed["devices_removed"]) <= seen
            assert not set(changed["devices_added"]) & seen
            seen = (seen - set(changed["devices_removed"])) | set(changed["devices_added"])
        assert sorted(n for n in seen if n.startswith("gpu-0-")) == after
        assert set(after) - set(before)  # 1g devices where the 3g and 2g were
    finally:
        d.kill()
