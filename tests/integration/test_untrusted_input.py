"""Malformed input never kills a call or the agent: answers of the API server and claim files."""

from __future__ import annotations

import os
import threading
import urllib.request

import pytest

from agent.sim.apiserver import ApiServer
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.integration.daemon import Daemon, claim_manifest, write_claims


def metric(d: Daemon, name: str) -> float:
    with urllib.request.urlopen(d.metrics_url("/metrics"), timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith((name + "{", name + " ")):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exposed")


def prepare(d: Daemon, *refs: ClaimRef) -> dict:
    with KubeletClient(d.dra_socket) as k:
        return k.prepare(list(refs))["claims"]


def until(cond, d: Daemon, what: str) -> None:
    """Wait for ``cond`` (a hang guard of 60 s), failing at once if the daemon died."""
    for _ in range(1200):
        if cond():
            return
        assert d.proc is not None and d.proc.poll() is None, f"the agent died: {d.logs[-5:]}"
        threading.Event().wait(0.05)
    raise AssertionError(f"never: {what}")


@pytest.mark.parametrize("kind", ["garbage", "array", "bad-line"])
def test_a_malformed_answer_of_the_api_server_is_retried_not_fatal(short_tmp, kind):
    with ApiServer() as server:
        server.faults.add("GET", r"/resourceslices$", kind, times=2, query_regex="fieldSelector")
        d = Daemon(short_tmp, "dgx-h100", "--kubeconfig", str(server.kubeconfig(short_tmp)))
        d.start()
        try:
            # the agent lives on, publishes once the answers are good again, and counted them
            until(lambda: bool(server.objects("resourceslices")), d, "slices published")
            assert not server.faults.pending()
            assert metric(d, "tessera_resourceslice_errors_total") >= 1
            assert d.wait_log("publishing ResourceSlices failed, will retry")["temporary"] is True
            # a claim read that comes back malformed fails that claim, not the call or the agent
            created = server.put_object(
                "resourceclaims", claim_manifest("job", "x", [("gpu", "gpu-1")], d.node)
            )
            ref = ClaimRef("default", "job", created["metadata"]["uid"])
            server.faults.add(
                "GET", r"/resourceclaims/job$", "array" if kind == "array" else "garbage"
            )
            (answer,) = prepare(d, ref).values()
            assert "cannot read it" in answer["error"] and "MalformedResponse" in answer["error"]
            (answer,) = prepare(d, ref).values()  # the kubelet's retry
            assert answer["error"] == ""
        finally:
            d.kill()


BAD_FILES = {
    "not-a-mapping.yaml": "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: x\n",
    "huge-int.yaml": "kind: ResourceClaim\nspec: " + "9" * 5000 + "\n",
    "alias-bomb.yaml": (
        "kind: ResourceClaim\n"
        'a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]\n'
        + "".join(
            f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
            for p, c in zip("abcdefgh", "bcdefghi", strict=True)
        )
    ),
    "not-yaml.yaml": "kind: [unclosed\n",
    "binary.yaml": "\udcff",
}


def test_one_bad_claim_file_affects_only_what_it_holds(short_tmp):
    """Broken documents, huge integers, an alias bomb and a FIFO in resourceclaims/: every other
    claim still prepares, and a missing claim names the unreadable files."""
    d = Daemon(short_tmp, "dgx-h100").start()
    try:
        claims = short_tmp / "resourceclaims"
        write_claims(short_tmp, claim_manifest("good", "uid-good", [("gpu", "gpu-2")], d.node))
        for name, text in BAD_FILES.items():
            (claims / name).write_bytes(text.encode(errors="surrogateescape"))
        os.mkfifo(claims / "x.yaml")  # reading it would block forever
        answers = prepare(d, ClaimRef("default", "good", "uid-good"), ClaimRef("a", "b", "uid-b"))
        assert answers["uid-good"]["error"] == ""
        missing = answers["uid-b"]["error"]
        assert "claim a/b not found" in missing
        for name, why in [("x.yaml", "not a regular file"), ("alias-bomb.yaml", "aliases"),
                          ("huge-int.yaml", "5000 digits"), ("not-yaml.yaml", "not valid YAML"),
                          ("binary.yaml", "not UTF-8")]:  # fmt: skip
            assert f"{name}: " in missing and why in missing, (name, missing)
    finally:
        d.kill()


@pytest.mark.parametrize(
    ("results", "field"),
    [
        ([{"driver": "gpu.tessera.dev", "pool": "dgx-h100", "device": "gpu-0"}],
         "status.allocation.devices.results[0].request: missing"),
        ([{"request": "gpu", "driver": "gpu.tessera.dev", "pool": "dgx-h100", "device": 7}],
         "status.allocation.devices.results[0].device: expected a string, got an integer: 7"),
        ("nope", "status.allocation.devices.results: expected a list, got a string"),
        ([["gpu"]], "status.allocation.devices.results[0]: expected an object, got a list"),
    ],
    ids=["no-request", "device-number", "results-string", "result-list"],
)  # fmt: skip
def test_a_malformed_claim_is_an_error_for_that_claim_only(h100, results, field):
    d = h100
    bad = claim_manifest("bad", "uid-bad", [("gpu", "gpu-0")], d.node)
    bad["status"]["allocation"]["devices"]["results"] = results
    write_claims(d.state, bad, claim_manifest("ok", "uid-ok", [("gpu", "gpu-1")], d.node))
    ok = ClaimRef("default", "ok", "uid-ok")
    answers = prepare(d, ClaimRef("default", "bad", "uid-bad"), ok)
    assert field in answers["uid-bad"]["error"]
    assert answers["uid-ok"]["error"] == ""  # the other claim of the same call
    assert d.proc is not None and d.proc.poll() is None
    with KubeletClient(d.dra_socket) as k:
        assert k.unprepare([ok])["claims"] == {"uid-ok": {"error": ""}}


def test_slow_claim_reads_answer_before_the_kubelet_gives_up_and_never_hold_up_unprepare(
    short_tmp,
):
    """16 claims whose reads never answer: an unrelated unprepare is answered while they hang,
    and the 16 fail with the read's own timeout (shorter than the call's 40 s), not the call's."""
    with ApiServer() as server:
        kubeconfig = str(server.kubeconfig(short_tmp))
        d = Daemon(short_tmp, "dgx-h100", "--kubeconfig", kubeconfig, "--claim-read-timeout", "2")
        d.start()
        try:
            refs = []
            for i in range(16):
                created = server.put_object(
                    "resourceclaims",
                    claim_manifest(f"slow-{i}", f"uid-slow-{i}", [("gpu", "gpu-1")], d.node),
                )
                refs.append(ClaimRef("default", f"slow-{i}", created["metadata"]["uid"]))
            fault = server.faults.add("GET", r"/resourceclaims/slow-", "slow:3600", times=16)
            answers: dict = {}
            caller = threading.Thread(target=lambda: answers.update(prepare(d, *refs)))
            caller.start()
            until(lambda: fault.remaining < 16, d, "the claim reads hang")
            with KubeletClient(d.dra_socket) as k:
                done = k.unprepare([ClaimRef("default", "other", "uid-other")])["claims"]
            assert done["uid-other"]["error"] == ""
            assert caller.is_alive()  # the prepares still hang while the unprepare was answered
            caller.join(60)
            assert len(answers) == 16
            for answer in answers.values():
                assert "cannot read it" in answer["error"] and "timed out" in answer["error"]
        finally:
            d.kill()
