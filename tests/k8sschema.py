"""Every Kubernetes object a test sees is checked against the upstream OpenAPI schemas of the
versions Tessera supports, strictly (an unknown field fails), as the API server would: through
kubernetes-validate's schemas, each parsed once per test process (agent/sim/apiserver_schemas.py;
the library's own ``validate`` parses its definitions file again on every call)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import kubernetes_validate

from agent.sim.apiserver_schemas import Schemas

VERSIONS = ("1.34.0", "1.35.0")


@functools.cache
def _schemas() -> Schemas:
    return Schemas(kubernetes_validate)


def validate(obj: Mapping[str, Any], version: str) -> str:
    """``kubernetes_validate.validate(obj, version, strict=True)``, with the schemas kept: the
    schema version used; raises ``kubernetes_validate.ValidationError`` when ``obj`` fails."""
    return _schemas().validate(obj, version)
