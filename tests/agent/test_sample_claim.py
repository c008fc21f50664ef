"""`tessera sim sample-claim`: the claim `make run` puts in front of the agent names a device the
simulated model advertises, for every model (dgx-a100's GPUs are MIG devices, not gpu-0)."""

import io
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from agent.cli import main
from agent.cli.sim import SAMPLE_CLAIM
from agent.sim.model import model_names
from dra_driver.claims import ClaimKey, parse_allocation
from dra_driver.kubelet_calls import ClaimRef
from dra_driver.kubelet_client import KubeletClient
from tests.integration.daemon import DRIVER, Daemon

ROOT = Path(__file__).resolve().parents[2]


def run(*argv: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    assert main(list(argv), {}, out, err) == 0, err.getvalue()
    return out.getvalue()


def advertised(model: str) -> set[tuple[str, str, str]]:
    """(pool, device, type) of every device in the ResourceSlices the model publishes."""
    return {
        (s["spec"]["pool"]["name"], d["name"], d["attributes"]["type"]["string"])
        for s in yaml.safe_load_all(run("slices", "--simulate", model))
        for d in s["spec"].get("devices", [])
    }


@pytest.mark.parametrize("model", model_names())
def test_the_sample_claim_names_a_device_the_model_advertises(model):
    claim = yaml.safe_load(run("sim", "sample-claim", "--simulate", model))
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    devices = {(pool, name): kind for pool, name, kind in advertised(model)}
    assert (result["pool"], result["device"]) in devices
    kind = devices[result["pool"], result["device"]]
    request = claim["spec"]["devices"]["requests"][0]["exactly"]
    assert request["deviceClassName"] == (DRIVER if kind == "gpu" else f"mig.{DRIVER}")
    namespace, name, uid = SAMPLE_CLAIM
    allocation = parse_allocation(claim, ClaimKey(namespace, name, uid), DRIVER, result["pool"])
    assert [d.device for d in allocation.devices] == [result["device"]]
    for version in ("1.34.0", "1.35.0"):
        kubernetes_validate.validate(claim, version, strict=True)


def test_the_dgx_h100_sample_is_the_documented_example():
    example = ROOT / "deploy" / "daemonset" / "examples" / "allocated-gpu-claim.yaml"
    assert yaml.safe_load(run("sim", "sample-claim", "--simulate", "dgx-h100")) == yaml.safe_load(
        example.read_text()
    )


def test_make_run_writes_the_sample_claim_for_its_model():
    makefile = (ROOT / "Makefile").read_text()
    assert "tessera sim sample-claim --simulate $(MODEL) --state-dir $(RUN_DIR)/state" in makefile
    assert f"SAMPLE_UID := {SAMPLE_CLAIM[2]}" in makefile


def test_the_readme_tour_prepares_the_sample_claim_on_dgx_a100(short_tmp):
    """What `make run MODEL=dgx-a100` then the README's `tessera kubelet prepare` do."""
    claims = short_tmp / "resourceclaims"
    claims.mkdir()
    (claims / "sample-gpu.yaml").write_text(
        run("sim", "sample-claim", "--simulate", "dgx-a100", "--state-dir", str(short_tmp))
    )
    daemon = Daemon(short_tmp, "dgx-a100").start()
    try:
        with KubeletClient(daemon.dra_socket) as kubelet:
            answer = kubelet.prepare([ClaimRef(*SAMPLE_CLAIM)])["claims"][SAMPLE_CLAIM[2]]
    finally:
        daemon.kill()
    assert answer["error"] == ""
    assert [d["deviceName"] for d in answer["devices"]] == ["gpu-0-mig-1g5gb-19-2"]
