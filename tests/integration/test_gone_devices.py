"""A prepared claim whose device the node no longer has (issue 23, item 5): a lost GPU, a change
of the node's model (another GPU under the same name), an administrator's MIG change. The
claim is kept until the kubelet unprepares it, and the agent says so: ``/readyz`` names it
(check ``gone-devices``), ``tessera_prepared_devices_gone`` counts it, a ``PreparedDeviceGone``
Node event is recorded once, and no energy or time is attributed to it from another GPU."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.integration.daemon import Daemon, claim_manifest, write_claims

DEADLINE_S = 30.0
GONE = "tessera_prepared_devices_gone"


def wait_for(what: str, check: Callable[[], bool], timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout}s: {what}")


def readyz(d: Daemon) -> tuple[int, dict[str, str]]:
    try:
        with urllib.request.urlopen(d.metrics_url("/readyz"), timeout=10) as r:
            return r.status, json.loads(r.read())["checks"]
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read())["checks"]


def gone_gauge(d: Daemon) -> float | None:
    values = list(d.scrape().get(GONE, {}).values())
    assert len(values) <= 1, values  # one series: the node's
    return values[0] if values else None


def claim_energy(d: Daemon, uid: str) -> list[float]:
    return [
        v
        for labels, v in d.scrape().get("tessera_claim_energy_joules_total", {}).items()
        if ("uid", uid) in labels
    ]


def gpu_energy(d: Daemon) -> float:
    return sum(d.scrape().get("tessera_gpu_energy_joules_total", {}).values())


def prepare(d: Daemon, k: KubeletClient, name: str, uid: str, device: str) -> None:
    write_claims(d.state, claim_manifest(name, uid, [("gpu", device)], d.node, namespace="ml"))
    res = k.prepare([ClaimRef("ml", name, uid)])
    assert res["claims"][uid]["error"] == "", res


def gone_events(d: Daemon) -> list[dict[str, Any]]:
    return [
        r
        for r in d.logs
        if r.get("msg") == "node event" and r.get("reason") == "PreparedDeviceGone"
    ]


def test_a_claim_on_a_removed_gpu_is_flagged_until_unprepared(short_tmp):
    d = Daemon(
        short_tmp, "dgx-h100", "--telemetry-interval", "0.2", "--rediscovery-debounce", "0.3",
        "--rediscovery-interval", "0",
    ).start()  # fmt: skip
    try:
        with KubeletClient(d.dra_socket) as k:
            wait_for("ready", lambda: readyz(d)[0] == 200)
            prepare(d, k, "held", "uid-held", "gpu-3")
            prepare(d, k, "other", "uid-other", "gpu-1")
            code, checks = readyz(d)
            assert code == 200 and checks["gone-devices"] == "every prepared device is on the node"
            assert gone_gauge(d) == 0.0
            uuid3 = d.checkpoint()["claims"]["uid-held"]["devices"][0]["gpuUUID"]

            d.fault("remove-gpu", "--gpu", "3")
            d.wait_log("node inventory changed")
            wait_for("the gauge counts it", lambda: gone_gauge(d) == 1.0)
            code, checks = readyz(d)
            # the claim stays (the kubelet unprepares it when its pod goes): not a reason to take
            # the agent out of service, as for an unrecovered claim; the check names it
            assert code == 200, checks
            detail = checks["gone-devices"]
            assert "ml/held" in detail and "uid-held" in detail and "gpu-3" in detail
            assert uuid3 in detail and "uid-other" not in detail
            wait_for("the node event", lambda: bool(gone_events(d)))
            (event,) = gone_events(d)
            assert event["type"] == "Warning"
            assert "ml/held" in event["message"] and "gpu-3" in event["message"]
            assert uuid3 in event["message"]

            res = k.unprepare([ClaimRef("ml", "held", "uid-held")])
            assert res["claims"]["uid-held"]["error"] == "", res
            assert gone_gauge(d) == 0.0
            assert readyz(d)[1]["gone-devices"] == "every prepared device is on the node"
        assert len(gone_events(d)) == 1  # once per device gone, not per re-read
    finally:
        d.kill()


def test_a_claim_prepared_before_the_node_model_changed_is_flagged_and_not_charged(short_tmp):
    # the same node name and state directory, another model: gpu-1 is now another GPU (its UUID
    # differs, its minor number is the same)
    d = Daemon(short_tmp, "dgx-h100", "--node-name", "gpu-node", "--telemetry-interval", "0.2")
    d.start()
    try:
        with KubeletClient(d.dra_socket) as k:
            write_claims(
                d.state,
                claim_manifest("held", "uid-held", [("gpu", "gpu-1")], "gpu-node", "ml"),
            )
            res = k.prepare([ClaimRef("ml", "held", "uid-held")])
            assert res["claims"]["uid-held"]["error"] == "", res
        old_uuid = d.checkpoint()["claims"]["uid-held"]["devices"][0]["gpuUUID"]
        assert d.stop() == 0
    finally:
        d.kill()

    d = Daemon(short_tmp, "l40s-pcie", "--node-name", "gpu-node", "--telemetry-interval", "0.2")
    d.start()
    try:
        assert "uid-held" in d.checkpoint()["claims"]  # kept: the kubelet has not unprepared it
        wait_for("the gauge counts it", lambda: gone_gauge(d) == 1.0)
        detail = readyz(d)[1]["gone-devices"]
        assert "uid-held" in detail and "gpu-1" in detail and old_uuid in detail
        wait_for("the node event", lambda: bool(gone_events(d)))
        # the sampler's ticks go on: the GPUs' energy grows (gpu-1's too), none of it is the
        # claim's (it was charged by minor number to the new gpu-1 before)
        first = gpu_energy(d)
        wait_for("the GPUs' energy grows", lambda: gpu_energy(d) > first > 0)
        assert claim_energy(d, "uid-held") in ([], [0.0])
        with KubeletClient(d.dra_socket) as k:
            res = k.unprepare([ClaimRef("ml", "held", "uid-held")])
            assert res["claims"]["uid-held"]["error"] == "", res
        assert gone_gauge(d) == 0.0
    finally:
        d.kill()


def test_a_claim_on_a_mig_device_an_admin_removed_is_flagged(short_tmp):
    d = Daemon(
        short_tmp, "dgx-a100", "--telemetry-interval", "0.2", "--rediscovery-interval", "0.3"
    ).start()
    try:
        with KubeletClient(d.dra_socket) as k:
            wait_for("ready", lambda: readyz(d)[0] == 200)
            cp_devices = sorted(
                n for n in _advertised(d) if n.startswith("gpu-0-mig-3g")
            )  # the balanced layout's 3g
            assert cp_devices, _advertised(d)
            prepare(d, k, "mig", "uid-mig", cp_devices[0])
            assert gone_gauge(d) == 0.0
            d.fault("mig-layout", "--gpu", "0", "--layout", "all-1g")
            wait_for("the gauge counts it", lambda: gone_gauge(d) == 1.0)
            detail = readyz(d)[1]["gone-devices"]
            assert "uid-mig" in detail and cp_devices[0] in detail
            wait_for("the node event", lambda: bool(gone_events(d)))
    finally:
        d.kill()


def _advertised(d: Daemon) -> list[str]:
    import yaml

    names = []
    for path in sorted((d.state / "resourceslices").glob("*.yaml")):
        s = yaml.safe_load(path.read_text()) or {}
        names += [dev["name"] for dev in s.get("spec", {}).get("devices", [])]
    return names
