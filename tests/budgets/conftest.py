"""The budget controller tests' cluster: the API-server emulator with the tessera.dev CRDs
(tests/budgets/cluster.py) and a production ``KubeClient`` talking to it over HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agent.sim.apiserver import ApiServer
from dra_driver.cluster.kube import KubeClient
from tests.apiclient import api_client
from tests.budgets import cluster


@pytest.fixture
def kube() -> Iterator[tuple[ApiServer, KubeClient]]:
    with cluster.server() as server:
        client = KubeClient(api_client(server, retries=False))
        try:
            yield server, client
        finally:
            client.close()
