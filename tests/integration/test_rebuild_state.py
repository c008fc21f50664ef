"""A corrupt checkpoint rebuilt from what survives, through the real daemon: the CDI specs, the
claims (standalone claim files, or the API-server emulator in kube mode) and the sharing
leftovers (MPS daemons, dynamic MIG instances, time-slices). Every claim is accounted for:
rebuilt with its namespace and name, or held and reported in /readyz and the metrics."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from agent.sim.apiserver import ApiServer
from dra_driver.testkubelet.calls import ClaimRef
from tests.integration.daemon import Daemon, claim_manifest
from tests.integration.test_sharing import claim, ok, placements, prepare, sharing_config, unprepare
from tests.simnode import mig_instances, mps_daemons, reap_mps_daemons, sharing


def readyz(d: Daemon, until_ready: bool = True) -> tuple[int, dict[str, str]]:
    """/readyz's status and checks (polled until it is ready, with a generous deadline)."""
    deadline = time.monotonic() + 30
    while True:
        code, checks = _readyz(d)
        if code == 200 or not until_ready or time.monotonic() > deadline:
            return code, checks
        time.sleep(0.1)


def _readyz(d: Daemon) -> tuple[int, dict[str, str]]:
    try:
        with urllib.request.urlopen(d.metrics_url("/readyz"), timeout=10) as r:
            code, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        with e:
            code, body = e.code, e.read()
    checks: dict[str, str] = json.loads(body)["checks"]
    return code, checks


def unrecovered_metric(d: Daemon) -> float:
    with urllib.request.urlopen(d.metrics_url("/metrics"), timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'^tessera_claims_unrecovered\{node="[^"]+"\} (\S+)$', text, re.MULTILINE)
    assert m is not None, "tessera_claims_unrecovered is not exposed"
    return float(m.group(1))


def corrupt(d: Daemon) -> None:
    (d.state / "checkpoint.json").write_text('{"version": 2, "claims": {"uid-')


def test_claims_of_every_kind_survive_a_corrupt_checkpoint(short_tmp):
    d = Daemon(short_tmp, "dgx-h100", "--mig-mode", "dynamic", "--sharing", "time-slicing",
               "--telemetry-interval", "0.2")  # fmt: skip
    d.start()
    try:
        mig_device = next(
            dev["name"]
            for dev in placements(d, 3)
            if dev["attributes"]["profile"]["string"] == "1g.10gb"
        )
        whole = claim(d, "whole", "gpu-0")
        sliced = claim(d, "sliced", "gpu-1", config=sharing_config("GpuConfig", "TimeSlicing",
                                                                    interval="Long"))  # fmt: skip
        thirty = sharing_config("GpuConfig", "MPS", activeThreadPercentage=30)
        mps = claim(d, "mps", "gpu-2", config=thirty)
        mig = claim(d, "mig", mig_device)
        lost = claim(d, "lost", "gpu-4")
        refs = (whole, sliced, mps, mig, lost)
        for ref in refs:
            ok(prepare(d, ref), ref)
        (daemon,) = mps_daemons(d.state / "sim", d.model)
        (instance,) = mig_instances(d.state / "sim", d.model, 3)
        d.kill()  # kill -9, then the checkpoint is damaged and one claim's file is gone
        corrupt(d)
        (d.state / "resourceclaims" / "default-lost.yaml").unlink()
        d.start()

        claims = d.checkpoint()["claims"]
        for ref in (whole, sliced, mps, mig):
            entry = claims[ref.uid]
            assert (entry["namespace"], entry["name"]) == ("default", ref.name)
            assert entry["rebuiltFrom"] == "cdi-spec+claim-files" and "recovered" not in entry
        assert claims[sliced.uid]["devices"][0]["interval"] == "Long"
        assert claims[mps.uid]["mps"]["pid"] == daemon.pid  # adopted, not started again
        assert claims[mig.uid]["devices"][0]["migUUID"] == instance.uuid
        assert claims[lost.uid]["recovered"] is True and claims[lost.uid]["name"] == ""
        rec = d.wait_log("cannot rebuild a prepared claim: its devices stay held until the"
                         " kubelet unprepares or prepares it")  # fmt: skip
        assert (rec["uid"], rec["reason"], rec["devices"]) == (lost.uid, "no_claim", "gpu-4")
        code, checks = readyz(d)
        assert code == 200, checks  # held, reported, and still serving (docs/reliability.md)
        assert checks["unrecovered-claims"].startswith("1 held but not rebuilt: uid-lost (no_claim")
        assert unrecovered_metric(d) == 1.0
        assert [x.pid for x in mps_daemons(d.state / "sim", d.model)] == [daemon.pid]
        assert sharing(d.state / "sim", d.model).gpus[1].timeslice == 3

        # meanwhile the held GPUs are never given out twice
        for name, device, holder in (("x", "gpu-0", "default/whole"), ("y", "gpu-4", "/ (uid-")):
            other = claim(d, name, device)
            error = prepare(d, other)[other.uid]["error"]
            assert f"{device} is already prepared for claim {holder}" in error, error

        for ref in refs:
            ok(unprepare(d, ref), ref)
        assert mps_daemons(d.state / "sim", d.model) == []
        assert mig_instances(d.state / "sim", d.model, 3) == ()
        assert sharing(d.state / "sim", d.model).gpus[1].timeslice == 0
        assert d.checkpoint()["claims"] == {} and d.cdi_files() == []
        assert unrecovered_metric(d) == 0.0
        assert readyz(d)[1]["unrecovered-claims"] == "every prepared claim is accounted for"
    finally:
        d.kill()
        reap_mps_daemons(d.state / "sim", d.model)


def test_in_kube_mode_the_names_come_from_the_api(short_tmp: Path) -> None:
    with ApiServer() as server:
        d = Daemon(short_tmp, "dgx-h100", "--kubeconfig", str(server.kubeconfig(short_tmp)))
        d.start()
        try:
            refs = []
            for ns, name, device in (("team-a", "train", "gpu-1"), ("team-b", "infer", "gpu-2")):
                obj = claim_manifest(name, f"uid-{name}", [("gpu", device)], d.node, ns)
                created: dict[str, Any] = server.put_object("resourceclaims", obj)
                refs.append(ClaimRef(ns, name, created["metadata"]["uid"]))
            for ref in refs:
                ok(prepare(d, ref), ref)
            d.kill()
            corrupt(d)
            server.delete_object("resourceclaims", refs[1].name, namespace=refs[1].namespace)
            d.start()
            claims = d.checkpoint()["claims"]
            rebuilt = claims[refs[0].uid]
            assert (rebuilt["namespace"], rebuilt["name"]) == ("team-a", "train")
            assert rebuilt["rebuiltFrom"] == "cdi-spec+api"
            assert claims[refs[1].uid]["recovered"] is True  # deleted from the API meanwhile
            (listed,) = [  # one cluster-wide list, in pages
                r
                for r in server.requests.snapshot()
                if r.path == "/apis/resource.k8s.io/v1/resourceclaims"
            ]
            assert (listed.method, listed.status, listed.params["limit"]) == ("GET", 200, "500")
            _, checks = readyz(d, until_ready=False)  # the emulator has no kubelet to register
            assert f"{refs[1].uid} (no_claim" in checks["unrecovered-claims"]
            assert unrecovered_metric(d) == 1.0
            ok(unprepare(d, refs[1]), refs[1])
            assert unrecovered_metric(d) == 0.0
            assert server.rejected == []
        finally:
            d.kill()
