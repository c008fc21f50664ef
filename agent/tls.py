"""TLS material for the agent's network listeners and for the clients of them.

A listener's TLS is a certificate chain and its private key (PEM files), and optionally a CA
bundle: clients must then present a certificate it signed. The HTTP endpoint (``ssl``) and the
telemetry API's TCP listener (gRPC, which takes PEM bytes) both use :func:`load_server`; `tessera
top` uses :func:`load_client`. The files are read and checked once, with the ``ssl`` module, so a
wrong file is one :class:`ConfigError` at start naming the option and the file, rather than a
failed handshake for every client later.

Options are named after a prefix: ``TlsFiles(option="--metrics-tls")`` is ``--metrics-tls-cert``,
``--metrics-tls-key`` and ``--metrics-tls-client-ca``.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from agent.errors import ConfigError

MIN_VERSION = ssl.TLSVersion.TLSv1_2


@dataclass(frozen=True)
class TlsFiles:
    """The files of one listener (or client): PEM certificate chain, PEM private key, and the CA
    bundle that verifies the other side (a server's clients, or a client's server)."""

    cert: Path | None
    key: Path | None
    ca: Path | None = None
    option: str = "--tls"
    """The options' common prefix, for error messages (``--metrics-tls``)."""
    ca_suffix: str = "-client-ca"
    """How the CA option is named after the prefix (``-client-ca`` on a server, ``-ca`` on a
    client)."""

    def label(self, which: str) -> str:
        return self.option + (self.ca_suffix if which == "ca" else f"-{which}")


@dataclass(frozen=True)
class TlsMaterial:
    """Checked TLS files: the PEM bytes (for gRPC) and an ``ssl`` context (for sockets)."""

    files: TlsFiles
    cert_chain: bytes | None
    key: bytes | None
    ca: bytes | None
    context: ssl.SSLContext

    @property
    def verifies_peer(self) -> bool:
        """Whether the other side must present a certificate signed by ``ca``."""
        return self.ca is not None


def _read(files: TlsFiles, which: str, path: Path, marker: bytes, what: str) -> bytes:
    label = files.label(which)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read {path}: {exc.strerror or exc}") from exc
    if b"-----BEGIN " not in data or marker not in data:
        raise ConfigError(f"{label}: {path} is not a PEM file holding {what}")
    return data


def _no_password() -> bytes:
    """An encrypted key must not make OpenSSL prompt on the terminal: no password, so it fails."""
    return b""


def _load_pair(files: TlsFiles, context: ssl.SSLContext) -> tuple[bytes, bytes]:
    assert files.cert is not None and files.key is not None
    cert = _read(files, "cert", files.cert, b"CERTIFICATE-----", "a certificate")
    key = _read(files, "key", files.key, b"PRIVATE KEY-----", "a private key")
    if b"ENCRYPTED" in key:
        raise ConfigError(
            f"{files.label('key')}: {files.key} is encrypted; give an unencrypted private key"
            " (protect the file by its permissions or a Kubernetes Secret)"
        )
    try:
        context.load_cert_chain(files.cert, files.key, password=_no_password)
    except (ssl.SSLError, OSError) as exc:
        detail = getattr(exc, "reason", None) or str(exc)
        if "KEY_VALUES_MISMATCH" in str(exc):
            detail = "the key does not belong to the certificate"
        raise ConfigError(
            f"{files.label('cert')}/{files.label('key')}: {files.cert} and {files.key} are not a"
            f" usable certificate and private key ({detail})"
        ) from exc
    return cert, key


def _load_ca(files: TlsFiles, context: ssl.SSLContext) -> bytes:
    assert files.ca is not None
    ca = _read(files, "ca", files.ca, b"CERTIFICATE-----", "CA certificates")
    try:
        context.load_verify_locations(cafile=str(files.ca))
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            f"{files.label('ca')}: {files.ca} holds no usable CA certificate"
            f" ({getattr(exc, 'reason', None) or exc})"
        ) from exc
    return ca


def load_server(files: TlsFiles) -> TlsMaterial:
    """A listener's certificate and key (both required) and, optionally, the CA its clients'
    certificates must be signed by (then a client without one is refused at the handshake)."""
    if files.cert is None or files.key is None:
        missing = files.label("cert" if files.cert is None else "key")
        raise ConfigError(f"{missing} is required for TLS on this listener")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = MIN_VERSION
    cert, key = _load_pair(files, context)
    ca = None
    if files.ca is not None:
        ca = _load_ca(files, context)
        context.verify_mode = ssl.CERT_REQUIRED
    return TlsMaterial(files, cert, key, ca, context)


def load_client(files: TlsFiles) -> TlsMaterial:
    """A client's TLS: the CA that signed the server's certificate (unset: the system's trust
    store), and a certificate and key when the server asks for one (both or neither)."""
    if (files.cert is None) != (files.key is None):
        given, missing = ("cert", "key") if files.key is None else ("key", "cert")
        raise ConfigError(f"{files.label(given)} needs {files.label(missing)} as well")
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=None)
    context.minimum_version = MIN_VERSION
    cert = key = ca = None
    if files.cert is not None:
        cert, key = _load_pair(files, context)
    if files.ca is not None:
        ca = _load_ca(files, context)
    return TlsMaterial(files, cert, key, ca, context)
