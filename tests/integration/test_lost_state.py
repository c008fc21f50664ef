"""Lost or corrupt state never gives a GPU out twice: CDI specs on disk are evidence."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.integration.daemon import DRIVER, Daemon, claim_manifest, write_claims


def gpu_claim(d: Daemon, name: str, uid: str, device: str) -> ClaimRef:
    write_claims(d.state, claim_manifest(name, uid, [("gpu", device)], d.node))
    return ClaimRef("default", name, uid)


def call(d: Daemon, op: str, ref: ClaimRef) -> str:
    with KubeletClient(d.dra_socket) as k:
        answer = (k.prepare if op == "prepare" else k.unprepare)([ref])
    return str(answer["claims"][ref.uid]["error"])


def specs_for(cdi: Path, device: str) -> list[str]:
    """The CDI spec files that expose ``device`` (whatever claim they belong to)."""
    found = []
    for path in sorted(cdi.glob(f"k8s.{DRIVER}-claim_*.json")):
        names = [d["name"] for d in json.loads(path.read_text())["devices"]]
        if any(n.endswith(f"-{device}") for n in names):
            found.append(path.name)
    return found


def daemon(tmp: Path) -> Daemon:
    """The CDI root outside the state directory, as on a real node (/var/run/cdi)."""
    return Daemon(tmp / "state", "dgx-h100", "--cdi-root", str(tmp / "cdi"))


def test_state_dir_lost_while_running_never_gives_the_gpu_out_twice(short_tmp):
    d = daemon(short_tmp)
    d.start()
    try:
        a = gpu_claim(d, "a", "uid-a", "gpu-0")
        assert call(d, "prepare", a) == ""
        d.kill()
        # the agent's state is lost (the simulated hardware under sim/ is not the agent's)
        for entry in d.state.iterdir():
            if entry.name not in ("sim", "resourceclaims"):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        d.start()
        # the claim file survived (resourceclaims/ is the cluster's, kept above): the claim is
        # rebuilt from its CDI spec with its name
        rec = d.wait_log("rebuilt a prepared claim from what survived")
        assert (rec["uid"], rec["claim"]) == ("uid-a", "default/a (uid-a)")
        b = gpu_claim(d, "b", "uid-b", "gpu-0")
        error = call(d, "prepare", b)
        assert "gpu-0 is already prepared for claim" in error and "uid-a" in error
        assert specs_for(short_tmp / "cdi", "gpu-0") == [f"k8s.{DRIVER}-claim_uid-a.json"]
        assert call(d, "prepare", a) == ""  # the kubelet's retry re-adopts the claim
        assert d.checkpoint()["claims"]["uid-a"]["name"] == "a"
        assert call(d, "unprepare", a) == "" and call(d, "prepare", b) == ""
        assert specs_for(short_tmp / "cdi", "gpu-0") == [f"k8s.{DRIVER}-claim_uid-b.json"]
    finally:
        d.kill()


def test_a_corrupt_checkpoint_keeps_the_devices_of_every_spec_on_disk(short_tmp):
    """A claim whose file is gone cannot be rebuilt (tests/integration/test_rebuild_state.py
    covers those that can): it is kept as recovered, holding its device."""
    d = daemon(short_tmp)
    d.start()
    try:
        a = gpu_claim(d, "a", "uid-a", "gpu-0")
        assert call(d, "prepare", a) == ""
        d.kill()
        (d.state / "checkpoint.json").write_text('{"version": 1, "claims": {')
        (d.state / "resourceclaims" / "default-a.yaml").unlink()
        d.start()
        b = gpu_claim(d, "b", "uid-b", "gpu-0")
        assert "already prepared for claim" in call(d, "prepare", b)
        assert specs_for(short_tmp / "cdi", "gpu-0") == [f"k8s.{DRIVER}-claim_uid-a.json"]
        recovered = d.checkpoint()["claims"]["uid-a"]
        assert recovered["recovered"] is True and recovered["devices"][0]["device"] == "gpu-0"
    finally:
        d.kill()


def test_a_deleted_spec_of_a_prepared_claim_is_written_again_on_the_next_prepare(short_tmp):
    d = daemon(short_tmp)
    d.start()
    try:
        a = gpu_claim(d, "a", "uid-a", "gpu-3")
        assert call(d, "prepare", a) == ""
        (spec,) = (short_tmp / "cdi").glob("*-claim_*.json")
        before = spec.read_text()
        spec.unlink()  # someone cleaned the CDI directory while the agent runs
        assert call(d, "prepare", a) == ""  # the kubelet asks again: the spec is back
        assert spec.read_text() == before
        d.wait_log("re-wrote the missing CDI spec of a prepared claim")
    finally:
        d.kill()


@pytest.mark.parametrize("spec", ["whole", "cut short"])
def test_specs_from_before_a_reboot_are_not_evidence(short_tmp, spec):
    """Specs are written without fsync (derived state): a power loss may leave one empty, and
    that one too is from before the boot."""
    d = daemon(short_tmp)
    d.start()
    try:
        a = gpu_claim(d, "a", "uid-a", "gpu-0")
        assert call(d, "prepare", a) == ""
        d.kill()
        (d.state / "checkpoint.json").unlink()
        if spec == "cut short":
            (written,) = (short_tmp / "cdi").glob(f"k8s.{DRIVER}-claim_*.json")
            stat = written.stat()
            written.write_bytes(b"")
            os.utime(written, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        (d.state / "sim" / "boot_id").unlink()  # the simulated node reboots
        d.start()
        rec = d.wait_log("removed orphaned CDI spec")
        assert rec["reason"] == "written before this boot"
        assert specs_for(short_tmp / "cdi", "gpu-0") == []
        b = gpu_claim(d, "b", "uid-b", "gpu-0")
        assert call(d, "prepare", b) == ""
    finally:
        d.kill()


def healthz(d: Daemon) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(d.metrics_url("/healthz"), timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode()


def test_healthz_fails_when_the_state_dir_or_a_socket_is_gone(short_tmp):
    """/healthz (the liveness probe) fails when a restart would repair something: the state
    directory deleted or replaced, or a socket the kubelet needs gone."""
    d = daemon(short_tmp)
    d.start()
    try:
        assert healthz(d) == (200, "ok\n")
        d.dra_socket.unlink()
        code, body = healthz(d)
        assert code == 503 and f"sockets: socket gone or replaced: {d.dra_socket}" in body
    finally:
        d.kill()
    d = daemon(short_tmp / "again")
    d.start()
    try:
        # the state directory's contents are gone; the publisher may not have made its
        # directory yet on a loaded machine (make test failed here once), and it is the lock
        # file that tells the agent its directory was replaced
        shutil.rmtree(d.state / "resourceslices", ignore_errors=True)
        (d.state / "agent.lock").unlink()
        code, body = healthz(d)
        assert code == 503 and f"state-dir: {d.state} was deleted or replaced" in body
    finally:
        d.kill()
