"""``tessera explain --kube-version/--feature-gates``: which scheduler the answer models
(:mod:`dra_driver.scheduler.versions`): the version given, else in cluster mode the API server's
own (``GET /version``), else the newest modelled; the DRA feature gates given over that
version's defaults (with the gates docs/install.md asks for on)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from agent.errors import ConfigError
from dra_driver.scheduler.versions import (
    NEWEST,
    VERSIONS,
    Scheduler,
    VersionError,
    parse_gates,
    server_version,
    version_of,
)

ALLOWED = f"{', '.join(VERSIONS)} (a newer one is modelled as {NEWEST})"


def kube_version_arg(raw: str) -> str:
    """``--kube-version``'s converter: the text as given, once it names a modelled version."""
    try:
        version_of(raw)
    except VersionError:
        raise ValueError(f"is not a Kubernetes version explain models: {ALLOWED}") from None
    return raw.strip()


def feature_gates_arg(raw: str) -> str:
    """``--feature-gates``'s converter: the text as given, once it parses."""
    try:
        parse_gates(raw)
    except VersionError as exc:
        raise ValueError(str(exc)) from None
    return raw


def resolve(
    kube_version: str | None,
    feature_gates: str | None,
    server: Callable[[], Mapping[str, Any]] | None = None,
) -> tuple[Scheduler, list[str]]:
    """The scheduler to model, and notes for the answer. ``server`` reads the API server's
    ``/version`` (cluster mode); it is asked only when no version is given."""
    notes: list[str] = []
    text, source = kube_version or "", f"--kube-version {kube_version}"  # kube_version_arg
    if not text and server is not None:
        text = server_version(server())
        source = f"the API server runs Kubernetes {text}"
    if not text:
        version = NEWEST
    else:
        try:
            version, note = version_of(text)
        except VersionError:
            raise ConfigError(
                f"{source}, which explain does not model: it models {ALLOWED}; pass"
                " --kube-version to model one of them"
            ) from None
        if note is not None:
            notes.append(f"{source}: {note}")
    return Scheduler.of(version, parse_gates(feature_gates or "")), notes


__all__ = ["feature_gates_arg", "kube_version_arg", "resolve"]
