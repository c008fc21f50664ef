"""Leader election on a real Lease in the API-server emulator (real HTTP), with fake clocks: who
holds it, when a silent holder's lease counts as expired (by the candidate's own observation, as
client-go decides), what each write records, and a clean release handing over at once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agent.sim.apiserver import ApiServer
from dra_driver.cluster.kube import KubeClient
from dra_driver.cluster.lease import LeaseElector, LeaseTiming
from dra_driver.errors import KubeError
from tests.apiclient import api_client
from tests.fakeclock import FakeClock
from tests.k8sschema import VERSIONS, validate

NS, NAME = "kube-system", "tessera-budgets"
TIMING = LeaseTiming(duration_s=15, renew_period_s=5, retry_period_s=2, renew_deadline_s=10)


@pytest.fixture
def kube() -> Iterator[tuple[ApiServer, KubeClient]]:
    with ApiServer() as server:
        client = KubeClient(api_client(server, retries=False))
        try:
            yield server, client
        finally:
            client.close()


def elector(client: KubeClient, who: str, clock: FakeClock) -> LeaseElector:
    return LeaseElector(client, NS, NAME, who, TIMING, clock=clock, monotonic=clock)


def lease(server: ApiServer) -> dict[str, object]:
    obj = server.get_object("leases", NAME, NS)
    assert obj is not None
    for version in VERSIONS:
        validate(obj, version)
    spec = obj["spec"]
    assert isinstance(spec, dict)
    return spec


def test_the_first_candidate_creates_the_lease_and_the_second_waits(
    kube: tuple[ApiServer, KubeClient],
) -> None:
    server, client = kube
    clock = FakeClock(1_000_000.0)
    a, b = elector(client, "a", clock), elector(client, "b", clock)
    assert a.try_acquire_or_renew() and a.is_leader()
    spec = lease(server)
    assert spec["holderIdentity"] == "a" and spec["leaseDurationSeconds"] == 15
    assert spec["leaseTransitions"] == 0 and spec["acquireTime"] == spec["renewTime"]
    assert not b.try_acquire_or_renew() and not b.is_leader() and b.holder == "a"


def test_a_renewal_keeps_acquire_time_and_moves_renew_time(
    kube: tuple[ApiServer, KubeClient],
) -> None:
    server, client = kube
    clock = FakeClock(1_000_000.0)
    a = elector(client, "a", clock)
    assert a.try_acquire_or_renew()
    first = lease(server)
    clock.advance(5)
    assert a.try_acquire_or_renew()
    second = lease(server)
    assert second["acquireTime"] == first["acquireTime"]
    assert second["renewTime"] != first["renewTime"] and second["leaseTransitions"] == 0


def test_a_silent_holder_is_replaced_only_after_a_full_duration_of_the_candidates_clock(
    kube: tuple[ApiServer, KubeClient],
) -> None:
    server, client = kube
    clock_a, clock_b = FakeClock(1_000_000.0), FakeClock(50.0)  # unrelated clocks
    a, b = elector(client, "a", clock_a), elector(client, "b", clock_b)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()  # b first sees the record now
    clock_b.advance(14.9)
    assert not b.try_acquire_or_renew()
    clock_b.advance(0.2)  # 15.1 s after b first saw the unchanged record
    assert b.try_acquire_or_renew() and b.is_leader()
    spec = lease(server)
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1
    assert spec["acquireTime"] == spec["renewTime"]
    # a, silent all along, learns it lost at its next try and stops leading
    assert not a.try_acquire_or_renew() and not a.is_leader() and a.holder == "b"


def test_a_renewing_holder_is_never_replaced(kube: tuple[ApiServer, KubeClient]) -> None:
    _, client = kube
    clock = FakeClock(1_000_000.0)
    a, b = elector(client, "a", clock), elector(client, "b", clock)
    assert a.try_acquire_or_renew()
    for _ in range(10):
        assert not b.try_acquire_or_renew()
        clock.advance(5)
        assert a.try_acquire_or_renew()
    assert a.is_leader() and not b.is_leader()


def test_a_leader_that_cannot_renew_stops_leading_at_the_renew_deadline(
    kube: tuple[ApiServer, KubeClient],
) -> None:
    server, client = kube
    clock = FakeClock(1_000_000.0)
    a = elector(client, "a", clock)
    assert a.try_acquire_or_renew()
    server.faults.add("GET", "leases", "503")
    clock.advance(9.9)
    assert a.is_leader()
    clock.advance(0.2)
    assert not a.is_leader()  # before b could take over (15 s)


def test_a_release_hands_over_at_once(kube: tuple[ApiServer, KubeClient]) -> None:
    server, client = kube
    clock = FakeClock(1_000_000.0)
    a, b = elector(client, "a", clock), elector(client, "b", clock)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    assert a.release() and not a.is_leader()
    spec = lease(server)
    assert spec["holderIdentity"] == "" and spec["leaseDurationSeconds"] == 1
    assert b.try_acquire_or_renew()  # no waiting: the lease has no holder
    assert lease(server)["holderIdentity"] == "b" and lease(server)["leaseTransitions"] == 1
    assert not a.release()  # not ours any more: nothing written


def test_a_lost_race_for_an_expired_lease_is_no_leadership(
    kube: tuple[ApiServer, KubeClient],
) -> None:
    server, client = kube
    clock = FakeClock(1_000_000.0)
    a, b = elector(client, "a", clock), elector(client, "b", clock)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    clock.advance(16)
    server.faults.add("PUT", "leases", "409")  # another candidate wrote between b's read and write
    assert not b.try_acquire_or_renew() and not b.is_leader()
    assert lease(server)["holderIdentity"] == "a"


def test_an_outage_is_an_error_for_the_caller_not_a_leadership(
    kube: tuple[ApiServer, KubeClient],
) -> None:
    server, client = kube
    clock = FakeClock(1_000_000.0)
    server.faults.add("GET", "leases", "503")
    a = elector(client, "a", clock)
    with pytest.raises(KubeError) as exc:
        a.try_acquire_or_renew()
    assert exc.value.status == 503 and not a.is_leader()
