"""`tessera explain --kube-version/--feature-gates` in standalone mode: which scheduler the answer
models, said in the text and the JSON; the same slice files answered differently by 1.34 and
1.35; versions and gates explain does not model refused (exit 2) naming the value and what is
allowed. (Cluster mode, the API server's own version: tests/integration/test_explain_cluster.py.)
"""

import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.cli import main
from agent.cli.node_commands import published_slices
from agent.config import Config
from tests.integration.test_explain_cluster_version import gpu0_1g_claim
from tests.k8sschema import validate as validate_k8s

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "daemonset" / "examples"
CLASSES = ROOT / "deploy" / "daemonset" / "deviceclasses.yaml"


def explain(*argv: object, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["explain", *map(str, argv)], env or {}, out, err)
    return code, out.getvalue(), err.getvalue()


def write(path: Path, *docs: Any) -> Path:
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


def mig_claim(path: Path, count: int) -> Path:
    return write(path, gpu0_1g_claim(count))


def a100_slices(path: Path, layout: str) -> Path:
    """A DGX A100's dynamic-MIG slices as the agent publishes them for a ``layout`` server."""
    config = Config.of(simulate="dgx-a100", mig_mode="dynamic", kube_layout=layout)
    slices = published_slices(config)
    for s in slices:
        validate_k8s(s, f"{layout}.0")
    return write(path, *slices)


def test_the_answer_says_which_scheduler_it_models() -> None:
    args = (EXAMPLES / "single-gpu.yaml", "--class", CLASSES, "--simulate", "l40s-pcie")
    code, out, _ = explain(*args)
    assert code == 0
    assert (
        "modelled: Kubernetes 1.35 scheduler, experimental allocator; feature gates:"
        " DRAAdminAccess=true, DRAConsumableCapacity=true (off by default),"
        " DRADeviceTaints=true (off by default), DRAPartitionableDevices=true (off by default),"
        " DRAPrioritizedList=true" in out.splitlines()
    )
    code, out, _ = explain(*args, "--kube-version", "1.34", "-o", "json")
    answer = json.loads(out)
    assert answer["scheduler"]["kubernetesVersion"] == "1.34"
    assert answer["scheduler"]["allocator"] == "experimental"
    (c,) = answer["nodes"][0]["claims"]
    assert c["explanation"]["scheduler"] == answer["scheduler"]


@pytest.mark.parametrize(
    ("layout", "version", "count", "fits", "says"),
    [
        # 1.35 buildPool: a slice with sharedCounters holds counters, not devices
        ("1.34", "1.35", 1, False, "devices are ignored: it holds sharedCounters"),
        ("1.34", "1.34", 7, True, None),
        # 1.34 checkAvailableCounters: the device's own slice's counter sets
        ("1.34", "1.34", 8, False, "counter gpu-0-counter-set/memory-slice"),
        ("1.35", "1.35", 8, False, "counter gpu-0-counter-set/memory-slice"),
        # ...which in the 1.35 layout hold none: 1.34 enforces no counters there
        ("1.35", "1.34", 8, True, None),
    ],
)
def test_the_same_slices_answer_per_version(
    tmp_path: Path, layout: str, version: str, count: int, fits: bool, says: str | None
) -> None:
    slices = a100_slices(tmp_path / "slices.yaml", layout)
    claim = mig_claim(tmp_path / "claim.yaml", count)
    code, out, err = explain(
        claim, "--class", CLASSES, "--slices", slices, "--kube-version", version
    )
    assert code == (0 if fits else 1), err
    assert f"modelled: Kubernetes {version} scheduler" in out
    if says:
        assert says in out


def test_a_newer_version_is_modelled_as_the_newest_saying_so() -> None:
    code, out, err = explain(
        EXAMPLES / "single-gpu.yaml",
        "--class",
        CLASSES,
        "--simulate",
        "l40s-pcie",
        env={"TESSERA_KUBE_VERSION": "v1.36.1"},
    )
    assert code == 0, err
    assert "modelled: Kubernetes 1.35 scheduler" in out
    assert (
        "note: --kube-version v1.36.1: Kubernetes 1.36 is newer than the newest version explain"
        " models: modelled as 1.35" in out
    )


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        (
            "--kube-version",
            "1.33",
            "--kube-version: '1.33' is not a Kubernetes version explain models: 1.34, 1.35"
            " (a newer one is modelled as 1.35)",
        ),
        ("--kube-version", "latest", "--kube-version: 'latest' is not a Kubernetes version"),
        (
            "--feature-gates",
            "DRAFoo=true",
            "--feature-gates: 'DRAFoo=true' names DRAFoo, not a gate explain models"
            " (DRAAdminAccess, DRAConsumableCapacity, DRADeviceTaints,"
            " DRAPartitionableDevices, DRAPrioritizedList)",
        ),
        ("--feature-gates", "DRADeviceTaints", "is not NAME=true|false"),
    ],
)
def test_what_explain_does_not_model_is_refused(flag: str, value: str, message: str) -> None:
    code, out, err = explain(
        EXAMPLES / "single-gpu.yaml", "--class", CLASSES, "--simulate", "l40s-pcie", flag, value
    )
    assert code == 2 and out == ""
    assert message in err


def test_a_gate_off_in_the_environment_refuses_first_available() -> None:
    """incubating/allocator_incubating.go Allocate: subrequests without DRAPrioritizedList."""
    env = {
        "TESSERA_FEATURE_GATES": "DRAPrioritizedList=false",
        "TESSERA_KUBE_VERSION": "1.34",
        "TESSERA_OUTPUT": "json",
    }
    code, out, err = explain(
        EXAMPLES / "prefer-hopper.yaml", "--class", CLASSES, "--simulate", "dgx-h100", env=env
    )
    assert code == 1, err
    answer = json.loads(out)
    assert answer["scheduler"]["featureGates"]["DRAPrioritizedList"] is False
    (c,) = answer["nodes"][0]["claims"]
    fatal = c["explanation"]["fatal"]
    assert fatal["kind"] == "feature-gate" and fatal["gate"] == "DRAPrioritizedList"
    assert "DRAPrioritizedList is off in the modelled Kubernetes 1.34 scheduler" in fatal["text"]
