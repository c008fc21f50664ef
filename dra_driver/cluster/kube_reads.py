"""JSON reads from the Kubernetes API over plain urllib3, for commands that only read.

:class:`dra_driver.cluster.kube.KubeClient` goes through the kubernetes client, whose import
alone costs about 0.5 s (1.4 s under load); ``tessera explain --kubeconfig`` must answer 64
nodes in 1.5 s. :class:`Reader` sends the same requests (``Accept: application/json``, the
bearer token, the kubeconfig's TLS settings, no retries of its own, the same (connect, read)
timeouts) and treats answers alike (:mod:`dra_driver.cluster.kube_answers`: the same body limit,
decoders and errors). It serves a kubeconfig :func:`~dra_driver.cluster.kubeconfig.read_kubeconfig`
reads; any other (exec plugins, auth providers) goes through KubeClient.
"""

from __future__ import annotations

import contextlib
import ssl
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import urllib3

from agent.errors import ConfigError
from dra_driver.cluster.kube_answers import DEFAULT_TIMEOUT, JSON, failed, json_object, read_body
from dra_driver.cluster.kubeconfig import Endpoint
from dra_driver.errors import KubeError


@contextlib.contextmanager
def _client_pem_files(endpoint: Endpoint) -> Iterator[tuple[Path | None, Path | None]]:
    """(certificate, key) files: the kubeconfig's, or its inline PEM data written to a private
    temporary directory for as long as ``ssl`` loads them (it reads only files)."""
    if endpoint.cert_pem is None and endpoint.key_pem is None:
        yield endpoint.cert_file, endpoint.key_file
        return
    with tempfile.TemporaryDirectory(prefix="tessera-kube-") as tmp:
        cert, key = endpoint.cert_file, endpoint.key_file
        if endpoint.cert_pem is not None:
            cert = Path(tmp) / "cert.pem"
            cert.write_bytes(endpoint.cert_pem)
        if endpoint.key_pem is not None:
            key = Path(tmp) / "key.pem"
            key.write_bytes(endpoint.key_pem)
        yield cert, key


def tls_context(endpoint: Endpoint) -> ssl.SSLContext:
    """The TLS settings of ``endpoint``; ConfigError naming what does not load."""
    ctx = ssl.create_default_context(
        cafile=None if endpoint.ca_file is None else str(endpoint.ca_file),
        cadata=endpoint.ca_pem,
    )
    if not endpoint.verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    with _client_pem_files(endpoint) as (cert, key):
        if (cert is None) != (key is None):
            raise ConfigError(
                "--kubeconfig: the user has a client certificate without a key, or a key without"
                " a certificate: both are needed"
            )
        if cert is not None:
            try:
                ctx.load_cert_chain(str(cert), None if key is None else str(key))
            except (ssl.SSLError, OSError) as exc:
                raise ConfigError(
                    f"--kubeconfig: the client certificate and key do not load: {exc}"
                ) from exc
    return ctx


class Reader:
    """GET requests of JSON objects (``request``, as KubeClient's) to one API server."""

    def __init__(self, endpoint: Endpoint, timeout: tuple[float, float] = DEFAULT_TIMEOUT) -> None:
        self._server = endpoint.server
        self._headers = {"Accept": JSON}
        if endpoint.token:
            self._headers["Authorization"] = f"Bearer {endpoint.token}"
        self._timeout = urllib3.Timeout(connect=timeout[0], read=timeout[1])
        tls: dict[str, Any] = {}
        if endpoint.server.startswith("https"):
            try:
                tls["ssl_context"] = tls_context(endpoint)
            except ssl.SSLError as exc:
                raise ConfigError(
                    f"--kubeconfig: the certificate authority does not load: {exc}"
                ) from exc
            if endpoint.tls_server_name:
                tls["server_hostname"] = endpoint.tls_server_name
            if not endpoint.verify:
                tls["cert_reqs"] = ssl.CERT_NONE
                tls["assert_hostname"] = False
        self._pool = urllib3.PoolManager(retries=False, **tls)

    def close(self) -> None:
        self._pool.clear()

    def request(
        self, method: str, path: str, query: Mapping[str, str] | None = None, *, fast: bool = False
    ) -> dict[str, Any]:
        """One request; the decoded JSON object (``fast``: decoded with orjson). Raises
        KubeError (KubeConflict for 409, KubeMalformed for an answer that is not a JSON
        object), as KubeClient.request does."""
        url = self._server + path + (f"?{urlencode(dict(query))}" if query else "")
        try:
            raw = self._pool.request(
                method, url, headers=self._headers, timeout=self._timeout, preload_content=False
            )
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise KubeError(0, "ConnectionError", str(exc), method, path) from exc
        try:
            if not 200 <= raw.status < 300:
                raise failed(raw, str(raw.reason), method, path)
            return json_object(read_body(raw, method, path) or b"{}", method, path, fast)
        finally:
            raw.release_conn()


__all__ = ["Reader", "tls_context"]
