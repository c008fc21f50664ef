"""`tessera explain --kubeconfig`: the claim, classes, every node's slices and the allocated claims
read over HTTP from the API-server emulator; one answer per node."""

import io
import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.cli import main
from agent.cli.node_commands import published_slices
from agent.config import Config
from agent.sim.apiserver import ApiServer
from tests.k8sschema import VERSIONS, validate

ROOT = Path(__file__).resolve().parents[2]
CLASSES = ROOT / "deploy" / "daemonset" / "deviceclasses.yaml"
NODES = {"node-h100": "dgx-h100", "node-l40s": "l40s-pcie"}


def gpu_claim(name: str, count: int, uid: str | None = None) -> dict[str, Any]:
    meta = {"name": name, "namespace": "default"} | ({"uid": uid} if uid else {})
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": meta,
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpus",
                        "exactly": {"deviceClassName": "gpu.tessera.dev", "count": count},
                    }
                ]
            }
        },
    }


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[ApiServer, Path]]:
    """Two GPU nodes with our slices (a DGX H100 and an L40S server) and a CPU-only node."""
    with ApiServer() as server:
        for node, model in NODES.items():
            server.put_object(
                "nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}
            )
            for s in published_slices(Config.of(simulate=model, node_name=node)):
                server.put_object("resourceslices", s)
        server.put_object(
            "nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "cpu-1"}}
        )
        for c in yaml.safe_load_all(CLASSES.read_text()):
            server.put_object("deviceclasses", c)
        yield server, server.kubeconfig(tmp_path / "kubeconfig")


def explain(*argv: object) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["explain", *map(str, argv)], {}, out, err)
    return code, out.getvalue(), err.getvalue()


def test_each_node_is_answered_with_its_first_blocking_reason(
    cluster: tuple[ApiServer, Path], tmp_path: Path
) -> None:
    _server, kubeconfig = cluster
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(gpu_claim("six", 6)))
    code, out, err = explain(f, "--kubeconfig", kubeconfig, "-o", "json")
    assert code == 0, err
    answer = json.loads(out)
    assert answer["fittingNodes"] == ["node-h100"]
    by_node = {n["node"]: n for n in answer["nodes"]}
    assert set(by_node) == {"cpu-1", "node-h100", "node-l40s"}
    assert by_node["cpu-1"]["reason"] == "no ResourceSlice applies to this node"
    assert by_node["node-l40s"]["fits"] is False and by_node["node-l40s"]["reason"]
    (c,) = by_node["node-h100"]["claims"]
    assert {r["pool"] for r in c["allocation"]["devices"]["results"]} == {"node-h100"}
    code, text, _ = explain(f, "--kubeconfig", kubeconfig)
    assert code == 0
    assert text.splitlines()[0] == "claim default/six: fits on 1 of 3 nodes"


def test_a_claim_in_the_api_named_namespace_slash_name_and_allocated_claims_count(
    cluster: tuple[ApiServer, Path],
) -> None:
    server, kubeconfig = cluster
    server.put_object("resourceclaims", gpu_claim("four", 4))
    code, out, _ = explain("default/four", "--kubeconfig", kubeconfig, "-o", "json")
    assert code == 0
    assert json.loads(out)["fittingNodes"] == ["node-h100", "node-l40s"]
    # another claim holds every GPU of the L40S node: only the H100 node is left
    held = gpu_claim("held", 4, uid="5a0f9d0e-0000-4000-8000-000000000001")
    held["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {
                        "request": "gpus",
                        "driver": "gpu.tessera.dev",
                        "pool": "node-l40s",
                        "device": f"gpu-{i}",
                    }
                    for i in range(4)
                ]
            }
        }
    }
    server.put_object("resourceclaims", held)
    code, out, _ = explain("default/four", "--kubeconfig", kubeconfig, "-o", "json")
    assert code == 0
    assert json.loads(out)["fittingNodes"] == ["node-h100"]


def test_no_node_fits_exits_1(cluster: tuple[ApiServer, Path], tmp_path: Path) -> None:
    _server, kubeconfig = cluster
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(gpu_claim("sixteen", 16)))
    code, out, _ = explain(f, "--kubeconfig", kubeconfig)
    assert code == 1
    assert out.splitlines()[0] == "claim default/sixteen: fits on 0 of 3 nodes"


def test_a_pods_template_is_read_from_the_api(
    cluster: tuple[ApiServer, Path], tmp_path: Path
) -> None:
    server, kubeconfig = cluster
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "two", "namespace": "default"},
        "spec": {"spec": gpu_claim("x", 2)["spec"]},
    }
    server.put_object("resourceclaimtemplates", template)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "trainer", "namespace": "default"},
        "spec": {
            "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "two"}],
            "containers": [{"name": "c", "image": "busybox"}],
        },
    }
    f = tmp_path / "pod.yaml"
    f.write_text(yaml.safe_dump(pod))
    code, out, _ = explain(f, "--kubeconfig", kubeconfig, "-o", "json")
    assert code == 0
    answer = json.loads(out)
    assert answer["claims"][0]["claim"] == "default/trainer-gpus"
    assert answer["fittingNodes"] == ["node-h100", "node-l40s"]


def test_unknown_claim_and_write_are_refused_with_exit_2(cluster: tuple[ApiServer, Path]) -> None:
    _server, kubeconfig = cluster
    code, _, err = explain("default/nowhere", "--kubeconfig", kubeconfig)
    assert code == 2 and "no ResourceClaim default/nowhere in the API server" in err
    code, _, err = explain("default/nowhere", "--kubeconfig", kubeconfig, "--write")
    assert code == 2 and "--write is for standalone mode" in err


def test_look_alike_nodes_each_name_their_own_devices_and_a_uuid_selector_tells_them_apart(
    tmp_path: Path,
) -> None:
    """Three L40S servers differ only in names and GPU UUIDs: one is evaluated, the others get
    its answer renamed to their own devices; a claim selecting one UUID fits only its node."""
    names = ["l40s-a", "l40s-b", "l40s-c"]
    with ApiServer() as server:
        for node in names:
            server.put_object(
                "nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}
            )
            for s in published_slices(Config.of(simulate="l40s-pcie", node_name=node)):
                for d in s["spec"]["devices"]:
                    d["attributes"]["uuid"]["string"] += f"-{node}"
                server.put_object("resourceslices", s)
        for c in yaml.safe_load_all(CLASSES.read_text()):
            server.put_object("deviceclasses", c)
        kubeconfig = server.kubeconfig(tmp_path / "kubeconfig")
        f = tmp_path / "one.yaml"
        f.write_text(yaml.safe_dump(gpu_claim("one", 1)))
        code, out, err = explain(f, "--kubeconfig", kubeconfig, "-o", "json")
        assert code == 0, err
        answer = json.loads(out)
        assert answer["fittingNodes"] == names
        for node in answer["nodes"]:
            (c,) = node["claims"]
            (result,) = c["allocation"]["devices"]["results"]
            assert result["pool"] == node["node"]
            terms = c["allocation"]["nodeSelector"]["nodeSelectorTerms"]
            assert terms[0]["matchFields"][0]["values"] == [node["node"]]
            assert {p["pool"] for p in c["explanation"]["pools"]} == {node["node"]}
        uuid = server.objects("resourceslices")[1]["spec"]["devices"][0]["attributes"]["uuid"]
        picky = gpu_claim("picky", 1)
        expression = f'device.attributes["gpu.tessera.dev"].uuid == "{uuid["string"]}"'
        picky["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
            {"cel": {"expression": expression}}
        ]
        f.write_text(yaml.safe_dump(picky))
        code, out, err = explain(f, "--kubeconfig", kubeconfig, "-o", "json")
        assert code == 0, err
        assert json.loads(out)["fittingNodes"] == ["l40s-b"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_sees_how_many_slices_and_nodes_were_read_and_the_line_is_cleared(
    cluster: tuple[ApiServer, Path], tmp_path: Path
) -> None:
    _server, kubeconfig = cluster
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(gpu_claim("one", 1)))
    out, err = io.StringIO(), Terminal()
    code = main(["explain", str(f), "--kubeconfig", str(kubeconfig)], {}, out, err)
    assert code == 0
    shown = err.getvalue()
    assert "\r\x1b[2Kread " in shown and " ResourceSlices of 2 nodes" in shown
    assert shown.endswith("\r\x1b[2K")
    assert out.getvalue().splitlines()[0] == "claim default/one: fits on 2 of 3 nodes"


NO_CLIENT = """
import sys
from agent.cli import main
code = main(sys.argv[1:])
print("kubernetes imported" if "kubernetes" in sys.modules else "kubernetes not imported")
sys.exit(code)
"""


def test_a_kubeconfig_of_static_credentials_is_read_without_the_kubernetes_client(
    cluster: tuple[ApiServer, Path], tmp_path: Path
) -> None:
    """The kubernetes client's import alone would cost a third of the 64-node goal (issue 25)."""
    _server, kubeconfig = cluster
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(gpu_claim("one", 1)))
    run = subprocess.run(
        [sys.executable, "-c", NO_CLIENT, "explain", str(f), "--kubeconfig", str(kubeconfig)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "claim default/one: fits on 2 of 3 nodes"
    assert lines[-1] == "kubernetes not imported"


def test_a_kubeconfig_only_the_kubernetes_client_loads_still_works(
    cluster: tuple[ApiServer, Path], tmp_path: Path
) -> None:
    """Basic authentication is the kubernetes client's to load: explain goes through it."""
    _server, kubeconfig = cluster
    doc = yaml.safe_load(kubeconfig.read_text())
    doc["users"][0]["user"] = {"username": "admin", "password": "pw"}
    kubeconfig.write_text(yaml.safe_dump(doc))
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(gpu_claim("one", 1)))
    code, out, err = explain(f, "--kubeconfig", kubeconfig)
    assert code == 0, err
    assert out.splitlines()[0] == "claim default/one: fits on 2 of 3 nodes"


def test_a_pod_in_the_api_has_its_claims_allocated_together(
    cluster: tuple[ApiServer, Path],
) -> None:
    # pod/NAMESPACE/NAME: the Pod is read from the API, a template claim resolved to the claim
    # the controller made for it (pod.status.resourceClaimStatuses, resourceclaim.Name), and
    # its claims are allocated together (dynamicresources.go Filter)
    server, kubeconfig = cluster
    made = gpu_claim("trainer-b-x7k2p", 2)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "trainer", "namespace": "default"},
        "spec": {
            "resourceClaims": [
                {"name": "a", "resourceClaimName": "three"},
                {"name": "b", "resourceClaimTemplateName": "two"},
            ],
            "containers": [{"name": "c", "image": "busybox"}],
        },
        "status": {
            "resourceClaimStatuses": [{"name": "b", "resourceClaimName": made["metadata"]["name"]}]
        },
    }
    for obj, version in itertools.product((pod, made, gpu_claim("three", 3)), VERSIONS):
        validate(obj, version)
    server.put_object("pods", pod)
    server.put_object("resourceclaims", gpu_claim("three", 3))
    server.put_object("resourceclaims", made)
    code, out, err = explain("pod/default/trainer", "--kubeconfig", kubeconfig, "-o", "json")
    assert code == 0, err
    answer = json.loads(out)
    assert [c["claim"] for c in answer["claims"]] == ["default/three", "default/trainer-b-x7k2p"]
    assert answer["fittingNodes"] == ["node-h100"]
    l40s = next(n for n in answer["nodes"] if n["node"] == "node-l40s")
    assert l40s["blockedClaim"] == "default/trainer-b-x7k2p"
    assert l40s["reason"].startswith(
        "default/trainer-b-x7k2p: fits alone, but not beside default/three"
    )
    code, _, err = explain("pod/default/nobody", "--kubeconfig", kubeconfig)
    assert code == 2 and "no Pod default/nobody in the API server" in err
