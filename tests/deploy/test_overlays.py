"""The kustomize base and its components, rendered with the real `kubectl kustomize`: every
rendered object validates against the upstream OpenAPI schemas (1.34 and 1.35, strict), the
agent's environment in each rendering makes a valid Config with the setting the component is
for, and the pod mounts exactly what that Config uses."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from agent.cli.doctor import DoctorOptions
from agent.config import Config, load_config, load_settings, settings_of
from agent.daemon import agent_paths
from tests.k8sschema import validate as validate_k8s

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "daemonset"
COMPONENTS_DIR = BASE / "components"
VERSIONS = ["1.34.0", "1.35.0"]
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl is not installed: the overlays cannot be rendered"
)

MONITORING_GROUP = "monitoring.coreos.com"
"""ServiceMonitor, PodMonitor, PrometheusRule: not built-in kinds, so kubernetes-validate has no
schema for them; tests/deploy/test_monitoring.py validates them against the operator's CRDs."""
OWNED_ELSEWHERE = {"monitoring", "monitoring/pod-monitor", "monitoring/budgets"}
"""components/monitoring (and its PodMonitor variant, and the budget controller's PodMonitor):
rendered and validated here like every component, their own behaviour tested in
tests/deploy/test_monitoring.py."""

COMPONENTS = sorted(p.parent.name for p in COMPONENTS_DIR.glob("*/kustomization.yaml"))
COMBINATIONS: list[tuple[str, ...]] = [
    (),
    *((c,) for c in COMPONENTS),
    # a GPU operator cluster (deploy/overlays/gpu-operator)
    ("container-driver", "gpu-operator-node-selector", "rolling-update"),
    # every feature at once, on either driver layout and sharing mode
    ("container-driver", "dynamic-mig", "memory-shares", "device-taints", "rolling-update"),
    ("dynamic-mig", "time-slicing", "device-taints", "rolling-update", "nfd-node-selector"),
    # GPUs for VMs: passthrough goes with dynamic MIG, vGPU with static MIG only
    ("container-driver", "dynamic-mig", "passthrough", "device-taints", "rolling-update"),
    ("vgpu", "device-taints", "rolling-update", "gpu-operator-node-selector"),
    # a component inside another one refines it and is rendered with it
    ("monitoring", "monitoring/pod-monitor"),
    ("monitoring", "monitoring/budgets"),
]
POD_UID = "4f1b2c3d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"
DOWNWARD = {
    "spec.nodeName": "gpu-node-1",
    "metadata.uid": POD_UID,
    "metadata.namespace": "tessera-system",
}
"""What the kubelet fills in for each fieldRef the DaemonSet uses."""


@functools.cache
def render(components: tuple[str, ...]) -> tuple[dict[str, Any], ...]:
    """The objects of a rendering that must succeed (``kustomize``)."""
    out = kustomize(components)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def kustomize(components: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """`kubectl kustomize` of the base with these components (a throwaway kustomization next to
    nothing, naming them by relative path as a user's overlay would)."""
    assert KUBECTL is not None
    with tempfile.TemporaryDirectory() as tmp:
        rel = os.path.relpath(BASE, tmp)
        kust = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [rel],
            "components": [f"{rel}/components/{c}" for c in components],
        }
        Path(tmp, "kustomization.yaml").write_text(yaml.safe_dump(kust))
        return subprocess.run(
            [KUBECTL, "kustomize", tmp], capture_output=True, text=True, timeout=60, check=False
        )


def daemonset(components: Sequence[str] = ()) -> dict[str, Any]:
    (ds,) = [o for o in render(tuple(components)) if o["kind"] == "DaemonSet"]
    return ds


def pod(components: Sequence[str] = ()) -> dict[str, Any]:
    spec: dict[str, Any] = daemonset(components)["spec"]["template"]["spec"]
    return spec


def agent(components: Sequence[str] = ()) -> dict[str, Any]:
    (container,) = pod(components)["containers"]
    return container


def environment(components: Sequence[str] = ()) -> dict[str, str]:
    """The agent's environment as the kubelet makes it (fieldRefs filled in)."""
    env = {}
    for e in agent(components)["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            env[e["name"]] = DOWNWARD[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def config(components: Sequence[str] = ()) -> Config:
    return load_config({}, environment(components))


VIRTUALIZATION_SETTINGS = {"virtualization"} & {s.name for s in settings_of(Config)}
"""The --virtualization setting, once issue 24's settings part is merged (empty before): what
components/passthrough and components/vgpu change in the Config. Until then their expectations
read TESSERA_VIRTUALIZATION from the rendered environment, which is what the agent reads."""


def virtualization(components: Sequence[str] = ()) -> str:
    """The agent's --virtualization in this rendering (TESSERA_VIRTUALIZATION; none unset)."""
    return environment(components).get("TESSERA_VIRTUALIZATION", "none")


def mounts(components: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """mountPath -> the mount with its volume (``volume``)."""
    volumes = {v["name"]: v for v in pod(components)["volumes"]}
    return {
        m["mountPath"]: {**m, "volume": volumes[m["name"]]}
        for m in agent(components)["volumeMounts"]
    }


def mount_of(path: Path | str, components: Sequence[str] = ()) -> dict[str, Any] | None:
    """The mount a path in the container lies in (the deepest one), or None."""
    p = PurePosixPath(str(path))
    found = [m for where, m in mounts(components).items() if p.is_relative_to(where)]
    return max(found, key=lambda m: len(m["mountPath"]), default=None)


def combo_id(components: tuple[str, ...]) -> str:
    return "+".join(components) or "base"


def validatable(objs: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    # Prometheus Operator kinds have no upstream schema: skipped here by group on purpose
    return [o for o in objs if o["apiVersion"].split("/")[0] != MONITORING_GROUP]


# -- every rendering validates --------------------------------------------------------------------


@needs_kubectl
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("components", COMBINATIONS, ids=combo_id)
def test_every_rendered_object_validates(components, version):
    objs = validatable(render(components))
    assert any(o["kind"] == "DaemonSet" for o in objs)
    for obj in objs:
        validate_k8s(dict(obj), version)


@needs_kubectl
@pytest.mark.parametrize("components", COMBINATIONS, ids=combo_id)
def test_every_rendering_makes_a_valid_agent_config_and_doctor_options(components):
    c = config(components)
    assert c.node.node_name == "gpu-node-1"
    c.driver.device_policy()  # the driver settings parse (quantities, modes)
    load_settings(DoctorOptions, {}, environment(components))


@needs_kubectl
@pytest.mark.parametrize("components", COMBINATIONS, ids=combo_id)
def test_mounts_and_volumes_match_one_to_one(components):
    """Every mount names a volume and every volume is mounted (the API server checks only the
    first), and every volume is a hostPath of the node."""
    spec = pod(components)
    volumes = {v["name"] for v in spec["volumes"]}
    mounted = [m["name"] for m in agent(components)["volumeMounts"]]
    assert sorted(mounted) == sorted(volumes)
    assert all("hostPath" in v for v in spec["volumes"])


@needs_kubectl
@pytest.mark.parametrize("components", COMBINATIONS, ids=combo_id)
def test_every_path_the_agent_uses_is_mounted_from_the_host_as_it_needs(components):
    """The directories the Config names are host directories: each lies in a mount, the ones
    the agent writes read-write, the ones it only reads read-only; and nothing else is mounted."""
    c = config(components)
    paths = agent_paths(c, c.node.state_dir or Path("/var/lib/tessera"))
    writes = [c.node.state_dir, paths.registry_dir, paths.plugins_dir, paths.cdi_root, Path("/dev")]
    reads = [c.node.driver_root, c.node.proc_root]
    # VMs' GPUs: driver binding, vGPU types and mediated devices are sysfs writes
    (writes if virtualization(components) != "none" else reads).append(Path("/sys"))
    doctor = load_settings(DoctorOptions, {}, environment(components)).host_root
    used = set()
    for p in writes:
        m = mount_of(p, components)
        assert m is not None and not m.get("readOnly"), p
        used.add(m["mountPath"])
    for p in [*reads, *([doctor] if doctor else [])]:
        m = mount_of(p, components)
        assert m is not None and m.get("readOnly") is True, p
        used.add(m["mountPath"])
    assert used == set(mounts(components)), "a volume no setting uses"
    # the MPS directories are mounted into containers by the agent's path: the same on the host
    mps = c.sharing.mps_root or (c.node.state_dir or Path("/var/lib/tessera")) / "mps"
    m = mount_of(mps, components)
    assert m is not None and m["volume"]["hostPath"]["path"] == m["mountPath"]


# -- what each component does ---------------------------------------------------------------------


@needs_kubectl
def test_every_component_has_its_expectations_here():
    assert set(COMPONENTS) - OWNED_ELSEWHERE == set(EXPECTED)


def expect_base(c: Config) -> None:
    assert (c.driver.mig_mode, c.driver.sharing, c.publishing.device_taints) == (
        "static",
        "none",
        False,
    )
    assert not c.daemon.rolling_update and c.daemon.pod_uid is None


def expect_container_driver(components: Sequence[str]) -> None:
    c = config(components)
    assert c.node.driver_root == Path("/driver-root")
    assert c.node.host_driver_root == Path("/run/nvidia/driver")
    assert c.cdi.cdi_hook_path == Path("/usr/local/nvidia/toolkit/nvidia-cdi-hook")
    m = mount_of(c.node.driver_root, components)
    assert m is not None and m["volume"]["hostPath"]["path"] == "/run/nvidia/driver"
    assert m["mountPropagation"] == "HostToContainer"  # a driver container started later
    # none of the host's / but the driver's root: the doctor's host root is gone with it
    assert all(m["volume"]["hostPath"]["path"] != "/" for m in mounts(components).values())
    assert "TESSERA_HOST_ROOT" not in environment(components)


def expect_dynamic_mig(components: Sequence[str]) -> None:
    assert config(components).driver.mig_mode == "dynamic"


def expect_time_slicing(components: Sequence[str]) -> None:
    assert config(components).driver.sharing == "time-slicing"


def expect_memory_shares(components: Sequence[str]) -> None:
    policy = config(components).driver.device_policy()
    assert policy.sharing == "memory-shares"
    assert policy.memory_share_min == policy.memory_share_step == 1024**3


def expect_virtualization(mode: str, components: Sequence[str]) -> None:
    assert virtualization(components) == mode
    c = config(components)
    for s in settings_of(Config):
        if s.name in VIRTUALIZATION_SETTINGS:
            assert getattr(getattr(c, s.section), s.name) == mode
    sys = mount_of("/sys", components)
    assert sys is not None and sys["readOnly"] is False  # said explicitly
    assert sys["volume"]["hostPath"]["path"] == "/sys"
    # the VFIO nodes the CDI specs name are the host's, under the writable /dev volume
    dev = mount_of("/dev/vfio/vfio", components)
    assert dev is not None and dev["volume"]["hostPath"]["path"] == "/dev"
    assert not dev.get("readOnly")
    assert config(components).driver.sharing == "none"


def expect_passthrough(components: Sequence[str]) -> None:
    expect_virtualization("passthrough", components)


def expect_vgpu(components: Sequence[str]) -> None:
    expect_virtualization("vgpu", components)
    assert config(components).driver.mig_mode == "static"


def expect_device_taints(components: Sequence[str]) -> None:
    assert config(components).publishing.device_taints is True


def expect_rolling_update(components: Sequence[str]) -> None:
    c = config(components)
    assert (
        c.daemon.rolling_update and c.daemon.pod_uid == POD_UID and not c.publishing.cleanup_on_exit
    )
    (uid,) = [e for e in agent(components)["env"] if e["name"] == "TESSERA_POD_UID"]
    assert uid["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert daemonset(components)["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }


NFD = {"feature.node.kubernetes.io/pci-10de.present": "true"}
NFD_DEFAULT = {"feature.node.kubernetes.io/pci-0302_10de.present": "true"}
NFD_VGA = {"feature.node.kubernetes.io/pci-0300_10de.present": "true"}
OPERATOR = {"nvidia.com/gpu.present": "true"}
NO_GPU = {"kubernetes.io/os": "linux", "feature.node.kubernetes.io/pci-10de.present": "false"}


def schedules_on(components: Sequence[str], labels: Mapping[str, str]) -> bool:
    """The DaemonSet's required node affinity against a node's labels (terms ORed, expressions
    ANDed; the In operator, the only one used)."""
    spec = pod(components)
    assert "nodeSelector" not in spec
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    for term in terms["nodeSelectorTerms"]:
        exprs = term["matchExpressions"]
        assert all(e["operator"] == "In" for e in exprs)
        if all(labels.get(e["key"]) in e["values"] for e in exprs):
            return True
    return False


def expect_nfd_node_selector(components: Sequence[str]) -> None:
    assert all(schedules_on(components, n) for n in (NFD, NFD_DEFAULT, NFD_VGA))
    assert not schedules_on(components, OPERATOR) and not schedules_on(components, NO_GPU)


def expect_gpu_operator_node_selector(components: Sequence[str]) -> None:
    assert schedules_on(components, OPERATOR)
    assert not any(schedules_on(components, n) for n in (NFD, NFD_DEFAULT, NO_GPU))


EXPECTED = {
    "container-driver": expect_container_driver,
    "dynamic-mig": expect_dynamic_mig,
    "time-slicing": expect_time_slicing,
    "memory-shares": expect_memory_shares,
    "device-taints": expect_device_taints,
    "rolling-update": expect_rolling_update,
    "nfd-node-selector": expect_nfd_node_selector,
    "passthrough": expect_passthrough,
    "vgpu": expect_vgpu,
    "gpu-operator-node-selector": expect_gpu_operator_node_selector,
}


@needs_kubectl
@pytest.mark.parametrize("components", [c for c in COMBINATIONS if c], ids=combo_id)
def test_each_component_does_what_it_says_alone_and_combined(components):
    for name in components:
        if name not in OWNED_ELSEWHERE:
            EXPECTED[name](components)


SHARING_ANNOTATION = "gpu.tessera.dev/sharing"
VIRTUALIZATION_ANNOTATION = "gpu.tessera.dev/virtualization"
MIG_MODE_ANNOTATION = "gpu.tessera.dev/mig-mode"
EXCLUSIVE = ("time-slicing", "memory-shares")
"""Components that each set the node's --sharing mode: one at most per rendering."""


@needs_kubectl
@pytest.mark.parametrize("components", COMBINATIONS, ids=combo_id)
def test_the_pod_template_names_the_sharing_mode_the_agent_runs(components):
    """The annotation the sharing components guard is the agent's --sharing (so that a pod
    shows its mode, and a change of mode rolls the pods)."""
    annotations = daemonset(components)["spec"]["template"]["metadata"]["annotations"]
    assert annotations[SHARING_ANNOTATION] == config(components).driver.sharing
    assert annotations[VIRTUALIZATION_ANNOTATION] == virtualization(components)
    # components/vgpu removes the MIG mode's annotation (its guard against dynamic MIG): static
    assert annotations.get(MIG_MODE_ANNOTATION, "static") == config(components).driver.mig_mode


@needs_kubectl
@pytest.mark.parametrize(
    "components",
    [
        EXCLUSIVE,
        EXCLUSIVE[::-1],
        ("dynamic-mig", EXCLUSIVE[1], "device-taints", EXCLUSIVE[0]),
    ],
    ids=combo_id,
)
def test_exclusive_sharing_components_do_not_render_together(components):
    """Two --sharing modes in one rendering fail, naming the component that came second,
    instead of the last one silently winning."""
    out = kustomize(components)
    assert out.returncode != 0, "rendered with two --sharing modes"
    second = [c for c in components if c in EXCLUSIVE][1]
    assert f"components/{second}" in out.stderr, out.stderr
    assert SHARING_ANNOTATION.replace("/", "~1") in out.stderr, out.stderr


EXCLUDED_PAIRS = [
    ("time-slicing", "memory-shares"),
    ("passthrough", "vgpu"),
    ("passthrough", "memory-shares"),
    ("passthrough", "time-slicing"),
    ("vgpu", "memory-shares"),
    ("vgpu", "time-slicing"),
    ("vgpu", "dynamic-mig"),
]
"""Components the agent refuses together (one --sharing, one --virtualization, no --sharing with
--virtualization, no vGPU with dynamic MIG): each pair fails to render in either order."""


@needs_kubectl
@pytest.mark.parametrize(
    "components",
    [pair for a, b in EXCLUDED_PAIRS for pair in ((a, b), (b, a))],
    ids=combo_id,
)
def test_components_the_agent_refuses_together_do_not_render_together(components):
    """The rendering fails naming the component that came second and the annotation it found
    taken, instead of producing a DaemonSet whose agents exit at start."""
    out = kustomize(components)
    assert out.returncode != 0, "rendered"
    assert f"components/{components[1]}" in out.stderr, out.stderr
    assert "testing value /spec/template/metadata/annotations/gpu.tessera.dev~1" in out.stderr


@needs_kubectl
def test_passthrough_goes_with_dynamic_mig_in_either_order():
    for components in (("passthrough", "dynamic-mig"), ("dynamic-mig", "passthrough")):
        assert kustomize(components).returncode == 0, components
        expect_passthrough(components)
        expect_dynamic_mig(components)


@needs_kubectl
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_component_changes_only_its_own_settings(name):
    """Alone, a component leaves every other setting as the base has it."""
    base, alone = config(), config((name,))
    own = {
        "container-driver": {"driver_root", "host_driver_root", "cdi_hook_path"},
        "dynamic-mig": {"mig_mode"},
        "time-slicing": {"sharing"},
        "memory-shares": {"sharing"},
        "device-taints": {"device_taints"},
        "rolling-update": {"rolling_update", "pod_uid"},
        "nfd-node-selector": set(),
        "gpu-operator-node-selector": set(),
        "passthrough": VIRTUALIZATION_SETTINGS,
        "vgpu": VIRTUALIZATION_SETTINGS,
    }[name]
    changed = {
        s.name
        for s in settings_of(Config)
        if getattr(getattr(base, s.section), s.name) != getattr(getattr(alone, s.section), s.name)
    }
    assert changed == own


@needs_kubectl
def test_the_base_is_a_host_driver_the_classic_update_and_every_gpu_node_label():
    expect_base(config())
    c = config()
    assert (c.node.driver_root, c.node.host_driver_root) == (Path("/host-root"), Path("/"))
    m = mount_of(c.node.driver_root)
    assert m is not None and m["volume"]["hostPath"]["path"] == "/"
    assert daemonset()["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    for labels in (NFD, NFD_DEFAULT, NFD_VGA, OPERATOR):
        assert schedules_on((), labels), labels
    assert not schedules_on((), NO_GPU)


@needs_kubectl
@pytest.mark.parametrize("components", COMBINATIONS, ids=combo_id)
def test_the_namespace_admits_the_pod_and_no_more(components):
    """Pod Security: hostPath volumes and privileged containers are outside baseline, so the
    namespace must enforce privileged exactly when the pod uses them (it does)."""
    (ns,) = [o for o in render(components) if o["kind"] == "Namespace"]
    labels = ns["metadata"]["labels"]
    spec = pod(components)
    needs_privileged = any("hostPath" in v for v in spec["volumes"]) or any(
        c.get("securityContext", {}).get("privileged") for c in spec["containers"]
    )
    assert needs_privileged
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert labels["pod-security.kubernetes.io/audit"] == "baseline"
    for key in ("hostPID", "hostNetwork", "hostIPC"):
        assert not spec.get(key), key


# -- every kustomization under deploy/ renders ---------------------------------------------------


KUSTOMIZATIONS = sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml"))


@needs_kubectl
@pytest.mark.parametrize("where", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_kustomization_under_deploy_renders_and_validates(where):
    """The base and the example overlays render themselves; a Component is rendered on the base
    in one of COMBINATIONS (each is validated there)."""
    kind = yaml.safe_load((where / "kustomization.yaml").read_text())["kind"]
    if kind == "Component":
        assert str(where.relative_to(COMPONENTS_DIR)) in {
            c for combo in COMBINATIONS for c in combo
        }
        return
    out = subprocess.run(
        [KUBECTL or "kubectl", "kustomize", str(where)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    for obj in validatable([d for d in yaml.safe_load_all(out.stdout) if d]):
        for version in VERSIONS:
            validate_k8s(dict(obj), version)


def test_the_mps_pods_run_the_agents_image_in_its_namespace():
    # an MPS claim's daemon Pod (dra_driver/cluster/mps_pods.py) is made in the namespace the
    # rbac.yaml Role grants, from the image the agent runs
    c = config()
    assert c.sharing.mps_pod_image == agent()["image"]
    assert c.sharing.mps_pod_namespace == "tessera-system"
