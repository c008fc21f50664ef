"""Power caps end to end: a real `tessera run --simulate` process driven over its DRA socket like
the kubelet, the simulated GPUs' power limits read back through NVML as another process would."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from agent.sim.nvml import FakeNvml
from dra_driver.testkubelet.calls import ClaimRef
from tests.integration.daemon import DRIVER, Daemon, claim_manifest, write_claims
from tests.integration.test_sharing import advertised, ok, prepare, unprepare
from tests.k8sschema import validate as validate_k8s
from tests.simnode import node_model

MODEL = "dgx-h100"
DEFAULT_MW = 700_000
VERSIONS = ("1.34.0", "1.35.0")


@pytest.fixture
def node(short_tmp: Path) -> Iterator[Daemon]:
    d = Daemon(short_tmp, MODEL).start()
    yield d
    d.kill()


def nvml(d: Daemon) -> FakeNvml:
    fake = FakeNvml(node_model(MODEL), d.state / "sim")
    fake.nvmlInit()
    return fake


def limits(d: Daemon) -> list[int]:
    fake = nvml(d)
    return [
        fake.nvmlDeviceGetPowerManagementLimit(fake.nvmlDeviceGetHandleByIndex(i)) for i in range(8)
    ]


def capped_claim(d: Daemon, name: str, *devices: str, limit: str) -> ClaimRef:
    config = {
        "source": "FromClaim",
        "requests": [],
        "opaque": {
            "driver": DRIVER,
            "parameters": {
                "apiVersion": f"{DRIVER}/v1alpha1",
                "kind": "GpuConfig",
                "powerLimit": limit,
            },
        },
    }
    obj = claim_manifest(
        name, f"uid-{name}", [("gpu", x) for x in devices], d.node, config=[config]
    )
    for version in VERSIONS:
        validate_k8s(obj, version)
    write_claims(d.state, obj)
    return ClaimRef("default", name, f"uid-{name}")


def test_whole_gpus_advertise_their_power_limit_range(node: Daemon) -> None:
    devices = advertised(node)
    gpus = [dev for dev in devices if dev["attributes"]["type"]["string"] == "gpu"]
    assert len(gpus) == 8
    for dev in gpus:
        attrs = dev["attributes"]
        assert (
            attrs["powerLimitMinWatts"],
            attrs["powerLimitMaxWatts"],
            attrs["powerLimitDefaultWatts"],
        ) == ({"int": 200}, {"int": 700}, {"int": 700})
    for path in sorted((node.state / "resourceslices").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                for version in VERSIONS:
                    validate_k8s(doc, version)


def test_a_cap_is_set_at_prepare_and_the_limit_set_back_at_unprepare(node: Daemon) -> None:
    ref = capped_claim(node, "eco", "gpu-0", "gpu-1", limit="350W")
    ok(prepare(node, ref), ref)
    assert limits(node) == [350_000, 350_000] + [DEFAULT_MW] * 6
    (entry,) = node.checkpoint()["claims"].values()
    assert node.checkpoint()["version"] == 3  # an older build refuses it rather than ignore caps
    assert [(x["powerLimitMilliwatts"], x["powerRestoreMilliwatts"]) for x in entry["devices"]] == [
        (350_000, DEFAULT_MW),
        (350_000, DEFAULT_MW),
    ]
    # under the same full load the capped GPU draws half of what the free one does
    fake = nvml(node)
    fake.set_load(0, 1.0)
    fake.set_load(2, 1.0)
    draw = [fake.nvmlDeviceGetPowerUsage(fake.nvmlDeviceGetHandleByIndex(i)) for i in (0, 2)]
    assert draw == [350_000, DEFAULT_MW]
    ok(unprepare(node, ref), ref)
    assert limits(node) == [DEFAULT_MW] * 8
    assert node.checkpoint()["version"] == 1


def test_a_cap_out_of_the_gpus_range_is_refused_naming_all_of_it(node: Daemon) -> None:
    ref = capped_claim(node, "hot", "gpu-3", limit="0.8kW")
    error = prepare(node, ref)[ref.uid]["error"]
    assert error == (
        "claim default/hot (uid-hot): invalid configuration: gpu-3: powerLimit 800W is outside"
        " the GPU's range; allowed: 200W to 700W (its default: 700W)"
    )
    assert limits(node) == [DEFAULT_MW] * 8
    assert node.checkpoint().get("claims", {}) == {}


def test_after_a_kill_and_a_driver_reload_the_cap_is_set_again_and_later_undone(
    node: Daemon,
) -> None:
    ref = capped_claim(node, "eco", "gpu-5", limit="300W")
    ok(prepare(node, ref), ref)
    node.kill()  # SIGKILL: nothing runs on the way out
    nvml(node).reload_driver()  # the driver reloaded while the agent was down: limits are gone
    assert limits(node)[5] == DEFAULT_MW
    node.start()
    assert limits(node)[5] == 300_000  # the start's reconcile caps it again
    node.wait_log("set the power cap of a prepared claim again (the GPU had lost it)")
    ok(unprepare(node, ref), ref)
    assert limits(node)[5] == DEFAULT_MW
