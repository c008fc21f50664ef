"""A kubeconfig's server and static credentials, read without the kubernetes client.

Why not ``kubernetes.config.load_kube_config``: ``import kubernetes`` imports the whole client
(every model and API class, about 0.5 s on a quiet machine and over a second under load), which
alone would spend a third of ``tessera explain --kubeconfig``'s 1.5 s on 64 nodes. A kubeconfig
is a small YAML document (PyYAML reads it); the fields read here are those the kubernetes
client's loader (``kubernetes/config/kube_config.py``: ``KubeConfigLoader``) turns into its
configuration for static credentials, with its meaning:

- the context ``current-context`` names, its ``cluster`` and ``user`` entries;
- the cluster's ``server`` (a trailing ``/`` dropped), ``certificate-authority-data`` (base64
  PEM) or ``certificate-authority`` (a file), ``insecure-skip-tls-verify``, ``tls-server-name``;
- the user's ``client-certificate-data``/``client-key-data`` (base64 PEM) or
  ``client-certificate``/``client-key`` (files), all only for an ``https`` server, as the
  client's loader reads them; ``token``, else ``tokenFile``.

Relative file names are relative to the kubeconfig's directory, as the client takes them.
Anything else that authenticates (``exec`` plugins, ``auth-provider``, ``username``/``password``)
or routes (``proxy-url``) is the kubernetes client's to do: :func:`read_kubeconfig` answers None
and the caller uses :class:`dra_driver.cluster.kube.KubeClient` as before.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from agent.errors import ConfigError

NEEDS_CLIENT = {
    "exec": "an exec credential plugin",
    "auth-provider": "an auth provider",
    "username": "basic authentication",
    "password": "basic authentication",
}
"""User fields only the kubernetes client's loader handles."""


@dataclass(frozen=True)
class Endpoint:
    """Where the API server is and how to talk to it."""

    server: str
    verify: bool = True
    ca_file: Path | None = None
    ca_pem: str | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    cert_pem: bytes | None = None
    key_pem: bytes | None = None
    token: str | None = None
    tls_server_name: str | None = None


class _Reader:
    """One kubeconfig file's fields; every error names the file and the field."""

    def __init__(self, path: Path, hint: str) -> None:
        self.path = path
        self.hint = hint

    def error(self, field: str, problem: str) -> ConfigError:
        return ConfigError(f"cannot load --kubeconfig {self.path}: {field}: {problem}; {self.hint}")

    def mapping(self, value: Any, field: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.error(field, f"must be a mapping, not {type(value).__name__}")
        return value

    def text(self, value: Any, field: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.error(field, f"must be a non-empty string, not {value!r}")
        return value

    def named(self, doc: dict[str, Any], section: str, name: str, key: str) -> dict[str, Any]:
        """The ``key`` mapping of the entry of list ``section`` called ``name``."""
        entries = doc.get(section) or []
        if not isinstance(entries, list):
            raise self.error(section, f"must be a list, not {type(entries).__name__}")
        for i, entry in enumerate(entries):
            entry = self.mapping(entry, f"{section}[{i}]")
            if entry.get("name") == name:
                return self.mapping(entry.get(key) or {}, f"{section}[{i}].{key}")
        raise self.error(section, f"no entry named {name!r}")

    def file(self, value: Any, field: str) -> Path:
        path = Path(self.text(value, field)).expanduser()
        path = path if path.is_absolute() else self.path.parent / path
        if not path.is_file():
            raise self.error(field, f"{path} is not a readable file")
        return path

    def pem(self, value: Any, field: str) -> bytes:
        try:
            return base64.b64decode(self.text(value, field), validate=True)
        except (binascii.Error, ValueError):
            raise self.error(field, "is not base64 (of PEM data)") from None


def read_kubeconfig(
    path: Path, hint: str = "pass --kubeconfig FILE, or --no-kube to run standalone"
) -> Endpoint | None:
    """The endpoint of ``path``'s current context, or None when its user needs the kubernetes
    client's loader (module doc). ConfigError naming the file and the field when it cannot be
    read; ``hint`` ends the message (what the command's user can do)."""
    r = _Reader(path, hint)
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot load --kubeconfig {path}: {exc}; {hint}") from exc
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"--kubeconfig: {path} is not a kubeconfig (YAML with clusters, users and"
            f" contexts): {type(exc).__name__}: {' '.join(str(exc).split())}"
        ) from exc
    doc = r.mapping(doc, "<root>")
    name = r.text(doc.get("current-context"), "current-context")
    context = r.named(doc, "contexts", name, "context")
    cluster = r.named(doc, "clusters", r.text(context.get("cluster"), "context.cluster"), "cluster")
    user_name = context.get("user")
    user = r.named(doc, "users", r.text(user_name, "context.user"), "user") if user_name else {}
    if any(key in user for key in NEEDS_CLIENT) or "proxy-url" in cluster:
        return None
    server = r.text(cluster.get("server"), "cluster.server").rstrip("/")
    insecure = cluster.get("insecure-skip-tls-verify", False)
    if not isinstance(insecure, bool):
        raise r.error(
            "cluster.insecure-skip-tls-verify", f"must be true or false, not {insecure!r}"
        )
    tls_name = cluster.get("tls-server-name")
    fields: dict[str, Any] = {
        "verify": not insecure,
        "tls_server_name": r.text(tls_name, "cluster.tls-server-name") if tls_name else None,
    }
    if "token" in user:
        fields["token"] = r.text(user["token"], "user.token")
    elif "tokenFile" in user:
        fields["token"] = r.file(user["tokenFile"], "user.tokenFile").read_text().strip()
    if server.startswith("https"):
        if "certificate-authority-data" in cluster:
            ca = r.pem(cluster["certificate-authority-data"], "cluster.certificate-authority-data")
            fields["ca_pem"] = ca.decode(errors="replace")
        elif "certificate-authority" in cluster:
            fields["ca_file"] = r.file(
                cluster["certificate-authority"], "cluster.certificate-authority"
            )
        for what, data_key, file_key in (
            ("cert", "client-certificate-data", "client-certificate"),
            ("key", "client-key-data", "client-key"),
        ):
            if data_key in user:
                fields[f"{what}_pem"] = r.pem(user[data_key], f"user.{data_key}")
            elif file_key in user:
                fields[f"{what}_file"] = r.file(user[file_key], f"user.{file_key}")
    return Endpoint(server, **fields)


__all__ = ["Endpoint", "read_kubeconfig"]
