"""The daemon as a real process: `tessera run --simulate` serves health, logs JSON, stops."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml


def start_daemon(state_dir: Path, *extra: str) -> subprocess.Popen[str]:
    tessera = os.path.join(os.path.dirname(sys.executable), "tessera")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    return subprocess.Popen(
        [tessera, "run", "--simulate", "dgx-h100", "--state-dir", str(state_dir),
         "--metrics-address", "127.0.0.1:0", "--no-kube", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def read_logs_until(proc: subprocess.Popen[str], msg: str, timeout: float = 60) -> list[dict]:
    assert proc.stderr is not None
    seen: list[dict] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise AssertionError(f"daemon exited ({proc.wait()}) before {msg!r}: {seen}")
        rec = json.loads(line)  # every line is one JSON object
        seen.append(rec)
        if rec["msg"] == msg:
            return seen
    raise AssertionError(f"no {msg!r} within {timeout}s")


def wait_ready(url: str, timeout: float = 30) -> dict:
    """Poll /readyz until 200; it is 503 until the first publish."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            e.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_daemon_serves_health_and_stops_on_signal(short_tmp, sig):
    tmp_path = short_tmp
    proc = start_daemon(tmp_path)
    try:
        logs = read_logs_until(proc, "agent started")
        gpus = [r for r in logs if r["msg"] == "discovered GPU"]
        assert [r["gpu"] for r in gpus] == list(range(8))
        assert gpus[0]["pci_bus_id"] == "0000:1b:00.0" and gpus[0]["numa_node"] == 0
        inventory = next(r for r in logs if r["msg"] == "node inventory")
        assert inventory["gpus"] == 8 and inventory["nics"] == 12
        arenas = next(r for r in logs if r["msg"] == "malloc arenas")  # glibc here
        assert arenas["limit"] == 2 and arenas["left_as_is"] is None
        healthz = logs[-1]["healthz"]
        with urllib.request.urlopen(healthz, timeout=5) as r:
            assert r.status == 200 and r.read() == b"ok\n"
        ready = wait_ready(healthz.replace("healthz", "readyz"))
        assert ready["checks"]["resourceslices"] == "published generation 1"
        slices = sorted((tmp_path / "resourceslices").glob("*.yaml"))
        assert len(slices) == 1
        obj = yaml.safe_load(slices[0].read_text())
        assert obj["spec"]["nodeName"] == "dgx-h100"
        assert len(obj["spec"]["devices"]) == 8
        proc.send_signal(sig)
        assert proc.wait(timeout=20) == 0
        assert proc.stderr is not None
        tail = [json.loads(line) for line in proc.stderr.read().splitlines()]
        assert tail[-1]["msg"] == "agent stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream:
                stream.close()
    # the simulated node's files live under the state dir, nowhere else
    assert (tmp_path / "sim" / "nvml-state.json").is_file()
    assert (tmp_path / "sim" / "sys" / "bus" / "pci" / "devices" / "0000:1b:00.0").is_symlink()


def test_daemon_refuses_a_busy_metrics_port(short_tmp):
    tmp_path = short_tmp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        tessera = os.path.join(os.path.dirname(sys.executable), "tessera")
        p = subprocess.run(
            [tessera, "run", "--simulate", "mixed", "--state-dir", str(tmp_path),
             "--metrics-address", f"127.0.0.1:{port}", "--no-kube"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert f"127.0.0.1:{port}" in p.stderr.splitlines()[-1]


def test_a_start_that_fails_half_way_exits_cleanly():
    """The kubelet socket path is too long: a clear error, exit 2, no hanging threads."""
    import shutil
    import tempfile

    state = Path(tempfile.mkdtemp(prefix="ts-" + "x" * 60, dir="/tmp"))
    try:
        tessera = os.path.join(os.path.dirname(sys.executable), "tessera")
        p = subprocess.run(
            [tessera, "run", "--simulate", "mixed", "--state-dir", str(state), "--no-kube",
             "--metrics-address", "127.0.0.1:0"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert p.returncode == 2, p.stderr[-2000:]
        last = p.stderr.strip().splitlines()[-1]
        assert "unix socket path" in last and "the limit is 107" in last
        assert "Traceback" not in p.stderr
        assert json.loads(p.stderr.strip().splitlines()[-2])["msg"] == "agent stopped"
    finally:
        shutil.rmtree(state, ignore_errors=True)
