"""GPU health through the running daemon: a kubelet client holds the health stream, faults come
from `tessera sim fault`, the slices are read where the scheduler would read them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import yaml

from agent.cli.sim import simulator_dir
from agent.sim.model import load_model
from agent.sim.nvml import FakeNvml
from dra_driver.testkubelet.client import KubeletClient
from tests.integration.daemon import DRIVER, Daemon
from tests.k8sschema import validate as validate_k8s

INTERVAL = "0.2"
TAINT = f"{DRIVER}/unhealthy"


def metrics(d: Daemon) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    return d.scrape()


def metric(d: Daemon, name: str, **labels: str) -> float:
    hits = [v for k, v in metrics(d)[name].items() if all(i in k for i in labels.items())]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def standalone_slices(d: Daemon) -> list[dict[str, Any]]:
    return [
        yaml.safe_load(p.read_text()) for p in sorted((d.state / "resourceslices").glob("*.yaml"))
    ]


def devices(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {dev["name"]: dev for s in slices for dev in s["spec"].get("devices") or []}


def of_gpu(names: object, minor: int) -> set[str]:
    return {n for n in names if n == f"gpu-{minor}" or n.startswith(f"gpu-{minor}-")}  # type: ignore[attr-defined]


def stream(d: Daemon) -> dict[str, str]:
    """The kubelet's view: the health stream's complete device list."""
    with KubeletClient(d.dra_socket) as k:
        (listed,) = list(k.watch_health(max_messages=1, timeout=10))
    return {x["deviceName"]: x["health"] for x in listed}


def until(what: str, check: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.1)


def ticks_pass(d: Daemon, n: int) -> None:
    start = metric(d, "tessera_sampler_ticks_total")
    until(f"{n} ticks", lambda: metric(d, "tessera_sampler_ticks_total") >= start + n)


def writes(d: Daemon) -> float:
    return metric(d, "tessera_resourceslice_writes_total")


def read_lost(d: Daemon, gpu: str) -> bool:
    """The latest tick read the GPU as lost (a lost GPU's readings are absent from /metrics)."""
    return not any(("gpu", gpu) in k for k in metrics(d)["tessera_gpu_power_watts"])


def published(d: Daemon) -> int:
    return sum(1 for r in d.logs if r.get("msg") == "GPU health published")


def test_xid_79_taints_the_gpu_everywhere_xid_13_changes_nothing_and_recover_lifts_it(short_tmp):
    d = Daemon(
        short_tmp, "dgx-h100", "--telemetry-interval", INTERVAL, "--device-taints",
        "--sim-mig-layout", "balanced",
    ).start()  # fmt: skip
    try:
        d.wait_log("published ResourceSlices")  # logged once the whole round is written
        before = standalone_slices(d)
        names = set(devices(before))
        gpu3 = of_gpu(names, 3)
        assert len(gpu3) > 1  # the MIG devices of GPU 3 follow it
        assert set(stream(d).values()) == {"HEALTHY"}
        steady = writes(d)

        d.fault("xid", "--gpu", "3", "--xid", "13")  # the workload's fault
        ticks_pass(d, 3)
        assert standalone_slices(d) == before and writes(d) == steady
        assert metric(d, "tessera_gpu_healthy", gpu="3") == 1
        assert metric(d, "tessera_gpu_xid_errors_total", gpu="3", xid="13") == 1
        assert set(stream(d).values()) == {"HEALTHY"}

        d.fault("xid", "--gpu", "3", "--xid", "79")  # fallen off the bus
        until(
            "GPU 3 tainted",
            lambda: any("taints" in x for x in devices(standalone_slices(d)).values()),
        )
        slices = standalone_slices(d)
        for obj in slices:
            for version in ("1.34.0", "1.35.0"):
                validate_k8s(obj, version)
        found = devices(slices)
        assert set(found) == names  # tainted, not withdrawn
        for name, dev in found.items():
            if name in gpu3:
                (taint,) = dev["taints"]
                assert (taint["key"], taint["value"], taint["effect"]) == (
                    TAINT,
                    "xid-79",
                    "NoSchedule",
                )
                assert taint["timeAdded"].endswith("Z")
            else:
                assert "taints" not in dev
        assert metric(d, "tessera_gpu_healthy", gpu="3") == 0
        kubelet = stream(d)
        assert {n for n, h in kubelet.items() if h == "UNHEALTHY"} == gpu3
        one_round = writes(d) - steady
        assert one_round == len(slices)  # one write round (every slice of the pool, once)
        ticks_pass(d, 5)
        assert writes(d) - steady == one_round  # steady state: nothing more

        d.fault("recover", "--gpu", "3")
        until("taints lifted", lambda: standalone_slices(d) and not any(
            "taints" in x for x in devices(standalone_slices(d)).values()))  # fmt: skip
        assert metric(d, "tessera_gpu_healthy", gpu="3") == 1
        assert set(stream(d).values()) == {"HEALTHY"}
        assert set(devices(standalone_slices(d))) == names

        # a flapping GPU: 50 XID 79 / recover cycles, as fast as they come
        fake = FakeNvml(load_model("dgx-h100"), simulator_dir(d.state))
        changes, rounds_before = published(d), writes(d)
        for _ in range(49):
            fake.inject_xid(5, 79)
            time.sleep(0.03)  # pacing only: the assertions below hold for any interleaving
            fake.recover_gpu(5)
            time.sleep(0.03)
        fake.inject_xid(5, 79)  # the last one is seen to fail reads before it recovers
        until("the last loss read", lambda: read_lost(d, "5"))
        fake.recover_gpu(5)
        until("GPU 5 healthy", lambda: metric(d, "tessera_gpu_healthy", gpu="5") == 1)
        until(
            "taints lifted",
            lambda: not any("taints" in x for x in devices(standalone_slices(d)).values()),
        )
        observed = published(d) - changes
        assert 2 <= observed <= 100
        assert writes(d) - rounds_before <= observed * len(standalone_slices(d))
        assert set(stream(d).values()) == {"HEALTHY"}
    finally:
        d.kill()


def test_kube_mode_withdraws_the_devices_of_an_unhealthy_gpu_and_brings_them_back(short_tmp):
    from agent.sim.apiserver import ApiServer

    with ApiServer() as server:
        d = Daemon(
            short_tmp, "dgx-h100", "--telemetry-interval", INTERVAL, "--mig-mode", "dynamic",
            "--kubeconfig", str(server.kubeconfig(short_tmp)),
        ).start()  # fmt: skip
        try:

            def listed() -> dict[str, dict[str, Any]]:
                return devices(server.objects("resourceslices"))

            d.wait_log("published ResourceSlices")  # logged once the whole round is written
            names = set(listed())
            sets = {
                c["name"]
                for s in server.objects("resourceslices")
                for c in s["spec"].get("sharedCounters") or []
            }
            gpu2 = of_gpu(names, 2)
            assert len(gpu2) > 1 and "gpu-2-counter-set" in sets
            writes_before = server.writes("resourceslices")

            d.fault("xid", "--gpu", "2", "--xid", "79")
            until("GPU 2 withdrawn", lambda: set(listed()) == names - gpu2)
            left = {
                c["name"]
                for s in server.objects("resourceslices")
                for c in s["spec"].get("sharedCounters") or []
            }
            assert left == sets - {"gpu-2-counter-set"}
            assert metric(d, "tessera_gpu_healthy", gpu="2") == 0
            kubelet = stream(d)
            assert {n for n, h in kubelet.items() if h == "UNHEALTHY"} == gpu2  # still listed
            ticks_pass(d, 5)
            round_one = server.writes("resourceslices") - writes_before
            assert 0 < round_one <= len(server.objects("resourceslices")) + 1

            d.fault("recover", "--gpu", "2")
            until("GPU 2 back", lambda: set(listed()) == names)
            assert metric(d, "tessera_gpu_healthy", gpu="2") == 1
            assert set(stream(d).values()) == {"HEALTHY"}
            ticks_pass(d, 5)
            total = server.writes("resourceslices") - writes_before
            assert total <= 2 * (len(server.objects("resourceslices")) + 1)  # two rounds
            assert server.rejected == []
        finally:
            d.kill()


def test_a_fatal_xid_survives_a_restart_of_the_agent_until_a_recovery_is_observed(short_tmp):
    d = Daemon(short_tmp, "l40s-pcie", "--telemetry-interval", INTERVAL)
    try:
        d.start()
        d.wait_log("published ResourceSlices")
        names = set(devices(standalone_slices(d)))
        gpu1 = of_gpu(names, 1)
        ecc = "tessera_gpu_ecc_errors_total"
        assert metric(d, ecc, gpu="1", type="uncorrected") == 0
        d.fault("xid", "--gpu", "1", "--xid", "48")  # a DBE: the GPU still answers
        until("GPU 1 withdrawn", lambda: set(devices(standalone_slices(d))) == names - gpu1)
        # the counter the runbooks tell the SRE to check moved with it
        until("DBE counted", lambda: metric(d, ecc, gpu="1", type="uncorrected") == 1)
        assert d.stop() == 0

        d.start()  # a restart (an upgrade): NVML will not deliver that XID again
        rec = d.wait_log("GPUs with a fatal XID no recovery cleared stay unhealthy")
        assert len(rec["gpus"]) == 1
        until("GPU 1 unhealthy", lambda: metric(d, "tessera_gpu_healthy", gpu="1") == 0)
        ticks_pass(d, 3)
        assert set(devices(standalone_slices(d))) == names - gpu1
        assert {n for n, h in stream(d).items() if h == "UNHEALTHY"} == gpu1

        d.fault("rebind", "--gpu", "1")  # the operator's reset: observed, probed, healthy
        until("GPU 1 back", lambda: set(devices(standalone_slices(d))) == names)
        assert d.stop() == 0

        d.start()  # and a restart after the recovery keeps it healthy
        ticks_pass(d, 3)
        assert metric(d, "tessera_gpu_healthy", gpu="1") == 1
        assert set(devices(standalone_slices(d))) == names
        assert not any(r.get("msg", "").startswith("GPUs with a fatal XID") for r in d.logs)
    finally:
        d.kill()
