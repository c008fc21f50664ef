"""A kubeconfig read without the kubernetes client (dra_driver.cluster.kubeconfig) and the plain
urllib3 reads it serves (dra_driver.cluster.kube_reads), against real HTTP servers."""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.errors import ConfigError
from agent.sim.apiserver import ApiServer
from dra_driver.cluster.kube_reads import Reader
from dra_driver.cluster.kubeconfig import Endpoint, read_kubeconfig
from dra_driver.errors import KubeError
from tests.tlscerts import Pki, make_pki


def kubeconfig(tmp_path: Path, cluster: dict[str, Any], user: dict[str, Any]) -> Path:
    path = tmp_path / "config" / "kubeconfig"
    path.parent.mkdir(exist_ok=True)
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "other", "cluster": {"server": "https://wrong"}},
                     {"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "ctx",
    }  # fmt: skip
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_current_contexts_server_and_static_credentials_are_read(tmp_path: Path) -> None:
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "token").write_text("s3cret\n")
    (tmp_path / "config" / "client.crt").write_text("cert")
    ca = base64.b64encode(b"-----BEGIN CERTIFICATE-----").decode()
    path = kubeconfig(
        tmp_path,
        {"server": "https://api.example:6443/", "certificate-authority-data": ca,
         "tls-server-name": "kubernetes"},
        {"tokenFile": "token", "client-certificate": "client.crt",
         "client-key-data": base64.b64encode(b"key").decode()},
    )  # fmt: skip
    assert read_kubeconfig(path) == Endpoint(
        server="https://api.example:6443",
        ca_pem="-----BEGIN CERTIFICATE-----",
        cert_file=tmp_path / "config" / "client.crt",
        key_pem=b"key",
        token="s3cret",
        tls_server_name="kubernetes",
    )


def test_plain_http_takes_no_certificates_and_insecure_turns_verification_off(
    tmp_path: Path,
) -> None:
    path = kubeconfig(
        tmp_path,
        {"server": "http://127.0.0.1:1", "insecure-skip-tls-verify": True},
        {"token": "t", "client-certificate": "missing.crt"},
    )
    assert read_kubeconfig(path) == Endpoint(server="http://127.0.0.1:1", verify=False, token="t")


@pytest.mark.parametrize(
    "user",
    [
        {"exec": {"command": "aws", "apiVersion": "client.authentication.k8s.io/v1"}},
        {"auth-provider": {"name": "oidc"}},
        {"username": "admin", "password": "pw"},
    ],
)
def test_credentials_only_the_kubernetes_client_loads_are_left_to_it(
    tmp_path: Path, user: dict[str, Any]
) -> None:
    assert read_kubeconfig(kubeconfig(tmp_path, {"server": "https://a"}, user)) is None


@pytest.mark.parametrize(
    ("change", "field", "problem"),
    [
        (lambda d: d.pop("current-context"), "current-context", "must be a non-empty string"),
        (lambda d: d.update({"current-context": "nope"}), "contexts", "no entry named 'nope'"),
        (lambda d: d["clusters"][1]["cluster"].pop("server"), "cluster.server", "non-empty"),
        (lambda d: d["clusters"][1]["cluster"].update({"certificate-authority-data": "%%"}),
         "cluster.certificate-authority-data", "is not base64"),
        (lambda d: d["users"][0]["user"].update({"tokenFile": "gone"}), "user.tokenFile",
         "is not a readable file"),
        (lambda d: d["clusters"][1]["cluster"].update({"insecure-skip-tls-verify": "yes"}),
         "cluster.insecure-skip-tls-verify", "must be true or false, not 'yes'"),
    ],
)  # fmt: skip
def test_a_bad_kubeconfig_names_the_file_and_the_field(
    tmp_path: Path, change: Any, field: str, problem: str
) -> None:
    path = kubeconfig(tmp_path, {"server": "https://a"}, {})
    doc = yaml.safe_load(path.read_text())
    change(doc)
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as exc:
        read_kubeconfig(path)
    assert f"--kubeconfig {path}: {field}: " in str(exc.value) and problem in str(exc.value)


def test_a_file_that_is_not_yaml_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text("clusters: [\n")
    with pytest.raises(ConfigError, match="is not a kubeconfig"):
        read_kubeconfig(path)


def test_reads_a_list_and_answers_a_missing_object_with_its_status(tmp_path: Path) -> None:
    with ApiServer() as server:
        server.put_object("nodes", {"metadata": {"name": "n1"}})
        endpoint = read_kubeconfig(server.kubeconfig(tmp_path))
        assert endpoint is not None
        reader = Reader(endpoint)
        try:
            listed = reader.request("GET", "/api/v1/nodes", {"limit": "1"}, fast=True)
            assert [n["metadata"]["name"] for n in listed["items"]] == ["n1"]
            with pytest.raises(KubeError) as exc:
                reader.request("GET", "/api/v1/nodes/n2")
            assert exc.value.status == 404 and exc.value.reason == "NotFound"
        finally:
            reader.close()
        assert [(r.method, r.path, r.query) for r in server.requests.snapshot()][-2:] == [
            ("GET", "/api/v1/nodes", "limit=1"),
            ("GET", "/api/v1/nodes/n2", ""),
        ]


@contextlib.contextmanager
def serving(server: http.server.HTTPServer, scheme: str) -> Iterator[str]:
    """``server`` answering on a thread of its own; its URL. Shut down and closed after."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{scheme}://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def busy() -> Iterator[tuple[str, list[str | None]]]:
    """A server that answers 429 with Retry-After; the Authorization headers it got."""
    seen: list[str | None] = []

    class Busy(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            body = b'{"kind":"Status","reason":"TooManyRequests","message":"slow down"}'
            self.send_response(429)
            self.send_header("Retry-After", "3")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    with serving(http.server.HTTPServer(("127.0.0.1", 0), Busy), "http") as url:
        yield url, seen


def test_the_token_is_sent_and_a_busy_server_s_wait_comes_back(
    busy: tuple[str, list[str | None]],
) -> None:
    url, seen = busy
    reader = Reader(Endpoint(server=url, token="s3cret"))
    with pytest.raises(KubeError) as exc:
        reader.request("GET", "/api/v1/nodes")
    reader.close()
    assert seen == ["Bearer s3cret"]
    error = exc.value
    assert (error.status, error.reason, error.retry_after) == (429, "TooManyRequests", 3.0)
    assert error.temporary


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[str, Pki]]:
    """An HTTPS server that requires a client certificate of ``pki``'s CA; answers a NodeList
    naming the client's certificate."""
    pki = make_pki(tmp_path / "pki")

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            peer = self.connection.getpeercert()
            subject = dict(x[0] for x in peer["subject"])
            body = json.dumps({"kind": "NodeList", "items": [], "client": subject}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca))
    ctx.load_cert_chain(str(pki.server_cert), str(pki.server_key))
    ctx.verify_mode = ssl.CERT_REQUIRED
    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    with serving(server, "https") as url:
        yield url, pki


def test_https_with_the_kubeconfig_s_authority_and_client_certificate(
    tmp_path: Path, tls_server: tuple[str, Pki]
) -> None:
    url, pki = tls_server
    ca = base64.b64encode(pki.ca.read_bytes()).decode()
    path = kubeconfig(
        tmp_path,
        {"server": url, "certificate-authority-data": ca,
         "tls-server-name": "localhost"},
        {"client-certificate": str(pki.client_cert),
         "client-key-data": base64.b64encode(pki.client_key.read_bytes()).decode()},
    )  # fmt: skip
    endpoint = read_kubeconfig(path)
    assert endpoint is not None
    reader = Reader(endpoint)
    try:
        got = reader.request("GET", "/api/v1/nodes")
    finally:
        reader.close()
    assert got["kind"] == "NodeList" and got["client"]["commonName"]


def test_https_with_another_authority_is_a_connection_error(
    tmp_path: Path, tls_server: tuple[str, Pki]
) -> None:
    url, pki = tls_server
    path = kubeconfig(
        tmp_path,
        {"server": url, "certificate-authority": str(pki.other_ca)},
        {"client-certificate": str(pki.client_cert), "client-key": str(pki.client_key)},
    )
    endpoint = read_kubeconfig(path)
    assert endpoint is not None
    reader = Reader(endpoint)
    with pytest.raises(KubeError) as exc:
        reader.request("GET", "/api/v1/nodes")
    reader.close()
    assert exc.value.status == 0 and exc.value.temporary
    assert "CERTIFICATE_VERIFY_FAILED" in str(exc.value)
