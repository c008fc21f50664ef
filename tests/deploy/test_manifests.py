"""Every manifest in deploy/ validates against the upstream OpenAPI schemas (1.34 and 1.35)."""

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.k8sschema import validate as validate_k8s

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "daemonset").glob("*.yaml"))
EXAMPLES = sorted((ROOT / "deploy" / "daemonset" / "examples").glob("*.yaml"))
VERSIONS = ["1.34.0", "1.35.0"]


def k8s_objects():
    for path in MANIFESTS + EXAMPLES:
        if path.name == "kustomization.yaml":
            continue
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc:
                yield pytest.param(doc, id=f"{path.name}#{i}")


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("obj", list(k8s_objects()))
def test_manifest_is_valid(obj, version):
    validate_k8s(obj, version)


def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((ROOT / "deploy" / "daemonset" / "kustomization.yaml").read_text())
    names = {p.name for p in MANIFESTS} - {"kustomization.yaml"}
    assert set(kust["resources"]) == names


def test_validation_can_fail():
    bad = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "x"},
        "spec": {"bogus": 1},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_k8s(bad, "1.35.0")


def test_the_agent_stops_within_the_pods_grace_period():
    """The kubelet SIGKILLs after terminationGracePeriodSeconds: the agent's own shutdown
    deadline (what claims being prepared get to finish) must end well before that."""
    from agent.config import Config

    ds = yaml.safe_load((ROOT / "deploy" / "daemonset" / "daemonset.yaml").read_text())
    pod = ds["spec"]["template"]["spec"]
    grace = pod["terminationGracePeriodSeconds"]  # set explicitly, not the implicit 30
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    timeout = float(env.get("TESSERA_SHUTDOWN_TIMEOUT") or Config().daemon.shutdown_timeout)
    assert timeout + 5 <= grace


def test_every_yaml_file_under_deploy_parses():
    """Components' patches are partial objects (validated once rendered, test_overlays.py); each
    still has to be YAML."""
    files = sorted((ROOT / "deploy").rglob("*.yaml"))
    assert files
    for path in files:
        assert list(yaml.safe_load_all(path.read_text())), path


def test_the_base_upgrades_the_classic_way():
    """Without TESSERA_ROLLING_UPDATE the old agent must go first (maxSurge 0): a second classic
    agent on the state directory exits. Upgrades without a gap are components/rolling-update
    (tests/deploy/test_overlays.py)."""
    ds = yaml.safe_load((ROOT / "deploy" / "daemonset" / "daemonset.yaml").read_text())
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    env = {e["name"] for e in ds["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "TESSERA_ROLLING_UPDATE" not in env
