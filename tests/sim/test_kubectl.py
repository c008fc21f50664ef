"""``kubectl apply`` against the API-server emulator, as a new user runs it: validation on (no
``--validate=false``), so kubectl reads the emulator's /openapi/v3 documents, finds that the
server validates fields, and sends ``fieldValidation=Strict``. A DeviceClass, the GpuBudget CRD
and its examples are applied (and re-applied: unchanged); a broken budget is refused with its CEL
rule's message and an unknown field with the strict decoding error; ``kubectl get`` shows the
CRD's printer columns. Real kubectl, real subprocess, real HTTP."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.sim.apiserver import ApiServer
from tests.k8sschema import VERSIONS
from tests.k8sschema import validate as validate_k8s

ROOT = Path(__file__).resolve().parents[2]
BUDGETS = ROOT / "deploy" / "daemonset" / "budgets"
KUBECTL = shutil.which("kubectl")

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (not on PATH)")

DEVICE_CLASS = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": "gpu.tessera.dev"},
    "spec": {"selectors": [{"cel": {"expression": 'device.driver == "gpu.tessera.dev"'}}]},
}


@pytest.fixture
def kubectl(tmp_path: Path) -> Iterator[Any]:
    with ApiServer() as server:
        config = server.kubeconfig(tmp_path / "kube")
        env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(tmp_path / "home"),  # kubectl's discovery and OpenAPI caches: this test's
            "KUBECONFIG": str(config),
        }

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            assert KUBECTL is not None
            return subprocess.run(
                [KUBECTL, *args], env=env, capture_output=True, text=True, timeout=120, check=False
            )

        yield run


def write(tmp_path: Path, name: str, obj: dict[str, Any]) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(obj, sort_keys=False))
    return str(path)


def broken_budget(**spec: Any) -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load((BUDGETS / "examples" / "team-a-monthly.yaml").read_text())
    obj["metadata"]["name"] = "broken"
    obj["spec"].update(spec)
    return obj


def test_kubectl_apply_validates_against_the_emulator(kubectl: Any, tmp_path: Path) -> None:
    for version in VERSIONS:
        validate_k8s(DEVICE_CLASS, version)
    done = kubectl("apply", "-f", write(tmp_path, "class.yaml", DEVICE_CLASS))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "deviceclass.resource.k8s.io/gpu.tessera.dev created"
    again = kubectl("apply", "-f", write(tmp_path, "class.yaml", DEVICE_CLASS))
    assert again.stdout.strip() == "deviceclass.resource.k8s.io/gpu.tessera.dev unchanged"

    done = kubectl("apply", "-f", str(BUDGETS / "gpubudget-crd.yaml"))
    assert done.returncode == 0, done.stderr
    assert "customresourcedefinition.apiextensions.k8s.io/gpubudgets.tessera.dev created" in (
        done.stdout
    )
    waited = kubectl("wait", "--for=condition=Established", "crd/gpubudgets.tessera.dev")
    assert waited.returncode == 0, waited.stderr

    done = kubectl("apply", "-f", str(BUDGETS / "examples"))
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split("\n")) == [
        "",
        "gpubudget.tessera.dev/research-rolling created",
        "gpubudget.tessera.dev/team-a-monthly created",
    ]
    again = kubectl("apply", "-f", str(BUDGETS / "examples" / "team-a-monthly.yaml"))
    assert again.stdout.strip() == "gpubudget.tessera.dev/team-a-monthly unchanged", again.stderr

    refused = kubectl("apply", "-f", write(tmp_path, "bad.yaml", broken_budget(gracePeriod="1h")))
    assert refused.returncode != 0
    assert refused.stderr.strip() == (
        'The GpuBudget "broken" is invalid: spec: Invalid value: "object": gracePeriod applies'
        " to action Terminate only"
    )
    unknown = kubectl("apply", "-f", write(tmp_path, "typo.yaml", broken_budget(limit={})))
    assert unknown.returncode != 0
    assert 'strict decoding error: unknown field "spec.limit"' in unknown.stderr

    listed = kubectl("get", "gpubudgets")
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.strip().split("\n")
    assert header.split() == [
        "NAME", "NAMESPACE", "ACTION", "GPU-H", "USED", "GPU-H", "LIMIT", "EXHAUSTED", "AGE"
    ]  # fmt: skip
    # empty cells print as nothing: research-rolling has no namespace and no GPU-hour limit
    assert [r.split()[:-1] for r in rows] == [
        ["research-rolling", "Terminate"],
        ["team-a-monthly", "team-a", "DenyNew", "1200"],
    ]
