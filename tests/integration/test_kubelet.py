"""The kubelet's view: a real `tessera run --simulate` process driven over its unix sockets."""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Iterator

import pytest

from dra_driver.errors import KubeletApiError
from dra_driver.kubeletplugin.cdi_spec import validate_spec
from dra_driver.kubeletplugin.params import API_VERSION
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient, register_like_kubelet
from tests.integration.daemon import DRIVER, Daemon, claim_manifest, write_claims
from tests.integration.test_daemon import wait_ready
from tests.integration.test_sharing import sharing_config
from tests.simnode import sharing

CDI_KIND = f"k8s.{DRIVER}/claim"


@pytest.fixture
def own_h100(short_tmp) -> Iterator[Daemon]:
    """A dgx-h100 daemon of the test's own (it stops it, or changes what the kubelet knows)."""
    d = Daemon(short_tmp, "dgx-h100").start()
    yield d
    d.kill()


@pytest.fixture
def a100(short_tmp) -> Iterator[Daemon]:
    d = Daemon(short_tmp, "dgx-a100").start()
    yield d
    d.kill()


def gpu_claim(d: Daemon, name: str, uid: str, *devices: str, **kw) -> ClaimRef:
    write_claims(d.state, claim_manifest(name, uid, [("gpu", x) for x in devices], d.node, **kw))
    return ClaimRef("default", name, uid)


def prepare(d: Daemon, *claims: ClaimRef, api: str = "v1") -> dict:
    with KubeletClient(d.dra_socket) as k:
        return k.prepare(list(claims), api=api)["claims"]


def unprepare(d: Daemon, *claims: ClaimRef, api: str = "v1") -> dict:
    with KubeletClient(d.dra_socket) as k:
        return k.unprepare(list(claims), api=api)["claims"]


def test_registration_handshake_and_socket_hygiene(own_h100):
    h100 = own_h100
    result = register_like_kubelet(h100.reg_socket)
    assert result["registered"] and result["chosenVersion"] == "v1.DRAPlugin"
    info = result["info"]
    assert info["type"] == "DRAPlugin" and info["name"] == DRIVER
    assert info["endpoint"] == str(h100.dra_socket.absolute())
    assert info["supportedVersions"][:2] == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    h100.wait_log("registered with the kubelet")
    for sock in (h100.reg_socket, h100.dra_socket):
        mode = os.stat(sock).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o750
    assert h100.stop() == 0
    assert not h100.reg_socket.exists() and not h100.dra_socket.exists()


def test_refused_registration_is_logged_with_the_reason(own_h100):
    h100 = own_h100
    with KubeletClient(h100.reg_socket) as k:
        k.notify_registration(False, "plugin version not supported")
    rec = h100.wait_log("the kubelet refused the registration")
    assert rec["level"] == "error" and rec["reason"] == "plugin version not supported"


def test_stale_sockets_are_replaced(short_tmp):
    d = Daemon(short_tmp, "l40s-pcie")
    for sock in (d.reg_socket, d.dra_socket):
        sock.parent.mkdir(parents=True)
        sock.write_text("left over from a crash")
    d.start()
    try:
        assert register_like_kubelet(d.reg_socket)["registered"]
    finally:
        d.kill()


@pytest.mark.parametrize("api", ["v1", "v1beta1"])
def test_prepare_and_unprepare_a_whole_gpu(h100, api):
    ref = gpu_claim(h100, "train", "uid-train", "gpu-3")
    (res,) = prepare(h100, ref, api=api).values()
    assert res["error"] == ""
    assert res["devices"] == [
        {
            "requestNames": ["gpu"],
            "poolName": "dgx-h100",
            "deviceName": "gpu-3",
            "cdiDeviceIds": [f"{CDI_KIND}=uid-train-gpu-3", f"k8s.{DRIVER}/driver=common"],
        }
    ]
    (spec_file,) = h100.cdi_files()
    spec = json.loads((h100.cdi_dir / spec_file).read_text())
    validate_spec(spec)
    assert spec["kind"] == CDI_KIND and spec["cdiVersion"] == "0.5.0"
    (dev,) = spec["devices"]
    assert [n["path"] for n in dev["containerEdits"]["deviceNodes"]] == ["/dev/nvidia3"]
    env = spec["containerEdits"]["env"]
    assert "TESSERA_CLAIM_UID=uid-train" in env and "TESSERA_DEVICES=gpu-3" in env
    base = h100.base_spec()  # the driver's files, written at start
    validate_spec(base)
    assert base["devices"][0]["name"] == "common"
    assert any(
        m["containerPath"].endswith("/libcuda.so.1") for m in base["containerEdits"]["mounts"]
    )
    assert h100.checkpoint()["claims"]["uid-train"]["state"] == "PrepareCompleted"
    assert unprepare(h100, ref, api=api) == {"uid-train": {"error": ""}}
    assert h100.cdi_files() == [] and h100.checkpoint()["claims"] == {}


def test_static_mig_device_gets_its_caps(a100):
    ref = gpu_claim(a100, "mig", "uid-mig", "gpu-0-mig-1g5gb-19-2")
    (res,) = prepare(a100, ref).values()
    assert res["error"] == "" and res["devices"][0]["deviceName"] == "gpu-0-mig-1g5gb-19-2"
    spec = json.loads((a100.cdi_dir / a100.cdi_files()[0]).read_text())
    nodes = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
    assert nodes[0] == "/dev/nvidia0"
    assert len([n for n in nodes if n.startswith("/dev/nvidia-caps/nvidia-cap")]) == 2


def test_prepare_is_idempotent_and_unknown_unprepare_succeeds(h100):
    ref = gpu_claim(h100, "a", "uid-a", "gpu-0")
    first = prepare(h100, ref)
    assert prepare(h100, ref) == first
    assert unprepare(h100, ClaimRef("default", "ghost", "uid-ghost")) == {
        "uid-ghost": {"error": ""}
    }
    assert unprepare(h100, ref) == unprepare(h100, ref) == {"uid-a": {"error": ""}}


def test_same_claim_from_many_callers_at_once(h100):
    ref = gpu_claim(h100, "busy", "uid-busy", "gpu-1", "gpu-2")
    results: list[dict] = []
    lock = threading.Lock()

    def call() -> None:
        r = prepare(h100, ref)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 8 and all(r == results[0] for r in results)
    assert results[0]["uid-busy"]["error"] == ""
    assert len(h100.cdi_files()) == 1
    assert unprepare(h100, ref) == {"uid-busy": {"error": ""}}


def test_many_claims_in_one_call_and_one_device_twice(h100):
    refs = [gpu_claim(h100, f"c{i}", f"uid-c{i}", f"gpu-{i}") for i in range(6)]
    rival = gpu_claim(h100, "rival", "uid-rival", "gpu-0")
    res = prepare(h100, *refs, rival)
    assert set(res) == {r.uid for r in [*refs, rival]}  # every claim answered
    errors = {uid: r["error"] for uid, r in res.items() if r["error"]}
    assert len(errors) == 1  # gpu-0 went to exactly one of uid-c0 / uid-rival
    ((loser, message),) = errors.items()
    winner = "uid-c0" if loser == "uid-rival" else "uid-rival"
    assert "gpu-0" in message and winner in message and loser in message
    assert len(h100.cdi_files()) == 6
    done = [r for r in [*refs, rival] if r.uid != loser]
    assert unprepare(h100, *done) == {r.uid: {"error": ""} for r in done}


def test_bad_input_gets_a_per_claim_error(h100):
    ok = gpu_claim(h100, "fine", "uid-fine", "gpu-0")
    write_claims(
        h100.state,
        claim_manifest("mismatch", "uid-real", [("gpu", "gpu-1")], "dgx-h100"),
        claim_manifest("pending", "uid-pending", [], "dgx-h100", allocated=False),
        claim_manifest("elsewhere", "uid-elsewhere", [("gpu", "gpu-2")], "other-node"),
        claim_manifest("unknown", "uid-unknown", [("gpu", "gpu-99")], "dgx-h100"),
        claim_manifest(
            "badcfg", "uid-badcfg", [("gpu", "gpu-4")], "dgx-h100",
            config=[{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
                "apiVersion": API_VERSION, "kind": "GpuConfig", "turbo": True}}}],
        ),
    )  # fmt: skip
    refs = [
        ok,
        ClaimRef("default", "missing", "uid-missing"),
        ClaimRef("default", "mismatch", "uid-stale"),
        ClaimRef("default", "pending", "uid-pending"),
        ClaimRef("default", "elsewhere", "uid-elsewhere"),
        ClaimRef("default", "unknown", "uid-unknown"),
        ClaimRef("default", "badcfg", "uid-badcfg"),
    ]
    res = prepare(h100, *refs)
    assert res["uid-fine"]["error"] == ""
    expected = {
        "uid-missing": "not found",
        "uid-stale": "has UID 'uid-real'",
        "uid-pending": "is not allocated",
        "uid-elsewhere": "another node",
        "uid-unknown": "'gpu-99' is not advertised",
        "uid-badcfg": "unknown field(s) turbo",
    }
    for uid, needle in expected.items():
        assert needle in res[uid]["error"], (uid, res[uid])
        assert res[uid]["devices"] == []
    assert h100.proc is not None and h100.proc.poll() is None  # no crash
    assert len(h100.cdi_files()) == 1
    assert unprepare(h100, ok) == {"uid-fine": {"error": ""}}


def test_health_stream_lists_every_advertised_device(h100):
    with KubeletClient(h100.dra_socket) as k:
        (devices,) = list(k.watch_health(max_messages=1, timeout=10))
    assert [d["deviceName"] for d in devices] == [f"gpu-{i}" for i in range(8)]
    assert {d["health"] for d in devices} == {"HEALTHY"}
    assert all(d["poolName"] == "dgx-h100" for d in devices)


@pytest.mark.parametrize("point", ["after-started", "after-cdi", "after-completed"])
def test_kill_during_prepare_then_retry_is_consistent(short_tmp, point):
    d = Daemon(short_tmp, "dgx-h100").start("--sim-crash-at", point)
    ref = gpu_claim(d, "crashy", "uid-crashy", "gpu-5")
    try:
        with pytest.raises(KubeletApiError):
            prepare(d, ref)
        assert d.wait_exit() == -9
        d.extra = []
        d.start()  # restarted without the fault; the kubelet retries
        (res,) = prepare(d, ref).values()
        assert res["error"] == "" and res["devices"][0]["deviceName"] == "gpu-5"
        assert d.cdi_files() == [f"{CDI_KIND.split('/')[0]}-claim_uid-crashy.json"]
        assert d.checkpoint()["claims"]["uid-crashy"]["state"] == "PrepareCompleted"
        assert unprepare(d, ref) == {"uid-crashy": {"error": ""}}
        assert d.cdi_files() == []
    finally:
        d.kill()


def test_kill_during_unprepare_then_retry(short_tmp):
    d = Daemon(short_tmp, "dgx-h100").start("--sim-crash-at", "after-unprepare-commit")
    ref = gpu_claim(d, "late", "uid-late", "gpu-6")
    try:
        assert prepare(d, ref)["uid-late"]["error"] == ""
        with pytest.raises(KubeletApiError):
            unprepare(d, ref)
        assert d.wait_exit() == -9
        d.extra = []
        d.start()
        assert unprepare(d, ref) == {"uid-late": {"error": ""}}
        assert d.cdi_files() == [] and d.checkpoint()["claims"] == {}
    finally:
        d.kill()


def test_orphaned_cdi_specs_and_interrupted_prepares_are_cleaned_at_start(short_tmp):
    """A whole GPU's prepare has no durable start (its only effect is its CDI spec): a crash
    after the spec leaves a spec the checkpoint does not list, removed at start like any other
    orphan; a time-sliced claim's started record is rolled back (the time-slice reset)."""
    d = Daemon(short_tmp, "dgx-h100", "--sharing", "time-slicing")
    d.start("--sim-crash-at", "after-cdi")
    ref = gpu_claim(d, "half", "uid-half", "gpu-7")
    try:
        with pytest.raises(KubeletApiError):
            prepare(d, ref)
        d.wait_exit()
        orphan = d.cdi_dir / f"k8s.{DRIVER}-claim_uid-orphan.json"
        orphan.write_text("{}")
        assert len(d.cdi_files()) == 2 and d.checkpoint()["claims"] == {}
        d.start()
        d.wait_log("agent started")
        removed = {r.get("uid") for r in d.logs if r.get("msg") == "removed orphaned CDI spec"}
        assert removed == {"uid-half", "uid-orphan"}
        assert d.cdi_files() == [] and d.checkpoint()["claims"] == {}
        write_claims(
            d.state,
            claim_manifest(
                "sliced", "uid-sliced", [("gpu", "gpu-6")], "dgx-h100",
                config=[sharing_config("GpuConfig", "TimeSlicing", interval="Long")],
            ),
        )  # fmt: skip
        d.stop()
        d.start("--sim-crash-at", "after-cdi")
        with pytest.raises(KubeletApiError):
            prepare(d, ClaimRef("default", "sliced", "uid-sliced"))
        d.wait_exit()
        assert d.checkpoint()["claims"]["uid-sliced"]["state"] == "PrepareStarted"
        d.start()
        d.wait_log("rolled back an interrupted prepare")
        assert d.cdi_files() == [] and d.checkpoint()["claims"] == {}
        assert sharing(d.state / "sim", d.model).gpus[6].timeslice == 0
    finally:
        d.kill()


def test_corrupt_checkpoint_is_moved_aside_and_reported(short_tmp):
    short_tmp.joinpath("checkpoint.json").write_text('{"version": 1, "claims": {')
    d = Daemon(short_tmp, "dgx-h100").start()
    try:
        rec = d.wait_log(
            "checkpoint was corrupt; moved aside; claims whose CDI specs are on disk keep their"
            " devices"
        )
        moved = list(short_tmp.glob("checkpoint.json.corrupt-*"))
        assert len(moved) == 1 and moved[0].read_text() == '{"version": 1, "claims": {'
        assert rec["moved_to"] == str(moved[0])
        ref = gpu_claim(d, "after", "uid-after", "gpu-0")
        assert prepare(d, ref)["uid-after"]["error"] == ""
    finally:
        d.kill()


def test_kube_mode_reads_claims_from_the_api_server_and_waits_for_registration(short_tmp):
    import urllib.error
    import urllib.request

    from agent.sim.apiserver import ApiServer

    with ApiServer() as server:
        d = Daemon(short_tmp, "dgx-h100", "--kubeconfig", str(server.kubeconfig(short_tmp)))
        d.start()
        try:
            readyz = d.wait_log("agent started")["healthz"].replace("healthz", "readyz")
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(readyz, timeout=5)
            body = json.loads(e.value.read())
            e.value.close()
            assert body["checks"]["kubelet"].startswith("not registered")
            assert register_like_kubelet(d.reg_socket)["registered"]
            assert wait_ready(readyz)["checks"]["kubelet"] == "registered"

            claim = claim_manifest("job", "placeholder", [("gpu", "gpu-2")], "dgx-h100")
            created = server.put_object("resourceclaims", claim)
            uid = created["metadata"]["uid"]
            ref = ClaimRef("default", "job", uid)
            (res,) = prepare(d, ref).values()
            assert res["error"] == "" and res["devices"][0]["deviceName"] == "gpu-2"
            gone = prepare(d, ClaimRef("default", "nope", "uid-nope"))["uid-nope"]
            assert "not found" in gone["error"]
            assert server.rejected == []
        finally:
            d.kill()


def test_reboot_discards_prepared_state(short_tmp):
    d = Daemon(short_tmp, "dgx-h100").start()
    try:
        ref = gpu_claim(d, "before", "uid-before", "gpu-1")
        assert prepare(d, ref)["uid-before"]["error"] == ""
        assert d.stop() == 0
        (short_tmp / "sim" / "boot_id").unlink()  # the simulated node reboots
        d.start()
        d.wait_log("node rebooted since the checkpoint: prepared state discarded")
        assert d.cdi_files() == [] and d.checkpoint()["claims"] == {}
        assert prepare(d, ref)["uid-before"]["error"] == ""  # the kubelet prepares again
    finally:
        d.kill()


def test_a_deleted_cdi_spec_of_a_prepared_claim_is_restored_at_start(short_tmp):
    d = Daemon(short_tmp, "dgx-h100").start()
    try:
        ref = gpu_claim(d, "keep", "uid-keep", "gpu-4")
        assert prepare(d, ref)["uid-keep"]["error"] == ""
        (spec,) = d.cdi_files()
        before = (d.cdi_dir / spec).read_text()
        assert d.stop() == 0
        (d.cdi_dir / spec).unlink()  # someone cleaned the CDI directory
        d.start()
        assert d.wait_log("restored the CDI spec of a prepared claim")["reason"] == "it was missing"
        assert (d.cdi_dir / spec).read_text() == before
    finally:
        d.kill()
