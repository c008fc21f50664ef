import json
import urllib.error
import urllib.request

import pytest

from agent.http import HttpEndpoint, Readiness


@pytest.fixture
def endpoint():
    readiness = Readiness()
    ep = HttpEndpoint("127.0.0.1", 0, readiness)
    ep.start()
    yield ep
    ep.stop()


def get(ep, path):
    host, port = ep.address
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_healthz_is_ok(endpoint):
    assert get(endpoint, "/healthz") == (200, b"ok\n")


def test_readyz_is_503_until_every_check_passes(endpoint):
    status, body = get(endpoint, "/readyz")
    assert status == 503  # no checks registered yet: not ready
    state = {"ok": False}
    endpoint.readiness.add("inventory", lambda: (True, "node discovered"))
    endpoint.readiness.add("kubelet", lambda: (state["ok"], "registered" if state["ok"] else "no"))
    status, body = get(endpoint, "/readyz")
    assert status == 503
    assert json.loads(body)["checks"]["kubelet"] == "no"
    state["ok"] = True
    status, body = get(endpoint, "/readyz")
    assert status == 200 and json.loads(body)["ready"] is True


def test_unknown_path_is_404(endpoint):
    assert get(endpoint, "/nope")[0] == 404
