"""The README tour's claim (deploy/daemonset/examples/sample-gpu.yaml): `tessera explain --write`
allocates it on every simulated model (a whole GPU, else a MIG device), the way `make run` and the
README do it, and the agent prepares what was written."""

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agent.cli import main
from agent.sim.model import all_model_names
from agent.statelock import StateLock
from dra_driver.kubeletplugin.claims import ClaimKey, parse_allocation
from dra_driver.testkubelet.calls import ClaimRef
from dra_driver.testkubelet.client import KubeletClient
from tests.integration.daemon import DRIVER, Daemon
from tests.k8sschema import validate as validate_k8s
from tests.sim.tools_helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "daemonset" / "examples"
CLASSES = ROOT / "deploy" / "daemonset" / "deviceclasses.yaml"
SAMPLE = EXAMPLES / "sample-gpu.yaml"
META = yaml.safe_load(SAMPLE.read_text())["metadata"]
KEY = ClaimKey(META["namespace"], META["name"], META["uid"])


def run(*argv: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    assert main(list(argv), {}, out, err) == 0, err.getvalue()
    return out.getvalue()


def allocate(where: Path, model: str, *extra: str) -> dict:
    """What `make run MODEL=<model>` does: copy the example, explain --write it."""
    f = where / "sample-gpu.yaml"
    shutil.copy(SAMPLE, f)
    run("explain", str(f), "--class", str(CLASSES), "--simulate", model, "--write", *extra)
    return yaml.safe_load(f.read_text())


def advertised(model: str) -> dict[tuple[str, str], str]:
    """(pool, device) -> type of every device in the ResourceSlices the model publishes."""
    return {
        (s["spec"]["pool"]["name"], d["name"]): d["attributes"]["type"]["string"]
        for s in yaml.safe_load_all(run("slices", "--simulate", model))
        for d in s["spec"].get("devices", [])
    }


@pytest.mark.parametrize("model", all_model_names())
def test_the_tour_claim_is_allocated_on_every_model(tmp_path, model):
    claim = allocate(tmp_path, model)
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    kind = advertised(model)[result["pool"], result["device"]]
    assert result["request"] == ("gpu/whole" if kind == "gpu" else "gpu/mig")
    allocation = parse_allocation(claim, KEY, DRIVER, result["pool"])
    assert [d.device for d in allocation.devices] == [result["device"]]
    assert claim["spec"] == yaml.safe_load(SAMPLE.read_text())["spec"]
    for version in ("1.34.0", "1.35.0"):
        validate_k8s(claim, version)


def test_the_dgx_h100_allocation_is_the_documented_example(tmp_path):
    example = yaml.safe_load((EXAMPLES / "allocated-gpu-claim.yaml").read_text())
    assert allocate(tmp_path, "dgx-h100") == example


def test_make_run_allocates_the_tour_claim_for_its_model():
    makefile = (ROOT / "Makefile").read_text()
    assert (
        "cp deploy/daemonset/examples/sample-gpu.yaml $(RUN_DIR)/state/resourceclaims/" in makefile
    )
    assert (
        "tessera explain $(RUN_DIR)/state/resourceclaims/sample-gpu.yaml \\\n\t\t--class"
        " deploy/daemonset/deviceclasses.yaml --simulate $(MODEL) --state-dir $(RUN_DIR)/state"
        " \\\n\t\t--write"
    ) in makefile
    assert f"SAMPLE_UID := {KEY.uid}" in makefile


def test_the_readme_tour_writes_the_allocation_then_prepares_it():
    readme = (ROOT / "README.md").read_text()
    explain_at = readme.index(
        "tessera explain .run/state/resourceclaims/sample-gpu.yaml --class"
        " deploy/daemonset/deviceclasses.yaml \\\n    --simulate dgx-h100 --state-dir .run/state"
        " --write"
    )
    prepare_at = readme.index(f"--claim {KEY.namespace}/{KEY.name}/{KEY.uid}")
    assert explain_at < prepare_at


def test_the_readme_tour_prepares_the_written_claim_on_dgx_a100(short_tmp):
    """What `make run MODEL=dgx-a100` then the README's `tessera kubelet prepare` do: dgx-a100's
    GPUs are all MIG-partitioned, so the claim gets its second choice, a MIG device."""
    claims = short_tmp / "resourceclaims"
    claims.mkdir()
    claim = allocate(claims, "dgx-a100", "--state-dir", str(short_tmp))
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["request"] == "gpu/mig"
    daemon = Daemon(short_tmp, "dgx-a100").start()
    try:
        with KubeletClient(daemon.dra_socket) as kubelet:
            answer = kubelet.prepare([ClaimRef(KEY.namespace, KEY.name, KEY.uid)])["claims"][
                KEY.uid
            ]
        # the README's next step: `tessera usage` shows the claim (written when it came)
        wait_for(
            lambda: (
                (short_tmp / "usage.json").exists()
                and KEY.uid in (short_tmp / "usage.json").read_text()
            ),
            "the claim in the usage ledger",
        )
    finally:
        daemon.kill()
    assert answer["error"] == ""
    assert [d["deviceName"] for d in answer["devices"]] == [result["device"]]
    rows = json.loads(run("usage", "--state-dir", str(short_tmp), "-o", "json"))["rows"]
    assert [(r["namespace"], r["claim"], r["device"], r["rule"]) for r in rows] == [
        (KEY.namespace, KEY.name, result["device"], "mig-slices")
    ]
    # the profile's name as NVML gives it (1g.5gb), whose compact form the device name carries
    assert f"-mig-{rows[0]['migProfile'].replace('.', '')}-" in result["device"]


def test_the_readme_tour_shows_the_claims_usage_after_unpreparing_it():
    readme = (ROOT / "README.md").read_text()
    assert readme.index("tessera kubelet unprepare") < readme.index(
        "tessera usage --state-dir .run/state"
    )


def test_a_second_make_run_leaves_the_running_agents_files_alone(tmp_path):
    """`make run` while an agent already runs on its state directory (it holds agent.lock):
    it stops before it writes anything there, says why, and the running agent's claim file
    (allocated for its own model) stays as it was. The first `make run`'s files are its agent's
    input; the second agent would only exit at the lock after they were overwritten."""
    state = tmp_path / "run" / "state"
    claims = state / "resourceclaims"
    claims.mkdir(parents=True)
    running = claims / "sample-gpu.yaml"
    running.write_bytes(b"# the running agent's claim, allocated on another model\n")
    stamp = tmp_path / "installed"
    stamp.touch()  # newer than pyproject.toml: make installs nothing
    lock = StateLock(state)
    lock.acquire()
    try:
        done = subprocess.run(
            ["make", "-C", str(ROOT), "run", f"RUN_DIR={tmp_path / 'run'}", f"STAMP={stamp}",
             f"VENV={Path(sys.executable).parent.parent}", "MODEL=dgx-a100", "METRICS=127.0.0.1:0"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    finally:
        lock.release()
    assert done.returncode != 0
    assert f"an agent already runs on {state}" in done.stderr, done.stderr
    assert running.read_bytes() == b"# the running agent's claim, allocated on another model\n"
    assert sorted(p.name for p in claims.iterdir()) == ["sample-gpu.yaml"]
