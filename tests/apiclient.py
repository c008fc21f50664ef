"""A ``kubernetes.client.ApiClient`` for the API-server emulator: the tests' way to call it as
client-go would, through the real kubernetes client (which only dra_driver.cluster imports in
the product)."""

from __future__ import annotations

from typing import Any

from kubernetes import client

from agent.sim.apiserver import ApiServer


def api_client(server: ApiServer, retries: int | bool | None = None) -> Any:
    """An ``ApiClient`` for ``server`` (close it when done).

    ``retries`` is urllib3's: None keeps its default (3 retries of connection errors and of
    429/503 answers carrying Retry-After on idempotent methods); False or 0 lets every failure
    through to the caller.
    """
    config = client.Configuration()
    config.host = server.url
    config.retries = retries
    return client.ApiClient(config)
