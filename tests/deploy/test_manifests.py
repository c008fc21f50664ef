"""Every manifest in deploy/ validates against the upstream OpenAPI schemas (1.34 and 1.35)."""

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

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
    kubernetes_validate.validate(obj, version, strict=True)


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
        kubernetes_validate.validate(bad, "1.35.0", strict=True)


def test_the_agent_stops_within_the_pods_grace_period():
    """The kubelet SIGKILLs after terminationGracePeriodSeconds: the agent's own shutdown
    deadline (what claims being prepared get to finish) must end well before that."""
    from agent.config import Config

    ds = yaml.safe_load((ROOT / "deploy" / "daemonset" / "daemonset.yaml").read_text())
    pod = ds["spec"]["template"]["spec"]
    grace = pod["terminationGracePeriodSeconds"]  # set explicitly, not the implicit 30
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    timeout = float(env.get("TESSERA_SHUTDOWN_TIMEOUT") or Config().shutdown_timeout)
    assert timeout + 5 <= grace


def test_the_daemonset_upgrades_without_a_gap():
    """maxSurge: 1 with maxUnavailable: 0 only works with --rolling-update (per-pod sockets, the
    state directory handed over): the manifest's environment must turn it on, with the pod UID
    from the downward API, and make a valid Config."""
    from agent.config import load_config

    ds = yaml.safe_load((ROOT / "deploy" / "daemonset" / "daemonset.yaml").read_text())
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    env = {e["name"]: e for e in ds["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TESSERA_POD_UID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    given = {name: e["value"] for name, e in env.items() if "value" in e}
    config = load_config({}, given | {"TESSERA_POD_UID": "4f1b2c3d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"})
    assert config.rolling_update and not config.cleanup_on_exit
