"""The README's kube mode against the API-server emulator: what makes the agent ready there.

The agent publishes at once, but /readyz waits for a kubelet's registration; with no kubelet,
the README has the user do the handshake (`tessera kubelet info`). The test runs those steps
against a real daemon and checks the README says them, in that order."""

from __future__ import annotations

import io
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from agent.cli import main
from agent.sim.apiserver import ApiServer
from tests.integration.daemon import Daemon

README = Path(__file__).resolve().parents[2] / "README.md"


def readyz(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read())


def test_the_readme_says_how_kube_mode_on_the_emulator_becomes_ready():
    text = README.read_text()
    run = text.index("tessera run --simulate dgx-h100 --state-dir .run/kube --kubeconfig")
    waiting = text.index('"kubelet": "not registered (waiting for kubelet)"', run)
    info = text.index(
        "tessera kubelet info --socket .run/kube/kubelet/plugins_registry/gpu.tessera.dev-reg.sock",
        run,
    )
    ready = text.index('/readyz            # "ready": true', info)
    assert run < waiting < info < ready


def test_kube_mode_on_the_emulator_is_ready_once_registered_as_the_readme_says(short_tmp):
    with ApiServer() as server:
        kubeconfig = server.kubeconfig(short_tmp / "kubeconfig")
        agent = Daemon(short_tmp / "kube", "dgx-h100", "--kubeconfig", str(kubeconfig)).start()
        try:
            url = agent.metrics_url("/readyz")
            deadline = time.monotonic() + 60
            while "published" not in readyz(url)[1]["checks"].get("resourceslices", ""):
                assert time.monotonic() < deadline, readyz(url)
                time.sleep(0.1)
            code, body = readyz(url)
            assert (code, body["ready"]) == (503, False)
            assert body["checks"]["kubelet"] == "not registered (waiting for kubelet)"
            out, err = io.StringIO(), io.StringIO()
            argv = ["kubelet", "info", "--socket", str(agent.reg_socket)]
            assert main(argv, {}, out, err) == 0, err.getvalue()
            assert json.loads(out.getvalue())["registered"] is True
            # ready once every other check is too (the sampler's first ticks may still be due
            # on a loaded machine): polled, as a user re-runs curl
            code, body = readyz(url)
            while not body["ready"] and time.monotonic() < deadline:
                time.sleep(0.1)
                code, body = readyz(url)
            assert (code, body["ready"]) == (200, True), json.dumps(body["checks"])
            assert body["checks"]["kubelet"] != "not registered (waiting for kubelet)"
        finally:
            agent.kill()
