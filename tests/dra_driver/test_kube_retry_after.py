"""A server's Retry-After, as the production client reads it: client-go's rules (only 429 and 5xx,
whole seconds, otherwise no request at all), bounded, and carried on the KubeError."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from agent.sim.apiserver import ApiServer
from dra_driver.cluster.kube import MAX_RETRY_AFTER_S, KubeClient, retry_after
from dra_driver.errors import KubeError
from tests.apiclient import api_client


@pytest.mark.parametrize(
    ("status", "header", "details", "seconds"),
    [
        (429, "5", None, 5.0),
        (503, "3", None, 3.0),
        (500, "1", None, 1.0),
        (429, " 4 ", None, 4.0),  # what an HTTP parser hands over is trimmed
        (429, "+2", None, 2.0),  # Go's strconv.Atoi takes a sign
        (429, "0", None, None),  # no wait asked
        (429, "-1", None, None),
        (429, "soon", None, None),  # garbage: no request, the caller's backoff applies
        (429, "1.5", None, None),  # whole seconds only
        (429, "Wed, 21 Oct 2015 07:28:00 GMT", None, None),  # the HTTP-date form: as client-go
        (429, "", None, None),
        (429, "86400", None, MAX_RETRY_AFTER_S),  # a day: cut to the bound
        (429, "9" * 5000, None, MAX_RETRY_AFTER_S),  # far past any integer type: still the bound
        (409, "5", None, None),  # only 429 and 5xx ask for a wait (checkWait)
        (404, "5", None, None),
        (200, "5", None, None),
        (429, None, {"retryAfterSeconds": 7}, 7.0),  # the Status details (SuggestsClientDelay)
        (429, "2", {"retryAfterSeconds": 7}, 2.0),  # the header first
        (429, "soon", {"retryAfterSeconds": 7}, None),  # a header that says nothing wins too
        (503, None, {"retryAfterSeconds": 100000}, MAX_RETRY_AFTER_S),
        (429, None, {"retryAfterSeconds": True}, None),
        (429, None, {"retryAfterSeconds": "7"}, None),
        (429, None, ["not", "details"], None),
        (429, None, None, None),
    ],
)
def test_retry_after_follows_client_go_and_is_bounded(
    status: int, header: str | None, details: Any, seconds: float | None
) -> None:
    assert retry_after(status, header, details) == seconds


def test_the_longer_of_the_backoff_and_the_servers_wait_is_waited() -> None:
    asked = KubeError(429, "TooManyRequests", "", "GET", "/x", retry_after=5.0)
    assert asked.retry_delay(0.5) == 5.0 and asked.retry_delay(12.0) == 12.0
    assert KubeError(503, "ServiceUnavailable", "", "GET", "/x").retry_delay(0.5) == 0.5


@pytest.fixture
def kube() -> Iterator[tuple[ApiServer, KubeClient]]:
    with ApiServer() as server:
        client = KubeClient(api_client(server, retries=False))
        try:
            yield server, client
        finally:
            client.close()


@pytest.mark.parametrize(
    ("kind", "seconds"),
    [("429", 1.0), ("429:7", 7.0), ("503:2", 2.0), ("500:30", 30.0), ("429:soon", None),
     ("429:999999", MAX_RETRY_AFTER_S), ("503", None), ("409", None)],
)  # fmt: skip
def test_the_client_carries_the_retry_after_of_a_real_answer(
    kube: tuple[ApiServer, KubeClient], kind: str, seconds: float | None
) -> None:
    server, client = kube
    server.faults.add("GET", "nodes", kind)
    with pytest.raises(KubeError) as exc:
        client.request("GET", "/api/v1/nodes")
    assert exc.value.status == int(kind.split(":")[0]) and exc.value.temporary == (kind != "409")
    assert exc.value.retry_after == seconds
    assert client.request("GET", "/api/v1/nodes")["items"] == []  # the fault is used up
