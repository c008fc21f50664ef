"""The agent's life as a process: one per state directory, JSON logs only, ready only while
reachable, and a shutdown that ends within its deadline."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest

from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.integration.daemon import Daemon, claim_manifest, write_claims
from tests.integration.test_daemon import wait_ready


def readyz(d: Daemon) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(d.metrics_url("/readyz"), timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read())


def test_every_stderr_line_is_json_when_the_checkpoint_is_corrupt(short_tmp):
    """The corrupt-checkpoint path logs from the checkpoint store (a module of the driver
    layer): its warning and the start-up lines all come out as JSON objects."""
    (short_tmp / "checkpoint.json").write_text('{"version": 1, "kind": "Checkp')
    d = Daemon(short_tmp, "dgx-h100").start()
    d.wait_log("checkpoint is corrupt; moved it aside and starting empty")
    assert d.stop() == 0
    assert d.raw, "the daemon wrote nothing"
    records = [json.loads(line) for line in d.raw]  # every line is one JSON object
    keys = {"ts", "level", "logger", "msg"}
    assert all(isinstance(r, dict) and keys <= r.keys() for r in records)
    moved = [r for r in records if r["msg"].startswith("checkpoint is corrupt")]
    assert moved[0]["logger"].startswith("tessera") and moved[0]["level"] == "warning"
    assert any(r["msg"] == "agent stopped" for r in records)


def test_a_second_agent_on_the_same_state_dir_is_refused_and_the_first_keeps_serving(short_tmp):
    first = Daemon(short_tmp, "dgx-h100").start()
    try:
        wait_ready(first.metrics_url("/readyz"))
        tessera = os.path.join(os.path.dirname(sys.executable), "tessera")
        env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
        second = subprocess.run(
            [tessera, "run", "--simulate", "dgx-h100", "--state-dir", str(short_tmp),
             "--metrics-address", "127.0.0.1:0", "--no-kube"],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        assert second.returncode == 2
        (line,) = second.stderr.splitlines()  # refused before it touched anything
        failed = json.loads(line)
        assert failed["msg"] == "agent cannot run" and failed["level"] == "error"
        assert f"PID {first.proc.pid}" in failed["error"]
        assert str(short_tmp / "agent.lock") in failed["error"]
        # the first agent never noticed: its sockets are there and it is still ready
        assert first.reg_socket.exists() and first.dra_socket.exists()
        assert readyz(first)[0] == 200
        with KubeletClient(first.dra_socket) as k:
            assert k.prepare([ClaimRef("default", "nope", "uid-nope")])["claims"]["uid-nope"]
    finally:
        first.kill()


def test_the_lock_dies_with_the_agent(short_tmp):
    """The kernel releases the lock of a killed agent: its successor starts at once."""
    d = Daemon(short_tmp, "l40s-pcie").start()
    d.kill()
    d.start()
    assert d.stop() == 0


@pytest.mark.parametrize("which", ["dra", "telemetry"])
def test_readyz_fails_when_one_of_our_sockets_is_gone(short_tmp, which):
    d = Daemon(short_tmp, "l40s-pcie").start()
    try:
        assert wait_ready(d.metrics_url("/readyz"))["checks"]["sockets"] == "serving"
        sock = d.dra_socket if which == "dra" else short_tmp / "telemetry.sock"
        sock.unlink()
        code, body = readyz(d)
        assert code == 503
        assert body["checks"]["sockets"] == f"socket gone or replaced: {sock}"
    finally:
        d.kill()


def test_shutdown_ends_within_its_deadline_and_the_next_start_rolls_the_claim_back(short_tmp):
    """A claim read that never answers holds a prepare worker. SIGTERM still ends the agent
    within --shutdown-timeout: the stuck claim is left to the next start."""
    from agent.sim.apiserver import ApiServer

    with ApiServer() as server:
        kubeconfig = str(server.kubeconfig(short_tmp / "kubeconfig"))
        d = Daemon(short_tmp, "dgx-h100", "--kubeconfig", kubeconfig, "--shutdown-timeout", "3")
        d.start()
        try:
            created = server.put_object(
                "resourceclaims", claim_manifest("stuck", "x", [("gpu", "gpu-1")], d.node)
            )
            ref = ClaimRef("default", "stuck", created["metadata"]["uid"])
            fault = server.faults.add("GET", r"/resourceclaims/stuck$", "slow:3600")
            answers: list[dict] = []

            def call() -> None:
                with KubeletClient(d.dra_socket) as k:
                    try:
                        answers.append(k.prepare([ref]))
                    except Exception as exc:  # the server goes away: any answer will do
                        answers.append({"error": str(exc)})

            caller = threading.Thread(target=call)
            caller.start()
            for _ in range(600):  # until the claim read hangs in the emulator
                if fault.remaining == 0:
                    break
                threading.Event().wait(0.05)
            assert fault.remaining == 0
            assert d.stop() == 0  # stop() waits for the exit (bounded by wait_exit's timeout)
            left = d.wait_log("claims still running at the shutdown deadline; the next start"
                              " rolls them back")  # fmt: skip
            assert left["claims"] == [f"default/stuck ({ref.uid})"]
            stopped = d.wait_log("agent stopped")
            assert stopped["unfinished"] == [f"claim {c}" for c in left["claims"]]
            caller.join(30)
            assert answers, "the kubelet's call got no answer at all"
        finally:
            d.kill()


def test_an_agent_never_takes_over_sockets_another_agent_serves(short_tmp):
    """Two agents with different state directories but the same kubelet directories: the
    second refuses to replace the live sockets (a stale socket file is still replaced)."""
    first = Daemon(short_tmp / "a", "l40s-pcie").start()
    try:
        tessera = os.path.join(os.path.dirname(sys.executable), "tessera")
        env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
        second = subprocess.run(
            [tessera, "run", "--simulate", "l40s-pcie", "--state-dir", str(short_tmp / "b"),
             "--metrics-address", "127.0.0.1:0", "--no-kube",
             "--kubelet-registry-dir", str(first.reg_socket.parent),
             "--kubelet-plugins-dir", str(first.dra_socket.parent.parent)],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        assert second.returncode == 2
        failed = json.loads(second.stderr.splitlines()[-1])
        assert failed["msg"] == "agent cannot run"
        assert "is served by another process" in failed["error"]
        assert str(first.dra_socket) in failed["error"]
        assert readyz(first)[0] == 200  # the first agent's sockets are untouched
    finally:
        first.kill()


def test_nothing_the_agent_creates_is_world_writable_under_umask_000(short_tmp):
    d = Daemon(short_tmp / "state", "l40s-pcie", "--cdi-root", str(short_tmp / "cdi"))
    d.umask = 0
    d.start()
    try:
        write_claims(d.state, claim_manifest("a", "uid-a", [("gpu", "gpu-1")], d.node))
        with KubeletClient(d.dra_socket) as k:
            assert k.prepare([ClaimRef("default", "a", "uid-a")])["claims"]["uid-a"]["error"] == ""
        created = [p for p in [d.state, *d.state.rglob("*"), short_tmp / "cdi",
                               *(short_tmp / "cdi").rglob("*")] if not p.is_symlink()]  # fmt: skip
        loose = [f"{p}: {stat.S_IMODE(p.stat().st_mode):o}" for p in created
                 if p.stat().st_mode & stat.S_IWOTH]  # fmt: skip
        assert loose == []
        assert stat.S_IMODE((short_tmp / "cdi").stat().st_mode) == 0o755
        assert stat.S_IMODE(d.state.stat().st_mode) == 0o750
    finally:
        d.kill()


def test_temp_files_left_by_a_crash_are_swept_at_start(short_tmp):
    d = Daemon(short_tmp, "l40s-pcie").start()
    d.kill()
    leftovers = [
        short_tmp / ".checkpoint.json.k3j2h1.tmp",
        short_tmp / "resourceslices" / ".l40s-pcie-x.yaml.a1b2.tmp",
        d.cdi_dir / ".k8s.gpu.tessera.dev-claim_uid-a.json.zz9.tmp",
    ]
    foreign = d.cdi_dir / ".k8s.nvidia.com-gpu.json.q1.tmp"  # another vendor's: not ours
    for p in [*leftovers, foreign]:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("half written")
    # the kill may also have left a real one (a slice file being written): it is swept too
    ours = {str(p) for p in short_tmp.rglob(".*.tmp") if p != foreign}
    assert {str(p) for p in leftovers} <= ours
    d.start()
    swept = {
        r["path"] for r in d.logs if r.get("msg") == "removed a temporary file left by a crash"
    }
    assert swept == ours
    assert not any(p.exists() for p in leftovers) and foreign.exists()
    d.kill()
